"""The parameter server: learner checkpoints -> versioned HF safetensors dirs -> engine reloads.

Publication of version v:
  1. open the params of the learner's Orbax checkpoint (or take them from memory);
  2. convert them to HF names and layout and write `weights/v{v:06d}.tmp/` (config.json,
     generation_config.json, tokenizer files, safetensors shards + index), every file fsynced,
     then `manifest.json` (version, sha256 of every file) last. Shards are written in parallel,
     each tensor read from the checkpoint, transposed and cast while the one before it is
     written and hashed, so publishing from a checkpoint costs about what writing does;
  3. rename the directory to `weights/v{v:06d}/` and atomically replace `weights/LATEST`;
  4. tell every engine `(v, path)` and record each engine's acknowledged version.
A half-written directory is never visible under its final name, and engines verify the manifest
before loading. Retention keeps the newest `keep` directories plus every one an engine serves.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time

import jax
import numpy as np
from flax import nnx

from models.config import ModelConfig
from models.hf import fsync_path, hf_tensor_plan, save_hf_tensors
from rl.checkpoint import ParamReader, open_params, restore_params, sha256_file

MANIFEST = "manifest.json"


def io_workers() -> int:
    """Threads for parallel shard I/O and hashing."""
    return max(1, min(16, os.cpu_count() or 1))


def param_sources(params) -> dict:
    """{nnx path: host array} of in-memory params (one batched transfer off the devices)."""
    if isinstance(params, nnx.State):
        params = nnx.to_pure_dict(params)
    leaves, _ = jax.tree_util.tree_flatten_with_path(params)
    host = jax.device_get([x for _, x in leaves])
    return {tuple(str(getattr(k, "key", k)) for k in path): x for (path, _), x in zip(leaves, host)}


def version_dir(weights_dir: str, version: int) -> str:
    """The published directory of a version."""
    return os.path.join(weights_dir, f"v{version:06d}")


def latest(weights_dir: str) -> tuple[int, str] | None:
    """(version, path) named by weights/LATEST, or None."""
    p = os.path.join(weights_dir, "LATEST")
    if not os.path.exists(p):
        return None
    with open(p) as f:
        name = f.read().strip()
    return int(name.lstrip("v")), os.path.join(weights_dir, name)


@dataclasses.dataclass
class PublishResult:
    """What one publication did and how long each stage took (seconds)."""

    version: int
    path: str
    bytes: int
    restore_s: float = 0.0  # getting the params: restored, or (checkpoints) opened
    write_s: float = 0.0
    reload_s: float = 0.0
    acks: dict = dataclasses.field(default_factory=dict)
    errors: dict = dataclasses.field(default_factory=dict)


class ParamServer:
    """Publishes versioned HF weight directories and drives engines to them."""

    def __init__(
        self,
        weights_dir: str,
        config: ModelConfig,
        *,
        tokenizer_dir: str | None = None,
        keep: int = 3,
        dtype: str | None = None,
        max_shard_bytes: int = 5 * 10**8,  # several shards hash in parallel
        hf_overrides: dict | None = None,
    ):
        self.weights_dir = os.path.abspath(weights_dir)
        os.makedirs(self.weights_dir, exist_ok=True)
        self.config = config
        self.tokenizer_dir = tokenizer_dir
        self.keep = keep
        self.dtype = dtype
        self.max_shard_bytes = max_shard_bytes
        self.hf_overrides = hf_overrides or {}
        self.engine_versions: dict[str, int] = {}

    # -- writing --------------------------------------------------------------------------
    def write(self, version: int, params) -> tuple[str, int]:
        """Writes params as the HF directory of `version` (tmp, manifest, rename, LATEST).

        `params`: in-memory params, {path: ParamReader} of a checkpoint (open_params), read
        while earlier tensors are being written, or {HF name: array} in HF layout."""
        final = version_dir(self.weights_dir, version)
        tmp = final + ".tmp"
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
        is_readers = isinstance(params, dict) and all(
            isinstance(v, ParamReader) for v in params.values()
        )
        if (
            isinstance(params, dict)
            and params
            and all(
                isinstance(k, str) and "." in k and isinstance(v, np.ndarray)
                for k, v in params.items()
            )
        ):
            tensors = params  # {HF name: array} already in HF layout (the direct path's copy)
        else:
            sources = params if is_readers and params else param_sources(params)
            tensors = hf_tensor_plan(self.config, sources, dtype=self.dtype)
        digests: dict[str, str] = {}
        files = save_hf_tensors(
            self.config,
            tensors,
            tmp,
            tokenizer_dir=self.tokenizer_dir,
            max_shard_bytes=self.max_shard_bytes,
            digests=digests,
            workers=io_workers(),
        )
        if self.hf_overrides:  # e.g. eos/pad ids of the task tokenizer
            cfg_path = os.path.join(tmp, "config.json")
            with open(cfg_path) as f:
                hf = json.load(f)
            hf.update({k: v for k, v in self.hf_overrides.items() if hf.get(k) is None})
            with open(cfg_path, "w") as f:
                json.dump(hf, f, indent=2)
                f.flush()
                os.fsync(f.fileno())
        names = sorted((set(files) | set(os.listdir(tmp))) - {MANIFEST})
        # The shards were hashed as they were written; the small files are hashed here.
        for n in names:
            if n not in digests:
                digests[n] = sha256_file(os.path.join(tmp, n))
        manifest = {"version": version, "files": {n: digests[n] for n in names}}
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(tmp)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_path(self.weights_dir)
        latest_tmp = os.path.join(self.weights_dir, "LATEST.tmp")
        with open(latest_tmp, "w") as f:
            f.write(os.path.basename(final))
            f.flush()
            os.fsync(f.fileno())
        os.replace(latest_tmp, os.path.join(self.weights_dir, "LATEST"))
        nbytes = int(sum(t.nbytes for t in tensors.values()))
        return final, nbytes

    # -- publishing -----------------------------------------------------------------------
    def publish(
        self,
        version: int,
        engines: dict | None = None,
        *,
        params=None,
        checkpoint_dir: str | None = None,
        step: int | None = None,
    ) -> PublishResult:
        """Publishes `version` from in-memory params or a checkpoint, then reloads engines."""
        t0 = time.perf_counter()
        if params is None:
            if checkpoint_dir is None:
                raise ValueError("publish needs params or checkpoint_dir")
            try:
                params = open_params(checkpoint_dir, step)  # read during the write
            except ValueError:  # a layout open_params does not know: restore it whole
                params = restore_params(checkpoint_dir, step)
        t1 = time.perf_counter()
        path, nbytes = self.write(version, params)
        t2 = time.perf_counter()
        result = PublishResult(version, path, nbytes, restore_s=t1 - t0, write_s=t2 - t1)
        for name, engine in (engines or {}).items():
            try:
                engine.update_weights(version, path).wait()
                self.engine_versions[name] = version
                result.acks[name] = version
            except Exception as e:  # noqa: BLE001 - reported per engine; the rest still move
                result.errors[name] = f"{type(e).__name__}: {e}"
        result.reload_s = time.perf_counter() - t2
        self.retain()
        return result

    def served(self, name: str, version: int) -> None:
        """Records that engine `name` serves `version` and applies retention."""
        self.engine_versions[name] = version
        self.retain()

    def retain(self) -> list[str]:
        """Deletes old directories except the newest `keep` and any an engine still serves."""
        served = {version_dir(self.weights_dir, v) for v in self.engine_versions.values()}
        dirs = sorted(
            os.path.join(self.weights_dir, d)
            for d in os.listdir(self.weights_dir)
            if d.startswith("v")
            and not d.endswith(".tmp")
            and os.path.isdir(os.path.join(self.weights_dir, d))
        )
        removed = []
        for d in dirs[: max(0, len(dirs) - self.keep)]:
            if d not in served:
                shutil.rmtree(d)
                removed.append(d)
        return removed
