"""Episodes and batches: immutable numpy arrays per token, versions on every generated token."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np


def _frozen(a: np.ndarray, dtype) -> np.ndarray:
    a = np.array(a, dtype=dtype, copy=True)
    a.setflags(write=False)
    return a


_SCALAR_TYPES = (
    ("prompt_len", int),
    ("reward", float),
    ("correct", bool),
    ("formatted", bool),
    ("num_turns", int),
)


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
        for name, cast in _SCALAR_TYPES:  # Python scalars (not numpy's): JSON-able, exact codec
            object.__setattr__(self, name, cast(getattr(self, name)))
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


# -- EpisodeGroups to and from flat arrays (checkpoint groups files, Ray's object store) --------
CODEC_VERSION = 1
_TOKEN_ARRAYS = (
    ("tokens", np.int32),
    ("loss_mask", np.int8),
    ("behavior_logp", np.float32),
    ("versions", np.int32),
)
_EPISODE_COLUMNS = (
    ("prompt_len", np.int64),
    ("reward", np.float64),
    ("correct", np.bool_),
    ("formatted", np.bool_),
    ("num_turns", np.int64),
)
_EPISODE_STRINGS = ("problem_id", "finish_reason", "completion_text")


def _encode_strings(arrays: dict, name: str, strings: list[str]) -> None:
    """Strings as their UTF-8 bytes concatenated (uint8) plus each one's byte length (int64):
    variable width, exact (NULs, lone surrogates), and no pickle needed to np.load them."""
    encoded = [s.encode("utf-8", "surrogatepass") for s in strings]
    arrays[f"{name}_utf8"] = np.frombuffer(b"".join(encoded), np.uint8).copy()
    arrays[f"{name}_nbytes"] = np.array([len(b) for b in encoded], np.int64)


def _decode_strings(arrays: Mapping[str, np.ndarray], name: str) -> list[str]:
    data = np.asarray(arrays[f"{name}_utf8"], np.uint8).tobytes()
    ends = np.cumsum(arrays[f"{name}_nbytes"]).tolist()
    if (ends[-1] if ends else 0) != len(data):
        raise ValueError(f"{name}: byte lengths sum to {ends[-1] if ends else 0}, have {len(data)}")
    starts = [0] + ends[:-1]
    return [data[a:b].decode("utf-8", "surrogatepass") for a, b in zip(starts, ends)]


def groups_to_arrays(groups: Sequence[EpisodeGroup]) -> dict[str, np.ndarray]:
    """EpisodeGroups as flat numpy arrays, the one codec of checkpoints and of Ray transfers.

    Per group [G]: group_id, dispatch_version, group_size, has_advantages, problem_id strings.
    Per episode [E]: length, the scalar fields, advantages (0 where a group has none), strings.
    Per token [sum of lengths]: the episodes' token arrays concatenated. Strings travel as UTF-8
    bytes plus byte lengths, never per token; every value is a plain numpy array, so the dict
    goes through np.savez / np.load without pickle. groups_from_arrays inverts it exactly.
    """
    eps = [e for g in groups for e in g.episodes]
    out: dict[str, np.ndarray] = {
        "codec_version": np.array([CODEC_VERSION], np.int64),
        "group_id": np.array([g.group_id for g in groups], np.int64),
        "dispatch_version": np.array([g.dispatch_version for g in groups], np.int64),
        "group_size": np.array([len(g.episodes) for g in groups], np.int64),
        "has_advantages": np.array([g.advantages is not None for g in groups], np.bool_),
        "length": np.array([len(e.tokens) for e in eps], np.int64),
    }
    _encode_strings(out, "group_problem_id", [g.problem_id for g in groups])
    adv = []
    for g in groups:
        n = len(g.episodes)
        if g.advantages is None:
            adv.append(np.zeros(n, np.float32))
        elif np.shape(g.advantages) != (n,):
            raise ValueError(
                f"group {g.group_id}: advantages of shape {np.shape(g.advantages)}, want ({n},)"
            )
        else:
            adv.append(np.asarray(g.advantages, np.float32))
    out["advantages"] = np.concatenate(adv) if adv else np.zeros(0, np.float32)
    for name, dtype in _EPISODE_COLUMNS:
        out[name] = np.array([getattr(e, name) for e in eps], dtype)
    for name in _EPISODE_STRINGS:
        _encode_strings(out, name, [getattr(e, name) for e in eps])
    for name, dtype in _TOKEN_ARRAYS:
        parts = [getattr(e, name) for e in eps]
        out[name] = np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)
    return out


def groups_from_arrays(arrays: Mapping[str, np.ndarray]) -> list[EpisodeGroup]:
    """The EpisodeGroups of a groups_to_arrays dict (arrays are copied: the result owns them)."""
    version = int(np.asarray(arrays.get("codec_version", [-1]))[0])
    if version != CODEC_VERSION:
        raise ValueError(f"episode-group arrays of codec version {version}, want {CODEC_VERSION}")
    lengths = np.asarray(arrays["length"], np.int64)
    sizes = np.asarray(arrays["group_size"], np.int64)
    if int(sizes.sum()) != len(lengths) or int(lengths.sum()) != len(arrays["tokens"]):
        raise ValueError(
            f"inconsistent episode-group arrays: group sizes sum to {int(sizes.sum())} for "
            f"{len(lengths)} episodes, lengths to {int(lengths.sum())} for "
            f"{len(arrays['tokens'])} tokens"
        )
    strings = {name: _decode_strings(arrays, name) for name in _EPISODE_STRINGS}
    # tolist(): Python ints, floats and bools, as Episode's fields hold them
    columns = {name: np.asarray(arrays[name], dtype).tolist() for name, dtype in _EPISODE_COLUMNS}
    ends = np.cumsum(lengths).tolist()
    eps = []
    for i, end in enumerate(ends):
        sl = slice(end - int(lengths[i]), end)
        eps.append(
            Episode(
                **{name: arrays[name][sl] for name, _ in _TOKEN_ARRAYS},
                **{name: values[i] for name, values in columns.items()},
                **{name: values[i] for name, values in strings.items()},
            )
        )
    problem_ids = _decode_strings(arrays, "group_problem_id")
    advantages = np.asarray(arrays["advantages"], np.float32)
    groups, k = [], 0
    for j, gid in enumerate(arrays["group_id"]):
        n = int(sizes[j])
        adv = advantages[k : k + n].copy() if arrays["has_advantages"][j] else None
        groups.append(
            EpisodeGroup(
                int(gid),
                problem_ids[j],
                tuple(eps[k : k + n]),
                int(arrays["dispatch_version"][j]),
                adv,
            )
        )
        k += n
    return groups


def arrays_nbytes(arrays: Mapping[str, np.ndarray]) -> int:
    """Bytes of the numpy arrays of a groups_to_arrays dict."""
    return sum(v.nbytes for v in arrays.values() if isinstance(v, np.ndarray))


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
