"""The supervised warm start: a fixed number of steps, or until a greedy-accuracy target."""

import os

import jax
import pytest

from models.tokenizer import build_task_tokenizer, load_tokenizer
from rl import config as C
from rl.learner_setup import make_learner, rl_step_cfg
from rl.sft import warm_start, warm_start_run
from rl.tasks import get_task

pytestmark = pytest.mark.slow  # warm starts that decode greedily to probe accuracy

BASE = ["sft.batch_size=8", "sft.check_every=2", "sft.probe_size=8", "task.num_eval=8"]


def _setup(tmp_path, *overrides):
    cfg = C.load(None, [*BASE, f"run_root={tmp_path}", *overrides])
    tok = load_tokenizer(build_task_tokenizer(os.path.join(tmp_path, "tok")))
    task = get_task(cfg.task.name, seed=cfg.task.seed, **cfg.task.options)
    _, learner, ckpt = make_learner(
        cfg, tok.vocab_size, jax.devices(), os.path.join(tmp_path, "run")
    )
    ckpt.close()
    return cfg, learner, task, tok


def test_target_accuracy_ends_the_warm_start_at_the_first_check_that_reaches_it(tmp_path):
    cfg, learner, task, tok = _setup(tmp_path, "sft.steps=20", "sft.target_accuracy=0.3")
    seen = iter([0.0, 0.1, 0.35, 0.9])  # the probe's answers, one per check (every 2 steps)
    calls = []

    def probe():
        calls.append(1)
        return next(seen)

    summary, _ = warm_start(learner, task, tok, cfg.sft, rl_step=rl_step_cfg(cfg), probe=probe)
    assert len(calls) == 3 and summary["sft/steps"] == 6
    assert summary["sft/probe_accuracy"] == 0.35 and learner.version == 0


def test_target_accuracy_probes_real_greedy_decoding_and_caps_at_steps(tmp_path):
    """An unreachable target: every check decodes the probe problems, and the warm start runs
    its sft.steps."""
    cfg, learner, task, tok = _setup(tmp_path, "sft.steps=4", "sft.target_accuracy=1.0")
    summary, _ = warm_start_run(cfg, learner, task, tok)
    assert summary["sft/steps"] == 4
    assert 0.0 <= summary["sft/probe_accuracy"] < 1.0


def test_without_a_target_all_steps_run_and_nothing_is_probed(tmp_path):
    cfg, learner, task, tok = _setup(tmp_path, "sft.steps=3")
    summary, _ = warm_start_run(cfg, learner, task, tok)
    assert summary["sft/steps"] == 3 and "sft/probe_accuracy" not in summary
