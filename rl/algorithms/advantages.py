"""Advantage estimators over groups of sampled answers, registered by name.

Every estimator takes rewards_GN (G groups, e.g. prompts, x N samples per group) and a
boolean valid_GN (False = no sample in that slot, for groups with fewer than N samples)
and returns float32 advantages_GN that are 0 at invalid slots. Statistics only ever use
the valid samples of a group (or of the batch, for reinforce_pp). A group with a single
valid sample has no baseline and gets advantage 0 from every estimator; a group whose
rewards are all equal gets advantage 0 as well.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

AdvantageFn = Callable[..., jax.Array]


@dataclasses.dataclass(frozen=True)
class AdvantageSpec:
    """A registered advantage estimator and the properties the config reads (never its name)."""

    name: str
    fn: AdvantageFn
    # Smallest rollout.group_size that gives a non-zero advantage: 2 for estimators with a
    # per-group baseline (one sample is its own baseline), 1 for a batch-level baseline.
    min_group_size: int = 2

    def __call__(self, rewards_GN: jax.Array, valid_GN: jax.Array, **kw) -> jax.Array:
        return self.fn(rewards_GN, valid_GN, **kw)


ADVANTAGES: dict[str, AdvantageSpec] = {}


def register_advantage(name: str, fn: AdvantageFn | None = None, *, min_group_size: int = 2) -> Any:
    """Register `fn(rewards_GN, valid_GN, *, eps, **kw) -> adv_GN` under `name`.

    As a decorator, `@register_advantage(name)`, it returns the function unchanged; called
    with `fn`, `register_advantage(name, fn, ...)`, it registers and returns `fn`.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"an advantage estimator name must be a non-empty str, got {name!r}")
    if isinstance(min_group_size, bool) or not isinstance(min_group_size, int):
        raise ValueError(f"advantage {name!r}: min_group_size must be an int >= 1")
    if min_group_size < 1:
        raise ValueError(f"advantage {name!r}: min_group_size must be an int >= 1")

    def wrap(fn: AdvantageFn) -> AdvantageFn:
        if name in ADVANTAGES:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        if not callable(fn):
            raise TypeError(f"advantage {name!r}: expected a callable, got {fn!r}")
        ADVANTAGES[name] = AdvantageSpec(name, fn, min_group_size=min_group_size)
        return fn

    return wrap if fn is None else wrap(fn)


def advantage_spec(name: str) -> AdvantageSpec:
    """The registered AdvantageSpec of `name`; ValueError listing the valid names if unknown."""
    spec = ADVANTAGES.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ValueError(f"unknown advantage estimator {name!r}; valid names: {sorted(ADVANTAGES)}")
    return spec


def compute_advantages(
    name: str,
    rewards_GN: jax.Array,
    *,
    valid_GN: jax.Array | None = None,
    eps: float = 1e-6,
    **kw,
) -> jax.Array:
    """Advantages_GN [G, N] (float32, 0 at invalid slots) by the estimator registered as `name`."""
    spec = advantage_spec(name)
    rewards_GN = jnp.asarray(rewards_GN, jnp.float32)
    if rewards_GN.ndim != 2:
        raise ValueError(f"rewards_GN must be [G, N], got shape {rewards_GN.shape}")
    if valid_GN is None:
        valid_GN = jnp.ones(rewards_GN.shape, bool)
    valid_GN = jnp.asarray(valid_GN).astype(bool)
    if valid_GN.shape != rewards_GN.shape:
        raise ValueError(
            f"valid_GN shape {valid_GN.shape} must equal rewards_GN shape {rewards_GN.shape}"
        )
    # Invalid slots may hold anything (NaN included); they never enter a statistic.
    rewards_GN = jnp.where(valid_GN, rewards_GN, 0.0)
    adv_GN = spec.fn(rewards_GN, valid_GN, eps=eps, **kw)
    return jnp.where(valid_GN, adv_GN, 0.0)


def _group_count_mean(r_GN: jax.Array, valid_GN: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-group number of valid samples and their mean reward, both [G, 1]."""
    v_GN = valid_GN.astype(r_GN.dtype)
    n_G1 = v_GN.sum(-1, keepdims=True)
    mean_G1 = (r_GN * v_GN).sum(-1, keepdims=True) / jnp.maximum(n_G1, 1.0)
    return n_G1, mean_G1


@register_advantage("grpo")
def grpo(r_GN: jax.Array, valid_GN: jax.Array, *, eps: float, ddof: int = 0) -> jax.Array:
    """GRPO: (r - group mean) / (group std + eps).

    The std is the POPULATION std (ddof=0, divide by n) by default. TRL's GRPOTrainer and
    verl compute `torch.std`, which is the SAMPLE std (ddof=1, divide by n-1); pass ddof=1
    to match them exactly. DeepSeekMath does not say which.
    """
    n_G1, mean_G1 = _group_count_mean(r_GN, valid_GN)
    d_GN = jnp.where(valid_GN, r_GN - mean_G1, 0.0)
    var_G1 = (d_GN**2).sum(-1, keepdims=True) / jnp.maximum(n_G1 - ddof, 1.0)
    return d_GN / (jnp.sqrt(var_G1) + eps)


@register_advantage("dr_grpo")
def dr_grpo(r_GN: jax.Array, valid_GN: jax.Array, *, eps: float) -> jax.Array:
    """Dr. GRPO (Liu et al. 2025): r - group mean, no std normalisation (eps unused)."""
    del eps
    _, mean_G1 = _group_count_mean(r_GN, valid_GN)
    return r_GN - mean_G1


@register_advantage("rloo")
def rloo(r_GN: jax.Array, valid_GN: jax.Array, *, eps: float) -> jax.Array:
    """RLOO (Ahmadian et al. 2024): r_i - mean of the other n-1 valid rewards of the group."""
    del eps
    n_G1, mean_G1 = _group_count_mean(r_GN, valid_GN)
    sum_G1 = mean_G1 * n_G1
    baseline_GN = (sum_G1 - r_GN) / jnp.maximum(n_G1 - 1.0, 1.0)
    return jnp.where(n_G1 > 1, r_GN - baseline_GN, 0.0)


@register_advantage("reinforce_pp")
def reinforce_pp(r_GN: jax.Array, valid_GN: jax.Array, *, eps: float, ddof: int = 0) -> jax.Array:
    """REINFORCE++-baseline (Hu et al. 2025): r - group mean, divided by the batch std + eps.

    The batch std is the population std (ddof=0) of the group-centred rewards over every
    valid sample of the batch (per sequence; OpenRLHF/verl whiten per token instead). The
    batch mean of group-centred rewards is exactly 0, so whitening reduces to this division.
    """
    _, mean_G1 = _group_count_mean(r_GN, valid_GN)
    d_GN = jnp.where(valid_GN, r_GN - mean_G1, 0.0)
    n = valid_GN.sum().astype(r_GN.dtype)
    batch_mean = d_GN.sum() / jnp.maximum(n, 1.0)
    batch_var = (jnp.where(valid_GN, d_GN - batch_mean, 0.0) ** 2).sum() / jnp.maximum(
        n - ddof, 1.0
    )
    return d_GN / (jnp.sqrt(batch_var) + eps)
