"""What every learner host builds from a RunConfig: model, optimizer, compiled step, and the
Learner with its Checkpointer on this host's devices.

The run's own learner (rl/build.py start_learner), each lockstep follower (rl/lockstep.py), each
Ray learner actor (rl/ray/learner.py), export and the benchmarks build through here, so one
config means one model and one optimizer everywhere.
"""

from __future__ import annotations

import dataclasses
import os

import optax

from models import sharding as msh
from models.config import ModelConfig
from rl import config as C
from rl import distributed
from rl.algorithms import losses as L
from rl.checkpoint import Checkpointer
from rl.learner import Learner, StepConfig, bucket, make_optimizer, make_schedule


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
        matmul_precision=cfg.model.matmul_precision,
    )


_OPTIMIZERS: dict[int, tuple] = {}  # id(tx) -> (tx, name) of the optimizers built below


def _named(tx, name: str):
    """`tx`, noted as the run's optimizer `name` (kept alive, so its id stays its own)."""
    _OPTIMIZERS[id(tx)] = (tx, name)
    return tx


def optimizer_name(tx) -> str | None:
    """'rl' or 'sft' when `tx` is one of the run's optimizers built here, else None (a learner
    host without Ray rebuilds it by name: an optax transformation holds closures, no pickle)."""
    entry = _OPTIMIZERS.get(id(tx))
    return entry[1] if entry is not None and entry[0] is tx else None


def named_optimizer(cfg: C.RunConfig, name: str):
    """The run's optimizer `name` ('rl' or 'sft'), built from cfg."""
    return {"rl": rl_optimizer, "sft": sft_optimizer}[name](cfg)


def rl_optimizer(cfg: C.RunConfig):
    """The optimizer of the run (its state structure is what checkpoints hold).

    With sft.continue_optimizer the warm start and RL share it: the RL stage keeps the warm
    start's Adam moments, so its first steps are not the sign-like steps of a fresh Adam.
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
    tx = make_optimizer(
        sched,
        weight_decay=o.weight_decay,
        b1=o.b1,
        b2=o.b2,
        eps=o.eps,
        max_grad_norm=o.max_grad_norm,
    )
    return _named(tx, "rl")


def sft_optimizer(cfg: C.RunConfig):
    """The warm start's own optimizer (when it does not continue into RL)."""
    s = cfg.sft
    tx = make_optimizer(s.lr, total_steps=s.steps, warmup_steps=s.warmup_steps, schedule=s.schedule)
    return _named(tx, "sft")


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
        needs_proximal=L.needs_proximal(a.loss, a.is_correction),
    )


def build_model(cfg: C.RunConfig, vocab_size: int, mesh):
    """The run's initial policy on `mesh`: a preset at cfg.seed, or a Hugging Face checkpoint."""
    if cfg.model.init == "hf":
        from models import load_hf

        m = cfg.model  # the run's compute settings over the checkpoint's shapes
        return load_hf(
            m.path,
            mesh=mesh,
            dtype=m.dtype,
            param_dtype=m.param_dtype,
            attention_impl=m.attention_impl,
            remat=m.remat,
            matmul_precision=m.matmul_precision,
        )
    return msh.create_model(model_config(cfg, vocab_size), mesh, seed=cfg.seed)


def make_learner(cfg: C.RunConfig, vocab_size: int, devices, run_dir: str):
    """(mesh, Learner, Checkpointer) of the run on `devices` (in process, or in the learner
    actor of the ray transport). With learner.hosts > 1 (after distributed.initialize) the mesh
    takes an equal share of every host's devices instead."""
    import jax

    m = cfg.learner.mesh
    n_dev = m.data * m.fsdp * m.tensor
    if jax.process_count() != cfg.learner.hosts:
        raise C.ConfigError(
            f"learner.hosts: {cfg.learner.hosts}, but this learner has {jax.process_count()} "
            "JAX process(es) (rl.distributed.initialize joins them)"
        )
    if cfg.learner.hosts > 1:
        devices = distributed.process_devices(n_dev // cfg.learner.hosts)
    if n_dev > len(devices):
        raise C.ConfigError(
            f"learner.mesh: {m.data}x{m.fsdp}x{m.tensor} needs {n_dev} devices, "
            f"{len(devices)} available (trainer.learner_devices / trainer.ray.learner_gpus)"
        )
    mesh = msh.make_mesh(m.data, m.fsdp, m.tensor, devices=list(devices)[:n_dev])
    model = build_model(cfg, vocab_size, mesh)
    ckpt = Checkpointer(
        os.path.join(run_dir, "checkpoints"),
        keep=cfg.trainer.keep_checkpoints,
        async_save=cfg.trainer.async_checkpoint,
    )
    learner = Learner(
        model,
        rl_optimizer(cfg),
        mesh=mesh,
        step_cfg=rl_step_cfg(cfg),
        ckpt=ckpt,
        gemm_autotune=cfg.trainer.gemm_autotune,
    )
    return mesh, learner, ckpt
