"""A JaxEngine in a child process, optionally pinned to its own CPU cores.

On a CPU host a sampler and a train step in threads of one process barely overlap (each alone
spreads over every core through XLA's thread pool); in two processes they overlap. The child
pins itself (os.sched_setaffinity) and sets its XLA flags BEFORE it imports JAX. Messages are
pickled numpy over a pipe:

  parent -> child   ("generate", id, [GenerationRequest])   -> (id, ok, [Generation], stats)
                    ("update", id, (version, path, {name: array})) -> (id, ok, secs, stats)
                    ("warm", id, (prompt_len, max_new_tokens, truncate)) -> (id, ok, n, stats)
                    ("abort" | "resume" | "stats" | "close", id, None) -> (id, ok, None, stats)

The child's main thread only receives; each generate runs in its own thread and weight updates
run in order on one update thread, so an update lands while a generate is in flight, exactly as
with the in-process JaxEngine (`drain` waits for the running batch, `continue` makes it return
'abort' partials at the next chunk boundary). Every wait has a deadline. A child that dies
is replaced (up to max_restarts) by one on the newest weights: the calls it took with it raise
WorkerLost, so their work is dispatched again; past the limit a call raises
RolloutProcessError naming the child and its exit code. A watchdog pings the child (its main
thread answers "stats" while generates run): one that leaves a ping unanswered for hang_s is
hung (stopped, deadlocked) and is killed, and then replaced exactly as a dead one.

The child starts its own session (os.setsid), as a separately launched engine server would:
Linux's autogroup scheduler gives each session one fair share of a busy host.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import queue
import threading
import time
import traceback

import numpy as np

from models.params import fill_params
from rl.rollout.base import (
    Generation,
    GenerationRequest,
    RolloutError,
    Weights,
    WeightUpdate,
    WorkerLost,
)


class RolloutProcessError(RolloutError):
    """The rollout process died, failed a command, or did not answer within the deadline."""


def _child_main(conn, config, version, cores, engine_kwargs, xla_flags):
    """Entry point of the rollout process: pin, then import JAX, then serve commands."""
    # Its own session, as a separately launched engine server would be: Linux's autogroup
    # scheduler gives each session one fair share of a busy machine, and in the trainer's
    # session the learner and this process would split one share between them.
    os.setsid()
    if cores:
        os.sched_setaffinity(0, set(cores))  # before JAX sizes its thread pool
    if xla_flags is not None:
        os.environ["XLA_FLAGS"] = xla_flags
    import jax
    from flax import nnx

    from models.params import abstract_params
    from rl.rollout.jax_engine import JaxEngine
    from rl.startup import CompileCounter

    send_lock = threading.Lock()

    def send(*msg):
        with send_lock:
            conn.send(msg)

    engine = None

    compiles = CompileCounter()

    def stats() -> dict:  # the engine's counters (busy time, tokens, installs, traces), compiles
        out = engine.stats() if engine is not None else {}
        return {
            **out,
            "pid": os.getpid(),
            "compile": compiles.since_start(),
            "compile_programs": compiles.programs_since_start(),
        }

    try:
        kind, flat = conn.recv()  # the initial params come over the pipe, not as spawn args
    except (EOFError, OSError):
        return
    try:
        graphdef, template = abstract_params(config)
        device = jax.devices()[0]
        params = jax.tree.map(lambda x: jax.device_put(x, device), fill_params(template, flat))
        engine = JaxEngine(nnx.merge(graphdef, params), version=version, **engine_kwargs)
    except BaseException:  # noqa: BLE001 - the parent must hear why the child could not start
        send("ready", False, traceback.format_exc(), None)
        return
    del flat
    send("ready", True, {"pid": os.getpid(), "cores": sorted(os.sched_getaffinity(0))}, None)

    # Message order is the serving order: a generate waits until every weight update received
    # before it is installed (the update thread may still be converting it, or draining).
    order = {"received": 0, "installed": 0}
    order_cv = threading.Condition()

    def generate(mid, requests, after_updates):
        with order_cv:
            order_cv.wait_for(lambda: order["installed"] >= after_updates)
        try:
            gens = engine.generate(requests)
        except BaseException:  # noqa: BLE001
            send(mid, False, traceback.format_exc(), stats())
            return
        send(mid, True, gens, stats())

    updates: queue.Queue = queue.Queue()

    def update_loop():
        while True:
            item = updates.get()
            if item is None:
                return
            mid, (v, path, new) = item
            t0 = time.perf_counter()
            try:
                engine.update_weights(v, path if new is None else fill_params(template, new))
            except BaseException:  # noqa: BLE001
                with order_cv:
                    order["installed"] += 1
                    order_cv.notify_all()
                send(mid, False, traceback.format_exc(), stats())
                continue
            with order_cv:
                order["installed"] += 1
                order_cv.notify_all()
            send(mid, True, time.perf_counter() - t0, stats())

    def warm(mid, prompt_len, max_new_tokens, truncate):
        try:
            n = engine.warm(prompt_len, max_new_tokens, truncate=truncate)
        except BaseException:  # noqa: BLE001
            send(mid, False, traceback.format_exc(), stats())
            return
        send(mid, True, n, stats())

    updater = threading.Thread(target=update_loop, name="weights", daemon=True)
    updater.start()
    while True:
        try:
            kind, mid, payload = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            break
        if kind == "generate":
            args = (mid, payload, order["received"])
            threading.Thread(target=generate, args=args, daemon=True).start()
        elif kind == "update":
            with order_cv:
                order["received"] += 1
            updates.put((mid, payload))
        elif kind == "warm":  # in a thread of its own: this one answers pings meanwhile
            threading.Thread(target=warm, args=(mid, *payload), daemon=True).start()
        elif kind == "abort":
            engine.abort()
            send(mid, True, None, stats())
        elif kind == "resume":
            engine.resume()
            send(mid, True, None, stats())
        elif kind == "stats":
            send(mid, True, None, stats())
        elif kind == "close":
            engine.abort()
            send(mid, True, None, stats())
            break
        else:
            send(mid, False, f"unknown command {kind!r}", stats())
    updates.put(None)


# ---------------------------------------------------------------------------------------------
# The parent side


class _Pending:
    __slots__ = ("event", "ok", "value", "callback", "lost")

    def __init__(self, callback=None):
        self.event = threading.Event()
        self.ok = False
        self.value = None
        self.callback = callback  # called as callback(ok, value) on the reader thread
        self.lost = False  # the child died and a replacement is starting


class ProcessEngine:
    """The engine contract over a JaxEngine running in a child process (pinned to `cores`).

    A child that dies is replaced, up to `max_restarts` times, by one serving the newest
    weights sent: calls in flight raise WorkerLost (their work can be dispatched again), weight
    updates in flight are served by the replacement, and later calls wait for it. Past the
    limit, every call raises RolloutProcessError naming the child and its exit code.
    """

    def __init__(
        self,
        model=None,
        *,
        config=None,
        params: dict[str, np.ndarray] | None = None,
        version: int = 0,
        cores: tuple[int, ...] | list[int] = (0,),
        chunk: int = 16,
        max_batch: int = 128,
        deadline_s: float = 600.0,
        xla_flags: str | None = None,
        name: str = "rollout-0",
        update_mode: str = "drain",
        max_restarts: int = 0,
        cache_len: int | None = None,
        hang_s: float | None = None,
        warm=None,
        gemm_autotune: bool = False,
    ):
        if model is not None:
            config, params = model.config, Weights.of(model).flat()
        if config is None or params is None:
            raise ValueError("ProcessEngine needs a model, or config= and params= (flat numpy)")
        self.config = config
        self.version = version
        self.deadline_s = deadline_s
        self.hang_s = deadline_s if hang_s is None else min(hang_s, deadline_s)
        self.name = name
        self.cores = tuple(cores)
        self.max_restarts = max_restarts
        self.restarts = 0
        self.lost: list[str] = []  # why each replaced child ended
        self._hung: dict[int, str] = {}  # pid -> why the watchdog killed it
        self._stats: dict = {"busy_s": 0.0, "generate_calls": 0, "tokens": 0, "install_s": 0.0}
        self.sync_times: list[dict] = []  # per update_weights: flatten, send, install, total
        self._ids = itertools.count()
        self._lock = threading.Lock()  # guards the current child's fields and sending
        self._closed = False
        self._kwargs = dict(
            chunk=chunk,
            max_batch=max_batch,
            deadline_s=deadline_s,
            update_mode=update_mode,
            cache_len=cache_len,
            warm=warm,  # a replacement child warms too
            gemm_autotune=gemm_autotune,
        )
        self._xla_flags = xla_flags
        self._newest: tuple[int, dict | None] = (version, params)  # what a replacement serves
        self._unserved: list[WeightUpdate] = []  # updates a dead child took with it
        self._live = threading.Event()  # set while no replacement is starting
        self._live.set()
        self._restarter: threading.Thread | None = None
        self._start_child(name, version, params)

    # -- plumbing -------------------------------------------------------------------------
    def _start_child(self, name: str, version: int, params) -> None:
        """Spawns a child serving `params` as `version` and waits until it is ready."""
        ctx = mp.get_context("spawn")
        conn, child_conn = ctx.Pipe()
        # Spawn arguments stay small: the spawn pipe is written before the child runs, and a
        # child that died while it was full would block Process.start() forever. The params
        # follow over the connection, which fails fast (EPIPE) if the child is gone.
        process = ctx.Process(
            target=_child_main,
            args=(child_conn, self.config, version, self.cores, self._kwargs, self._xla_flags),
            name=name,
            daemon=True,
        )
        process.start()
        child_conn.close()
        ready, pending = _Pending(), {}
        with self._lock:
            self.process, self._conn, self._pending, self._ready = process, conn, pending, ready
            self._dead: str | None = None
            self._final = ""  # past the limit: that no replacement follows
        reader = threading.Thread(
            target=self._read, args=(process, conn, pending, ready), name=f"{name}-reader"
        )
        reader.daemon = True
        reader.start()
        threading.Thread(target=self._send_init, args=(conn, params), daemon=True).start()
        try:
            info = self._wait(ready, "start", self.deadline_s)
        except RolloutProcessError:
            self._stop(process, conn, timeout=5)
            raise
        self.pid = process.pid
        self.child_cores = tuple(info["cores"])  # the affinity the child reports
        watchdog = threading.Thread(
            target=self._watch, args=(process, conn, pending), name=f"{name}-watchdog"
        )
        watchdog.daemon = True
        watchdog.start()

    def _watch(self, process, conn, pending: dict) -> None:
        """Pings one child while it is the current one; a ping unanswered for hang_s means the
        child is hung: it is SIGKILLed, and its reader replaces it as a dead one."""
        while not self._closed and process is self.process and process.is_alive():
            p = _Pending()
            # sent from a thread of its own: a send to a stopped child can block (a full pipe)
            ping = threading.Thread(target=self._ping, args=(process, conn, pending, p))
            ping.daemon = True
            ping.start()
            if not p.event.wait(self.hang_s):
                if self._closed or process is not self.process or not process.is_alive():
                    return
                self._hung[process.pid] = (
                    f"hung: no answer to a health check within "
                    f"trainer.rollout_hang_s={self.hang_s:g}s, killed"
                )
                process.kill()
                return
            # the next ping after a quarter of the deadline, at once if the child exits
            mpc.wait([process.sentinel], timeout=self.hang_s / 4)

    def _ping(self, process, conn, pending: dict, p: _Pending) -> None:
        """Sends one health check ("stats") to `process`; its reader answers `p`."""
        with self._lock:
            if process is not self.process or self._dead:
                p.event.set()  # not the current child: the watchdog stops
                return
            mid = next(self._ids)
            pending[mid] = p
            try:
                conn.send(("stats", mid, None))
            except (OSError, ValueError):  # gone: its reader fails `p` and reports how
                pass

    def _limit_note(self) -> str:
        return (
            f"; {self.restarts} of trainer.max_rollout_restarts={self.max_restarts} "
            "replacements used, the run stops"
        )

    def _describe(self, process=None) -> str:
        process = process or self.process
        cores = list(self.cores) or "all"
        return f"rollout process {process.name!r} (pid {process.pid}, cores {cores})"

    def _read(self, process, conn, pending: dict, ready: _Pending):
        """Receives one child's replies; on its death fails (or hands over) every waiter."""
        while True:
            try:
                if conn not in mpc.wait([conn, process.sentinel]):
                    raise EOFError
                msg = conn.recv()
            except (EOFError, OSError):
                break
            if msg[0] == "ready":
                _, ok, value, _ = msg
                ready.ok, ready.value = ok, value
                ready.event.set()
                continue
            mid, ok, value, stats = msg
            if stats:
                self._stats = stats
            with self._lock:
                p = pending.pop(mid, None)
            if p is not None:
                p.ok, p.value = ok, value
                p.event.set()
                if p.callback is not None:
                    self._call(p.callback, ok, value)
        process.join(timeout=5)
        # the watchdog's is_alive() may reap the child first: its exit code then lands a moment
        # later (this thread's waitpid got ECHILD)
        settle = time.monotonic() + 2.0
        while process.exitcode is None and time.monotonic() < settle:
            time.sleep(0.01)
        why = "closed" if self._closed else f"died (exit code {process.exitcode})"
        why = self._hung.get(process.pid, why)
        dead = f"{self._describe(process)} {why}"
        with self._lock:
            current = process is self.process
            served = current and ready.ok and not self._closed  # a start that failed: no
            replace = served and self._newest[1] is not None and self.restarts < self.max_restarts
            if current:
                self._dead = dead
                if served and not replace:
                    self._final = self._limit_note()
            if replace:
                self.restarts += 1
                self.lost.append(dead)
                self._live.clear()  # later calls wait for the replacement
            waiting = list(pending.values()) + [ready]
            pending.clear()
        for p in waiting:
            p.lost = replace
            p.event.set()
            if p.callback is not None:
                self._call(p.callback, False, None)
        if replace:
            self._restarter = threading.Thread(target=self._replace, name=f"{self.name}-restart")
            self._restarter.daemon = True
            self._restarter.start()

    def _replace(self) -> None:
        """Starts replacement children (within the limit) until one is ready on the newest
        weights; then serves the weight updates the dead child took with it."""
        while True:
            version, params = self._newest
            name = f"{self.name}.r{self.restarts}"
            try:
                self._start_child(name, version, params)
            except RolloutProcessError as e:
                with self._lock:
                    self.lost.append(str(e))
                    if self._closed or self.restarts >= self.max_restarts:
                        self._dead, self._final = str(e), self._limit_note()
                        break
                    self.restarts += 1
                continue
            with self._lock:
                self.version = version
                unserved = [u for u in self._unserved if u.version <= version]
                self._unserved = [u for u in self._unserved if u.version > version]
            if self._closed:
                self._stop(self.process, self._conn, timeout=5)
            for u in unserved:
                u.set_served()
            break
        with self._lock:
            unserved, self._unserved = self._unserved, []
            dead = f"{self._dead}{self._final}"
        for u in unserved:  # a later version, or none: this child will not serve it
            u.set_failed(RolloutProcessError(f"{dead}; version {u.version} was not served"))
        self._live.set()

    def _send_init(self, conn, params) -> None:
        """Sends the initial params (a thread: the start deadline bounds the wait, not this)."""
        try:
            with self._lock:
                conn.send(("init", params))
        except (OSError, ValueError):  # the child is gone: the reader reports how
            pass

    @staticmethod
    def _call(callback, ok, value) -> None:
        """Runs a completion callback; its errors are printed, never kill the reader thread."""
        try:
            callback(ok, value)
        except BaseException:  # noqa: BLE001
            traceback.print_exc()

    def _send(self, kind: str, payload=None, callback=None) -> _Pending:
        """Sends a command to the current child (waiting while a replacement starts)."""
        p = _Pending(callback)
        deadline = time.monotonic() + self.deadline_s
        while True:
            if not self._live.wait(max(0.0, deadline - time.monotonic())):
                raise RolloutProcessError(
                    f"{self._describe()}: no replacement ready within {self.deadline_s:.0f}s"
                )
            with self._lock:
                if not self._live.is_set():  # the child died meanwhile: wait for its successor
                    continue
                if self._dead:
                    raise RolloutProcessError(f"{self._dead}: cannot {kind}{self._final}")
                mid = next(self._ids)
                self._pending[mid] = p
                try:
                    self._conn.send((kind, mid, payload))
                except OSError:  # the child is gone: its reader answers this call as it fails
                    pass
                return p

    def _wait(self, p: _Pending, what: str, timeout: float):
        if not p.event.wait(timeout):
            raise RolloutProcessError(
                f"{self._describe()}: no answer to {what} within {timeout:.0f}s "
                f"(alive: {self.process.is_alive()})"
            )
        if not p.ok:
            if p.value is None and p.lost:
                raise WorkerLost(f"{self.lost[-1]} during {what}; a replacement is starting")
            if p.value is None:
                why = self._dead or self._describe()
                raise RolloutProcessError(f"{why} during {what}{self._final}")
            raise RolloutProcessError(f"{self._describe()} failed {what}:\n{p.value}")
        return p.value

    @staticmethod
    def _stop(process, conn, timeout: float) -> None:
        """Ends a child process: terminate, then kill; closes its connection."""
        process.join(timeout)
        if process.is_alive():
            process.terminate()
            process.join(timeout)
        if process.is_alive():
            process.kill()
            process.join(timeout)
        conn.close()

    # -- Engine protocol ------------------------------------------------------------------
    def generate(self, requests: list[GenerationRequest]) -> list[Generation]:
        """Completes every request in the child; raises WorkerLost if it dies (and is being
        replaced), RolloutProcessError past the restart limit or the deadline."""
        if not requests:
            return []
        return self._wait(self._send("generate", list(requests)), "generate", self.deadline_s)

    def update_weights(self, version: int, weights) -> WeightUpdate:
        """Sends `weights` to the child; the handle is done once the child serves them.

        A host copy is taken before this returns, so the caller may donate its buffers; later
        generate() calls are served after the update (the child keeps message order). If the
        child dies first, its replacement serves them.
        """
        w = Weights.of(weights)
        t0 = time.perf_counter()
        flat, path = (w.flat(), None) if w.in_memory() else (None, w.path())
        t1 = time.perf_counter()
        sent = [t1]  # when the send returned (set below; an ack may come first)
        what = f"update_weights to version {version}"
        handle = WeightUpdate(version)

        def callback(ok, value):
            if ok:
                self.version = version
                self.sync_times.append(
                    {
                        "flatten_s": t1 - t0,
                        "send_s": sent[0] - t1,
                        "install_s": value,
                        "total_s": time.perf_counter() - t0,
                    }
                )
                handle.set_served()
                return
            if value is None and not self._live.is_set():  # the replacement serves it
                with self._lock:
                    self._unserved.append(handle)
                return
            if value is None:
                why = f"{self._dead} during {what}{self._final}"
            else:
                why = f"{self._describe()} failed {what}:\n{value}"
            handle.set_failed(RolloutProcessError(why))

        with self._lock:  # a replacement starts on the newest weights (only from memory)
            self._newest = (version, flat)
        self._send("update", (version, path, flat), callback)
        sent[0] = time.perf_counter()
        return handle

    def abort(self) -> None:
        """Makes in-flight and later generate() calls return 'abort' partials, until resume()."""
        if self._dead or not self._live.is_set() or not self.process.is_alive():
            return  # nothing in flight can be waiting on a dead child (its waiters were failed)
        try:
            self._wait(self._send("abort"), "abort", self.deadline_s)
        except (RolloutProcessError, WorkerLost):
            if self.process.is_alive():
                raise

    def resume(self) -> None:
        """Undoes abort()."""
        self._wait(self._send("resume"), "resume", self.deadline_s)

    def stats(self) -> dict:
        """The child's counters now (busy time, tokens, installs, compilations, pid), plus
        the replacements started and the children lost."""
        if not self._dead and self._live.is_set() and self.process.is_alive():
            try:
                self._wait(self._send("stats"), "stats", self.deadline_s)
            except WorkerLost:
                pass  # died meanwhile: the last counters it sent
        out = {**self._stats, "sync_s": sum(t["total_s"] for t in self.sync_times)}
        return {**out, "restarts": self.restarts, "workers_lost": len(self.lost)}

    def warm(self, prompt_len: int, max_new_tokens: int, *, truncate: bool = False) -> int:
        """The child's JaxEngine.warm (a replacement child warms only as `warm=` says)."""
        payload = (prompt_len, max_new_tokens, truncate)
        return self._wait(self._send("warm", payload), "warm", self.deadline_s)

    def record_timeline(self) -> None:
        """None: the scheduler runs in the child process."""
        return None

    def close(self, timeout: float = 10.0) -> None:
        """Stops the child (and a replacement starting): asks, then terminates, then kills;
        idempotent."""
        if self._closed:
            return
        self._closed = True
        restarter = self._restarter
        if restarter is not None:
            restarter.join(self.deadline_s)
        if self.process.is_alive() and not self._dead:
            try:
                self._wait(self._send("close"), "close", timeout)
            except (RolloutProcessError, WorkerLost):
                pass
        self._stop(self.process, self._conn, timeout)

    def __del__(self):
        try:
            if not self._closed and self.process.is_alive():
                self.process.kill()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
