"""The built-in JAX sampler: continuous batching over a fixed set of decode slots.

Requests from any number of generate() calls wait in one queue; a scheduler thread owns the
device state (a KV cache of `capacity` rows, one per slot) and loops: admit waiting requests
into free slots (a batched prefill written into their rows), dispatch a jitted chunk of `chunk`
decode steps over all slots, then read back the chunk's tokens and hand finished rows to their
callers. On an accelerator one chunk stays in flight while the host reads the previous one
(`overlap`), so the device never waits for the host; on a CPU, whose cores the host shares, a
freed slot is refilled one chunk sooner instead.
A finished row's slot takes the next waiting request at once; `continuous=False` admits only
into an empty batch (static batching, the baseline of `launch.bench sampler --workload longtail`).
On a CPU a step costs per row and per cache position, so there the slots follow the demand
(compacted once it fits in half), the cache follows the longest row in finer length buckets, and
a chunk ends early on the device (`early_exit`) once no row is live or, with requests waiting,
once an eighth of the slots finished.

Shapes are bucketed (slots, cache length, prefill batch and prompt length), so a run compiles a
handful of programs; on fixed slots (`fixed_slots`, the default on accelerators) warm() compiles
them all before serving. The cache grows and shrinks with the longest live row, so a decode step
attends over the positions in use, not over prompt + budget (with the Pallas kernel, which reads
only each row's valid positions, it only grows). Weights are served in the compute dtype. Each
row samples with its own key (fold_in of the request seed and the token index), so a request's
output does not depend on what it was batched with or when it was admitted. `timeline` records
the scheduler's calls, for diagnostics.

Weight updates land between chunks: under `drain` admissions pause until the live rows finish;
under `continue` live rows return 'abort' partials (tokens so far, with their version) and the
caller resubmits them; under `inflight` live rows keep their slots and cache and go on with the
new weights (each token is tagged with the version that sampled it, its log-prob the one it was
sampled with, so the decoupled loss corrects it exactly; the earlier tokens' cache entries stay
those of the older weights, as in PipelineRL's in-flight updates).
The engine runs on its own `devices` (default: the first device), params replicated and rows
split over them; with `background_install` update_weights returns at once.

Tokens do not depend on the batch, but log-probs do in their last bits (a row's logits change
with the prefill batch and prompt bucket, the slot count and the cache length). With
`cache_len` set the engine is batch-invariant: every decode step runs on max_batch slots over a
cache of cache_len positions and every prompt is prefilled alone, so a request's tokens and
log-probs are bit-for-bit the same in any batch (what an exact replay of a run needs).
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import os
import threading
import time
import weakref
import zlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from models.decode_attention import supported
from models.kv_cache import KVCache, init_cache
from rl.metrics import BusyClock
from rl.rollout import kernels, sample_kernel
from rl.rollout.base import (
    UPDATE_MODES,
    Generation,
    GenerationRequest,
    RolloutError,
    Weights,
    WeightUpdate,
)
from rl.rollout.layout import params_of_layout, serving_layout
from rl.rollout.sampling import key_data, process_logits, sample


@dataclasses.dataclass(frozen=True)
class Warm:
    """What JaxEngine(warm=..) compiles before serving: programs for requests of at most
    prompt_len prompt tokens and max_new_tokens new ones (top-k / top-p: `truncate`)."""

    prompt_len: int
    max_new_tokens: int
    truncate: bool = False


def length_bucket(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket >= n (past the last one: a multiple of it)."""
    for b in buckets:
        if n <= b:
            return b
    return -(-n // buckets[-1]) * buckets[-1]


# XLA options of the decode program on a GPU: its GEMMs have one row per slot, where cuBLAS
# beats XLA's Triton GEMMs, which split K there and add a reduction kernel each
# (docs/benchmarks.md). The other programs keep XLA's defaults.
GPU_DECODE_OPTIONS = {"xla_gpu_enable_triton_gemm": False}

# Prompt and cache lengths: powers of two, then steps of 1.5x (a step attends over at most a
# third more positions than it needs, for a handful more compiled programs).
LEN_BUCKETS = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
# The cache where slots follow demand (CPU): a step there costs per row and per position, so
# lengths step by 1.25-1.5x (a long row's cache is at most a quarter more than it needs).
FINE_LEN_BUCKETS = (16, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512, 640, 768, 1024)
FINE_LEN_BUCKETS += (1280, 1536, 2048, 2560, 3072, 4096)
PROMPT_BUCKETS = (8,) + LEN_BUCKETS  # prefill lengths
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
DECODE_ATTENTION = ("auto", "xla", "pallas")  # auto: the Pallas kernel on one GPU, else XLA
EARLY_EXIT_FRACTION = 8  # a chunk ends early once 1/8 of the slots finished (rows waiting)


STOP_BUCKETS = (4, 8, 16, 64)
_ENGINES: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_engines() -> None:
    """Stops scheduler threads before the interpreter tears down the XLA runtime under them."""
    for engine in list(_ENGINES):
        engine.close()


class _Call:
    """One generate() call: its results, filled as rows finish, and an event once all are."""

    def __init__(self, n: int):
        self.results: list[Generation | None] = [None] * n
        self.left = n
        self.tokens = 0
        self.error: BaseException | None = None
        self.event = threading.Event()


@dataclasses.dataclass(eq=False)
class _Row:
    """A request from submission to its Generation (host side of one slot)."""

    req: GenerationRequest
    call: _Call
    index: int  # position in its call's request list
    prompt_len: int
    max_new: int
    slot: int = -1
    inflight: int = 0  # decode chunks dispatched and not yet read back
    finished: bool = False
    tokens: list = dataclasses.field(default_factory=list)
    logps: list = dataclasses.field(default_factory=list)
    versions: list = dataclasses.field(default_factory=list)  # each token's weights version

    def reach(self, chunk: int, more: int = 0) -> int:
        """Tokens the row has once its in-flight work and `more` chunks are read (the first one
        pending until its insert is read), before its budget."""
        return max(len(self.tokens), 1) + chunk * (self.inflight + more)


@dataclasses.dataclass
class _Rows:
    """Sampling constants of rows ([C, ...] numpy): built on the host for an admission; the
    slots' own live on the device, in the engine state (written by the insert)."""

    keys: np.ndarray  # uint32 [C, 2]
    temp: np.ndarray  # float32 [C]
    top_k: np.ndarray  # int32 [C]
    top_p: np.ndarray  # float32 [C]
    max_new: np.ndarray  # int32 [C]
    stop: np.ndarray  # int32 [C, n_stop], -1 pads (a token id is never -1)

    @classmethod
    def empty(cls, C: int, n_stop: int) -> _Rows:
        return cls(
            np.zeros((C, 2), np.uint32),
            np.ones(C, np.float32),
            np.zeros(C, np.int32),
            np.ones(C, np.float32),
            np.ones(C, np.int32),
            np.full((C, n_stop), -1, np.int32),
        )

    def set(self, slot: int, req: GenerationRequest, key: np.ndarray) -> None:
        p = req.params
        self.keys[slot] = key
        self.temp[slot], self.top_k[slot], self.top_p[slot] = p.temperature, p.top_k, p.top_p
        self.max_new[slot] = p.max_new_tokens
        self.stop[slot] = -1
        self.stop[slot, : len(p.stop_token_ids)] = p.stop_token_ids

    def arrays(self) -> tuple:
        return (self.keys, self.temp, self.top_k, self.top_p, self.max_new, self.stop)


def _truncates(row: _Row) -> bool:
    """Whether the row samples from a truncated distribution (top-k or top-p on)."""
    p = row.req.params
    return p.top_k > 0 or p.top_p < 1.0


def _seed(req: GenerationRequest) -> int:
    return req.params.seed if req.params.seed is not None else zlib.crc32(req.request_id.encode())


class JaxEngine:
    """Rollout engine running the policy in process on its own devices (continuous batching)."""

    def __init__(
        self,
        model: nnx.Module,
        *,
        version: int = 0,
        chunk: int = 16,
        max_batch: int = 128,
        deadline_s: float = 600.0,
        devices: Sequence[jax.Device] | None = None,
        update_mode: str = "drain",
        background_install: bool = False,
        continuous: bool = True,
        overlap: bool | None = None,
        cache_len: int | None = None,
        early_exit: bool | None = None,
        decode_attention: str = "auto",
        sample_kernel: bool | None = None,
        fixed_slots: bool | None = None,
        warm: Warm | None = None,
    ):
        if update_mode not in UPDATE_MODES:
            raise ValueError(f"JaxEngine: update_mode {update_mode!r}; valid: {UPDATE_MODES}")
        if chunk < 1 or max_batch < 1:
            raise ValueError(f"JaxEngine: chunk={chunk}, max_batch={max_batch}; both must be >= 1")
        if decode_attention not in DECODE_ATTENTION:
            raise ValueError(
                f"JaxEngine: decode_attention {decode_attention!r}; valid: {DECODE_ATTENTION}"
            )
        self.update_mode = update_mode
        self.background_install = background_install
        self.continuous = continuous
        self.graphdef, params, self.rest = nnx.split(model, nnx.Param, ...)
        self.config = model.config
        self.devices = list(devices) if devices else jax.local_devices()[:1]
        if len(set(self.devices)) != len(self.devices):
            raise ValueError(f"JaxEngine: devices {self.devices} repeat a device")
        mesh = Mesh(np.asarray(self.devices, dtype=object), ("rows",), axis_types=(AxisType.Auto,))
        self.replicated = NamedSharding(mesh, PartitionSpec())  # params
        self.rows = NamedSharding(mesh, PartitionSpec("rows"))  # every [C, ...] array
        # The params tree's shapes (what update_weights' trees match) in the compute dtype: every
        # use casts a weight to it (the same numbers), so float32 master weights are served and
        # copied at half the bytes. self.params holds them in their serving layout (_serve_impl).
        compute = jnp.dtype(model.config.dtype)
        self._template = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(
                a.shape, compute if jnp.issubdtype(a.dtype, jnp.floating) else a.dtype
            ),
            params,
        )
        self._layer_def = None  # the graphdef of one decoder layer (set by _serve_impl)
        self.traces = 0  # programs traced (compilations): prefill, insert, relayout, decode, serve
        self.warm_traces = 0  # of those, traced by warm() before serving
        self.version = version
        self.chunk = chunk
        nd = len(self.devices)
        self.max_batch = -(-max_batch // nd) * nd  # slots split evenly over the devices
        accelerator = self.devices[0].platform != "cpu"
        c = model.config
        decode_attention, sample_kernel = kernels.choose(
            decode_attention, sample_kernel, self.devices, c, compute
        )
        self.decode_attention = decode_attention
        self.interpret = self.devices[0].platform != "gpu"  # the Pallas kernels off a GPU: tests
        # The Pallas kernel reads keys with the head dim minor (a block of slots contiguous).
        self.k_pos = 2 if decode_attention == "pallas" else 3
        per_layer = (self.rows,) * model.config.num_hidden_layers  # the cache: [C, ...] per layer
        self.cache_rows = KVCache(k=per_layer, v=per_layer, k_pos=self.k_pos)
        # (cache, tok, pos, n, done, consts): consts are _Rows.arrays() of the slots
        self.state_rows = (self.cache_rows,) + (self.rows,) * 4 + ((self.rows,) * 6,)
        # Sampling as two Pallas kernels (rl.rollout.sample_kernel) where no row truncates.
        self.sample_kernel = sample_kernel
        # With the Pallas kernel a step reads each row's valid positions only, so a longer cache
        # costs no step time: it only grows (no relayouts back and forth, no programs per length).
        self.ragged = decode_attention == "pallas" and supported(
            c.dtype, c.num_attention_heads, c.num_key_value_heads, c.head_dim, LEN_BUCKETS[0]
        )
        self._floor = LEN_BUCKETS[0]  # the shortest cache the scheduler allocates (see warm)
        # The norms' weights folded into the q/k/v and gate/up kernels where the attention
        # kernel finishes the input norm (two kernels fewer a layer); not for float16, whose
        # range the unnormalized input's GEMM could exceed.
        self.fold_norms = self.ragged and not c.qk_norm and jnp.dtype(c.dtype) != jnp.float16
        self._serve = jax.jit(self._serve_impl, out_shardings=self.replicated)
        self.params = self._serve(self._own(self._cast(params)))
        self.overlap = accelerator if overlap is None else overlap
        # A chunk that ends when rows finish (a data-dependent loop; on an accelerator its
        # condition may wait on the host each step) is kept to the CPU by default.
        self.early_exit = (not accelerator) if early_exit is None else early_exit
        # On an accelerator a decode step costs about the same for any number of rows (it reads
        # the weights), so the slots stay at max_batch: one program per cache length. A CPU's
        # step costs per row, so there the slots follow demand (powers of two). Batch-invariant
        # engines always keep them fixed.
        fixed = accelerator if fixed_slots is None else fixed_slots
        self.fixed_slots = fixed or cache_len is not None
        self.cache_buckets = LEN_BUCKETS if self.fixed_slots else FINE_LEN_BUCKETS
        # A prefill costs per row on a CPU, and on an accelerator too once its rows x prompt
        # tokens make it compute-bound (a few hundred tokens): admissions pad to powers of two.
        self.prefill_buckets = BATCH_BUCKETS
        if cache_len is not None and cache_len < 1:
            raise ValueError(f"JaxEngine: cache_len={cache_len}; must be >= 1 (or None)")
        self.cache_len = None if cache_len is None else length_bucket(cache_len, LEN_BUCKETS)
        self.deadline_s = deadline_s
        self._abort = threading.Event()  # set by abort(), cleared by resume()
        self._interrupt = threading.Event()  # set while a `continue` weight update waits
        self._cv = threading.Condition()  # guards _waiting, _installs, _thread, _closed
        self._waiting: collections.deque[_Row] = collections.deque()
        self._installs: collections.deque = collections.deque()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._failed: BaseException | None = None
        # The scheduler thread's own state: slots, device arrays, dispatched-but-unread work.
        self._slots: list[_Row | None] = []
        self._state = None  # (cache, tok, pos, n, done, consts), [C, ...] split over the devices
        self._records: collections.deque = collections.deque()
        self.decode_steps = 0  # decode steps run (each over every slot), as read back
        self.slot_steps = 0  # rows computed by decode steps (slots x steps)
        self.useful_steps = 0  # of those, rows that produced a token
        # Diagnostics: set to a list and the scheduler appends (kind, start, end, *info) of its
        # calls: ("chunk", .., live rows, waiting rows, cache length, slots) at a dispatch,
        # ("read", ..) at each read-back, ("admit", .., rows) at each prefill, ("install", ..).
        self.timeline: list | None = None
        rows = self.rows
        state = self.state_rows
        self._prefill = jax.jit(
            self._prefill_impl, static_argnums=(4,), out_shardings=(rows,) * 3 + (self.cache_rows,)
        )
        self._insert = jax.jit(self._insert_impl, donate_argnums=(0,), out_shardings=state)
        self._relayout = jax.jit(self._relayout_impl, static_argnums=(2, 3), out_shardings=state)
        gpu = self.devices[0].platform == "gpu"
        self._decode = jax.jit(
            self._decode_impl,
            static_argnums=(3,),
            donate_argnums=(1,),
            compiler_options=dict(GPU_DECODE_OPTIONS) if gpu else None,
            out_shardings=(state,) + (rows,) * 3 + (self.replicated,),
        )
        self.pid = os.getpid()
        self.sync_times: list[dict] = []  # per update_weights: copy_s, install_s, total_s
        self.clock = BusyClock()
        _ENGINES.add(self)
        if warm is not None:  # before serving, so that nothing compiles while it serves
            self.warm(warm.prompt_len, warm.max_new_tokens, truncate=warm.truncate)

    # -- weights --------------------------------------------------------------------------
    def update_weights(self, version: int, weights) -> WeightUpdate:
        """Copies `weights` onto the engine's devices and serves them as `version`.

        Under `continue` live rows return 'abort' partials at the next chunk end; under `drain`
        admissions pause until they finish; under `inflight` live rows keep their slots and KV
        cache and sample their next tokens with the new weights. With background_install the
        handle is done once the copy has landed and is installed (the caller may donate its
        buffers then); otherwise update_weights returns when the engine serves the version.
        """
        t0 = time.perf_counter()
        params = self._own(self._cast(Weights.of(weights).tree(self._template)))
        handle = WeightUpdate(version)
        with self._cv:
            self._check_open()
            self._installs.append((version, params, t0, time.perf_counter(), handle))
            if self.update_mode == "continue":
                self._interrupt.set()
            self._wake()
        if not self.background_install:
            handle.wait(self.deadline_s)
        return handle

    def _note(self, kind: str, t0: float, *info) -> None:
        """Records a scheduler call that started at t0 (when a timeline is kept)."""
        if self.timeline is not None:
            self.timeline.append((kind, t0, time.perf_counter(), *info))

    def _install(self) -> None:
        """Serves the oldest queued update (no row is live, or any under `inflight`)."""
        t_start = time.perf_counter()
        with self._cv:
            version, params, t0, t1, handle = self._installs.popleft()
            if not self._installs:
                self._interrupt.clear()
        try:
            jax.block_until_ready(params)  # served = the copy has landed on the devices
        except BaseException as e:  # noqa: BLE001 - the learner must hear of any failure
            handle.set_failed(e)
            return
        self.params, self.version = self._serve(params), version
        t2 = time.perf_counter()
        self.sync_times.append({"copy_s": t1 - t0, "install_s": t2 - t1, "total_s": t2 - t0})
        handle.set_served()
        self._note("install", t_start)

    def _cast(self, tree):
        """tree's arrays in the template's (serving) dtypes, cast where they are."""
        return jax.tree.map(lambda t, a: a.astype(t.dtype), self._template, tree)

    def _own(self, params):
        """A private copy replicated on the engine's devices (the learner donates its buffers)."""

        def own(x):
            y = jax.device_put(x, self.replicated)
            if isinstance(x, jax.Array) and set(x.devices()) & set(self.devices):
                y = jnp.array(y, copy=True)  # device_put may alias a buffer already there
            return y

        return jax.tree.map(own, params)

    def stats(self) -> dict:
        """Busy time, calls, tokens, weight installs, compilations (and those before serving),
        slot occupancy (and its counts: rows computed by decode steps, rows that produced a
        token), pid."""
        return {
            **self.clock.snapshot(),
            "updates": len(self.sync_times),
            "install_s": sum(t["install_s"] for t in self.sync_times),
            "sync_s": sum(t["total_s"] for t in self.sync_times),
            "traces": self.traces,
            "warm_traces": self.warm_traces,
            "slot_occupancy": self.useful_steps / self.slot_steps if self.slot_steps else 0.0,
            "slot_steps": self.slot_steps,
            "useful_steps": self.useful_steps,
            "pid": self.pid,
        }

    # -- compiled programs ----------------------------------------------------------------
    def _serve_impl(self, params):
        """(head, layers): layout.serving_layout of the weights, once per version; records the
        layers' graphdef (static)."""
        self.traces += 1
        model = nnx.merge(self.graphdef, params, self.rest)
        head, layers, self._layer_def = serving_layout(model, self.fold_norms)
        return head, layers

    def served_params(self):
        """The served weights as the model's params tree (the layers stacked back, the fused
        kernels split): what update_weights took, for callers that compare weights (with
        fold_norms, the q/k/v and gate/up kernels within two roundings of it)."""
        return params_of_layout(
            self.params, self._layer_def, self.config, self._template, self.fold_norms
        )

    def _model(self, params):
        """(model, per-layer modules and fused kernels) of _serve_impl's weights."""
        head, layers = params
        model = nnx.merge(self.graphdef, head, self.rest)
        return model, [(nnx.merge(self._layer_def, st), fused) for st, fused in layers]

    def _prefill_impl(self, params, tokens_bT, lengths_b, consts_b, truncate):
        """New rows' first tokens: (token, log-prob, done, cache [b, T]) of right-padded prompts.
        truncate: whether any row has top-k or top-p on (static: without, sampling never sorts)."""
        self.traces += 1
        keys, temp, top_k, top_p, max_new, stop = consts_b
        model, layers = self._model(params)
        b, T = tokens_bT.shape
        last, cache = model.prefill(
            tokens_bT,
            lengths_b,
            self._new_cache(b, T),
            last_only=True,
            layers=layers,
            folded=self.fold_norms,
        )
        keys0 = jax.vmap(lambda k: jax.random.fold_in(k, 0))(keys)
        tok, lp = sample(process_logits(last, temp, top_k, top_p, truncate), keys0, temp)
        done = jnp.any(tok[:, None] == stop, axis=-1) | (max_new <= 1)
        return tok, lp, done, cache

    def _insert_impl(self, state, idx_b, tok_b, lengths_b, done_b, cache_b: KVCache, consts_b):
        """Writes new rows into slots idx_b (an index past the end drops a padding row)."""
        self.traces += 1
        cache, tok, pos, n, done, consts = state
        T = cache_b.max_len

        def put(c, x, axis):  # rows idx_b, positions [0, T)
            where = (idx_b,) + tuple(slice(0, T) if d == axis else slice(None) for d in (1, 2, 3))
            return c.at[where].set(x.astype(c.dtype), mode="drop")

        cache = cache.map(put, cache_b)
        at = lambda a, x: a.at[idx_b].set(x, mode="drop")
        consts = tuple(at(a, x) for a, x in zip(consts, consts_b))
        return cache, at(tok, tok_b), at(pos, lengths_b), at(n, 1), at(done, done_b), consts

    def _relayout_impl(self, state, idx_C, S, n_stop):
        """State rows idx_C (-1: an empty, finished row), the cache resized to S positions and
        the stop tables widened to n_stop."""
        self.traces += 1
        cache, tok, pos, n, done, consts = state
        ok = idx_C >= 0
        rows = lambda a: jnp.take(a, jnp.maximum(idx_C, 0), axis=0)

        def resize(c, axis):  # [C, ...] per layer, positions on `axis`
            c = rows(c)
            if S <= c.shape[axis]:
                return jax.lax.slice_in_dim(c, 0, S, axis=axis)
            pad = [(0, 0)] * c.ndim
            pad[axis] = (0, S - c.shape[axis])
            return jnp.pad(c, pad)

        cache = cache.map(resize)
        *consts, stop = (rows(a) for a in consts)
        stop = jnp.pad(stop, ((0, 0), (0, n_stop - stop.shape[1])), constant_values=-1)
        empty = _Rows.empty(1, n_stop).arrays()  # an empty row's constants
        fill = lambda a, e: jnp.where(ok.reshape((-1,) + (1,) * (a.ndim - 1)), a, e)
        consts = tuple(fill(a, e) for a, e in zip((*consts, stop), empty))
        state = (cache, rows(tok), jnp.where(ok, rows(pos), 0), rows(n), rows(done) | ~ok)
        return state + (consts,)

    def _decode_impl(self, params, state, stop_after, truncate):
        """Up to `chunk` decode steps of every slot: (state, tokens [C, chunk] (-1: none),
        log-probs, done [C] as int8: a copy the host reads after the state was donated to the
        next chunk, steps run). With early_exit the chunk ends once no row is live or
        stop_after rows finished in it. truncate: as in _prefill_impl."""
        self.traces += 1
        cache, tok, pos, n, done, consts = state
        keys, temp, top_k, top_p, max_new, stop = consts
        model, layers = self._model(params)
        C = tok.shape[0]

        def one(i, c):
            cache, tok, pos, n, done, toks, lps = c
            logits, cache = model.decode(
                tok,
                pos,
                cache,
                layers,
                self.decode_attention,
                interpret=self.interpret,
                folded=self.fold_norms,
            )
            keys_i = jax.vmap(jax.random.fold_in)(keys, n)  # token index n of the row
            if self.sample_kernel and not truncate:
                new, lp = sample_kernel.sample(logits, keys_i, temp, interpret=self.interpret)
            else:
                new, lp = sample(process_logits(logits, temp, top_k, top_p, truncate), keys_i, temp)
            active = ~done
            toks = toks.at[:, i].set(jnp.where(active, new, -1))
            lps = lps.at[:, i].set(jnp.where(active, lp, 0.0))
            n = n + active
            hit_stop = jnp.any(new[:, None] == stop, axis=-1)
            done = done | (active & (hit_stop | (n >= max_new)))
            return cache, jnp.where(active, new, tok), pos + active, n, done, toks, lps

        toks = jnp.full((C, self.chunk), -1, jnp.int32)
        lps = jnp.zeros((C, self.chunk), jnp.float32)
        done0 = done  # empty slots hold finished rows
        carry = (cache, tok, pos, n, done0, toks, lps)
        if self.early_exit:

            def more(c):
                i, (*_, done, _, _) = c
                finished = jnp.sum(done & ~done0)
                return (i < self.chunk) & ~jnp.all(done) & (finished < stop_after)

            steps, carry = jax.lax.while_loop(more, lambda c: (c[0] + 1, one(*c)), (0, carry))
        else:
            steps, carry = self.chunk, jax.lax.fori_loop(0, self.chunk, one, carry)
        cache, tok, pos, n, done, toks, lps = carry
        state = (cache, tok, pos, n, done, consts)
        return state, toks, lps, done.astype(jnp.int8), jnp.int32(steps)

    def _new_cache(self, rows: int, slots: int) -> KVCache:
        """An all-zero cache in this engine's key layout."""
        return init_cache(self.config, rows, slots, k_pos=self.k_pos)

    def _abstract(self, C: int, S: int):
        """Shapes and shardings of the state for C slots and a cache of S slots."""
        arg = lambda shape, dtype, sharding: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
        kv = jax.eval_shape(lambda: self._new_cache(C, S))
        cache = jax.tree.map(lambda a, sh: arg(a.shape, a.dtype, sh), kv, self.cache_rows)
        i32 = arg((C,), jnp.int32, self.rows)
        flag = arg((C,), jnp.bool_, self.rows)
        empty = _Rows.empty(C, STOP_BUCKETS[0]).arrays()
        consts = tuple(arg(a.shape, a.dtype, self.rows) for a in empty)
        return cache, i32, i32, i32, flag, consts

    def lower_decode(
        self, slots: int, cache_len: int, truncate: bool = False
    ) -> jax.stages.Lowered:
        """The decode chunk lowered for `slots` rows and cache_len cache positions, nothing
        allocated or run (compile-time benchmarks, warm)."""
        state = self._abstract(slots, cache_len)
        return self._decode.lower(self.params, state, np.int32(1), truncate)  # as _dispatch

    def lower_prefill(
        self, rows: int, prompt_len: int, truncate: bool = False
    ) -> jax.stages.Lowered:
        """The prefill lowered for `rows` prompts of prompt_len tokens, nothing run (warm)."""
        _, lengths, *_, consts = self._abstract(rows, prompt_len)
        tokens = jax.ShapeDtypeStruct((rows, prompt_len), jnp.int32, sharding=self.rows)
        return self._prefill.lower(self.params, tokens, lengths, consts, truncate)

    def warm(self, prompt_len: int, max_new_tokens: int, *, truncate: bool = False) -> int:
        """Compiles, before serving, what requests of at most prompt_len prompt tokens and
        max_new_tokens new ones use on fixed slots (an accelerator's, or batch-invariant): per
        prompt bucket and admission size a prefill and an insert, per cache length the
        scheduler can pick a decode chunk and the relayouts between them, so that nothing
        compiles while serving; with `truncate` (requests with top-k / top-p) the prefills and
        decode chunks that truncate too. With ragged attention the cache is held at the
        longest length from then on (a step costs the same): one length. Call it before the
        first generate (or pass JaxEngine(warm=Warm(..))). Returns the programs traced: 0 where
        slots follow demand (a CPU's; too many shapes to warm, they compile as they come)."""
        if not self.fixed_slots:
            return 0
        before, C = self.traces, self.max_batch
        modes = (False, True) if truncate else (False,)
        top_T = length_bucket(prompt_len, PROMPT_BUCKETS)
        Ts = sorted({T for T in PROMPT_BUCKETS if T < top_T} | {top_T})
        longest = length_bucket(max(top_T, prompt_len + max_new_tokens - 1), self.cache_buckets)
        if self.cache_len is not None:
            Ss, sizes = [self.cache_len], {self._admission_rows(1)}  # each prompt alone
        else:
            Ss = sorted({S for S in self.cache_buckets if S < longest} | {longest})
            sizes = {self._admission_rows(b) for b in self.prefill_buckets}
            if self.ragged:
                Ss, self._floor = [longest], longest
        i32 = jax.ShapeDtypeStruct((C,), jnp.int32, sharding=self.rows)
        for S in Ss:
            state = self._abstract(C, S)
            for t in modes:
                self.lower_decode(C, S, t).compile()
            for other in Ss:
                if other != S:
                    old = self._abstract(C, other)
                    self._relayout.lower(old, i32, S, STOP_BUCKETS[0]).compile()
            for T in (T for T in Ts if T <= S):  # a prefill grows the cache to its bucket
                for b in sorted(sizes):
                    for t in modes:  # (outputs of the same shapes either way)
                        tok, _, done, cache = self.lower_prefill(b, T, t).compile().out_info
                    _, lengths, *_, consts = self._abstract(b, T)
                    self._insert.lower(state, lengths, tok, lengths, done, cache, consts).compile()
        self.warm_traces += self.traces - before
        return self.traces - before

    # -- generation -----------------------------------------------------------------------
    def abort(self) -> None:
        """Ends live rows at a chunk boundary ('abort' partials), later calls at once; resume()."""
        self._abort.set()
        with self._cv:
            self._cv.notify_all()

    def resume(self) -> None:
        """Undoes abort()."""
        with self._cv:  # a scheduler step ending the queued rows re-checks under this lock
            self._abort.clear()

    def generate(self, requests: list[GenerationRequest]) -> list[Generation]:
        """Completes every request: queued, admitted to slots as they free, results in order."""
        if not requests:
            return []
        if min(len(r.prompt_ids) for r in requests) < 1:
            raise ValueError("every request needs a prompt of at least one token")
        if self.cache_len is not None:
            need = max(len(r.prompt_ids) + r.params.max_new_tokens for r in requests)
            if need > self.cache_len:
                raise ValueError(
                    f"JaxEngine: a request needs {need} cache positions (prompt + "
                    f"max_new_tokens); the batch-invariant cache holds {self.cache_len}"
                )
        if self._abort.is_set():
            return [_aborted(r.request_id) for r in requests]
        call = _Call(len(requests))
        rows = [
            _Row(r, call, i, len(r.prompt_ids), int(r.params.max_new_tokens))
            for i, r in enumerate(requests)
        ]
        self.clock.enter()
        try:
            with self._cv:
                self._check_open()
                self._waiting.extend(rows)
                self._wake()
            if not call.event.wait(self.deadline_s):
                raise TimeoutError(
                    f"JaxEngine: {call.left} of {len(requests)} requests unfinished after "
                    f"{self.deadline_s}s (trainer.deadline_s)"
                )
            if call.error is not None:
                raise RolloutError(f"JaxEngine: generation failed: {call.error!r}") from call.error
            return call.results
        finally:
            self.clock.exit(call.tokens)

    def close(self) -> None:
        """Ends live and queued generations ('abort') and stops the scheduler thread."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            thread = self._thread
        self._abort.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.deadline_s)

    # -- the scheduler --------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._failed is not None:
            raise RolloutError(
                f"JaxEngine: the scheduler failed: {self._failed!r}"
            ) from self._failed
        if self._closed:
            raise RolloutError("JaxEngine: closed")

    def _wake(self) -> None:
        """Starts the scheduler thread if it is not running (called under _cv)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)
            self._thread.start()
        self._cv.notify_all()

    def _run(self) -> None:
        try:
            while self._step():
                pass
        except BaseException as e:  # noqa: BLE001 - every caller must hear of the failure
            self._fail(e)

    def _live(self) -> list[_Row]:
        return [r for r in self._slots if r is not None]

    def _step(self) -> bool:
        """One scheduler iteration; False once the thread may exit (idle, closed)."""
        if self._abort.is_set() or self._closed:
            self._flush()
            self._end_live()
            with self._cv:  # not what a call after resume() queued meanwhile
                waiting = []
                if self._abort.is_set() or self._closed:
                    waiting, self._waiting = list(self._waiting), collections.deque()
            for r in waiting:
                self._finish(r, "abort")
        if self._installs:
            if self.update_mode == "continue" and self._live():
                self._flush()
                self._end_live()
            if self.update_mode == "inflight" and self._live():
                self._install()  # between chunks: live rows go on under the new weights
            elif not self._live():
                self._flush()
                self._install()
                return True
        elif not self._abort.is_set():
            self._admit()
        if self._live():
            if self._records and not self._needs_chunk():
                self._process(self._records.popleft())  # what is in flight ends every live row
                return True
            self._dispatch()
            while len(self._records) > self.overlap:  # with overlap one chunk stays in flight
                self._process(self._records.popleft())
            return True
        self._flush()
        with self._cv:
            if self._waiting or self._installs:
                return True
            if self._closed:
                self._thread = None
                return False
            if not self._cv.wait(timeout=1.0) and not (self._waiting or self._installs):
                self._thread = None  # idle: exit; the next call starts a new thread
                return False
        return True

    def _needs_chunk(self) -> bool:
        """Whether a live row may need a token beyond those in flight (its insert's first
        token, then chunk tokens per chunk): a chunk past every row's budget would decode for
        nothing while the host waits to admit the next requests."""
        return any(r.reach(self.chunk) < r.max_new for r in self._live())

    def _admit(self) -> None:
        """Sizes the slots to the demand (live and waiting rows), then moves waiting requests
        into free slots (static batching: only into an empty batch)."""
        live = self._live()
        with self._cv:
            demand = len(live) + len(self._waiting)
        if not demand:
            return
        nd = len(self.devices)
        want = min(length_bucket(demand, BATCH_BUCKETS), self.max_batch)
        want = self.max_batch if self.fixed_slots else -(-want // nd) * nd
        C = len(self._slots)
        # Slots grow at once and shrink (live rows compacted) once the demand fits in half of
        # them: a drain with nothing waiting then steps over the live rows only.
        if want > C or (want < C and (not live or demand <= C // 2)):
            self._resize(live, want)
        if not self._waiting or (live and not self.continuous):
            return
        free = [s for s, r in enumerate(self._slots) if r is None]
        with self._cv:
            rows = [self._waiting.popleft() for _ in range(min(len(free), len(self._waiting)))]
        if self.cache_len is not None:  # each prompt prefilled alone: its own shapes only
            for r, s in zip(rows, free):
                self._prefill_rows([r], [s])
        elif rows:
            self._prefill_rows(rows, free)

    def _prefill_rows(self, rows: list[_Row], free: list[int]) -> None:
        """Prefills rows into the free slots (in order) and queues their first tokens."""
        t0 = time.perf_counter()
        n_stop = max(len(r.req.params.stop_token_ids) for r in rows)
        T = length_bucket(max(r.prompt_len for r in rows), PROMPT_BUCKETS)
        self._fit_cache(extra=T, n_stop=n_stop)
        b = self._admission_rows(len(rows))
        tokens = np.zeros((b, T), np.int32)
        lengths = np.ones(b, np.int32)
        idx = np.full(b, len(self._slots), np.int32)  # past the end: a dropped padding row
        new = _Rows.empty(b, self._n_stop())
        for i, (r, s) in enumerate(zip(rows, free)):
            tokens[i, : r.prompt_len] = r.req.prompt_ids
            lengths[i], idx[i] = r.prompt_len, s
            new.set(i, r.req, key_data(_seed(r.req)))
            r.slot = s
            self._slots[s] = r
        tokens, lengths, idx, consts = jax.device_put(
            (tokens, lengths, idx, new.arrays()), self.rows
        )
        truncate = any(_truncates(r) for r in rows)
        tok, lp, done, cache = self._prefill(self.params, tokens, lengths, consts, truncate)
        self._state = self._insert(self._state, idx, tok, lengths, done, cache, consts)
        self._records.append(("insert", rows, tok, lp, done, self.version))
        self._note("admit", t0, len(rows))

    def _admission_rows(self, n: int) -> int:
        """Rows of the prefill that admits n requests: a prefill bucket, at most max_batch,
        split evenly over the devices."""
        nd = len(self.devices)
        return -(-min(length_bucket(n, self.prefill_buckets), self.max_batch) // nd) * nd

    def _resize(self, live: list[_Row], C: int) -> None:
        """C slots: live rows kept (moved to the front when shrinking), the rest empty."""
        if self._state is None or not live:  # nothing to keep: a fresh state, no relayout
            self._flush()
            self._slots = [None] * C
            cache = self._new_cache(C, self.cache_len or self._floor)
            zeros = np.zeros(C, np.int32)
            consts = _Rows.empty(C, STOP_BUCKETS[0]).arrays()
            state = (cache, zeros, zeros, zeros, np.ones(C, bool), consts)
            self._state = jax.device_put(state, self.state_rows)
            return
        if C < len(self._slots):
            self._flush()  # records name slots by index
            live = self._live()
            idx = np.array([r.slot for r in live] + [-1] * (C - len(live)), np.int32)
        else:
            idx = np.concatenate([np.arange(len(self._slots)), np.full(C - len(self._slots), -1)])
            idx = idx.astype(np.int32)
        idx = jax.device_put(idx, self.rows)
        self._state = self._relayout(self._state, idx, self._S(), self._n_stop())
        slots: list[_Row | None] = [None] * C
        for s, old in enumerate(idx):
            if old >= 0 and self._slots[old] is not None:
                slots[s] = self._slots[old]
                slots[s].slot = s
        self._slots = slots

    def _S(self) -> int:
        return self._state[0].max_len

    def _n_stop(self) -> int:
        return self._state[5][5].shape[1]  # the stop table's width

    def _fit_cache(self, extra: int = 0, n_stop: int = 0) -> None:
        """Sizes the cache to what live rows can reach by the end of the next chunk (or to
        cache_len, always, when batch-invariant) and widens the stop tables to n_stop."""
        width = max(self._n_stop(), length_bucket(n_stop, STOP_BUCKETS))
        if self.cache_len is not None:
            if self._S() != self.cache_len or width != self._n_stop():
                idx = jax.device_put(np.arange(len(self._slots), dtype=np.int32), self.rows)
                self._state = self._relayout(self._state, idx, self.cache_len, width)
            return
        # A row's last position by the end of the next chunk: prompt_len + its tokens then - 1.
        need = max(
            [extra, self._floor]
            + [r.prompt_len + min(r.reach(self.chunk, 1), r.max_new) - 1 for r in self._live()]
        )
        S, new = self._S(), length_bucket(need, self.cache_buckets)
        # Where slots follow demand (CPU) the cache shrinks to fit at once; elsewhere once a
        # quarter of it is in use (each change is a relayout); with ragged attention never.
        shrink = not self.ragged and (not self.fixed_slots or need <= S // 4)
        if not (new > S or (new < S and shrink)):
            new = S
        if new != S or width != self._n_stop():
            idx = jax.device_put(np.arange(len(self._slots), dtype=np.int32), self.rows)
            self._state = self._relayout(self._state, idx, new, width)

    def _dispatch(self) -> None:
        """Runs one decode chunk over every slot (asynchronously; read back by _process)."""
        t0 = time.perf_counter()
        self._fit_cache()
        for r in self._slots:
            if r is not None:
                r.inflight += 1
        C = len(self._slots)
        with self._cv:
            queued = len(self._waiting)
        waiting = queued if self.continuous else 0
        # With requests waiting, the chunk ends once enough rows finished to admit some (a
        # freed slot idles no longer than that); otherwise it runs until no row is live.
        stop_after = max(1, min(waiting, C // EARLY_EXIT_FRACTION)) if waiting else C + 1
        truncate = any(r is not None and _truncates(r) for r in self._slots)
        self._state, toks, lps, done, steps = self._decode(
            self.params, self._state, np.int32(stop_after), truncate
        )
        self._records.append(("chunk", list(self._slots), toks, lps, done, steps, self.version))
        if self.timeline is not None:  # (the live count only when a timeline is kept)
            self._note("chunk", t0, sum(r is not None for r in self._slots), queued, self._S(), C)

    def _process(self, record) -> None:
        """Reads back a dispatched insert or chunk: appends tokens, finishes done rows."""
        t0 = time.perf_counter()
        if record[0] == "insert":
            _, rows, tok, lp, done, version = record
            tok, lp, done = jax.device_get((tok, lp, done))
            for i, r in enumerate(rows):
                if not r.finished:
                    r.tokens.append(int(tok[i]))
                    r.logps.append(float(lp[i]))
                    r.versions.append(version)
                    if done[i]:  # a stop token or a budget of one: no chunk needs to say so
                        self._finish(r)
            return
        _, slots, toks, lps, done, steps, version = record
        toks, lps, done, steps = jax.device_get((toks, lps, done, steps))
        valid = toks >= 0
        self.decode_steps += int(steps)
        self.slot_steps += toks.shape[0] * int(steps)
        self.useful_steps += int(valid.sum())
        for s, r in enumerate(slots):
            if r is not None:
                r.inflight -= 1
            if r is None or r.finished:
                continue
            m = valid[s]
            r.tokens.extend(toks[s][m].tolist())
            r.logps.extend(lps[s][m].tolist())
            r.versions.extend([version] * int(m.sum()))
            if done[s]:
                self._finish(r)
        self._note("read", t0)

    def _flush(self) -> None:
        while self._records:
            self._process(self._records.popleft())

    def _end_live(self) -> None:
        """Ends every live row with what it has ('abort')."""
        live = self._live()
        for r in live:
            self._finish(r, "abort")
        if live:  # their slots hold finished rows on the device too (a decode skips them)
            done = jax.device_put(np.ones(len(self._slots), bool), self.rows)
            self._state = self._state[:4] + (done,) + self._state[5:]

    def _finish(self, r: _Row, reason: str | None = None) -> None:
        """Delivers a row's Generation; frees its slot."""
        r.finished = True
        if 0 <= r.slot < len(self._slots) and self._slots[r.slot] is r:
            self._slots[r.slot] = None
        k = len(r.tokens)
        if reason is None:
            stops = r.req.params.stop_token_ids
            reason = "stop" if k and r.tokens[-1] in stops else "length"
        gen = Generation(
            r.req.request_id,
            np.asarray(r.tokens, np.int32),
            np.asarray(r.logps, np.float32),
            np.asarray(r.versions, np.int32),
            reason,
        )
        call = r.call
        call.results[r.index] = gen
        call.tokens += k
        call.left -= 1
        if call.left == 0:
            call.event.set()

    def _fail(self, error: BaseException) -> None:
        """Fails every queued and live call and queued weight update with the scheduler's error."""
        with self._cv:
            self._failed = error
            self._thread = None
            rows = list(self._waiting) + self._live()
            self._waiting.clear()
            installs, self._installs = list(self._installs), collections.deque()
        for r in rows:
            r.call.error = error
            r.call.event.set()
        for *_, handle in installs:
            handle.set_failed(error)


def _aborted(request_id: str) -> Generation:
    empty = np.zeros(0, np.int32)
    return Generation(request_id, empty, np.zeros(0, np.float32), empty, "abort")
