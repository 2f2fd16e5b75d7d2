"""In-flight groups stopped by a preemption, kept so a resumed run continues them.

A PartialGroup holds every sample of one dispatched group as the agent loop had it when the
engine aborted: the token ids so far (prompt, generated and environment tokens), their loss
mask, behaviour log-probs and per-token versions, and the agent state (turn, tokens left in the
turn, aborts so far, the seed, whether the sample is done). At resume the agent loop rebuilds
its drafts from them and continues generation after the saved tokens (the `continue` semantics
of partial rollouts), so no generated token is lost and none changes. SavedPartials hands each
saved group to the dispatch once.

The arrays codec reuses rl.types.groups_to_arrays (each sample as an Episode) plus per-sample
columns for the agent state, so a partials file is a plain npz, loaded without pickle.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from rl.types import Episode, EpisodeGroup, groups_from_arrays, groups_to_arrays

# per-sample agent state columns of the codec (the rest is the Episode codec's)
_STATE_COLUMNS = (
    ("partial_seed", np.int64),
    ("partial_turn", np.int64),
    ("partial_turn_budget", np.int64),
    ("partial_aborts", np.int64),
    ("partial_done", np.bool_),
)


@dataclasses.dataclass(frozen=True)
class PartialSample:
    """One sample of a stopped group: its tokens so far and the agent loop's state."""

    seed: int
    tokens: np.ndarray  # int32 [L]: prompt, generated and environment tokens so far
    loss_mask: np.ndarray  # int8 [L]: 1 on generated tokens
    behavior_logp: np.ndarray  # float32 [L]
    versions: np.ndarray  # int32 [L]: -1 where not generated
    prompt_len: int
    turn: int = 0
    turn_budget: int = 0  # tokens left in the current turn
    aborts: int = 0
    done: bool = False
    finish_reason: str = "stop"

    @property
    def num_generated(self) -> int:
        """Generated tokens kept in this sample."""
        return int(np.asarray(self.loss_mask).sum())


@dataclasses.dataclass(frozen=True)
class PartialGroup:
    """Every sample of one group whose generation was stopped before it finished."""

    group_id: int
    problem_id: str
    dispatch_version: int  # the published version when the group was first admitted
    samples: tuple[PartialSample, ...]

    @property
    def num_generated(self) -> int:
        """Generated tokens kept in the group."""
        return sum(s.num_generated for s in self.samples)


def partials_to_arrays(partials: Sequence[PartialGroup]) -> dict[str, np.ndarray]:
    """PartialGroups as flat numpy arrays (partials_from_arrays inverts it exactly)."""
    groups = [
        EpisodeGroup(
            p.group_id,
            p.problem_id,
            tuple(
                Episode(
                    p.problem_id,
                    s.tokens,
                    s.loss_mask,
                    s.behavior_logp,
                    s.versions,
                    s.prompt_len,
                    0.0,
                    finish_reason=s.finish_reason,
                    num_turns=s.turn,
                )
                for s in p.samples
            ),
            p.dispatch_version,
        )
        for p in partials
    ]
    out = groups_to_arrays(groups)
    samples = [s for p in partials for s in p.samples]
    for name, dtype in _STATE_COLUMNS:
        attr = name.removeprefix("partial_")
        out[name] = np.array([getattr(s, attr) for s in samples], dtype)
    return out


def partials_from_arrays(arrays: Mapping[str, np.ndarray]) -> list[PartialGroup]:
    """The PartialGroups of a partials_to_arrays dict."""
    groups = groups_from_arrays(arrays)
    n = sum(len(g.episodes) for g in groups)
    cols = {}
    for name, dtype in _STATE_COLUMNS:
        if name not in arrays or len(arrays[name]) != n:
            raise ValueError(f"partial-group arrays: column {name} missing or not {n} long")
        cols[name.removeprefix("partial_")] = np.asarray(arrays[name], dtype).tolist()
    out, k = [], 0
    for g in groups:
        samples = []
        for e in g.episodes:
            samples.append(
                PartialSample(
                    seed=cols["seed"][k],
                    tokens=e.tokens,
                    loss_mask=e.loss_mask,
                    behavior_logp=e.behavior_logp,
                    versions=e.versions,
                    prompt_len=e.prompt_len,
                    turn=cols["turn"][k],
                    turn_budget=cols["turn_budget"][k],
                    aborts=cols["aborts"][k],
                    done=cols["done"][k],
                    finish_reason=e.finish_reason,
                )
            )
            k += 1
        out.append(PartialGroup(g.group_id, g.problem_id, g.dispatch_version, tuple(samples)))
    return out


def by_id(partials: Iterable[PartialGroup]) -> dict[int, PartialGroup]:
    """{group id: PartialGroup}; a group id twice is an error."""
    out: dict[int, PartialGroup] = {}
    for p in partials:
        if p.group_id in out:
            raise ValueError(f"partial group {p.group_id} appears twice")
        out[p.group_id] = p
    return out


class SavedPartials:
    """A preemption checkpoint's partial groups at resume, each handed out once to be continued;
    those not handed out yet stay saved when the run checkpoints again. Dispatcher threads take
    from it concurrently."""

    def __init__(self, partials: Mapping[int, PartialGroup] | None = None):
        self._left = dict(partials or {})
        self._lock = threading.Lock()

    def take(self, group: int) -> PartialGroup | None:
        """The saved partial of `group` the first time it is asked for, else None."""
        with self._lock:
            return self._left.pop(group, None)

    def left(self) -> dict[int, PartialGroup]:
        """{group: PartialGroup} of the partials not handed out yet."""
        with self._lock:
            return dict(self._left)

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self._left)
