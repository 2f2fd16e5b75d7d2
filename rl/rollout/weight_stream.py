"""The sending side of the direct weight path: the learner's params -> HF-named tensors in the
serving dtype -> a payload (whole tensors, or only the changed elements) -> vLLM's weight-update
endpoints on each host, whose worker engine (rl/rollout/vllm_weight_engine.py) verifies and
loads it. No file is written on the way; the HF directory is the durable record, written after.

The learner is blocked only while one compiled function is dispatched: it transposes the
kernels to HF layout and casts every tensor to the serving dtype into new arrays, so the next
optimizer step may donate the params. Everything else runs on the engine's update thread.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from urllib.parse import urlparse

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.hf import hf_name
from rl.rollout import weight_wire

log = logging.getLogger(__name__)

TRANSPORTS = ("auto", "shm", "tcp")
LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}


@dataclasses.dataclass
class Snapshot:
    """One version's serving tensors, still on the learner's devices (being computed)."""

    names: list[tuple[str, ...]]  # per output: the HF name of each layer slice (or one name)
    stacked: list[bool]  # per output: whether it stacks the decoder layers (leading axis)
    arrays: list[jax.Array]


@dataclasses.dataclass
class Prepared:
    """One version's serving tensors on this host, with the checksum of each."""

    version: int
    tensors: dict[str, np.ndarray]
    checksums: dict[str, str]

    @property
    def nbytes(self) -> int:
        """Bytes of the whole version."""
        return sum(t.nbytes for t in self.tensors.values())


@dataclasses.dataclass
class Payload:
    """A version encoded against a base (or whole), laid out in one buffer."""

    version: int
    base_version: int | None
    entries: list[dict]
    nbytes: int
    changed: int  # elements whose bits differ from the base (all of them without a base)
    elements: int  # elements of the whole version


@functools.lru_cache(maxsize=8)
def _serving_fn(dtype: str, transposed: tuple[bool, ...], stacked: tuple[bool, ...]):
    """A compiled function: flat params -> HF-layout copies in the serving dtype."""
    to = jnp.dtype(dtype)

    def fn(leaves):
        out = []
        for x, t, s in zip(leaves, transposed, stacked):
            if t:
                lead = 1 if s else 0
                x = jnp.transpose(x, (*range(lead), *reversed(range(lead, x.ndim))))
            out.append(jnp.array(x, dtype=to, copy=True))  # a new buffer even when unchanged
        return out

    return jax.jit(fn)


def _flatten(params) -> list[tuple[tuple[str, ...], jax.Array]]:
    if isinstance(params, nnx.Module):
        params = nnx.state(params, nnx.Param)
    if isinstance(params, nnx.State):
        params = nnx.to_pure_dict(params)
    leaves, _ = jax.tree_util.tree_flatten_with_path(params)
    return [(tuple(str(getattr(k, "key", k)) for k in path), x) for path, x in leaves]


def snapshot(params, dtype: str) -> Snapshot:
    """Dispatches the HF-layout, serving-dtype copy of `params` (returns before it is done)."""
    flat = _flatten(params)
    names, transposed, stacked = [], [], []
    for path, x in flat:
        is_stacked = len(path) > 2 and path[0] == "model" and path[1] == "layers"
        layers = range(x.shape[0]) if is_stacked else [None]
        per_layer = [hf_name(path, layer) for layer in layers]
        names.append(tuple(n for n, _ in per_layer))
        transposed.append(per_layer[0][1])
        stacked.append(is_stacked)
    fn = _serving_fn(dtype, tuple(transposed), tuple(stacked))
    return Snapshot(names, stacked, fn([x for _, x in flat]))


def prepare(snap: Snapshot, version: int, workers: int | None = None) -> Prepared:
    """The snapshot on this host as {HF name: C-contiguous array}, each with its checksum."""
    tensors: dict[str, np.ndarray] = {}
    for names, stacked, array in zip(snap.names, snap.stacked, jax.device_get(snap.arrays)):
        array = np.asarray(array)
        if not stacked:
            tensors[names[0]] = np.ascontiguousarray(array)
        for i, name in enumerate(names if stacked else ()):
            tensors[name] = np.ascontiguousarray(array[i])
    tensors = dict(sorted(tensors.items(), key=lambda kv: _hf_order(kv[0])))
    with concurrent.futures.ThreadPoolExecutor(workers or _workers()) as pool:
        sums = dict(zip(tensors, pool.map(weight_wire.checksum, tensors.values())))
    return Prepared(version, tensors, sums)


def _hf_order(name: str) -> tuple:
    """embed_tokens, layers by number, norm, lm_head: a layer's tensors arrive together, so
    the host processes each layer as soon as it has all of them."""
    parts = name.split(".")
    if parts[0] == "lm_head":
        return (3, 0, name)
    if len(parts) > 2 and parts[1] == "layers":
        return (1, int(parts[2]), name)
    return (0 if "embed_tokens" in parts else 2, 0, name)


def encode(prepared: Prepared, base: Prepared | None, buffer: Callable[[int], memoryview]):
    """Lays `prepared` out (changed elements against `base` where smaller) in buffer(nbytes)."""
    entries, chunks = [], []
    offset = changed = elements = 0
    for name, tensor in prepared.tensors.items():
        old = None if base is None else base.tensors.get(name)
        encoding, parts, count = weight_wire.encode(tensor, old)
        entry = {
            "name": name,
            "dtype": str(tensor.dtype),
            "shape": list(tensor.shape),
            "encoding": encoding,
            "offset": offset,
            "checksum": prepared.checksums[name],
        }
        if encoding != "full":
            entry["count"] = count
        changed += count
        elements += tensor.size
        entries.append(entry)
        chunks.append((offset, parts))
        offset += weight_wire.entry_size(entry)
    view = buffer(offset)
    for start, parts in chunks:
        for part in parts:
            raw = part.reshape(-1).view(np.uint8)
            np.frombuffer(view, np.uint8, raw.size, start)[:] = raw
            start += raw.size
    del view
    return Payload(
        prepared.version,
        None if base is None else base.version,
        entries,
        offset,
        changed,
        elements,
    )


def is_local(url: str) -> bool:
    """Whether a host URL names this machine (its payloads can go through shared memory)."""
    host = urlparse(url).hostname or ""
    return host in LOCAL_HOSTS or host in {socket.gethostname(), socket.getfqdn()}


def _workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


class WeightStreamer:
    """Sends versions to vLLM hosts: whole or as deltas against the version a host holds.

    `delta`: send changed elements where smaller (hosts keep a copy of the version they serve).
    `transport`: "shm" (same node), "tcp" (a socket this streamer serves on `bind_host`), or
    "auto" (shm for hosts whose URL names this machine, else tcp). `record(version, tensors)`,
    if given, writes the durable copy (an HF directory) after the hosts serve a version.
    """

    def __init__(
        self,
        dtype: str = "float32",
        *,
        delta: bool = False,
        transport: str = "auto",
        bind_host: str = "127.0.0.1",
        shm_dir: str = "/dev/shm",
        timeout_s: float = 120.0,
        record: Callable[[int, dict], object] | None = None,
        template=None,
    ):
        if transport not in TRANSPORTS:
            raise ValueError(f"transport={transport!r}; valid: {TRANSPORTS}")
        self.dtype = dtype
        self.delta = delta
        self.transport = transport
        self.bind_host = bind_host
        self.timeout_s = timeout_s
        self.record = record
        self.template = template  # a params tree, for weights that come as flat arrays
        self.recorded: int | None = None  # the newest version whose durable copy is written
        self.record_error: str | None = None
        self._pending: Prepared | None = None
        self._recorder: threading.Thread | None = None
        self._record_lock = threading.Lock()
        self.base: Prepared | None = None  # the last version sent (the base of deltas)
        self._buffers = {
            "full": weight_wire.ShmPayload(shm_dir),
            "delta": weight_wire.ShmPayload(shm_dir),
        }
        self._payloads: dict[str, Payload] = {}
        self._server: weight_wire.PayloadServer | None = None
        self.stats: dict[str, float] = {}

    def snapshot(self, params) -> Snapshot:
        """See snapshot(): the learner is blocked only for this."""
        return snapshot(params, self.dtype)

    def begin(self, snap: Snapshot, version: int) -> Prepared:
        """Brings a version to this host and encodes it (whole, and as a delta if enabled)."""
        t0 = time.perf_counter()
        prepared = prepare(snap, version)
        t1 = time.perf_counter()
        self._payloads = {}
        self._payloads["full"] = encode(prepared, None, self._buffers["full"].buffer)
        if self.delta and self.base is not None:
            self._payloads["delta"] = encode(prepared, self.base, self._buffers["delta"].buffer)
        self.stats = {"fetch_s": t1 - t0, "encode_s": time.perf_counter() - t1}
        return prepared

    def payload(self, host_version: int) -> tuple[str, Payload]:
        """Which payload a host serving `host_version` gets: the delta if it is on the base."""
        delta = self._payloads.get("delta")
        if delta is not None and host_version == delta.base_version:
            return "delta", delta
        return "full", self._payloads["full"]

    def sent(self, kind: str) -> tuple[Payload, memoryview] | None:
        """The current version's payload `kind` ("full" or "delta") and its bytes, or None."""
        p = self._payloads.get(kind)
        return None if p is None else (p, self._buffers[kind].buffer(p.nbytes))

    def update_info(self, url: str, kind: str) -> dict:
        """The body of POST /update_weights that sends payload `kind` to the host at `url`."""
        p = self._payloads[kind]
        info = {
            "version": p.version,
            "nbytes": p.nbytes,
            "tensors": p.entries,
            "base_version": p.base_version,
            "keep_base": self.delta,
            "timeout_s": self.timeout_s,
        }
        transport = self.transport
        if transport == "auto":
            transport = "shm" if is_local(url) else "tcp"
        if transport == "shm":
            info.update(transport="shm", location=self._buffers[kind].path)
        else:
            if self._server is None:
                self._server = weight_wire.PayloadServer(self.bind_host, timeout_s=self.timeout_s)
            view = self._buffers[kind].buffer(p.nbytes)
            info.update(
                transport="tcp", location=self._server.address, token=self._server.offer(view)
            )
        return info

    def finish(self, prepared: Prepared, served: bool) -> None:
        """Ends a version's sending: it becomes the delta base if any host serves it."""
        if self._server is not None:
            self._server.close()
            self._server = None
        if served and self.delta:
            self.base = prepared

    def record_later(self, prepared: Prepared) -> None:
        """Writes the durable copy of a served version in the background; a version still
        waiting when a newer one comes is skipped (a restarted host wants the newest)."""
        if self.record is None:
            return
        with self._record_lock:
            self._pending = prepared
            if self._recorder is None:
                self._recorder = threading.Thread(
                    target=self._record_loop, name="weights-record", daemon=True
                )
                self._recorder.start()

    def wait_recorded(self, timeout_s: float) -> None:
        """Blocks until no durable copy is being written; TimeoutError after timeout_s."""
        end = time.monotonic() + timeout_s
        while True:
            with self._record_lock:
                if self._recorder is None:
                    return
            if time.monotonic() >= end:
                raise TimeoutError(f"durable weight copy still being written after {timeout_s} s")
            time.sleep(0.01)

    def _record_loop(self) -> None:
        while True:
            with self._record_lock:
                prepared, self._pending = self._pending, None
                if prepared is None:
                    self._recorder = None
                    return
            try:
                self.record(prepared.version, prepared.tensors)
                self.recorded = prepared.version
            except Exception as e:  # noqa: BLE001 - kept for the caller; the hosts serve on
                self.record_error = f"version {prepared.version}: {type(e).__name__}: {e}"
                log.error("durable copy of weights failed: %s", self.record_error)

    def close(self) -> None:
        """Removes the shared-memory files and stops the socket server."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for b in self._buffers.values():
            b.unlink()
