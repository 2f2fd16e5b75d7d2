"""The parameter server: a learner's Orbax checkpoint -> a versioned HF directory that transformers
loads with the learner's logits, a manifest of sha256s, LATEST, crash safety, retention of the
newest K plus served versions, and per-engine errors that do not stop the other engines."""

from __future__ import annotations

import hashlib
import json
import os

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from models import create_model, make_mesh, tiny
from models.tokenizer import build_task_tokenizer
from rl.checkpoint import Checkpointer
from rl.learner import Learner, StepConfig, make_batch, make_optimizer
from rl.param_server import MANIFEST, ParamServer, latest, version_dir
from rl.rollout.base import Weights, WeightUpdate
from rl.rollout.jax_engine import JaxEngine
from rl.rollout.vllm_host import VLLMError, verify_weights_dir
from rl.types import Episode

CONFIG = tiny()  # the vLLM-compatible tiny shape (2 layers, hidden 128, untied head)
UPDATES = 3  # learner updates before the checkpoint


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _episodes(n: int = 8, length: int = 24, seed: int = 0) -> list[Episode]:
    """Random-token demonstrations (first 4 tokens prompt), all trained."""
    rng = np.random.RandomState(seed)
    eps = []
    for i in range(n):
        mask = np.ones(length, np.int8)
        mask[:4] = 0
        tokens = rng.randint(0, CONFIG.vocab_size, length)
        eps.append(
            Episode(f"e{i}", tokens, mask, np.zeros(length), np.zeros(length, np.int32), 4, 1.0)
        )
    return eps


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny learner after UPDATES supervised updates, its Orbax checkpoint and a tokenizer."""
    root = tmp_path_factory.mktemp("ps")
    mesh = make_mesh(devices=jax.devices()[:1])
    learner = Learner(
        create_model(CONFIG, mesh, seed=0),
        make_optimizer(1e-2, total_steps=UPDATES),
        mesh=mesh,
        step_cfg=StepConfig(loss="sft", temperature=1.0),
    )
    batch = make_batch(_episodes(), np.zeros(8))
    for _ in range(UPDATES):
        learner.update(batch)
    ckpt_dir = str(root / "checkpoints")
    ckpt = Checkpointer(ckpt_dir)
    ckpt.save(UPDATES, learner.state, {"version": learner.version})
    ckpt.close()
    tok_dir = build_task_tokenizer(str(root / "tokenizer"))
    tokens_BT = np.random.RandomState(1).randint(0, CONFIG.vocab_size, (2, 20)).astype(np.int32)
    logits_BTV = np.asarray(jax.device_get(learner.model(tokens_BT)), np.float32)
    return dict(
        learner=learner,
        ckpt_dir=ckpt_dir,
        tok_dir=tok_dir,
        tokens=tokens_BT,
        logits=logits_BTV,
        params=jax.tree.map(np.asarray, nnx.to_pure_dict(learner.params())),
    )


def _server(tmp_path, trained, **kw) -> ParamServer:
    return ParamServer(str(tmp_path / "weights"), CONFIG, tokenizer_dir=trained["tok_dir"], **kw)


@pytest.mark.slow
def test_publish_from_checkpoint_loads_in_transformers(tmp_path, trained):
    ps = _server(tmp_path, trained, max_shard_bytes=600_000)  # ~2.1 MB of weights: 4 shards
    result = ps.publish(UPDATES, checkpoint_dir=trained["ckpt_dir"])
    assert result.path == version_dir(ps.weights_dir, UPDATES) and os.path.isdir(result.path)
    assert result.errors == {} and result.acks == {}
    n_weights = sum(x.size for x in jax.tree.leaves(trained["params"]))
    assert result.bytes == 4 * n_weights  # float32, every weight once

    files = sorted(os.listdir(result.path))
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) == 4 and "model.safetensors.index.json" in files
    assert {"config.json", "tokenizer.json", MANIFEST} <= set(files)

    # The manifest lists every other file with its sha256 (computed here independently).
    with open(os.path.join(result.path, MANIFEST)) as f:
        manifest = json.load(f)
    assert manifest["version"] == UPDATES
    assert sorted(manifest["files"]) == [f for f in files if f != MANIFEST]
    for name, digest in manifest["files"].items():
        assert digest == _sha256(os.path.join(result.path, name)), name
    assert verify_weights_dir(result.path, UPDATES)["version"] == UPDATES

    # transformers (float32) gives the learner's logits.
    model = transformers.AutoModelForCausalLM.from_pretrained(result.path, dtype=torch.float32)
    with torch.no_grad():
        theirs = model(torch.as_tensor(trained["tokens"], dtype=torch.long)).logits.numpy()
    ours = trained["logits"]
    assert theirs.shape == ours.shape == (2, 20, CONFIG.vocab_size)
    assert np.abs(ours).max() > 1.0  # trained, peaked weights: a wrong layout would show
    print(f"transformers vs learner logits: max |diff| = {np.abs(theirs - ours).max():.2e}")
    np.testing.assert_allclose(theirs, ours, atol=1e-5, rtol=0)

    # The trainer's path (the learner's live nnx.State, no checkpoint) writes the same bytes.
    live = ps.publish(UPDATES + 1, params=trained["learner"].params())
    with open(os.path.join(live.path, MANIFEST)) as f:
        live_files = json.load(f)["files"]
    for name in shards:
        assert live_files[name] == manifest["files"][name], name


def test_latest_names_the_newest_version(tmp_path, trained):
    ps = _server(tmp_path, trained)
    assert latest(ps.weights_dir) is None
    for v in (1, 2, 5):
        ps.publish(v, params=trained["params"])
        with open(os.path.join(ps.weights_dir, "LATEST")) as f:
            assert f.read() == f"v{v:06d}"
        assert latest(ps.weights_dir) == (v, version_dir(ps.weights_dir, v))
    assert not os.path.exists(os.path.join(ps.weights_dir, "LATEST.tmp"))


def test_crash_between_write_and_rename_leaves_only_a_tmp_dir(tmp_path, trained, monkeypatch):
    ps = _server(tmp_path, trained)
    ps.publish(1, params=trained["params"])
    real_rename = os.rename

    def crash(src, dst):
        raise OSError(f"simulated crash before renaming {src} -> {dst}")

    monkeypatch.setattr(os, "rename", crash)
    engine = _RecordingEngine()
    with pytest.raises(OSError, match="simulated crash"):
        ps.publish(2, {"e": engine}, params=trained["params"])
    monkeypatch.setattr(os, "rename", real_rename)

    final = version_dir(ps.weights_dir, 2)
    assert not os.path.exists(final) and os.path.isdir(final + ".tmp")
    assert os.path.isfile(os.path.join(final + ".tmp", MANIFEST))  # fully written, not renamed
    assert latest(ps.weights_dir) == (1, version_dir(ps.weights_dir, 1))
    assert engine.calls == []  # no engine was told about the unpublished version
    with pytest.raises(VLLMError, match="half-written .tmp"):
        verify_weights_dir(final + ".tmp")
    with pytest.raises(VLLMError, match="does not exist"):
        verify_weights_dir(final, 2)

    # Publishing the version again replaces the stale .tmp dir.
    ps.publish(2, {"e": engine}, params=trained["params"])
    assert not os.path.exists(final + ".tmp") and os.path.isdir(final)
    assert latest(ps.weights_dir) == (2, final) and engine.calls == [(2, final)]


def test_verify_refuses_a_corrupted_file(tmp_path, trained):
    ps = _server(tmp_path, trained)
    path = ps.publish(1, params=trained["params"]).path
    with open(os.path.join(path, "model.safetensors"), "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\0\0\0\1")
    with pytest.raises(VLLMError, match="sha256 of .*model.safetensors"):
        verify_weights_dir(path, 1)
    with pytest.raises(VLLMError, match="says version 1, but version 2"):
        verify_weights_dir(path, 2, checksums=False)


class _RecordingEngine:
    """Checks each directory it is told about as a vLLM host would, then records (v, path)."""

    def __init__(self, fail_from: int | None = None):
        self.fail_from = fail_from
        self.calls: list[tuple[int, str]] = []

    def update_weights(self, version: int, weights) -> WeightUpdate:
        if self.fail_from is not None and version >= self.fail_from:
            raise VLLMError(f"host down: cannot load version {version}")
        path = Weights.of(weights).path()
        verify_weights_dir(path, version)
        self.calls.append((version, path))
        return WeightUpdate.served(version)


def test_retention_keeps_newest_and_served_and_a_failing_engine_is_reported(tmp_path, trained):
    ps = _server(tmp_path, trained, keep=2)
    learner = trained["learner"]
    jax_engine = JaxEngine(create_model(CONFIG, seed=7), version=0)  # different weights
    stuck = _RecordingEngine(fail_from=2)  # serves v1 forever
    ok = _RecordingEngine()
    engines = {"jax": jax_engine, "stuck": stuck, "ok": ok}
    for v in range(1, 6):
        result = ps.publish(v, engines, params=trained["params"])
        if v == 1:
            assert result.errors == {}
        else:
            assert list(result.errors) == ["stuck"]
            assert f"version {v}" in result.errors["stuck"]
        assert result.acks == {"jax": v, "ok": v} | ({"stuck": 1} if v == 1 else {})
        assert ps.engine_versions == {"jax": v, "stuck": 1, "ok": v}
    assert [c[0] for c in ok.calls] == [1, 2, 3, 4, 5] and [c[0] for c in stuck.calls] == [1]

    # The JAX engine moved: it serves v5 and holds the learner's weights.
    assert jax_engine.version == 5
    served = jax.tree.map(np.asarray, nnx.to_pure_dict(jax_engine.served_params()))
    want = jax.tree.map(np.asarray, nnx.to_pure_dict(learner.params()))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), served, want)

    # Newest 2 (v4, v5) plus v1, which `stuck` still serves; v2 and v3 are gone.
    kept = sorted(d for d in os.listdir(ps.weights_dir) if d.startswith("v"))
    assert kept == ["v000001", "v000004", "v000005"]
    # Once `stuck` moves on, v1 is released at the next retention pass.
    ps.engine_versions["stuck"] = 5
    assert ps.retain() == [version_dir(ps.weights_dir, 1)]
    assert sorted(d for d in os.listdir(ps.weights_dir) if d.startswith("v")) == [
        "v000004",
        "v000005",
    ]


def test_checkpoint_publication_reads_each_stacked_parameter_once(trained):
    """Streaming from a checkpoint reads every parameter once, however many layer tensors it
    is sliced into, and gives the tensors of the plain conversion."""
    from models.hf import hf_tensor_plan, to_hf_tensors
    from rl.checkpoint import open_params

    readers = open_params(trained["ckpt_dir"])
    reads = {}

    def counted(read, key):
        def read_counted():
            reads[key] = reads.get(key, 0) + 1
            return read()

        return read_counted

    for key, r in readers.items():
        r.read = counted(r.read, key)
    plan = hf_tensor_plan(CONFIG, readers)
    got = {name: t.make() for name, t in plan.items()}
    assert reads == {key: 1 for key in readers}
    stacked = [k for k in readers if k[:2] == ("model", "layers")]
    assert stacked and all(len(readers[k].shape) >= 2 for k in stacked)
    plain = to_hf_tensors(CONFIG, trained["params"])
    assert sorted(got) == sorted(plain)
    assert all(np.array_equal(got[k], plain[k]) and got[k].dtype == plain[k].dtype for k in plain)
    up = plain["model.layers.1.mlp.up_proj.weight"]
    kernel = trained["params"]["model"]["layers"]["mlp"]["up_proj"]["kernel"]
    assert np.array_equal(up, np.asarray(kernel[1]).T)
