"""The built-in JAX sampler: continuous batching over a fixed set of decode slots.

This module is the host scheduler; the compiled programs it runs (prefill, insert, relayout,
decode chunk, the serving layout of the weights, warm compilation, the kernel choice) are
rl.rollout.jax_programs'.

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

On fixed slots (`fixed_slots`, the default on accelerators) warm() compiles every program the
scheduler can pick before serving. The cache grows and shrinks with the longest live row, so a
decode step attends over the positions in use, not over prompt + budget (with the Pallas
kernel, which reads only each row's valid positions, it only grows). A request's output does
not depend on what it was batched with or when it was admitted (each row has its own key).
`timeline` records the scheduler's calls, for diagnostics.

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
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from rl.metrics import BusyClock
from rl.rollout.base import (
    UPDATE_MODES,
    Generation,
    GenerationRequest,
    RolloutError,
    Weights,
    WeightUpdate,
)
from rl.rollout.jax_programs import (
    BATCH_BUCKETS,
    FINE_LEN_BUCKETS,
    LEN_BUCKETS,
    PROMPT_BUCKETS,
    STOP_BUCKETS,
    Programs,
    RowConstants,
    Warm,
    length_bucket,
)

EARLY_EXIT_FRACTION = 8  # a chunk ends early once 1/8 of the slots finished (rows waiting)
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


def _truncates(row: _Row) -> bool:
    """Whether the row samples from a truncated distribution (top-k or top-p on)."""
    p = row.req.params
    return p.top_k > 0 or p.top_p < 1.0


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
        gemm_autotune: bool = False,
    ):
        if update_mode not in UPDATE_MODES:
            raise ValueError(f"JaxEngine: update_mode {update_mode!r}; valid: {UPDATE_MODES}")
        if chunk < 1 or max_batch < 1:
            raise ValueError(f"JaxEngine: chunk={chunk}, max_batch={max_batch}; both must be >= 1")
        if cache_len is not None and cache_len < 1:
            raise ValueError(f"JaxEngine: cache_len={cache_len}; must be >= 1 (or None)")
        self.update_mode = update_mode
        self.background_install = background_install
        self.continuous = continuous
        self.version = version
        self.chunk = chunk
        devices = list(devices) if devices else jax.local_devices()[:1]
        accelerator = devices[0].platform != "cpu"
        self.overlap = accelerator if overlap is None else overlap
        # A chunk that ends when rows finish (a data-dependent loop; on an accelerator its
        # condition may wait on the host each step) is kept to the CPU by default.
        self.early_exit = (not accelerator) if early_exit is None else early_exit
        # The compiled programs and the weights they serve (sampling as two Pallas kernels,
        # rl.rollout.sample_kernel, where no row truncates and the device runs them).
        self.programs = Programs(
            model,
            devices=devices,
            chunk=chunk,
            early_exit=self.early_exit,
            decode_attention=decode_attention,
            sample_kernel=sample_kernel,
            gemm_autotune=gemm_autotune,
        )
        p = self.programs
        self.config, self.devices, self.rows = p.config, p.devices, p.rows  # rows: [C, ...]
        self.decode_attention, self.sample_kernel = p.decode_attention, p.sample_kernel
        self.k_pos, self.ragged, self.fold_norms = p.k_pos, p.ragged, p.fold_norms
        self.interpret = p.interpret  # the Pallas kernels interpreted (off a GPU)
        nd = len(self.devices)
        self.max_batch = -(-max_batch // nd) * nd  # slots split evenly over the devices
        self._floor = LEN_BUCKETS[0]  # the shortest cache the scheduler allocates (see warm)
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
        self.pid = os.getpid()
        self.sync_times: list[dict] = []  # per update_weights: copy_s, install_s, total_s
        self.clock = BusyClock()
        _ENGINES.add(self)
        if warm is not None:  # before serving, so that nothing compiles while it serves
            self.warm(warm.prompt_len, warm.max_new_tokens, truncate=warm.truncate)

    @property
    def params(self):
        """The served weights, in their serving layout (Programs.params)."""
        return self.programs.params

    @property
    def traces(self) -> int:
        """Programs traced (compilations): prefill, insert, relayout, decode, serving layout."""
        return self.programs.traces

    @property
    def warm_traces(self) -> int:
        """Of the traces, those warm() traced before serving."""
        return self.programs.warm_traces

    def served_params(self):
        """The served weights as the model's params tree (Programs.served_params)."""
        return self.programs.served_params()

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
        params = self.programs.place(Weights.of(weights).tree(self.programs.template))
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
        self.programs.params, self.version = self.programs.serve(params), version
        t2 = time.perf_counter()
        self.sync_times.append({"copy_s": t1 - t0, "install_s": t2 - t1, "total_s": t2 - t0})
        handle.set_served()
        self._note("install", t_start)

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
        return self.programs.warm(self.max_batch, Ss, Ts, sizes, truncate)

    def record_timeline(self) -> list:
        """A new `timeline` list, which the scheduler appends its calls to from now on."""
        self.timeline = []
        return self.timeline

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
        new = RowConstants.empty(b, self._n_stop())
        for i, (r, s) in enumerate(zip(rows, free)):
            tokens[i, : r.prompt_len] = r.req.prompt_ids
            lengths[i], idx[i] = r.prompt_len, s
            new.set(i, r.req)
            r.slot = s
            self._slots[s] = r
        tokens, lengths, idx, consts = jax.device_put(
            (tokens, lengths, idx, new.arrays()), self.rows
        )
        truncate = any(_truncates(r) for r in rows)
        tok, lp, done, cache = self.programs.prefill(self.params, tokens, lengths, consts, truncate)
        self._state = self.programs.insert(self._state, idx, tok, lengths, done, cache, consts)
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
            cache = self.programs.new_cache(C, self.cache_len or self._floor)
            zeros = np.zeros(C, np.int32)
            consts = RowConstants.empty(C, STOP_BUCKETS[0]).arrays()
            state = (cache, zeros, zeros, zeros, np.ones(C, bool), consts)
            self._state = jax.device_put(state, self.programs.state_rows)
            return
        if C < len(self._slots):
            self._flush()  # records name slots by index
            live = self._live()
            idx = np.array([r.slot for r in live] + [-1] * (C - len(live)), np.int32)
        else:
            idx = np.concatenate([np.arange(len(self._slots)), np.full(C - len(self._slots), -1)])
            idx = idx.astype(np.int32)
        idx = jax.device_put(idx, self.rows)
        self._state = self.programs.relayout(self._state, idx, self._S(), self._n_stop())
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
                self._state = self.programs.relayout(self._state, idx, self.cache_len, width)
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
            self._state = self.programs.relayout(self._state, idx, new, width)

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
        self._state, toks, lps, done, steps = self._decode(stop_after, truncate)
        self._records.append(("chunk", list(self._slots), toks, lps, done, steps, self.version))
        if self.timeline is not None:  # (the live count only when a timeline is kept)
            self._note("chunk", t0, sum(r is not None for r in self._slots), queued, self._S(), C)

    def _decode(self, stop_after: int, truncate: bool):
        """Dispatches the decode chunk over the slots (the call tests wrap to act between
        chunks): (state, tokens, log-probs, done, steps), as Programs.decode."""
        return self.programs.decode(self.params, self._state, np.int32(stop_after), truncate)

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
