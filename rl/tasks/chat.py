"""A task as the run's tokenizer sees it: prompts rendered with the chat template (when the run
asks), the episode's end tokens, and the task's stop texts checked to be single tokens.

Every place that turns a problem into tokens (rollouts, the warm start, evaluation, the
learner's row length) reads `problem.prompt` from this wrapper, so a prompt is rendered once
and the same way everywhere.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from rl.config_rules import ConfigError
from rl.tasks.base import Problem


class TaskTokenError(ConfigError):
    """The task cannot run with this tokenizer (names the task, the text and the tokenizer)."""


def chat_enabled(mode: bool | str, tokenizer, *, preset: bool) -> bool:
    """Whether prompts are rendered with the chat template: task.chat true / false, or auto
    (when the tokenizer has a template, except the character tokenizer of presets)."""
    if mode is True:
        if tokenizer.chat_template is None:
            raise TaskTokenError(
                f"task.chat: true, but the tokenizer at {tokenizer.path} has no chat_template "
                "(tokenizer_config.json or chat_template.jinja); set task.chat: false"
            )
        return True
    return mode == "auto" and not preset and tokenizer.chat_template is not None


@dataclasses.dataclass
class ChatTask:
    """`task` with its prompts rendered for `tokenizer` (chat: as one user message after an
    optional system prompt, or the row's own messages)."""

    task: Any
    tokenizer: Any
    chat: bool = False
    system_prompt: str = ""
    _rendered: dict = dataclasses.field(default_factory=dict, init=False, repr=False)
    _lock: Any = dataclasses.field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self):
        if self.chat:
            self.tokenizer = self.tokenizer.with_turn_end()
        for text in getattr(self.task, "stop_texts", ()):
            ids = self.tokenizer.encode(text)
            if len(ids) != 1:
                raise TaskTokenError(
                    f"task {self.task.name!r} ends a turn on {text!r}, which the tokenizer at "
                    f"{self.tokenizer.path} encodes as {len(ids)} tokens {ids}; it needs a "
                    "tokenizer where that text is one token"
                )

    def __getstate__(self):  # a copy sent to another process renders for itself
        return {k: v for k, v in self.__dict__.items() if k not in ("_rendered", "_lock")}

    def __setstate__(self, state):
        self.__dict__.update(state, _rendered={}, _lock=threading.Lock())

    def __getattr__(self, name: str):
        if name == "task":  # not set yet (copy, unpickle)
            raise AttributeError(name)
        return getattr(self.task, name)

    def render(self, problem: Problem) -> Problem:
        """The problem with its prompt as the model sees it."""
        messages = problem.meta.get("messages")
        if not self.chat:
            if messages is not None:
                raise TaskTokenError(
                    f"{problem.meta.get('row', problem.id)}: the prompt is a list of chat "
                    "messages, which needs the chat template: set task.chat: true or auto"
                )
            return problem
        if messages is None:
            messages = ({"role": "user", "content": problem.prompt},)
        if self.system_prompt and messages[0]["role"] != "system":
            messages = ({"role": "system", "content": self.system_prompt}, *messages)
        text = self.tokenizer.render_chat(list(messages), add_generation_prompt=True)
        return dataclasses.replace(problem, prompt=text)

    def problems(self, split: str, n: int) -> list[Problem]:
        """The task's problems, rendered. Task lists are prefix-stable, so each problem is
        rendered once: a longer list renders only its new tail."""
        with self._lock:  # the dispatcher's threads ask concurrently
            done = self._rendered.setdefault(split, [])
            if len(done) < n:
                raw = self.task.problems(split, n)
                done.extend([self.render(p) for p in raw[len(done) :]])
            return done[:n]

    def stats(self) -> dict:
        """The task's own counters (a data task's reward failures), if it keeps any."""
        stats = getattr(self.task, "stats", None)
        return stats() if stats is not None else {}

    def close(self) -> None:
        """Releases what the task holds (a data task's reward workers)."""
        close = getattr(self.task, "close", None)
        if close is not None:
            close()
