"""The learner actor of the `ray` transport and the driver's client of it.

LearnerActor is a process holding the sharded Learner (mesh, model, optimizer), its Orbax
Checkpointer and the compiled steps. RemoteLearner is the driver's handle with the Learner's
interface (update, version, set_step_cfg, reset_optimizer) plus weights() (the flat numpy params
put into the object store by the learner process: one copy, shared by every reader) and
save / restore of checkpoints, which the learner writes itself. Training batches travel as numpy
arrays through the object store. Every call waits at most trainer.deadline_s; a learner that
passes the deadline fails the run with an error naming its pid and log file. A call to a learner
that died raises LearnerActorDied; restart() then starts a new actor from the newest valid
checkpoint, up to trainer.ray.max_learner_restarts times per run.
"""

from __future__ import annotations

import os

from rl.learner import LearnerLost
from rl.placement import pin_threads
from rl.ray.cluster import redirect_output
from rl.rollout.base import Weights


class LearnerError(RuntimeError):
    """The learner actor died, failed to start, or passed its deadline."""


class LearnerActorDied(LearnerError, LearnerLost):
    """The learner actor's process died (restart() may replace it from the last checkpoint)."""


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
    ):
        self.log_path = log_path
        redirect_output(log_path)
        for k, v in (env or {}).items():  # before JAX initialises its backend (XLA_FLAGS)
            os.environ[k] = v
        if cores:
            pin_threads(cores)
        import jax

        from rl.build import make_learner

        self.mesh, self.learner, self.ckpt = make_learner(cfg, vocab_size, jax.devices(), run_dir)
        print(
            f"learner: pid {os.getpid()}, devices {list(self.mesh.devices.flat)}, "
            f"cores {sorted(os.sched_getaffinity(0))}",
            flush=True,
        )

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
        """Loads the newest checkpoint: None if there is none, else (meta, packed groups)."""
        from rl.build import restore_learner
        from rl.types import groups_to_arrays

        restored = restore_learner(self.learner, self.ckpt)
        if restored is None:
            return None
        meta, groups = restored
        return meta, groups_to_arrays(list(groups.values()))

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
        """[ObjectRef] of the params as flat numpy arrays, put into the store by this process."""
        import ray

        from models.params import flat_params

        return [ray.put(flat_params(self.learner.params()))]

    def save(self, step: int, meta: dict, packed: dict) -> None:
        """Checkpoints the learner state with the driver's meta and buffered groups."""
        from rl.types import groups_from_arrays

        groups = {g.group_id: g for g in groups_from_arrays(packed)}
        self.ckpt.save(step, self.learner.state, {**meta, "version": self.learner.version}, groups)

    def wait_saved(self) -> None:
        """Returns once the last checkpoint is committed (CheckpointError if it failed)."""
        self.ckpt.wait()

    def close(self) -> None:
        """Waits for checkpoint writes in flight."""
        self.ckpt.close()


class RemoteLearner:
    """The driver's handle on a LearnerActor, with the Learner interface the trainer uses."""

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
        pass_env: bool = True,
        max_restarts: int = 0,
    ):
        """pass_env: the learner gets this process's XLA_FLAGS and JAX_PLATFORMS (a local
        cluster); on a joined cluster it keeps its own node's. max_restarts: restart() calls
        allowed (trainer.ray.max_learner_restarts)."""
        import ray

        self.deadline_s = deadline_s
        self.log = os.path.join(log_dir, "learner.log") if log_dir else ""
        self.pid, self.node = -1, ""
        self.max_restarts, self.restarts = max_restarts, 0
        self.lost: list[str] = []  # why each restarted actor ended
        keys = ("XLA_FLAGS", "JAX_PLATFORMS") if pass_env else ()
        env = {k: os.environ[k] for k in keys if k in os.environ}
        cls = ray.remote(LearnerActor).options(num_cpus=cpus, num_gpus=gpus, max_restarts=0)
        self._args = (cfg, os.path.abspath(run_dir), vocab_size, tuple(cores), self.log, env)
        self._cls = cls
        self._start()
        self._version = 0

    def _start(self) -> None:
        """A new learner actor; returns once it answers (its model built)."""
        self.handle = self._cls.remote(*self._args)
        info = self._get(self.handle.info.remote(), "start")
        self.pid, self.node, self.config = info["pid"], info["node"], info["config"]
        self.devices = info["devices"]

    def restart(self, why: str):
        """Replaces a learner actor that died by a new one on the newest valid checkpoint:
        (meta, {group id: EpisodeGroup}) of that checkpoint; the version goes back to its.
        Raises LearnerError past max_restarts, or if there is no checkpoint."""
        if self.restarts >= self.max_restarts:
            raise LearnerError(
                f"{why}; {self.restarts} of trainer.ray.max_learner_restarts="
                f"{self.max_restarts} restarts used, the run stops"
            )
        self.restarts += 1
        self.lost.append(why)
        self._kill()
        self._start()
        restored = self.restore()
        if restored is None:
            raise LearnerError(f"{why}; no checkpoint to restart the learner from")
        return restored

    def _kill(self) -> None:
        import ray

        try:
            ray.kill(self.handle, no_restart=True)
        except Exception:  # noqa: BLE001 - already dead
            pass

    def describe(self) -> str:
        """The learner by pid, node and log file."""
        log = self.log or "the Ray worker logs (/tmp/ray/session_latest/logs on its node)"
        return f"learner actor (pid {self.pid}, node {self.node or '?'}; log: {log})"

    def _get(self, ref, what: str):
        import ray

        try:
            return ray.get(ref, timeout=self.deadline_s)
        except ray.exceptions.GetTimeoutError as e:
            raise LearnerError(
                f"{self.describe()}: no answer to {what} within trainer.deadline_s="
                f"{self.deadline_s:g}s (still scheduling? it needs trainer.ray.learner_cpus / "
                f"learner_gpus free in the cluster: {ray.available_resources()})"
            ) from e
        except ray.exceptions.RayActorError as e:
            raise LearnerActorDied(f"{self.describe()} died during {what}: {e}") from e
        except ray.exceptions.RayTaskError as e:
            raise LearnerError(f"{self.describe()} failed {what}:\n{e}") from e

    @property
    def version(self) -> int:
        """Updates applied (the policy version the learner holds)."""
        return self._version

    @version.setter
    def version(self, v: int) -> None:
        self._get(self.handle.set_version.remote(v), "set_version")
        self._version = v

    def update(self, batch, *, minibatches: int = 1) -> dict[str, float]:
        """One policy update on the learner (the batch goes through the object store)."""
        met, self._version = self._get(self.handle.update.remote(batch, minibatches), "update")
        return met

    def set_step_cfg(self, step_cfg) -> None:
        """Switches the learner's compiled step."""
        self._get(self.handle.set_step_cfg.remote(step_cfg), "set_step_cfg")

    def reset_optimizer(self, tx) -> None:
        """A fresh optimizer state on the learner."""
        self._get(self.handle.reset_optimizer.remote(tx), "reset_optimizer")

    def weights(self) -> Weights:
        """The current params as Weights: flat numpy arrays the learner puts into the object
        store (once, when an engine first asks for them)."""
        return Weights(make_ref=lambda: self._get(self.handle.weights.remote(), "weights")[0])

    def restore(self):
        """(meta, {group id: EpisodeGroup}) of the newest checkpoint, or None; sets version."""
        from rl.types import groups_from_arrays

        out = self._get(self.handle.restore.remote(), "restore")
        if out is None:
            return None
        meta, packed = out
        self._version = meta["version"]
        return meta, {g.group_id: g for g in groups_from_arrays(packed)}

    def save(self, step: int, meta: dict, groups: dict) -> None:
        """A checkpoint written by the learner: its state, `meta` and the buffered groups."""
        from rl.types import groups_to_arrays

        packed = groups_to_arrays(list(groups.values()))
        self._get(self.handle.save.remote(step, meta, packed), "save")

    def wait_saved(self) -> None:
        """Returns once the learner's last checkpoint is committed; raises if it failed."""
        self._get(self.handle.wait_saved.remote(), "wait_saved")

    def close(self) -> None:
        """Waits for checkpoint writes, then ends the actor. Idempotent."""
        import ray

        if self.handle is None:
            return
        try:
            ray.get(self.handle.close.remote(), timeout=self.deadline_s)
        except ray.exceptions.RayError:
            pass
        self._kill()
        self.handle = None
