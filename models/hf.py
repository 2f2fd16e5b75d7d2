"""Hugging Face interop: safetensors tensors <-> parameter state, and load_hf / save_hf.

Names map one to one, except that the decoder layers are stacked: slice i of the nnx parameter
`model.layers.self_attn.q_proj.kernel` [L, in, out] is the HF tensor
`model.layers.{i}.self_attn.q_proj.weight` transposed (torch Linear is (out, in), Flax (in, out));
`embedding` becomes `weight` as is; biases and norm weights keep their names. A tied model has no
`lm_head.weight`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import fnmatch
import functools
import hashlib
import json
import os
import shutil
import threading
from collections.abc import Callable, Mapping
from typing import Any

import jax
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)
import numpy as np
import safetensors.numpy
from flax import nnx
from jax.sharding import Mesh

from models.config import ModelConfig
from models.sharding import state_shardings
from models.transformer import Transformer

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # HF's "5GB"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_PATTERNS = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "chat_template.*",
    "*.tiktoken",
    "spiece.model",
)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints carry
_NP_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype("bfloat16")}


# --- name map -------------------------------------------------------------------------------


def hf_name(path: tuple, layer: int | None = None) -> tuple[str, bool]:
    """(HF tensor name, whether it is transposed) of an nnx parameter path (of its slice
    `layer` for a stacked decoder-layer parameter)."""
    *prefix, leaf = (str(p) for p in path)
    if layer is not None:
        prefix = [*prefix[:2], str(layer), *prefix[2:]]  # model.layers.{i}.rest
    stem = ".".join(prefix)
    if leaf == "kernel":
        return f"{stem}.weight", True
    if leaf == "embedding":
        return f"{stem}.weight", False
    return f"{stem}.{leaf}", False


def _stacked(path: tuple) -> bool:
    """Whether a parameter path is a decoder-layer parameter (leading `layers` axis)."""
    return len(path) > 2 and str(path[0]) == "model" and str(path[1]) == "layers"


@functools.lru_cache(maxsize=16)
def _layout(config: ModelConfig) -> tuple[tuple[tuple, int | None, str, bool, tuple], ...]:
    """(nnx path, layer slice or None, HF name, transposed, HF shape) of every HF tensor, in HF
    file order."""
    abstract = nnx.state(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))), nnx.Param)
    rows = []
    for path, leaf in _flatten(abstract).items():
        shape = tuple(leaf.shape)
        layers = range(shape[0]) if _stacked(path) else (None,)
        if _stacked(path):
            shape = shape[1:]
        for layer in layers:
            name, transposed = hf_name(path, layer)
            rows.append((path, layer, name, transposed, shape[::-1] if transposed else shape))
    return tuple(sorted(rows, key=_order_key))


def _order_key(row: tuple) -> tuple:
    """embed_tokens, layers by number, norm, lm_head."""
    parts, layer = [str(p) for p in row[0]], row[1]
    group = {"embed_tokens": 0, "layers": 1, "norm": 2}.get(parts[1], 3) if len(parts) > 1 else 3
    if parts[0] == "lm_head":
        group = 4
    return (group, -1 if layer is None else layer, parts)


def _flatten(tree: Any, prefix: tuple = ()) -> dict[tuple, Any]:
    """Nested mapping -> {path: leaf}; an nnx Variable or a {"value": x} node is a leaf."""
    if isinstance(tree, nnx.Variable):
        return {prefix: tree.get_value()}
    if isinstance(tree, Mapping):
        if set(tree.keys()) == {"value"}:
            return {prefix: tree["value"]}
        out = {}
        for key, sub in tree.items():
            out.update(_flatten(sub, (*prefix, key)))
        return out
    return {prefix: tree}


def _unflatten(flat: dict[tuple, Any]) -> dict:
    out: dict = {}
    for path, leaf in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = leaf
    return out


# --- pure conversions -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LazyTensor:
    """An HF tensor made on demand (read from a checkpoint, transposed, cast): its file entry is
    known before its bytes, so a writer can lay out a shard and fill it as tensors arrive."""

    shape: tuple[int, ...]
    dtype: np.dtype
    make: Callable[[], np.ndarray]  # -> the C-contiguous array, in `shape` and `dtype`

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def hf_tensor_plan(
    config: ModelConfig, sources: Mapping[tuple, Any], *, dtype: str | None = None
) -> dict[str, LazyTensor]:
    """HF-named LazyTensors (torch layout) from {nnx path: source}, where a source is an array
    or has `.shape`, `.dtype` and `.read()` (rl.checkpoint.ParamReader). They come in order of
    their source, a stacked parameter's layers together, so a streamed write reads each source
    once and holds only the few it is writing from."""
    flat = {tuple(str(p) for p in k): v for k, v in sources.items()}
    if dtype is not None and dtype not in _NP_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not valid; use one of {sorted(_NP_DTYPES)}")
    out_dtype = _NP_DTYPES[dtype] if dtype else None
    layout = _layout(config)
    expected = {tuple(str(p) for p in row[0]) for row in layout}
    missing = sorted(".".join(p) for p in expected - flat.keys())
    extra = sorted(".".join(p) for p in flat.keys() - expected)
    if missing or extra:
        per_layer = [p for p in flat.keys() - expected if _stacked(p) and p[2].isdigit()]
        hint = (
            "; the decoder layers are one stacked parameter per name (model.layers.<name> "
            "[L, ...]), not one per layer (model.layers.<i>.<name>): this state was written "
            "before the layers were stacked"
            if per_layer
            else ""
        )
        raise ValueError(
            f"parameter state does not match the config: missing {missing[:5]}, "
            f"unexpected {extra[:5]}{hint}"
        )
    order = {}  # tensors in order of their source (each stacked source's layers together)
    for row in layout:
        order.setdefault(tuple(str(p) for p in row[0]), len(order))
    rows = sorted(layout, key=lambda r: (order[tuple(str(p) for p in r[0])], r[1] or 0))
    uses: dict[tuple, int] = {}
    for row in rows:
        key = tuple(str(p) for p in row[0])
        uses[key] = uses.get(key, 0) + 1
    shared = _SharedSources(flat, uses)

    def make(key, layer, name, transposed, shape, to):
        value = shared.get(key)
        value = value if layer is None else value[layer]
        if transposed:
            value = value.T
        if value.shape != shape:
            raise ValueError(f"{name}: shape {value.shape} does not match the config's {shape}")
        out = np.ascontiguousarray(value, dtype=to)
        shared.done(key)
        return out

    plan = {}
    for path, layer, name, transposed, shape in rows:
        key = tuple(str(p) for p in path)
        source = flat[key]
        to = out_dtype if out_dtype is not None else np.dtype(source.dtype)
        plan[name] = LazyTensor(
            shape, to, functools.partial(make, key, layer, name, transposed, shape, to)
        )
    return plan


class _SharedSources:
    """Each source read once (a checkpoint reader's read(), or a copy off the devices), shared
    by the tensors sliced from it, and let go once the last of them is made."""

    def __init__(self, flat: Mapping[tuple, Any], uses: dict[tuple, int]):
        self._flat, self._left = flat, dict(uses)
        self._lock = threading.Lock()
        self._values: dict[tuple, concurrent.futures.Future] = {}

    def get(self, key: tuple) -> np.ndarray:
        with self._lock:
            future = self._values.get(key)
            owner = future is None
            if owner:
                future = self._values[key] = concurrent.futures.Future()
        if owner:
            try:
                source = self._flat[key]
                if hasattr(source, "read"):
                    future.set_result(source.read())
                else:
                    future.set_result(np.asarray(jax.device_get(source)))
            except BaseException as e:
                future.set_exception(e)
        return future.result()

    def done(self, key: tuple) -> None:
        with self._lock:
            self._left[key] -= 1
            if self._left[key] == 0:
                self._values.pop(key, None)


def to_hf_tensors(
    config: ModelConfig, params_state: Any, *, dtype: str | None = None
) -> dict[str, np.ndarray]:
    """HF-named host arrays (torch layout, hf_tensor_plan's order) from a parameter state or
    its pure dict."""
    plan = hf_tensor_plan(config, _flatten(params_state), dtype=dtype)
    return {name: t.make() for name, t in plan.items()}


def from_hf_tensors(config: ModelConfig, tensors: Mapping[str, np.ndarray]) -> dict:
    """The parameter state as a pure dict (nnx layout, config.param_dtype) from HF tensors."""
    layout = _layout(config)
    known = {row[2] for row in layout}
    ignored = {"lm_head.weight"} if config.tie_word_embeddings else set()
    extra = sorted(
        n
        for n in tensors
        if n not in known and n not in ignored and not n.endswith(_IGNORED_SUFFIXES)
    )
    missing = sorted(known - set(tensors))
    if missing or extra:
        raise ValueError(
            f"HF tensors do not match the config ({config.model_type}, "
            f"tie_word_embeddings={config.tie_word_embeddings}): missing {missing[:5]}, "
            f"unexpected {extra[:5]}"
        )
    dtype = _NP_DTYPES[config.param_dtype]
    slices: dict[tuple, list] = {}
    for path, _, name, transposed, shape in layout:
        value = np.asarray(tensors[name])
        if value.shape != shape:
            raise ValueError(f"HF tensor {name} has shape {value.shape}; the config needs {shape}")
        slices.setdefault(path, []).append(value.T if transposed else value)
    flat = {}
    for path, values in slices.items():  # layout order: a stacked path's layers 0, 1, ...
        value = np.stack(values) if _stacked(path) else values[0]
        flat[path] = np.ascontiguousarray(value.astype(dtype, copy=False))
    return _unflatten(flat)


# --- files ----------------------------------------------------------------------------------


def read_hf_tensors(path: str) -> dict[str, np.ndarray]:
    """All tensors of an HF directory (one file, or shards listed by the index json)."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(path, SINGLE_FILE)):
        files = [SINGLE_FILE]
    else:
        raise FileNotFoundError(f"{path} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    tensors = {}
    for name in files:
        with safetensors.safe_open(os.path.join(path, name), framework="numpy") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    return tensors


def fsync_path(path: str) -> None:
    """fsyncs a file or directory by path (a directory's entries survive a crash once synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _plan_shards(tensors: Mapping[str, Any], max_shard_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, value in tensors.items():
        if shards[-1] and size + value.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += value.nbytes
    return shards


_ST_DTYPES = {
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float64": "F64",
    "int32": "I32",
    "int64": "I64",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}
_LOOKAHEAD = 4  # tensors a shard writer has in production ahead of the one it writes


def _write_shard(target: str, names: list[str], tensors: Mapping[str, Any], pool) -> str:
    """Writes one safetensors file tensor by tensor, in order, as each is made (a LazyTensor is
    made in `pool` ahead of the write), hashing the bytes as they go out; fsyncs; its sha256."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        t = tensors[name]
        size = t.nbytes
        header[name] = {
            "dtype": _ST_DTYPES[np.dtype(t.dtype).name],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    digest = hashlib.sha256()

    def submit(name):
        t = tensors[name]
        if isinstance(t, LazyTensor):
            return pool.submit(t.make)
        done = concurrent.futures.Future()
        done.set_result(np.ascontiguousarray(t))
        return done

    pending = [submit(n) for n in names[:_LOOKAHEAD]]
    with open(target, "wb") as f:
        for chunk in (len(blob).to_bytes(8, "little"), blob):
            f.write(chunk)
            digest.update(chunk)
        for i, name in enumerate(names):
            value = pending[i].result()
            pending[i] = None  # let the array go once written
            if i + _LOOKAHEAD < len(names):
                pending.append(submit(names[i + _LOOKAHEAD]))
            if value.shape != tuple(tensors[name].shape) or value.dtype != tensors[name].dtype:
                raise ValueError(f"{name}: made {value.shape} {value.dtype}, planned otherwise")
            data = value.reshape(-1).view(np.uint8)
            f.write(data)
            digest.update(data)
        f.flush()
        os.fsync(f.fileno())
    return digest.hexdigest()


def save_hf_tensors(
    config: ModelConfig,
    tensors: Mapping[str, Any],
    path: str,
    *,
    tokenizer_dir: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    digests: dict[str, str] | None = None,
    workers: int | None = None,
) -> list[str]:
    """Write an HF directory (safetensors shard by shard, config, tokenizer), all fsynced.

    `tensors` are arrays or LazyTensors (hf_tensor_plan): shards are written in parallel, each
    while its tensors are being made. Returns the names of the files written, relative to
    `path`; `digests`, if given, receives each safetensors file's sha256.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes={max_shard_bytes} must be positive")
    os.makedirs(path, exist_ok=True)
    shards = _plan_shards(tensors, max_shard_bytes)
    n = len(shards)
    names = (
        [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )
    workers = workers or max(1, min(16, os.cpu_count() or 1))
    # Writers and makers in separate pools: a writer waiting on a tensor never holds a maker.
    with (
        concurrent.futures.ThreadPoolExecutor(workers) as makers,
        concurrent.futures.ThreadPoolExecutor(min(n, workers)) as writers,
    ):
        futures = [
            writers.submit(_write_shard, os.path.join(path, f), keys, tensors, makers)
            for f, keys in zip(names, shards)
        ]
        shas = [f.result() for f in futures]
    if digests is not None:
        digests.update(zip(names, shas))
    written = list(names)
    if n > 1:
        weight_map = {k: file_name for file_name, keys in zip(names, shards) for k in keys}
        total = int(sum(v.nbytes for v in tensors.values()))
        _write_json(
            os.path.join(path, INDEX_FILE),
            {"metadata": {"total_size": total}, "weight_map": weight_map},
        )
        written.append(INDEX_FILE)
    for stale in os.listdir(path):  # an earlier save's weights would confuse loaders
        is_weights = fnmatch.fnmatch(stale, "model*.safetensors") or stale == INDEX_FILE
        if is_weights and stale not in written:
            os.remove(os.path.join(path, stale))

    hf_config = config.to_hf()
    stored = str(next(iter(tensors.values())).dtype) if tensors else config.param_dtype
    hf_config["torch_dtype"] = hf_config["dtype"] = stored
    _write_json(os.path.join(path, "config.json"), hf_config)
    generation = {"_from_model_config": True}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if hf_config[key] is not None:
            generation[key] = hf_config[key]
    _write_json(os.path.join(path, "generation_config.json"), generation)
    written += ["config.json", "generation_config.json"]
    if tokenizer_dir is not None:
        written += _copy_tokenizer(tokenizer_dir, path)
    fsync_path(path)
    return written


def _copy_tokenizer(tokenizer_dir: str, path: str) -> list[str]:
    files = sorted(
        f
        for f in os.listdir(tokenizer_dir)
        if os.path.isfile(os.path.join(tokenizer_dir, f))
        and any(fnmatch.fnmatch(f, p) for p in TOKENIZER_PATTERNS)
    )
    if not files:
        raise FileNotFoundError(
            f"tokenizer_dir={tokenizer_dir!r} has no tokenizer files; "
            f"looked for {TOKENIZER_PATTERNS}"
        )
    for f in files:
        target = os.path.join(path, f)
        shutil.copyfile(os.path.join(tokenizer_dir, f), target)
        fsync_path(target)
    return files


# --- models ---------------------------------------------------------------------------------


def load_hf(
    path: str, *, dtype: str | None = None, mesh: Mesh | None = None, **overrides
) -> Transformer:
    """A Transformer from a local HF directory, placed on `mesh` (default: one device).

    `dtype` sets both parameter and compute dtype (default: the checkpoint's, else float32);
    `overrides` set other ModelConfig fields (e.g. remat="full").
    """
    with open(os.path.join(path, "config.json")) as f:
        hf_config = json.load(f)
    if dtype is not None:
        overrides = {"dtype": dtype, "param_dtype": dtype, **overrides}
    config = ModelConfig.from_hf(hf_config, **overrides)
    params = from_hf_tensors(config, read_hf_tensors(path))
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    if mesh is None:
        placed = jax.tree.map(jax.device_put, params)
    else:
        shardings = _unflatten(_flatten(state_shardings(config, abstract, mesh)))
        placed = jax.tree.map(jax.device_put, params, shardings)
    nnx.replace_by_pure_dict(abstract, placed)
    return nnx.merge(graphdef, abstract)


def save_hf(
    model: Transformer,
    path: str,
    *,
    tokenizer_dir: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: str | None = None,
) -> list[str]:
    """Write `model` as an HF directory that transformers and vLLM load as is."""
    tensors = to_hf_tensors(model.config, nnx.state(model, nnx.Param), dtype=dtype)
    return save_hf_tensors(
        model.config, tensors, path, tokenizer_dir=tokenizer_dir, max_shard_bytes=max_shard_bytes
    )
