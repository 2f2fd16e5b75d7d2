"""Where things run: CPU core pinning and the rollout / learner device split.

On a CPU host two JAX computations in threads of one process barely overlap: each one alone
spreads over every core through XLA's intra-op thread pool. With `trainer.pin_cores` the rollout
engine runs in its own process pinned to `trainer.rollout_cores` and the learner process is
pinned to the other cores (or `trainer.learner_cores`), as separate accelerator pools would be.
XLA sizes its thread pool from the cores the process may use when JAX initialises its backend,
so pin before the first `jax.devices()` where possible. On a host with several accelerators,
`trainer.rollout_devices` / `learner_devices` give the rollout engine devices of its own.
"""

from __future__ import annotations

import dataclasses
import os

from rl import config as C


@dataclasses.dataclass(frozen=True)
class CoreSplit:
    """CPU cores of the rollout process and of the learner process."""

    rollout: tuple[int, ...]
    learner: tuple[int, ...]


# The affinity before this module pinned anything (pin_learner narrows the process's own mask).
_STARTUP_CORES = frozenset(os.sched_getaffinity(0))


def available_cores() -> tuple[int, ...]:
    """The cores this process could use before pinning (its affinity mask at startup)."""
    return tuple(sorted(_STARTUP_CORES | os.sched_getaffinity(0)))


def core_split(
    rollout_cores: list[int] | tuple[int, ...] = (0,),
    learner_cores: list[int] | tuple[int, ...] = (),
    available: tuple[int, ...] | None = None,
) -> CoreSplit:
    """Validated split; empty learner_cores means every available core not given to rollout."""
    available = available if available is not None else available_cores()
    rollout = tuple(sorted(set(rollout_cores)))
    if not rollout:
        raise ValueError("trainer.rollout_cores: empty; give the rollout process at least one core")
    bad = [c for c in rollout if c not in available]
    if bad:
        raise ValueError(
            f"trainer.rollout_cores: cores {bad} are not available to this process; "
            f"available: {list(available)}"
        )
    if learner_cores:
        learner = tuple(sorted(set(learner_cores)))
        bad = [c for c in learner if c not in available]
        if bad:
            raise ValueError(
                f"trainer.learner_cores: cores {bad} are not available to this process; "
                f"available: {list(available)}"
            )
    else:
        learner = tuple(c for c in available if c not in rollout)
    if not learner:
        raise ValueError(
            f"trainer.rollout_cores {list(rollout)} leave no core for the learner "
            f"(available: {list(available)}); pin_cores needs at least 2 cores"
        )
    overlap = sorted(set(rollout) & set(learner))
    if overlap:
        raise ValueError(
            f"trainer.rollout_cores and trainer.learner_cores share cores {overlap}; "
            "the point of pinning is that they do not"
        )
    return CoreSplit(rollout, learner)


def split_of(trainer_section) -> CoreSplit:
    """The core split of a config's trainer section (rollout_cores, learner_cores)."""
    return core_split(
        getattr(trainer_section, "rollout_cores", (0,)),
        getattr(trainer_section, "learner_cores", ()),
    )


def pin_threads(cores: tuple[int, ...] | list[int]) -> None:
    """Pins this process, every thread it already has and every later thread, to `cores`."""
    cores = set(cores)
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no procfs: the calling thread (and threads it starts) only
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
        except (ProcessLookupError, PermissionError):  # a thread that just ended
            pass
    os.sched_setaffinity(0, cores)


def pin_learner(cores: tuple[int, ...] | list[int]) -> None:
    """Pins the learner (this) process to `cores`; call before JAX initialises its backend."""
    pin_threads(cores)


PLACEMENTS = ("process", "in_process", "split")


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the local transport's rollout engine runs, resolved on this host.

    process: a child process (pinned to `cores.rollout` with trainer.pin_cores); in_process: in
    this process on the learner's devices; split: in this process on `split.rollout` devices,
    the learner's mesh on `split.learner`. `config` is the run config with a mesh that fits.
    """

    kind: str
    backend: str
    config: C.RunConfig
    cores: CoreSplit | None = None
    split: DeviceSplit | None = None


def resolve(cfg: C.RunConfig, *, backend: str | None = None, devices=None) -> Placement:
    """trainer.placement on this host's backend and devices (auto: a process of its own on a
    CPU, in process beside one accelerator, a device split with two or more).

    Raises ConfigError naming the key, the backend and what is valid here; runs before any work.
    """
    import jax

    t = cfg.trainer
    # A local learner over several hosts takes a share of every device; the rollout runs on
    # host 0 (this process) beside it, never on a split of its own.
    hosts = cfg.learner.hosts > 1 and t.transport == "local"
    if devices is None:
        devices = jax.local_devices() if hosts else jax.devices()
    devices = list(devices)
    backend = backend or jax.default_backend()
    here = f"the {backend!r} backend with {len(devices)} device(s)"
    valid = ["auto", "in_process"] + (["process"] if backend == "cpu" else [])
    valid += ["split"] if len(devices) >= 2 and not hosts else []
    kind = t.placement
    if kind == "auto":
        if t.rollout_devices:
            kind = "split"
        elif backend == "cpu":
            kind = "process"
        else:
            kind = "split" if len(devices) >= 2 and not hosts else "in_process"
    if cfg.rollout.engine != "jax" or t.transport != "local":
        kind = "in_process"  # vLLM hosts or Ray workers are the rollout; the evaluator is here
    if kind not in valid:
        need = "the CPU backend" if kind == "process" else "at least 2 devices"
        raise C.ConfigError(
            f"trainer.placement: {kind!r} needs {need}; this is {here}. "
            f"Valid here: {', '.join(valid)}"
        )
    if t.pin_cores and backend != "cpu":
        raise C.ConfigError(
            f"trainer.pin_cores: true needs the CPU backend; this is {here}. Valid here: false"
        )
    cores = split_of(t) if t.pin_cores else None
    if kind != "split":
        return Placement(kind, backend, cfg, cores=cores)
    if not t.rollout_devices:  # auto: the first device generates, the rest learn
        t = dataclasses.replace(t, rollout_devices=[0])
    m = cfg.learner.mesh
    n_learner = len(t.learner_devices) or len(devices) - len(t.rollout_devices)
    if (m.data, m.fsdp, m.tensor) == (1, 1, 1) and n_learner > 1:
        m = dataclasses.replace(m, data=n_learner)  # every learner device, data parallel
    learner = dataclasses.replace(cfg.learner, mesh=m)
    cfg = dataclasses.replace(cfg, trainer=t, learner=learner)
    return Placement(kind, backend, cfg, cores=cores, split=device_split(cfg, devices))


@dataclasses.dataclass(frozen=True)
class DeviceSplit:
    """The local transport's devices: the rollout engine's and the learner mesh's (disjoint)."""

    rollout: tuple  # jax.Device
    learner: tuple  # jax.Device


def device_split(cfg: C.RunConfig, devices=None) -> DeviceSplit | None:
    """trainer.rollout_devices / learner_devices resolved on this host; None = no split."""
    import jax

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


def prepare(cfg: C.RunConfig) -> Placement:
    """Pins this process where the config asks (before JAX starts its backend: XLA sizes its
    thread pool then), then resolves the placement. Cheap: run it before any work."""
    t = cfg.trainer
    if t.pin_cores and cfg.sft.steps == 0 and t.transport == "local":
        pin_learner(split_of(t).learner)
    return resolve(cfg)
