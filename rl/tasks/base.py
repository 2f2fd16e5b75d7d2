"""What every task shares: Problem, RewardResult, answer-tag parsing, deterministic splits.

A task is a plain (frozen dataclass) object with:
  name: str; max_turns: int (1 = single turn); stop_texts: tuple[str, ...] (texts, each one token
  of the task tokenizer, that end a model turn besides eos);
  problems(split, n) -> list[Problem]   deterministic from the task seed, prefix-stable;
  split_key(problem) -> str             the canonical key that decides the problem's split:
                                        trivial twins (12+34 and 34+12) share it;
  reward(problem, completion) -> RewardResult;
  demonstration(problem) -> str         a correct completion (env observations included);
  env_step(problem, transcript) -> str | None   multi-turn: observation text to append, or
                                                None when the episode is over.
`completion` / `transcript` is everything after the prompt: model turns and env observations,
as text (decode with skip_special=True, or leave trailing eos/end markers: they are ignored).
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import re
from collections.abc import Callable

ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
# Text that may trail a final answer (a decoded eos / chat end marker) and still count.
END_MARKERS = ("<eos>", "<|im_end|>", "<|endoftext|>", "<pad>")
# Completions longer than this score 0 without being parsed.
MAX_COMPLETION_CHARS = 1 << 17
MAX_ANSWER_CHARS = 200
SPLITS = ("train", "eval")
_INT_RE = re.compile(r"-?[0-9]{1,60}")  # ASCII digits only (str.isdigit accepts other scripts)

TASKS: dict[str, type] = {}  # name -> task class: task.name is valid once its class registers


def register_task(cls: type) -> type:
    """Class decorator: registers a task class under its `name` (see above for what a task
    provides); a second class under a taken name is an error."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_task: {cls!r} needs a class attribute `name` (a string)")
    if TASKS.get(name, cls) is not cls:
        raise ValueError(f"register_task: task {name!r} is already {TASKS[name]!r}, not {cls!r}")
    TASKS[name] = cls
    return cls


@dataclasses.dataclass(frozen=True)
class Problem:
    """One task instance: the prompt text, a reference answer (tag content) and task data."""

    id: str
    prompt: str
    answer: str
    meta: dict = dataclasses.field(default_factory=dict, hash=False, compare=True)


@dataclasses.dataclass(frozen=True)
class RewardResult:
    """A scored completion: reward, whether it is correct, whether it is a well-formed attempt."""

    reward: float
    correct: bool
    formatted: bool


ZERO = RewardResult(reward=0.0, correct=False, formatted=False)


def strip_end_markers(text: str) -> str:
    """Text without trailing whitespace and trailing end markers (eos, im_end, pad)."""
    end = len(text)
    while True:  # linear: indices move left, nothing is copied until the end
        new_end = end
        while new_end > 0 and text[new_end - 1].isspace():
            new_end -= 1
        for marker in END_MARKERS:
            if text.endswith(marker, 0, new_end):
                new_end -= len(marker)
                break
        if new_end == end:
            return text[:end]
        end = new_end


def extract_tagged(text: str, open_tag: str, close_tag: str, max_chars: int) -> str | None:
    """Content of the single final `open...close` pair ending the text, else None.

    Exactly one open and one close tag, in order, nothing but end markers after the close tag,
    content at most max_chars long.
    """
    if len(text) > MAX_COMPLETION_CHARS:
        return None
    text = strip_end_markers(text)
    if not text.endswith(close_tag) or text.count(close_tag) != 1 or text.count(open_tag) != 1:
        return None
    start, stop = text.index(open_tag) + len(open_tag), len(text) - len(close_tag)
    if start > stop or stop - start > max_chars:
        return None
    return text[start:stop]


def extract_answer(completion: str) -> str | None:
    """Content of the one `<answer>...</answer>` that ends the completion, else None."""
    if not isinstance(completion, str):
        return None
    return extract_tagged(completion, ANSWER_OPEN, ANSWER_CLOSE, MAX_ANSWER_CHARS)


def extract_first_answer(completion: str) -> str | None:
    """Content of the first `<answer>...</answer>` of the completion, whatever follows it (a
    generation that runs on to a fixed budget past its answer), else None."""
    if not isinstance(completion, str) or len(completion) > MAX_COMPLETION_CHARS:
        return None
    start = completion.find(ANSWER_OPEN)
    if start < 0:
        return None
    start += len(ANSWER_OPEN)
    stop = completion.find(ANSWER_CLOSE, start)
    if stop < 0 or stop - start > MAX_ANSWER_CHARS:
        return None
    return completion[start:stop]


def parse_int(text: str) -> int | None:
    """An ASCII integer ('-12', surrounding spaces allowed), else None."""
    text = text.strip()
    return int(text) if _INT_RE.fullmatch(text) else None


def score(correct: bool, formatted: bool, format_reward: float) -> RewardResult:
    """RewardResult with reward 1.0 if correct, format_reward if only formatted, else 0."""
    reward = 1.0 if correct else (format_reward if formatted else 0.0)
    return RewardResult(reward=reward, correct=correct, formatted=formatted or correct)


def unit_hash(text: str) -> float:
    """A stable uniform number in [0, 1) of a string (the same on every host and run)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2.0**64


def in_split(key: str, split: str, eval_fraction: float) -> bool:
    """Whether a problem (by its content key) belongs to split; a fixed hash partition."""
    return (unit_hash(key) < eval_fraction) == (split == "eval")


def sample_problems(
    task_name: str,
    seed: int,
    split: str,
    n: int,
    eval_fraction: float,
    draw: Callable[[random.Random], tuple[str, str, str, dict]],
    max_draws: int | None = None,
) -> list[Problem]:
    """n problems of split, drawn from one seeded stream; eval problems are distinct.

    `draw(rng) -> (key, prompt, answer, meta)`; key is the problem's canonical key (shared by
    its trivial twins) for the split partition, so train and eval never share a problem or a
    twin of one, and eval holds no two twins. The list for n is a prefix of the
    list for any larger n. Train problems may repeat (an i.i.d. stream).
    """
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not valid; choose one of {SPLITS}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(f"{task_name}:{seed}:{split}")
    max_draws = max_draws if max_draws is not None else 1000 + 200 * n
    out: list[Problem] = []
    seen: set[str] = set()
    draws = 0
    while len(out) < n:
        draws += 1
        if draws > max_draws:
            raise ValueError(
                f"found only {len(out)} distinct {split} problems of {task_name} in {max_draws} "
                f"draws (n={n}); the {split} split is smaller; ask for fewer or widen the task"
            )
        key, prompt, answer, meta = draw(rng)
        if not in_split(key, split, eval_fraction):
            continue
        if split == "eval":
            if key in seen:
                continue
            seen.add(key)
        out.append(
            Problem(id=f"{task_name}-{split}-{len(out)}", prompt=prompt, answer=answer, meta=meta)
        )
    return out


def check_common(task) -> None:
    """Validates the fields every task has: seed, eval_fraction, format_reward."""
    if not isinstance(task.seed, int):
        raise ValueError(f"{task.name}: seed must be an int, got {task.seed!r}")
    if not 0.0 < task.eval_fraction < 1.0:
        raise ValueError(f"{task.name}: eval_fraction must be in (0, 1), got {task.eval_fraction}")
    if not 0.0 <= task.format_reward < 1.0:
        raise ValueError(f"{task.name}: format_reward must be in [0, 1), got {task.format_reward}")


def as_tuple(task, field: str) -> None:
    """Stores a list-valued field (e.g. from YAML) of a frozen task as a tuple."""
    value = getattr(task, field)
    if isinstance(value, list):
        object.__setattr__(task, field, tuple(value))
