"""Tasks by name: prompts, rewards, demonstrations and multi-turn environment steps.

`register_task` adds a task class from any module (the run's `imports` load the user's), so a
new task needs no edit here; `make_task` builds the run's task for its tokenizer.
"""

from __future__ import annotations

import dataclasses

from rl.tasks.arithmetic import ArithmeticTask
from rl.tasks.base import Problem, RewardResult
from rl.tasks.calculator import CalculatorTask
from rl.tasks.chat import ChatTask, TaskTokenError, chat_enabled
from rl.tasks.countdown import CountdownTask
from rl.tasks.dataset import DataError, DatasetTask
from rl.tasks.longtail import LongTailTask

TASKS: dict[str, type] = {}

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


def register_task(cls: type) -> type:
    """Class decorator: registers a task class under its `name` (see rl.tasks.base for what a
    task provides); a second class under a taken name is an error."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_task: {cls!r} needs a class attribute `name` (a string)")
    if TASKS.get(name, cls) is not cls:
        raise ValueError(f"register_task: task {name!r} is already {TASKS[name]!r}, not {cls!r}")
    TASKS[name] = cls
    return cls


for _cls in (ArithmeticTask, CountdownTask, CalculatorTask, LongTailTask, DatasetTask):
    register_task(_cls)


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
