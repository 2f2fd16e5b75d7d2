"""A safe evaluator for integer arithmetic expressions (+ - * / parentheses), exact as Fractions.

Hand-written recursive descent over a fixed alphabet; nothing is ever passed to eval/exec.
Every input is bounded: length, nesting depth, literal digits and the size of every
intermediate numerator and denominator, so evaluation is fast on any input.
"""

from __future__ import annotations

import dataclasses
import functools
from fractions import Fraction

ALLOWED_CHARS = frozenset("0123456789+-*/() \t\n")
DIGITS = frozenset("0123456789")
WHITESPACE = frozenset(" \t\n")


class ExprError(ValueError):
    """An expression that is not valid or not allowed; `kind` names the category."""

    kind = "invalid"


class ExprSyntaxError(ExprError):
    """Malformed expression or a character/operator outside the grammar."""

    kind = "syntax"


class ExprLimitError(ExprError):
    """Too long, too deep, or a number too large."""

    kind = "limit"


class ExprZeroDivisionError(ExprError):
    """Division by zero."""

    kind = "division by zero"


@dataclasses.dataclass(frozen=True)
class Limits:
    """Bounds on an expression; every one is checked before it can cost time."""

    max_len: int = 200  # characters
    max_depth: int = 32  # nested parentheses and unary signs
    max_digits: int = 12  # digits in one integer literal
    max_abs: int = 10**18  # bound on |numerator| and denominator of every intermediate value
    allow_unary: bool = True  # leading + / - signs


DEFAULT_LIMITS = Limits()


def _tokenize(text: str, limits: Limits) -> list[str]:
    if len(text) > limits.max_len:
        raise ExprLimitError(f"expression has {len(text)} characters; at most {limits.max_len}")
    for c in text:
        if c not in ALLOWED_CHARS:
            raise ExprSyntaxError(f"character {c!r} is not allowed; valid: digits, + - * / ( )")
    if "**" in text:
        raise ExprSyntaxError("exponentiation (**) is not allowed")
    if "//" in text:
        raise ExprSyntaxError("floor division (//) is not allowed; use /")
    tokens, i = [], 0
    while i < len(text):
        c = text[i]
        if c in WHITESPACE:
            i += 1
        elif c in DIGITS:
            j = i
            while j < len(text) and text[j] in DIGITS:
                j += 1
            if j - i > limits.max_digits:
                raise ExprLimitError(f"number with {j - i} digits; at most {limits.max_digits}")
            tokens.append(text[i:j])
            i = j
        else:
            tokens.append(c)
            i += 1
    return tokens


class _Parser:
    """expr := term (('+'|'-') term)* ; term := unary (('*'|'/') unary)* ;
    unary := ('+'|'-') unary | atom ; atom := INT | '(' expr ')'.

    The grammar once; what a parse builds is the subclass's: literal, add, mul, neg.
    """

    def __init__(self, tokens: list[str], limits: Limits):
        self.tokens, self.pos, self.limits = tokens, 0, limits
        self.numbers: list[int] = []

    def parse(self):
        if not self.tokens:
            raise ExprSyntaxError("empty expression")
        value = self.expr(0)
        if self.peek() is not None:
            raise ExprSyntaxError(f"unexpected token {self.peek()!r} after a complete expression")
        return value

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            raise ExprSyntaxError("unexpected end of expression")
        self.pos += 1
        return tok

    def expr(self, depth: int):
        value = self.term(depth)
        while self.peek() in ("+", "-"):
            op = self.take()
            value = self.add(value, op, self.term(depth))
        return value

    def term(self, depth: int):
        value = self.unary(depth)
        while self.peek() in ("*", "/"):
            op = self.take()
            value = self.mul(value, op, self.unary(depth))
        return value

    def unary(self, depth: int):
        if depth >= self.limits.max_depth:
            raise ExprLimitError(f"nesting deeper than {self.limits.max_depth}")
        tok = self.peek()
        if tok in ("+", "-"):
            if not self.limits.allow_unary:
                raise ExprSyntaxError(f"unary {tok!r} is not allowed here")
            self.take()
            value = self.unary(depth + 1)
            return self.neg(value) if tok == "-" else value
        return self.atom(depth)

    def atom(self, depth: int):
        tok = self.take()
        if tok == "(":
            value = self.expr(depth + 1)
            if self.take() != ")":
                raise ExprSyntaxError("expected ')'")
            return value
        if tok[0] in DIGITS:
            n = int(tok)
            self.numbers.append(n)
            return self.literal(n)
        raise ExprSyntaxError(f"unexpected token {tok!r}")


class _Evaluator(_Parser):
    """Exact values, every intermediate bounded by limits.max_abs."""

    def check(self, x: Fraction) -> Fraction:
        m = self.limits.max_abs
        if abs(x.numerator) > m or x.denominator > m:
            raise ExprLimitError(f"intermediate value exceeds {m} in numerator or denominator")
        return x

    def literal(self, n: int) -> Fraction:
        return self.check(Fraction(n))

    def add(self, a: Fraction, op: str, b: Fraction) -> Fraction:
        return self.check(a + b if op == "+" else a - b)

    def mul(self, a: Fraction, op: str, b: Fraction) -> Fraction:
        if op == "/" and b == 0:
            raise ExprZeroDivisionError("division by zero")
        return self.check(a * b if op == "*" else a / b)

    def neg(self, a: Fraction) -> Fraction:
        return -a


def evaluate_with_numbers(
    text: str, limits: Limits = DEFAULT_LIMITS
) -> tuple[Fraction, tuple[int, ...]]:
    """Exact value of an integer expression and its integer literals in order; raises ExprError."""
    if not isinstance(text, str):
        raise ExprSyntaxError(f"expression must be a str, got {type(text).__name__}")
    parser = _Evaluator(_tokenize(text, limits), limits)
    value = parser.parse()
    return value, tuple(parser.numbers)


def evaluate(text: str, limits: Limits = DEFAULT_LIMITS) -> Fraction:
    """Exact value of an integer expression with + - * / and parentheses; raises ExprError."""
    return evaluate_with_numbers(text, limits)[0]


def format_value(x: Fraction) -> str:
    """An exact value as text: '12', '-3' or '7/2'."""
    return str(x.numerator) if x.denominator == 1 else f"{x.numerator}/{x.denominator}"


# A term: its factors as sorted (exponent, factor text) pairs, exponent 1 for *, -1 for /.
# A sum: its terms as sorted (sign, term) pairs. Literals are one-factor terms.
_Term = tuple[tuple[int, str], ...]
_Sum = tuple[tuple[int, _Term], ...]


def _render_term(term: _Term) -> str:
    num = "*".join(f for e, f in term if e > 0) or "1"
    return num + "".join("/" + f for e, f in term if e < 0)


def _render_sum(terms) -> str:
    return "".join(("+" if s > 0 else "-") + _render_term(t) for s, t in terms)


def _sorted_sum(terms) -> _Sum:
    return tuple(sorted(terms, key=lambda st: (_render_term(st[1]), st[0])))


def _product(factors: list[tuple[int, _Sum]]) -> _Sum:
    """A product of signed sums as one signed term; single-term factors are flattened into it."""
    sign, pairs = 1, []
    for exp, value in factors:
        if len(value) == 1:
            s, term = value[0]
            sign *= s
            pairs.extend((e * exp, f) for e, f in term)
        else:
            pairs.append((exp, f"({_render_sum(value)})"))
    return ((sign, tuple(sorted(pairs, key=lambda ef: (-ef[0], ef[1])))),)


class _CanonicalParser(_Parser):
    """Sorted sum-of-products forms instead of values (the key of twin_key)."""

    def literal(self, n: int) -> _Sum:
        return ((1, ((1, str(n)),)),)

    def add(self, a: _Sum, op: str, b: _Sum) -> _Sum:
        sign = 1 if op == "+" else -1
        return _sorted_sum([*a, *((s * sign, t) for s, t in b)])

    def mul(self, a: _Sum, op: str, b: _Sum) -> _Sum:
        return _product([(1, a), (1 if op == "*" else -1, b)])

    def neg(self, a: _Sum) -> _Sum:
        return _sorted_sum((-s, t) for s, t in a)


@functools.lru_cache(maxsize=1 << 16)  # a task's draws repeat a few thousand expressions
def twin_key(text: str, limits: Limits = DEFAULT_LIMITS) -> str:
    """A key shared by an expression's trivial twins; raises ExprError on an invalid one.

    Twins: the same expression up to the order and grouping of + and * operands (with - and /
    as their inverses: a-(b-c) is a+c-b) and up to an overall sign (a-b and b-a), since each
    one's answer follows from the other's without new arithmetic.
    """
    if not isinstance(text, str):
        raise ExprSyntaxError(f"expression must be a str, got {type(text).__name__}")
    value = _CanonicalParser(_tokenize(text, limits), limits).parse()
    negated = _sorted_sum((-s, t) for s, t in value)
    return min(_render_sum(value), _render_sum(negated))
