"""The `ray` transport: rollout workers as Ray actors, episode batches in the object store.

Each rollout worker is an actor in its own process holding an engine (a JaxEngine, or a
VLLMEngine over vLLM hosts the worker launches on its node), the task and the tokenizer; it runs
whole groups (multi-turn episodes, rewards) and `ray.put`s each finished batch as a few flat
numpy arrays (pack_groups), so episodes cross processes (and hosts) through the shared-memory
object store, never as pickled Python objects per token. The coordinator and the buffer stay in
the driver process (the trainer), the same code as with `local`: one dispatcher thread per
worker slot admits groups, sends them to its actor, and delivers the unpacked groups to the
buffer. The learner and the parameter server are actors too (rl/ray_learner.py): the learner
puts each version's flat numpy params into the object store once, and the parameter server has
every worker install them, in order (vLLM workers: from the HF directory it writes).

Health: a dispatcher waits for its batch in short slices and pings its actor (a threaded actor
answers while it generates; a vLLM worker whose hosts all exited fails the ping); an actor that
dies (RayActorError), fails a ping, or leaves one unanswered for `health_deadline_s` is killed,
its in-flight groups go back to the coordinator (requeue: the same group numbers, counted as
re-dispatched) and a replacement starts with the newest weights, up to `max_restarts`
replacements per run; past that the run fails with an error naming the worker, its pid and its
log file. vLLM hosts get SIGTERM when their worker's process dies, so none is orphaned.

The worker actor itself is in rl/ray_worker.py. The `local` transport (CPU core split) is in
rl/transport.py; this module is imported only when trainer.transport is 'ray' (ray itself is
imported lazily, inside the functions).
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
import time

import numpy as np

from rl.ray_learner import ParamServerActor
from rl.ray_worker import RolloutActor


def connect(address: str = "", need_cpus: float = 1.0) -> bool:
    """Joins the Ray cluster at `address` (or RAY_ADDRESS), else starts a local one.

    Returns True if this call started Ray (the caller shuts it down), False if Ray was already
    initialised in this process. A local cluster gets at least this host's CPUs and need_cpus.
    """
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS", "")
    if address:  # join a running cluster (Ray's own RAY_ADDRESS convention too)
        ray.init(address=address, log_to_driver=False)
    else:
        ray.init(
            num_cpus=max(os.cpu_count() or 1, int(np.ceil(need_cpus))),
            include_dashboard=False,
            log_to_driver=False,
        )
    return True


class RolloutWorkerError(RuntimeError):
    """A rollout worker failed past the restart limit, or raised inside its rollout."""


class WorkerLost(RuntimeError):
    """A rollout worker died or stopped answering (its work is re-dispatched)."""


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


_GROUP_KEYS = ("group_id", "dispatch_version", "group_size")
_TOKEN_KEYS = (("tokens", np.int32), ("loss_mask", np.int8))
_TOKEN_KEYS += (("behavior_logp", np.float32), ("versions", np.int32))


def pack_groups(groups) -> dict:
    """Episode groups as flat numpy arrays: per-token arrays concatenated, per-episode columns.

    Strings (problem ids, finish reasons, completion texts) are per episode, never per token.
    """
    eps = [e for g in groups for e in g.episodes]
    out = {
        "group_id": np.array([g.group_id for g in groups], np.int64),  # [G]
        "dispatch_version": np.array([g.dispatch_version for g in groups], np.int64),  # [G]
        "group_size": np.array([len(g.episodes) for g in groups], np.int64),  # [G]
        "group_problem_id": [g.problem_id for g in groups],
        "length": np.array([len(e.tokens) for e in eps], np.int64),  # [E]
        "prompt_len": np.array([e.prompt_len for e in eps], np.int64),
        "reward": np.array([e.reward for e in eps], np.float64),
        "correct": np.array([e.correct for e in eps], bool),
        "formatted": np.array([e.formatted for e in eps], bool),
        "num_turns": np.array([e.num_turns for e in eps], np.int64),
        "problem_id": [e.problem_id for e in eps],
        "finish_reason": [e.finish_reason for e in eps],
        "completion_text": [e.completion_text for e in eps],
    }
    for name, dtype in _TOKEN_KEYS:  # [sum of lengths]
        parts = [getattr(e, name) for e in eps]
        out[name] = np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)
    return out


def unpack_groups(batch: dict) -> list:
    """The EpisodeGroups of a pack_groups batch (arrays copied out of the object store)."""
    from rl.types import Episode, EpisodeGroup

    ends = np.cumsum(batch["length"])
    starts = ends - batch["length"]
    eps = []
    for i in range(len(batch["length"])):
        sl = slice(int(starts[i]), int(ends[i]))
        eps.append(
            Episode(
                problem_id=batch["problem_id"][i],
                **{name: batch[name][sl] for name, _ in _TOKEN_KEYS},
                prompt_len=int(batch["prompt_len"][i]),
                reward=float(batch["reward"][i]),
                correct=bool(batch["correct"][i]),
                formatted=bool(batch["formatted"][i]),
                finish_reason=batch["finish_reason"][i],
                num_turns=int(batch["num_turns"][i]),
                completion_text=batch["completion_text"][i],
            )
        )
    groups, k = [], 0
    for j in range(len(batch["group_id"])):
        n = int(batch["group_size"][j])
        groups.append(
            EpisodeGroup(
                int(batch["group_id"][j]),
                batch["group_problem_id"][j],
                tuple(eps[k : k + n]),
                int(batch["dispatch_version"][j]),
            )
        )
        k += n
    return groups


def batch_nbytes(batch: dict) -> int:
    """Bytes of a packed batch's numpy arrays."""
    return sum(v.nbytes for v in batch.values() if isinstance(v, np.ndarray))


@dataclasses.dataclass
class _Worker:
    name: str
    handle: object
    pid: int = -1
    node: str = ""
    log: str = ""


class RayRollout:
    """Rollout worker actors behind the Engine protocol (plus group-level `run` for the trainer).

    Starts a local Ray cluster unless `options.address` names one (and shuts down only a
    cluster it started). `version` is the newest version sent to the workers.
    """

    def __init__(
        self,
        source,
        *,
        version: int,
        task: dict,
        tokenizer_dir: str,
        options: RayOptions,
        engine_kwargs: dict | None = None,
        call_deadline_s: float = 600.0,
        vllm: dict | None = None,
    ):
        """vllm: the workers drive vLLM hosts instead of a JAX sampler: VLLMHost.launch and
        VLLMEngine options (num_hosts per worker, host, enforce_eager, seed, extra_args,
        ready_timeout_s, update_mode, request_timeout_s, deadline_s) plus 'hf', the parameter
        server's ParamServer options (weights_dir on a filesystem every node shares, config,
        tokenizer_dir, keep, hf_overrides)."""
        import ray

        from rl.rollout.process_engine import flat_params

        self.options = options
        self.version = version
        self.call_deadline_s = call_deadline_s
        self.config = source.config
        self.task = dict(task)
        self.engine_kwargs = dict(engine_kwargs or {})
        self.vllm = {k: v for k, v in (vllm or {}).items() if k != "hf"} if vllm else None
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
        # A RemoteLearner's weights were put by the learner process; a model's are put here.
        self.weights_ref = (
            source.weights() if hasattr(source, "weights") else ray.put(flat_params(source))
        )
        self.restarts = 0
        self.lost: list[str] = []  # why each lost worker was lost
        self.batches = 0  # episode batches received through the object store
        self.batch_bytes = 0
        self.sync_times: list[dict] = []
        self.workers: list[_Worker] = []
        log = os.path.join(options.log_dir, "param-server.log") if options.log_dir else ""
        self.param_server = ray.remote(ParamServerActor).options(num_cpus=0, max_restarts=0)
        self.param_server = self.param_server.remote(log, dict(vllm["hf"]) if vllm else None)
        self.inflight: dict[int, list[int]] = {}  # slot -> group ids its worker is running
        self._updates: queue.Queue = queue.Queue()  # weight versions for the update thread
        self._updater: threading.Thread | None = None
        self._closed = False
        try:
            self.param_server_pid = ray.get(
                self.param_server.info.remote(), timeout=call_deadline_s
            )["pid"]
            if self.vllm:  # vLLM workers start from the published HF directory of `version`
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
    def num_workers(self) -> int:
        """Worker slots (each slot has one live actor, replaced when it is lost)."""
        return len(self.workers)

    @property
    def pid(self) -> int:
        """Process id of worker 0 (the benchmark reads its CPU time)."""
        return self.workers[0].pid

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
                self.engine_kwargs,
                tuple(o.cores),
                log,
                self.vllm,
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
            why = self._unhealthy(slot)  # the worker lost its engine (vLLM hosts exited)
            if why:
                raise WorkerLost(f"failed a health check: {why}") from e
            raise RolloutWorkerError(f"{self.describe(slot)} raised:\n{e}") from e
        with self._lock:
            self.batches += 1
            self.batch_bytes += batch_nbytes(batch)
        return unpack_groups(batch)

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
                        raise WorkerLost(f"failed a health check: {_first_line(e)}") from e
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
            return _first_line(e)
        return ""

    def _kill(self, handle) -> None:
        import ray

        try:
            ray.kill(handle, no_restart=True)
        except Exception:  # noqa: BLE001 - already dead
            pass

    # -- Engine protocol ------------------------------------------------------------------
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

    def update_weights(
        self,
        version: int,
        path: str | None = None,
        params=None,
        *,
        ref=None,
        interrupt: bool = False,
        on_served=None,
        on_error=None,
    ) -> None:
        """Publishes `version` through the parameter server actor: every worker installs it.

        The weights are `ref` (flat numpy params already in the object store, e.g. put by the
        learner actor) or `params` (put here, once). Without on_served, returns when every
        live worker serves `version`. With on_served, returns once the weights are handed on
        and calls on_served(version) when every worker serves them (on_error(exception) if that
        fails), as ProcessEngine does. A worker lost meanwhile is replaced by its dispatcher,
        on the newest weights.
        """
        import ray

        from rl.rollout.process_engine import flat_params

        if (params is None) == (ref is None):
            raise ValueError("RayRollout.update_weights needs params or ref (HF paths: no)")
        t0 = time.perf_counter()
        if ref is None:
            flat = flat_params(params)
            t1 = time.perf_counter()
            ref = ray.put(flat)
        else:
            t1 = t0
        if not self.vllm:  # a replacement started from now on gets these weights (vLLM: the
            with self._lock:  # directory the parameter server writes, once it is written)
                self.weights_ref, self.version = ref, version
        done = threading.Event()
        result: dict = {}

        def served(v):
            done.set()
            if on_served is not None:
                on_served(v)

        def failed(e):
            result["error"] = e
            done.set()
            if on_error is not None:
                on_error(e)

        if self._updater is None:
            self._updater = threading.Thread(target=self._update_loop, daemon=True)
            self._updater.start()
        self._updates.put((version, ref, interrupt, (t0, t1, time.perf_counter()), served, failed))
        if on_served is None:
            done.wait()
            if "error" in result:
                raise result["error"]

    def _update_loop(self) -> None:
        """Has the parameter server publish queued versions to the workers, one at a time."""
        import ray

        while True:
            item = self._updates.get()
            if item is None:
                return
            version, ref, interrupt, (t0, t1, t2), served, failed = item
            try:
                with self._lock:
                    handles = [w.handle for w in self.workers]
                deadline = self.call_deadline_s
                call = self.param_server.publish.remote(
                    version, [ref], handles, interrupt, deadline
                )
                out = ray.get(call, timeout=deadline + 30)
                while self.vllm:  # replacements started meanwhile on the previous directory
                    with self._lock:
                        self.weights_ref, self.version = out["weights"][0], version
                        missed = [w.handle for w in self.workers if w.handle not in handles]
                    if not missed:
                        break
                    handles += missed
                    call = self.param_server.publish.remote(
                        version, [ref], missed, interrupt, deadline
                    )
                    out = ray.get(call, timeout=deadline + 30)
                self.sync_times.append(
                    {
                        "flatten_s": t1 - t0,
                        "send_s": t2 - t1,
                        "install_s": out["install_s"],
                        "total_s": time.perf_counter() - t0,
                    }
                )
            except BaseException as e:  # noqa: BLE001 - the learner hears of it
                failed(RolloutWorkerError(f"weight update to version {version} failed: {e!r}"))
                continue
            served(version)

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

    def refresh_stats(self) -> dict:
        """Counters summed over the live workers (busy_s, tokens, traces, install_s)."""
        out: dict = {"busy_s": 0.0, "tokens": 0, "traces": 0, "install_s": 0.0, "updates": 0}
        for s in self._all("stats", timeout=self.call_deadline_s):
            for k in out:
                out[k] += (s or {}).get(k, 0)
        return out

    def metrics(self) -> dict[str, float]:
        """Transport counters for the metrics row."""
        return {
            "rollout/workers": float(len(self.workers)),
            "rollout/restarts": float(self.restarts),
            "rollout/workers_lost": float(len(self.lost)),
            "transport/batches": float(self.batches),
            "transport/batch_mbytes": self.batch_bytes / 1e6,
        }

    def close(self) -> None:
        """Kills the workers; shuts Ray down if this object started it. Idempotent."""
        import ray

        if self._closed:
            return
        self._closed = True
        self._updates.put(None)
        if self.vllm:  # stop the vLLM servers cleanly (a killed worker's die with it anyway)
            refs = [w.handle.shutdown.remote() for w in self.workers]
            ray.wait(refs, num_returns=len(refs), timeout=60)
        for w in self.workers:
            self._kill(w.handle)
        self._kill(self.param_server)
        if self.owns_ray and ray.is_initialized():
            ray.shutdown()


def _first_line(e: BaseException) -> str:
    """The innermost cause of a Ray error, on one line."""
    cause = getattr(e, "cause", None) or e
    return f"{type(cause).__name__}: {str(cause).strip().splitlines()[0] if str(cause) else ''}"


_STATS_LOCK = threading.Lock()  # dispatcher threads add to one stats dict


def ray_rollout_loop(pool, slot, coord, buffer, work, sampling, stats, max_groups, deadline):
    """A dispatcher thread of worker `slot`: admit groups, run them on the actor, deliver.

    `work(admitted)` turns [(group, version)] into [(group, version, problem, seeds)]. Work of a
    lost worker goes back to the coordinator (same group numbers, counted as re-dispatched) and
    the slot gets a replacement; any other failure reaches the learner through buffer.fail.
    """
    try:
        while True:
            admitted = coord.admit(max_groups, timeout=deadline)
            if not admitted:
                return
            t0 = time.perf_counter()
            try:
                groups = pool.run(slot, work(admitted), sampling, stopped=lambda: coord.stopped)
            except WorkerLost as e:
                if coord.stopped:
                    return
                lost = [g for g, _ in admitted]
                pool.replace(slot, str(e), on_started=lambda lost=lost: coord.requeue(lost))
                continue
            if groups is None or coord.stopped:
                return
            with _STATS_LOCK:
                stats["generate_time"] += time.perf_counter() - t0
                stats["tokens"] += sum(e.num_generated for g in groups for e in g.episodes)
            for g in groups:
                buffer.put(g)
    except BaseException as e:  # noqa: BLE001 - the learner must hear of any failure
        buffer.fail(e)
