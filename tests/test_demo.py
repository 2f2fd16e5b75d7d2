"""The demonstration's data (launch/demo.py): held-out problems share no numbers-and-operations
key with training ones, answers are right, and the demonstrator slips only on + and -."""

import json
import random
import re

from launch.demo import word_problem, write_data


def _steps(solution: str) -> list[tuple[int, str, int, int]]:
    return [
        (int(a), op, int(b), int(c))
        for a, op, b, c in re.findall(r"(-?\d+) ([-+*]) (\d+) = (-?\d+)\.", solution)
    ]


def test_correct_demonstrator_works_every_chain_right():
    rng = random.Random(0)
    for _ in range(300):
        p = word_problem(rng, slip=0.0)
        steps = _steps(p["solution"])
        assert 2 <= len(steps) <= 3 and p["solution"].endswith(f"#### {p['answer']}")
        for a, op, b, c in steps:
            assert c == {"+": a + b, "-": a - b, "*": a * b}[op]
        assert steps[-1][3] == int(p["answer"]) and p["prompt"].endswith("have now?")


def test_slipping_demonstrator_slips_on_additions_and_subtractions_only():
    rng = random.Random(1)
    for _ in range(300):
        p = word_problem(rng, slip=1.0)
        for a, op, b, c in _steps(p["solution"]):
            want = {"+": a + b + 1, "-": a - b - 1, "*": a * b}[op]
            assert c == want, p["solution"]


def test_held_out_keys_never_train(tmp_path):
    train, held = write_data(str(tmp_path), seed=0, n_train=3000, n_eval=100, slip=0.6)
    rows = {n: [json.loads(line) for line in open(f)] for n, f in (("t", train), ("e", held))}
    assert len(rows["t"]) == 3000 and len(rows["e"]) == 100

    ops = {"sells": "-", "loses": "-", "gives": "-", "buys": "+", "gets": "+", "finds": "+"}
    ops.update(boxes="*", twice="*2", three="*3")

    def key(r):  # the numbers and operations as the prompt states them, names and items aside
        words = r["prompt"].replace(".", " ").split()
        return tuple(w if w.isdigit() else ops[w] for w in words if w.isdigit() or w in ops)

    assert not {key(r) for r in rows["e"]} & {key(r) for r in rows["t"]}
    assert len({r["prompt"] for r in rows["t"]}) == 3000
