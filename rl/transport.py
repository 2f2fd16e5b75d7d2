"""How rollout and learner talk: the `local` transport's CPU layout.

`local`: which cores the rollout process and the learner get (on GPUs, which devices: see
trainer.rollout_devices in rl/trainer.py). The `ray` transport (rollout worker actors, episode
batches in the object store, worker health) is in rl/ray_transport.py.

On a CPU host two JAX computations in threads of one process barely overlap: each one alone
spreads over every core through XLA's intra-op thread pool. With `trainer.pin_cores` the
rollout engine runs in its own process pinned to `trainer.rollout_cores` (see
rl/rollout/process_engine.py) and the learner process is pinned to the other cores (or
`trainer.learner_cores`), as separate accelerator pools would be. Sync and async runs use the
same split, so their wall clocks compare like with like. With `trainer.rollout_process` (the
main job's setting) the rollout engine also runs in its own process but unpinned: the OS
interleaves it with the learner on every core. Where the learner is the bottleneck that is the
faster layout (the main job's 40-update recipe on 2 cores: async RL stage 54.4 s shared, 59.7 s
pinned; README "Async against sync"); pinning pays where both sides have work for their cores.

XLA sizes its thread pool from the cores the process may use when JAX initialises its backend
(the first `jax.devices()` or computation); pinning later still moves every thread, but the pool
keeps its size. Without a warm start `Trainer.__init__` pins before its first `jax.devices()`
(covering `python -m launch.train`); with one, the warm start runs first on every core (no
rollout process exists yet) and `Trainer.run` pins the learner before it starts the rollout
process, so the pool's threads share the learner's cores (measured on the main job in async
mode: the whole job 134.6 s -> 120.5 s, the RL stage 58.0 s -> 59.7 s). `python -m launch.bench
async` pins first thing. (XLA's `--xla_cpu_multi_thread_eigen=false` on a pinned
one-core process made no measurable difference here: the pool already has one thread.)
"""

from __future__ import annotations

import dataclasses
import os


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
