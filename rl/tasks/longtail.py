"""A synthetic long-tailed workload for throughput benchmarks (not a skill to learn).

Prompts look like the arithmetic ones ("12+34="). Each problem carries its own generation
budget, drawn from a Pareto distribution (seeded, scaled by min_tokens, clipped to
[min_tokens, max_tokens]), in meta["max_new_tokens"], and meta["ignore_eos"] = True: the agent
generates exactly that many tokens (capped by rollout.max_new_tokens), so a batch's length is
set by its longest budget, as in real RL where a few long answers stall a synchronous step.
The reward is cheap, deterministic and varies inside a group: the fraction of the generated
digits that are even (0 when there is none), so GRPO groups are rarely filtered.
"""

from __future__ import annotations

import dataclasses
import random
from typing import ClassVar

from rl.tasks.arithmetic import operand_range, pareto_budget_at
from rl.tasks.base import Problem, RewardResult, check_common, register_task, sample_problems
from rl.tasks.expr import twin_key


def pareto_budget(rng: random.Random, alpha: float, lo: int, hi: int) -> int:
    """round(lo * Pareto(alpha)) clipped to [lo, hi]: most budgets near lo, a heavy tail to hi."""
    return pareto_budget_at(rng.random(), alpha, lo, hi)  # one draw, as paretovariate


@register_task
@dataclasses.dataclass(frozen=True)
class LongTailTask:
    """'a+b=' prompts with per-problem Pareto(alpha) generation budgets in [min, max] tokens."""

    min_tokens: int = 16
    max_tokens: int = 128
    alpha: float = 1.2
    digits: int = 2
    seed: int = 0
    eval_fraction: float = 0.1
    format_reward: float = 0.0

    name: ClassVar[str] = "longtail"
    max_turns: ClassVar[int] = 1
    stop_texts: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self):
        check_common(self)
        if not (isinstance(self.min_tokens, int) and 1 <= self.min_tokens <= self.max_tokens):
            raise ValueError(
                f"longtail: need 1 <= min_tokens <= max_tokens, got min_tokens={self.min_tokens!r}"
                f", max_tokens={self.max_tokens!r}"
            )
        if not self.alpha > 0:
            raise ValueError(f"longtail: alpha must be > 0, got {self.alpha!r}")
        if not (isinstance(self.digits, int) and 1 <= self.digits <= 9):
            raise ValueError(f"longtail: digits must be an int in 1..9, got {self.digits!r}")

    def _draw(self, rng: random.Random) -> tuple[str, str, str, dict]:
        lo, hi = operand_range(self.digits)
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        budget = pareto_budget(rng, self.alpha, self.min_tokens, self.max_tokens)
        meta = {"a": a, "b": b, "max_new_tokens": budget, "ignore_eos": True}
        return twin_key(f"{a}+{b}"), f"{a}+{b}=", str(a + b), meta

    def split_key(self, problem: Problem) -> str:
        """The problem's canonical key: a+b and b+a share one (budgets aside)."""
        return twin_key(f"{problem.meta['a']}+{problem.meta['b']}")

    def problems(self, split: str, n: int) -> list[Problem]:
        """n problems of split ('train' | 'eval'); deterministic from the seed."""
        return sample_problems(self.name, self.seed, split, n, self.eval_fraction, self._draw)

    def reward(self, problem: Problem, completion: str) -> RewardResult:
        """Fraction of the completion's ASCII digits that are even (0.0 without digits)."""
        digits = [c for c in completion if "0" <= c <= "9"]
        if not digits:
            return RewardResult(reward=0.0, correct=False, formatted=False)
        frac = sum(c in "02468" for c in digits) / len(digits)
        return RewardResult(reward=frac, correct=frac >= 0.5, formatted=True)

    def demonstration(self, problem: Problem) -> str:
        """A completion of the problem's budget made of even digits (reward 1)."""
        return ("2468" * problem.meta["max_new_tokens"])[: problem.meta["max_new_tokens"]]

    def env_step(self, problem: Problem, transcript: str) -> str | None:
        """Single turn."""
        return None
