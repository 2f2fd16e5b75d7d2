"""One training loop for sync, one-step-off and fully-async RL.

The modes differ only in the staleness bound eta the coordinator enforces (sync: 0,
one_step_off: 1, async: trainer.max_staleness); rollout workers, buffer, learner, weight
publication, metrics and checkpoints are the same code. Rollout workers run in threads of this
process (`local` transport) and push complete groups into the buffer; the learner consumes
B groups per update, publishes weights every sync_every updates, evaluates and checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
import zlib

import jax
import numpy as np
import optax
from flax import nnx

from models import sharding as msh
from models.config import ModelConfig
from models.tokenizer import build_task_tokenizer, load_tokenizer
from rl import config as C
from rl.agent import run_episodes
from rl.algorithms import advantages as A
from rl.algorithms import losses as L
from rl.buffer import GroupBuffer
from rl.checkpoint import Checkpointer
from rl.coordinator import Coordinator
from rl.learner import (
    Learner,
    StepConfig,
    bucket,
    make_batch,
    make_optimizer,
    make_schedule,
    pack_rows,
)
from rl.metrics import MetricsWriter, staleness_metrics
from rl.rollout.base import SamplingParams
from rl.rollout.jax_engine import JaxEngine
from rl.rollout.process_engine import ProcessEngine
from rl.tasks import get_task
from rl.transport import pin_learner, split_of
from rl.types import Episode, EpisodeGroup


def episode_seed(run_seed: int, group: int, index: int) -> int:
    """The sampling seed of rollout `index` of group `group` (independent of batching)."""
    return zlib.crc32(f"{run_seed}:{group}:{index}".encode()) & 0x7FFFFFFF


def model_config(cfg: C.RunConfig, vocab_size: int) -> ModelConfig:
    """The ModelConfig of a preset, with the run's dtypes and attention settings."""
    from models import config as mc

    try:
        base = getattr(mc, cfg.model.preset)(**cfg.model.overrides)
    except ValueError as e:  # e.g. heads that do not divide hidden_size
        raise C.ConfigError(
            f"model.overrides: {cfg.model.overrides!r} give an invalid model: {e}"
        ) from None
    if base.vocab_size < vocab_size:
        base = dataclasses.replace(base, vocab_size=bucket(vocab_size, 64))
    return dataclasses.replace(
        base,
        dtype=cfg.model.dtype,
        param_dtype=cfg.model.param_dtype,
        attention_impl=cfg.model.attention_impl,
        remat=cfg.model.remat,
    )


def rl_optimizer(cfg: C.RunConfig):
    """The optimizer of the run (its state structure is what checkpoints hold).

    With sft.continue_optimizer the warm start and RL share it: the RL stage keeps the
    warm start's Adam moments, so its first steps are not the sign-like steps of a fresh
    Adam, which at RL learning rates wreck a small warm-started model.
    """
    o, s = cfg.optim, cfg.sft
    sched = make_schedule(
        o.lr,
        total_steps=cfg.trainer.total_updates * cfg.learner.minibatches,
        warmup_steps=o.warmup_steps,
        schedule=o.schedule,
    )
    if s.steps > 0 and s.continue_optimizer:  # one optimizer, one step count, both stages
        warm = make_schedule(
            s.lr, total_steps=s.steps, warmup_steps=s.warmup_steps, schedule=s.schedule
        )
        sched = optax.join_schedules([warm, sched], [s.steps])
    return make_optimizer(
        sched,
        weight_decay=o.weight_decay,
        b1=o.b1,
        b2=o.b2,
        eps=o.eps,
        max_grad_norm=o.max_grad_norm,
    )


@dataclasses.dataclass(frozen=True)
class DeviceSplit:
    """The local transport's devices: the rollout engine's and the learner mesh's (disjoint)."""

    rollout: tuple  # jax.Device
    learner: tuple  # jax.Device


def device_split(cfg: C.RunConfig, devices=None) -> DeviceSplit | None:
    """trainer.rollout_devices / learner_devices resolved on this host; None = no split."""
    t, m = cfg.trainer, cfg.learner.mesh
    if not t.rollout_devices:
        return None
    devices = list(jax.devices() if devices is None else devices)
    for key in ("rollout_devices", "learner_devices"):
        bad = [i for i in getattr(t, key) if i >= len(devices)]
        if bad:
            raise C.ConfigError(
                f"trainer.{key}: {getattr(t, key)} names device(s) {bad}; this host has "
                f"{len(devices)} {devices[0].platform} device(s), valid: 0..{len(devices) - 1}"
            )
    learner = t.learner_devices or [i for i in range(len(devices)) if i not in t.rollout_devices]
    n = m.data * m.fsdp * m.tensor
    if n != len(learner):
        raise C.ConfigError(
            f"learner.mesh: {m.data}x{m.fsdp}x{m.tensor} uses {n} device(s), but the learner has "
            f"{len(learner)} (trainer.learner_devices {t.learner_devices or 'empty'} = {learner} "
            f"beside trainer.rollout_devices {t.rollout_devices}); the mesh must use them all"
        )
    return DeviceSplit(
        tuple(devices[i] for i in t.rollout_devices), tuple(devices[i] for i in learner)
    )


def effective_eta(cfg: C.RunConfig) -> int:
    """The staleness bound of the mode: sync 0, one_step_off 1, async max_staleness."""
    return {"sync": 0, "one_step_off": 1}.get(cfg.trainer.mode, cfg.trainer.max_staleness)


def loss_config(cfg: C.RunConfig) -> L.LossConfig:
    """The algorithm section as a LossConfig."""
    a = cfg.algorithm
    return L.LossConfig(
        clip_eps=a.clip_eps,
        clip_eps_high=a.clip_eps_high,
        dual_clip_c=a.dual_clip_c,
        is_correction=a.is_correction,
        is_cap=a.is_cap,
        decoupled_cap=a.decoupled_cap,
        aggregation=a.aggregation,
        kl_coef=a.kl_coef,
        loss_norm_const=a.loss_norm_const,
    )


def rl_step_cfg(cfg: C.RunConfig) -> StepConfig:
    """The compiled RL step of the run (loss, temperature, micro-batches)."""
    a = cfg.algorithm
    n_seq = cfg.rollout.prompts_per_update * cfg.rollout.group_size // cfg.learner.minibatches
    mb = cfg.learner.micro_batch_size
    return StepConfig(
        loss=a.loss,
        loss_cfg=loss_config(cfg),
        temperature=cfg.rollout.temperature,
        micro_batches=(n_seq // mb) if mb else 1,
        logprob_chunk=cfg.learner.logprob_chunk,
        needs_proximal=a.loss == "decoupled_ppo" or a.is_correction != "none",
    )


def build_model(cfg: C.RunConfig, vocab_size: int, mesh):
    """The run's initial policy on `mesh`: a preset at cfg.seed, or a Hugging Face checkpoint."""
    if cfg.model.init == "hf":
        from models import load_hf

        return load_hf(cfg.model.path, mesh=mesh)
    return msh.create_model(model_config(cfg, vocab_size), mesh, seed=cfg.seed)


def make_learner(cfg: C.RunConfig, vocab_size: int, devices, run_dir: str):
    """(mesh, Learner, Checkpointer) of the run on `devices`: the in-process learner's and the
    ray transport's learner actor's."""
    m = cfg.learner.mesh
    n_dev = m.data * m.fsdp * m.tensor
    if n_dev > len(devices):
        raise C.ConfigError(
            f"learner.mesh: {m.data}x{m.fsdp}x{m.tensor} needs {n_dev} devices, "
            f"{len(devices)} available (trainer.learner_devices / trainer.ray.learner_gpus)"
        )
    mesh = msh.make_mesh(m.data, m.fsdp, m.tensor, devices=list(devices)[:n_dev])
    model = build_model(cfg, vocab_size, mesh)
    learner = Learner(model, rl_optimizer(cfg), mesh=mesh, step_cfg=rl_step_cfg(cfg))
    ckpt = Checkpointer(
        os.path.join(run_dir, "checkpoints"),
        keep=cfg.trainer.keep_checkpoints,
        async_save=cfg.trainer.async_checkpoint,
    )
    return mesh, learner, ckpt


def restore_learner(learner: Learner, ckpt: Checkpointer):
    """Loads the newest checkpoint into `learner`: (meta, groups), or None if there is none."""
    if ckpt.latest_step() is None:
        return None
    state, meta, groups = ckpt.restore(learner.state)
    learner.state = state
    learner.version = meta["version"]
    return meta, groups


class Trainer:
    """Builds a run from a RunConfig and trains it (supervised warm start, then RL)."""

    def __init__(self, cfg: C.RunConfig, *, run_dir: str | None = None, resume: bool = False):
        self.cfg = cfg
        self.run_dir = run_dir or os.path.join(cfg.run_root, cfg.name)
        os.makedirs(self.run_dir, exist_ok=True)
        C.dump(cfg, os.path.join(self.run_dir, "config.yaml"))
        self.tok_dir = os.path.join(self.run_dir, "tokenizer")
        if not os.path.exists(os.path.join(self.tok_dir, "tokenizer.json")):
            build_task_tokenizer(self.tok_dir)
        self.tokenizer = load_tokenizer(self.tok_dir)
        self.task = get_task(cfg.task.name, seed=cfg.task.seed, **cfg.task.options)
        self.eval_problems = self.task.problems("eval", cfg.task.num_eval)
        self._train_problems: list = []
        self.sft_curve: list[tuple[int, float]] = []
        self.eta = effective_eta(cfg)
        self.B = cfg.rollout.prompts_per_update
        self.n = cfg.rollout.group_size
        self.core_split = None
        self.remote = cfg.trainer.transport == "ray"  # the learner is an actor of its own
        if cfg.trainer.pin_cores:
            self.core_split = split_of(cfg.trainer)
            if cfg.sft.steps == 0 and not self.remote:  # before jax.devices(): XLA sizes its
                pin_learner(self.core_split.learner)  # pool from the mask
            # else the warm start (no rollout process yet) uses every core, and run() pins the
            # learner after it; XLA's pool keeps its size, its threads share the learner's cores
        self.resume_meta: dict | None = None
        self.resume_groups: dict = {}
        self.owns_ray = False
        if self.remote:
            self._start_remote_learner(resume)
        else:
            self._start_learner(resume)
        self.writer = MetricsWriter(
            self.run_dir,
            tensorboard=cfg.logging.tensorboard,
            progress=cfg.logging.progress,
            total_updates=cfg.trainer.total_updates,
            resume=self.resume_meta["step"] if self.resume_meta else False,
        )
        self.episodes_dir = os.path.join(self.run_dir, "episodes")
        os.makedirs(self.episodes_dir, exist_ok=True)

    # -- building -------------------------------------------------------------------------
    def _start_learner(self, resume: bool) -> None:
        """The learner in this process, on this host's devices (or trainer.learner_devices)."""
        cfg = self.cfg
        self.device_split = device_split(cfg)  # the rollout's devices and the learner's
        pool = self.device_split.learner if self.device_split else jax.devices()
        self.mesh, self.learner, self.ckpt = make_learner(
            cfg, self.tokenizer.vocab_size, pool, self.run_dir
        )
        restored = restore_learner(self.learner, self.ckpt) if resume else None
        if restored is not None:
            self.resume_meta, self.resume_groups = restored

    def _start_remote_learner(self, resume: bool) -> None:
        """The learner as a Ray actor (trainer.transport=ray); this process holds no model."""
        from rl.ray_learner import RemoteLearner
        from rl.ray_transport import connect

        cfg, r = self.cfg, self.cfg.trainer.ray
        self.device_split = None
        self.mesh = self.ckpt = None
        need = r.num_workers * r.worker_cpus + r.learner_cpus
        self.owns_ray = connect(r.address, need_cpus=need)
        try:
            self.learner = RemoteLearner(
                cfg,
                self.run_dir,
                self.tokenizer.vocab_size,
                cpus=r.learner_cpus,
                gpus=r.learner_gpus,
                cores=self.core_split.learner if self.core_split else (),
                log_dir=os.path.join(os.path.abspath(self.run_dir), "logs"),
                deadline_s=cfg.trainer.deadline_s,
                pass_env=self.owns_ray,  # a joined cluster's nodes keep their own environment
            )
            restored = self.learner.restore() if resume else None
        except BaseException:
            self.close_ray()
            raise
        if restored is not None:
            self.resume_meta, self.resume_groups = restored

    def close_ray(self) -> None:
        """Ends the learner actor and the Ray cluster this trainer started (ray transport)."""
        learner = getattr(self, "learner", None)
        if self.remote and learner is not None:
            learner.close()
        if self.owns_ray:
            import ray

            ray.shutdown()
            self.owns_ray = False

    def _rl_tx(self):
        return rl_optimizer(self.cfg)

    def _rl_step_cfg(self) -> StepConfig:
        return rl_step_cfg(self.cfg)

    def train_problem(self, group: int):
        """The problem of group number `group` (the data cursor walks the train stream)."""
        if group >= len(self._train_problems):
            self._train_problems = self.task.problems("train", 2 * (group + 1) + 64)
        return self._train_problems[group]

    def sampling(self, greedy: bool = False) -> SamplingParams:
        """Sampling params of rollouts (or of greedy evaluation)."""
        r = self.cfg.rollout
        return SamplingParams(
            max_new_tokens=r.max_new_tokens,
            temperature=r.eval_temperature if greedy else r.temperature,
            top_k=0 if greedy else r.top_k,
            top_p=1.0 if greedy else r.top_p,
        )

    def make_engine(self):
        """The rollout engine of the config, serving the learner's current weights."""
        if self.cfg.trainer.transport == "ray":
            return self.make_ray_rollout()
        if self.cfg.rollout.engine == "vllm":
            return self.make_vllm_engine()
        if self.core_split is not None or self.cfg.trainer.rollout_process:
            if jax.default_backend() != "cpu":
                key = "pin_cores" if self.core_split is not None else "rollout_process"
                raise C.ConfigError(
                    f"trainer.{key}: true needs the CPU backend, got {jax.default_backend()!r}"
                )
            return ProcessEngine(
                self.learner.model,
                version=self.learner.version,
                cores=self.core_split.rollout if self.core_split is not None else (),
                max_batch=self.cfg.rollout.batch_size,
                deadline_s=self.cfg.trainer.deadline_s,
            )
        return JaxEngine(
            self.learner.model,
            version=self.learner.version,
            max_batch=self.cfg.rollout.batch_size,
            deadline_s=self.cfg.trainer.deadline_s,
            devices=self.device_split.rollout if self.device_split else None,
        )

    def make_ray_rollout(self):
        """Rollout worker actors (the `ray` transport) serving the learner's current weights."""
        from rl.ray_transport import RayOptions, RayRollout

        c, r = self.cfg, self.cfg.trainer.ray
        opts = RayOptions(
            address=r.address,
            num_workers=r.num_workers,
            cpus=r.worker_cpus,
            gpus=r.worker_gpus,
            health_deadline_s=r.health_deadline_s,
            max_restarts=r.max_restarts,
            cores=self.core_split.rollout if self.core_split else (),
            log_dir=os.path.abspath(os.path.join(self.run_dir, "logs")),
        )
        return RayRollout(
            self.learner,
            version=self.learner.version,
            task={"name": c.task.name, "seed": c.task.seed, "options": dict(c.task.options)},
            tokenizer_dir=self.tok_dir,
            options=opts,
            engine_kwargs={"max_batch": c.rollout.batch_size, "deadline_s": c.trainer.deadline_s},
            call_deadline_s=c.trainer.deadline_s,
            vllm=self._ray_vllm_options() if c.rollout.engine == "vllm" else None,
        )

    def _ray_vllm_options(self) -> dict:
        """What each vLLM rollout worker launches, and the parameter server's HF publication."""
        v = self.cfg.rollout.vllm
        return {
            "num_hosts": v.num_hosts,
            "host": v.host,
            "enforce_eager": v.enforce_eager,
            "seed": self.cfg.seed,
            "extra_args": list(v.extra_args),
            "ready_timeout_s": v.ready_timeout_s,
            "update_mode": self.cfg.trainer.partial,
            "request_timeout_s": v.request_timeout_s,
            "deadline_s": self.cfg.trainer.deadline_s,
            "hf": {
                "weights_dir": os.path.join(os.path.abspath(self.run_dir), "weights"),
                "config": self.learner.config,
                "tokenizer_dir": os.path.abspath(self.tok_dir),
                "keep": 3,
                "hf_overrides": {
                    "eos_token_id": self.tokenizer.eos_id,
                    "pad_token_id": self.tokenizer.pad_id,
                },
            },
        }

    def group_work(self, admitted: list[tuple[int, int]]) -> list[tuple]:
        """Admitted [(group, version)] as [(group, version, problem, seeds)] for a worker."""
        seeds = [[episode_seed(self.cfg.seed, g, i) for i in range(self.n)] for g, _ in admitted]
        return [(g, v, self.train_problem(g), s) for (g, v), s in zip(admitted, seeds)]

    def make_jax_engine(self):
        """An in-process JAX sampler on the learner's current weights (evaluation)."""
        return JaxEngine(
            self.learner.model,
            version=self.learner.version,
            max_batch=self.cfg.rollout.batch_size,
            deadline_s=self.cfg.trainer.deadline_s,
        )

    def make_vllm_engine(self):
        """vLLM hosts serving the learner's current weights, published by the parameter server.

        Launches rollout.vllm.num_hosts servers on this machine, or connects to rollout.vllm.urls
        (which must serve a model of the same shape; they are reloaded to version v at once).
        """
        from rl.param_server import ParamServer
        from rl.rollout.vllm import VLLMEngine, VLLMHost, launch_hosts

        v = self.cfg.rollout.vllm
        self.param_server = ParamServer(
            os.path.join(self.run_dir, "weights"),
            self.learner.model.config,
            tokenizer_dir=self.tok_dir,
            keep=3,
            hf_overrides={
                "eos_token_id": self.tokenizer.eos_id,
                "pad_token_id": self.tokenizer.pad_id,
            },
        )
        version = self.learner.version
        path, _ = self.param_server.write(version, self.learner.params())
        if v.urls:
            hosts = [VLLMHost.connect(u) for u in v.urls]
        else:
            hosts = launch_hosts(
                path,
                [os.path.join(self.run_dir, "logs", f"vllm-{i}.log") for i in range(v.num_hosts)],
                ready_timeout_s=v.ready_timeout_s,
                seed=self.cfg.seed,
                host=v.host,
                enforce_eager=v.enforce_eager,
                extra_args=v.extra_args,
            )
        engine = VLLMEngine(
            hosts,
            version=version,
            update_mode=self.cfg.trainer.partial,
            request_timeout_s=v.request_timeout_s,
            deadline_s=self.cfg.trainer.deadline_s,
            owns_hosts=not v.urls,
        )
        if v.urls:
            engine.update_weights(version, path=path)
        self.param_server.engine_versions["vllm"] = version
        return engine

    def publish(self, engine, version: int, on_served=None, on_error=None) -> float:
        """Moves the rollout engine to the learner's weights at `version`; returns seconds.

        on_served (ProcessEngine, JaxEngine): return once the weights are sent and call
        on_served(version) when the engine serves them (on_error(exc) if it cannot), so the
        learner need not wait while a `drain` finishes the in-flight batch.
        """
        t0 = time.perf_counter()
        if self.cfg.rollout.engine == "vllm" and not self.remote:
            result = self.param_server.publish(
                version, {"vllm": engine}, params=self.learner.params()
            )
            if result.errors:
                raise RuntimeError(
                    f"weight publication of version {version} failed: {result.errors}"
                )
        else:
            extra = {"on_served": on_served, "on_error": on_error} if on_served else {}
            weights = {"ref": self.learner.weights()} if self.remote else {}
            engine.update_weights(
                version,
                params=None if self.remote else self.learner.params(),
                **weights,
                interrupt=self.cfg.trainer.partial == "continue",
                **extra,
            )
        return time.perf_counter() - t0

    # -- supervised warm start ------------------------------------------------------------
    def demo_episode(self, problem) -> Episode:
        """A demonstration as an episode: completion tokens trained, tool responses masked."""
        prompt = self.tokenizer.encode(problem.prompt)
        text = self.task.demonstration(problem)
        comp = self.tokenizer.encode(text) + [self.tokenizer.eos_id]
        mask = np.ones(len(comp), np.int8)
        open_id = close_id = None
        try:
            open_id = self.tokenizer.token_id("<tool_response>")
            close_id = self.tokenizer.token_id("</tool_response>")
        except KeyError:
            pass
        inside = False
        for i, t in enumerate(comp):  # environment text is not the model's to learn
            if t == open_id:
                inside = True
            if inside:
                mask[i] = 0
            if t == close_id:
                inside = False
        n = len(prompt) + len(comp)
        return Episode(
            problem.id,
            np.asarray(prompt + comp, np.int32),
            np.concatenate([np.zeros(len(prompt), np.int8), mask]),
            np.zeros(n, np.float32),
            np.full(n, -1, np.int32),
            len(prompt),
            reward=1.0,
        )

    def supervised(self) -> dict:
        """Runs the supervised warm start (sft.steps steps of demonstrations)."""
        s = self.cfg.sft
        self.learner.set_step_cfg(StepConfig(loss="sft", temperature=1.0))
        if not s.continue_optimizer:
            tx = make_optimizer(
                s.lr, total_steps=s.steps, warmup_steps=s.warmup_steps, schedule=s.schedule
            )
            self.learner.reset_optimizer(tx)
        problems = self.task.problems("train", s.steps * s.batch_size)
        row_len = None
        t0 = time.perf_counter()
        loss = float("nan")
        for step in range(s.steps):
            eps = [
                self.demo_episode(p)
                for p in problems[step * s.batch_size : (step + 1) * s.batch_size]
            ]
            if row_len is None:
                row_len = bucket(max(len(e.tokens) for e in eps) + 8)
            batch = make_batch(eps, np.zeros(len(eps)), row_len=row_len)
            met = self.learner.update(batch)
            loss = met["loss"]
            if step % 25 == 0 or step == s.steps - 1:
                self.sft_curve.append((step, loss))
        self.learner.version = 0
        self.learner.set_step_cfg(self._rl_step_cfg())
        if not s.continue_optimizer:
            self.learner.reset_optimizer(self._rl_tx())
        return {"sft/loss": loss, "sft/time": time.perf_counter() - t0, "sft/steps": s.steps}

    # -- evaluation -----------------------------------------------------------------------
    def evaluate(self, engine) -> dict:
        """Greedy (by default) decoding of the held-out split: accuracy and reward."""
        t0 = time.perf_counter()
        eps = run_episodes(
            engine,
            self.task,
            self.tokenizer,
            self.eval_problems,
            self.sampling(greedy=True),
            seeds=list(range(len(self.eval_problems))),
        )
        return {
            "eval/accuracy": float(np.mean([e.correct for e in eps])),
            "eval/reward": float(np.mean([e.reward for e in eps])),
            "eval/formatted": float(np.mean([e.formatted for e in eps])),
            "eval/length": float(np.mean([e.num_generated for e in eps])),
            "timing/eval": time.perf_counter() - t0,
        }

    # -- rollout side ---------------------------------------------------------------------
    def rollout_worker(self, engine, coord: Coordinator, buffer: GroupBuffer, stats: dict):
        """Admits groups, generates their rollouts, delivers complete groups (a thread)."""
        max_groups = max(1, self.cfg.rollout.batch_size // self.n)
        deadline = self.cfg.trainer.deadline_s
        try:
            while True:
                admitted = coord.admit(max_groups, timeout=deadline)
                if not admitted:
                    return
                problems, seeds = [], []
                for g, _ in admitted:
                    p = self.train_problem(g)
                    problems += [p] * self.n
                    seeds += [episode_seed(self.cfg.seed, g, i) for i in range(self.n)]
                t0 = time.perf_counter()
                eps = run_episodes(
                    engine, self.task, self.tokenizer, problems, self.sampling(), seeds=seeds
                )
                stats["generate_time"] += time.perf_counter() - t0
                stats["tokens"] += sum(e.num_generated for e in eps)
                if coord.stopped:
                    return
                for k, (g, v) in enumerate(admitted):
                    buffer.put(
                        EpisodeGroup(
                            g, problems[k * self.n].id, tuple(eps[k * self.n : (k + 1) * self.n]), v
                        )
                    )
        except BaseException as e:  # noqa: BLE001 - the learner must hear of any failure
            buffer.fail(e)

    # -- the loop -------------------------------------------------------------------------
    def advantages(self, groups: list[EpisodeGroup]) -> np.ndarray:
        """[G, n] advantages of the update's groups by the configured estimator."""
        r = np.stack([g.rewards for g in groups])
        return np.asarray(A.compute_advantages(self.cfg.algorithm.advantage, r))

    def _save(self, step: int, coord: Coordinator, buffer: GroupBuffer, extra: dict) -> None:
        bstate = buffer.state()
        meta = {
            "step": step,
            "version": self.learner.version,
            "next_group": bstate["next_group"],
            "dispatched": coord.state()["next_group"],
            "freed": coord.freed,
            "counts": bstate["counts"],
            "consumed": bstate.get("consumed", []),
            **extra,
        }
        if self.remote:  # the learner actor writes its checkpoint
            self.learner.save(step, meta, bstate["groups"])
        else:
            self.ckpt.save(step, self.learner.state, meta, bstate["groups"])

    def run(self) -> dict:
        """Trains; returns the last logged metrics (with eval/accuracy before and after)."""
        try:
            return self._run()
        finally:
            self.close_ray()  # the ray transport's learner actor, and a cluster it started

    def _run(self) -> dict:
        cfg = self.cfg
        summary: dict = {}
        resumed = self.resume_meta is not None
        if not resumed:
            if cfg.sft.steps > 0:
                summary.update(self.supervised())
            self._save(
                0,
                Coordinator(self.B, self.eta),
                GroupBuffer(Coordinator(self.B, 0)),
                {"sft_done": True},
            )
        if self.core_split is not None and cfg.sft.steps > 0 and not self.remote:
            pin_learner(self.core_split.learner)
        start_version = self.learner.version
        engine = self.make_engine()
        local_vllm = cfg.rollout.engine == "vllm" and not self.remote  # evaluated by JAX
        eval_engine = self.make_jax_engine() if local_vllm else engine
        if not resumed:
            ev = self.evaluate(eval_engine)
            summary["eval/accuracy_start"] = ev["eval/accuracy"]
            self.writer.log(0, 0, {**{k: v for k, v in summary.items()}, **ev})
        meta = self.resume_meta or {"next_group": 0, "dispatched": 0, "freed": 0, "counts": {}}
        total_groups_hint = None
        coord = Coordinator(
            self.B,
            self.eta,
            start_group=meta["next_group"],
            published_version=start_version,
            total_groups=total_groups_hint,
        )
        coord.freed = meta["freed"]
        buffer = GroupBuffer(
            coord,
            stale_policy=cfg.trainer.stale_policy,
            filter_zero_advantage=cfg.algorithm.filter_zero_advantage,
            start_group=meta["next_group"],
        )
        buffer.counts.update(meta.get("counts", {}))
        # Finished groups from the checkpoint come back; what was in flight is dispatched again
        # (never a group already consumed: trained, filtered or dropped).
        buffer.consumed = set(meta.get("consumed", []))
        for g in self.resume_groups.values():
            buffer.groups[g.group_id] = g
        if resumed:
            coord.next_group = max(
                meta["dispatched"], meta["next_group"], max(self.resume_groups, default=-1) + 1
            )
            coord.retry.extend(
                i
                for i in range(meta["next_group"], coord.next_group)
                if i not in self.resume_groups and i not in buffer.consumed
            )
        coord.publish(start_version)
        stats = {"generate_time": 0.0, "tokens": 0}
        if cfg.trainer.transport == "ray":  # one dispatcher thread per rollout worker actor
            from rl.ray_transport import ray_rollout_loop

            max_groups = max(1, cfg.rollout.batch_size // self.n)
            workers = [
                threading.Thread(
                    target=ray_rollout_loop,
                    args=(engine, i, coord, buffer, self.group_work, self.sampling(), stats)
                    + (max_groups, cfg.trainer.deadline_s),
                    name=f"rollout-{i}",
                    daemon=True,
                )
                for i in range(engine.num_workers)
            ]
        else:
            workers = [
                threading.Thread(
                    target=self.rollout_worker,
                    args=(engine, coord, buffer, stats),
                    name="rollout-0",
                    daemon=True,
                )
            ]
        for worker in workers:
            worker.start()
        t_start = time.perf_counter()
        last = {"time": t_start, "tokens": 0, "gen": 0.0, "wait": 0.0}
        wait_total = 0.0
        row_len = cfg.learner.pack_length if cfg.learner.pack else bucket(self._max_len())
        try:
            for version in range(start_version, cfg.trainer.total_updates):
                t0 = time.perf_counter()
                groups = buffer.get_batch(self.B, version, timeout=cfg.trainer.deadline_s)
                t_wait = time.perf_counter() - t0
                wait_total += t_wait
                adv = self.advantages(groups)
                eps = [e for g in groups for e in g.episodes]
                batch = self.rl_batch(eps, adv.reshape(-1), row_len)
                met = self.learner.update(batch, minibatches=cfg.learner.minibatches)
                new_version = self.learner.version
                t_sync = 0.0
                if (
                    new_version % cfg.trainer.sync_every == 0
                    or new_version == cfg.trainer.total_updates
                ):
                    if (
                        isinstance(engine, ProcessEngine)
                        or cfg.trainer.transport == "ray"
                        or self.device_split is not None
                    ):
                        # published when the rollout process (every ray worker, the rollout
                        # devices) serves it: the learner does not wait for a drain
                        t_sync = self.publish(engine, new_version, coord.publish, buffer.fail)
                    else:
                        t_sync = self.publish(engine, new_version)
                        coord.publish(new_version)
                row = self._update_metrics(
                    groups, batch, met, version, t_wait, t_sync, stats, last, buffer, coord
                )
                if hasattr(engine, "metrics"):  # the ray transport's worker and batch counters
                    row.update(engine.metrics())
                if (
                    cfg.trainer.eval_every
                    and new_version % cfg.trainer.eval_every == 0
                    or new_version == cfg.trainer.total_updates
                ):
                    if eval_engine is not engine:
                        eval_engine.update_weights(new_version, params=self.learner.params())
                    row.update(self.evaluate(eval_engine))
                self.writer.log(new_version, new_version, row)
                summary.update(row)
                self._dump_episodes(new_version, groups)
                ce = cfg.trainer.checkpoint_every
                if (ce and new_version % ce == 0) or new_version == cfg.trainer.total_updates:
                    self._save(new_version, coord, buffer, {"sft_done": True})
        finally:
            coord.stop()
            engine.abort()
            for worker in workers:
                worker.join(timeout=60)
            engine.close()
            self.writer.close()
            if not self.remote:
                self.ckpt.close()
        summary["time/total"] = time.perf_counter() - t_start
        summary["eval/accuracy_end"] = summary.get("eval/accuracy")
        return summary

    def rl_batch(self, eps: list[Episode], adv, row_len: int):
        """The update's TrainBatch: one row per episode, or (learner.pack) packed rows.

        Packed, the row count is rounded up to `unit` x a power of two (unit = minibatches x
        micro-batches x data-parallel size, so every split is even): a handful of shapes, so a
        handful of compilations, however the lengths vary.
        """
        if not self.cfg.learner.pack:
            return make_batch(eps, adv, num_rows=self.B * self.n, row_len=row_len)
        longest = max(len(e.tokens) - 1 for e in eps)
        if longest > row_len:
            raise ValueError(
                f"learner.pack_length: invalid value {row_len}; an episode has {longest} "
                f"targets (raise pack_length or lower rollout.max_new_tokens)"
            )
        rows = len(pack_rows([len(e.tokens) - 1 for e in eps], row_len))
        m = self.cfg.learner.mesh
        unit = self.cfg.learner.minibatches * self._rl_step_cfg().micro_batches * m.data * m.fsdp
        num_rows = unit * 2 ** max(0, int(np.ceil(np.log2(-(-rows // unit)))))
        return make_batch(eps, adv, num_rows=num_rows, row_len=row_len, pack=True)

    def _max_len(self) -> int:
        """Longest episode in tokens: prompt + turns x (generation + observation)."""
        prompts = [len(self.tokenizer.encode(p.prompt)) for p in self.eval_problems[:64]]
        turns = getattr(self.task, "max_turns", 1)
        return max(prompts) + 8 + turns * (self.cfg.rollout.max_new_tokens + 32)

    def _update_metrics(
        self, groups, batch, met, version, t_wait, t_sync, stats, last, buffer, coord
    ) -> dict:
        now = time.perf_counter()
        eps = [e for g in groups for e in g.episodes]
        mask = batch.loss_mask > 0
        stale = (version - batch.versions)[mask]
        spans = [e.version_span for e in eps]
        row = {f"loss/{k}": v for k, v in met.items() if not k.startswith("timing/")}
        row.update(
            {
                "reward/mean": float(np.mean([e.reward for e in eps])),
                "reward/correct": float(np.mean([e.correct for e in eps])),
                "reward/formatted": float(np.mean([e.formatted for e in eps])),
                "episode/length": float(np.mean([e.num_generated for e in eps])),
                "episode/turns": float(np.mean([e.num_turns for e in eps])),
                "batch/rows": float(batch.inputs.shape[0]),
                "batch/padding": 1.0 - float(np.mean(batch.segment_ids > 0)),
                "partial/ratio": float(np.mean([s[1] > s[0] for s in spans])),
                "partial/version_span": float(np.mean([s[1] - s[0] for s in spans])),
                "timing/train_step": met["timing/train_step"],
                "timing/wait_data": t_wait,
                "timing/weight_sync": t_sync,
                "timing/update": now - last["time"],
                "idle/learner": t_wait / max(now - last["time"], 1e-9),
            }
        )
        gen = stats["generate_time"] - last["gen"]
        row["idle/rollout"] = max(0.0, 1.0 - gen / max(now - last["time"], 1e-9))
        row["throughput/tokens_per_s"] = (stats["tokens"] - last["tokens"]) / max(
            now - last["time"], 1e-9
        )
        row.update(staleness_metrics(stale))
        row.update(buffer.metrics())
        row["coordinator/redispatched"] = float(coord.redispatched)
        row["staleness/bound"] = float(self.eta)
        last.update(time=now, tokens=stats["tokens"], gen=stats["generate_time"])
        self.writer.log_histogram(version + 1, "staleness/tokens", stale)
        return row

    def _dump_episodes(self, version: int, groups: list[EpisodeGroup]) -> None:
        k = self.cfg.logging.save_episodes
        if not k:
            return
        eps = [(g.group_id, i, e) for g in groups for i, e in enumerate(g.episodes)][:k]
        with open(os.path.join(self.episodes_dir, f"v{version:06d}.jsonl"), "w") as f:
            for gid, i, e in eps:
                f.write(
                    json.dumps(
                        {
                            "group": gid,
                            "index": i,
                            "problem_id": e.problem_id,
                            "prompt": self.tokenizer.decode(e.tokens[: e.prompt_len].tolist()),
                            "completion": e.completion_text,
                            "reward": e.reward,
                            "versions": list(e.version_span),
                            "finish_reason": e.finish_reason,
                        }
                    )
                    + "\n"
                )


def train(cfg: C.RunConfig, *, run_dir: str | None = None, resume: bool = False) -> dict:
    """Runs a whole training job from a config; returns the summary metrics."""
    return Trainer(cfg, run_dir=run_dir, resume=resume).run()


__all__ = ["Trainer", "train", "nnx"]
