"""The built-in rewards (exact, numeric, math, format) and the final-answer extractor they share."""

from __future__ import annotations

import functools
import logging
import math
import re

from rl.rewards.registry import register_reward
from rl.tasks.base import ANSWER_CLOSE, ANSWER_OPEN, MAX_COMPLETION_CHARS, strip_end_markers

BOXED = "\\boxed{"
HASHES = "####"
_BRACE_RE = re.compile(r"[{}]")
_NUMBER_RE = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
# Text that already holds a LaTeX environment Math-Verify finds by itself.
_LATEX_ENVS = ("$", "\\(", "\\[", "\\boxed")


def _braced(text: str, start: int, stop: int) -> str | None:
    """The text from start up to the brace closing an already open one, if before stop."""
    depth = 1
    for match in _BRACE_RE.finditer(text, start, stop):
        depth += 1 if match.group() == "{" else -1
        if depth == 0:
            return text[start : match.start()]
    return None


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` with balanced braces, else None."""
    stop = len(text)
    start = text.rfind(BOXED)
    while start != -1:
        # An earlier box that has not closed where a later unclosed one opens never closes.
        content = _braced(text, start + len(BOXED), stop)
        if content is not None:
            return content
        stop = start
        start = text.rfind(BOXED, 0, start)
    return None


def after_hashes(text: str) -> str | None:
    """The first line of the text after the last `####` (GSM8K's answer form), else None."""
    at = text.rfind(HASHES)
    if at == -1:
        return None
    rest = text[at + len(HASHES) :].strip()
    return rest.split("\n", 1)[0].strip() or None


def final_answer(text: str) -> str | None:
    """The final answer: last `\\boxed{}`, else after the last `####`, else a final `<answer>`.

    None when there is none, or the text is over MAX_COMPLETION_CHARS (not searched).
    """
    if not isinstance(text, str) or len(text) > MAX_COMPLETION_CHARS:
        return None
    text = strip_end_markers(text)
    boxed = last_boxed(text)
    if boxed is not None and boxed.strip():
        return boxed.strip()
    hashed = after_hashes(text)
    if hashed is not None:
        return hashed
    if text.endswith(ANSWER_CLOSE):
        at = text.rfind(ANSWER_OPEN)
        content = text[at + len(ANSWER_OPEN) : -len(ANSWER_CLOSE)].strip() if at != -1 else ""
        return content or None
    return None


def normalise_space(text: str) -> str:
    """Text with runs of whitespace as one space, none at the ends."""
    return " ".join(text.split())


@register_reward("exact")
def exact_reward(completion: str, answer: str) -> float:
    """1.0 if the final answer equals the answer up to whitespace, else 0.0."""
    found = final_answer(completion)
    return float(found is not None and normalise_space(found) == normalise_space(str(answer)))


def parse_number(text: str) -> float | None:
    """A finite number from text like '$1,234.5', '12%', '7.' (commas, $, % dropped), else None."""
    text = text.replace("\\$", "").replace("\\%", "")
    text = text.replace(",", "").replace("$", "").replace("%", "").strip()
    text = text.removesuffix(".").strip()
    if not _NUMBER_RE.fullmatch(text):
        return None
    value = float(text)
    return value if math.isfinite(value) else None


@register_reward("numeric")
def numeric_reward(completion: str, answer: str) -> float:
    """1.0 if the final answer and the answer are equal numbers (relative 1e-6, absolute 1e-9)."""
    found = final_answer(completion)
    got = parse_number(found) if found is not None else None
    want = parse_number(str(answer))
    if got is None or want is None:
        return 0.0
    return float(math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9))


def _parse_math(text: str) -> list:
    """Math-Verify's parse of an answer text: as LaTeX math (wrapped in $...$) unless it holds
    a LaTeX environment already, then as Math-Verify's default extraction if that finds none."""
    from math_verify import parse

    wrapped = text if any(env in text for env in _LATEX_ENVS) else f"${text}$"
    return parse(wrapped, parsing_timeout=None) or parse(text, parsing_timeout=None)


@functools.lru_cache(maxsize=4096)
def _parse_gold(answer: str) -> tuple:
    return tuple(_parse_math(answer))


def _parse_prediction(completion: str) -> list:
    from math_verify import parse

    text = strip_end_markers(completion)
    boxed = last_boxed(text)
    if boxed is not None:
        return _parse_math(boxed)
    hashed = after_hashes(text)
    if hashed is not None:
        return _parse_math(hashed.replace(",", ""))
    return parse(text, parsing_timeout=None)


class _NoTimeoutWarning(logging.Filter):
    """Drops Math-Verify's warning that its own timeouts are off: the scorer enforces them."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_NoTimeoutWarning())


def _prepare_math(args: dict) -> None:
    math_reward("\\boxed{1}", "1")  # imports Math-Verify and compiles its patterns


@register_reward("math", prepare=_prepare_math)
def math_reward(completion: str, answer: str) -> float:
    """1.0 if Math-Verify finds the final answer equivalent to the answer, else 0.0.

    The prediction is the last `\\boxed{}`, else the GSM8K form (after the last `####`, first
    line, commas dropped), else what Math-Verify extracts from the whole completion.
    Math-Verify's own (signal-based) timeouts are off; the scorer limits time instead.
    """
    from math_verify import verify

    if not isinstance(completion, str) or len(completion) > MAX_COMPLETION_CHARS:
        return 0.0
    gold = _parse_gold(str(answer))
    if not gold:
        return 0.0
    predicted = _parse_prediction(completion)
    return float(bool(predicted) and verify(list(gold), predicted, timeout_seconds=None))


def _prepare_format(args: dict) -> None:
    pattern = args.get("pattern")
    if pattern is None:
        return
    if not isinstance(pattern, str):
        raise ValueError(f"pattern: invalid value {pattern!r}; expected a regular expression")
    try:
        re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise ValueError(f"pattern {pattern!r} is not a valid regular expression: {e}") from None


@register_reward("format", prepare=_prepare_format)
def format_reward(completion: str, answer: str, pattern: str | None = None) -> float:
    """1.0 if the completion has a final answer, or, given `pattern`, if the regex matches it."""
    if pattern is None:
        return float(final_answer(completion) is not None)
    if len(completion) > MAX_COMPLETION_CHARS:
        return 0.0
    return float(re.search(pattern, completion, re.DOTALL) is not None)
