"""The main job cut short on this CPU (its whole warm start, then 25 of its RL updates): RL raises
held-out accuracy well past the warm start's. The whole job's runs: docs/results.md."""

import json
import os

import pytest

from rl import config as C
from rl.trainer import Trainer

pytestmark = pytest.mark.slow  # the main job's warm start and 25 RL updates

DEFAULT = os.path.join(os.path.dirname(__file__), "..", "configs", "default.yaml")


def test_main_job_rl_raises_held_out_accuracy(tmp_path):
    over = [
        f"run_root={tmp_path}",
        "name=learn",
        "trainer.total_updates=25",
        "trainer.eval_every=25",
        "logging.progress=false",
        "logging.tensorboard=false",
    ]
    trainer = Trainer(C.load(DEFAULT, over))
    summary = trainer.run()
    start, end = summary["eval/accuracy_start"], summary["eval/accuracy_end"]
    with open(os.path.join(trainer.run_dir, "metrics.jsonl")) as f:
        first = json.loads(f.readline())
    k = {key: (first[key], summary[key]) for key in ("eval/pass@1", "eval/pass@8", "eval/maj@8")}
    print(f"held-out accuracy {start:.3f} -> {end:.3f}; sampled, start -> end: {k}")
    # The warm start answers like its demonstrator (wrong, greedily); RL turns it around.
    assert start < 0.5 and end >= start + 0.3, (start, end)
    # Sampling finds the right answer often at the start (what RL works from), and RL moves
    # the sampled policy too: its pass@1 rises with the greedy accuracy.
    assert k["eval/pass@8"][0] > start and k["eval/pass@1"][1] >= k["eval/pass@1"][0] + 0.3, k
