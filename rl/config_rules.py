"""The run config's cross-field rules: values that are well-typed but impossible together,
each error naming the key, the bad value and what is valid. rl.config.from_dict runs them on
its RunConfig (`cfg` below; not imported here: rl.config imports this module)."""

from __future__ import annotations

import difflib
import os


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type, missing or out of range."""


def check(cfg) -> None:
    """Cross-field rules: values that are well-typed but impossible."""

    def positive(path: str, value: float, allow_zero: bool = False) -> None:
        if value < 0 or (value == 0 and not allow_zero):
            need = ">= 0" if allow_zero else "> 0"
            raise ConfigError(f"{path}: invalid value {value!r}; must be {need}")

    positive("rollout.group_size", cfg.rollout.group_size)
    positive("rollout.prompts_per_update", cfg.rollout.prompts_per_update)
    positive("rollout.max_new_tokens", cfg.rollout.max_new_tokens)
    positive("rollout.temperature", cfg.rollout.temperature)
    positive("rollout.eval_temperature", cfg.rollout.eval_temperature, allow_zero=True)
    positive("rollout.batch_size", cfg.rollout.batch_size)
    positive("rollout.streams", cfg.rollout.streams, allow_zero=True)
    positive("rollout.top_k", cfg.rollout.top_k, allow_zero=True)
    if not 0.0 < cfg.rollout.top_p <= 1.0:
        raise ConfigError(f"rollout.top_p: invalid value {cfg.rollout.top_p!r}; must be in (0, 1]")
    positive("trainer.total_updates", cfg.trainer.total_updates, allow_zero=True)
    positive("trainer.max_staleness", cfg.trainer.max_staleness, allow_zero=True)
    positive("trainer.sync_every", cfg.trainer.sync_every)
    positive("trainer.deadline_s", cfg.trainer.deadline_s)
    positive("trainer.max_rollout_restarts", cfg.trainer.max_rollout_restarts, allow_zero=True)
    positive("trainer.rollout_hang_s", cfg.trainer.rollout_hang_s)
    if cfg.trainer.rollout_hang_s > cfg.trainer.deadline_s:
        raise ConfigError(
            f"trainer.rollout_hang_s: invalid value {cfg.trainer.rollout_hang_s!r}; must be <= "
            f"trainer.deadline_s ({cfg.trainer.deadline_s!r}): a hung rollout process must be "
            "found before the learner's wait for its groups fails the run"
        )
    cache = cfg.trainer.compile_cache
    if not cache or (
        cache not in ("auto", "off") and os.path.exists(cache) and not os.path.isdir(cache)
    ):
        raise ConfigError(
            f"trainer.compile_cache: invalid value {cache!r}; must be auto, off or a directory"
        )
    positive("optim.lr", cfg.optim.lr)
    positive("sft.steps", cfg.sft.steps, allow_zero=True)
    positive("sft.check_every", cfg.sft.check_every)
    positive("sft.probe_size", cfg.sft.probe_size)
    if not 0.0 <= cfg.sft.target_accuracy <= 1.0:
        raise ConfigError(
            f"sft.target_accuracy: invalid value {cfg.sft.target_accuracy!r}; must be in [0, 1] "
            f"(0 = run all sft.steps)"
        )
    if cfg.sft.target_accuracy and (cfg.trainer.transport == "ray" or cfg.learner.hosts > 1):
        raise ConfigError(
            f"sft.target_accuracy: invalid value {cfg.sft.target_accuracy!r} with "
            f"trainer.transport={cfg.trainer.transport!r}, learner.hosts={cfg.learner.hosts}: "
            f"the accuracy probe needs the learner in this process; set sft.target_accuracy: 0"
        )
    if cfg.sft.target_accuracy and cfg.sft.steps and cfg.sft.continue_optimizer:
        raise ConfigError(
            f"sft.continue_optimizer: invalid value True with sft.target_accuracy "
            f"{cfg.sft.target_accuracy!r}: the shared optimizer's schedule turns to the RL lr "
            f"after sft.steps ({cfg.sft.steps}), not where the warm start stops on its target; "
            "valid: false, or sft.target_accuracy: 0"
        )
    positive("algorithm.clip_eps", cfg.algorithm.clip_eps)
    positive("algorithm.is_cap", cfg.algorithm.is_cap)
    positive("learner.minibatches", cfg.learner.minibatches)
    positive("learner.micro_batch_size", cfg.learner.micro_batch_size, allow_zero=True)
    for axis in ("data", "fsdp", "tensor"):
        positive(f"learner.mesh.{axis}", getattr(cfg.learner.mesh, axis))
    _check_hosts(cfg)
    from rl.algorithms.advantages import advantage_spec
    from rl.algorithms.losses import loss_spec, policy_losses

    need = advantage_spec(cfg.algorithm.advantage).min_group_size
    if cfg.rollout.group_size < need:
        raise ConfigError(
            f"rollout.group_size: invalid value {cfg.rollout.group_size}; "
            f"advantage {cfg.algorithm.advantage!r} needs groups of at least {need} samples"
        )
    if cfg.trainer.mode == "sync" and cfg.trainer.max_staleness != 0:
        raise ConfigError(
            f"trainer.max_staleness: invalid value {cfg.trainer.max_staleness} with trainer.mode "
            "'sync' (sync is on-policy, staleness 0); use mode 'async' or 'one_step_off'"
        )
    if cfg.trainer.mode == "one_step_off" and cfg.trainer.max_staleness not in (0, 1):
        raise ConfigError(
            f"trainer.max_staleness: invalid value {cfg.trainer.max_staleness} with trainer.mode "
            "'one_step_off' (valid: 1); use mode 'async' for larger bounds"
        )
    eta = {"sync": 0, "one_step_off": 1}.get(cfg.trainer.mode, cfg.trainer.max_staleness)
    if cfg.trainer.sync_every - 1 > eta:
        raise ConfigError(
            f"trainer.sync_every: invalid value {cfg.trainer.sync_every} with staleness bound "
            f"{eta} (trainer.mode {cfg.trainer.mode!r}): weights published every k updates are "
            f"up to k-1 versions stale, so sync_every must be <= {eta + 1}"
        )
    _check_adaptive(cfg)
    _check_model_overrides(cfg)
    if cfg.model.init == "hf" and not cfg.model.path:
        raise ConfigError("model.path: missing; required when model.init is 'hf'")
    t = cfg.trainer
    if cfg.rollout.batch_invariant and (cfg.rollout.engine != "jax" or t.transport != "local"):
        raise ConfigError(
            "rollout.batch_invariant: true needs rollout.engine 'jax' and trainer.transport "
            f"'local' (the in-run JAX sampler), got engine {cfg.rollout.engine!r}, transport "
            f"{t.transport!r}"
        )
    if t.partial == "inflight" and cfg.rollout.engine != "jax":
        raise ConfigError(
            "trainer.partial: invalid value 'inflight' with rollout.engine "
            f"{cfg.rollout.engine!r}: only the JAX sampler swaps weights under live rows; "
            "valid there: drain, continue"
        )
    if t.pin_cores and cfg.rollout.engine != "jax":
        raise ConfigError(
            "trainer.pin_cores: true needs rollout.engine 'jax' (the rollout process runs the "
            f"JAX sampler), got {cfg.rollout.engine!r}"
        )
    if t.placement in ("process", "split") and cfg.rollout.engine != "jax":
        raise ConfigError(
            f"trainer.placement: {t.placement!r} places the JAX sampler, but rollout.engine is "
            f"{cfg.rollout.engine!r} (its hosts are the rollout); valid: auto, in_process"
        )
    if t.placement in ("process", "split") and t.transport != "local":
        raise ConfigError(
            f"trainer.placement: {t.placement!r} needs trainer.transport 'local' (got "
            f"{t.transport!r}, whose rollout workers are Ray actors); valid: auto, in_process"
        )
    if t.pin_cores and t.placement in ("in_process", "split"):
        raise ConfigError(
            f"trainer.pin_cores: true pins a rollout process, but trainer.placement is "
            f"{t.placement!r}; valid placements with pin_cores: auto, process"
        )
    _check_device_split(cfg)
    positive("trainer.preempt_deadline_s", cfg.trainer.preempt_deadline_s)
    if cfg.trainer.transport == "ray":
        ray = cfg.trainer.ray
        positive("trainer.ray.num_workers", ray.num_workers)
        positive("trainer.ray.worker_cpus", ray.worker_cpus)
        positive("trainer.ray.worker_gpus", ray.worker_gpus, allow_zero=True)
        positive("trainer.ray.health_deadline_s", ray.health_deadline_s)
        positive("trainer.ray.max_restarts", ray.max_restarts, allow_zero=True)
        positive("trainer.ray.max_learner_restarts", ray.max_learner_restarts, allow_zero=True)
        positive("trainer.ray.learner_cpus", ray.learner_cpus, allow_zero=True)
        positive("trainer.ray.learner_gpus", ray.learner_gpus, allow_zero=True)
        if cfg.rollout.engine == "vllm" and cfg.rollout.vllm.urls:
            raise ConfigError(
                f"rollout.vllm.urls: {cfg.rollout.vllm.urls!r} with trainer.transport 'ray'; "
                "ray rollout workers launch their own vLLM hosts (rollout.vllm.num_hosts each): "
                "valid: [] (or trainer.transport 'local' to use running servers)"
            )
    if cfg.learner.micro_batch_size:
        n = cfg.rollout.prompts_per_update * cfg.rollout.group_size // cfg.learner.minibatches
        if n % cfg.learner.micro_batch_size:
            raise ConfigError(
                f"learner.micro_batch_size: invalid value {cfg.learner.micro_batch_size}; must "
                f"divide the minibatch of {n} sequences (prompts_per_update * group_size / "
                "minibatches)"
            )
    a = cfg.algorithm
    spec = loss_spec(a.loss)
    if a.is_correction != "none" and not spec.accepts_is_correction:
        raise ConfigError(
            f"algorithm.is_correction: invalid value {a.is_correction!r} with algorithm.loss "
            f"{a.loss!r}, which takes no importance correction (registered with "
            "accepts_is_correction=False, e.g. it carries its own behaviour weight); valid: 'none'"
        )
    if cfg.learner.pack:
        positive("learner.pack_length", cfg.learner.pack_length)
        if a.aggregation != "token_mean":
            raise ConfigError(
                f"learner.pack: true needs algorithm.aggregation 'token_mean' (a packed row holds "
                f"several sequences), got {a.aggregation!r}; or set learner.pack: false"
            )
        if spec.sequence_level or a.is_correction.endswith("_seq"):
            token = [n for n in policy_losses() if not loss_spec(n).sequence_level]
            kind = " (sequence-level)" if spec.sequence_level else ""
            raise ConfigError(
                f"learner.pack: true needs a token-level loss, got algorithm.loss {a.loss!r}"
                f"{kind} with is_correction {a.is_correction!r}; valid: {' / '.join(token)} "
                "with none or *_token corrections, or learner.pack: false"
            )
    n_seq = cfg.rollout.prompts_per_update * cfg.rollout.group_size
    if n_seq % cfg.learner.minibatches:
        raise ConfigError(
            f"learner.minibatches: invalid value {cfg.learner.minibatches}; must divide "
            f"prompts_per_update * group_size = {n_seq}"
        )


MODEL_OVERRIDES = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rope_theta",
    "rms_norm_eps",
    "tie_word_embeddings",
)


def _check_model_overrides(cfg) -> None:
    """model.overrides: known shape fields, with init=preset only (a checkpoint fixes shapes)."""
    over = cfg.model.overrides
    if over and cfg.model.init != "preset":
        raise ConfigError(
            f"model.overrides: {over!r} needs model.init 'preset' (an HF checkpoint's shapes "
            "are fixed); remove the overrides"
        )
    for key, value in over.items():
        if key not in MODEL_OVERRIDES:
            hint = difflib.get_close_matches(str(key), MODEL_OVERRIDES, n=1)
            raise ConfigError(
                f"model.overrides.{key}: unknown field; valid: {', '.join(MODEL_OVERRIDES)}"
                + (f" (did you mean {hint[0]!r}?)" if hint else "")
            )
        if key == "tie_word_embeddings":
            ok, want = isinstance(value, bool), "a bool"
        elif key in ("rope_theta", "rms_norm_eps"):
            ok, want = _is_number(value) and value > 0, "a positive number"
        else:
            ok, want = _is_number(value) and isinstance(value, int) and value > 0, "a positive int"
        if not ok:
            raise ConfigError(f"model.overrides.{key}: invalid value {value!r}; expected {want}")


def _check_hosts(cfg) -> None:
    """learner.hosts: a positive share of the mesh per host. More than one host: learner actors
    (trainer.transport ray), or the command run on every host (local: rl/lockstep.py, where the
    mesh takes every device, so there is no rollout device split; the coordinator comes from the
    environment, checked when the process joins)."""
    n, m = cfg.learner.hosts, cfg.learner.mesh
    size = m.data * m.fsdp * m.tensor
    if n < 1:
        raise ConfigError(f"learner.hosts: invalid value {n}; must be > 0")
    if size % n:
        raise ConfigError(
            f"learner.hosts: invalid value {n}; must divide the {size} devices of learner.mesh "
            f"{m.data}x{m.fsdp}x{m.tensor} (each host gives the mesh an equal share); valid: "
            f"{', '.join(str(k) for k in range(1, size + 1) if size % k == 0)}"
        )
    t = cfg.trainer
    if n > 1 and t.transport == "local":
        split = [
            (k, v)
            for k, v in (
                ("trainer.placement", "split" if t.placement == "split" else None),
                ("trainer.rollout_devices", t.rollout_devices),
                ("trainer.learner_devices", t.learner_devices),
            )
            if v
        ]
        if split:
            key, value = split[0]
            raise ConfigError(
                f"{key}: {value!r} with learner.hosts {n} and trainer.transport 'local': the "
                "learner's mesh takes a share of every host's devices, none is left to split off "
                "for the rollout; valid: trainer.placement auto, in_process or process (CPU), "
                "no rollout_devices / learner_devices"
            )


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_device_split(cfg) -> None:
    """trainer.rollout_devices / learner_devices: a valid split of one host's devices."""
    t = cfg.trainer
    for key in ("rollout_devices", "learner_devices"):
        ids = getattr(t, key)
        if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
            raise ConfigError(
                f"trainer.{key}: invalid value {ids}; must list distinct device indices >= 0"
            )
    if not t.rollout_devices:
        if t.learner_devices:
            raise ConfigError(
                f"trainer.learner_devices: {t.learner_devices} needs trainer.rollout_devices "
                "(the devices the learner leaves to the rollout engine); set both, or neither"
            )
        return
    both = sorted(set(t.rollout_devices) & set(t.learner_devices))
    if both:
        raise ConfigError(
            f"trainer.learner_devices: {t.learner_devices} overlaps trainer.rollout_devices "
            f"{t.rollout_devices} on {both}; each device is the rollout's or the learner's"
        )
    why = []
    if t.transport != "local":
        why.append(f"trainer.transport 'local' (got {t.transport!r}; ray: trainer.ray.worker_gpus)")
    if cfg.rollout.engine != "jax":
        why.append(f"rollout.engine 'jax' (got {cfg.rollout.engine!r})")
    if t.pin_cores:
        why.append("trainer.pin_cores false (pin_cores splits CPU cores between two processes)")
    if t.placement in ("process", "in_process"):
        why.append(f"trainer.placement 'auto' or 'split' (got {t.placement!r})")
    if why:
        raise ConfigError(
            f"trainer.rollout_devices: {t.rollout_devices} (an in-process rollout engine on its "
            f"own devices) needs {' and '.join(why)}"
        )
    m = cfg.learner.mesh
    n = m.data * m.fsdp * m.tensor
    if t.learner_devices and n != len(t.learner_devices):
        raise ConfigError(
            f"trainer.learner_devices: {t.learner_devices} ({len(t.learner_devices)} devices) "
            f"but learner.mesh {m.data}x{m.fsdp}x{m.tensor} uses {n}; the mesh must use every "
            "learner device (data * fsdp * tensor = their number)"
        )


def _check_adaptive(cfg) -> None:
    """trainer.adaptive: an async run, bounds around the starting eta, a signal the loss
    measures, and a stale policy that never discards what a lowered bound leaves behind."""
    from rl.algorithms import needs_proximal

    t, a = cfg.trainer, cfg.trainer.adaptive
    if not a.enabled:
        return
    if t.mode != "async":
        raise ConfigError(
            f"trainer.adaptive.enabled: invalid value true with trainer.mode {t.mode!r}; "
            "adaptive staleness needs mode 'async'"
        )
    if not 0 <= a.floor <= t.max_staleness <= a.ceiling:
        raise ConfigError(
            f"trainer.max_staleness: invalid value {t.max_staleness} with trainer.adaptive floor "
            f"{a.floor} and ceiling {a.ceiling}; need 0 <= floor <= max_staleness (where eta "
            "starts) <= ceiling"
        )
    if t.sync_every - 1 > a.floor:
        raise ConfigError(
            f"trainer.adaptive.floor: invalid value {a.floor} with trainer.sync_every "
            f"{t.sync_every}; weights published every k updates are up to k-1 versions stale, "
            f"so the floor must be >= {t.sync_every - 1}"
        )
    if not 0 <= a.low < a.high:
        raise ConfigError(
            f"trainer.adaptive.low: invalid value {a.low} with high {a.high}; need 0 <= low < high"
        )
    if a.window < 1:
        raise ConfigError(f"trainer.adaptive.window: invalid value {a.window}; must be >= 1")
    if t.stale_policy != "keep":
        raise ConfigError(
            f"trainer.stale_policy: invalid value {t.stale_policy!r} with trainer.adaptive; "
            "'drop' would discard finished groups a lowered bound leaves behind: use 'keep'"
        )
    al = cfg.algorithm
    if a.signal in ("kl", "ess") and not needs_proximal(al.loss, al.is_correction):
        raise ConfigError(
            f"trainer.adaptive.signal: invalid value {a.signal!r} with algorithm.loss "
            f"{al.loss!r} and is_correction {al.is_correction!r}: the drift needs proximal "
            "log-probs (a loss such as decoupled_ppo, or an is_correction); use signal 'clip'"
        )
