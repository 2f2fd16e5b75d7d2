"""The learner and the parameter server of the `ray` transport, each a Ray actor of its own.

LearnerActor is a process holding the sharded Learner (mesh, model, optimizer), its Orbax
Checkpointer and the compiled steps; the driver (the trainer: coordinator, buffer, dispatchers,
metrics) reaches it through RemoteLearner, which has the Learner's interface (update, version,
set_step_cfg, reset_optimizer) plus weights() (the flat numpy params put into the object store
by the learner process: one copy, shared by every reader) and save / restore of checkpoints,
which the learner writes itself (the driver sends the checkpoint's meta and the buffer's
finished groups as pack_groups arrays). Training batches travel as numpy arrays through the
object store; nothing of the model lives in the driver.

ParamServerActor is the version registry and the fan-out of weight publication: the driver
hands it (version, weights ref, the live rollout workers) and it has every worker install that
version, in publication order (a Ray actor runs one call at a time, in the order they were
sent), and reports the slowest install; a worker lost meanwhile is skipped (its dispatcher
replaces it on the newest weights). Its `latest()` is the newest version and weights.

Every call waits at most trainer.deadline_s; a learner that dies or passes the deadline fails
the run with an error naming its pid and log file.
"""

from __future__ import annotations

import os
import time

from rl.transport import pin_threads


class LearnerError(RuntimeError):
    """The learner actor died, failed to start, or passed its deadline."""


def redirect_output(log_path: str) -> None:
    """Everything the process prints (JAX warnings, tracebacks) goes to log_path."""
    if not log_path:
        return
    os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


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

        from rl.trainer import make_learner

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
        from rl.ray_transport import pack_groups
        from rl.trainer import restore_learner

        restored = restore_learner(self.learner, self.ckpt)
        if restored is None:
            return None
        meta, groups = restored
        return meta, pack_groups(list(groups.values()))

    def update(self, batch, minibatches: int) -> tuple[dict, int]:
        """One policy update; returns (metrics, the new version)."""
        met = self.learner.update(batch, minibatches=minibatches)
        return met, self.learner.version

    def set_version(self, version: int) -> None:
        self.learner.version = version

    def set_step_cfg(self, step_cfg) -> None:
        self.learner.set_step_cfg(step_cfg)

    def reset_optimizer(self, tx) -> None:
        self.learner.reset_optimizer(tx)

    def weights(self) -> list:
        """[ObjectRef] of the params as flat numpy arrays, put into the store by this process."""
        import ray

        from rl.rollout.process_engine import flat_params

        return [ray.put(flat_params(self.learner.params()))]

    def save(self, step: int, meta: dict, packed: dict) -> None:
        """Checkpoints the learner state with the driver's meta and buffered groups."""
        from rl.ray_transport import unpack_groups

        groups = {g.group_id: g for g in unpack_groups(packed)}
        self.ckpt.save(step, self.learner.state, {**meta, "version": self.learner.version}, groups)

    def close(self) -> None:
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
    ):
        """pass_env: the learner gets this process's XLA_FLAGS and JAX_PLATFORMS (a local
        cluster); on a joined cluster it keeps its own node's."""
        import ray

        self.deadline_s = deadline_s
        self.log = os.path.join(log_dir, "learner.log") if log_dir else ""
        self.pid, self.node = -1, ""
        keys = ("XLA_FLAGS", "JAX_PLATFORMS") if pass_env else ()
        env = {k: os.environ[k] for k in keys if k in os.environ}
        cls = ray.remote(LearnerActor).options(num_cpus=cpus, num_gpus=gpus, max_restarts=0)
        self.handle = cls.remote(
            cfg, os.path.abspath(run_dir), vocab_size, tuple(cores), self.log, env
        )
        info = self._get(self.handle.info.remote(), "start")
        self.pid, self.node, self.config = info["pid"], info["node"], info["config"]
        self.devices = info["devices"]
        self._version = 0

    def describe(self) -> str:
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
            raise LearnerError(f"{self.describe()} died during {what}: {e}") from e
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
        self._get(self.handle.set_step_cfg.remote(step_cfg), "set_step_cfg")

    def reset_optimizer(self, tx) -> None:
        self._get(self.handle.reset_optimizer.remote(tx), "reset_optimizer")

    def weights(self):
        """ObjectRef of the current params as flat numpy arrays (owned by the learner)."""
        return self._get(self.handle.weights.remote(), "weights")[0]

    def restore(self):
        """(meta, {group id: EpisodeGroup}) of the newest checkpoint, or None; sets version."""
        from rl.ray_transport import unpack_groups

        out = self._get(self.handle.restore.remote(), "restore")
        if out is None:
            return None
        meta, packed = out
        self._version = meta["version"]
        return meta, {g.group_id: g for g in unpack_groups(packed)}

    def save(self, step: int, meta: dict, groups: dict) -> None:
        """A checkpoint written by the learner: its state, `meta` and the buffered groups."""
        from rl.ray_transport import pack_groups

        self._get(self.handle.save.remote(step, meta, pack_groups(list(groups.values()))), "save")

    def close(self) -> None:
        """Waits for checkpoint writes, then ends the actor. Idempotent."""
        import ray

        if self.handle is None:
            return
        try:
            ray.get(self.handle.close.remote(), timeout=self.deadline_s)
        except ray.exceptions.RayError:
            pass
        try:
            ray.kill(self.handle, no_restart=True)
        except Exception:  # noqa: BLE001 - already dead
            pass
        self.handle = None


class ParamServerActor:
    """Publishes weight versions to the rollout workers, in order; remembers the newest."""

    def __init__(self, log_path: str = "", hf: dict | None = None):
        self.log_path = log_path
        redirect_output(log_path)
        self.version = -1
        self.weights: list = []
        self.published = 0
        self.server = None
        if hf is not None:  # vLLM workers: each version becomes a published HF directory
            from flax import nnx

            from models.transformer import Transformer
            from rl.param_server import ParamServer

            config = hf.pop("config")
            abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
            self.template = nnx.state(abstract, nnx.Param)
            self.server = ParamServer(hf.pop("weights_dir"), config, **hf)

    def info(self) -> dict:
        return {"pid": os.getpid(), "log": self.log_path}

    def write(self, version: int, weights: list) -> str:
        """Writes weights[0] (flat numpy params) as the HF directory of `version` (vLLM)."""
        import ray

        from rl.rollout.process_engine import _fill

        path, _ = self.server.write(version, _fill(self.template, ray.get(weights[0])))
        self.server.engine_versions["workers"] = version  # kept until a newer one is served
        self.server.retain()
        return path

    def publish(self, version: int, weights: list, workers: list, interrupt: bool, deadline_s):
        """Has every worker install `version`; {install_s, skipped, total_s, weights}.

        weights[0] is the flat numpy params' ObjectRef; JAX workers install it from the object
        store, vLLM workers reload the HF directory written here from it ('weights' in the reply:
        what a replacement worker starts on). A worker that died or fails its health check (its
        dispatcher replaces it) is skipped: its replacement starts on the newest weights.
        """
        import ray

        t0 = time.perf_counter()
        send = self.write(version, weights) if self.server is not None else weights[0]
        self.version, self.weights = version, [send]
        refs = [w.update_weights.remote(version, send, interrupt) for w in workers]
        install, skipped = 0.0, 0
        for w, r in zip(workers, refs):
            try:
                install = max(install, ray.get(r, timeout=deadline_s))
            except ray.exceptions.RayActorError:
                skipped += 1
            except ray.exceptions.RayTaskError:  # lost its engine (vLLM hosts exited), or a
                try:  # failed update on a healthy worker, which must not serve the old version
                    ray.get(w.ping.remote(), timeout=deadline_s)
                except ray.exceptions.RayError:
                    skipped += 1
                    continue
                raise
        self.published += 1
        return {
            "install_s": install,
            "skipped": skipped,
            "total_s": time.perf_counter() - t0,
            "weights": [send],
        }

    def latest(self) -> tuple[int, list]:
        """(newest version, [its weights: an ObjectRef, or an HF directory for vLLM])."""
        return self.version, self.weights
