"""Exact replay: the recorded schedule of an async run, re-run in one process, bit for bit; the
batch-invariant sampler it needs; and the comparison that names the first difference."""

import json
import os
import shutil

import numpy as np
import pytest
from model_weights import randomize

from models import create_model, tiny
from rl import config as C
from rl.replay import ReplayMismatch, compare_row, replay
from rl.rollout.base import GenerationRequest, SamplingParams
from rl.rollout.jax_engine import JaxEngine
from rl.schedule import read_schedule, segments
from rl.trainer import train
from rl.types import Episode

RUN = [
    "sft.steps=20",
    "sft.batch_size=16",
    "sft.lr=5e-3",
    "rollout.prompts_per_update=4",
    "rollout.group_size=4",
    "rollout.batch_size=16",
    "task.num_eval=16",
    "logging.progress=false",
    "trainer.eval_every=2",
    "seed=3",
    "trainer.total_updates=3",
    "trainer.mode=async",
    "trainer.max_staleness=2",
    "rollout.streams=12",  # the bound's worth of groups in flight: generation runs ahead
    "trainer.partial=continue",
    "rollout.batch_invariant=true",
]


def _req(rid, prompt_seed, n, max_new, **kw):
    prompt = np.random.RandomState(prompt_seed).randint(2, tiny().vocab_size, n).astype(np.int32)
    return GenerationRequest(rid, prompt, SamplingParams(max_new_tokens=max_new, **kw))


@pytest.mark.slow
def test_batch_invariant_sampler_log_probs_bit_equal():
    """With cache_len, a request's tokens and log-probs are the same bits alone and in a batch
    (without it only the tokens are: the logits change with the batch's shapes)."""
    model = randomize(create_model(tiny(), seed=0), seed=0)
    engine = JaxEngine(model, chunk=4, max_batch=8, cache_len=64)
    try:
        target = _req("t", 7, 6, 20, temperature=1.0, seed=1234)
        alone = engine.generate([target])[0]
        others = [
            _req(f"o{i}", 10 + i, 3 + 4 * i, 5 + 3 * i, temperature=1.0, seed=i) for i in range(5)
        ]
        out = engine.generate(others[:2] + [target] + others[2:])[2]
        np.testing.assert_array_equal(out.token_ids, alone.token_ids)
        assert out.logprobs.tobytes() == alone.logprobs.tobytes()
        with pytest.raises(ValueError, match="cache positions"):
            engine.generate([_req("long", 1, 60, 10)])
    finally:
        engine.close()


def test_segments_split_turns_and_versions():
    """Spans: one per turn, a turn split where its version changes (an interrupted request)."""
    toks = np.arange(12)
    mask = [0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1]
    vers = [-1, -1, 3, 3, 4, 4, -1, -1, 4, 4, 4, 5]
    e = Episode("p", toks, mask, np.zeros(12), vers, prompt_len=2, reward=0.0)
    assert segments(e) == [[0, 3, 2], [0, 4, 2], [1, 4, 3], [1, 5, 1]]


def test_compare_is_exact_and_names_the_first_difference():
    row = {"loss/loss": 0.25, "eval/accuracy": 0.5, "timing/update": 1.0}
    compare_row(2, row, {**row, "timing/update": 9.0})  # times are not compared
    bumped = {**row, "loss/loss": float(np.nextafter(np.float32(0.25), np.float32(1)))}
    with pytest.raises(ReplayMismatch, match="step 2: loss/loss"):
        compare_row(2, row, bumped)
    with pytest.raises(ReplayMismatch, match="eval/accuracy was logged"):
        compare_row(2, row, {"loss/loss": 0.25})


@pytest.mark.slow
def test_async_run_replays_bit_for_bit(tmp_path):
    """An async run (staleness bound 2, partial rollouts 'continue', a rollout process) and its
    replay in one process: every loss, reward and accuracy equal; a changed value is named."""
    cfg = C.load(None, [*RUN, f"run_root={tmp_path}", "name=async"])
    train(cfg)
    run = os.path.join(tmp_path, "async")
    schedule = read_schedule(run)
    updates = [s for s in schedule if "update" in s]
    assert [s["update"] for s in updates] == [1, 2, 3]
    assert [s["eval"] for s in updates] == [False, True, True]
    stale = [
        s["update"] - 1 - v
        for s in updates
        for g in s["trained"]
        for e in g["episodes"]
        for _, v, _ in e["segments"]
    ]
    assert max(stale) >= 1  # trained off-policy: the replay must keep older weights
    assert replay(run, str(tmp_path / "work")) == 4  # step 0 and three updates

    tampered = str(tmp_path / "tampered")
    shutil.copytree(run, tampered, ignore=shutil.ignore_patterns("checkpoints"))
    with open(os.path.join(tampered, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    rows[1]["loss/pg_loss"] = float(np.nextafter(rows[1]["loss/pg_loss"], 1.0))
    with open(os.path.join(tampered, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with pytest.raises(ReplayMismatch, match="step 1: loss/pg_loss"):
        replay(tampered, str(tmp_path / "work2"))


@pytest.mark.slow
def test_adaptive_staleness_run_replays_bit_for_bit(tmp_path):
    """An adaptive-staleness run: the bound it sets from the measured drift is in the metrics
    (staleness/eta) and the schedule, and the replay makes the same decisions from the replayed
    rows; a recorded bound that differs is named."""
    adaptive = [
        "algorithm.loss=decoupled_ppo",  # its proximal log-probs give the drift
        "trainer.total_updates=4",
        "trainer.adaptive.enabled=true",
        "trainer.adaptive.ceiling=4",
        "trainer.adaptive.low=0.0",
        "trainer.adaptive.high=1e-9",  # any measured drift halves eta: 2, 1, 0
        "trainer.adaptive.window=1",
    ]
    cfg = C.load(None, [*RUN, *adaptive, f"run_root={tmp_path}", "name=adaptive"])
    train(cfg)
    run = os.path.join(tmp_path, "adaptive")
    with open(os.path.join(run, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f][1:]
    etas = [r["staleness/eta"] for r in rows]
    # The bound moved during the run. Update 1 trains tokens of its own version, whose drift is
    # 0 where the sampler's log-probs equal the learner's (bit for bit for some batches, not all):
    # it may keep eta. Update 2's tokens are a version old: their drift halves it.
    assert etas[1] < etas[0] <= 2 and len(set(etas)) > 1, etas
    assert [r["staleness/bound"] for r in rows[1:]] == etas[:-1]  # each update's bound in force
    schedule = [s for s in read_schedule(run) if "update" in s]
    assert [s["eta"] for s in schedule] == etas
    assert replay(run, str(tmp_path / "work")) == 5

    tampered = str(tmp_path / "tampered")
    shutil.copytree(run, tampered, ignore=shutil.ignore_patterns("checkpoints"))
    path = os.path.join(tampered, "schedule.jsonl")
    with open(path) as f:
        lines = [json.loads(line) for line in f]
    first = next(s for s in lines if "update" in s)
    first["eta"] += 1
    with open(path, "w") as f:
        f.writelines(json.dumps(s) + "\n" for s in lines)
    with pytest.raises(ReplayMismatch, match="update 1: staleness bound"):
        replay(tampered, str(tmp_path / "work2"))
