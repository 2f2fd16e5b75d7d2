"""The learner actors of the `ray` transport and the driver's client of them.

A LearnerActor is a process holding the sharded Learner (mesh, model, optimizer), its Orbax
Checkpointer and the compiled steps. With learner.hosts = N there are N of them, one per bundle
of a Ray placement group, joined by jax.distributed into one learner over one global mesh: they
run every call in lockstep. RemoteLearner is the driver's handle with the learner contract
(rl.learner.LearnerHandle): update, weights() (the flat numpy params put into the object store by
process 0: one copy, shared by every reader), save / restore of checkpoints, which the learner
hosts write themselves, restart and close. Training batches travel as numpy arrays
through the object store (every host reads the whole batch and places its own rows). While a
call runs, each host is pinged (a ping has a thread of its own in the actor). A host that died
raises LearnerActorDied; one that leaves a ping unanswered for trainer.ray.health_deadline_s, or
a call unanswered past trainer.deadline_s, is hung and raises LearnerHung (both LearnerLost):
restart() then kills the hosts and starts new ones from the newest valid checkpoint, up to
trainer.ray.max_learner_restarts times per run. Errors name the host's pid and log file.
"""

from __future__ import annotations

import os
import time

from rl.distributed import redirect_output
from rl.learner import LearnerLost
from rl.placement import pin_threads
from rl.rollout.base import Weights

GRACE_S = 5.0  # after one host fails, how long the others get to report (a died one is named)


class LearnerError(RuntimeError):
    """A learner actor died, failed to start, or passed its deadline."""


class LearnerActorDied(LearnerError, LearnerLost):
    """A learner actor's process died (restart() may replace the hosts from the last checkpoint)."""


class LearnerHung(LearnerError, LearnerLost):
    """A learner actor is alive but does not answer (stopped, deadlocked): it is treated as lost,
    killed and replaced from the last checkpoint like one that died."""


HEALTH = "health"  # the actor's concurrency group for ping(): answered while a call runs


class LearnerActor:
    """The learner process: model, optimizer and checkpoints on this process's devices."""

    def __init__(
        self,
        cfg,
        run_dir: str,
        vocab_size: int,
        cores: tuple[int, ...] = (),
        log_path: str = "",
        env: dict | None = None,
        process_id: int = 0,
    ):
        """Nothing of JAX yet: start() builds the learner once every host's actor exists."""
        self.log_path = log_path
        redirect_output(log_path)
        for k, v in (env or {}).items():  # before JAX initialises its backend (XLA_FLAGS)
            os.environ[k] = v
        if cores:
            pin_threads(cores)
        self.cfg, self.run_dir, self.vocab_size = cfg, run_dir, vocab_size
        self.process_id = process_id

    def coordinator(self) -> str:
        """host:port for the jax.distributed coordinator, free on this actor's node (actor 0)."""
        import ray

        from rl.distributed import free_port

        node = ray.util.get_node_ip_address()
        return f"{node}:{free_port(node)}"

    def start(self, coordinator: str | None) -> None:
        """Joins the learner hosts (learner.hosts > 1), then builds mesh, learner, checkpointer."""
        from rl import distributed

        cfg = self.cfg
        distributed.initialize(
            cfg.learner.hosts,
            coordinator_address=coordinator,
            process_id=self.process_id,
            log=self.log_path,
            deadline_s=cfg.trainer.deadline_s,
        )
        import jax

        from rl.learner_setup import make_learner

        self.mesh, self.learner, self.ckpt = make_learner(
            cfg, self.vocab_size, jax.devices(), self.run_dir
        )
        print(
            f"learner: pid {os.getpid()}, host {self.process_id} of {cfg.learner.hosts}, devices "
            f"{[d for d in self.mesh.devices.flat if d.process_index == jax.process_index()]}, "
            f"cores {sorted(os.sched_getaffinity(0))}",
            flush=True,
        )

    def ping(self) -> int:
        """This process's pid (run in the HEALTH group: answers while another call runs)."""
        return os.getpid()

    def info(self) -> dict:
        """pid, node, devices, the model config and the log path of the learner."""
        import ray

        return {
            "pid": os.getpid(),
            "node": ray.util.get_node_ip_address(),
            "devices": [str(d) for d in self.mesh.devices.flat],
            "config": self.learner.model.config,
            "log": self.log_path,
        }

    def restore(self):
        """Loads the newest checkpoint: None if there is none, else (meta, packed groups,
        packed partial groups or None)."""
        from rl.partials import partials_to_arrays
        from rl.types import groups_to_arrays

        restored = self.learner.restore()
        if restored is None:
            return None
        meta, groups, partials = restored
        parts = partials_to_arrays(list(partials.values())) if partials else None
        return meta, groups_to_arrays(list(groups.values())), parts

    def update(self, batch, minibatches: int) -> tuple[dict, int]:
        """One policy update; returns (metrics, the new version)."""
        met = self.learner.update(batch, minibatches=minibatches)
        return met, self.learner.version

    def set_version(self, version: int) -> None:
        """Sets the policy version (after the warm start)."""
        self.learner.version = version

    def set_step_cfg(self, step_cfg) -> None:
        """Switches the compiled step (warm start / RL)."""
        self.learner.set_step_cfg(step_cfg)

    def reset_optimizer(self, tx) -> None:
        """A fresh optimizer state for `tx`."""
        self.learner.reset_optimizer(tx)

    def weights(self) -> list:
        """[ObjectRef] of the params as flat numpy arrays, put into the store by process 0 ([None]
        on the other hosts). Every host takes part in the gather (distributed.gather_to_primary
        states its memory cost)."""
        import ray

        from models.params import flat_params
        from rl import distributed

        host = distributed.gather_to_primary(self.learner.params())
        return [ray.put(flat_params(host))] if distributed.is_primary() else [None]

    def wait_saved(self) -> None:
        """Returns once the last checkpoint is committed (CheckpointError if it failed)."""
        self.ckpt.wait()

    def save(self, step: int, meta: dict, packed: dict, packed_partials=None) -> None:
        """Checkpoints the learner state with the driver's meta, buffered and partial groups."""
        from rl.partials import by_id, partials_from_arrays
        from rl.types import groups_from_arrays

        groups = {g.group_id: g for g in groups_from_arrays(packed)}
        partials = None if packed_partials is None else by_id(partials_from_arrays(packed_partials))
        meta = {**meta, "version": self.learner.version}
        self.learner.save(step, meta, groups, partials)

    def close(self) -> None:
        """Waits for checkpoint writes in flight."""
        self.ckpt.close()


class RemoteLearner:
    """The driver's handle on the learner actors (one per learner host), with the learner
    contract (rl.learner.LearnerHandle); every call goes to every host, results come from host 0.
    With owns_ray it also shuts down the Ray cluster it started, at close."""

    def __init__(
        self,
        cfg,
        run_dir: str,
        vocab_size: int,
        *,
        cpus: float,
        gpus: float,
        cores: tuple[int, ...] = (),
        log_dir: str = "",
        deadline_s: float = 600.0,
        health_deadline_s: float = 30.0,
        pass_env: bool = True,
        max_restarts: int = 0,
        owns_ray: bool = False,
    ):
        """pass_env: the learner gets this process's XLA_FLAGS and JAX_PLATFORMS (a local
        cluster); on a joined cluster it keeps its own node's. max_restarts: restart() calls
        allowed (trainer.ray.max_learner_restarts). health_deadline_s: how long a started host
        may leave a ping unanswered before it counts as hung."""
        import ray

        self.deadline_s, self.health_deadline_s = deadline_s, health_deadline_s
        self.started = False  # pings and hang detection begin once every host has answered
        self.hosts = n = cfg.learner.hosts
        names = ["learner"] if n == 1 else [f"learner-{i}" for i in range(n)]
        self.logs = [os.path.join(log_dir, f"{name}.log") if log_dir else "" for name in names]
        self.log = self.logs[0]
        self.pids, self.nodes = [-1] * n, [""] * n
        self.pid, self.node = -1, ""
        self.max_restarts, self.restarts = max_restarts, 0
        self.owns_ray = owns_ray
        self.lost: list[str] = []  # why each restarted learner ended
        self.handles: list = []
        keys = ("XLA_FLAGS", "JAX_PLATFORMS") if pass_env else ()
        env = {k: os.environ[k] for k in keys if k in os.environ}
        cls = ray.remote(concurrency_groups={HEALTH: 1})(LearnerActor)
        self._cls, self._env, self._args = cls, env, (cfg, run_dir, vocab_size)
        self._cpus, self._gpus, self._cores = cpus, gpus, tuple(cores)
        self.group = self._placement_group(cpus, gpus) if n > 1 else None
        self._start()
        self._version = 0

    def _start(self) -> None:
        """New learner actors (one per host, joined); returns once they answer."""
        cfg, run_dir, vocab_size = self._args
        cls, env, cpus, gpus = self._cls, self._env, self._cpus, self._gpus
        n = self.hosts
        self.handles, self.started = [], False
        for i in range(n):
            opts = {"num_cpus": cpus, "num_gpus": gpus, "max_restarts": 0}
            if self.group is not None:
                from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

                opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    self.group, placement_group_bundle_index=i
                )
            self.handles.append(
                cls.options(**opts).remote(
                    cfg, os.path.abspath(run_dir), vocab_size, self._cores, self.logs[i], env, i
                )
            )
        address = self._get(self.handles[0].coordinator.remote(), "start") if n > 1 else None
        self._all("start", address)
        infos = self._all("info")
        self.pids = [info["pid"] for info in infos]
        self.nodes = [info["node"] for info in infos]
        self.pid, self.node, self.config = self.pids[0], self.nodes[0], infos[0]["config"]
        self.devices = infos[0]["devices"]  # the global mesh's, the same on every host
        self.started = True

    def restart(self, why: str):
        """Replaces learner hosts of which one died or hung by new ones on the newest valid
        checkpoint: (meta, groups, partial groups) of it; the version goes back to its.
        Raises LearnerError past max_restarts, or if there is no checkpoint."""
        self._kill()  # a hung host must not hold its resources or delay close()
        if self.restarts >= self.max_restarts:
            raise LearnerError(
                f"{why}; {self.restarts} of trainer.ray.max_learner_restarts="
                f"{self.max_restarts} restarts used, the run stops"
            )
        self.restarts += 1
        self.lost.append(why)
        self._start()
        restored = self.restore()
        if restored is None:
            raise LearnerError(f"{why}; no checkpoint to restart the learner from")
        return restored

    def _kill(self) -> None:
        """Ends every host's process (SIGKILL from its raylet: a stopped process ends too)."""
        import ray

        for h in self.handles:
            try:
                ray.kill(h, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass
        self.handles = []

    def _placement_group(self, cpus: float, gpus: float):
        """One bundle per learner host, SPREAD: on a cluster the hosts land on different nodes
        where they fit, and on one machine (a local cluster, as in the tests) they all land on it;
        STRICT_SPREAD would demand a node per host and never place on one machine."""
        import ray
        from ray.util.placement_group import placement_group

        bundle = {k: v for k, v in (("CPU", cpus), ("GPU", gpus)) if v > 0}
        if not bundle:
            raise LearnerError(
                "learner.hosts > 1 needs trainer.ray.learner_cpus or learner_gpus > 0 (one "
                "placement group bundle per host)"
            )
        group = placement_group([bundle] * self.hosts, strategy="SPREAD")
        try:
            ray.get(group.ready(), timeout=self.deadline_s)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(group)
            raise LearnerError(
                f"{self.hosts} learner hosts of {bundle} each could not be placed within "
                f"trainer.deadline_s={self.deadline_s:g}s (free: {ray.available_resources()})"
            ) from None
        return group

    def describe(self, host: int = 0) -> str:
        """A learner host by process id, pid, node and log file."""
        log = self.logs[host] or "the Ray worker logs (/tmp/ray/session_latest/logs on its node)"
        where = f"pid {self.pids[host]}, node {self.nodes[host] or '?'}; log: {log}"
        return f"learner actor ({where})" if self.hosts == 1 else f"learner host {host} ({where})"

    def _get(self, ref, what: str, host: int = 0):
        """One host's answer to `what`."""
        return self._gather([ref], what, hosts=[host])[0]

    def _all(self, method: str, *args) -> list:
        """Every host's answer to method(*args), called on all of them (lockstep)."""
        refs = [getattr(h, method).remote(*args) for h in self.handles]
        return self._gather(refs, method)

    def _gather(self, refs: list, what: str, hosts: list[int] | None = None) -> list:
        """ray.get of one ref per host within the deadline. When a host fails, the others get
        GRACE_S to report, so the error names a host that died rather than its survivors. Once
        started, the hosts still working are pinged; one that leaves a ping unanswered for
        health_deadline_s, or the call past the deadline, raises LearnerHung."""
        import ray

        hosts = list(range(len(refs))) if hosts is None else hosts
        t0 = time.monotonic()
        pending, failed = list(refs), {}
        pings: dict[int, tuple] = {}  # host -> (ping ref, sent at)
        answered = dict.fromkeys(hosts, t0)  # host -> when it last answered
        while pending:
            now = time.monotonic()
            left = self.deadline_s - (now - t0)
            if failed:
                left = min(left, GRACE_S - (now - failed["t"]))
            if left <= 0:
                break
            if self.started:
                left = min(left, self.health_deadline_s / 4)
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            for ref in ready:
                host = hosts[refs.index(ref)]
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    failed.setdefault("t", time.monotonic())
                    failed[host] = f"{self.describe(host)} died during {what}: {e}"
                except ray.exceptions.RayTaskError as e:
                    failed.setdefault("t", time.monotonic())
                    failed[host] = f"{self.describe(host)} failed {what}:\n{e}"
            if self.started and pending and not failed:
                working = [hosts[refs.index(r)] for r in pending]
                self._check_pings(working, pings, answered, what)
        failed.pop("t", None)
        if failed:
            died = [m for m in failed.values() if " died during " in m]
            if died:
                raise LearnerActorDied("\n".join(died))
            raise LearnerError("\n".join(failed.values()))
        if pending:
            late = ", ".join(self.describe(hosts[refs.index(r)]) for r in pending)
            if self.started:
                raise LearnerHung(
                    f"{late}: no answer to {what} within trainer.deadline_s={self.deadline_s:g}s "
                    "(hung)"
                )
            raise LearnerError(
                f"{late}: no answer to {what} within trainer.deadline_s={self.deadline_s:g}s "
                f"(still scheduling? it needs trainer.ray.learner_cpus / learner_gpus free in "
                f"the cluster: {ray.available_resources()})"
            )
        return [ray.get(r) for r in refs]

    def _check_pings(self, working: list[int], pings: dict, answered: dict, what: str) -> None:
        """Pings each working host every quarter health deadline; raises LearnerHung for one
        whose ping stays unanswered for health_deadline_s (LearnerActorDied if it died)."""
        import ray

        deadline = self.health_deadline_s
        now = time.monotonic()
        for host in working:
            if host in pings:
                ref, sent = pings[host]
                if ray.wait([ref], timeout=0)[0]:
                    try:
                        ray.get(ref)
                    except ray.exceptions.RayActorError as e:
                        raise LearnerActorDied(
                            f"{self.describe(host)} died during {what}: {e}"
                        ) from e
                    del pings[host]
                    answered[host] = now
                elif now - sent > deadline:
                    raise LearnerHung(
                        f"{self.describe(host)} did not answer a health check within "
                        f"trainer.ray.health_deadline_s={deadline:g}s during {what} (hung: "
                        "stopped or deadlocked)"
                    )
            if host not in pings and now - answered[host] > deadline / 4:
                ping = self.handles[host].ping.options(concurrency_group=HEALTH).remote()
                pings[host] = (ping, now)

    @property
    def version(self) -> int:
        """Updates applied (the policy version the learner holds)."""
        return self._version

    @version.setter
    def version(self, v: int) -> None:
        self._all("set_version", v)
        self._version = v

    def update(self, batch, *, minibatches: int = 1, wait: bool = True) -> dict[str, float]:
        """One policy update on every host (the batch goes through the object store once). It
        always waits (wait is the contract's): the metrics come back from the actors."""
        import ray

        ref = ray.put(batch)
        met, self._version = self._all("update", ref, minibatches)[0]
        return met

    def set_step_cfg(self, step_cfg) -> None:
        """Switches the learner's compiled step."""
        self._all("set_step_cfg", step_cfg)

    def reset_optimizer(self, tx) -> None:
        """A fresh optimizer state on the learner."""
        self._all("reset_optimizer", tx)

    def weights(self) -> Weights:
        """The current params as Weights: flat numpy arrays host 0 puts into the object store
        (once, when an engine first asks for them)."""
        return Weights(make_ref=lambda: self._all("weights")[0][0])

    def restore(self):
        """(meta, {group id: EpisodeGroup}, {group id: PartialGroup}) of the newest checkpoint,
        or None; sets version."""
        from rl.partials import by_id, partials_from_arrays
        from rl.types import groups_from_arrays

        out = self._all("restore")[0]
        if out is None:
            return None
        meta, packed, packed_partials = out
        self._version = meta["version"]
        partials = {} if packed_partials is None else by_id(partials_from_arrays(packed_partials))
        return meta, {g.group_id: g for g in groups_from_arrays(packed)}, partials

    def save(self, step: int, meta: dict, groups: dict, partials: dict | None = None) -> None:
        """A checkpoint written by the learner hosts: state, `meta`, buffered and partial
        groups."""
        import ray

        from rl.partials import partials_to_arrays
        from rl.types import groups_to_arrays

        packed = ray.put(groups_to_arrays(list(groups.values())))
        parts = ray.put(partials_to_arrays(list(partials.values()))) if partials else None
        self._all("save", step, meta, packed, parts)

    def wait_saved(self) -> None:
        """Returns once the learner's last checkpoint is committed; raises if it failed."""
        self._all("wait_saved")

    def stats(self) -> dict[str, float]:
        """The learner's counters for the update's metrics row: restarts so far."""
        return {"learner/restarts": float(self.restarts)}

    def close(self, failed: bool = False) -> None:
        """Waits for checkpoint writes, then ends the actors and their placement group, and a
        Ray cluster this learner started. Idempotent."""
        import ray

        try:
            self._close_actors()
        finally:
            if self.owns_ray:
                self.owns_ray = False
                ray.shutdown()

    def _close_actors(self) -> None:
        import ray

        if not self.handles:
            return
        refs = [h.close.remote() for h in self.handles]
        try:
            ray.wait(refs, num_returns=len(refs), timeout=self.deadline_s)
        except ray.exceptions.RayError:
            pass
        self._kill()
        if self.group is not None:
            try:
                ray.util.remove_placement_group(self.group)
            except Exception:  # noqa: BLE001 - the cluster is going down
                pass
            self.group = None


def remote_learner(cfg, run_dir: str, vocab_size: int, cores: tuple[int, ...] = ()):
    """The run's learner actors (trainer.transport ray): joins trainer.ray.address, or starts a
    local cluster that the learner shuts down at close; this process holds no model."""
    import ray

    from rl.ray.cluster import connect

    r = cfg.trainer.ray
    owns_ray = connect(
        r.address, need_cpus=r.num_workers * r.worker_cpus + r.learner_cpus * cfg.learner.hosts
    )
    try:
        return RemoteLearner(
            cfg,
            run_dir,
            vocab_size,
            cpus=r.learner_cpus,
            gpus=r.learner_gpus,
            cores=cores,
            log_dir=os.path.join(os.path.abspath(run_dir), "logs"),
            deadline_s=cfg.trainer.deadline_s,
            health_deadline_s=r.health_deadline_s,
            pass_env=owns_ray,  # a joined cluster's nodes keep their own environment
            max_restarts=r.max_learner_restarts,
            owns_ray=owns_ray,
        )
    except BaseException:
        if owns_ray:
            ray.shutdown()
        raise
