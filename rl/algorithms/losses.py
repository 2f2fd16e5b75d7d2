"""Policy-gradient losses for (possibly stale) off-policy batches, registered by name.

Three log-prob tensors can enter a loss, all per token [B, T] for the sampled tokens:
  logp           the current policy pi_theta (differentiable),
  behavior_logp  the policy that actually sampled the token (the rollout engine's numbers),
  proximal_logp  the learner's params at the start of this update (no gradient).

Losses (LOSSES):
  ppo_clip       PPO clipped surrogate, ratio pi_theta / pi_behavior (or / pi_proximal when an
                 is_correction is set, see below); optional dual clip (Ye et al. 2020).
  decoupled_ppo  Hilton et al. 2021 "Batch size-invariance for policy optimization", as used
                 by AReaL: ratio pi_theta / pi_proximal clipped around the proximal policy and
                 multiplied by the behaviour weight w = sg(pi_proximal / pi_behavior), capped
                 by `decoupled_cap` (truncated, or masked as AReaL does with
                 decoupled_cap_mode="mask").
  gspo           Zheng et al. 2025, sequence-level ratio s_i = exp(mean_t log(pi_theta/pi_old))
                 in the per-token gradient form of the paper (GSPO-token):
                 s_it = sg(s_i) * pi_theta(y_t) / sg(pi_theta(y_t)), so grad s_it = s_i grad logp_t.
                 With per-sequence advantages and aggregation "seq_mean_token_mean" it is
                 exactly the paper's sequence objective. The paper uses tiny clip ranges
                 (3e-4 / 4e-4); set clip_eps / clip_eps_high accordingly.
  sft            supervised warm start: token negative log-likelihood -logp (behavior_logp
                 and advantages unused; not an RL policy loss, so not a valid algorithm.loss).

Each loss is registered with its properties (LossSpec: needs_proximal, sequence_level,
accepts_is_correction, supervised); callers read those through loss_spec / needs_proximal /
token_level / policy_losses, never by comparing names.

Training-inference mismatch correction (cfg.is_correction, for ppo_clip and gspo; needs
proximal_logp): the trust region is taken around pi_proximal (the ratio's denominator becomes
proximal_logp) and each token's loss is multiplied by a stop-gradient weight
  token level  ("*_token"): w_t = pi_proximal(y_t) / pi_behavior(y_t),
  sequence level ("*_seq"): w_i = prod_t pi_proximal(y_t) / pi_behavior(y_t)  (same for all t),
  TIS ("tis_*", truncated IS as in verl / Yao et al. 2025): w <- min(w, is_cap),
  MIS ("mis_*", masked IS as in IcePop / TRL masked IS): w <- w if 1/is_cap <= w <= is_cap
      else 0 (the token or whole sequence is dropped; TRL masks the upper side only).
With is_correction="none", proximal_logp is ignored by ppo_clip and gspo.

Numerics: every log-ratio (token, sequence mean, sequence sum) is clipped to
+-LOG_RATIO_CLIP (20) before exp, so ratios and weights stay within [2e-9, 4.9e8]: finite
losses and gradients for any input. Beyond the clip a token ratio is constant (no gradient);
such a token is far outside any trust region. Positions with mask 0 are replaced by 0 before
any arithmetic, so padding (even NaN or inf) never reaches the loss or its gradient.

Aggregation (cfg.aggregation) of the per-token loss l_bt with mask m_bt:
  token_mean               sum_bt m l / max(sum_bt m, 1)
  seq_mean_token_mean      mean over non-empty rows of  sum_t m l / sum_t m
  seq_mean_token_sum_norm  mean over non-empty rows of  sum_t m l / loss_norm_const  (Dr. GRPO)
Rows with no trained token do not count. For micro-batching, LossInputs.num_tokens /
num_seqs override the local token / non-empty-row counts with global ones.
"""

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

LOG_RATIO_CLIP = 20.0

IS_CORRECTIONS = ("none", "tis_token", "tis_seq", "mis_token", "mis_seq")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
DECOUPLED_CAP_MODES = ("truncate", "mask")


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Loss hyper-parameters (hashable, so it can be a static argument of jax.jit)."""

    clip_eps: float = 0.2  # lower clip: ratio >= 1 - clip_eps
    clip_eps_high: float | None = None  # upper clip: ratio <= 1 + clip_eps_high (DAPO); None = same
    dual_clip_c: float | None = None  # dual clip for A < 0 (Ye et al. 2020); must be > 1
    is_correction: str = "none"  # one of IS_CORRECTIONS
    is_cap: float = 2.0  # TIS truncation / MIS mask bound (>= 1)
    decoupled_cap: float | None = None  # decoupled_ppo behaviour-weight cap (> 0) or None
    decoupled_cap_mode: str = "truncate"  # "truncate": min(w, cap); "mask": w > cap -> 0 (AReaL)
    aggregation: str = "token_mean"  # one of AGGREGATIONS
    kl_coef: float = 0.0  # k3 KL penalty to ref_logp; 0 = off
    loss_norm_const: float | None = None  # required by "seq_mean_token_sum_norm"

    def __post_init__(self):
        def bad(field: str, valid: str):
            value = getattr(self, field)
            raise ValueError(f"LossConfig.{field}={value!r} is invalid; expected {valid}")

        if not self.clip_eps > 0:
            bad("clip_eps", "a float > 0")
        if self.clip_eps_high is not None and not self.clip_eps_high > 0:
            bad("clip_eps_high", "None or a float > 0")
        if self.dual_clip_c is not None and not self.dual_clip_c > 1:
            bad("dual_clip_c", "None or a float > 1 (e.g. 3.0)")
        if self.is_correction not in IS_CORRECTIONS:
            bad("is_correction", f"one of {IS_CORRECTIONS}")
        if not self.is_cap >= 1:
            bad("is_cap", "a float >= 1")
        if self.decoupled_cap is not None and not self.decoupled_cap > 0:
            bad("decoupled_cap", "None or a float > 0 (e.g. 5.0)")
        if self.decoupled_cap_mode not in DECOUPLED_CAP_MODES:
            bad("decoupled_cap_mode", f"one of {DECOUPLED_CAP_MODES}")
        if self.aggregation not in AGGREGATIONS:
            bad("aggregation", f"one of {AGGREGATIONS}")
        if not self.kl_coef >= 0:
            bad("kl_coef", "a float >= 0")
        if self.loss_norm_const is not None and not self.loss_norm_const > 0:
            bad("loss_norm_const", "None or a float > 0")
        if self.aggregation == "seq_mean_token_sum_norm" and self.loss_norm_const is None:
            bad("loss_norm_const", "a float > 0 with aggregation='seq_mean_token_sum_norm'")

    @property
    def eps_low(self) -> float:
        """Lower clip range: ratio >= 1 - eps_low."""
        return self.clip_eps

    @property
    def eps_high(self) -> float:
        """Upper clip range: ratio <= 1 + eps_high."""
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "logp",
        "behavior_logp",
        "advantages",
        "mask",
        "proximal_logp",
        "ref_logp",
        "num_tokens",
        "num_seqs",
    ],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class LossInputs:
    """Per-token loss inputs (a pytree; optional fields may be None)."""

    logp: jax.Array  # [B, T] current policy log-probs of the sampled tokens (differentiable)
    behavior_logp: jax.Array  # [B, T] log-probs under the sampling policy (engine)
    advantages: jax.Array  # [B] per sequence (broadcast over tokens) or [B, T]
    mask: jax.Array  # [B, T] 1 = trained token, 0 = prompt / padding
    proximal_logp: jax.Array | None = None  # [B, T] learner params at the start of the update
    ref_logp: jax.Array | None = None  # [B, T] reference policy, for the KL penalty / metric
    num_tokens: jax.Array | None = None  # scalar: global trained-token count (micro-batching)
    num_seqs: jax.Array | None = None  # scalar: global non-empty-sequence count


@dataclasses.dataclass(frozen=True)
class TokenTerms:
    """What a registered loss returns: per-token loss and diagnostics, all [B, T]."""

    loss: jax.Array  # per-token loss before aggregation (IS weight applied)
    ratio: jax.Array  # the ratio that enters the clipped surrogate
    log_ratio: jax.Array  # token log(pi_theta / denominator), for approx_kl
    clipped_low: jax.Array  # bool: ratio < 1 - eps_low and A < 0 (gradient cut)
    clipped_high: jax.Array  # bool: ratio > 1 + eps_high and A > 0 (gradient cut)
    dual_clipped: jax.Array  # bool: dual clip active (A < 0, ratio > c)
    is_weight: jax.Array  # stop-gradient weight multiplied into the loss (1 when none)
    is_masked: jax.Array  # bool: token dropped by MIS / decoupled mask


LossFn = Callable[[LossInputs, LossConfig], TokenTerms]


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """A registered loss and the properties that the learner and the config read.

    Code outside this module never compares a loss's name: it asks `loss_spec(name)` (or
    `needs_proximal`, `token_level`, `policy_losses`) instead, so a loss registered by a
    user's module behaves like a built-in one.
    """

    name: str
    fn: LossFn
    # Reads LossInputs.proximal_logp (the params at the start of the update) even without an
    # is_correction; the learner then supplies it (decoupled_ppo).
    needs_proximal: bool = False
    # A token's loss depends on the other tokens of its sequence (gspo's sequence ratio):
    # rows packed with several sequences would mix them.
    sequence_level: bool = False
    # Accepts cfg.is_correction; False: is_correction must be "none" (decoupled_ppo carries
    # its own behaviour weight).
    accepts_is_correction: bool = True
    # Trains on demonstrations (the warm start): behaviour log-probs and advantages unused
    # (advantages may be None); the learner reports only its loss. Not an RL policy loss, so
    # not a valid algorithm.loss.
    supervised: bool = False

    def __call__(self, inputs: LossInputs, cfg: LossConfig) -> TokenTerms:
        return self.fn(inputs, cfg)


LOSSES: dict[str, LossSpec] = {}


def register_loss(
    name: str,
    fn: LossFn | None = None,
    *,
    needs_proximal: bool = False,
    sequence_level: bool = False,
    accepts_is_correction: bool = True,
    supervised: bool = False,
) -> Any:
    """Register `fn(inputs, cfg) -> TokenTerms` under `name`, with its properties (LossSpec).

    As a decorator, `@register_loss(name, needs_proximal=True)`, it returns the function
    unchanged; called with `fn`, `register_loss(name, fn, ...)`, it registers and returns `fn`.
    The function receives LossInputs already cleaned by compute_loss: float32 arrays, every
    per-token array 0 at masked positions, advantages [B, T], mask float 0/1.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a loss name must be a non-empty str, got {name!r}")

    def wrap(fn: LossFn) -> LossFn:
        if name in LOSSES:
            raise ValueError(f"loss {name!r} is already registered")
        if not callable(fn):
            raise TypeError(f"loss {name!r}: expected a callable fn(inputs, cfg), got {fn!r}")
        LOSSES[name] = LossSpec(
            name,
            fn,
            needs_proximal=bool(needs_proximal),
            sequence_level=bool(sequence_level),
            accepts_is_correction=bool(accepts_is_correction),
            supervised=bool(supervised),
        )
        return fn

    return wrap if fn is None else wrap(fn)


def loss_spec(name: str) -> LossSpec:
    """The registered LossSpec of `name`; ValueError listing the valid names if unknown."""
    spec = LOSSES.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ValueError(f"unknown loss {name!r}; valid names: {sorted(LOSSES)}")
    return spec


def policy_losses() -> tuple[str, ...]:
    """Registered RL policy losses (not supervised), in registration order: algorithm.loss."""
    return tuple(n for n, s in LOSSES.items() if not s.supervised)


def needs_proximal(loss: str, is_correction: str) -> bool:
    """Whether an update with `loss` and `is_correction` needs proximal_logp.

    True when the loss reads it (LossSpec.needs_proximal) or an is_correction is set (the
    trust region is then taken around the proximal policy). Unknown names raise ValueError.
    """
    spec = loss_spec(loss)
    if is_correction not in IS_CORRECTIONS:
        raise ValueError(f"unknown is_correction {is_correction!r}; valid: {IS_CORRECTIONS}")
    return spec.needs_proximal or is_correction != "none"


def token_level(loss: str, cfg: LossConfig) -> bool:
    """Whether `loss` under `cfg` only sums per-token terms over a global token count.

    Then each token's term depends on its own token alone and the normaliser on the batch,
    so rows packed with several sequences give exactly the unpacked loss.
    """
    if loss_spec(loss).sequence_level:
        return False
    return cfg.aggregation == "token_mean" and not cfg.is_correction.endswith("_seq")


def _exp(log_x: jax.Array) -> jax.Array:
    """exp of a log-ratio clipped to +-LOG_RATIO_CLIP (finite, no gradient beyond the clip)."""
    return jnp.exp(jnp.clip(log_x, -LOG_RATIO_CLIP, LOG_RATIO_CLIP))


def _clipped_surrogate(
    ratio: jax.Array, adv: jax.Array, cfg: LossConfig
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-token PPO loss -min(r A, clip(r) A), with the dual clip max(., c A) for A < 0."""
    lo, hi = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    obj = jnp.minimum(ratio * adv, jnp.clip(ratio, lo, hi) * adv)
    dual_clipped = jnp.zeros(ratio.shape, bool)
    if cfg.dual_clip_c is not None:
        # Ye et al. 2020: for A < 0 the objective is max(min(r A, clip(r) A), c A), which
        # bounds the loss of a very large ratio at -c A (and cuts its gradient).
        floor = cfg.dual_clip_c * adv
        dual_clipped = (adv < 0) & (obj < floor)
        obj = jnp.where(adv < 0, jnp.maximum(obj, floor), obj)
    stats = {
        "clipped_low": (ratio < lo) & (adv < 0),
        "clipped_high": (ratio > hi) & (adv > 0),
        "dual_clipped": dual_clipped,
    }
    return -obj, stats


def _seq_sum(x_BT: jax.Array, m_BT: jax.Array) -> jax.Array:
    """Masked sum over tokens, [B, 1]."""
    return (x_BT * m_BT).sum(-1, keepdims=True)


def _is_weight(x: LossInputs, cfg: LossConfig) -> tuple[jax.Array, jax.Array]:
    """Stop-gradient mismatch weight [B, T] and its dropped-token mask, per cfg.is_correction."""
    m = x.mask
    if cfg.is_correction == "none":
        return jnp.ones_like(m), jnp.zeros(m.shape, bool)
    kind, level = cfg.is_correction.split("_")
    log_w = x.proximal_logp - x.behavior_logp  # [B, T], 0 at masked positions
    if level == "seq":
        log_w = jnp.broadcast_to(_seq_sum(log_w, m), m.shape)
    log_w = jnp.clip(log_w, -LOG_RATIO_CLIP, LOG_RATIO_CLIP)
    w = jnp.exp(log_w)
    log_cap = jnp.log(cfg.is_cap)
    if kind == "tis":
        w, dropped = jnp.minimum(w, cfg.is_cap), jnp.zeros(m.shape, bool)
    else:  # mis
        dropped = (log_w > log_cap) | (log_w < -log_cap)
        w = jnp.where(dropped, 0.0, w)
    return jax.lax.stop_gradient(w), dropped & (m > 0)


def _denominator(x: LossInputs, cfg: LossConfig) -> jax.Array:
    """The ratio's denominator: proximal_logp under an is_correction, else behavior_logp."""
    return x.behavior_logp if cfg.is_correction == "none" else x.proximal_logp


@register_loss("ppo_clip")
def ppo_clip(x: LossInputs, cfg: LossConfig) -> TokenTerms:
    """PPO clipped surrogate against behavior_logp (or proximal_logp + IS weight)."""
    log_ratio = x.logp - _denominator(x, cfg)
    ratio = _exp(log_ratio)
    loss, stats = _clipped_surrogate(ratio, x.advantages, cfg)
    w, dropped = _is_weight(x, cfg)
    return TokenTerms(loss * w, ratio, log_ratio, is_weight=w, is_masked=dropped, **stats)


@register_loss("decoupled_ppo", needs_proximal=True, accepts_is_correction=False)
def decoupled_ppo(x: LossInputs, cfg: LossConfig) -> TokenTerms:
    """Decoupled PPO: clip around pi_proximal, times sg(pi_proximal / pi_behavior) capped."""
    log_ratio = x.logp - x.proximal_logp
    ratio = _exp(log_ratio)
    loss, stats = _clipped_surrogate(ratio, x.advantages, cfg)
    w = _exp(x.proximal_logp - x.behavior_logp)
    dropped = jnp.zeros(w.shape, bool)
    if cfg.decoupled_cap is not None:
        if cfg.decoupled_cap_mode == "truncate":
            w = jnp.minimum(w, cfg.decoupled_cap)
        else:
            dropped = (w > cfg.decoupled_cap) & (x.mask > 0)
            w = jnp.where(dropped, 0.0, w)
    w = jax.lax.stop_gradient(w)
    return TokenTerms(loss * w, ratio, log_ratio, is_weight=w, is_masked=dropped, **stats)


@register_loss("gspo", sequence_level=True)
def gspo(x: LossInputs, cfg: LossConfig) -> TokenTerms:
    """GSPO(-token): clipped surrogate on the length-normalised sequence ratio."""
    m = x.mask
    log_ratio = x.logp - _denominator(x, cfg)  # [B, T]
    seq_log_ratio_B1 = _seq_sum(log_ratio, m) / jnp.maximum(m.sum(-1, keepdims=True), 1.0)
    seq_log_ratio_B1 = jnp.clip(seq_log_ratio_B1, -LOG_RATIO_CLIP, LOG_RATIO_CLIP)
    # s_it = sg(s_i) * pi(y_t) / sg(pi(y_t)): value s_i, gradient s_i * grad logp_t.
    tok_log_ratio = jax.lax.stop_gradient(seq_log_ratio_B1) + (
        x.logp - jax.lax.stop_gradient(x.logp)
    )
    ratio = jnp.exp(tok_log_ratio)
    loss, stats = _clipped_surrogate(ratio, x.advantages, cfg)
    w, dropped = _is_weight(x, cfg)
    return TokenTerms(loss * w, ratio, log_ratio, is_weight=w, is_masked=dropped, **stats)


@register_loss("sft", supervised=True, accepts_is_correction=False)
def sft(x: LossInputs, cfg: LossConfig) -> TokenTerms:
    """Supervised warm start: per-token negative log-likelihood -logp (no ratio, no weight)."""
    del cfg
    no = jnp.zeros(x.mask.shape, bool)
    one = jnp.ones_like(x.mask)
    return TokenTerms(-x.logp, one, jnp.zeros_like(x.logp), no, no, no, one, no)


def _num_seqs(m_BT: jax.Array) -> jax.Array:
    """Number of rows with at least one trained token."""
    return (m_BT.sum(-1) > 0).sum().astype(m_BT.dtype)


def aggregate(
    loss_BT: jax.Array,
    mask_BT: jax.Array,
    cfg: LossConfig,
    *,
    num_tokens: jax.Array | None = None,
    num_seqs: jax.Array | None = None,
) -> jax.Array:
    """Reduce a per-token loss [B, T] to a scalar by cfg.aggregation (see module docstring)."""
    m = mask_BT.astype(loss_BT.dtype)
    lm = jnp.where(m > 0, loss_BT, 0.0)
    if cfg.aggregation == "token_mean":
        n = m.sum() if num_tokens is None else num_tokens
        return lm.sum() / jnp.maximum(n, 1.0)
    n_seqs = _num_seqs(m) if num_seqs is None else num_seqs
    if cfg.aggregation == "seq_mean_token_mean":
        per_seq_B = lm.sum(-1) / jnp.maximum(m.sum(-1), 1.0)
    else:  # seq_mean_token_sum_norm
        per_seq_B = lm.sum(-1) / cfg.loss_norm_const
    return per_seq_B.sum() / jnp.maximum(n_seqs, 1.0)


def _prepare(inputs: LossInputs | Mapping[str, Any], supervised: bool = False) -> LossInputs:
    """Validate shapes, cast to float32, zero every per-token array at masked positions.

    A supervised loss may leave advantages None (they are then zeros).
    """
    if isinstance(inputs, Mapping):
        unknown = set(inputs) - {f.name for f in dataclasses.fields(LossInputs)}
        if unknown:
            raise ValueError(
                f"unknown loss inputs {sorted(unknown)}; valid: "
                f"{[f.name for f in dataclasses.fields(LossInputs)]}"
            )
        inputs = LossInputs(**inputs)
    logp = jnp.asarray(inputs.logp)
    dtype = jnp.promote_types(logp.dtype, jnp.float32)
    if logp.ndim != 2:
        raise ValueError(f"logp must be [B, T], got shape {logp.shape}")
    B, T = logp.shape
    mask_bool = jnp.asarray(inputs.mask)
    if mask_bool.shape != (B, T):
        raise ValueError(f"mask shape {mask_bool.shape} must equal logp shape {(B, T)}")
    mask_bool = mask_bool.astype(bool)

    def per_token(name: str, x):
        if x is None:
            return None
        x = jnp.asarray(x, dtype)
        if x.shape != (B, T):
            raise ValueError(f"{name} shape {x.shape} must equal logp shape {(B, T)}")
        return jnp.where(mask_bool, x, 0.0)

    adv = inputs.advantages
    adv = jnp.zeros((B,), dtype) if adv is None and supervised else jnp.asarray(adv, dtype)
    if adv.shape == (B,):
        adv = jnp.broadcast_to(adv[:, None], (B, T))
    elif adv.shape != (B, T):
        raise ValueError(f"advantages shape {adv.shape} must be [B]={(B,)} or [B, T]={(B, T)}")
    return LossInputs(
        logp=per_token("logp", logp),
        behavior_logp=per_token("behavior_logp", inputs.behavior_logp),
        advantages=jnp.where(mask_bool, adv, 0.0),
        mask=mask_bool.astype(dtype),
        proximal_logp=per_token("proximal_logp", inputs.proximal_logp),
        ref_logp=per_token("ref_logp", inputs.ref_logp),
        num_tokens=inputs.num_tokens,
        num_seqs=inputs.num_seqs,
    )


def compute_loss(
    name: str, inputs: LossInputs | Mapping[str, Any], cfg: LossConfig
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Scalar loss and scalar metrics (token means over trained tokens) of loss `name`.

    Metrics: loss, pg_loss, clip_fraction (= low + high), clip_fraction_low,
    clip_fraction_high, dual_clip_fraction, approx_kl (k3 of pi_theta vs the ratio's
    denominator), ratio_mean, ratio_max, is_weight_mean, masked_fraction, num_tokens,
    and kl (k3 vs ref_logp) when ref_logp is given, drift_kl and drift_ess (the behaviour
    policy against the proximal one) when proximal_logp is given. Entropy needs full logits:
    the learner.
    """
    spec = loss_spec(name)
    if cfg.is_correction != "none" and not spec.accepts_is_correction:
        raise ValueError(
            f"loss {name!r} takes no is_correction (registered with accepts_is_correction="
            f"False, e.g. it carries its own behaviour weight); "
            f"is_correction={cfg.is_correction!r} must be 'none' with it"
        )
    x = _prepare(inputs, supervised=spec.supervised)
    if spec.needs_proximal and x.proximal_logp is None:
        raise ValueError(f"loss {name!r} needs proximal_logp (got None)")
    if cfg.is_correction != "none" and x.proximal_logp is None:
        raise ValueError(f"is_correction={cfg.is_correction!r} needs proximal_logp (got None)")
    if cfg.kl_coef > 0 and x.ref_logp is None:
        raise ValueError(f"kl_coef={cfg.kl_coef} needs ref_logp (got None)")

    terms = spec.fn(x, cfg)
    m = x.mask
    agg = functools.partial(aggregate, mask_BT=m, cfg=cfg, num_tokens=x.num_tokens)
    agg = functools.partial(agg, num_seqs=x.num_seqs)
    pg_loss = agg(terms.loss)
    loss = pg_loss
    kl_BT = None
    if x.ref_logp is not None:
        # k3 (Schulman 2020) estimate of KL(pi_theta || pi_ref), as in GRPO.
        d = jnp.clip(x.ref_logp - x.logp, -LOG_RATIO_CLIP, LOG_RATIO_CLIP)
        kl_BT = jnp.exp(d) - d - 1.0
        if cfg.kl_coef > 0:
            loss = agg(terms.loss + cfg.kl_coef * kl_BT)

    sg = jax.lax.stop_gradient
    n_tok = jnp.maximum(m.sum(), 1.0)

    def mean(v):
        return (jnp.where(m > 0, sg(v).astype(m.dtype), 0.0)).sum() / n_tok

    lr = jnp.clip(sg(terms.log_ratio), -LOG_RATIO_CLIP, LOG_RATIO_CLIP)
    low, high = mean(terms.clipped_low), mean(terms.clipped_high)
    metrics = {
        "loss": sg(loss),
        "pg_loss": sg(pg_loss),
        "clip_fraction": low + high,
        "clip_fraction_low": low,
        "clip_fraction_high": high,
        "dual_clip_fraction": mean(terms.dual_clipped),
        "approx_kl": mean(jnp.exp(lr) - 1.0 - lr),
        "ratio_mean": mean(terms.ratio),
        "ratio_max": jnp.where(m > 0, sg(terms.ratio), 0.0).max(),
        "is_weight_mean": mean(terms.is_weight),
        "masked_fraction": mean(terms.is_masked),
        "num_tokens": m.sum(),
    }
    if kl_BT is not None:
        metrics["kl"] = mean(kl_BT)
    if x.proximal_logp is not None and not spec.supervised:
        # Drift of the data from the learner: r = proximal / behaviour on tokens drawn from the
        # behaviour policy; k3 of KL(behaviour || proximal) and the normalised effective sample
        # size (sum r)^2 / (n sum r^2) of the importance weights (1: no drift).
        d = jnp.clip(sg(x.proximal_logp - x.behavior_logp), -LOG_RATIO_CLIP, LOG_RATIO_CLIP)
        r = jnp.where(m > 0, jnp.exp(d), 0.0)
        metrics["drift_kl"] = mean(r - 1.0 - d)
        metrics["drift_ess"] = r.sum() ** 2 / jnp.maximum(n_tok * (r**2).sum(), 1e-30)
    return loss, metrics
