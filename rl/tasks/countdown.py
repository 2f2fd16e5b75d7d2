"""Countdown (TinyZero rules): reach the target with the given numbers, each used at most once."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from typing import ClassVar

from rl.tasks.base import (
    ANSWER_CLOSE,
    ANSWER_OPEN,
    ZERO,
    Problem,
    RewardResult,
    as_tuple,
    check_common,
    extract_answer,
    register_task,
    sample_problems,
    score,
)
from rl.tasks.expr import ExprError, evaluate_with_numbers

PROMPT_STYLES = ("compact", "tinyzero")
_PREC = {"+": 1, "-": 1, "*": 2, "/": 2}


def _apply(op: str, a: int, b: int) -> int | None:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    return None if b == 0 or a % b != 0 else a // b  # exact integer division only


def random_expression(rng: random.Random, numbers: list[int]) -> tuple[str, int, int] | None:
    """A random expression using every number once: (text, value, precedence), or None.

    Intermediate values are integers (division only when exact); parentheses are minimal.
    """
    if len(numbers) == 1:
        return str(numbers[0]), numbers[0], 3
    cut = rng.randint(1, len(numbers) - 1)
    left = random_expression(rng, numbers[:cut])
    right = random_expression(rng, numbers[cut:])
    if left is None or right is None:
        return None
    op = rng.choice("+-*/")
    value = _apply(op, left[1], right[1])
    if value is None:
        return None
    p = _PREC[op]
    lt = f"({left[0]})" if left[2] < p else left[0]
    rt = f"({right[0]})" if right[2] < p or (right[2] == p and op in "-/") else right[0]
    return f"{lt}{op}{rt}", value, p


def _key(meta: dict) -> str:
    return f"{sorted(meta['numbers'])}->{meta['target']}"


@register_task
@dataclasses.dataclass(frozen=True)
class CountdownTask:
    """Given 3-4 numbers and a target, write an equation with + - * / ( ) equal to the target."""

    counts: tuple[int, ...] = (3, 4)  # how many numbers, drawn uniformly
    min_number: int = 1
    max_number: int = 99
    min_target: int = 1
    max_target: int = 100
    use_all: bool = False  # False: each number at most once (TinyZero's data uses all of them)
    prompt_style: str = "compact"  # "compact": "[19,36,55,7]->65:"; "tinyzero": the sentence
    seed: int = 0
    eval_fraction: float = 0.1
    format_reward: float = 0.1

    name: ClassVar[str] = "countdown"
    max_turns: ClassVar[int] = 1
    stop_texts: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self):
        as_tuple(self, "counts")
        check_common(self)
        if not self.counts or any(not isinstance(c, int) or not 2 <= c <= 6 for c in self.counts):
            raise ValueError(f"countdown: counts must be ints in 2..6, got {self.counts!r}")
        if not 1 <= self.min_number <= self.max_number <= 10**6:
            raise ValueError(
                f"countdown: need 1 <= min_number <= max_number <= 1e6, "
                f"got {self.min_number}, {self.max_number}"
            )
        if not self.min_target <= self.max_target:
            raise ValueError(
                f"countdown: min_target {self.min_target} > max_target {self.max_target}"
            )
        if self.prompt_style not in PROMPT_STYLES:
            raise ValueError(
                f"countdown: prompt_style {self.prompt_style!r} not in {PROMPT_STYLES}"
            )

    def prompt(self, numbers: list[int], target: int) -> str:
        """The prompt text for numbers and target."""
        if self.prompt_style == "compact":
            return f"[{','.join(map(str, numbers))}]->{target}:"
        rule = "each number must be used once" if self.use_all else "each number at most once"
        return (
            f"Using the numbers {numbers}, create an equation that equals {target}. You can use "
            f"basic arithmetic operations (+, -, *, /) and {rule}. Return the final answer in "
            "<answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>.\n"
        )

    def _draw(self, rng: random.Random) -> tuple[str, str, str, dict]:
        for _ in range(10_000):
            numbers = [
                rng.randint(self.min_number, self.max_number)
                for _ in range(rng.choice(self.counts))
            ]
            order = rng.sample(numbers, len(numbers))
            for _ in range(20):
                expr = random_expression(rng, order)
                if expr is None:
                    continue
                text, value, _ = expr
                if self.min_target <= value <= self.max_target:
                    target = value
                    meta = {"numbers": tuple(numbers), "target": target}
                    return _key(meta), self.prompt(numbers, target), text, meta
        raise ValueError(
            f"countdown: no instance with a target in [{self.min_target}, {self.max_target}] "
            f"from numbers in [{self.min_number}, {self.max_number}]; widen the target range"
        )

    def problems(self, split: str, n: int) -> list[Problem]:
        """n solvable instances of split ('train' | 'eval'); answer = a reference solution."""
        return sample_problems(self.name, self.seed, split, n, self.eval_fraction, self._draw)

    def split_key(self, problem: Problem) -> str:
        """The problem's canonical key: its number multiset and target (the order is no twin)."""
        return _key(problem.meta)

    def reward(self, problem: Problem, completion: str) -> RewardResult:
        """1.0 for an equation equal to the target using only the given numbers (each at most
        once, or exactly once with use_all); format_reward for a legal equation off target."""
        content = extract_answer(completion)
        if content is None:
            return ZERO
        try:
            value, used = evaluate_with_numbers(content)
        except ExprError:
            return ZERO
        given, used_count = Counter(problem.meta["numbers"]), Counter(used)
        legal = used_count == given if self.use_all else not (used_count - given)
        if not legal:
            return ZERO
        return score(value == problem.meta["target"], True, self.format_reward)

    def demonstration(self, problem: Problem) -> str:
        """The reference solution in answer tags (eos not included)."""
        return f"{ANSWER_OPEN}{problem.answer}{ANSWER_CLOSE}"

    def env_step(self, problem: Problem, transcript: str) -> str | None:
        """Single turn: the episode ends after the model's first turn."""
        return None
