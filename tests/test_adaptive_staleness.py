"""Adaptive staleness (rl/staleness.py): the controller's rule on synthetic drift sequences, its
checkpoint state, the drift metrics the loss reports, the config's errors, and the coordinator
carrying the controller through a checkpoint."""

import dataclasses
import json
import math

import jax.numpy as jnp
import numpy as np
import pytest

from rl import config as C
from rl.algorithms.losses import LossConfig, LossInputs, compute_loss
from rl.coordinator import Coordinator
from rl.staleness import EtaController, from_config


def _run(ctl: EtaController, drifts: list[float], key: str = "loss/drift_kl") -> list[int]:
    return [ctl.observe({key: d}) for d in drifts]


def test_raises_eta_while_drift_is_low_up_to_the_ceiling():
    ctl = EtaController(eta=1, floor=0, ceiling=4, low=0.01, high=0.1, window=2)
    etas = _run(ctl, [0.001] * 12)
    assert etas == [1, 2, 2, 3, 3, 4, 4, 4, 4, 4, 4, 4]  # +1 per window of two, capped


def test_halves_eta_once_drift_is_high_down_to_the_floor():
    ctl = EtaController(eta=16, floor=3, ceiling=16, low=0.01, high=0.1, window=1)
    assert _run(ctl, [0.5] * 4) == [8, 4, 3, 3]


def test_holds_eta_between_the_thresholds_and_decides_on_the_window_mean():
    ctl = EtaController(eta=4, floor=0, ceiling=8, low=0.01, high=0.1, window=3)
    assert _run(ctl, [0.05, 0.02, 0.09]) == [4, 4, 4]  # mean 0.053: in the band, held
    assert _run(ctl, [0.31, 0.001, 0.001]) == [4, 4, 2]  # mean 0.104 > high: halved
    assert _run(ctl, [0.25, 0.001, 0.001]) == [2, 2, 2]  # mean 0.084: one high value is not enough


def test_stays_within_bounds_on_any_sequence():
    rng = np.random.default_rng(0)
    for _ in range(50):
        floor = int(rng.integers(0, 4))
        ceiling = floor + int(rng.integers(0, 12))
        eta = int(rng.integers(floor, ceiling + 1))
        ctl = EtaController(
            eta, floor, ceiling, low=0.01, high=0.05, window=int(rng.integers(1, 5))
        )
        for e in _run(ctl, rng.exponential(0.03, size=200).tolist()):
            assert floor <= e <= ceiling


def test_ess_reads_lost_sample_fraction_and_missing_values_are_skipped():
    ctl = EtaController(eta=2, floor=0, ceiling=8, signal="ess", low=0.01, high=0.1, window=1)
    assert ctl.observe({"loss/drift_ess": 0.999}) == 3  # drift 0.001: raise
    assert ctl.observe({"loss/drift_ess": 0.5}) == 1  # drift 0.5: halve
    assert ctl.observe({"loss/drift_ess": float("nan")}) == 1  # no value: no decision
    assert ctl.observe({}) == 1 and ctl.seen == []


def test_state_round_trip_continues_the_window():
    a = EtaController(eta=2, floor=0, ceiling=8, low=0.01, high=0.1, window=3)
    _run(a, [0.001, 0.002])
    b = EtaController(eta=0, floor=0, ceiling=8, low=0.01, high=0.1, window=3)
    b.restore(json.loads(json.dumps(a.state())))
    assert _run(b, [0.003]) == _run(a, [0.003]) == [3]


def test_coordinator_lowering_pauses_admission_and_resumes_the_controller():
    ctl = EtaController(eta=4, floor=0, ceiling=8, low=0.01, high=0.1, window=1)
    coord = Coordinator(2, 4, controller=ctl)
    assert coord.capacity() == (4 + 0 + 1) * 2
    coord.admit(10, timeout=1)  # all 10 slots taken at version 0
    row = {"loss/drift_kl": 0.5}
    assert coord.adapt(row) == {"staleness/bound": 4.0, "staleness/eta": 2.0}
    assert coord.capacity() == 0  # lowered: no new admission until the version catches up
    coord.publish(2)
    assert coord.capacity() == 0  # (2 + 2 + 1) * 2 = 10 groups: still all taken
    coord.publish(3)
    assert coord.capacity() == 2
    state = json.loads(json.dumps(coord.state()))
    again = Coordinator.from_state(
        state,
        groups_per_update=2,
        max_staleness=4,  # the config's start: the checkpoint's eta wins
        controller=EtaController(eta=4, floor=0, ceiling=8, low=0.01, high=0.1, window=1),
    )
    assert again.eta == 2 and again.controller.eta == 2
    fixed = Coordinator(2, 3)
    assert fixed.adapt(row) == {"staleness/bound": 3.0} and fixed.eta == 3


def test_drift_metrics_hand_values():
    """drift_kl is k3 of KL(behaviour || proximal) on the trained tokens; drift_ess the
    normalised effective sample size of r = proximal / behaviour."""
    behav = np.log(np.array([[0.5, 0.25, 0.1, 0.9]]))
    prox = np.log(np.array([[0.5, 0.5, 0.05, 0.9]]))
    mask = np.array([[1.0, 1.0, 1.0, 0.0]])
    x = LossInputs(
        logp=jnp.asarray(prox),
        behavior_logp=jnp.asarray(behav),
        advantages=jnp.ones((1,)),
        mask=jnp.asarray(mask),
        proximal_logp=jnp.asarray(prox),
    )
    _, met = compute_loss("decoupled_ppo", x, LossConfig())
    r = np.array([1.0, 2.0, 0.5])
    k3 = np.mean(r - 1 - np.log(r))
    ess = r.sum() ** 2 / (3 * (r**2).sum())
    assert math.isclose(float(met["drift_kl"]), k3, rel_tol=1e-5)
    assert math.isclose(float(met["drift_ess"]), ess, rel_tol=1e-5)
    _, plain = compute_loss("ppo_clip", dataclasses.replace(x, proximal_logp=None), LossConfig())
    assert "drift_kl" not in plain


def _cfg(**adaptive):
    return {
        "trainer": {"mode": "async", "max_staleness": 2, "adaptive": {"enabled": True, **adaptive}},
        "algorithm": {"loss": "decoupled_ppo"},
    }


def test_config_builds_the_controller_from_max_staleness():
    ctl = from_config(C.from_dict(_cfg(floor=1, ceiling=6, signal="ess", window=2)))
    assert (ctl.eta, ctl.floor, ctl.ceiling, ctl.signal, ctl.window) == (2, 1, 6, "ess", 2)
    assert from_config(C.from_dict({})) is None


@pytest.mark.parametrize(
    "change,match",
    [
        ({"trainer": {"mode": "sync", "max_staleness": 0}}, "adaptive.enabled.*mode 'sync'"),
        ({"trainer": {"max_staleness": 9}}, "max_staleness: invalid value 9.*ceiling 8"),
        ({"trainer": {"sync_every": 3}}, "adaptive.floor: invalid value 0 with.*sync_every 3"),
        ({"adaptive": {"low": 0.2, "high": 0.1}}, "adaptive.low: invalid value 0.2"),
        ({"trainer": {"stale_policy": "drop"}}, "stale_policy: invalid value 'drop'"),
        ({"algorithm": {"loss": "ppo_clip"}}, "adaptive.signal: invalid value 'kl'.*'clip'"),
    ],
)
def test_config_errors_name_key_value_and_what_is_valid(change, match):
    raw = _cfg(ceiling=8)
    raw["trainer"].update(change.get("trainer", {}))
    raw["trainer"]["adaptive"].update(change.get("adaptive", {}))
    raw["algorithm"].update(change.get("algorithm", {}))
    with pytest.raises(C.ConfigError, match=match):
        C.from_dict(raw)
