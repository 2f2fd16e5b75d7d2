"""Tasks by name: prompts, rewards, demonstrations and multi-turn environment steps."""

from __future__ import annotations

import dataclasses

from rl.tasks.arithmetic import ArithmeticTask
from rl.tasks.base import Problem, RewardResult
from rl.tasks.calculator import CalculatorTask
from rl.tasks.countdown import CountdownTask
from rl.tasks.longtail import LongTailTask

TASKS = {t.name: t for t in (ArithmeticTask, CountdownTask, CalculatorTask, LongTailTask)}

__all__ = [
    "TASKS",
    "ArithmeticTask",
    "CalculatorTask",
    "CountdownTask",
    "LongTailTask",
    "Problem",
    "RewardResult",
    "get_task",
]


def get_task(name: str, **kwargs):
    """A task by registry name with its options; unknown names or options are errors."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid: {sorted(TASKS)}")
    cls = TASKS[name]
    valid = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = sorted(set(kwargs) - set(valid))
    if unknown:
        raise ValueError(f"task {name!r} has no option(s) {unknown}; valid: {valid}")
    return cls(**kwargs)
