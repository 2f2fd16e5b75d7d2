"""Multi-digit integer arithmetic: prompt "12+34=", completion "<answer>46</answer>"."""

from __future__ import annotations

import dataclasses
import random
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
    extract_first_answer,
    parse_int,
    register_task,
    sample_problems,
    score,
    unit_hash,
)
from rl.tasks.expr import twin_key

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def pareto_budget_at(u: float, alpha: float, lo: int, hi: int) -> int:
    """round(lo * Pareto(alpha)) at uniform u in [0, 1) (the inverse CDF, as
    random.paretovariate draws it), clipped to [lo, hi]: most near lo, a heavy tail to hi."""
    return int(min(hi, max(lo, round(lo * (1.0 - u) ** (-1.0 / alpha)))))


def operand_range(digits: int) -> tuple[int, int]:
    """Inclusive range of numbers with exactly `digits` digits (1 digit: 0..9)."""
    return (0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


@register_task
@dataclasses.dataclass(frozen=True)
class ArithmeticTask:
    """a OP b with `digits`-digit operands, OP drawn uniformly from `ops`."""

    digits: int = 2
    ops: tuple[str, ...] = ("+",)
    seed: int = 0
    eval_fraction: float = 0.1
    format_reward: float = 0.1
    # The answer's digits least significant first ("12+34=" -> "<answer>64</answer>"; a sign
    # stays in front): each digit then follows from digits already seen, the order in which
    # small transformers learn addition far faster (Lee et al. 2023).
    reverse_digits: bool = False
    # Partial credit for a wrong, well-formed answer: this much times the fraction of the answer's
    # digits written right (position by position, in the written order), on top of format_reward.
    digit_credit: float = 0.0
    # A sloppy demonstrator: this fraction of the demonstrations (fixed per problem id) write
    # the first answer digit one too high (9 -> 0). Above one half, a model that imitates it
    # answers wrong greedily while sampling the right answer often: what RL can correct.
    demo_error: float = 0.0
    # Long-tailed generation: with budget_min > 0 every sample of a problem runs to that
    # problem's own token budget, round(budget_min * Pareto(budget_alpha)) clipped to
    # [budget_min, budget_max] (eos ignored, as a few long answers stall a synchronous step);
    # the reward reads the completion's first answer, whatever the budget's rest holds.
    budget_min: int = 0
    budget_max: int = 128
    budget_alpha: float = 1.2

    name: ClassVar[str] = "arithmetic"
    max_turns: ClassVar[int] = 1
    stop_texts: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self):
        as_tuple(self, "ops")
        check_common(self)
        if not (isinstance(self.digits, int) and 1 <= self.digits <= 9):
            raise ValueError(f"arithmetic: digits must be an int in 1..9, got {self.digits!r}")
        if not (isinstance(self.digit_credit, (int, float)) and 0 <= self.digit_credit < 1):
            raise ValueError(
                f"arithmetic: digit_credit must be a number in [0, 1), got {self.digit_credit!r}"
            )
        if not (isinstance(self.demo_error, (int, float)) and 0 <= self.demo_error <= 1):
            raise ValueError(
                f"arithmetic: demo_error must be a number in [0, 1], got {self.demo_error!r}"
            )
        if not (
            isinstance(self.budget_min, int)
            and isinstance(self.budget_max, int)
            and (self.budget_min == 0 or 1 <= self.budget_min <= self.budget_max)
        ):
            raise ValueError(
                f"arithmetic: need budget_min 0 (off) or 1 <= budget_min <= budget_max, got "
                f"budget_min={self.budget_min!r}, budget_max={self.budget_max!r}"
            )
        if not (isinstance(self.budget_alpha, (int, float)) and self.budget_alpha > 0):
            raise ValueError(f"arithmetic: budget_alpha must be > 0, got {self.budget_alpha!r}")
        bad = [op for op in self.ops if op not in OPS]
        if not self.ops or bad:
            raise ValueError(f"arithmetic: ops {self.ops!r} invalid; choose from {tuple(OPS)}")

    def _draw(self, rng: random.Random) -> tuple[str, str, str, dict]:
        lo, hi = operand_range(self.digits)
        op = rng.choice(self.ops)
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        meta = {"a": a, "b": b, "op": op}
        if self.budget_min:  # from the problem's own hash: the problems stay those without
            u = unit_hash(f"{self.seed}:budget:{a}{op}{b}")
            budget = pareto_budget_at(u, self.budget_alpha, self.budget_min, self.budget_max)
            meta.update(max_new_tokens=budget, ignore_eos=True)
        return _key(meta), f"{a}{op}{b}=", str(OPS[op](a, b)), meta

    def split_key(self, problem: Problem) -> str:
        """The problem's canonical key: a+b, b+a, a*b, b*a share one, as do a-b and b-a."""
        return _key(problem.meta)

    def problems(self, split: str, n: int) -> list[Problem]:
        """n problems of split ('train' | 'eval'); deterministic from the seed."""
        return sample_problems(self.name, self.seed, split, n, self.eval_fraction, self._draw)

    def reward(self, problem: Problem, completion: str) -> RewardResult:
        """1.0 for the right integer in <answer></answer>, format_reward for another integer."""
        first = extract_first_answer if self.budget_min else extract_answer
        content = first(completion)
        if content is not None and self.reverse_digits:  # only a well-formed integer turns
            content = _reverse_digits(content.strip()) if parse_int(content) is not None else None
        value = None if content is None else parse_int(content)
        if value is None:
            return ZERO
        got = score(value == int(problem.answer), True, self.format_reward)
        if got.correct or not self.digit_credit:
            return got
        written = first(completion).strip()
        want = self.demonstration_answer(problem.answer)
        right = sum(a == b for a, b in zip(written, want)) / max(len(written), len(want))
        return dataclasses.replace(got, reward=got.reward + self.digit_credit * right)

    def demonstration_answer(self, answer: str) -> str:
        """An answer as the model writes it (digits reversed with reverse_digits)."""
        return _reverse_digits(answer) if self.reverse_digits else answer

    def demonstration(self, problem: Problem) -> str:
        """The completion the demonstrator writes (eos not included): the correct one, or with
        demo_error its first digit one too high for that fraction of problem ids."""
        answer = self.demonstration_answer(problem.answer)
        if self.demo_error and unit_hash(f"{self.seed}:{problem.id}") < self.demo_error:
            i = 1 if answer[0] in "+-" else 0
            answer = answer[:i] + str((int(answer[i]) + 1) % 10) + answer[i + 1 :]
        return f"{ANSWER_OPEN}{answer}{ANSWER_CLOSE}"

    def env_step(self, problem: Problem, transcript: str) -> str | None:
        """Single turn: the episode ends after the model's first turn."""
        return None


def _key(meta: dict) -> str:
    return twin_key(f"{meta['a']}{meta['op']}{meta['b']}")


def _reverse_digits(text: str) -> str:
    """'-123' <-> '-321': the digits reversed, a leading sign kept in front (an involution)."""
    sign = text[:1] if text[:1] in "+-" else ""
    return sign + text[len(sign) :][::-1]
