"""From a RunConfig to objects: model, optimizer, compiled step, learner, engines, param server.

The trainer, the Ray learner actor, launch/export.py and the benchmarks build through here, so
one config means one model and one optimizer everywhere.
"""

from __future__ import annotations

import dataclasses
import os
import zlib

import numpy as np
import optax

from models import sharding as msh
from models.config import ModelConfig
from rl import config as C
from rl import distributed
from rl.algorithms import losses as L
from rl.algorithms.advantages import compute_advantages
from rl.checkpoint import Checkpointer
from rl.learner import Learner, StepConfig, bucket, make_optimizer, make_schedule, train_batch
from rl.placement import Placement
from rl.rollout.base import SamplingParams


def episode_seed(run_seed: int, group: int, index: int) -> int:
    """The sampling seed of rollout `index` of group `group` (independent of batching)."""
    return zlib.crc32(f"{run_seed}:{group}:{index}".encode()) & 0x7FFFFFFF


def effective_eta(cfg: C.RunConfig) -> int:
    """The staleness bound of the mode: sync 0, one_step_off 1, async max_staleness."""
    return {"sync": 0, "one_step_off": 1}.get(cfg.trainer.mode, cfg.trainer.max_staleness)


def sampling(cfg: C.RunConfig, greedy: bool = False) -> SamplingParams:
    """Sampling params of rollouts (or of greedy evaluation)."""
    r = cfg.rollout
    return SamplingParams(
        max_new_tokens=r.max_new_tokens,
        temperature=r.eval_temperature if greedy else r.temperature,
        top_k=0 if greedy else r.top_k,
        top_p=1.0 if greedy else r.top_p,
    )


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


def pack_unit(cfg: C.RunConfig) -> int:
    """Packed row counts are multiples of this (minibatches x micro-batches x data shards)."""
    m = cfg.learner.mesh
    return cfg.learner.minibatches * rl_step_cfg(cfg).micro_batches * m.data * m.fsdp


def row_length(cfg: C.RunConfig, task, tokenizer, problems) -> int:
    """The learner's row length: learner.pack_length packed, else the longest episode's bucket
    (prompt + turns x generation + an observation between turns)."""
    if cfg.learner.pack:
        return cfg.learner.pack_length
    return bucket(_last_turn_prompt(cfg, task, tokenizer, problems) + cfg.rollout.max_new_tokens)


def _last_turn_prompt(cfg: C.RunConfig, task, tokenizer, problems) -> int:
    """The longest prompt a turn can have: the first prompt (of the first 64 problems, with a
    margin), then each earlier turn's generation and an observation after it."""
    prompts = [len(tokenizer.encode(p.prompt)) for p in problems[:64]]
    turns = getattr(task, "max_turns", 1)
    return max(prompts) + 8 + (turns - 1) * (cfg.rollout.max_new_tokens + 32)


def warm_spec(cfg: C.RunConfig, task, tokenizer, problems):
    """What the JAX sampler compiles before serving (rollout.engine jax): requests of the
    longest prompt a turn can have and rollout.max_new_tokens new tokens."""
    from rl.rollout.jax_engine import Warm

    r = cfg.rollout
    prompt = _last_turn_prompt(cfg, task, tokenizer, problems)
    return Warm(prompt, r.max_new_tokens, truncate=r.top_k > 0 or r.top_p < 1.0)


def update_batch(cfg: C.RunConfig, groups, *, row_len: int, unit: int):
    """The TrainBatch of one update: the groups' advantages (algorithm.advantage) on every
    token, packed (learner.pack, row counts a multiple of `unit`: pack_unit) or one row per
    episode."""
    adv = np.asarray(
        compute_advantages(cfg.algorithm.advantage, np.stack([g.rewards for g in groups]))
    )
    eps = [e for g in groups for e in g.episodes]
    rows = cfg.rollout.prompts_per_update * cfg.rollout.group_size
    return train_batch(
        eps, adv.reshape(-1), row_len=row_len, pack=cfg.learner.pack, unit=unit, rows=rows
    )


def make_tokenizer(cfg: C.RunConfig, run_dir: str):
    """(tokenizer directory, Tokenizer) of the run, kept in run_dir/tokenizer so that every
    engine, published and exported directory and a resumed run use the same files: the
    checkpoint's own tokenizer with model.init=hf (or model.tokenizer's), the character-level
    task tokenizer for presets. A missing tokenizer, or one with more tokens than the model's
    embedding has rows, is a ConfigError naming the file."""
    from models.hf import TOKENIZER_PATTERNS
    from models.tokenizer import build_task_tokenizer, load_tokenizer

    tok_dir = os.path.join(run_dir, "tokenizer")
    have = os.path.exists(os.path.join(tok_dir, "tokenizer.json"))
    if cfg.model.init != "hf":
        if not have:
            build_task_tokenizer(tok_dir)
        return tok_dir, load_tokenizer(tok_dir)
    model_dir = cfg.model.path
    config_file = os.path.join(model_dir, "config.json")
    if not model_dir or not os.path.isfile(config_file):
        raise C.ConfigError(
            f"model.path: {model_dir!r}: {config_file} does not exist; model.init: hf needs a "
            "local Hugging Face checkpoint directory (config.json, safetensors, tokenizer)"
        )
    source = cfg.model.tokenizer or model_dir
    key = "model.tokenizer" if cfg.model.tokenizer else "model.path"
    try:
        tokenizer = load_tokenizer(source)
    except FileNotFoundError as e:
        raise C.ConfigError(f"{key}: {e}") from None
    import json

    with open(config_file) as f:
        rows = json.load(f).get("vocab_size")
    if not isinstance(rows, int) or tokenizer.vocab_size > rows:
        raise C.ConfigError(
            f"{key}: {os.path.join(source, 'tokenizer.json')} has {tokenizer.vocab_size} tokens, "
            f"more than the model's embedding ({config_file}: vocab_size {rows}); token ids past "
            "the embedding cannot be used: give the checkpoint's own tokenizer"
        )
    if not have:  # the run's own copy, with the checkpoint's generation eos ids
        import fnmatch
        import shutil

        os.makedirs(tok_dir, exist_ok=True)
        patterns = (*TOKENIZER_PATTERNS, "generation_config.json")
        for name in sorted(os.listdir(source)):
            if any(fnmatch.fnmatch(name, p) for p in patterns):
                shutil.copyfile(os.path.join(source, name), os.path.join(tok_dir, name))
        gen = os.path.join(model_dir, "generation_config.json")
        if source != model_dir and os.path.isfile(gen):
            shutil.copyfile(gen, os.path.join(tok_dir, "generation_config.json"))
    return tok_dir, load_tokenizer(tok_dir)


def make_task(cfg: C.RunConfig, tokenizer):
    """The run's task for its tokenizer (rl.tasks.make_task); with a warm start, a task that
    has no demonstrations is a ConfigError now, not after the model is built."""
    from rl.tasks import make_task as make

    task = make(cfg.task, tokenizer, preset=cfg.model.init != "hf", imports=cfg.imports)
    if cfg.sft.steps > 0:
        try:
            task.demonstration(task.problems("train", 1)[0])
        except C.ConfigError:
            task.close()
            raise
    return task


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
    learner = Learner(model, rl_optimizer(cfg), mesh=mesh, step_cfg=rl_step_cfg(cfg))
    ckpt = Checkpointer(
        os.path.join(run_dir, "checkpoints"),
        keep=cfg.trainer.keep_checkpoints,
        async_save=cfg.trainer.async_checkpoint,
    )
    return mesh, learner, ckpt


def restore_learner(learner: Learner, ckpt: Checkpointer, *, partials: bool = False):
    """Loads the newest checkpoint into `learner`: (meta, groups), or None if there is none;
    with partials=True (meta, groups, partial groups)."""
    if ckpt.latest_step() is None:
        return None
    state, meta, groups, parts = ckpt.restore(learner.state, partials=True)
    learner.state = state
    learner.version = meta["version"]
    return (meta, groups, parts) if partials else (meta, groups)


def make_param_server(cfg: C.RunConfig, model_config_, run_dir: str, tok_dir: str, tokenizer):
    """The parameter server writing each version's HF directory under run_dir/weights."""
    from rl.param_server import ParamServer

    return ParamServer(
        os.path.join(run_dir, "weights"),
        model_config_,
        tokenizer_dir=tok_dir,
        keep=3,
        hf_overrides={"eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id},
    )


def vllm_launch_options(cfg: C.RunConfig) -> dict:
    """How the run launches a vLLM server (VLLMHost.launch keywords)."""
    v = cfg.rollout.vllm
    return {
        "ready_timeout_s": v.ready_timeout_s,
        "seed": cfg.seed,
        "host": v.host,
        "enforce_eager": v.enforce_eager,
        "extra_args": list(v.extra_args),
        "dtype": v.dtype,
    }


def vllm_engine_options(cfg: C.RunConfig) -> dict:
    """How the run drives vLLM servers (VLLMEngine keywords)."""
    return {
        "update_mode": cfg.trainer.partial,
        "request_timeout_s": cfg.rollout.vllm.request_timeout_s,
        "deadline_s": cfg.trainer.deadline_s,
    }


def make_engine(
    cfg: C.RunConfig,
    learner: Learner,
    place: Placement,
    *,
    param_server=None,
    run_dir: str = "",
    cache_len: int | None = None,
    warm=None,
):
    """The local transport's rollout engine, serving the learner's current weights.

    vLLM hosts (launched here, or rollout.vllm.urls) reload from the parameter server's
    directories; the JAX sampler runs where `place` says (a process of its own, beside the
    learner, or on rollout devices of its own) and compiles what `warm` (warm_spec) says
    before serving. With rollout.batch_invariant the JAX sampler computes every row at fixed
    shapes, its cache `cache_len` positions (row_length).
    """
    t = cfg.trainer
    common = dict(
        version=learner.version,
        max_batch=cfg.rollout.batch_size,
        deadline_s=t.deadline_s,
        update_mode=t.partial,
    )
    if cfg.rollout.batch_invariant:
        common["cache_len"] = cache_len
    if cfg.rollout.engine == "vllm":
        from rl.rollout.vllm import VLLMEngine, launch_engine

        v = cfg.rollout.vllm
        version = learner.version
        path, _ = param_server.write(version, learner.params())
        options = vllm_engine_options(cfg)
        if v.weight_sync == "direct":  # the directory is written after the hosts serve
            from rl.rollout.weight_stream import WeightStreamer

            options["streamer"] = WeightStreamer(v.dtype, delta=v.delta, record=param_server.write)
        if v.urls:  # servers of the user's: reloaded to this run's weights at once
            engine = VLLMEngine(v.urls, version=version, **options)
            engine.update_weights(version, path).wait()
        else:
            logs = [os.path.join(run_dir, "logs", f"vllm-{i}.log") for i in range(v.num_hosts)]
            engine = launch_engine(
                path,
                logs,
                version=version,
                launch=vllm_launch_options(cfg),
                engine=options,
            )
        param_server.served("engine", version)
        return engine
    common["warm"] = warm
    if place.kind == "process":
        from rl.rollout.process_engine import ProcessEngine

        cores = place.cores.rollout if place.cores else ()
        return ProcessEngine(
            learner.model,
            cores=cores,
            max_restarts=t.max_rollout_restarts,
            hang_s=t.rollout_hang_s,
            **common,
        )
    from rl.rollout.jax_engine import JaxEngine

    split = place.split
    return JaxEngine(
        learner.model,
        devices=split.rollout if split else None,
        background_install=split is not None,
        **common,
    )


def streams(cfg: C.RunConfig) -> int:
    """Dispatcher streams of the local transport (rollout.streams; 0 = auto)."""
    if cfg.rollout.streams:
        return cfg.rollout.streams
    return 2 * max(1, cfg.rollout.batch_size // cfg.rollout.group_size)


def make_eval_engine(cfg: C.RunConfig, learner: Learner, warm=None):
    """An in-process JAX sampler on the learner's weights: the evaluator beside local vLLM
    hosts (the hosts keep serving rollouts)."""
    from rl.rollout.jax_engine import JaxEngine

    return JaxEngine(
        learner.model,
        version=learner.version,
        max_batch=cfg.rollout.batch_size,
        deadline_s=cfg.trainer.deadline_s,
        warm=warm,
    )
