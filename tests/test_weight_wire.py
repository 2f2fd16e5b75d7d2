"""The direct weight path without a server: the wire format (whole tensors and deltas, verified
bit for bit), both transports, the learner-side serving copy against the HF export's tensors,
and the worker engine's refusals (checksums, versions, a missed delta) with vLLM's reload
replaced by a recorder. Against a real vLLM host: tests/test_vllm_direct.py."""

from __future__ import annotations

import types

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import models
from models.hf import hf_tensor_plan
from rl.param_server import param_sources
from rl.rollout import weight_stream, weight_wire
from rl.rollout.vllm_weight_engine import TandemWeightTransferEngine


def _bf16(rng, shape) -> np.ndarray:
    return (rng.standard_normal(shape) * 0.02).astype(ml_dtypes.bfloat16)


def _payload(parts: list[list[np.ndarray]]) -> memoryview:
    return memoryview(b"".join(p.reshape(-1).view(np.uint8).tobytes() for ps in parts for p in ps))


def test_delta_is_bit_exact_and_smaller():
    rng = np.random.default_rng(0)
    base = _bf16(rng, (64, 96))
    new = base.copy()
    flat = new.reshape(-1)
    idx = rng.choice(flat.size, 100, replace=False)
    flat[idx] = (flat[idx].astype(np.float32) * 1.5 + 1e-3).astype(ml_dtypes.bfloat16)
    encoding, parts, count = weight_wire.encode(new, base)
    assert encoding == "indices" and count == int(
        (new.view(np.uint16) != base.view(np.uint16)).sum()
    )
    entry = {
        "name": "w",
        "dtype": "bfloat16",
        "shape": [64, 96],
        "encoding": encoding,
        "offset": 0,
        "count": count,
        "checksum": weight_wire.checksum(new),
    }
    assert weight_wire.entry_size(entry) == count * 6 < new.nbytes
    host_copy = base.copy()
    out = weight_wire.decode(entry, _payload([parts]), host_copy)
    np.testing.assert_array_equal(out.view(np.uint16), new.view(np.uint16))

    # A wrong base (a host that missed a version) decodes to other bits: the checksum says so.
    other = base.copy()
    same = new.view(np.uint16).reshape(-1) == base.view(np.uint16).reshape(-1)
    other.reshape(-1)[np.flatnonzero(same)[0]] = 7.0
    with pytest.raises(weight_wire.WireError, match="checksum"):
        weight_wire.decode(entry, _payload([parts]), other)
    with pytest.raises(weight_wire.WireError, match="needs a base"):
        weight_wire.decode(entry, _payload([parts]), None)


def test_mostly_changed_tensor_goes_whole():
    rng = np.random.default_rng(1)
    base = rng.standard_normal((32, 32)).astype(np.float32)
    new = base + 1e-3
    encoding, parts, _ = weight_wire.encode(new, base)
    assert encoding == "full" and len(parts) == 1
    entry = dict(name="w", dtype="float32", shape=[32, 32], encoding="full", offset=0)
    entry["checksum"] = weight_wire.checksum(new)
    np.testing.assert_array_equal(weight_wire.decode(entry, _payload([parts]), None), new)
    entry["checksum"] = weight_wire.checksum(base)
    with pytest.raises(weight_wire.WireError, match="checksum"):
        weight_wire.decode(entry, _payload([parts]), None)


def test_shared_memory_and_socket_transports(tmp_path):
    data = np.arange(1 << 20, dtype=np.uint8)
    shm = weight_wire.ShmPayload(str(tmp_path))
    try:
        view = shm.buffer(data.size)
        view[:] = data.tobytes()
        got = weight_wire.read_shm(shm.path, data.size)
        assert bytes(got) == data.tobytes()
        server = weight_wire.PayloadServer("127.0.0.1", timeout_s=10)
        try:
            token = server.offer(view)
            assert bytes(weight_wire.read_socket(server.address, token, data.size, 10)) == bytes(
                view
            )
            with pytest.raises(weight_wire.WireError, match="expected"):
                weight_wire.read_socket(server.address, token, data.size + 1, 10)
            server.withdraw(token)
            with pytest.raises(weight_wire.WireError, match="does not know"):
                weight_wire.read_socket(server.address, token, data.size, 10)
        finally:
            server.close()
        del view, got
    finally:
        shm.unlink()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_serving_copy_matches_the_hf_export(dtype):
    config = models.tiny(dtype="float32", param_dtype="float32")
    mesh = models.make_mesh(devices=jax.devices()[:1])
    params = nnx.state(models.create_model(config, mesh, seed=0), nnx.Param)
    snap = weight_stream.snapshot(params, dtype)
    prepared = weight_stream.prepare(snap, version=3)
    reference = {
        name: t.make()
        for name, t in hf_tensor_plan(config, param_sources(params), dtype=dtype).items()
    }
    assert sorted(prepared.tensors) == sorted(reference)
    layers = [int(n.split(".")[2]) for n in prepared.tensors if n.startswith("model.layers.")]
    assert layers == sorted(layers)  # a layer's tensors together: the host reloads layer by layer
    for name, want in reference.items():
        got = prepared.tensors[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8), err_msg=name)
        assert prepared.checksums[name] == weight_wire.checksum(want)


class _Recorder:
    """The worker engine with vLLM's reload replaced by recording what it would load."""

    def __init__(self):
        vllm_config = types.SimpleNamespace(parallel_config=None, model_config=None)
        self.engine = TandemWeightTransferEngine(None, vllm_config, "cpu", None)
        self.loaded: list[dict] = []
        self.engine._load = lambda tensors: self.loaded.append(
            {k: np.array(v, copy=True) for k, v in tensors.items()}
        )


def _send(streamer, recorder, version, tensors, kind="auto", **changes):
    snap = weight_stream.Snapshot(
        [(n,) for n in tensors], [False] * len(tensors), list(tensors.values())
    )
    prepared = streamer.begin(snap, version)
    kind = streamer.payload(recorder.engine.base_version)[0] if kind == "auto" else kind
    info = streamer.update_info("http://127.0.0.1:1", kind)
    info.update(changes)
    recorder.engine.update_weights(info)
    streamer.finish(prepared, served=True)
    return kind, info


def test_worker_engine_versions_checksums_and_missed_deltas(tmp_path):
    rng = np.random.default_rng(2)
    v1 = {"a": _bf16(rng, (128, 64)), "b": _bf16(rng, (256,))}
    streamer = weight_stream.WeightStreamer("bfloat16", delta=True, shm_dir=str(tmp_path))
    rec = _Recorder()
    try:
        assert _send(streamer, rec, 1, v1)[0] == "full"
        v2 = {k: v.copy() for k, v in v1.items()}
        v2["a"][3, :5] += ml_dtypes.bfloat16(0.5)
        kind, info = _send(streamer, rec, 2, v2)
        assert kind == "delta" and info["nbytes"] < sum(v.nbytes for v in v2.values()) / 10
        for k in v2:
            np.testing.assert_array_equal(rec.loaded[-1][k].view(np.uint16), v2[k].view(np.uint16))

        with pytest.raises(ValueError, match="versions only go up"):
            _send(streamer, rec, 2, v2)
        # A delta on a version this host does not hold is refused: it needs the full version.
        v3 = {k: v.copy() for k, v in v2.items()}
        v3["b"][:3] = ml_dtypes.bfloat16(1.0)
        with pytest.raises(ValueError, match="needs the full version"):
            _send(streamer, rec, 3, v3, kind="delta", base_version=1)
        # A checksum that does not match refuses the update before anything is loaded.
        loads = len(rec.loaded)
        bad = streamer.update_info  # one entry's checksum altered on the way
        streamer.update_info = lambda url, kind: _corrupt(bad(url, kind))
        with pytest.raises(weight_wire.WireError, match="checksum"):
            _send(streamer, rec, 3, v3, kind="full")
        streamer.update_info = bad
        assert len(rec.loaded) == loads and rec.engine.base_version is None
        assert _send(streamer, rec, 3, v3)[0] == "full"  # no base now: whole again
        np.testing.assert_array_equal(rec.loaded[-1]["b"].view(np.uint16), v3["b"].view(np.uint16))
    finally:
        streamer.close()


def _corrupt(info: dict) -> dict:
    info["tensors"][0]["checksum"] = "0" * 16
    return info
