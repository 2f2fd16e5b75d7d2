"""Advantage estimators against independent numpy references (loops over groups in float64,
inputs rounded to float32 first), hand-computed values, jit and errors."""

import math

import jax
import numpy as np
import pytest

from rl.algorithms import ADVANTAGES, compute_advantages, register_advantage

TOL = dict(rtol=1e-6, atol=1e-6)


def _f32(x):
    return np.asarray(x, np.float32).astype(np.float64)


# --------------------------------------------------------------------------------------------
# numpy references: advantages
# --------------------------------------------------------------------------------------------


def ref_advantages(name, r, valid, eps, ddof=0):
    """Reference estimators, one group at a time."""
    G, N = r.shape
    out = np.zeros((G, N))
    centred = {}  # (g, j) -> r - group mean, for reinforce_pp
    for g in range(G):
        idx = [j for j in range(N) if valid[g, j]]
        vals = [float(r[g, j]) for j in idx]
        n = len(vals)
        if n == 0:
            continue
        mu = sum(vals) / n
        for j in idx:
            centred[(g, j)] = float(r[g, j]) - mu
        if name == "grpo":
            sd = math.sqrt(sum((v - mu) ** 2 for v in vals) / max(n - ddof, 1))
            for j in idx:
                out[g, j] = (r[g, j] - mu) / (sd + eps)
        elif name == "dr_grpo":
            for j in idx:
                out[g, j] = r[g, j] - mu
        elif name == "rloo":
            for j in idx:
                others = [float(r[g, k]) for k in idx if k != j]
                out[g, j] = r[g, j] - sum(others) / len(others) if others else 0.0
    if name == "reinforce_pp":
        vals = list(centred.values())
        m = sum(vals) / max(len(vals), 1)
        sd = math.sqrt(sum((v - m) ** 2 for v in vals) / max(len(vals) - ddof, 1))
        for (g, j), v in centred.items():
            out[g, j] = v / (sd + eps)
    return out


# --------------------------------------------------------------------------------------------
# advantages
# --------------------------------------------------------------------------------------------


def _rewards():
    rng = np.random.default_rng(0)
    r = _f32(rng.normal(size=(6, 5)))
    r[1] = 0.7  # constant group: no signal
    r[2, :2] = [1.0, 0.0]  # a 0/1 group
    valid = np.ones((6, 5), bool)
    valid[2, 2:] = False  # group of 2
    valid[3, 1:] = False  # group of 1: no baseline
    valid[4, :] = False  # empty group
    valid[5, 3] = False  # hole
    r[~valid] = np.nan  # invalid slots must never be read
    return r, valid


@pytest.mark.parametrize(
    "name,kw", [("grpo", {}), ("grpo", {"ddof": 1}), ("dr_grpo", {}), ("rloo", {}),
                ("reinforce_pp", {}), ("reinforce_pp", {"ddof": 1})]
)  # fmt: skip
def test_advantages_match_reference(name, kw):
    r, valid = _rewards()
    got = np.asarray(compute_advantages(name, r, valid_GN=valid, eps=1e-6, **kw))
    want = ref_advantages(name, r, valid, 1e-6, **kw)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, **TOL)
    assert (got[~valid] == 0).all()
    assert (got[1] == 0).all() and (got[3] == 0).all()  # constant group, single sample


def test_advantages_hand_values():
    r = np.array([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 5.0]])
    # group 0: mean 0.5, population std 0.5 -> +-1; sample std sqrt(1/3) -> +-0.866025.
    # group 1: mean 2.75, population std sqrt((3*0.5625 + 5.0625)/4) = 1.299038.
    g = np.asarray(compute_advantages("grpo", r, eps=0.0))
    np.testing.assert_allclose(g[0], [1, -1, -1, 1], **TOL)
    np.testing.assert_allclose(g[1], np.array([-0.75, -0.75, -0.75, 2.25]) / 1.2990381, **TOL)
    g1 = np.asarray(compute_advantages("grpo", r[:1], eps=0.0, ddof=1))
    np.testing.assert_allclose(g1[0], np.array([1, -1, -1, 1]) * 0.8660254, **TOL)
    np.testing.assert_allclose(
        np.asarray(compute_advantages("dr_grpo", r))[0], [0.5, -0.5, -0.5, 0.5], **TOL
    )
    # RLOO: r=1 -> 1 - (0+0+1)/3 = 2/3 ; r=0 -> 0 - (1+0+1)/3 = -2/3
    np.testing.assert_allclose(
        np.asarray(compute_advantages("rloo", r))[0], [2 / 3, -2 / 3, -2 / 3, 2 / 3], **TOL
    )
    # REINFORCE++ baseline on [[1,0],[1,1]]: centred [[.5,-.5],[0,0]], batch std sqrt(.5/4).
    rp = np.asarray(compute_advantages("reinforce_pp", np.array([[1.0, 0], [1, 1]]), eps=0.0))
    np.testing.assert_allclose(rp, [[math.sqrt(2), -math.sqrt(2)], [0, 0]], **TOL)


def test_advantages_jit_and_errors():
    r, valid = _rewards()
    f = jax.jit(lambda r, v: compute_advantages("rloo", r, valid_GN=v))
    np.testing.assert_allclose(np.asarray(f(r, valid)), ref_advantages("rloo", r, valid, 0), **TOL)
    with pytest.raises(ValueError, match=r"'nope'.*dr_grpo.*grpo.*reinforce_pp.*rloo"):
        compute_advantages("nope", r)
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("grpo")(lambda r, v, *, eps: r)
    with pytest.raises(ValueError, match=r"valid_GN shape \(2, 2\)"):
        compute_advantages("grpo", r, valid_GN=np.ones((2, 2), bool))
    with pytest.raises(ValueError, match=r"\[G, N\]"):
        compute_advantages("grpo", np.ones(3))
    assert {"grpo", "dr_grpo", "rloo", "reinforce_pp"} <= set(ADVANTAGES)
