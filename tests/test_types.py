"""The EpisodeGroup codec (rl.types.groups_to_arrays / groups_from_arrays): exact round trips."""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest

from rl.types import Episode, EpisodeGroup, arrays_nbytes, groups_from_arrays, groups_to_arrays

STRINGS = ["", "plain", "ünïcödé ∑ 数学 🧮", "trailing NUL\x00", "\x00", "lone \ud800 surrogate"]


def episode(seed: int, turns: int = 1, **overrides) -> Episode:
    """Every field set to a non-default value; `turns` generated spans separated by env tokens."""
    rng = np.random.default_rng(seed)
    prompt = int(rng.integers(1, 5))
    mask, versions = [0] * prompt, [-1] * prompt
    for t in range(turns):
        if t:  # environment tokens between turns
            k = int(rng.integers(1, 4))
            mask, versions = mask + [0] * k, versions + [-1] * k
        k = int(rng.integers(1, 6))
        mask, versions = mask + [1] * k, versions + [seed + t] * k
    n = len(mask)
    fields = dict(
        problem_id=STRINGS[seed % len(STRINGS)] + f"#{seed}",
        tokens=rng.integers(0, 50_000, n),
        loss_mask=mask,
        behavior_logp=np.where(mask, -rng.random(n), 0.0),
        versions=versions,
        prompt_len=prompt,
        reward=float(rng.normal()),  # a float64 round trip must be exact
        correct=bool(seed % 2),
        formatted=not seed % 3,
        finish_reason=["stop", "length", "abort"][seed % 3],
        num_turns=turns,
        completion_text=STRINGS[(seed + 2) % len(STRINGS)] * (seed % 4),
    )
    # every field of Episode is set here: a field added later fails until the codec carries it
    assert set(fields) == {f.name for f in dataclasses.fields(Episode)}
    fields.update(overrides)
    return Episode(**fields)


def sample_groups() -> list[EpisodeGroup]:
    return [
        EpisodeGroup(7, "p7 ∑", (episode(1, turns=3), episode(2), episode(3, turns=2)), 3),
        EpisodeGroup(
            2,
            STRINGS[2],
            (episode(4, turns=4), episode(5)),
            0,
            advantages=np.array([0.5, -0.5], np.float32),
        ),
        EpisodeGroup(11, "", (), 5),  # no episodes
        EpisodeGroup(
            12,
            "q\x00",
            (
                episode(6, tokens=[], loss_mask=[], behavior_logp=[], versions=[], prompt_len=0),
                episode(7, turns=2),
            ),
            1,
            advantages=np.array([1.25, -3.0], np.float32),
        ),
    ]


def assert_groups_equal(a: list[EpisodeGroup], b: list[EpisodeGroup]) -> None:
    """Equal field by field (every dataclass field), array dtypes included."""
    assert len(a) == len(b)
    for g, h in zip(a, b):
        for f in dataclasses.fields(EpisodeGroup):
            x, y = getattr(g, f.name), getattr(h, f.name)
            if f.name == "episodes":
                assert len(x) == len(y)
                for e, d in zip(x, y):
                    for ef in dataclasses.fields(Episode):
                        u, v = getattr(e, ef.name), getattr(d, ef.name)
                        if isinstance(u, np.ndarray):
                            assert u.dtype == v.dtype, ef.name
                            np.testing.assert_array_equal(u, v, err_msg=ef.name)
                        else:
                            assert type(u) is type(v) and u == v, (ef.name, u, v)
            elif x is None or y is None:
                assert x is None and y is None, f.name
            elif isinstance(x, np.ndarray):
                assert x.dtype == y.dtype, f.name
                np.testing.assert_array_equal(x, y, err_msg=f.name)
            else:
                assert type(x) is type(y) and x == y, (f.name, x, y)


def test_round_trip_exact():
    """Every field, multi-turn episodes, advantages set or not, empty groups and episodes."""
    groups = sample_groups()
    arrays = groups_to_arrays(groups)
    assert all(isinstance(v, np.ndarray) and v.dtype != object for v in arrays.values())
    back = groups_from_arrays(arrays)
    assert_groups_equal(groups, back)
    assert [g.group_id for g in back] == [7, 2, 11, 12]  # order kept
    assert back[0].episodes[0].num_turns == 3 and back[1].advantages.dtype == np.float32
    n_tokens = sum(len(e.tokens) for g in groups for e in g.episodes)
    per_token = sorted(k for k, v in arrays.items() if v.shape == (n_tokens,))
    assert per_token == ["behavior_logp", "loss_mask", "tokens", "versions"]


def test_round_trip_empty():
    arrays = groups_to_arrays([])
    assert groups_from_arrays(arrays) == []
    assert all(v.size == 0 for k, v in arrays.items() if k != "codec_version")


def test_survives_npz_without_pickle():
    """np.savez / np.load(allow_pickle=False): the checkpoint groups file needs no pickle."""
    groups = sample_groups()
    buf = io.BytesIO()
    np.savez(buf, **groups_to_arrays(groups))
    buf.seek(0)
    with np.load(buf, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    assert_groups_equal(groups, groups_from_arrays(arrays))


def test_decoded_groups_own_their_arrays():
    """Decoding copies: changing the arrays afterwards (a reused buffer) changes no episode."""
    groups = sample_groups()
    arrays = groups_to_arrays(groups)
    back = groups_from_arrays(arrays)
    for v in arrays.values():
        v[...] = 0
    assert_groups_equal(groups, back)
    assert not back[0].episodes[0].tokens.flags.writeable


def test_arrays_nbytes():
    arrays = groups_to_arrays(sample_groups())
    assert arrays_nbytes(arrays) == sum(v.nbytes for v in arrays.values()) > 0
    assert arrays_nbytes({**arrays, "note": "not an array"}) == arrays_nbytes(arrays)


def test_rejects_bad_input():
    """Wrong advantages shape on encode; a foreign or truncated dict on decode."""
    g = sample_groups()[1]
    with pytest.raises(ValueError, match="advantages of shape"):
        groups_to_arrays([dataclasses.replace(g, advantages=np.zeros(3, np.float32))])
    arrays = groups_to_arrays(sample_groups())
    with pytest.raises(ValueError, match="codec version"):
        groups_from_arrays({k: v for k, v in arrays.items() if k != "codec_version"})
    with pytest.raises(ValueError, match="inconsistent"):
        groups_from_arrays({**arrays, "tokens": arrays["tokens"][:-1]})
    with pytest.raises(ValueError, match="completion_text"):
        groups_from_arrays({**arrays, "completion_text_utf8": arrays["completion_text_utf8"][1:]})
