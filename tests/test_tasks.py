"""Tasks: determinism, disjoint splits, rewards of demonstrations and of adversarial outputs."""

import random
import re
import time
from fractions import Fraction

import pytest

from rl.tasks import TASKS, get_task
from rl.tasks.base import Problem, RewardResult, extract_answer, in_split
from rl.tasks.expr import (
    ExprError,
    ExprLimitError,
    ExprSyntaxError,
    ExprZeroDivisionError,
    Limits,
    evaluate,
    evaluate_with_numbers,
    twin_key,
)

TASK_NAMES = ["arithmetic", "countdown", "calculator"]
# The generators, whose splits go by a canonical twin key; the data-file task (`dataset`) splits
# by a hash of the normalised prompt and is tested in test_dataset_task.py.
GENERATORS = sorted(set(TASKS) - {"dataset"})


def reference_eval(expr: str) -> Fraction:
    """Python's own evaluator on a checked digits-and-operators string, with exact Fractions."""
    assert re.fullmatch(r"[0-9+\-*/() ]+", expr), expr
    return eval(re.sub(r"[0-9]+", lambda m: f"Fraction({m.group()})", expr), {"Fraction": Fraction})


def problem_key(task_name: str, p: Problem):
    """How a problem is identified, computed from its visible content."""
    if task_name == "countdown":
        return tuple(sorted(p.meta["numbers"])), p.meta["target"]
    return p.prompt


# ---------------------------------------------------------------- expression evaluator


@pytest.mark.parametrize(
    "expr,value",
    [
        ("6/4*2", Fraction(3)),
        ("1+2*3", Fraction(7)),
        ("(1+2)*3", Fraction(9)),
        ("10-4-3", Fraction(3)),
        ("8/4/2", Fraction(1)),
        ("-3+5", Fraction(2)),
        ("2*(3+4)-5/5", Fraction(13)),
        (" 1 +\t2\n", Fraction(3)),
        ("7/2", Fraction(7, 2)),
        ("--4", Fraction(4)),
        ("007", Fraction(7)),
    ],
)
def test_expr_hand_values(expr, value):
    assert evaluate(expr) == value


def test_expr_numbers_in_order():
    assert evaluate_with_numbers("(19+36)*(55-7)") == (Fraction(55 * 48), (19, 36, 55, 7))


def test_expr_matches_python_on_random_expressions():
    rng = random.Random(0)

    def gen(depth):
        if depth == 0 or rng.random() < 0.3:
            return str(rng.randint(0, 30))
        return f"({gen(depth - 1)}{rng.choice('+-*/')}{gen(depth - 1)})"

    checked = zero_div = 0
    for _ in range(500):
        expr = gen(4)[: Limits().max_len]
        try:
            expected = reference_eval(expr)
        except ZeroDivisionError:
            with pytest.raises(ExprZeroDivisionError):
                evaluate(expr)
            zero_div += 1
            continue
        except SyntaxError:  # truncated to max_len
            continue
        assert evaluate(expr) == expected, expr
        checked += 1
    assert checked > 300 and zero_div > 0


@pytest.mark.parametrize(
    "expr,error",
    [
        ("1/0", ExprZeroDivisionError),
        ("1/(2-2)", ExprZeroDivisionError),
        ("2**99999999", ExprSyntaxError),
        ("2^3", ExprSyntaxError),
        ("7//2", ExprSyntaxError),
        ("__import__('os').system('x')", ExprSyntaxError),
        ("1.5", ExprSyntaxError),
        ("\u0661+\u0661", ExprSyntaxError),  # Arabic-Indic digits
        ("", ExprSyntaxError),
        ("  ", ExprSyntaxError),
        ("1+", ExprSyntaxError),
        ("1 2", ExprSyntaxError),
        ("(1+2", ExprSyntaxError),
        ("1+2)", ExprSyntaxError),
        ("()", ExprSyntaxError),
        ("(" * 10 + "1", ExprSyntaxError),
        ("(" * 40 + "1" + ")" * 40, ExprLimitError),  # depth 40 > 32, length 81
        ("-" * 50 + "1", ExprLimitError),
        ("(" * 5000, ExprLimitError),  # length
        ("9" * 13, ExprLimitError),
        ("9" * 100000, ExprLimitError),
        ("*".join(["999999999999"] * 3), ExprLimitError),  # 1e36 > 1e18
        ("1" + "/7" * 30, ExprLimitError),  # denominator 7**30 > 1e18
    ],
)
def test_expr_rejects(expr, error):
    with pytest.raises(error):
        evaluate(expr)


def test_expr_rejects_non_str_and_unary_when_disabled():
    with pytest.raises(ExprError):
        evaluate(12)
    with pytest.raises(ExprSyntaxError):
        evaluate("-1", Limits(allow_unary=False))


# ---------------------------------------------------------------- registry


def test_registry():
    # longtail: a benchmark workload; dataset: the user's data files
    assert sorted(TASKS) == sorted([*TASK_NAMES, "longtail", "dataset"])
    assert get_task("arithmetic", ops=["+", "*"]).ops == ("+", "*")  # YAML lists become tuples
    with pytest.raises(ValueError, match="valid"):
        get_task("sudoku")
    with pytest.raises(ValueError, match="digitz"):
        get_task("arithmetic", digitz=3)
    with pytest.raises(ValueError, match=r"\^"):
        get_task("arithmetic", ops=("^",))
    with pytest.raises(ValueError, match="eval_fraction"):
        get_task("countdown", eval_fraction=0.0)
    with pytest.raises(ValueError, match="split"):
        get_task("arithmetic").problems("test", 3)
    for name in TASK_NAMES:
        task = get_task(name)
        assert task.name == name and task.max_turns >= 1


def test_twin_key():
    """Twins share a key (order and grouping of + and *, their inverses, overall sign)."""
    same = [
        ("34+12", "12+34"),
        ("34*12", "12*34"),
        ("34-12", "12-34"),
        ("3*4+5", "5+4*3"),
        ("1-(2-3)", "1+3-2"),
        ("(1+2)+3", "1+(2+3)"),
        ("2*(3*4)", "4*3*2"),
        ("(-3)*4", "3*4"),
        ("2*(3+4)", "(4+3)*2"),
        ("8/2/4", "8/(4*2)"),
    ]
    for a, b in same:
        assert twin_key(a) == twin_key(b), (a, b)
    for a, b in [
        ("6/2", "2/6"),
        ("1+2", "1-2"),
        ("2*(3+4)", "2*3+2*4"),
        ("1+2", "3"),
        ("3+4", "34"),
    ]:
        assert twin_key(a) != twin_key(b), (a, b)
    with pytest.raises(ExprSyntaxError):
        twin_key("1+")


# ---------------------------------------------------------------- splits and determinism


@pytest.mark.parametrize("name", TASK_NAMES)
def test_problems_deterministic_and_prefix_stable(name):
    a, b = get_task(name, seed=3), get_task(name, seed=3)
    for split in ("train", "eval"):
        ps = a.problems(split, 50)
        assert ps == b.problems(split, 50)
        assert ps[:20] == a.problems(split, 20)
        assert len({p.id for p in ps}) == 50
    assert [p.prompt for p in get_task(name, seed=4).problems("train", 50)] != [
        p.prompt for p in a.problems("train", 50)
    ]


@pytest.mark.parametrize(
    "name,kwargs,n_eval",
    [
        ("arithmetic", {}, 200),  # 8100 problems
        ("countdown", {}, 200),
        ("calculator", {"min_digits": 1, "max_digits": 1}, 50),  # 1000 problems: overlap would show
    ],
)
def test_splits_disjoint(name, kwargs, n_eval):
    train_keys, eval_keys = set(), set()
    for seed in (0, 1):  # the partition holds across seeds, not just within one
        task = get_task(name, seed=seed, **kwargs)
        train_keys |= {problem_key(name, p) for p in task.problems("train", 3000)}
        ev = [problem_key(name, p) for p in task.problems("eval", n_eval)]
        assert len(set(ev)) == len(ev)  # eval problems are distinct
        eval_keys |= set(ev)
    assert len(train_keys) > 500 and len(eval_keys) >= n_eval
    assert not train_keys & eval_keys


# Small problem spaces (a 20000-problem train sample covers them) and the number of held-out
# problems each has: the whole eval split is checked, so any leaked twin would show.
SMALL_SPACES = {
    "arithmetic": ({"digits": 1, "ops": ("+", "-", "*")}, 17),
    "calculator": ({"min_digits": 1, "max_digits": 1}, 55),
    "countdown": ({"counts": (2,), "max_number": 9, "max_target": 20}, 7),
    "longtail": ({"digits": 1}, 5),
}


def twin(name: str, p: Problem) -> Problem:
    """The problem's commuted twin (operands swapped, countdown numbers reversed)."""
    m = dict(p.meta)
    if name == "countdown":
        m["numbers"] = tuple(reversed(m["numbers"]))
        prompt = f"[{','.join(map(str, m['numbers']))}]->{m['target']}:"
    else:
        m["a"], m["b"] = m["b"], m["a"]
        op = m.get("op", "*" if name == "calculator" else "+")
        prompt = f"{m['a']}{op}{m['b']}" + (f"+{m['c']}" if name == "calculator" else "") + "="
        if name == "calculator":
            m["expression"] = prompt[:-1]
    return Problem(id=p.id + "-twin", prompt=prompt, answer=p.answer, meta=m)


def visible_twins(name: str, p: Problem) -> set:
    """The problem and its trivial twins as read off its prompt, independently of split_key."""
    if name == "countdown":
        return {(tuple(sorted(p.meta["numbers"])), p.meta["target"])}
    a, op, b, rest = re.fullmatch(r"(\d+)([+\-*])(\d+)(.*)=", p.prompt).groups()
    return {f"{a}{op}{b}{rest}=", f"{b}{op}{a}{rest}="}


@pytest.mark.parametrize("small", [True, False], ids=["small-space", "default"])
@pytest.mark.parametrize("name", GENERATORS)
def test_no_held_out_twin_in_train(name, small):
    """No held-out problem's canonical key, nor a commuted twin's prompt, is a training one."""
    assert set(SMALL_SPACES) == set(GENERATORS), "every generator needs a small space here"
    kwargs, n_eval = SMALL_SPACES[name] if small else ({}, 256)
    task = get_task(name, **kwargs)
    train = task.problems("train", 20000)
    held_out = task.problems("eval", n_eval)
    if small:  # that was the whole held-out split
        with pytest.raises(ValueError, match="distinct eval problems"):
            task.problems("eval", n_eval + 1)
    train_keys = {task.split_key(p) for p in train}
    assert not [p.prompt for p in held_out if task.split_key(p) in train_keys]
    train_seen = set().union(*(visible_twins(name, p) for p in train))
    assert not [p.prompt for p in held_out if visible_twins(name, p) & train_seen]
    assert len({task.split_key(p) for p in held_out}) == n_eval  # no two held-out twins


@pytest.mark.parametrize("name", GENERATORS)
def test_split_key_catches_commuted_twins(name):
    """The failure of a split by prompt text: a twin on the other side. The key joins them."""
    task = get_task(name)
    problems = task.problems("train", 2000) + task.problems("eval", 200)
    torn = 0
    for p in problems:
        q = twin(name, p)
        assert task.split_key(q) == task.split_key(p), (p.prompt, q.prompt)
        torn += in_split(p.prompt, "eval", 0.1) != in_split(q.prompt, "eval", 0.1)
    assert torn > 0  # a split by prompt text puts some twins on opposite sides


def test_small_problem_space_exhaustive():
    task = get_task("arithmetic", digits=1)  # 100 problems in all
    train = {p.prompt for p in task.problems("train", 3000)}
    ev = {p.prompt for p in task.problems("eval", 5)}
    assert not train & ev and len(train) + len(ev) <= 100
    assert len(train) > 80  # the train stream covers its part of the space
    with pytest.raises(ValueError, match="distinct eval problems"):
        task.problems("eval", 50)


# ---------------------------------------------------------------- demonstrations


def test_arithmetic_problems_and_demonstrations():
    task = get_task("arithmetic", digits=3, ops=("+", "-", "*"))
    seen_ops = set()
    for p in task.problems("train", 300):
        a, op, b = re.fullmatch(r"(\d{3})([+\-*])(\d{3})=", p.prompt).groups()
        expected = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        seen_ops.add(op)
        demo = task.demonstration(p)
        assert demo == f"<answer>{expected}</answer>"
        assert task.reward(p, demo).reward == 1.0
    assert seen_ops == {"+", "-", "*"}


def test_arithmetic_reversed_digits():
    """reverse_digits: the answer least significant digit first, a sign kept in front."""
    task = get_task("arithmetic", digits=2, ops=("+", "-"), reverse_digits=True)
    plain = get_task("arithmetic", digits=2, ops=("+", "-"))
    for p in task.problems("train", 300):
        a, op, b = re.fullmatch(r"(\d{2})([+\-])(\d{2})=", p.prompt).groups()
        expected = int(a) + int(b) if op == "+" else int(a) - int(b)
        digits = str(abs(expected))[::-1]
        demo = task.demonstration(p)
        assert demo == f"<answer>{'-' if expected < 0 else ''}{digits}</answer>", (p.prompt, demo)
        assert task.reward(p, demo).reward == 1.0
        assert plain.reward(p, demo).correct == (digits == digits[::-1])  # palindromes only
    p = Problem(id="r", prompt="36+73=", answer="109", meta={})
    assert task.reward(p, "<answer>901</answer>").correct
    assert not task.reward(p, "<answer>109</answer>").correct
    assert task.reward(p, "<answer>109</answer>").formatted  # a number, in the wrong order
    assert task.reward(p, "<answer>9-01</answer>").reward == 0.0  # a sign only in front
    n = Problem(id="n", prompt="12-40=", answer="-28", meta={})
    assert task.reward(n, "<answer>-82</answer>").correct
    assert not task.reward(n, "<answer>82-</answer>").formatted


def test_arithmetic_digit_credit():
    """digit_credit: a wrong, well-formed answer earns format_reward plus digit_credit times the
    fraction of its written digits that match the right answer's, position by position."""
    task = get_task("arithmetic", reverse_digits=True, digit_credit=0.5)
    p = Problem(id="r", prompt="36+73=", answer="109", meta={})  # written "901"
    assert task.reward(p, "<answer>901</answer>").reward == 1.0
    assert task.reward(p, "<answer>911</answer>").reward == pytest.approx(0.1 + 0.5 * 2 / 3)
    assert task.reward(p, "<answer>90</answer>").reward == pytest.approx(0.1 + 0.5 * 2 / 3)
    assert task.reward(p, "<answer>9011</answer>").reward == pytest.approx(0.1 + 0.5 * 3 / 4)
    assert task.reward(p, "<answer>123</answer>").reward == pytest.approx(0.1)
    assert task.reward(p, "<answer>x</answer>").reward == 0.0
    n = Problem(id="n", prompt="12-40=", answer="-28", meta={})  # written "-82"
    assert task.reward(n, "<answer>-83</answer>").reward == pytest.approx(0.1 + 0.5 * 2 / 3)
    plain = get_task("arithmetic", digit_credit=0.5)  # the usual order: compared as written
    assert plain.reward(p, "<answer>108</answer>").reward == pytest.approx(0.1 + 0.5 * 2 / 3)
    assert get_task("arithmetic").reward(p, "<answer>108</answer>").reward == 0.1
    with pytest.raises(ValueError, match=r"digit_credit must be a number in \[0, 1\), got 1"):
        get_task("arithmetic", digit_credit=1)


def test_arithmetic_sloppy_demonstrator():
    """demo_error: that fraction of problem ids gets a demonstration whose first written digit
    is one too high (mod 10), the rest of it right; the others stay correct; the same problems
    on every call; prompts, answers and rewards untouched."""
    clean = get_task("arithmetic", reverse_digits=True, ops=("+", "-"))
    task = get_task("arithmetic", reverse_digits=True, ops=("+", "-"), demo_error=0.7)
    problems = task.problems("train", 4000)
    assert problems == clean.problems("train", 4000)
    wrong = 0
    for p in problems:
        demo, right = task.demonstration(p), clean.demonstration(p)
        assert demo == task.demonstration(p)
        assert task.reward(p, right).correct
        if demo != right:
            wrong += 1
            d, r = extract_answer(demo), extract_answer(right)
            i = 1 if r[0] == "-" else 0
            assert d[:i] == r[:i] and d[i + 1 :] == r[i + 1 :]
            assert int(d[i]) == (int(r[i]) + 1) % 10
            assert not task.reward(p, demo).correct and task.reward(p, demo).formatted
    assert abs(wrong / len(problems) - 0.7) < 0.03
    assert all(
        clean.demonstration(p)
        == get_task(
            "arithmetic", reverse_digits=True, ops=("+", "-"), demo_error=0.0
        ).demonstration(p)
        for p in problems[:50]
    )
    with pytest.raises(ValueError, match=r"demo_error must be a number in \[0, 1\], got 1.5"):
        get_task("arithmetic", demo_error=1.5)


def test_arithmetic_long_tailed_budgets():
    """budget_min > 0: each problem carries a Pareto budget in [min, max] and ignore_eos; the
    problems and splits are those of the task without budgets; the reward reads the first
    answer, whatever follows it."""
    plain = get_task("arithmetic", reverse_digits=True, demo_error=0.7)
    task = get_task("arithmetic", reverse_digits=True, demo_error=0.7, budget_min=16)
    problems = task.problems("train", 3000)
    assert [(p.id, p.prompt, p.answer) for p in problems] == [
        (p.id, p.prompt, p.answer) for p in plain.problems("train", 3000)
    ]
    assert (
        all(p.meta["ignore_eos"] for p in problems)
        and "ignore_eos" not in plain.problems("train", 1)[0].meta
    )
    b = [p.meta["max_new_tokens"] for p in problems]
    assert min(b) == 16 and max(b) == 128
    assert abs(sum(x > 32 for x in b) / len(b) - (16 / 32.5) ** 1.2) < 0.03  # Pareto(1.2) tail
    p = problems[0]
    right = plain.demonstration_answer(p.answer)
    assert task.demonstration(p) == plain.demonstration(p)
    assert task.reward(p, f"<answer>{right}</answer><eos>12 9<answer>0</answer>").correct
    assert not plain.reward(p, f"<answer>{right}</answer>12").correct  # no budget: it must end
    wrong = f"<answer>{int(right) + 1}</answer>"
    assert task.reward(p, wrong + f"<answer>{right}</answer>").reward == pytest.approx(0.1)
    assert task.reward(p, "xx <answer>12").reward == 0.0
    with pytest.raises(ValueError, match="budget_min=200, budget_max=128"):
        get_task("arithmetic", budget_min=200)
    with pytest.raises(ValueError, match="budget_alpha must be > 0"):
        get_task("arithmetic", budget_min=4, budget_alpha=0)


@pytest.mark.parametrize("use_all", [False, True])
def test_countdown_problems_and_demonstrations(use_all):
    task = get_task("countdown", use_all=use_all)
    for p in task.problems("train", 300) + task.problems("eval", 50):
        numbers, target = p.meta["numbers"], p.meta["target"]
        assert len(numbers) in (3, 4) and all(1 <= x <= 99 for x in numbers)
        assert 1 <= target <= 100
        assert p.prompt == f"[{','.join(map(str, numbers))}]->{target}:"
        demo = task.demonstration(p)
        expr = re.fullmatch(r"<answer>(.*)</answer>", demo).group(1)
        assert reference_eval(expr) == target
        assert sorted(int(x) for x in re.findall(r"[0-9]+", expr)) == sorted(numbers)
        assert task.reward(p, demo) == RewardResult(1.0, True, True)


def test_countdown_tinyzero_prompt():
    p = get_task("countdown", prompt_style="tinyzero").problems("train", 1)[0]
    assert p.prompt.startswith(f"Using the numbers {list(p.meta['numbers'])}, create an equation")


def test_calculator_problems_and_demonstrations():
    task = get_task("calculator")
    for p in task.problems("train", 200):
        a, b, c = map(int, re.fullmatch(r"(\d+)\*(\d+)\+(\d+)=", p.prompt).groups())
        assert all(10 <= x <= 999 for x in (a, b, c))
        demo = task.demonstration(p)
        call = f"<tool_call>{a}*{b}+{c}</tool_call>"
        assert (
            demo == f"{call}<tool_response>{a * b + c}</tool_response><answer>{a * b + c}</answer>"
        )
        assert task.env_step(p, call) == f"<tool_response>{a * b + c}</tool_response>"
        assert task.reward(p, demo).reward == 1.0
    one_turn = get_task("calculator", max_turns=1)
    assert one_turn.demonstration(p) == f"<answer>{p.answer}</answer>"


# ---------------------------------------------------------------- rewards


ARITH = Problem(id="t", prompt="12+34=", answer="46", meta={"a": 12, "b": 34, "op": "+"})


@pytest.mark.parametrize(
    "completion,expected",
    [
        ("<answer>46</answer>", (1.0, True, True)),
        ("<answer> 46 </answer>", (1.0, True, True)),
        ("<answer>46</answer><eos>", (1.0, True, True)),
        ("<answer>46</answer>\n<|im_end|>\n", (1.0, True, True)),
        ("12+34 is 46 <answer>46</answer>", (1.0, True, True)),
        ("<answer>47</answer>", (0.1, False, True)),
        ("<answer>-46</answer>", (0.1, False, True)),
        ("<answer>046</answer>", (1.0, True, True)),
        ("<answer>46</answer>junk", (0.0, False, False)),
        ("<answer>46</answer><answer>46</answer>", (0.0, False, False)),
        ("<answer>4 6</answer>", (0.0, False, False)),
        ("<answer>46.0</answer>", (0.0, False, False)),
        ("<answer>4_6</answer>", (0.0, False, False)),
        ("<answer>\u0664\u0666</answer>", (0.0, False, False)),  # Arabic-Indic 46
        ("<answer>34+12</answer>", (0.0, False, False)),
        ("<answer></answer>", (0.0, False, False)),
        ("46", (0.0, False, False)),
    ],
)
def test_arithmetic_reward_table(completion, expected):
    r = get_task("arithmetic").reward(ARITH, completion)
    assert (r.reward, r.correct, r.formatted) == expected


COUNTDOWN = Problem(
    id="t", prompt="[3,5,7]->15:", answer="3*5", meta={"numbers": (3, 5, 7), "target": 15}
)


@pytest.mark.parametrize(
    "completion,expected",
    [
        ("<answer>3*5</answer>", (1.0, True, True)),
        ("<answer>7+5+3</answer>", (1.0, True, True)),
        ("<answer> (7 + 3) * 5 / 10 </answer>", (0.0, False, False)),  # 10 not given
        ("<answer>(7-5)*3</answer>", (0.1, False, True)),
        ("<answer>5+5+5</answer>", (0.0, False, False)),  # 5 used three times
        ("<answer>15</answer>", (0.0, False, False)),  # a number not given
        ("<answer>3*5*1</answer>", (0.0, False, False)),
        ("<answer>35/7*3</answer>", (0.0, False, False)),  # digits glued into a new number
        ("<answer>3*5=15</answer>", (0.0, False, False)),
        ("<answer>3*(5</answer>", (0.0, False, False)),
        ("<answer>5/(7-7)</answer>", (0.0, False, False)),
    ],
)
def test_countdown_reward_table(completion, expected):
    r = get_task("countdown").reward(COUNTDOWN, completion)
    assert (r.reward, r.correct, r.formatted) == expected


def test_countdown_exact_fractions_and_use_all():
    p = Problem(id="t", prompt="", answer="", meta={"numbers": (6, 4, 2), "target": 3})
    assert get_task("countdown").reward(p, "<answer>6/4*2</answer>").reward == 1.0
    p2 = Problem(id="t", prompt="", answer="", meta={"numbers": (3, 7, 1), "target": 3})
    assert get_task("countdown").reward(p2, "<answer>1/3*7*3/7*3</answer>").reward == 0.0
    strict = get_task("countdown", use_all=True)
    assert strict.reward(COUNTDOWN, "<answer>3*5</answer>").reward == 0.0  # 7 unused
    assert strict.reward(COUNTDOWN, "<answer>7+5+3</answer>").reward == 1.0


def _adversarial():
    mb = 1 << 20
    return {
        "many_open_tags": "<answer>" * 10000,
        "many_close_tags": "</answer>" * 10000,
        "nines": "9" * 100000,
        "tagged_nines": "<answer>" + "9" * 100000 + "</answer>",
        "tagged_nines_4k": "<answer>" + "9" * 4500 + "</answer>",
        "import": "<answer>__import__('os').system('x')</answer>",
        "bare_import": "__import__('os').system('x')",
        "div_zero": "<answer>1/0</answer>",
        "parens": "<answer>" + "(" * 5000 + "</answer>",
        "deep_parens": "<answer>" + "(" * 60 + "1" + ")" * 60 + "</answer>",
        "power": "<answer>2**99999999</answer>",
        "unicode": "<answer>\U0001f600\u00e9\u6f22</answer>",
        "nul": "<answer>\x00</answer>",
        "unmatched_close_first": "</answer>46<answer>",
        "unclosed": "<answer>46",
        "unopened": "46</answer>",
        "empty": "",
        "eos_flood": "<eos>" * 26000,  # just under the length cap: stripping must stay linear
        "answer_then_eos_flood_junk": "<answer>1</answer>" + "<eos> " * 20000 + "x",
        "one_mb_text": "x" * mb,
        "one_mb_eos": "<eos>" * (mb // 5),
        "one_mb_answer": "<answer>" + "1+" * (mb // 2) + "1</answer>",
        "one_mb_tool_calls": "<tool_call>1+1</tool_call>" * (mb // 26),
    }


ADVERSARIAL = _adversarial()


@pytest.mark.parametrize("name", TASK_NAMES)
@pytest.mark.parametrize("case", sorted(ADVERSARIAL))
def test_adversarial_outputs_score_zero_fast(name, case):
    task = get_task(name)
    problem = task.problems("eval", 1)[0]
    text = ADVERSARIAL[case]
    start = time.perf_counter()
    r = task.reward(problem, text)
    obs = task.env_step(problem, text)
    elapsed = time.perf_counter() - start
    assert r.reward == 0.0 and not r.correct
    assert obs is None or (obs.startswith("<tool_response>") and len(obs) < 100)
    assert elapsed < 1.0, f"{case}: {elapsed:.2f} s"


# ---------------------------------------------------------------- calculator environment

CALC = Problem(
    id="t",
    prompt="123*45+678=",
    answer="6213",
    meta={"a": 123, "b": 45, "c": 678, "expression": "123*45+678"},
)


@pytest.mark.parametrize(
    "turn,observation",
    [
        ("<tool_call>123*45</tool_call>", "<tool_response>5535</tool_response>"),
        ("let me compute <tool_call>123*45+678</tool_call>", "<tool_response>6213</tool_response>"),
        ("<tool_call>7/2</tool_call><eos>", "<tool_response>7/2</tool_response>"),
        ("<tool_call>1/0</tool_call>", "<tool_response>error: division by zero</tool_response>"),
        ("<tool_call>__import__('os')</tool_call>", "<tool_response>error: syntax</tool_response>"),
        ("<tool_call>2**9999</tool_call>", "<tool_response>error: syntax</tool_response>"),
        ("<tool_call>" + "9" * 20 + "</tool_call>", "<tool_response>error: limit</tool_response>"),
        ("<tool_call>" + "(" * 300 + "</tool_call>", None),  # too long to be a call
        ("<tool_call>1+1</tool_call> and more", None),
        ("<tool_call>1+1</tool_call><tool_call>2+2</tool_call>", None),
        ("<tool_call>1+1", None),
        ("<answer>6213</answer>", None),
        ("<tool_call>1+1</tool_call><answer>2</answer>", None),
        ("no action", None),
    ],
)
def test_calculator_env_step_first_turn(turn, observation):
    assert get_task("calculator").env_step(CALC, turn) == observation


def test_calculator_episode_turn_limit_and_scoring():
    task = get_task("calculator", max_turns=3)
    transcript = "<tool_call>123*45</tool_call>"
    obs = task.env_step(CALC, transcript)
    assert obs == "<tool_response>5535</tool_response>"
    transcript += obs + "<tool_call>5535+678</tool_call>"
    obs = task.env_step(CALC, transcript)
    assert obs == "<tool_response>6213</tool_response>"
    transcript += obs + "<tool_call>1+1</tool_call>"
    assert task.env_step(CALC, transcript) is None  # third model turn was the last
    assert task.reward(CALC, transcript).reward == 0.0  # no answer given
    final = transcript[: transcript.rindex("<tool_call>")] + "<answer>6213</answer>"
    assert task.reward(CALC, final) == RewardResult(1.0, True, True)
    assert task.reward(CALC, final.replace("6213</answer>", "6214</answer>")).reward == 0.1
    # A turn after the last tool response is what counts, not earlier ones.
    assert get_task("calculator", max_turns=1).env_step(CALC, "<tool_call>1</tool_call>") is None
