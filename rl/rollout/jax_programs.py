"""The JAX sampler's compiled programs, which rl.rollout.jax_engine's scheduler runs: the weights
in their serving layout, the batched prefill of new rows, their insert into slots, the relayout
that resizes the slots and the cache, and the decode chunk; their lowering and compilation
before serving (warm), and the choice of kernels (rl.rollout.kernels).

The programs work on the engine state, split over the devices by row (slot):
(cache, tok, pos, n, done, consts): the KV cache ([C, ...] per layer), each slot's last token,
its next position, its tokens so far, whether it finished (an empty slot holds a finished row),
and its sampling constants (RowConstants.arrays()). Shapes are bucketed (slots, cache length,
prefill batch and prompt length), so a run compiles a handful of programs. Weights are served
in the compute dtype. Each row samples with its own key (fold_in of the request seed and the
token index), so a row's tokens do not depend on what it is batched with.
"""

from __future__ import annotations

import dataclasses
import os
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from models.decode_attention import supported
from models.kv_cache import KVCache, init_cache
from rl import startup
from rl.rollout import kernels, sample_kernel
from rl.rollout.base import GenerationRequest
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
STOP_BUCKETS = (4, 8, 16, 64)  # widths of the stop-token tables


@dataclasses.dataclass
class RowConstants:
    """Sampling constants of rows ([C, ...] numpy): built on the host for an admission; the
    slots' own live on the device, in the engine state (written by the insert)."""

    keys: np.ndarray  # uint32 [C, 2]
    temp: np.ndarray  # float32 [C]
    top_k: np.ndarray  # int32 [C]
    top_p: np.ndarray  # float32 [C]
    max_new: np.ndarray  # int32 [C]
    stop: np.ndarray  # int32 [C, n_stop], -1 pads (a token id is never -1)

    @classmethod
    def empty(cls, C: int, n_stop: int) -> RowConstants:
        """The constants of C empty rows."""
        return cls(
            np.zeros((C, 2), np.uint32),
            np.ones(C, np.float32),
            np.zeros(C, np.int32),
            np.ones(C, np.float32),
            np.ones(C, np.int32),
            np.full((C, n_stop), -1, np.int32),
        )

    def set(self, slot: int, req: GenerationRequest) -> None:
        """Row `slot` samples as `req` asks, keyed by its seed (else a hash of its id)."""
        p = req.params
        seed = p.seed if p.seed is not None else zlib.crc32(req.request_id.encode())
        self.keys[slot] = key_data(seed)
        self.temp[slot], self.top_k[slot], self.top_p[slot] = p.temperature, p.top_k, p.top_p
        self.max_new[slot] = p.max_new_tokens
        self.stop[slot] = -1
        self.stop[slot, : len(p.stop_token_ids)] = p.stop_token_ids

    def arrays(self) -> tuple:
        """The constants in the order of the engine state's consts."""
        return (self.keys, self.temp, self.top_k, self.top_p, self.max_new, self.stop)


WARM_THREADS = 8  # XLA compilations at a time in warm()


def compile_all(lowered: list) -> list:
    """Compiles lowered programs, concurrently on a thread per core this process may use (at
    most WARM_THREADS): XLA compiles without holding the GIL, and a GPU's programs each take
    about a second of host time however small."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    n = min(WARM_THREADS, cores or 1, len(lowered))
    if n <= 1:
        return [lo.compile() for lo in lowered]
    with ThreadPoolExecutor(n, thread_name_prefix="warm-compile") as pool:
        return list(pool.map(lambda lo: lo.compile(), lowered))


class Programs:
    """The compiled programs of one JaxEngine on its `devices` (params replicated, rows split
    over them) and the weights they serve (`params`, in the serving layout)."""

    def __init__(
        self,
        model: nnx.Module,
        *,
        devices: Sequence[jax.Device],
        chunk: int,
        early_exit: bool,
        decode_attention: str = "auto",
        sample_kernel: bool | None = None,
        gemm_autotune: bool = False,
    ):
        if decode_attention not in DECODE_ATTENTION:
            raise ValueError(
                f"JaxEngine: decode_attention {decode_attention!r}; valid: {DECODE_ATTENTION}"
            )
        self.graphdef, params, self.rest = nnx.split(model, nnx.Param, ...)
        self.config = c = model.config
        self.devices = list(devices)
        if len(set(self.devices)) != len(self.devices):
            raise ValueError(f"JaxEngine: devices {self.devices} repeat a device")
        self.chunk, self.early_exit = chunk, early_exit
        mesh = Mesh(np.asarray(self.devices, dtype=object), ("rows",), axis_types=(AxisType.Auto,))
        self.replicated = NamedSharding(mesh, PartitionSpec())  # params
        self.rows = NamedSharding(mesh, PartitionSpec("rows"))  # every [C, ...] array
        # The params tree's shapes (what update_weights' trees match) in the compute dtype: every
        # use casts a weight to it (the same numbers), so float32 master weights are served and
        # copied at half the bytes. self.params holds them in their serving layout (_serve_impl).
        compute = jnp.dtype(c.dtype)
        self.template = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(
                a.shape, compute if jnp.issubdtype(a.dtype, jnp.floating) else a.dtype
            ),
            params,
        )
        self.layer_def = None  # the graphdef of one decoder layer (set by _serve_impl)
        self.traces = 0  # programs traced (compilations): prefill, insert, relayout, decode, serve
        self.warm_traces = 0  # of those, traced by warm() before serving
        self.decode_attention, self.sample_kernel = kernels.choose(
            decode_attention, sample_kernel, self.devices, c, compute
        )
        self.interpret = self.devices[0].platform != "gpu"  # the Pallas kernels off a GPU: tests
        # The Pallas kernel reads keys with the head dim minor (a block of slots contiguous).
        self.k_pos = 2 if self.decode_attention == "pallas" else 3
        per_layer = (self.rows,) * c.num_hidden_layers  # the cache: [C, ...] per layer
        self.cache_rows = KVCache(k=per_layer, v=per_layer, k_pos=self.k_pos)
        # (cache, tok, pos, n, done, consts): consts are RowConstants.arrays() of the slots
        self.state_rows = (self.cache_rows,) + (self.rows,) * 4 + ((self.rows,) * 6,)
        # With the Pallas kernel a step reads each row's valid positions only, so a longer cache
        # costs no step time: it only grows (no relayouts back and forth, no programs per length).
        self.ragged = self.decode_attention == "pallas" and supported(
            c.dtype, c.num_attention_heads, c.num_key_value_heads, c.head_dim, LEN_BUCKETS[0]
        )
        # The norms' weights folded into the q/k/v and gate/up kernels where the attention
        # kernel finishes the input norm (two kernels fewer a layer); not for float16, whose
        # range the unnormalized input's GEMM could exceed.
        self.fold_norms = self.ragged and not c.qk_norm and jnp.dtype(c.dtype) != jnp.float16
        rows, state = self.rows, self.state_rows
        platform = self.devices[0].platform
        opts = startup.gemm_options(gemm_autotune, platform)
        self.serve = jax.jit(self._serve_impl, out_shardings=self.replicated, compiler_options=opts)
        self.prefill = jax.jit(
            self._prefill_impl,
            static_argnums=(4,),
            out_shardings=(rows,) * 3 + (self.cache_rows,),
            compiler_options=opts,
        )
        self.insert = jax.jit(
            self._insert_impl, donate_argnums=(0,), out_shardings=state, compiler_options=opts
        )
        self.relayout = jax.jit(
            self._relayout_impl, static_argnums=(2, 3), out_shardings=state, compiler_options=opts
        )
        decode_base = GPU_DECODE_OPTIONS if platform == "gpu" else None
        self.decode = jax.jit(
            self._decode_impl,
            static_argnums=(3,),
            donate_argnums=(1,),
            compiler_options=startup.gemm_options(gemm_autotune, platform, decode_base),
            out_shardings=(state,) + (rows,) * 3 + (self.replicated,),
        )
        self.params = self.serve(self.place(params))

    # -- weights --------------------------------------------------------------------------
    def place(self, tree):
        """A private copy of a params tree in the serving dtypes, replicated on the devices
        (the learner donates its buffers)."""
        tree = jax.tree.map(lambda t, a: a.astype(t.dtype), self.template, tree)

        def own(x):
            y = jax.device_put(x, self.replicated)
            if isinstance(x, jax.Array) and set(x.devices()) & set(self.devices):
                y = jnp.array(y, copy=True)  # device_put may alias a buffer already there
            return y

        return jax.tree.map(own, tree)

    def served_params(self):
        """The served weights as the model's params tree (the layers stacked back, the fused
        kernels split): what update_weights took, for callers that compare weights (with
        fold_norms, the q/k/v and gate/up kernels within two roundings of it)."""
        return params_of_layout(
            self.params, self.layer_def, self.config, self.template, self.fold_norms
        )

    def new_cache(self, rows: int, slots: int) -> KVCache:
        """An all-zero cache in this engine's key layout."""
        return init_cache(self.config, rows, slots, k_pos=self.k_pos)

    # -- the programs ---------------------------------------------------------------------
    def _serve_impl(self, params):
        """(head, layers): layout.serving_layout of the weights, once per version; records the
        layers' graphdef (static)."""
        self.traces += 1
        model = nnx.merge(self.graphdef, params, self.rest)
        head, layers, self.layer_def = serving_layout(model, self.fold_norms)
        return head, layers

    def _model(self, params):
        """(model, per-layer modules and fused kernels) of _serve_impl's weights."""
        head, layers = params
        model = nnx.merge(self.graphdef, head, self.rest)
        return model, [(nnx.merge(self.layer_def, st), fused) for st, fused in layers]

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
            self.new_cache(b, T),
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
        empty = RowConstants.empty(1, n_stop).arrays()  # an empty row's constants
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

    # -- lowering and compiling ahead -----------------------------------------------------
    def abstract(self, C: int, S: int):
        """Shapes and shardings of the state for C slots and a cache of S slots."""
        arg = lambda shape, dtype, sharding: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
        kv = jax.eval_shape(lambda: self.new_cache(C, S))
        cache = jax.tree.map(lambda a, sh: arg(a.shape, a.dtype, sh), kv, self.cache_rows)
        i32 = arg((C,), jnp.int32, self.rows)
        flag = arg((C,), jnp.bool_, self.rows)
        empty = RowConstants.empty(C, STOP_BUCKETS[0]).arrays()
        consts = tuple(arg(a.shape, a.dtype, self.rows) for a in empty)
        return cache, i32, i32, i32, flag, consts

    def lower_decode(
        self, slots: int, cache_len: int, truncate: bool = False
    ) -> jax.stages.Lowered:
        """The decode chunk lowered for `slots` rows and cache_len cache positions, nothing
        allocated or run (compile-time benchmarks, warm)."""
        state = self.abstract(slots, cache_len)
        return self.decode.lower(self.params, state, np.int32(1), truncate)  # as a dispatch

    def lower_prefill(
        self, rows: int, prompt_len: int, truncate: bool = False
    ) -> jax.stages.Lowered:
        """The prefill lowered for `rows` prompts of prompt_len tokens, nothing run (warm)."""
        _, lengths, *_, consts = self.abstract(rows, prompt_len)
        tokens = jax.ShapeDtypeStruct((rows, prompt_len), jnp.int32, sharding=self.rows)
        return self.prefill.lower(self.params, tokens, lengths, consts, truncate)

    def warm(self, slots: int, cache_lens, prompt_lens, admissions, truncate: bool) -> int:
        """Compiles what a scheduler on `slots` fixed slots runs for these cache lengths, prompt
        buckets and admission sizes: per cache length a decode chunk and the relayouts from the
        others, per prompt bucket (within the cache length) and admission size a prefill and
        an insert; with `truncate` the prefills and decode chunks that truncate too. The
        programs are lowered here and compiled concurrently (compile_all). Returns the
        programs traced."""
        before, C = self.traces, slots
        modes = (False, True) if truncate else (False,)
        i32 = jax.ShapeDtypeStruct((C,), jnp.int32, sharding=self.rows)
        Ts = sorted({T for T in prompt_lens if T <= max(cache_lens)})  # a prefill grows the
        keys = [(b, T, t) for T in Ts for b in sorted(admissions) for t in modes]  # cache to T
        lowered = [self.lower_prefill(b, T, t) for b, T, t in keys]
        for S in cache_lens:
            lowered += [self.lower_decode(C, S, t) for t in modes]
            for other in cache_lens:
                if other != S:
                    old = self.abstract(C, other)
                    lowered.append(self.relayout.lower(old, i32, S, STOP_BUCKETS[0]))
        compiled = compile_all(lowered)
        prefill_out = {k: c.out_info for k, c in zip(keys, compiled)}  # what an insert takes
        inserts = []
        for S in cache_lens:
            state = self.abstract(C, S)
            for T in (T for T in Ts if T <= S):
                for b in sorted(admissions):
                    tok, _, done, cache = prefill_out[b, T, False]  # (the same either way)
                    _, lengths, *_, consts = self.abstract(b, T)
                    inserts.append(
                        self.insert.lower(state, lengths, tok, lengths, done, cache, consts)
                    )
        compile_all(inserts)
        self.warm_traces += self.traces - before
        return self.traces - before
