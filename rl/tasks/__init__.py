"""Tasks by name: prompts, rewards, demonstrations and multi-turn environment steps.

`register_task` (rl/tasks/base.py) adds a task class from any module: each built-in task's module
registers its own, and the run's `imports` load the user's, so a new task needs no edit here;
the config's task.name is checked against the registry. `make_task` builds the run's task for
its tokenizer.
"""

from __future__ import annotations

import dataclasses

from rl.tasks.arithmetic import ArithmeticTask
from rl.tasks.base import TASKS, Problem, RewardResult, register_task
from rl.tasks.calculator import CalculatorTask
from rl.tasks.chat import ChatTask, TaskTokenError, chat_enabled
from rl.tasks.countdown import CountdownTask
from rl.tasks.dataset import DataError, DatasetTask
from rl.tasks.longtail import LongTailTask

__all__ = [
    "TASKS",
    "ArithmeticTask",
    "CalculatorTask",
    "ChatTask",
    "CountdownTask",
    "DataError",
    "DatasetTask",
    "LongTailTask",
    "Problem",
    "RewardResult",
    "TaskTokenError",
    "get_task",
    "make_task",
    "register_task",
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


def make_task(task_cfg, tokenizer, *, preset: bool, imports=()) -> ChatTask:
    """The run's task (cfg.task) for `tokenizer`: its options, prompts rendered with the chat
    template when task.chat says so, stop texts checked. A data task gets the run's imports
    (its reward workers load them)."""
    options = dict(task_cfg.options)
    if task_cfg.name == DatasetTask.name:
        options.setdefault("imports", tuple(imports))
    task = get_task(task_cfg.name, seed=task_cfg.seed, **options)
    chat = chat_enabled(task_cfg.chat, tokenizer, preset=preset)
    return ChatTask(task, tokenizer, chat=chat, system_prompt=task_cfg.system_prompt)
