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
