"""Typed run configuration: YAML -> validated dataclasses, `--set a.b=c` overrides."""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, Literal

import yaml

from rl.config_rules import ConfigError, check


def F(
    default: Any,
    help: str,  # noqa: A002 - `help` reads best in schemas
    *,
    choices: Callable[[], Sequence[str]] | None = None,
    registry: str = "",
    **kw,
) -> Any:
    """A schema field with a default and a one-line meaning (used by the config reference).

    choices: for a `str` field named from a registry, a function returning the registry's
    current names; the value is checked against them at load time (so a name registered by
    a module imported before the config is loaded is valid) and the config reference lists
    them. registry: the function that registers names, quoted in the error.
    """
    metadata = {"help": help}
    if choices is not None:
        metadata.update(choices=choices, registry=registry)
    if isinstance(default, (list, dict)):
        return dataclasses.field(
            default_factory=lambda d=default: type(d)(d), metadata=metadata, **kw
        )
    return dataclasses.field(default=default, metadata=metadata, **kw)


def sub(cls: type, help: str) -> Any:  # noqa: A002
    """A nested section field."""
    return dataclasses.field(default_factory=cls, metadata={"help": help})


# ---------------------------------------------------------------------------------------------
# Registries: the single source of the names of tasks, engines, advantage estimators and losses.
# Imported when first needed, so `import rl.config` stays free of JAX.


def task_names() -> tuple[str, ...]:
    """Registered tasks (rl.tasks.TASKS), in registration order."""
    from rl.tasks import TASKS

    return tuple(TASKS)


def advantage_names() -> tuple[str, ...]:
    """Registered advantage estimators (rl.algorithms.ADVANTAGES), in registration order."""
    from rl.algorithms.advantages import ADVANTAGES

    return tuple(ADVANTAGES)


def engine_names() -> tuple[str, ...]:
    """Registered rollout engines (rl.engines.ENGINES), in registration order."""
    from rl.engines import ENGINES

    return tuple(ENGINES)


def loss_names() -> tuple[str, ...]:
    """Registered RL policy losses (supervised ones excluded), in registration order."""
    from rl.algorithms.losses import policy_losses

    return policy_losses()


# ---------------------------------------------------------------------------------------------
# Schemas


@dataclasses.dataclass
class ModelSection:
    init: Literal["preset", "hf"] = F("preset", "where the initial weights come from")
    preset: Literal["tiny", "qwen2_0p5b", "qwen2_1p5b"] = F(
        "tiny", "model shape when init=preset (random init, then the supervised warm start)"
    )
    path: str = F("", "local Hugging Face directory when init=hf (weights, config, tokenizer)")
    tokenizer: str = F(
        "",
        "init=hf: a directory whose tokenizer (tokenizer.json, its config and chat template) the "
        "run uses instead of model.path's",
    )
    dtype: Literal["float32", "bfloat16"] = F("float32", "compute dtype")
    param_dtype: Literal["float32", "bfloat16"] = F("float32", "parameter dtype")
    attention_impl: Literal["xla", "cudnn"] = F("xla", "dot_product_attention implementation")
    remat: Literal["none", "full", "dots_saveable"] = F(
        "none", "rematerialisation policy per layer"
    )
    matmul_precision: Literal["auto", "highest", "high", "default"] = F(
        "auto",
        "matmul precision of learner, sampler and log-probs: auto = highest (true float32) for "
        "float32 compute, the backend's fast path (default: TF32 on GPUs) for bfloat16",
    )
    overrides: dict[str, Any] = F(
        {}, "shape fields replacing the preset's (e.g. {hidden_size: 256, num_hidden_layers: 4})"
    )


@dataclasses.dataclass
class TaskSection:
    name: str = F(
        "arithmetic",
        "task to train on (dataset: the user's JSONL / Parquet files, docs/data.md; longtail: "
        "synthetic long-tailed lengths, for benchmarks)",
        choices=task_names,
        registry="rl.tasks.register_task",
    )
    seed: int = F(0, "seed of the task's problem generator (train/eval splits are disjoint)")
    num_eval: int = F(256, "held-out problems evaluated every eval_every updates")
    eval_samples: int = F(
        0,
        "k: at the start and the end, also k sampled completions (rollout.temperature) of each "
        "held-out problem: eval/pass@1, eval/pass@k, eval/maj@k; 0 = off",
    )
    options: dict[str, Any] = F({}, "task-specific keyword arguments (e.g. digits for arithmetic)")
    chat: bool | Literal["auto"] = F(
        "auto",
        "render prompts with the tokenizer's chat template (a plain prompt as one user message): "
        "true, false, or auto = whenever the tokenizer has one, except the character tokenizer "
        "of presets",
    )
    system_prompt: str = F("", "with chat rendering: a system message put before each prompt")


@dataclasses.dataclass
class SFTSection:
    steps: int = F(150, "supervised warm-start steps before RL (0 = none)")
    batch_size: int = F(128, "demonstrations per supervised step")
    lr: float = F(1e-3, "supervised learning rate (AdamW after warmup)")
    warmup_steps: int = F(10, "supervised warmup steps")
    schedule: Literal["constant", "cosine"] = F(
        "constant",
        "supervised schedule after warmup (cosine decay leaves a sharp minimum that RL steps "
        "fall out of)",
    )
    continue_optimizer: bool = F(
        False, "RL keeps the warm start's optimizer moments (one optimizer for both stages)"
    )
    target_accuracy: float = F(
        0.0,
        "end the warm start once greedy accuracy on training problems reaches this (checked "
        "every check_every steps; steps is then the cap); 0 = run all steps",
    )
    check_every: int = F(10, "warm-start steps between target_accuracy checks")
    probe_size: int = F(256, "training problems decoded by each target_accuracy check")


@dataclasses.dataclass
class VLLMSection:
    urls: list[str] = F([], "existing vLLM servers to use; empty = launch num_hosts locally")
    num_hosts: int = F(
        1, "vLLM servers to launch on this machine when urls is empty (ray: per rollout worker)"
    )
    host: str = F("127.0.0.1", "bind address of launched servers")
    enforce_eager: bool = F(True, "launch with --enforce-eager (faster start on CPU)")
    ready_timeout_s: float = F(300.0, "deadline for a launched server to become healthy")
    request_timeout_s: float = F(120.0, "deadline for one generation request")
    extra_args: list[str] = F([], "extra command-line arguments for launched servers")
    dtype: Literal["float32", "bfloat16"] = F(
        "float32", "serving dtype of launched servers, and of weights streamed to any server"
    )
    weight_sync: Literal["disk", "direct"] = F(
        "disk",
        "how new weights reach the hosts: reload from the published HF directory, or streamed "
        "to the workers (shared memory / socket) with the directory written after (docs/vllm.md)",
    )
    delta: bool = F(False, "weight_sync=direct: send only the elements that changed, where smaller")


@dataclasses.dataclass
class RolloutSection:
    engine: str = F(
        "jax", "rollout engine", choices=engine_names, registry="rl.engines.register_engine"
    )
    group_size: int = F(8, "samples per prompt (one GRPO group)")
    prompts_per_update: int = F(32, "groups consumed by one optimizer update")
    max_new_tokens: int = F(16, "generation budget per turn")
    temperature: float = F(1.0, "sampling temperature (the learner evaluates at the same one)")
    top_k: int = F(0, "top-k sampling, 0 = off")
    top_p: float = F(1.0, "nucleus sampling, 1.0 = off")
    eval_temperature: float = F(0.0, "temperature of held-out evaluation (0 = greedy)")
    batch_size: int = F(128, "max sequences the JAX sampler decodes at once (its slots)")
    batch_invariant: bool = F(
        False,
        "the JAX sampler computes every row at fixed shapes (batch_size slots, a cache of the "
        "learner's row length, prompts prefilled alone), so log-probs do not depend on the batch "
        "(slower); what `launch.train --replay` needs to reproduce a run bit for bit",
    )
    warm: bool = F(
        True,
        "the JAX sampler compiles, before the first update, every program its fixed slots (an "
        "accelerator's, or batch_invariant) serve for the run's prompt and generation lengths, "
        "so that none compiles while it serves (a longer start); false: each compiles when "
        "first needed",
    )
    streams: int = F(
        0,
        "groups generating at once on the local engine, each its own admit -> generate -> "
        "deliver loop; 0 = auto: twice the groups rollout.batch_size holds, so a slot freed "
        "while its group waits for a long episode refills at once; 1 = one batch at a time",
    )
    vllm: VLLMSection = sub(VLLMSection, "vLLM hosts (rollout.engine=vllm)")


@dataclasses.dataclass
class AlgorithmSection:
    advantage: str = F(
        "grpo",
        "advantage estimator",
        choices=advantage_names,
        registry="rl.algorithms.register_advantage",
    )
    loss: str = F(
        "ppo_clip", "policy loss", choices=loss_names, registry="rl.algorithms.register_loss"
    )
    clip_eps: float = F(0.2, "PPO clip range (low side, and high side unless clip_eps_high)")
    clip_eps_high: float | None = F(
        None, "high-side clip range (DAPO clip-higher); null = clip_eps"
    )
    dual_clip_c: float | None = F(None, "dual-clip constant for negative advantages; null = off")
    is_correction: Literal["none", "tis_token", "tis_seq", "mis_token", "mis_seq"] = F(
        "none", "behavior/proximal importance correction (truncated or masked, token or sequence)"
    )
    is_cap: float = F(2.0, "cap of the importance correction")
    decoupled_cap: float | None = F(
        5.0, "truncation of decoupled PPO's behavior weight; null = off"
    )
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = F(
        "token_mean", "how per-token losses are reduced"
    )
    loss_norm_const: float = F(16.0, "constant normaliser for seq_mean_token_sum_norm")
    kl_coef: float = F(0.0, "KL-to-reference coefficient (k3 estimator); 0 = off")
    filter_zero_advantage: bool = F(True, "drop (and count) groups whose advantages are all zero")


@dataclasses.dataclass
class OptimSection:
    lr: float = F(3e-4, "peak learning rate of the RL stage")
    schedule: Literal["constant", "cosine"] = F("constant", "learning-rate schedule after warmup")
    warmup_steps: int = F(0, "linear warmup updates")
    weight_decay: float = F(0.0, "AdamW weight decay")
    b1: float = F(0.9, "Adam beta1")
    b2: float = F(0.99, "Adam beta2")
    eps: float = F(1e-8, "Adam epsilon")
    max_grad_norm: float = F(1.0, "global-norm gradient clipping; 0 = off")


@dataclasses.dataclass
class MeshSection:
    data: int = F(1, "data-parallel mesh axis size")
    fsdp: int = F(1, "fully-sharded data-parallel axis size")
    tensor: int = F(1, "tensor-parallel axis size")


@dataclasses.dataclass
class LearnerSection:
    mesh: MeshSection = sub(MeshSection, "learner device mesh")
    micro_batch_size: int = F(
        0, "sequences per micro-batch (gradient accumulation); 0 = whole batch"
    )
    pack: bool = F(False, "pack sequences into rows of pack_length tokens with segment ids")
    pack_length: int = F(256, "row length of packed batches")
    minibatches: int = F(1, "optimizer steps per consumed batch (PPO minibatches)")
    logprob_chunk: int = F(0, "vocab chunk of the log-prob computation; 0 = full vocab at once")
    hosts: int = F(
        1,
        "learner processes (one per host, jax.distributed), each giving learner.mesh an equal "
        "share of its devices; > 1 with trainer.transport ray: one learner actor per host; with "
        "local: the same command runs on every host (process 0 trains, the others follow its "
        "learner calls; coordinator from JAX_COORDINATOR_ADDRESS etc. or SLURM / TPU; "
        "docs/clusters.md)",
    )


@dataclasses.dataclass
class RaySection:
    address: str = F("", "Ray cluster to join ('auto' or host:port); empty = start a local one")
    num_workers: int = F(1, "rollout worker actors (each a process with its own JAX sampler)")
    worker_cpus: float = F(1.0, "CPUs Ray reserves for each rollout worker actor")
    worker_gpus: float = F(0.0, "GPUs Ray reserves for each rollout worker actor")
    health_deadline_s: float = F(
        30.0,
        "a rollout worker that leaves a health check unanswered this long is replaced; a learner "
        "actor is restarted from the last checkpoint (as one that died)",
    )
    max_restarts: int = F(2, "replacement workers started per run before the run fails")
    max_learner_restarts: int = F(
        2,
        "a dead learner actor is restarted from the last checkpoint this many times per run "
        "before the run fails (updates after that checkpoint are repeated)",
    )
    learner_cpus: float = F(1.0, "CPUs Ray reserves for the learner actor")
    learner_gpus: float = F(0.0, "GPUs Ray reserves for the learner actor (its mesh's devices)")


@dataclasses.dataclass
class AdaptiveSection:
    enabled: bool = F(
        False,
        "set the staleness bound eta online from the drift measured on the updates just trained "
        "(trainer.mode async; trainer.max_staleness is where eta starts); false: eta is fixed",
    )
    floor: int = F(0, "lowest eta the controller sets")
    ceiling: int = F(16, "highest eta the controller sets")
    signal: Literal["kl", "ess", "clip"] = F(
        "kl",
        "the drift read: kl = KL(behaviour || proximal) of the trained tokens (loss/drift_kl), "
        "ess = 1 - the importance weights' normalised effective sample size (loss/drift_ess), "
        "clip = the PPO clip fraction",
    )
    low: float = F(0.005, "drift under this over a window: eta + 1")
    high: float = F(0.02, "drift over this over a window: eta halved")
    window: int = F(4, "updates whose mean drift makes one decision")


@dataclasses.dataclass
class TrainerSection:
    mode: Literal["sync", "one_step_off", "async"] = F(
        "sync", "how generation and training overlap"
    )
    total_updates: int = F(40, "optimizer updates of the RL stage")
    max_staleness: int = F(
        0, "eta: max versions between a token's policy and the update training it"
    )
    adaptive: AdaptiveSection = sub(AdaptiveSection, "adaptive staleness (trainer.mode async)")
    sync_every: int = F(1, "publish weights to the rollout engines every this many updates")
    partial: Literal["drain", "continue", "inflight"] = F(
        "drain",
        "in-flight work at a weight update: drain (finish on the old weights), continue "
        "(resubmit the partials, re-prefilled), inflight (go on under the new weights; JAX engine)",
    )
    stale_policy: Literal["keep", "drop"] = F(
        "keep", "keep finished stale groups, or drop and count"
    )
    transport: Literal["local", "ray"] = F(
        "local", "local: rollout in this process (or one pinned child); ray: rollout worker actors"
    )
    ray: RaySection = sub(RaySection, "rollout worker and learner actors (trainer.transport=ray)")
    pin_cores: bool = F(
        False, "CPU: run rollout and learner in processes pinned to their own cores"
    )
    placement: Literal["auto", "process", "in_process", "split"] = F(
        "auto",
        "where the JAX rollout engine runs: process (CPU: a process of its own; pin_cores pins "
        "it), in_process (beside the learner, on its devices), split (on rollout_devices); "
        "auto: process on a CPU, in_process with one accelerator, split with two or more",
    )
    max_rollout_restarts: int = F(
        2,
        "local transport: replacements of a dead rollout process (placement process) started "
        "per run before the run fails; its groups are dispatched again (ray: ray.max_restarts)",
    )
    rollout_hang_s: float = F(
        60.0,
        "local transport: a rollout process (placement process) that leaves a health check "
        "unanswered this long is hung: it is killed and replaced as a dead one (at most "
        "trainer.deadline_s)",
    )
    rollout_cores: list[int] = F([0], "pin_cores: CPU cores of the rollout process")
    learner_cores: list[int] = F(
        [], "pin_cores: CPU cores of the learner process; empty = every core not for rollout"
    )
    rollout_devices: list[int] = F(
        [],
        "local: devices (jax.devices() indices) of the in-process rollout engine, weights moved "
        "by jax.device_put; empty = no split",
    )
    learner_devices: list[int] = F(
        [],
        "with rollout_devices: devices of the learner's mesh (learner.mesh must use them all); "
        "empty = every device not for rollout",
    )
    eval_every: int = F(
        10, "evaluate on the held-out split every this many updates (0 = start/end)"
    )
    checkpoint_every: int = F(0, "Orbax checkpoint every this many updates (0 = only at the end)")
    keep_checkpoints: int = F(2, "checkpoints retained")
    async_checkpoint: bool = F(
        True, "write checkpoints in the background (the learner waits only for the host copy)"
    )
    deadline_s: float = F(600.0, "longest any wait may block before the run fails with an error")
    preempt_deadline_s: float = F(
        120.0,
        "on SIGTERM / SIGINT: the run checkpoints and exits 0 within this many seconds, "
        "else it exits 1",
    )
    compile_cache: str = F(
        "auto",
        "JAX's persistent compilation cache, shared by the run's processes: auto "
        "($JAX_COMPILATION_CACHE_DIR if set, else ~/.cache/tandem/jax; off, with a warning, "
        "where it cannot be created), off, or a directory",
    )
    gemm_autotune: bool = F(
        False,
        "GPU only: XLA's default GEMMs (Triton kernels, each new matmul shape autotuned on the "
        "device, once per shape with the compile cache); false: cuBLAS without autotuning, "
        "which compiles several times faster (docs/benchmarks.md#start-up-on-one-h100)",
    )


@dataclasses.dataclass
class LoggingSection:
    tensorboard: bool = F(True, "write tensorboardX event files")
    progress: bool = F(True, "console progress bar")
    save_episodes: int = F(4, "episodes per update written to episodes/ for inspection")


@dataclasses.dataclass
class RunConfig:
    imports: list[str] = F(
        [],
        "Python modules imported before the config is checked, so that the tasks, rewards, "
        "losses and advantages they register (register_task, register_reward, ...) are valid "
        "names",
    )
    name: str = F("default", "run name; the run directory is <run_root>/<name>")
    run_root: str = F("runs", "parent directory of run directories")
    seed: int = F(0, "seed of initialisation, sampling and data order")
    model: ModelSection = sub(ModelSection, "policy model")
    task: TaskSection = sub(TaskSection, "task and data")
    sft: SFTSection = sub(SFTSection, "supervised warm start")
    rollout: RolloutSection = sub(RolloutSection, "generation")
    algorithm: AlgorithmSection = sub(AlgorithmSection, "advantages and policy loss")
    optim: OptimSection = sub(OptimSection, "optimizer of the RL stage")
    learner: LearnerSection = sub(LearnerSection, "learner layout")
    trainer: TrainerSection = sub(TrainerSection, "training loop")
    logging: LoggingSection = sub(LoggingSection, "metrics and logs")


# ---------------------------------------------------------------------------------------------
# Validation


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a mapping (section)"
    if origin is not None:
        return str(tp).replace("typing.", "")
    return getattr(tp, "__name__", str(tp))


def _coerce(path: str, value: Any, tp: Any) -> Any:
    """Checks `value` against type `tp`, converting ints to floats; raises ConfigError."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin is Literal:
        if value in args and type(value) is type(next(a for a in args if a == value)):
            return value
        close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"{path}: invalid value {value!r}; valid: {', '.join(map(repr, args))}{hint}"
        )
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(path, value, a)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{path}: expected {_type_name(tp)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping (section), got {value!r}")
        return build_section(tp, value, path)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        return [_coerce(f"{path}[{i}]", v, args[0]) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return {str(k): _coerce(f"{path}.{k}", v, args[1]) for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected bool (true/false), got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected int, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and FLOAT_RE.match(value.strip()):
            return float(value)  # YAML 1.1 reads "1e-3" as a string
        raise ConfigError(f"{path}: expected float, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{path}: expected str, got {value!r}")
    raise TypeError(f"unsupported schema type {tp} at {path}")


def _check_choice(path: str, value: Any, f: dataclasses.Field) -> None:
    """A registry-named field: `value` must be one of the registry's current names."""
    valid = tuple(f.metadata["choices"]())
    if value in valid:
        return
    close = difflib.get_close_matches(str(value), valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    where = f"; names are registered by {f.metadata['registry']}" if f.metadata["registry"] else ""
    raise ConfigError(
        f"{path}: invalid value {value!r}; valid: {', '.join(map(repr, valid))}{hint}{where}"
    )


def build_section(cls: type, data: dict, prefix: str = "") -> Any:
    """A dataclass section from a dict: coerced types; unknown keys, bad values: ConfigError."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    names = list(fields)
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{path}: unknown key{hint} (valid keys: {', '.join(names)})")
        kwargs[key] = _coerce(path, value, hints[key])
    obj = cls(**kwargs)
    for name, f in fields.items():  # defaults included: the registry is the only source
        if "choices" in f.metadata:
            _check_choice(f"{prefix}.{name}" if prefix else name, getattr(obj, name), f)
    return obj


def from_dict(data: dict | None) -> RunConfig:
    """Validates a nested mapping into a RunConfig."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"<root>: expected a mapping of sections, got {data!r}")
    import_modules(data.get("imports", []))
    cfg = build_section(RunConfig, data)
    check(cfg)
    return cfg


def import_modules(names: Any) -> None:
    """Imports the config's `imports` (a user's registrations); ConfigError naming the one that
    fails."""
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"imports: expected a list of module names, got {names!r}")
    import importlib
    import os
    import sys

    if os.getcwd() not in sys.path and "" not in sys.path:  # as `python -m` finds modules
        sys.path.insert(0, os.getcwd())
    for i, name in enumerate(names):
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - any failure of the user's module is reported
            raise ConfigError(
                f"imports[{i}]: cannot import {name!r}: {type(e).__name__}: {e}"
            ) from None


FLOAT_RE = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def parse_scalar(text: str) -> Any:
    """Parses a --set value by YAML rules (1 -> int, 1e-3 -> float, true -> bool, [a] -> list)."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, str) and FLOAT_RE.match(value.strip()):
        return float(value)  # YAML 1.1 reads "1e-3" as a string
    return value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Applies `a.b=c` overrides to a nested mapping (returns a new mapping)."""
    import copy

    data = copy.deepcopy(data or {})
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key.path=value")
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        node = data
        for part in parts[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"{key}: {part!r} is not a section (value {nxt!r})")
            node = nxt
        node[parts[-1]] = parse_scalar(text)
    return data


def load(path: str | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Loads a YAML config file (or the defaults), applies overrides and validates."""
    data: dict = {}
    if path:
        with open(path) as f:
            try:
                data = yaml.safe_load(f) or {}
            except yaml.YAMLError as e:
                raise ConfigError(f"{path}: not valid YAML: {e}") from e
    data = apply_overrides(data, overrides or [])
    try:
        return from_dict(data)
    except ConfigError as e:
        where = f"{path}: " if path else ""
        raise ConfigError(f"{where}{e}") from None


def to_dict(cfg: Any) -> dict:
    """The config as plain nested dicts (for YAML and metrics)."""
    return dataclasses.asdict(cfg)


def dump(cfg: RunConfig, path: str) -> None:
    """Writes the resolved config as YAML."""
    with open(path, "w") as f:
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False)


def reference_rows(cls: type = RunConfig, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, type, default, meaning) for every leaf field of the schema, for the docs."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = f"{prefix}.{f.name}" if prefix else f.name
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows.extend(reference_rows(tp, path))
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        else:
            default = f.default_factory()  # type: ignore[misc]
        if "choices" in f.metadata:  # the registry's names when the reference is generated
            type_name = "one of " + ", ".join(repr(c) for c in f.metadata["choices"]())
        else:
            type_name = _type_name(tp)
        rows.append(
            (
                path,
                type_name,
                yaml.safe_dump(default).strip().removesuffix("...").strip(),
                f.metadata.get("help", ""),
            )
        )
    return rows
