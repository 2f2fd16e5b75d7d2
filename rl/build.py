"""From a RunConfig to the run's objects: tokenizer, task, learner, rollout, param server.

The kind of learner and of rollout is chosen here, once: start_learner gives the learner
contract (rl.learner.LearnerHandle) over a learner in this process, the leader of learner hosts
in lockstep, or the Ray learner actors; make_rollout gives the engine contract over this
process's engine (rollout.engine, from rl/engines.py) or the Ray worker pool. What every
learner host builds (model, optimizer, compiled step) is in rl/learner_setup.py.
"""

from __future__ import annotations

import dataclasses
import os
import zlib
from typing import Any

import numpy as np

from rl import config as C
from rl.algorithms.advantages import compute_advantages
from rl.engines import engine_spec
from rl.learner import Learner, LearnerHandle, bucket, train_batch
from rl.learner_setup import make_learner, rl_step_cfg
from rl.placement import Placement, pin_learner
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
    """The local transport's rollout engine (rollout.engine, from the engine registry),
    serving the learner's current weights.

    vLLM hosts (launched here, or rollout.vllm.urls) reload from the parameter server's
    directories; the JAX sampler runs where `place` says (a process of its own, beside the
    learner, or on rollout devices of its own) and compiles what `warm` (warm_spec) says
    before serving. With rollout.batch_invariant the JAX sampler computes every row at fixed
    shapes, its cache `cache_len` positions (row_length).
    """
    return engine_spec(cfg.rollout.engine).local(
        cfg,
        learner,
        place,
        param_server=param_server,
        run_dir=run_dir,
        cache_len=cache_len,
        warm=warm,
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
        gemm_autotune=cfg.trainer.gemm_autotune,
    )


def start_learner(
    cfg: C.RunConfig, vocab_size: int, run_dir: str, place: Placement
) -> LearnerHandle:
    """The run's learner (LearnerHandle): Ray learner actors (trainer.transport ray; this process
    holds no model), this process leading the other hosts of a lockstep learner (learner.hosts
    > 1, rl/lockstep.py), or a Learner on this host's devices (or trainer.learner_devices)."""
    if cfg.trainer.transport == "ray":
        from rl.ray.learner import remote_learner

        return remote_learner(cfg, run_dir, vocab_size, place.cores.learner if place.cores else ())
    if cfg.learner.hosts > 1:
        from rl import lockstep

        return lockstep.lead(cfg, vocab_size, run_dir)
    import jax

    devices = place.split.learner if place.split else jax.devices()
    return make_learner(cfg, vocab_size, devices, run_dir)[1]


@dataclasses.dataclass
class Rollout:
    """What generates the run's episodes (make_rollout)."""

    slots: Any  # the dispatch slots groups run on (rl.dispatch.LocalRollout, or the worker pool)
    engine: Any  # the engine contract the learner's weights are published to
    evaluator: Any  # the engine held-out evaluation runs on
    param_server: Any = None  # writes the HF directories the engine reloads (hf_weights)

    def publish(self, version: int, weights, served, failed) -> None:
        """Starts moving the engine to `weights` at `version` (first published as an HF
        directory when it reloads those); served(version) once it serves them, failed(error)
        if it does not."""
        if self.param_server is not None:
            weights.publish_with(self.param_server, version)

        def done(v: int) -> None:
            served(v)
            if self.param_server is not None:  # retention keeps the directory it serves
                self.param_server.served("engine", v)

        self.engine.update_weights(version, weights).then(done, failed)


def make_rollout(
    cfg: C.RunConfig, learner, place: Placement, task, tokenizer, tok_dir: str, run_dir: str,
    eval_problems,
) -> Rollout:  # fmt: skip
    """The run's rollout on the learner's current weights: the Ray worker pool (trainer.transport
    ray), or rollout.engine in this process (dispatch streams over one engine; beside vLLM
    hosts, an in-process JAX sampler evaluates). A JAX sampler compiles what rollout.warm asks
    before serving. This process (the learner's) moves to its trainer.pin_cores share after the
    warm start, before a rollout process starts."""
    warm = None  # what the JAX sampler compiles before serving (rollout.warm)
    if cfg.rollout.warm:
        warm = warm_spec(cfg, task, tokenizer, eval_problems)
    if cfg.trainer.transport == "ray":
        from rl.ray.pool import worker_pool

        pool = worker_pool(
            cfg,
            learner.weights(),
            learner.config,
            version=learner.version,
            run_dir=run_dir,
            tokenizer_dir=tok_dir,
            tokenizer=tokenizer,
            cores=place.cores.rollout if place.cores else (),
            warm=warm,
        )
        return Rollout(pool, pool, pool)
    from rl.dispatch import LocalRollout

    if place.cores and cfg.sft.steps > 0:
        pin_learner(place.cores.learner)  # with no warm start, placement.prepare pinned it
    param_server = None
    if engine_spec(cfg.rollout.engine).hf_weights:
        param_server = make_param_server(cfg, learner.config, run_dir, tok_dir, tokenizer)
    engine = make_engine(
        cfg,
        learner,
        place,
        param_server=param_server,
        run_dir=run_dir,
        cache_len=row_length(cfg, task, tokenizer, eval_problems),
        warm=warm,
    )
    evaluator = engine
    if param_server is not None:  # greedy: no top-k / top-p programs
        evaluator = make_eval_engine(
            cfg, learner, warm and dataclasses.replace(warm, truncate=False)
        )
    slots = LocalRollout(engine, task, tokenizer, streams(cfg))
    return Rollout(slots, engine, evaluator, param_server)
