"""The rollout worker pool of the `ray` transport: the engine contract over remote workers.

Each worker is an actor in its own process (rl/ray/worker.py) holding an engine, the task and
the tokenizer; it runs whole groups and `ray.put`s each finished batch as flat numpy arrays
(rl.types.groups_to_arrays), so episodes cross processes and hosts through the shared-memory
object store. The driver's dispatchers (rl/dispatch.py, one per worker slot) hand groups to
`run` and deliver what comes back; weight versions go out through the parameter-server actor
(rl/ray/param_server.py), which has every worker install them in order.

Health: a dispatcher waits for its batch in short slices and pings its actor (a threaded actor
answers while it generates; a vLLM worker whose hosts all exited fails the ping); an actor that
dies, fails a ping, or leaves one unanswered for `health_deadline_s` raises WorkerLost, and
`replace` kills it and starts a replacement on the newest weights, up to `max_restarts` per
run; past that the run fails with an error naming the worker, its pid and its log file.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import sys
import threading
import time

import numpy as np

from rl import config as C
from rl.engines import engine_spec
from rl.ray.cluster import connect, first_line
from rl.ray.param_server import ParamServerActor
from rl.ray.worker import RolloutActor
from rl.rollout.base import RolloutError, Weights, WeightUpdate, WorkerLost
from rl.rollout.vllm_host import VLLMHostsDown
from rl.types import arrays_nbytes, groups_from_arrays


class RolloutWorkerError(RolloutError):
    """A rollout worker failed past the restart limit, or raised inside its rollout."""


@dataclasses.dataclass(frozen=True)
class RayOptions:
    """Where the Ray rollout workers run and how their health is judged (trainer.ray)."""

    address: str = ""  # "" = start a local cluster; "auto" or "host:port" = join one
    num_workers: int = 1
    cpus: float = 1.0  # per worker actor
    gpus: float = 0.0  # per worker actor
    health_deadline_s: float = 30.0
    max_restarts: int = 2
    cores: tuple[int, ...] = ()  # pin each worker to these cores of its node (trainer.pin_cores)
    log_dir: str = ""  # each worker's stdout/stderr go to <log_dir>/<name>.log


@dataclasses.dataclass
class _Worker:
    name: str
    handle: object
    pid: int = -1
    node: str = ""
    log: str = ""


class WorkerPool:
    """Rollout worker actors behind the engine contract, plus group-level `run` / `replace`.

    Starts a local Ray cluster unless `options.address` names one (and shuts down only a
    cluster it started). `version` is the newest version sent to the workers.
    """

    def __init__(
        self,
        weights: Weights,
        config,
        *,
        version: int,
        task: dict,
        tokenizer_dir: str,
        options: RayOptions,
        engine: str = "jax",
        engine_kwargs: dict | None = None,
        call_deadline_s: float = 600.0,
        hf: dict | None = None,
    ):
        """engine: the registered rollout engine (rl.engines) each worker builds with
        `engine_kwargs` (its worker_options). hf: the workers reload HF directories (vLLM
        hosts) that the parameter server publishes with these ParamServer options (weights_dir
        on a filesystem every node shares, config, tokenizer_dir, keep, hf_overrides)."""
        import ray

        self.options = options
        self.version = version
        self.call_deadline_s = call_deadline_s
        self.config = config
        self.task = dict(task)
        self.engine, self.engine_kwargs = engine, dict(engine_kwargs or {})
        self.hf_weights = hf is not None  # workers start from, and reload, published HF dirs
        self.direct = bool(hf and hf.get("direct"))  # ...or take flat params, dirs written after
        self._record_error: BaseException | None = None  # a served version's directory failed
        self.tokenizer_files = {}
        for fname in sorted(os.listdir(tokenizer_dir)):
            path = os.path.join(tokenizer_dir, fname)
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    self.tokenizer_files[fname] = f.read()
        self.owns_ray = connect(options.address, options.num_workers * options.cpus)
        self._actor_cls = ray.remote(RolloutActor).options(
            num_cpus=options.cpus,
            num_gpus=options.gpus,
            max_concurrency=16,  # pings are answered while rollouts, evals and updates wait
            max_restarts=0,
        )
        self._lock = threading.Lock()
        self.weights_ref = Weights.of(weights).ref()
        self.restarts = 0
        self.lost: list[str] = []  # why each lost worker was lost
        self.batches = 0  # episode batches received through the object store
        self.batch_bytes = 0
        self.sync_times: list[dict] = []
        self.workers: list[_Worker] = []
        log = os.path.join(options.log_dir, "param-server.log") if options.log_dir else ""
        self.param_server = ray.remote(ParamServerActor).options(num_cpus=0, max_restarts=0)
        self.param_server = self.param_server.remote(log, dict(hf) if hf is not None else None)
        self.inflight: dict[int, list[int]] = {}  # slot -> group ids its worker is running
        self._updates: queue.Queue = queue.Queue()  # weight versions for the update thread
        self._updater: threading.Thread | None = None
        self._closed = False
        try:
            self.param_server_pid = ray.get(
                self.param_server.info.remote(), timeout=call_deadline_s
            )["pid"]
            if self.hf_weights:  # workers start from the published HF directory of `version`
                write = self.param_server.write.remote(version, [self.weights_ref])
                self.weights_ref = ray.get(write, timeout=call_deadline_s)
            for i in range(options.num_workers):
                self.workers.append(self._start(i, 0))
            for i in range(options.num_workers):
                self._wait_ready(i)
        except BaseException:
            self.close()
            raise

    # -- workers --------------------------------------------------------------------------
    @property
    def slots(self) -> int:
        """Worker slots (each slot has one live actor, replaced when it is lost)."""
        return len(self.workers)

    @property
    def engines(self) -> int:
        """Independent engines (one per worker), each with its own busy clock."""
        return len(self.workers)

    def pids(self) -> list[int]:
        """Process ids of the current workers."""
        return [w.pid for w in self.workers]

    def _start(self, slot: int, generation: int) -> _Worker:
        """A new actor for `slot` on the newest weights (not yet ready)."""
        name = f"rollout-{slot}" + (f".r{generation}" if generation else "")
        o = self.options
        log = os.path.join(o.log_dir, f"{name}.log") if o.log_dir else ""
        with self._lock:  # the newest weights: an update after this also reaches the worker
            handle = self._actor_cls.remote(
                name,
                self.config,
                self.weights_ref,
                self.version,
                self.task,
                self.tokenizer_files,
                self.engine,
                self.engine_kwargs,
                tuple(o.cores),
                log,
            )
        return _Worker(name, handle, log=log)

    def _wait_ready(self, slot: int) -> None:
        import ray

        w = self.workers[slot]
        try:
            info = ray.get(w.handle.info.remote(), timeout=self.call_deadline_s)
        except ray.exceptions.GetTimeoutError as e:
            raise WorkerLost(f"{self.describe(slot)} did not start within the deadline") from e
        except ray.exceptions.RayError as e:
            raise WorkerLost(f"{self.describe(slot)} failed to start: {e}") from e
        w.pid, w.node, w.log = info["pid"], info["node"], info["log"] or w.log

    def describe(self, slot: int) -> str:
        """The worker of `slot` by name, pid, node and log file."""
        w = self.workers[slot]
        log = w.log or "the Ray worker logs (/tmp/ray/session_latest/logs on its node)"
        return f"rollout worker {w.name!r} (pid {w.pid}, node {w.node or '?'}; log: {log})"

    def replace(self, slot: int, why: str, on_started=None) -> None:
        """Kills the worker of `slot` and starts a replacement; raises past max_restarts.

        on_started() runs once the replacement is counted and launched, before it is ready
        (the caller re-dispatches the lost work there, so the counters lead the re-dispatch).
        """
        what = f"{self.describe(slot)}: {why}"
        self.lost.append(what)
        self._kill(self.workers[slot].handle)
        while True:
            if self.restarts >= self.options.max_restarts:
                raise RolloutWorkerError(
                    f"{what}; {self.restarts} of trainer.ray.max_restarts="
                    f"{self.options.max_restarts} replacements used, the run stops"
                )
            self.restarts += 1
            self.workers[slot] = self._start(slot, self.restarts)
            if on_started is not None:
                on_started()
                on_started = None
            try:
                self._wait_ready(slot)
                return
            except WorkerLost as e:
                what = str(e)
                self.lost.append(what)

    # -- group rollouts (the trainer's dispatchers) -----------------------------------------
    def submit(self, slot: int, items: list, sampling):
        """Starts groups on the worker of `slot`; returns the ObjectRef of its reply."""
        return self.workers[slot].handle.rollout.remote(items, sampling)

    def run(self, slot: int, items: list, sampling, stopped=lambda: False):
        """Runs groups on the worker of `slot`: [EpisodeGroup], or None once stopped() is true.

        Raises WorkerLost if the worker dies or leaves a health check unanswered for
        health_deadline_s (or the whole call passes call_deadline_s).
        """
        self.inflight[slot] = [item[0] for item in items]
        try:
            return self._run(slot, items, sampling, stopped)
        finally:
            self.inflight[slot] = []

    def _run(self, slot: int, items: list, sampling, stopped):
        import ray

        ref = self.submit(slot, items, sampling)
        try:
            outer = self._await(self.workers[slot].handle, ref, stopped)
            if outer is None:
                return None
            batch = ray.get(outer[0])
        except ray.exceptions.ObjectLostError as e:  # its owner (the worker) died
            raise WorkerLost(f"died ({type(e).__name__})") from e
        except ray.exceptions.RayTaskError as e:  # a bug in the rollout: fail the run, unless
            if isinstance(getattr(e, "cause", e), VLLMHostsDown):  # the worker lost its engine
                raise WorkerLost(f"failed a health check: {first_line(e)}") from e  # (hosts down)
            why = self._unhealthy(slot)  # or its ping finds every vLLM host exited
            if why:
                raise WorkerLost(f"failed a health check: {why}") from e
            raise RolloutWorkerError(f"{self.describe(slot)} raised:\n{e}") from e
        with self._lock:
            self.batches += 1
            self.batch_bytes += arrays_nbytes(batch)
        return groups_from_arrays(batch)

    def _await(self, handle, ref, stopped=lambda: False):
        """ray.get(ref) of a call on `handle`, pinging the worker meanwhile; None once stopped().

        Raises WorkerLost if the worker dies, leaves a ping unanswered for health_deadline_s,
        or the call passes call_deadline_s.
        """
        import ray

        deadline = self.options.health_deadline_s
        t0 = last_answer = time.perf_counter()
        ping, ping_t = None, 0.0
        while True:
            ready, _ = ray.wait([ref], timeout=min(0.2, deadline / 4))
            if ready:
                try:
                    return ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    raise WorkerLost(f"died ({type(e).__name__})") from e
            if stopped():
                return None
            now = time.perf_counter()
            if ping is not None:
                answered, _ = ray.wait([ping], timeout=0)
                if answered:
                    try:
                        ray.get(ping)
                    except ray.exceptions.RayActorError as e:
                        raise WorkerLost(f"died ({type(e).__name__})") from e
                    except ray.exceptions.RayTaskError as e:  # e.g. its vLLM hosts exited
                        raise WorkerLost(f"failed a health check: {first_line(e)}") from e
                    ping, last_answer = None, now
                elif now - ping_t > deadline:
                    raise WorkerLost(f"did not answer a health check within {deadline:g}s")
            if ping is None and now - last_answer > deadline / 4:
                ping, ping_t = handle.ping.remote(), now
            if now - t0 > self.call_deadline_s:
                raise WorkerLost(f"no result within trainer.deadline_s={self.call_deadline_s:g}s")

    def _unhealthy(self, slot: int) -> str:
        """Why the worker of `slot` fails its health check ('' if it passes)."""
        import ray

        try:
            ray.get(self.workers[slot].handle.ping.remote(), timeout=self.options.health_deadline_s)
        except ray.exceptions.RayError as e:
            return first_line(e)
        return ""

    def _kill(self, handle) -> None:
        import ray

        try:
            ray.kill(handle, no_restart=True)
        except Exception:  # noqa: BLE001 - already dead
            pass

    # -- the engine contract ----------------------------------------------------------------
    def generate(self, requests: list) -> list:
        """Completes requests, split in contiguous chunks over the workers."""
        import ray

        if not requests:
            return []
        n = min(len(self.workers), len(requests))
        bounds = np.linspace(0, len(requests), n + 1).astype(int)
        chunks = [requests[bounds[i] : bounds[i + 1]] for i in range(n)]
        calls = [(i, self.workers[i].handle) for i in range(n)]
        refs = [h.generate.remote(chunks[i]) for i, h in calls]
        out = []
        for i, r in enumerate(refs):
            slot, handle = calls[i]
            for attempt in range(len(self.workers) + 1):  # a lost worker's chunk goes elsewhere
                try:
                    out += self._await(handle, r)
                    break
                except WorkerLost as e:
                    self._kill(handle)  # its dispatcher replaces it
                    if attempt == len(self.workers):
                        raise RolloutWorkerError(f"{self.describe(slot)}: {e} in generate") from e
                    slot = (slot + 1) % len(self.workers)
                    handle = self.workers[slot].handle
                    r = handle.generate.remote(chunks[i])
                except ray.exceptions.RayTaskError as e:
                    raise RolloutWorkerError(f"{self.describe(slot)} failed generate: {e}") from e
        return out

    def update_weights(self, version: int, weights) -> WeightUpdate:
        """Publishes `version` through the parameter-server actor: every worker installs it.

        The weights go into the object store once (Weights.ref: a RemoteLearner's are put by
        the learner process). The handle is done when every live worker serves `version`; a
        worker lost meanwhile is replaced by its dispatcher, on the newest weights.
        """
        t0 = time.perf_counter()
        ref = Weights.of(weights).ref()
        t1 = time.perf_counter()
        if not self.hf_weights:  # a replacement started from now on gets these weights (HF: the
            with self._lock:  # directory the parameter server writes, once it is written)
                self.weights_ref, self.version = ref, version
        handle = WeightUpdate(version)
        if self._updater is None:
            self._updater = threading.Thread(target=self._update_loop, daemon=True)
            self._updater.start()
        self._updates.put((version, ref, (t0, t1, time.perf_counter()), handle))
        return handle

    def _update_loop(self) -> None:
        """Has the parameter server publish queued versions to the workers, one at a time."""
        import ray

        while True:
            item = self._updates.get()
            if item is None:
                return
            version, ref, (t0, t1, t2), handle = item
            if self._record_error is not None:
                handle.set_failed(self._record_error)
                continue
            try:
                with self._lock:  # a worker not yet ready (pid -1) is still starting
                    handles = [w.handle for w in self.workers]
                    starting = [w.pid == -1 for w in self.workers]
                deadline = self.call_deadline_s
                health = self.options.health_deadline_s
                call = self.param_server.publish.remote(
                    version, [ref], handles, deadline, health, starting
                )
                out = ray.get(call, timeout=deadline + 30)
                install_s = out["install_s"]
                durable = self.hf_weights
                if self.direct:  # served: the hosts have it; the directory is written after
                    handle.set_served()
                    with self._updates.mutex:  # else the newer version queued is written
                        durable = all(item is None for item in self._updates.queue)
                    if durable:
                        write = self.param_server.write.remote(version, [ref])
                        out = {"weights": [ray.get(write, timeout=deadline + 30)]}
                path = out["weights"][0] if durable else None
                while durable:  # replacements started meanwhile on the previous directory
                    with self._lock:
                        self.weights_ref, self.version = path, version
                        missed = [w for w in self.workers if w.handle not in handles]
                    if not missed:
                        break
                    handles += [w.handle for w in missed]
                    call = self.param_server.publish.remote(
                        version,
                        [ref],
                        [w.handle for w in missed],
                        deadline,
                        health,
                        [w.pid == -1 for w in missed],
                    )
                    out = ray.get(call, timeout=deadline + 30)
                self.sync_times.append(
                    {
                        "flatten_s": t1 - t0,
                        "send_s": t2 - t1,
                        "install_s": install_s,
                        "total_s": time.perf_counter() - t0,
                    }
                )
            except BaseException as e:  # noqa: BLE001 - the learner hears of it
                err = RolloutWorkerError(f"weight update to version {version} failed: {e!r}")
                if handle.done():  # served, then its durable copy failed: the next update hears
                    self._record_error = err
                else:
                    handle.set_failed(err)
                continue
            handle.set_served()  # a no-op where the direct path set it already

    def _all(self, method: str, timeout: float) -> list:
        import ray

        refs = [getattr(w.handle, method).remote() for w in self.workers]
        out = []
        for r in refs:
            try:
                out.append(ray.get(r, timeout=timeout))
            except ray.exceptions.RayError:
                out.append(None)
        return out

    def abort(self) -> None:
        """Makes in-flight and later generations on every worker return 'abort' partials."""
        if not self._closed:
            self._all("abort", timeout=10)

    def resume(self) -> None:
        """Undoes abort()."""
        self._all("resume", timeout=self.call_deadline_s)

    def stats(self) -> dict:
        """Counters summed over the live workers, plus the pool's own (workers, restarts, ...)."""
        keys = ("busy_s", "tokens", "generate_calls", "traces", "install_s", "updates")
        keys += ("streamed",)  # vLLM workers: updates streamed to their hosts (direct)
        # JAX workers: compilations before serving, slot occupancy's counts
        keys += ("warm_traces", "slot_steps", "useful_steps")
        out: dict = dict.fromkeys(keys, 0)
        for s in self._all("stats", timeout=self.call_deadline_s):
            for k in keys:
                out[k] += (s or {}).get(k, 0)
        out.update(
            pid=self.workers[0].pid,
            sync_s=sum(t["total_s"] for t in self.sync_times),
            workers=len(self.workers),
            restarts=self.restarts,
            workers_lost=len(self.lost),
            batches=self.batches,
            batch_mbytes=self.batch_bytes / 1e6,
        )
        return out

    def warm(self, prompt_len: int, max_new_tokens: int, *, truncate: bool = False) -> int:
        """Has every worker's engine compile ahead: the programs compiled, summed (a
        replacement warms only as engine_kwargs' `warm` says)."""
        import ray

        refs = [w.handle.warm.remote(prompt_len, max_new_tokens, truncate) for w in self.workers]
        return sum(ray.get(refs, timeout=self.call_deadline_s))

    def record_timeline(self) -> None:
        """None: the schedulers run in the worker processes."""
        return None

    def close(self) -> None:
        """Finishes the weight updates queued (a run's last version is published, its HF
        directory written), then kills the workers; shuts Ray down if this object started it.
        Idempotent."""
        import ray

        if self._closed:
            return
        self._closed = True
        self._updates.put(None)
        if self._updater is not None:  # each queued update waits at most its call's deadline
            self._updater.join(timeout=self.call_deadline_s + 30)
            if self._updater.is_alive():
                print(
                    f"rollout pool: a weight update still running after "
                    f"{self.call_deadline_s + 30:.0f} s; closing without it",
                    file=sys.stderr,
                )
        if self.hf_weights:  # stop vLLM servers cleanly (a killed worker's die with it anyway)
            refs = [w.handle.shutdown.remote() for w in self.workers]
            ray.wait(refs, num_returns=len(refs), timeout=60)
        for w in self.workers:
            self._kill(w.handle)
        self._kill(self.param_server)
        if self.owns_ray and ray.is_initialized():
            ray.shutdown()


def worker_pool(
    cfg,
    weights: Weights,
    model_config,
    *,
    version: int,
    run_dir: str,
    tokenizer_dir: str,
    tokenizer,
    cores: tuple[int, ...] = (),
    warm=None,
) -> WorkerPool:
    """The run's rollout workers (trainer.ray, rollout.*) serving `weights` as `version`; a JAX
    sampler compiles what `warm` (build.warm_spec) says before serving."""
    r = cfg.trainer.ray
    opts = RayOptions(
        address=r.address,
        num_workers=r.num_workers,
        cpus=r.worker_cpus,
        gpus=r.worker_gpus,
        health_deadline_s=r.health_deadline_s,
        max_restarts=r.max_restarts,
        cores=tuple(cores),
        log_dir=os.path.abspath(os.path.join(run_dir, "logs")),
    )
    spec = engine_spec(cfg.rollout.engine)
    hf = None
    if spec.hf_weights:  # the parameter server's HF publication, on storage every node shares
        hf = {
            "weights_dir": os.path.join(os.path.abspath(run_dir), "weights"),
            "config": model_config,
            "tokenizer_dir": os.path.abspath(tokenizer_dir),
            "keep": 3,
            "hf_overrides": {"eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id},
            "direct": cfg.rollout.vllm.weight_sync == "direct",
        }
    return WorkerPool(
        weights,
        model_config,
        version=version,
        task={
            "section": C.to_dict(cfg.task),
            "preset": cfg.model.init != "hf",
            "imports": list(cfg.imports),
        },
        tokenizer_dir=tokenizer_dir,
        options=opts,
        engine=spec.name,
        engine_kwargs=spec.worker_options(cfg, warm),
        call_deadline_s=cfg.trainer.deadline_s,
        hf=hf,
    )
