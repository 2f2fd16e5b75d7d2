"""The main job cut short on this CPU (its whole warm start, then 25 of its RL updates): RL raises
held-out accuracy well past the warm start's. The whole job's runs: docs/results.md."""

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
    summary = Trainer(C.load(DEFAULT, over)).run()
    start, end = summary["eval/accuracy_start"], summary["eval/accuracy_end"]
    print(f"held-out accuracy {start:.3f} -> {end:.3f}")
    # The warm start answers like its demonstrator (wrong, greedily); RL turns it around.
    assert start < 0.5 and end >= start + 0.3, (start, end)
