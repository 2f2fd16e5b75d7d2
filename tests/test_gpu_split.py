"""The local transport's device split (trainer.rollout_devices / learner_devices), on the 4 fake
CPU devices of conftest: the rollout engine's params live on its devices and the learner's on its
mesh, a split engine gives the one-device engine's tokens, weights reach it device to device
(update_weights in the background), a split sync run reproduces the unsplit run, and an async run on
a 2 + 2 split completes within its staleness bound. The same code splits a host's GPUs."""

import json
import threading

import jax
import numpy as np
import pytest
from flax import nnx
from model_weights import randomize
from run_files import compared_keys

from models import create_model, tiny
from rl import config as C
from rl.placement import device_split
from rl.rollout.base import GenerationRequest, SamplingParams
from rl.rollout.jax_engine import JaxEngine
from rl.trainer import Trainer

CONFIG = tiny()


def _reqs(n, max_new=10):
    rng = np.random.RandomState(3)
    return [
        GenerationRequest(
            f"r{i}",
            rng.randint(3, CONFIG.vocab_size, size=2 + i % 5).astype(np.int32),
            SamplingParams(max_new_tokens=max_new - i % 3, temperature=1.0, seed=40 + i),
        )
        for i in range(n)
    ]


def _devices_of(tree) -> set:
    return set().union(*(x.devices() for x in jax.tree.leaves(tree)))


# -- config validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["trainer.rollout_devices=[0, 0]"], r"trainer.rollout_devices: invalid value \[0, 0\]"),
        (["trainer.rollout_devices=[-1]"], r"trainer.rollout_devices: invalid value \[-1\]"),
        (
            ["trainer.learner_devices=[1]"],
            r"trainer.learner_devices: \[1\] needs .*rollout_devices",
        ),
        (
            ["trainer.rollout_devices=[0, 1]", "trainer.learner_devices=[1]"],
            r"trainer.learner_devices: \[1\] overlaps trainer.rollout_devices \[0, 1\] on \[1\]",
        ),
        (
            ["trainer.rollout_devices=[0]", "trainer.pin_cores=true"],
            r"trainer.rollout_devices: \[0\] .* needs trainer.pin_cores false",
        ),
        (
            ["trainer.rollout_devices=[0]", "trainer.transport=ray"],
            r"trainer.rollout_devices: \[0\] .* needs trainer.transport 'local' \(got 'ray'",
        ),
        (
            ["trainer.rollout_devices=[0]", "rollout.engine=vllm"],
            r"trainer.rollout_devices: \[0\] .* needs rollout.engine 'jax' \(got 'vllm'\)",
        ),
        (
            ["trainer.rollout_devices=[0]", "trainer.learner_devices=[1, 2]"],
            r"trainer.learner_devices: \[1, 2\] \(2 devices\) but learner.mesh 1x1x1 uses 1",
        ),
    ],
)
def test_config_rejects_bad_splits(overrides, match):
    with pytest.raises(C.ConfigError, match=match):
        C.load(None, overrides)


def test_split_resolves_on_this_host():
    devs = jax.devices()
    assert len(devs) == 4
    assert device_split(C.load(None, [])) is None
    s = device_split(C.load(None, ["trainer.rollout_devices=[0]", "learner.mesh.data=3"]))
    assert s.rollout == (devs[0],) and s.learner == tuple(devs[1:])  # empty = every other one
    s = device_split(C.load(None, ["trainer.rollout_devices=[3]", "trainer.learner_devices=[1]"]))
    assert s.rollout == (devs[3],) and s.learner == (devs[1],)
    with pytest.raises(C.ConfigError, match=r"trainer.rollout_devices: \[4\] names device\(s\) "):
        device_split(C.load(None, ["trainer.rollout_devices=[4]", "trainer.learner_devices=[0]"]))
    with pytest.raises(C.ConfigError, match=r"valid: 0..3"):
        device_split(C.load(None, ["trainer.rollout_devices=[0]", "trainer.learner_devices=[7]"]))
    with pytest.raises(C.ConfigError, match=r"learner.mesh: 1x1x1 uses 1 device\(s\), but the "):
        device_split(C.load(None, ["trainer.rollout_devices=[0]"]))  # 3 left, mesh of 1


# -- the engine on its own devices ------------------------------------------------------------


@pytest.fixture(scope="module")
def models():
    return randomize(create_model(CONFIG, seed=0), 0), randomize(create_model(CONFIG, seed=0), 1)


@pytest.mark.slow
def test_engine_on_two_devices_equals_one_device_engine(models):
    old, new = models
    devs = jax.devices()
    split = JaxEngine(old, chunk=4, devices=devs[:2], background_install=True)
    ref = JaxEngine(old, chunk=4, devices=devs[3:])
    assert _devices_of(split.params) == {devs[0], devs[1]}
    assert _devices_of(ref.params) == {devs[3]}
    reqs = _reqs(5)  # 5 rows: bucket 8, split 4 + 4 over the two devices
    before = split.generate(reqs)
    for got, want in zip(before, ref.generate(reqs)):
        np.testing.assert_array_equal(got.token_ids, want.token_ids)
        assert np.abs(got.logprobs - want.logprobs).max() < 1e-5
        assert (got.versions == 0).all()
    # the same programs as the one-device engine (layout, prefill, insert, decodes, relayouts)
    traces = split.stats()["traces"]
    assert split.stats()["busy_s"] > 0 and traces == ref.stats()["traces"] >= 2

    # New weights from a model on another device, served asynchronously, then by version 1.
    served = threading.Event()
    got_version = []
    split.update_weights(1, nnx.state(new, nnx.Param)).then(
        lambda v: (got_version.append(v), served.set())
    )
    assert served.wait(60) and got_version == [1]
    assert _devices_of(split.params) == {devs[0], devs[1]}
    assert len(split.sync_times) == 1 and split.sync_times[0]["total_s"] > 0
    ref.update_weights(1, nnx.state(new, nnx.Param)).wait()
    after, want = split.generate(reqs), ref.generate(reqs)
    for a, w in zip(after, want):
        np.testing.assert_array_equal(a.token_ids, w.token_ids)
        assert (a.versions == 1).all()
    assert any(not np.array_equal(a.token_ids, b.token_ids) for a, b in zip(after, before))
    assert split.stats()["traces"] == traces  # new weights and the same requests: no new program


# -- the trainer ------------------------------------------------------------------------------

RUN = [
    "task.name=longtail",
    "task.options={min_tokens: 4, max_tokens: 12}",
    "task.num_eval=4",
    "sft.steps=0",
    "rollout.prompts_per_update=2",
    "rollout.group_size=4",
    "rollout.batch_size=8",
    "rollout.max_new_tokens=12",
    "algorithm.filter_zero_advantage=false",
    "trainer.total_updates=3",
    "trainer.eval_every=0",
    "logging.progress=false",
    "logging.tensorboard=false",
    "seed=5",
]


def _run(tmp_path, name, *extra):
    """Trains; returns (metrics by step, the devices of the engine's and the learner's params)."""
    trainer = Trainer(C.load(None, [*RUN, f"run_root={tmp_path}", f"name={name}", *extra]))
    engines = []
    trainer.run(on_engine=engines.append)
    with open(tmp_path / name / "metrics.jsonl") as f:
        rows = {r["step"]: r for r in map(json.loads, f)}
    return rows, _devices_of(engines[0].params), _devices_of(trainer.learner.params()), trainer


@pytest.mark.slow
def test_split_sync_run_reproduces_unsplit_run(tmp_path):
    devs = jax.devices()
    plain, eng_devs, learner_devs, _ = _run(tmp_path, "plain", "trainer.placement=in_process")
    assert eng_devs == learner_devs == {devs[0]}
    split, eng_devs, learner_devs, _ = _run(
        tmp_path, "split", "trainer.rollout_devices=[0]", "trainer.learner_devices=[1]"
    )
    assert eng_devs == {devs[0]} and learner_devs == {devs[1]}
    assert sorted(plain) == sorted(split) == [0, 1, 2, 3]
    for step in plain:
        for key in compared_keys(plain[step], step):
            assert split[step][key] == pytest.approx(plain[step][key], abs=1e-6), (step, key)


@pytest.mark.slow
def test_async_run_on_two_plus_two_devices(tmp_path):
    devs = jax.devices()
    rows, eng_devs, learner_devs, trainer = _run(
        tmp_path,
        "async",
        "trainer.mode=async",
        "trainer.max_staleness=1",
        "trainer.rollout_devices=[0, 1]",
        "trainer.learner_devices=[2, 3]",
        "learner.mesh.data=2",
    )
    assert eng_devs == {devs[0], devs[1]} and learner_devs == {devs[2], devs[3]}
    assert set(trainer.learner.mesh.devices.flat) == {devs[2], devs[3]}
    assert sorted(rows) == [0, 1, 2, 3]
    assert all(rows[s]["staleness/max"] <= 1 for s in (1, 2, 3))
    assert all(np.isfinite(rows[s]["loss/loss"]) for s in (1, 2, 3))
