"""Readers of a run directory shared by the tests: metric rows and the trained-episode dumps."""

import glob
import json
import os


def metric_rows(run_dir) -> list[dict]:
    """Every row of the run's metrics.jsonl."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def trained_episodes(run_dir) -> dict:
    """{(group, index): dumped episode} over every update's dump; asserts no duplicate."""
    out = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "episodes", "v*.jsonl"))):
        with open(path) as f:
            for line in f:
                e = json.loads(line)
                key = (e["group"], e["index"])
                assert key not in out, f"episode {key} trained twice"
                out[key] = e
    return out


COMPARED = ("loss/loss", "reward/mean", "episode/length", "eval/reward")


def compared_keys(row: dict, step: int) -> list[str]:
    """The keys of COMPARED in a metrics row, asserting the ones every such row has: the
    start's evaluation at step 0, the update's loss, reward and length after it (so a renamed
    key fails the comparison instead of leaving it)."""
    want = {"eval/reward"} if step == 0 else {"loss/loss", "reward/mean", "episode/length"}
    keys = [k for k in COMPARED if k in row]
    assert want <= set(keys), (step, sorted(want - set(keys)))
    return keys
