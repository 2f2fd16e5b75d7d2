"""The built-in JAX sampler: batched prefill + chunked decode with a KV cache.

Shapes are bucketed (batch, prompt length, generation length), so a run compiles a handful of
programs and then reuses them. Decoding runs in jitted chunks of `chunk` tokens; between chunks
the host checks for an abort (partial rollouts) and whether every row has finished.
Each row samples with its own key (fold_in of the request seed and the token index), so a
request's output does not depend on what it was batched with.

The engine runs on its own `devices` (default: the first device): the params are replicated over
them and each batch is split along its rows, so on a host with several accelerators the rollout
can hold devices the learner does not use (trainer.rollout_devices). New weights are copied
device to device; with `background_install` a thread installs them in order (after the
in-flight batch under `drain`) while update_weights returns at once.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import zlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from models.transformer import init_cache
from rl.metrics import BusyClock
from rl.rollout.base import (
    UPDATE_MODES,
    Generation,
    GenerationRequest,
    Weights,
    WeightUpdate,
)


def length_bucket(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket >= n (past the last one: a multiple of it)."""
    for b in buckets:
        if n <= b:
            return b
    return -(-n // buckets[-1]) * buckets[-1]


LEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def process_logits(
    logits_BV: jax.Array, temperature_B: jax.Array, top_k_B: jax.Array, top_p_B: jax.Array
) -> jax.Array:
    """Temperature, then top-k and top-p truncation (masked to -inf). Greedy rows use T=1."""
    t = jnp.where(temperature_B > 0, temperature_B, 1.0)
    x = logits_BV.astype(jnp.float32) / t[:, None]
    # The vocabulary sort only runs when some row truncates (top-k or top-p on).
    truncate = jnp.any((top_k_B > 0) | (top_p_B < 1.0))
    return jax.lax.cond(truncate, _truncate, lambda x, *_: x, x, top_k_B, top_p_B)


def _truncate(x: jax.Array, top_k_B: jax.Array, top_p_B: jax.Array) -> jax.Array:
    V = x.shape[-1]
    sorted_x = jnp.sort(x, axis=-1)[:, ::-1]
    k = jnp.where(top_k_B > 0, jnp.minimum(top_k_B, V), V)
    kth = jnp.take_along_axis(sorted_x, (k - 1)[:, None], axis=-1)
    x = jnp.where(x < kth, -jnp.inf, x)
    # top-p: keep the smallest prefix of the sorted distribution with mass >= p.
    sorted_x = jnp.where(sorted_x < kth, -jnp.inf, sorted_x)
    probs = jax.nn.softmax(sorted_x, axis=-1)
    cum_before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = cum_before < top_p_B[:, None]
    cutoff = jnp.min(jnp.where(keep_sorted, sorted_x, jnp.inf), axis=-1, keepdims=True)
    x = jnp.where((top_p_B[:, None] < 1.0) & (x < cutoff), -jnp.inf, x)
    return x


def _sample(x_BV, keys_B2, temperature_B):
    """Samples one token per row from processed logits; returns (token, its log-prob)."""
    logp_all = jax.nn.log_softmax(x_BV, axis=-1)
    sampled = jax.vmap(jax.random.categorical)(keys_B2, x_BV)
    greedy = jnp.argmax(x_BV, axis=-1)
    tok = jnp.where(temperature_B > 0, sampled, greedy).astype(jnp.int32)
    return tok, jnp.take_along_axis(logp_all, tok[:, None], axis=-1)[:, 0]


def _key_data(seed: int) -> np.ndarray:
    """uint32 [2] threefry key of an integer seed: jax.random.PRNGKey(seed) for 0 <= seed < 2**32,
    and all 64 bits of larger seeds (PRNGKey keeps only 32 of them without x64)."""
    s = int(seed) & 0xFFFFFFFFFFFFFFFF
    return np.array([s >> 32, s & 0xFFFFFFFF], np.uint32)


class JaxEngine:
    """Rollout engine running the policy in process on its own devices."""

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
    ):
        if update_mode not in UPDATE_MODES:
            raise ValueError(f"JaxEngine: update_mode {update_mode!r}; valid: {UPDATE_MODES}")
        self.update_mode = update_mode
        self.background_install = background_install
        self.graphdef, params, self.rest = nnx.split(model, nnx.Param, ...)
        self.config = model.config
        self.devices = list(devices) if devices else [jax.devices()[0]]
        if len(set(self.devices)) != len(self.devices):
            raise ValueError(f"JaxEngine: devices {self.devices} repeat a device")
        mesh = Mesh(np.asarray(self.devices, dtype=object), ("rows",), axis_types=(AxisType.Auto,))
        self.replicated = NamedSharding(mesh, PartitionSpec())  # params, scalars
        self.rows = NamedSharding(mesh, PartitionSpec("rows"))  # every [B, ...] array
        self.params = self._own(params)
        self.version = version
        self.chunk = chunk
        self.max_batch = max_batch
        self.deadline_s = deadline_s
        self._abort = threading.Event()  # set by abort(), cleared by resume()
        self._interrupt = threading.Event()  # set while a weight update interrupts
        self._lock = threading.Lock()  # held while a batch generates
        self._cond = threading.Condition()
        self._pending = 0  # weight updates waiting for the lock
        self._updates: queue.Queue | None = None  # installs of update_weights(on_served=...)
        self.traces = 0  # number of times a generation program was traced (compilations)
        rows, rep = self.rows, self.replicated
        self._prefill = jax.jit(
            self._prefill_impl, static_argnames=("N",), out_shardings=(rows, rows, rows)
        )
        carry_out = (rows,) * 7 + (rep,)  # (cache, tok, pos, n, done, out_tok, out_lp), step
        self._decode = jax.jit(self._decode_impl, donate_argnums=(1,), out_shardings=carry_out)
        self.pid = os.getpid()
        self.sync_times: list[dict] = []  # per update_weights: copy_s, install_s, total_s
        self.clock = BusyClock()

    # -- weights --------------------------------------------------------------------------
    def update_weights(self, version: int, weights) -> WeightUpdate:
        """Copies `weights` onto the engine's devices and serves them as `version`.

        Under `continue` an in-flight batch returns 'abort' partials at its next chunk end;
        under `drain` it finishes first. With background_install the handle is done once the
        copy has landed and is installed (the caller may donate its buffers at once);
        otherwise update_weights returns when the engine serves the version.
        """
        t0 = time.perf_counter()
        tree = Weights.of(weights).tree(self.params)
        params = self._own(jax.tree.map(lambda old, new: new.astype(old.dtype), self.params, tree))
        t1 = time.perf_counter()
        with self._cond:
            self._pending += 1
        if self.update_mode == "continue":
            self._interrupt.set()
        handle = WeightUpdate(version)
        if not self.background_install:
            self._install(version, params, t0, t1)
            handle.set_served()
            return handle
        if self._updates is None:
            self._updates = queue.Queue()
            threading.Thread(target=self._install_loop, name="weights", daemon=True).start()
        self._updates.put((version, params, t0, t1, handle))
        return handle

    def _install(self, version: int, params, t0: float, t1: float) -> None:
        """Swaps in copied weights once no batch runs (drain) or at a chunk end (continue)."""
        try:
            with self._lock:  # drain: waits for the in-flight batch; continue: for its chunk
                self.params = params
                self.version = version
        finally:
            with self._cond:
                self._pending -= 1
                if self._pending == 0:
                    self._interrupt.clear()
                self._cond.notify_all()
        t2 = time.perf_counter()
        self.sync_times.append({"copy_s": t1 - t0, "install_s": t2 - t1, "total_s": t2 - t0})

    def _install_loop(self) -> None:
        """Installs queued weight updates in order; reports each one served (or failed)."""
        while True:
            version, params, t0, t1, handle = self._updates.get()
            try:
                jax.block_until_ready(params)  # served = the copy has landed on the devices
                self._install(version, params, t0, t1)
            except BaseException as e:  # noqa: BLE001 - the learner must hear of any failure
                handle.set_failed(e)
                continue
            handle.set_served()

    def _own(self, params):
        """A private copy replicated on the engine's devices (the learner donates its buffers)."""

        def own(x):
            y = jax.device_put(x, self.replicated)
            if isinstance(x, jax.Array) and set(x.devices()) & set(self.devices):
                y = jnp.array(y, copy=True)  # device_put may alias a buffer already there
            return y

        return jax.tree.map(own, params)

    def stats(self) -> dict:
        """Generation busy time, calls, tokens, weight installs, compilations, pid."""
        return {
            **self.clock.snapshot(),
            "updates": len(self.sync_times),
            "install_s": sum(t["install_s"] for t in self.sync_times),
            "sync_s": sum(t["total_s"] for t in self.sync_times),
            "traces": self.traces,
            "pid": self.pid,
        }

    # -- compiled programs ----------------------------------------------------------------
    def _prefill_impl(self, params, tokens_BT, lengths_B, keys_B2, temp_B, topk_B, topp_B, N):
        self.traces += 1
        model = nnx.merge(self.graphdef, params, self.rest)
        B, T = tokens_BT.shape
        cache = init_cache(self.config, B, T + N)
        last, cache = model.prefill(tokens_BT, lengths_B, cache, last_only=True)
        keys = jax.vmap(lambda k: jax.random.fold_in(k, 0))(keys_B2)
        tok, lp = _sample(process_logits(last, temp_B, topk_B, topp_B), keys, temp_B)
        return tok, lp, cache

    def _decode_impl(self, params, carry, keys_B2, temp_B, topk_B, topp_B, maxnew_B, stop_BS):
        self.traces += 1
        model = nnx.merge(self.graphdef, params, self.rest)

        def one(i, c):
            cache, tok, pos, n, done, out_tok, out_lp, step = c
            logits, cache = model.decode(tok, pos, cache)
            keys = jax.vmap(lambda k: jax.random.fold_in(k, step + 1))(keys_B2)
            new, lp = _sample(process_logits(logits, temp_B, topk_B, topp_B), keys, temp_B)
            active = ~done
            out_tok = jnp.where(
                active[:, None] & (jnp.arange(out_tok.shape[1]) == n[:, None]),
                new[:, None],
                out_tok,
            )
            out_lp = jnp.where(
                active[:, None] & (jnp.arange(out_lp.shape[1]) == n[:, None]), lp[:, None], out_lp
            )
            n = n + active
            hit_stop = jnp.any(new[:, None] == stop_BS, axis=-1)
            done = done | (active & (hit_stop | (n >= maxnew_B)))
            return (
                cache,
                jnp.where(active, new, tok),
                pos + active,
                n,
                done,
                out_tok,
                out_lp,
                step + 1,
            )

        return jax.lax.fori_loop(0, self.chunk, one, carry)

    # -- generation -----------------------------------------------------------------------
    def abort(self) -> None:
        """Ends in-flight generate() calls at a chunk boundary, later ones at once; see resume()."""
        self._abort.set()

    def resume(self) -> None:
        """Undoes abort()."""
        self._abort.clear()

    def generate(self, requests: list[GenerationRequest]) -> list[Generation]:
        """Completes every request (in batches of at most max_batch)."""
        out: list[Generation] = []
        for i in range(0, len(requests), self.max_batch):
            out.extend(self._generate_batch(requests[i : i + self.max_batch]))
        return out

    def _generate_batch(self, reqs: list[GenerationRequest]) -> list[Generation]:
        n = len(reqs)
        B = min(length_bucket(n, BATCH_BUCKETS), max(self.max_batch, n))
        B = -(-B // len(self.devices)) * len(self.devices)  # rows split evenly over devices
        prompt_lens = np.array([len(r.prompt_ids) for r in reqs], np.int32)
        if prompt_lens.min() < 1:
            raise ValueError("every request needs a prompt of at least one token")
        Tp = length_bucket(int(prompt_lens.max()), LEN_BUCKETS)
        max_new = np.array([r.params.max_new_tokens for r in reqs], np.int32)
        N = length_bucket(int(max_new.max()), LEN_BUCKETS)
        tokens = np.zeros((B, Tp), np.int32)
        for i, r in enumerate(reqs):
            tokens[i, : prompt_lens[i]] = r.prompt_ids
        lengths = np.ones(B, np.int32)
        lengths[:n] = prompt_lens

        def per_row(f, dtype, fill):
            a = np.full(B, fill, dtype)
            a[:n] = [f(r.params) for r in reqs]
            return a

        temp = per_row(lambda p: p.temperature, np.float32, 1.0)
        topk = per_row(lambda p: p.top_k, np.int32, 0)
        topp = per_row(lambda p: p.top_p, np.float32, 1.0)
        maxnew = np.ones(B, np.int32)
        maxnew[:n] = max_new
        seeds = [
            r.params.seed if r.params.seed is not None else zlib.crc32(r.request_id.encode())
            for r in reqs
        ]
        keys = np.zeros((B, 2), np.uint32)
        keys[:n] = [_key_data(s) for s in seeds]
        # Each row stops on its own request's tokens only (-1 pads; a token id is never -1).
        n_stop = max([len(r.params.stop_token_ids) for r in reqs] + [1])
        stop_BS = np.full((B, length_bucket(n_stop, (4, 8, 16, 64))), -1, np.int32)
        for i, r in enumerate(reqs):
            stop_BS[i, : len(r.params.stop_token_ids)] = r.params.stop_token_ids

        with self._cond:  # a pending weight update goes first
            if not self._cond.wait_for(lambda: self._pending == 0, timeout=self.deadline_s):
                raise TimeoutError(
                    f"JaxEngine: weight update still pending after {self.deadline_s}s"
                )
        with self._lock:
            if self._abort.is_set():  # aborted before it started: nothing generated
                empty = np.zeros(0, np.int32)
                return [
                    Generation(r.request_id, empty, np.zeros(0, np.float32), empty, "abort")
                    for r in reqs
                ]
            self.clock.enter()
            gens: list[Generation] = []
            try:
                gens = self._generate_locked(
                    reqs, tokens, lengths, keys, temp, topk, topp, maxnew, stop_BS, N, B, n
                )
                return gens
            finally:
                self.clock.exit(sum(len(g.token_ids) for g in gens))

    def _generate_locked(
        self, reqs, tokens, lengths, keys, temp, topk, topp, maxnew, stop_BS, N, B, n
    ):
        params, version = self.params, self.version
        # Every [B, ...] input split along rows over the engine's devices, once per batch, like
        # the decode outputs fed back in: a mix of host and device arrays (or of shardings) is a
        # different jit signature (a second trace and compile).
        keys, temp, topk, topp, maxnew_d, stop_d, tokens_d, lengths_d = jax.device_put(
            (keys, temp, topk, topp, maxnew, stop_BS, tokens, lengths), self.rows
        )
        tok, lp, cache = self._prefill(params, tokens_d, lengths_d, keys, temp, topk, topp, N=N)
        out_tok = np.zeros((B, N), np.int32)
        out_lp = np.zeros((B, N), np.float32)
        tok_np, lp_np = np.asarray(tok), np.asarray(lp)
        out_tok[:, 0], out_lp[:, 0] = tok_np, lp_np
        n_gen = np.ones(B, np.int32)
        done = (tok_np[:, None] == stop_BS).any(-1) | (maxnew <= 1)
        done[n:] = True
        rows_carry = (cache, tok, lengths, n_gen, done, out_tok, out_lp)
        step = np.zeros((), np.int32)
        carry = (*jax.device_put(rows_carry, self.rows), jax.device_put(step, self.replicated))
        aborted = False
        while not bool(np.all(np.asarray(carry[4]))):
            if self._abort.is_set() or self._interrupt.is_set():
                aborted = True
                break
            carry = self._decode(params, carry, keys, temp, topk, topp, maxnew_d, stop_d)
        _, _, _, n_gen, done, out_tok, out_lp, _ = jax.device_get(carry)
        gens = []
        for i, r in enumerate(reqs):
            k = int(n_gen[i])
            ids = out_tok[i, :k]
            if aborted and not done[i]:
                reason = "abort"
            elif k and int(ids[-1]) in r.params.stop_token_ids:
                reason = "stop"
            else:
                reason = "length"
            gens.append(
                Generation(
                    r.request_id,
                    ids.astype(np.int32),
                    out_lp[i, :k].astype(np.float32),
                    np.full(k, version, np.int32),
                    reason,
                )
            )
        return gens

    def close(self) -> None:
        """Ends in-flight generation (nothing else to release in process)."""
        self.abort()
