"""A multi-turn tool task: compute a*b+c, optionally asking a calculator tool.

The model may end a turn with `<tool_call>EXPR</tool_call>`; the environment appends
`<tool_response>VALUE</tool_response>` (environment text: the agent masks it from the loss).
The final `<answer>N</answer>` is scored.
"""

from __future__ import annotations

import dataclasses
import random
from typing import ClassVar

from rl.tasks.arithmetic import operand_range
from rl.tasks.base import (
    ANSWER_CLOSE,
    ANSWER_OPEN,
    MAX_COMPLETION_CHARS,
    ZERO,
    Problem,
    RewardResult,
    check_common,
    extract_answer,
    extract_tagged,
    parse_int,
    register_task,
    sample_problems,
    score,
)
from rl.tasks.expr import DEFAULT_LIMITS, ExprError, evaluate, format_value, twin_key

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"


def tool_response(expression: str) -> str:
    """The calculator's reply to one expression: its exact value, or 'error: <kind>'."""
    try:
        body = format_value(evaluate(expression))
    except ExprError as e:
        body = f"error: {e.kind}"
    return f"{TOOL_RESPONSE_OPEN}{body}{TOOL_RESPONSE_CLOSE}"


@register_task
@dataclasses.dataclass(frozen=True)
class CalculatorTask:
    """a*b+c with operands of min_digits..max_digits digits; up to max_turns model turns."""

    min_digits: int = 2
    max_digits: int = 3
    max_turns: int = 3  # model turns: up to max_turns - 1 tool calls, then the answer
    seed: int = 0
    eval_fraction: float = 0.1
    format_reward: float = 0.1

    name: ClassVar[str] = "calculator"
    stop_texts: ClassVar[tuple[str, ...]] = (TOOL_CALL_CLOSE,)

    def __post_init__(self):
        check_common(self)
        if not 1 <= self.min_digits <= self.max_digits <= 9:
            raise ValueError(
                f"calculator: need 1 <= min_digits <= max_digits <= 9, "
                f"got {self.min_digits}, {self.max_digits}"
            )
        if not (isinstance(self.max_turns, int) and self.max_turns >= 1):
            raise ValueError(f"calculator: max_turns must be an int >= 1, got {self.max_turns!r}")

    def _number(self, rng: random.Random) -> int:
        return rng.randint(*operand_range(rng.randint(self.min_digits, self.max_digits)))

    def _draw(self, rng: random.Random) -> tuple[str, str, str, dict]:
        a, b, c = self._number(rng), self._number(rng), self._number(rng)
        expression = f"{a}*{b}+{c}"
        meta = {"a": a, "b": b, "c": c, "expression": expression}
        return twin_key(expression), expression + "=", str(a * b + c), meta

    def split_key(self, problem: Problem) -> str:
        """The problem's canonical key: a*b+c and b*a+c share one."""
        return twin_key(problem.meta["expression"])

    def problems(self, split: str, n: int) -> list[Problem]:
        """n problems of split ('train' | 'eval'); deterministic from the seed."""
        return sample_problems(self.name, self.seed, split, n, self.eval_fraction, self._draw)

    def env_step(self, problem: Problem, transcript: str) -> str | None:
        """The tool's response to a tool call ending the model's last turn, else None (over).

        transcript: everything after the prompt so far, ending with the model's latest turn.
        """
        if len(transcript) > MAX_COMPLETION_CHARS:
            return None
        if transcript.count(TOOL_RESPONSE_CLOSE) + 1 >= self.max_turns:
            return None  # that was the last model turn
        last_turn = transcript.rpartition(TOOL_RESPONSE_CLOSE)[2]
        if ANSWER_OPEN in last_turn:
            return None
        expression = extract_tagged(
            last_turn, TOOL_CALL_OPEN, TOOL_CALL_CLOSE, max_chars=DEFAULT_LIMITS.max_len
        )
        return None if expression is None else tool_response(expression)

    def reward(self, problem: Problem, completion: str) -> RewardResult:
        """1.0 for the right integer in a final <answer></answer>, format_reward for another."""
        content = extract_answer(completion)
        value = None if content is None else parse_int(content)
        if value is None:
            return ZERO
        return score(value == int(problem.answer), True, self.format_reward)

    def demonstration(self, problem: Problem) -> str:
        """One tool call with the whole expression, the tool's response, then the answer.

        With max_turns=1 (no room for a tool call) just the answer.
        """
        call = f"{TOOL_CALL_OPEN}{problem.meta['expression']}{TOOL_CALL_CLOSE}"
        observation = self.env_step(problem, call)
        answer = f"{ANSWER_OPEN}{problem.answer}{ANSWER_CLOSE}"
        return answer if observation is None else f"{call}{observation}{answer}"
