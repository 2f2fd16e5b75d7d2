"""Episodes and batches: immutable numpy arrays per token, versions on every generated token."""

from __future__ import annotations

import dataclasses

import numpy as np


def _frozen(a: np.ndarray, dtype) -> np.ndarray:
    a = np.array(a, dtype=dtype, copy=True)
    a.setflags(write=False)
    return a


@dataclasses.dataclass(frozen=True)
class Episode:
    """One rollout: prompt + generated + environment tokens of a (multi-turn) episode.

    All per-token arrays have length L = len(tokens). `loss_mask` is 1 on tokens the policy
    generated (trained), 0 on prompt and environment tokens. `versions[t]` is the policy version
    that generated token t (-1 where not generated); `behavior_logp[t]` its log-prob under the
    sampling distribution (0 where not generated).
    """

    problem_id: str
    tokens: np.ndarray  # int32 [L]
    loss_mask: np.ndarray  # int8 [L]
    behavior_logp: np.ndarray  # float32 [L]
    versions: np.ndarray  # int32 [L]
    prompt_len: int
    reward: float
    correct: bool = False
    formatted: bool = False
    finish_reason: str = "stop"
    num_turns: int = 1
    completion_text: str = ""

    def __post_init__(self):
        n = len(self.tokens)
        object.__setattr__(self, "tokens", _frozen(self.tokens, np.int32))
        object.__setattr__(self, "loss_mask", _frozen(self.loss_mask, np.int8))
        object.__setattr__(self, "behavior_logp", _frozen(self.behavior_logp, np.float32))
        object.__setattr__(self, "versions", _frozen(self.versions, np.int32))
        for name in ("loss_mask", "behavior_logp", "versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"Episode.{name} has length {len(getattr(self, name))}, tokens {n}"
                )

    @property
    def num_generated(self) -> int:
        """Tokens the policy generated (the trained tokens)."""
        return int(self.loss_mask.sum())

    @property
    def version_span(self) -> tuple[int, int]:
        """(min, max) policy version over generated tokens; (-1, -1) if none."""
        v = self.versions[self.loss_mask > 0]
        if v.size == 0:
            return (-1, -1)
        return int(v.min()), int(v.max())


@dataclasses.dataclass(frozen=True)
class EpisodeGroup:
    """All n rollouts of one prompt: the unit of scheduling, advantage and staleness."""

    group_id: int
    problem_id: str
    episodes: tuple[Episode, ...]
    dispatch_version: int  # the published version when the group was admitted
    advantages: np.ndarray | None = None  # float32 [n]

    @property
    def rewards(self) -> np.ndarray:
        """float32 [n] rewards of the group's episodes."""
        return np.array([e.reward for e in self.episodes], np.float32)

    @property
    def min_version(self) -> int:
        """Oldest policy version among the group's generated tokens."""
        spans = [e.version_span[0] for e in self.episodes if e.num_generated]
        return min(spans) if spans else self.dispatch_version


@dataclasses.dataclass(frozen=True)
class TrainBatch:
    """Learner input: [B, T] arrays aligned on targets (targets[b, t] follows inputs[b, :t+1]).

    Packed rows hold several episodes, told apart by segment_ids (0 = padding) with positions
    restarting at 0 per segment. Per-target arrays: loss_mask, behavior_logp, advantages, versions.
    """

    inputs: np.ndarray  # int32 [B, T]
    targets: np.ndarray  # int32 [B, T]
    positions: np.ndarray  # int32 [B, T]
    segment_ids: np.ndarray  # int32 [B, T]
    loss_mask: np.ndarray  # float32 [B, T]
    behavior_logp: np.ndarray  # float32 [B, T]
    advantages: np.ndarray  # float32 [B, T]
    versions: np.ndarray  # int32 [B, T] (-1 where not trained)
    num_sequences: int = 0

    def arrays(self) -> dict[str, np.ndarray]:
        """The per-token arrays as a dict (what the jitted step consumes)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), np.ndarray)
        }
