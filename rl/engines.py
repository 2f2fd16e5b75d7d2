"""Rollout engines by name: how each is built in the trainer's process and in a Ray worker.

`register_engine` adds one from any module (the run's `imports` load the user's), so a new
engine needs no edit to rl/build.py, the trainer or the Ray worker; the config's rollout.engine
is checked against the registry. Every engine follows the contract of rl/rollout/base.py. The
built-in ones, `jax` (the JAX sampler) and `vllm` (vLLM hosts), import what they build lazily,
so the registry stays light for the config.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """How rollout engine `name` is built.

    local(cfg, learner, place, *, param_server, run_dir, cache_len, warm) -> engine: the local
      transport's engine, serving the learner's current weights (rl/build.py make_engine).
    worker(name, model_config, weights, version, options, log_path) -> (engine, hosts): the
      engine of a Ray rollout worker, on `weights` (flat numpy params; the published HF
      directory when hf_weights); hosts are server processes it launched (health checks
      watch them).
    worker_options(cfg, warm) -> dict: what the worker pool sends each worker for `worker`.
    hf_weights: the engine reloads from the HF directories a parameter server publishes.
    """

    name: str
    local: Callable[..., Any]
    worker: Callable[..., tuple[Any, list]]
    worker_options: Callable[..., dict]
    hf_weights: bool = False


ENGINES: dict[str, EngineSpec] = {}


def register_engine(
    name: str,
    *,
    local: Callable[..., Any],
    worker: Callable[..., tuple[Any, list]],
    worker_options: Callable[..., dict],
    hf_weights: bool = False,
) -> EngineSpec:
    """Registers rollout engine `name` (see EngineSpec); a taken name is an error."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_engine: name must be a non-empty string, got {name!r}")
    if name in ENGINES:
        raise ValueError(f"register_engine: engine {name!r} is already registered")
    spec = EngineSpec(name, local, worker, worker_options, hf_weights)
    ENGINES[name] = spec
    return spec


def engine_spec(name: str) -> EngineSpec:
    """The registered engine `name`; an unknown name is an error listing the valid ones."""
    if name not in ENGINES:
        raise ValueError(f"unknown rollout engine {name!r}; valid: {', '.join(ENGINES)}")
    return ENGINES[name]


# ---------------------------------------------------------------------------------------------
# jax: the JAX sampler (continuous batching), in this process, a process of its own, or a worker


def jax_local(cfg, learner, place, *, param_server=None, run_dir="", cache_len=None, warm=None):
    """The JAX sampler where `place` says: a process of its own, beside the learner, or on
    rollout devices of its own; it compiles what `warm` says before serving, and with
    rollout.batch_invariant computes every row at fixed shapes, its cache `cache_len` long."""
    t = cfg.trainer
    options = dict(
        version=learner.version,
        max_batch=cfg.rollout.batch_size,
        deadline_s=t.deadline_s,
        update_mode=t.partial,
        warm=warm,
        gemm_autotune=t.gemm_autotune,
    )
    if cfg.rollout.batch_invariant:
        options["cache_len"] = cache_len
    if place.kind == "process":
        from rl.rollout.process_engine import ProcessEngine

        cores = place.cores.rollout if place.cores else ()
        return ProcessEngine(
            learner.model,
            cores=cores,
            max_restarts=t.max_rollout_restarts,
            hang_s=t.rollout_hang_s,
            **options,
        )
    from rl.rollout.jax_engine import JaxEngine

    split = place.split
    return JaxEngine(
        learner.model,
        devices=split.rollout if split else None,
        background_install=split is not None,
        **options,
    )


def jax_worker(name: str, model_config, weights, version: int, options: dict, log_path: str):
    """A JAX sampler on this worker's first device, on flat numpy params from the object store."""
    import jax
    from flax import nnx

    from models.params import abstract_params, fill_params
    from rl.rollout.jax_engine import JaxEngine

    graphdef, template = abstract_params(model_config)
    device = jax.devices()[0]
    params = jax.tree.map(lambda x: jax.device_put(x, device), fill_params(template, weights))
    return JaxEngine(nnx.merge(graphdef, params), version=version, **options), []


def jax_worker_options(cfg, warm=None) -> dict:
    """JaxEngine keywords of a Ray worker's sampler."""
    return {
        "max_batch": cfg.rollout.batch_size,
        "deadline_s": cfg.trainer.deadline_s,
        "update_mode": cfg.trainer.partial,
        "warm": warm,
        "gemm_autotune": cfg.trainer.gemm_autotune,
    }


# ---------------------------------------------------------------------------------------------
# vllm: vLLM hosts reloading the parameter server's HF directories


def vllm_launch_options(cfg) -> dict:
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


def vllm_engine_options(cfg) -> dict:
    """How the run drives vLLM servers (VLLMEngine keywords)."""
    return {
        "update_mode": cfg.trainer.partial,
        "request_timeout_s": cfg.rollout.vllm.request_timeout_s,
        "deadline_s": cfg.trainer.deadline_s,
    }


def vllm_local(cfg, learner, place, *, param_server=None, run_dir="", cache_len=None, warm=None):
    """vLLM hosts serving the learner's weights as `param_server` published them: the user's
    (rollout.vllm.urls, reloaded at once) or launched here."""
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


def vllm_worker(name: str, model_config, path: str, version: int, options: dict, log_path: str):
    """A VLLMEngine over options['num_hosts'] vLLM servers launched on this worker's node,
    serving the published directory `path`. The servers die with the worker
    (PR_SET_PDEATHSIG): a killed worker leaves no orphan. With weight_sync 'direct' the
    parameter server sends flat params, which this worker streams to its hosts (shared memory:
    they are on its node); the directories it gets are what it starts on."""
    import tempfile

    from rl.rollout.vllm import launch_engine

    log_dir = os.path.dirname(log_path) if log_path else tempfile.gettempdir()
    logs = [os.path.join(log_dir, f"{name}-vllm-{i}.log") for i in range(options["num_hosts"])]
    engine_options = dict(options["engine"])
    direct = options.get("direct")
    if direct is not None:
        from models.params import abstract_params
        from rl.rollout.weight_stream import WeightStreamer

        template = abstract_params(model_config)[1]
        engine_options["streamer"] = WeightStreamer(
            direct["dtype"], delta=direct["delta"], template=template
        )
    engine = launch_engine(
        path,
        logs,
        version=version,
        launch=options["launch"],
        engine=engine_options,
        die_with_parent=True,
    )
    return engine, engine.hosts


def vllm_worker_options(cfg, warm=None) -> dict:
    """What each Ray worker launches: hosts per worker, their launch and client options."""
    v = cfg.rollout.vllm
    return {
        "num_hosts": v.num_hosts,
        "launch": vllm_launch_options(cfg),
        "engine": vllm_engine_options(cfg),
        "direct": {"dtype": v.dtype, "delta": v.delta} if v.weight_sync == "direct" else None,
    }


register_engine("jax", local=jax_local, worker=jax_worker, worker_options=jax_worker_options)
register_engine(
    "vllm",
    local=vllm_local,
    worker=vllm_worker,
    worker_options=vllm_worker_options,
    hf_weights=True,
)
