"""Policy losses against independent numpy references (advantages: tests/test_advantages.py).

The references below are written from the papers' formulas with explicit Python loops over
groups / sequences / tokens in float64; they never call rl.algorithms. Inputs are rounded to
float32 first and the reference sees the same rounded values, so the comparison measures only
the float32 arithmetic of the jnp code: 1e-6 (rtol and atol) throughout.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl.algorithms import (
    AGGREGATIONS,
    LOSSES,
    LossConfig,
    LossInputs,
    TokenTerms,
    compute_loss,
    register_loss,
)

TOL = dict(rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------------------
# numpy references: losses
# --------------------------------------------------------------------------------------------


def ref_surrogate(r, a, lo, hi, c):
    """PPO objective min(r a, clip(r) a) (dual clip: max(., c a) for a < 0) and d obj / d r."""
    clipped_r = min(max(r, lo), hi)
    obj = min(r * a, clipped_r * a)
    if a > 0:
        # unclipped branch is the min unless r > hi (then hi * a, flat)
        d = a if r < hi else 0.0
    elif a < 0:
        # unclipped branch is the min unless r < lo (then lo * a, flat)
        d = a if r > lo else 0.0
    else:
        d = 0.0
    if c is not None and a < 0:
        if obj < c * a:
            obj, d = c * a, 0.0
    return obj, d


def ref_agg_coeffs(mask, aggregation, norm_const):
    """k[b, t] such that the aggregated loss is sum_bt k[b, t] * l[b, t]."""
    B, T = mask.shape
    n_tok = sum(mask[b, t] for b in range(B) for t in range(T))
    rows = [b for b in range(B) if sum(mask[b]) > 0]
    k = np.zeros((B, T))
    for b in rows:
        len_b = sum(mask[b])
        for t in range(T):
            if not mask[b, t]:
                continue
            if aggregation == "token_mean":
                k[b, t] = 1.0 / n_tok
            elif aggregation == "seq_mean_token_mean":
                k[b, t] = 1.0 / (len_b * len(rows))
            else:
                k[b, t] = 1.0 / (norm_const * len(rows))
    return k


def ref_weights(name, cfg, prox, behav, mask):
    """Stop-gradient weights w[b, t] and dropped[b, t] (decoupled / TIS / MIS)."""
    B, T = mask.shape
    w, dropped = np.ones((B, T)), np.zeros((B, T), bool)
    for b in range(B):
        seq_log_w = sum(prox[b, t] - behav[b, t] for t in range(T) if mask[b, t])
        for t in range(T):
            if not mask[b, t]:
                continue
            if name == "decoupled_ppo":
                raw = math.exp(prox[b, t] - behav[b, t])
                cap = cfg.decoupled_cap
                if cap is not None and raw > cap:
                    if cfg.decoupled_cap_mode == "truncate":
                        raw = cap
                    else:
                        raw, dropped[b, t] = 0.0, True
                w[b, t] = raw
            elif cfg.is_correction != "none":
                kind, level = cfg.is_correction.split("_")
                raw = math.exp(prox[b, t] - behav[b, t] if level == "token" else seq_log_w)
                if kind == "tis":
                    w[b, t] = min(raw, cfg.is_cap)
                elif raw > cfg.is_cap or raw < 1.0 / cfg.is_cap:
                    w[b, t], dropped[b, t] = 0.0, True
                else:
                    w[b, t] = raw
    return w, dropped


def ref_loss(name, d, cfg):
    """Reference loss, d loss / d logp, and metrics for ppo_clip / decoupled_ppo / gspo.

    ppo_clip, decoupled_ppo: l_t = -w_t * obj(r_t, A_t),  d l_t / d logp_t = -w_t obj'(r_t) r_t.
    gspo (GSPO-token, Zheng et al. 2025 eq. for s_i,t): r_t = s_i = exp(mean_t log ratio) for all
    t of sequence i, and the gradient of the token form is d l_t / d logp_t = -w_t obj'(s_i) s_i.
    KL (k3): l_t += beta (exp(x) - x - 1) with x = ref - logp, d/d logp = beta (1 - exp(x)).
    """
    logp, behav, prox, ref, mask = d["logp"], d["behav"], d["prox"], d["ref"], d["mask"]
    adv = d["adv"] if d["adv"].ndim == 2 else np.repeat(d["adv"][:, None], logp.shape[1], 1)
    B, T = logp.shape
    lo = 1.0 - cfg.clip_eps
    hi = 1.0 + (cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high)
    denom = prox if (name == "decoupled_ppo" or cfg.is_correction != "none") else behav
    w, dropped = ref_weights(name, cfg, prox, behav, mask)
    r = np.ones((B, T))
    for b in range(B):
        n_b = sum(mask[b])
        seq = sum(logp[b, t] - denom[b, t] for t in range(T) if mask[b, t]) / max(n_b, 1)
        for t in range(T):
            r[b, t] = math.exp(seq) if name == "gspo" else math.exp(logp[b, t] - denom[b, t])
    k = ref_agg_coeffs(mask, cfg.aggregation, cfg.loss_norm_const)
    loss = pg = 0.0
    grad = np.zeros((B, T))
    stats = dict(low=0, high=0, dual=0, akl=0.0, rsum=0.0, rmax=0.0, w=0.0, drop=0, kl=0.0)
    n_tok = mask.sum()
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            a = adv[b, t]
            obj, dobj = ref_surrogate(r[b, t], a, lo, hi, cfg.dual_clip_c)
            l_t, g_t = -w[b, t] * obj, -w[b, t] * dobj * r[b, t]
            pg += k[b, t] * l_t
            if ref is not None:
                x = ref[b, t] - logp[b, t]
                kl_t = math.exp(x) - x - 1.0
                stats["kl"] += kl_t / n_tok
                l_t += cfg.kl_coef * kl_t
                g_t += cfg.kl_coef * (1.0 - math.exp(x))
            loss += k[b, t] * l_t
            grad[b, t] = k[b, t] * g_t
            stats["low"] += r[b, t] < lo and a < 0
            stats["high"] += r[b, t] > hi and a > 0
            c = cfg.dual_clip_c
            stats["dual"] += c is not None and a < 0 and r[b, t] > c
            lr = logp[b, t] - denom[b, t]
            stats["akl"] += (math.exp(lr) - 1.0 - lr) / n_tok
            stats["rsum"] += r[b, t] / n_tok
            stats["rmax"] = max(stats["rmax"], r[b, t])
            stats["w"] += w[b, t] / n_tok
            stats["drop"] += dropped[b, t]
    metrics = {
        "loss": loss,
        "pg_loss": pg,
        "clip_fraction_low": stats["low"] / n_tok,
        "clip_fraction_high": stats["high"] / n_tok,
        "clip_fraction": (stats["low"] + stats["high"]) / n_tok,
        "dual_clip_fraction": stats["dual"] / n_tok,
        "approx_kl": stats["akl"],
        "ratio_mean": stats["rsum"],
        "ratio_max": stats["rmax"],
        "is_weight_mean": stats["w"],
        "masked_fraction": stats["drop"] / n_tok,
        "num_tokens": n_tok,
    }
    if ref is not None:
        metrics["kl"] = stats["kl"]
    if prox is not None:  # the behaviour policy's drift from the proximal one (r = prox / behav)
        rr = [math.exp(prox[b, t] - behav[b, t]) for b in range(B) for t in range(T) if mask[b, t]]
        metrics["drift_kl"] = sum(x - 1.0 - math.log(x) for x in rr) / n_tok
        metrics["drift_ess"] = sum(rr) ** 2 / (n_tok * sum(x * x for x in rr))
    return loss, grad, metrics


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _f32(x):
    return np.asarray(x, np.float32).astype(np.float64)


def make_batch(seed, B=4, T=7, seq_adv=True, spread=0.5, row_shift=0.0, with_ref=True):
    """Random batch (float32-rounded, as float64), masks with a short row and an empty row.

    row_shift moves each row's behaviour log-probs by one offset in [-row_shift, row_shift], so
    sequence-level ratios (GSPO) leave the clip range too.
    """
    rng = np.random.default_rng(seed)
    logp = -rng.uniform(0.05, 3.0, (B, T))
    shift_B1 = rng.uniform(-row_shift, row_shift, (B, 1))
    prox_shift_B1 = rng.uniform(-row_shift, row_shift, (B, 1))
    behav = logp - rng.uniform(-spread, spread, (B, T)) - shift_B1
    prox = logp - rng.uniform(-spread, spread, (B, T)) - prox_shift_B1
    ref = logp - rng.uniform(-spread, spread, (B, T))
    mask = np.ones((B, T), bool)
    mask[0, 5:] = False  # right padding
    mask[1, :2] = False  # prompt tokens
    mask[2, :] = False  # row with nothing to train
    mask[3, 3] = False  # an interior hole (e.g. a tool-output span)
    adv = rng.normal(size=(B,)) if seq_adv else rng.normal(size=(B, T))
    return {
        "logp": _f32(logp),
        "behav": _f32(behav),
        "prox": _f32(prox),
        "ref": _f32(ref) if with_ref else None,
        "adv": _f32(adv),
        "mask": mask,
    }


def usable(name, d, cfg, margin=2e-3):
    """Some tokens clipped, some not, and no ratio / weight within `margin` of a kink or cap."""
    lo = 1.0 - cfg.clip_eps
    hi = 1.0 + (cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high)
    kinks = [lo, hi] + ([cfg.dual_clip_c] if cfg.dual_clip_c else [])
    caps = [cfg.is_cap, 1.0 / cfg.is_cap] + ([cfg.decoupled_cap] if cfg.decoupled_cap else [])
    if not 0 < ref_loss(name, d, cfg)[2]["clip_fraction"] < 1:
        return False  # both branches of the surrogate must be exercised
    denom = d["prox"] if (name == "decoupled_ppo" or cfg.is_correction != "none") else d["behav"]
    m = d["mask"]
    tok = np.exp(d["logp"] - denom)[m]
    n = np.maximum(m.sum(1), 1)
    seq = np.exp(((d["logp"] - denom) * m).sum(1) / n)[m.sum(1) > 0]
    w_tok = np.exp(d["prox"] - d["behav"])[m]
    w_seq = np.exp(((d["prox"] - d["behav"]) * m).sum(1))[m.sum(1) > 0]
    ok = all(np.abs(v - kk).min() > margin for v in (tok, seq) if v.size for kk in kinks)
    return ok and all(np.abs(v - c).min() > margin for v in (w_tok, w_seq) if v.size for c in caps)


def draw(name, cfg, seed, **kw):
    """First usable batch from `seed` upward (deterministic)."""
    for s in range(seed, seed + 200):
        d = make_batch(s, **kw)
        if usable(name, d, cfg):
            return d
    raise AssertionError("no usable batch in 200 seeds")


def to_inputs(d, logp=None):
    return LossInputs(
        logp=jnp.asarray(d["logp"] if logp is None else logp, jnp.float32),
        behavior_logp=jnp.asarray(d["behav"], jnp.float32),
        advantages=jnp.asarray(d["adv"], jnp.float32),
        mask=jnp.asarray(d["mask"]),
        proximal_logp=jnp.asarray(d["prox"], jnp.float32),
        ref_logp=None if d["ref"] is None else jnp.asarray(d["ref"], jnp.float32),
    )


def jax_loss(name, d, cfg, jit=False):
    """(loss, metrics, d loss / d logp) from compute_loss."""

    def f(logp):
        return compute_loss(name, to_inputs(d, logp), cfg)

    vg = jax.value_and_grad(f, has_aux=True)
    if jit:
        vg = jax.jit(vg)
    (loss, metrics), grad = vg(jnp.asarray(d["logp"], jnp.float32))
    return float(loss), {k: float(v) for k, v in metrics.items()}, np.asarray(grad)


def check_against_reference(name, d, cfg):
    loss, metrics, grad = jax_loss(name, d, cfg)
    rloss, rgrad, rmetrics = ref_loss(name, d, cfg)
    # The batch must exercise both branches of the surrogate: some tokens clipped, some not.
    assert 0 < rmetrics["clip_fraction"] < 1, rmetrics["clip_fraction"]
    np.testing.assert_allclose(loss, rloss, **TOL)
    np.testing.assert_allclose(grad, rgrad, **TOL)
    assert set(metrics) == set(rmetrics)
    for key, value in rmetrics.items():
        np.testing.assert_allclose(metrics[key], value, **TOL, err_msg=key)
    return loss


# --------------------------------------------------------------------------------------------
# losses: hand-computed values
# --------------------------------------------------------------------------------------------


def _hand_inputs():
    # behavior_logp = 0, so ratio = exp(logp); eps = 0.2 -> clip range [0.8, 1.2].
    ratios = np.array([[1.1, 1.5, 0.5], [0.7, 1.3, 0.9]])
    mask = np.array([[1, 1, 1], [1, 1, 0]], bool)
    return {
        "logp": _f32(np.log(ratios)),
        "behav": np.zeros((2, 3)),
        "prox": np.zeros((2, 3)),
        "ref": None,
        "adv": np.array([1.0, -2.0]),
        "mask": mask,
    }


@pytest.mark.parametrize(
    "aggregation,want",
    [
        ("token_mean", 0.28),
        ("seq_mean_token_mean", 0.5833333333),
        ("seq_mean_token_sum_norm", 0.175),
    ],
)
def test_ppo_clip_hand_2x3(aggregation, want):
    # Row 0, A=+1:  r=1.1 -> min(1.1, 1.1)=1.1 ; r=1.5 -> min(1.5, 1.2)=1.2 (clipped high) ;
    #               r=0.5 -> min(0.5, 0.8)=0.5 (unclipped: lower ratio hurts, no cut).  sum 2.8
    # Row 1, A=-2:  r=0.7 -> min(-1.4, -1.6)=-1.6 (clipped low) ; r=1.3 -> min(-2.6, -2.4)=-2.6 ;
    #               third token masked.  sum -4.2 over 2 tokens.
    # loss = -objective:  token_mean = -(2.8 - 4.2) / 5 = 0.28
    #   seq_mean_token_mean = (-2.8/3 + 4.2/2) / 2 = 0.583333
    #   seq_mean_token_sum_norm (C=4) = (-2.8/4 + 4.2/4) / 2 = 0.175
    cfg = LossConfig(clip_eps=0.2, aggregation=aggregation, loss_norm_const=4.0)
    loss, m, grad = jax_loss("ppo_clip", _hand_inputs(), cfg)
    np.testing.assert_allclose(loss, want, **TOL)
    np.testing.assert_allclose(m["clip_fraction_high"], 1 / 5, **TOL)
    np.testing.assert_allclose(m["clip_fraction_low"], 1 / 5, **TOL)
    np.testing.assert_allclose(m["ratio_max"], 1.5, **TOL)
    np.testing.assert_allclose(m["ratio_mean"], (1.1 + 1.5 + 0.5 + 0.7 + 1.3) / 5, **TOL)
    if aggregation == "token_mean":
        # d(-r A)/d logp = -r A on unclipped tokens, 0 on clipped ones, 0 on padding; / 5.
        want_grad = np.array([[-1.1, 0.0, -0.5], [0.0, 2.6, 0.0]]) / 5
        np.testing.assert_allclose(grad, want_grad, **TOL)


def test_dual_clip_hand():
    # A = -2, eps 0.2, c = 3.  r=3.5: min(-7, -2.4) = -7, max(-7, -6) = -6 -> loss 6, grad 0.
    # r=2.5: min(-5, -2.4) = -5 > -6 -> loss 5, grad d(-rA)/dlogp = -rA = 5.
    # r=0.5: min(-1, -1.6) = -1.6 -> loss 1.6, grad 0.   token mean = 12.6 / 3 = 4.2
    d = {
        "logp": _f32(np.log([[3.5, 2.5, 0.5]])),
        "behav": np.zeros((1, 3)),
        "prox": np.zeros((1, 3)),
        "ref": None,
        "adv": np.array([-2.0]),
        "mask": np.ones((1, 3), bool),
    }
    loss, m, grad = jax_loss("ppo_clip", d, LossConfig(dual_clip_c=3.0))
    np.testing.assert_allclose(loss, 4.2, **TOL)
    np.testing.assert_allclose(grad, [[0.0, 5.0 / 3, 0.0]], **TOL)
    np.testing.assert_allclose(m["dual_clip_fraction"], 1 / 3, **TOL)
    # Without the dual clip the r=3.5 token costs 7 and keeps its gradient 7/3.
    loss, _, grad = jax_loss("ppo_clip", d, LossConfig())
    np.testing.assert_allclose(loss, 13.6 / 3, **TOL)
    np.testing.assert_allclose(grad, [[7.0 / 3, 5.0 / 3, 0.0]], **TOL)


@pytest.mark.parametrize(
    "r,a,eps_high,loss,grad",
    [
        (1.199, 1.0, None, -1.199, -1.199),  # inside, A>0: gradient flows
        (1.201, 1.0, None, -1.2, 0.0),  # outside high, A>0: clipped, no gradient
        (0.801, 1.0, None, -0.801, -0.801),
        (0.799, 1.0, None, -0.799, -0.799),  # below low, A>0: unclipped is the min
        (1.199, -1.0, None, 1.199, 1.199),
        (1.201, -1.0, None, 1.201, 1.201),  # above high, A<0: unclipped is the min
        (0.801, -1.0, None, 0.801, 0.801),
        (0.799, -1.0, None, 0.8, 0.0),  # below low, A<0: clipped, no gradient
        (1.25, 1.0, 0.28, -1.25, -1.25),  # DAPO clip-higher: 1.25 is inside [0.8, 1.28]
        (1.281, 1.0, 0.28, -1.28, 0.0),
    ],
)
def test_clip_boundaries(r, a, eps_high, loss, grad):
    d = {
        "logp": _f32(np.log([[r]])),
        "behav": np.zeros((1, 1)),
        "prox": np.zeros((1, 1)),
        "ref": None,
        "adv": np.array([a]),
        "mask": np.ones((1, 1), bool),
    }
    got_loss, _, got_grad = jax_loss("ppo_clip", d, LossConfig(clip_eps_high=eps_high))
    np.testing.assert_allclose(got_loss, loss, **TOL)
    np.testing.assert_allclose(got_grad, [[grad]], **TOL)


def test_tis_vs_mis_hand():
    # logp = proximal, so every PPO ratio is 1 and A = 1: the token loss is -w.
    # Token weights pi_prox / pi_behav: row 0 [0.3, 1.5, 3.0] (product 1.35),
    #                                   row 1 [0.3, 1.5, 3.0, 2.0] (product 2.7); is_cap = 2.
    w = np.array([[0.3, 1.5, 3.0, 1.0], [0.3, 1.5, 3.0, 2.0]])
    mask = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], bool)
    d = {
        "logp": np.zeros((2, 4)),
        "behav": _f32(-np.log(w)),
        "prox": np.zeros((2, 4)),
        "ref": None,
        "adv": np.array([1.0, 1.0]),
        "mask": mask,
    }
    want = {
        # TIS token: [0.3, 1.5, 2] and [0.3, 1.5, 2, 2] -> -(3.8 + 5.8) / 7
        "tis_token": (-(3.8 + 5.8) / 7, 0.0),
        # MIS token: 0.3 < 1/2 and 3 > 2 are dropped: [0, 1.5, 0] and [0, 1.5, 0, 2]
        "mis_token": (-(1.5 + 3.5) / 7, 4 / 7),
        # TIS seq: min(1.35, 2) on 3 tokens, min(2.7, 2) on 4 tokens
        "tis_seq": (-(3 * 1.35 + 4 * 2.0) / 7, 0.0),
        # MIS seq: row 0 kept with 1.35, row 1 (2.7 > 2) dropped entirely
        "mis_seq": (-(3 * 1.35) / 7, 4 / 7),
    }
    for mode, (loss, dropped) in want.items():
        got, m, _ = jax_loss("ppo_clip", d, LossConfig(is_correction=mode, is_cap=2.0))
        np.testing.assert_allclose(got, loss, **TOL, err_msg=mode)
        np.testing.assert_allclose(m["masked_fraction"], dropped, **TOL, err_msg=mode)


# --------------------------------------------------------------------------------------------
# losses: random batches against the reference (loss, gradient, metrics)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("seq_adv", [True, False])
@pytest.mark.parametrize("dual", [None, 1.3])
def test_ppo_clip_matches_reference(aggregation, seq_adv, dual):
    cfg = LossConfig(aggregation=aggregation, loss_norm_const=6.0, dual_clip_c=dual)
    d = draw("ppo_clip", cfg, seed=10, seq_adv=seq_adv)
    check_against_reference("ppo_clip", d, cfg)


@pytest.mark.parametrize("name", ["ppo_clip", "gspo"])
@pytest.mark.parametrize("mode", ["tis_token", "tis_seq", "mis_token", "mis_seq"])
def test_is_correction_matches_reference(name, mode):
    cfg = LossConfig(is_correction=mode, is_cap=1.5, aggregation="seq_mean_token_mean")
    d = draw(name, cfg, seed=20, spread=0.4, row_shift=0.2, B=6)
    loss, _, _ = jax_loss(name, d, cfg)
    check_against_reference(name, d, cfg)
    # The weight matters: the uncorrected loss on the same batch differs.
    assert abs(loss - jax_loss(name, d, LossConfig(aggregation=cfg.aggregation))[0]) > 1e-3


def test_tis_and_mis_differ_on_a_batch_with_large_weights():
    cfg_t = LossConfig(is_correction="tis_token", is_cap=1.2)
    cfg_m = LossConfig(is_correction="mis_token", is_cap=1.2)
    d = draw("ppo_clip", cfg_m, seed=30, spread=0.6)
    _, mt, _ = jax_loss("ppo_clip", d, cfg_t)
    _, mm, _ = jax_loss("ppo_clip", d, cfg_m)
    assert mt["masked_fraction"] == 0 and mm["masked_fraction"] > 0.2
    assert mm["is_weight_mean"] < mt["is_weight_mean"]
    check_against_reference("ppo_clip", d, cfg_t)
    check_against_reference("ppo_clip", d, cfg_m)


@pytest.mark.parametrize(
    "cap,mode", [(None, "truncate"), (1.3, "truncate"), (1.3, "mask")]
)  # fmt: skip
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_sum_norm"])
def test_decoupled_ppo_matches_reference(cap, mode, aggregation):
    cfg = LossConfig(
        decoupled_cap=cap, decoupled_cap_mode=mode, aggregation=aggregation, loss_norm_const=5.0
    )
    d = draw("decoupled_ppo", cfg, seed=40, seq_adv=False)
    check_against_reference("decoupled_ppo", d, cfg)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("seq_adv", [True, False])
def test_gspo_matches_reference(aggregation, seq_adv):
    cfg = LossConfig(clip_eps=0.05, clip_eps_high=0.08, aggregation=aggregation,
                     loss_norm_const=6.0)  # fmt: skip
    d = draw("gspo", cfg, seed=50, seq_adv=seq_adv, spread=0.3, row_shift=0.1, B=6)
    check_against_reference("gspo", d, cfg)


def test_gspo_gradient_is_the_sequence_objective_gradient():
    """GSPO-token with per-sequence A = the paper's sequence-level objective (finite diff)."""
    cfg = LossConfig(clip_eps=0.05, aggregation="seq_mean_token_mean")
    d = draw("gspo", cfg, seed=60, spread=0.3, row_shift=0.1, B=6)
    mask, adv = d["mask"], d["adv"]

    def seq_objective(logp):
        # Zheng et al. 2025: J = 1/G sum_i min(s_i A_i, clip(s_i, 1-e, 1+e) A_i), loss = -J.
        total, rows = 0.0, 0
        for b in range(logp.shape[0]):
            toks = [t for t in range(logp.shape[1]) if mask[b, t]]
            if not toks:
                continue
            s = math.exp(sum(logp[b, t] - d["behav"][b, t] for t in toks) / len(toks))
            total += min(s * adv[b], min(max(s, 0.95), 1.05) * adv[b])
            rows += 1
        return -total / rows

    h = 1e-6
    fd = np.zeros_like(d["logp"])
    for b, t in zip(*np.nonzero(mask)):
        up, dn = d["logp"].copy(), d["logp"].copy()
        up[b, t] += h
        dn[b, t] -= h
        fd[b, t] = (seq_objective(up) - seq_objective(dn)) / (2 * h)
    loss, _, grad = jax_loss("gspo", d, cfg)
    np.testing.assert_allclose(loss, seq_objective(d["logp"]), **TOL)
    # 1e-5 here: the float64 central difference itself carries ~1e-9/h = 1e-6 of error.
    np.testing.assert_allclose(grad, fd, rtol=1e-5, atol=1e-5)
    assert np.abs(grad).max() > 1e-3  # some sequence is unclipped, so this is not 0 == 0


@pytest.mark.parametrize("name", ["ppo_clip", "decoupled_ppo", "gspo"])
def test_kl_penalty_matches_reference(name):
    cfg = LossConfig(kl_coef=0.1, aggregation="seq_mean_token_mean")
    d = draw(name, cfg, seed=70, row_shift=0.3, B=6)
    loss = check_against_reference(name, d, cfg)
    no_kl, m, _ = jax_loss(name, d, LossConfig(aggregation=cfg.aggregation))
    assert loss > no_kl + 1e-4 and m["kl"] > 0  # the k3 term is positive and is added


# --------------------------------------------------------------------------------------------
# losses: masking, degenerate inputs, numerics
# --------------------------------------------------------------------------------------------

ALL_SETUPS = [
    ("ppo_clip", LossConfig(dual_clip_c=3.0, kl_coef=0.05)),
    ("ppo_clip", LossConfig(is_correction="mis_seq", aggregation="seq_mean_token_mean")),
    (
        "ppo_clip",
        LossConfig(
            is_correction="tis_token", aggregation="seq_mean_token_sum_norm", loss_norm_const=7.0
        ),
    ),  # fmt: skip
    ("decoupled_ppo", LossConfig(decoupled_cap=2.0, kl_coef=0.05)),
    ("decoupled_ppo", LossConfig(decoupled_cap=2.0, decoupled_cap_mode="mask")),
    ("gspo", LossConfig(is_correction="mis_token", kl_coef=0.05)),
    ("gspo", LossConfig(aggregation="seq_mean_token_mean")),
]


@pytest.mark.parametrize("name,cfg", ALL_SETUPS)
def test_padding_never_contributes(name, cfg):
    d = make_batch(80, seq_adv=False)
    loss, _, grad = jax_loss(name, d, cfg, jit=True)
    pad = ~d["mask"]
    junk = np.array([np.nan, np.inf, -np.inf, 1e4, -1e4, 0.0])
    e = dict(d)
    for i, key in enumerate(["logp", "behav", "prox", "ref", "adv"]):
        x = d[key].copy()
        x[pad] = np.resize(np.roll(junk, i), pad.sum())
        e[key] = x
    loss2, m2, grad2 = jax_loss(name, e, cfg, jit=True)
    assert np.isfinite(loss) and np.isfinite(grad).all()
    assert loss2 == loss
    np.testing.assert_array_equal(grad2, grad)
    assert (grad[pad] == 0).all()
    assert all(np.isfinite(v) for v in m2.values())


@pytest.mark.parametrize("name,cfg", ALL_SETUPS)
def test_all_masked_and_zero_advantage(name, cfg):
    d = make_batch(90)
    empty = dict(d, mask=np.zeros_like(d["mask"]))
    loss, m, grad = jax_loss(name, empty, cfg)
    assert loss == 0 and (grad == 0).all()
    assert all(np.isfinite(v) for v in m.values()) and m["num_tokens"] == 0
    # Zero advantages and no KL: nothing to learn.
    zero = dict(d, adv=np.zeros_like(d["adv"]), ref=None)
    cfg0 = LossConfig(**{**cfg.__dict__, "kl_coef": 0.0})
    loss, m, grad = jax_loss(name, zero, cfg0)
    assert loss == 0 and (grad == 0).all() and m["clip_fraction"] == 0


@pytest.mark.parametrize("name,cfg", ALL_SETUPS)
@pytest.mark.parametrize("scale", [50.0, 1000.0])
def test_huge_log_ratios_stay_finite(name, cfg, scale):
    d = make_batch(100, seq_adv=False)
    sign = np.where(np.arange(d["logp"].size).reshape(d["logp"].shape) % 2, 1.0, -1.0)
    e = dict(d, behav=d["logp"] + scale * sign, prox=d["logp"] - scale * sign)
    e["ref"] = d["logp"] + scale * sign
    loss, m, grad = jax_loss(name, e, cfg)
    assert np.isfinite(loss) and np.isfinite(grad).all()
    assert all(np.isfinite(v) for v in m.values())
    assert m["ratio_max"] <= math.exp(20.0) * (1 + 1e-6)


def test_all_masked_row_does_not_count_in_sequence_means():
    cfg = LossConfig(aggregation="seq_mean_token_mean")
    d = _hand_inputs()
    padded = {
        k: None if v is None else np.concatenate([v, np.zeros_like(v[:1])]) for k, v in d.items()
    }
    np.testing.assert_allclose(
        jax_loss("ppo_clip", padded, cfg)[0], jax_loss("ppo_clip", d, cfg)[0], **TOL
    )


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_global_normalisers_make_micro_batches_add_up(aggregation):
    """Losses of micro-batches with global num_tokens / num_seqs sum to the full-batch loss."""
    cfg = LossConfig(aggregation=aggregation, loss_norm_const=6.0)
    d = draw("ppo_clip", cfg, seed=110, B=6)
    full, _, grad = jax_loss("ppo_clip", d, cfg)
    n_tok, n_seq = d["mask"].sum(), (d["mask"].sum(1) > 0).sum()
    total, grads = 0.0, []
    for rows in (slice(0, 2), slice(2, 6)):
        part = {k: None if v is None else v[rows] for k, v in d.items()}

        def f(logp, part=part):
            x = to_inputs(part, logp)
            x = LossInputs(**{**x.__dict__, "num_tokens": n_tok, "num_seqs": n_seq})
            return compute_loss("ppo_clip", x, cfg)[0]

        value, g = jax.value_and_grad(f)(jnp.asarray(part["logp"], jnp.float32))
        total += float(value)
        grads.append(np.asarray(g))
    np.testing.assert_allclose(total, full, **TOL)
    np.testing.assert_allclose(np.concatenate(grads), grad, **TOL)


# --------------------------------------------------------------------------------------------
# losses: API
# --------------------------------------------------------------------------------------------


def test_jit_dict_inputs_and_bf16():
    cfg = LossConfig(is_correction="tis_seq", kl_coef=0.1)
    d = draw("gspo", cfg, seed=120, row_shift=0.3, B=6)
    x = to_inputs(d)
    eager = compute_loss("gspo", x, cfg)[0]
    jitted = jax.jit(compute_loss, static_argnums=(0, 2))("gspo", x, cfg)[0]
    np.testing.assert_allclose(float(jitted), float(eager), **TOL)
    as_dict = compute_loss("gspo", dict(x.__dict__), cfg)[0]
    np.testing.assert_allclose(float(as_dict), float(eager), **TOL)
    bf16 = LossInputs(**{**x.__dict__, "logp": x.logp.astype(jnp.bfloat16)})
    assert compute_loss("gspo", bf16, cfg)[0].dtype == jnp.float32


def test_loss_errors():
    d = _hand_inputs()
    x = to_inputs(d)
    no_prox = LossInputs(**{**x.__dict__, "proximal_logp": None})
    with pytest.raises(ValueError, match=r"'nope'.*decoupled_ppo.*gspo.*ppo_clip"):
        compute_loss("nope", x, LossConfig())
    with pytest.raises(ValueError, match="decoupled_ppo.*proximal_logp"):
        compute_loss("decoupled_ppo", no_prox, LossConfig())
    with pytest.raises(ValueError, match="tis_seq.*proximal_logp"):
        compute_loss("ppo_clip", no_prox, LossConfig(is_correction="tis_seq"))
    with pytest.raises(ValueError, match="kl_coef=0.1 needs ref_logp"):
        compute_loss("ppo_clip", x, LossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="is_correction='mis_token' must be 'none'"):
        compute_loss("decoupled_ppo", x, LossConfig(is_correction="mis_token"))
    with pytest.raises(ValueError, match=r"advantages shape \(3,\)"):
        compute_loss("ppo_clip", dict(x.__dict__, advantages=np.ones(3)), LossConfig())
    with pytest.raises(ValueError, match=r"behavior_logp shape \(2, 2\)"):
        compute_loss("ppo_clip", dict(x.__dict__, behavior_logp=np.ones((2, 2))), LossConfig())
    with pytest.raises(ValueError, match=r"unknown loss inputs \['old_logp'\]"):
        compute_loss("ppo_clip", dict(x.__dict__, old_logp=x.logp), LossConfig())
    # ppo_clip without an is_correction ignores proximal_logp entirely.
    np.testing.assert_allclose(
        float(compute_loss("ppo_clip", no_prox, LossConfig())[0]), 0.28, **TOL
    )


@pytest.mark.parametrize(
    "field,value",
    [("clip_eps", 0.0), ("clip_eps_high", -0.1), ("dual_clip_c", 1.0), ("is_correction", "tis"),
     ("is_cap", 0.5), ("decoupled_cap", 0.0), ("decoupled_cap_mode", "clip"),
     ("aggregation", "mean"), ("kl_coef", -1.0), ("loss_norm_const", 0.0)],
)  # fmt: skip
def test_loss_config_validation(field, value):
    with pytest.raises(ValueError, match=f"LossConfig.{field}="):
        LossConfig(**{field: value})


def test_sum_norm_needs_constant_and_custom_registration():
    with pytest.raises(ValueError, match="loss_norm_const.*seq_mean_token_sum_norm"):
        LossConfig(aggregation="seq_mean_token_sum_norm")

    @register_loss("test_reinforce")
    def reinforce(x, cfg):  # plain REINFORCE: -A logp
        z = jnp.zeros(x.mask.shape, bool)
        one = jnp.ones_like(x.mask)
        return TokenTerms(-x.advantages * x.logp, one, x.logp - x.behavior_logp, z, z, z, one, z)

    try:
        d = _hand_inputs()
        loss, _, grad = jax_loss("test_reinforce", d, LossConfig())
        lp = d["logp"]
        np.testing.assert_allclose(loss, -(lp[0].sum() - 2 * lp[1, :2].sum()) / 5, **TOL)
        np.testing.assert_allclose(grad, [[-0.2] * 3, [0.4, 0.4, 0.0]], **TOL)
        with pytest.raises(ValueError, match="already registered"):
            register_loss("test_reinforce")(reinforce)
    finally:
        LOSSES.pop("test_reinforce")
