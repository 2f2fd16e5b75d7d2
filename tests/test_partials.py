"""Partial groups (a preemption's in-flight work): the agent loop hands them back once halted,
with every sample's tokens, log-probs, versions and agent state, and continues them later after
their saved tokens on a real JAX engine in either update mode; their checkpoint file round-trips
and is verified like the groups file."""

from __future__ import annotations

import os
import shutil
import threading
import time
import warnings

import numpy as np
import pytest
from test_checkpoint import tiny_state

from models import create_model, tiny
from models.tokenizer import build_task_tokenizer, load_tokenizer
from rl.agent import run_groups
from rl.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointWarning,
    load_partials,
    save_partials,
)
from rl.partials import PartialGroup, PartialSample, SavedPartials
from rl.rollout.base import SamplingParams
from rl.rollout.jax_engine import JaxEngine
from rl.tasks.longtail import LongTailTask
from rl.types import EpisodeGroup

BUDGET = 48


def _sample(seed: int, n_gen: int, done: bool) -> PartialSample:
    L = 3 + n_gen + 2  # prompt, generated, an environment observation
    mask = np.r_[np.zeros(3), np.ones(n_gen), np.zeros(2)].astype(np.int8)
    return PartialSample(
        seed=seed,
        tokens=np.arange(L, dtype=np.int32) + seed,
        loss_mask=mask,
        behavior_logp=np.where(mask, -0.25 - 0.01 * np.arange(L), 0).astype(np.float32),
        versions=np.where(mask, 3, -1).astype(np.int32),
        prompt_len=3,
        turn=2,
        turn_budget=7,
        aborts=1,
        done=done,
        finish_reason="abort",
    )


def _partials() -> dict[int, PartialGroup]:
    return {
        4: PartialGroup(4, "p4", 2, (_sample(11, 5, False), _sample(12, 0, True))),
        9: PartialGroup(9, "p9-é", 3, (_sample(2**31 - 1, 1, False), _sample(7, 9, False))),
    }


def _assert_equal(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for p, q in zip(a.values(), b.values()):
        assert (p.group_id, p.problem_id, p.dispatch_version) == (
            q.group_id,
            q.problem_id,
            q.dispatch_version,
        )
        for s, t in zip(p.samples, q.samples, strict=True):
            for f in ("tokens", "loss_mask", "behavior_logp", "versions"):
                np.testing.assert_array_equal(getattr(s, f), getattr(t, f))
                assert getattr(s, f).dtype == getattr(t, f).dtype
            for f in ("seed", "prompt_len", "turn", "turn_budget", "aborts", "done"):
                assert getattr(s, f) == getattr(t, f), f
            assert s.finish_reason == t.finish_reason


def test_partials_file_round_trips_and_a_tampered_one_is_skipped(tmp_path):
    parts = _partials()
    path = str(tmp_path / "partials_1.npz")
    save_partials(path, parts)
    _assert_equal(parts, load_partials(path))
    assert load_partials(str(tmp_path / "missing.npz")) == {}

    d = str(tmp_path / "ckpt")
    ckpt = Checkpointer(d, keep=3)
    try:
        ckpt.save(1, tiny_state(1), {"version": 1}, {}, {4: parts[4]})
        ckpt.save(2, tiny_state(2), {"version": 2}, {}, parts)
        ckpt.save(3, tiny_state(3), {"version": 3}, {})  # no partials: no file
        assert not os.path.exists(ckpt.partials_path(3))
        _, meta, groups, back = ckpt.restore(tiny_state(), step=2, partials=True)
        assert meta == {"version": 2} and groups == {}
        _assert_equal(parts, back)
        assert ckpt.restore(tiny_state(), partials=True)[3] == {}
    finally:
        ckpt.close()
    with open(os.path.join(d, "partials_2.npz"), "r+b") as f:  # one byte changed
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    shutil.rmtree(os.path.join(d, "3"))  # the tampered step 2 is the newest now
    ckpt = Checkpointer(d, keep=3)
    try:
        with pytest.raises(CheckpointError, match="partials file .* has sha256"):
            ckpt.restore(tiny_state(), step=2, partials=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, meta, _, back = ckpt.restore(tiny_state(), partials=True)
    finally:
        ckpt.close()
    assert meta == {"version": 1}  # step 2 skipped for step 1, with its own partials
    _assert_equal({4: parts[4]}, back)
    assert [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(build_task_tokenizer(str(tmp_path_factory.mktemp("tok"))))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["drain", "continue", "inflight"])
def test_halted_groups_come_back_partial_and_continue_after_their_tokens(tok, mode):
    """A real JaxEngine (update mode `mode`): halt + abort mid-generation gives PartialGroups;
    after a weight update to version 1, run_groups continues them: the saved tokens, log-probs
    and versions are kept, generation resumes after them up to the budget, at version 1."""
    task = LongTailTask(min_tokens=BUDGET, max_tokens=BUDGET)
    model = create_model(tiny(), seed=0)
    engine = JaxEngine(model, chunk=2, max_batch=8, update_mode=mode, deadline_s=120)
    problems = task.problems("train", 2)
    items = [(g, 0, problems[g], [100 * g + i for i in range(3)]) for g in range(2)]
    params = SamplingParams(max_new_tokens=BUDGET, temperature=1.0)
    halt = threading.Event()
    box: dict = {}
    worker = threading.Thread(
        target=lambda: box.update(
            out=run_groups(engine, task, tok, items, params, halt=halt.is_set)
        )
    )
    try:
        worker.start()
        t0 = time.monotonic()
        while engine.useful_steps < 6 * 4 and time.monotonic() - t0 < 120:  # tokens exist
            time.sleep(0.005)
        halt.set()
        engine.abort()
        worker.join(timeout=60)
        assert not worker.is_alive()
        parts = box["out"]
        assert all(isinstance(p, PartialGroup) for p in parts), parts
        assert [p.group_id for p in parts] == [0, 1]
        got = [s.num_generated for p in parts for s in p.samples]
        assert max(got) > 0 and max(got) < BUDGET, got
        assert all((s.versions[s.loss_mask > 0] == 0).all() for p in parts for s in p.samples)

        engine.resume()
        engine.update_weights(1, model).wait(60)
        resumed = [(*it, p) for it, p in zip(items, parts)]
        groups = run_groups(engine, task, tok, resumed, params)
    finally:
        engine.close()
    assert all(isinstance(g, EpisodeGroup) and g.dispatch_version == 0 for g in groups)
    for p, g in zip(parts, groups):
        for s, e in zip(p.samples, g.episodes, strict=True):
            n = len(s.tokens)
            np.testing.assert_array_equal(e.tokens[:n], s.tokens)
            np.testing.assert_array_equal(e.behavior_logp[:n], s.behavior_logp)
            np.testing.assert_array_equal(e.versions[:n], s.versions)
            assert e.num_generated == BUDGET  # the whole budget, earlier tokens included
            assert (e.versions[n:] == 1).all() and len(e.tokens) > n


def test_saved_partials_are_handed_out_once_and_the_rest_stay_saved():
    """At resume each saved partial goes to one dispatch (of concurrent dispatcher threads) and
    only once; the ones not handed out yet are what a new checkpoint keeps."""
    parts = {g: PartialGroup(g, f"p{g}", 0, ()) for g in range(64)}
    saved = SavedPartials(parts)
    assert saved and saved.left() == parts
    assert saved.take(3) is parts[3] and saved.take(3) is None and saved.take(99) is None
    assert 3 not in saved.left() and len(saved.left()) == 63
    got: list[int] = []

    def take_all():
        for g in range(64):
            if saved.take(g) is not None:
                got.append(g)

    threads = [threading.Thread(target=take_all) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == [g for g in range(64) if g != 3]  # each exactly once
    assert not saved and saved.left() == {}
    assert not SavedPartials() and SavedPartials(None).left() == {}
