"""A JaxEngine in a child process, optionally pinned to its own CPU cores.

On a CPU host a sampler and a train step in threads of one process barely overlap (each alone
spreads over every core through XLA's thread pool); in two processes they overlap. The child
pins itself (os.sched_setaffinity) and sets its XLA flags BEFORE it imports JAX. Messages are
pickled numpy over a pipe:

  parent -> child   ("generate", id, [GenerationRequest])   -> (id, ok, [Generation], stats)
                    ("update", id, (version, path, {name: array})) -> (id, ok, secs, stats)
                    ("abort" | "resume" | "stats" | "close", id, None) -> (id, ok, None, stats)

The child's main thread only receives; each generate runs in its own thread and weight updates
run in order on one update thread, so an update lands while a generate is in flight, exactly as
with the in-process JaxEngine (`drain` waits for the running batch, `continue` makes it return
'abort' partials at the next chunk boundary). Every wait has a deadline; a child that dies
raises RolloutProcessError naming it and its exit code.

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
from rl.rollout.base import Generation, GenerationRequest, RolloutError, Weights, WeightUpdate


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

    send_lock = threading.Lock()

    def send(*msg):
        with send_lock:
            conn.send(msg)

    engine = None

    def stats() -> dict:  # the engine's own counters (busy time, tokens, installs, traces)
        return {**(engine.stats() if engine is not None else {}), "pid": os.getpid()}

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
    __slots__ = ("event", "ok", "value", "callback")

    def __init__(self, callback=None):
        self.event = threading.Event()
        self.ok = False
        self.value = None
        self.callback = callback  # called as callback(ok, value) on the reader thread


class ProcessEngine:
    """The engine contract over a JaxEngine running in a child process (pinned to `cores`)."""

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
    ):
        if model is not None:
            config, params = model.config, Weights.of(model).flat()
        if config is None or params is None:
            raise ValueError("ProcessEngine needs a model, or config= and params= (flat numpy)")
        self.config = config
        self.version = version
        self.deadline_s = deadline_s
        self.name = name
        self.cores = tuple(cores)
        self._stats: dict = {"busy_s": 0.0, "generate_calls": 0, "tokens": 0, "install_s": 0.0}
        self.sync_times: list[dict] = []  # per update_weights: flatten, send, install, total
        self._ids = itertools.count()
        self._pending: dict[int, _Pending] = {}
        self._lock = threading.Lock()  # guards _pending and sending
        self._dead: str | None = None
        self._closed = False
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        kwargs = dict(
            chunk=chunk, max_batch=max_batch, deadline_s=deadline_s, update_mode=update_mode
        )
        # Spawn arguments stay small: the spawn pipe is written before the child runs, and a
        # child that died while it was full would block Process.start() forever. The params
        # follow over the connection, which fails fast (EPIPE) if the child is gone.
        self.process = ctx.Process(
            target=_child_main,
            args=(child_conn, config, version, self.cores, kwargs, xla_flags),
            name=name,
            daemon=True,
        )
        self.process.start()
        child_conn.close()
        self._ready = _Pending()
        self._reader = threading.Thread(target=self._read, name=f"{name}-reader", daemon=True)
        self._reader.start()
        threading.Thread(target=self._send_init, args=(params,), daemon=True).start()
        try:
            info = self._wait(self._ready, "start", deadline_s)
        except RolloutProcessError:
            self.close(timeout=5)
            raise
        self.pid = self.process.pid
        self.child_cores = tuple(info["cores"])  # the affinity the child reports

    # -- plumbing -------------------------------------------------------------------------
    def _describe(self) -> str:
        cores = list(self.cores) or "all"
        return f"rollout process {self.name!r} (pid {self.process.pid}, cores {cores})"

    def _read(self):
        """Receives replies; on the child's death fails every waiter."""
        while True:
            try:
                ready = mpc.wait([self._conn, self.process.sentinel])
                if self._conn not in ready:
                    raise EOFError
                msg = self._conn.recv()
            except (EOFError, OSError):
                break
            if msg[0] == "ready":
                _, ok, value, _ = msg
                self._ready.ok, self._ready.value = ok, value
                self._ready.event.set()
                continue
            mid, ok, value, stats = msg
            if stats:
                self._stats = stats
            with self._lock:
                p = self._pending.pop(mid, None)
            if p is not None:
                p.ok, p.value = ok, value
                p.event.set()
                if p.callback is not None:
                    self._call(p.callback, ok, value)
        self.process.join(timeout=5)
        code = self.process.exitcode
        why = "closed" if self._closed else f"died (exit code {code})"
        with self._lock:
            self._dead = f"{self._describe()} {why}"
            waiting = list(self._pending.values()) + [self._ready]
            self._pending.clear()
        for p in waiting:
            p.event.set()
            if p.callback is not None:
                self._call(p.callback, False, None)

    def _send_init(self, params) -> None:
        """Sends the initial params (a thread: the start deadline bounds the wait, not this)."""
        try:
            with self._lock:
                self._conn.send(("init", params))
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
        p = _Pending(callback)
        with self._lock:
            if self._dead:
                raise RolloutProcessError(f"{self._dead}; cannot {kind}")
            mid = next(self._ids)
            self._pending[mid] = p
            try:
                self._conn.send((kind, mid, payload))
            except (OSError, BrokenPipeError) as e:
                self._pending.pop(mid, None)
                raise RolloutProcessError(f"{self._describe()}: cannot send {kind}: {e}") from e
        return p

    def _wait(self, p: _Pending, what: str, timeout: float):
        if not p.event.wait(timeout):
            raise RolloutProcessError(
                f"{self._describe()}: no answer to {what} within {timeout:.0f}s "
                f"(alive: {self.process.is_alive()})"
            )
        if not p.ok:
            if p.value is None:
                raise RolloutProcessError(f"{self._dead or self._describe()} during {what}")
            raise RolloutProcessError(f"{self._describe()} failed {what}:\n{p.value}")
        return p.value

    # -- Engine protocol ------------------------------------------------------------------
    def generate(self, requests: list[GenerationRequest]) -> list[Generation]:
        """Completes every request in the child; raises if it dies or passes the deadline."""
        if not requests:
            return []
        return self._wait(self._send("generate", list(requests)), "generate", self.deadline_s)

    def update_weights(self, version: int, weights) -> WeightUpdate:
        """Sends `weights` to the child; the handle is done once the child serves them.

        A host copy is taken before this returns, so the caller may donate its buffers; later
        generate() calls are served after the update (the child keeps message order).
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
            why = self._dead if value is None else f"{self._describe()} failed {what}:\n{value}"
            handle.set_failed(RolloutProcessError(f"{why} during {what}" if value is None else why))

        self._send("update", (version, path, flat), callback)
        sent[0] = time.perf_counter()
        return handle

    def abort(self) -> None:
        """Makes in-flight and later generate() calls return 'abort' partials, until resume()."""
        if self._dead or not self.process.is_alive():
            return  # nothing in flight can be waiting on a dead child (its waiters were failed)
        try:
            self._wait(self._send("abort"), "abort", self.deadline_s)
        except RolloutProcessError:
            if self.process.is_alive():
                raise

    def resume(self) -> None:
        """Undoes abort()."""
        self._wait(self._send("resume"), "resume", self.deadline_s)

    def stats(self) -> dict:
        """The child's counters now (busy time, tokens, installs, compilations, pid)."""
        if not self._dead and self.process.is_alive():
            self._wait(self._send("stats"), "stats", self.deadline_s)
        return {**self._stats, "sync_s": sum(t["total_s"] for t in self.sync_times)}

    def close(self, timeout: float = 10.0) -> None:
        """Stops the child: asks, then terminates, then kills; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.process.is_alive() and not self._dead:
            try:
                self._wait(self._send("close"), "close", timeout)
            except RolloutProcessError:
                pass
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout)
        self._conn.close()

    def __del__(self):
        try:
            if not self._closed and self.process.is_alive():
                self.process.kill()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
