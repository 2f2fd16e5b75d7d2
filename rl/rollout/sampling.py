"""Token sampling of the JAX sampler: temperature and top-k / top-p truncation of a row's
logits, one inverse-CDF draw per row, and the per-request key of an integer seed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def process_logits(
    logits_BV: jax.Array,
    temperature_B: jax.Array,
    top_k_B: jax.Array,
    top_p_B: jax.Array,
    truncate: bool | None = None,
) -> jax.Array:
    """Temperature, then top-k and top-p truncation (masked to -inf). Greedy rows use T=1.

    truncate: whether any row truncates, if the caller knows (static): without truncation the
    scaled logits stay a fusion the sampler's reductions read; None decides on the device
    (a conditional, whose result is then written out whole).
    """
    x = logits_BV.astype(jnp.float32) / scale_of(temperature_B)[:, None]
    if truncate is not None:
        return _truncate(x, top_k_B, top_p_B) if truncate else x
    # The vocabulary sort only runs when some row truncates (top-k or top-p on).
    truncate = jnp.any((top_k_B > 0) | (top_p_B < 1.0))
    return jax.lax.cond(truncate, _truncate, lambda x, *_: x, x, top_k_B, top_p_B)


def scale_of(temperature_B: jax.Array) -> jax.Array:
    """What a row's logits are divided by: its temperature, 1 for greedy rows (T = 0)."""
    return jnp.where(temperature_B > 0, temperature_B, 1.0)


def uniforms(keys_B2: jax.Array) -> jax.Array:
    """Each row's one uniform draw in [0, 1) from its key (the inverse CDF's target)."""
    return jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys_B2)


def _truncate(x: jax.Array, top_k_B: jax.Array, top_p_B: jax.Array) -> jax.Array:
    V = x.shape[-1]
    sorted_x = jnp.sort(x, axis=-1)[:, ::-1]
    k = jnp.where(top_k_B > 0, jnp.minimum(top_k_B, V), V)
    kth = jnp.take_along_axis(sorted_x, (k - 1)[:, None], axis=-1)
    x = jnp.where(x < kth, -jnp.inf, x)
    # top-p: keep the smallest prefix of the sorted distribution with mass >= p.
    sorted_x = jnp.where(sorted_x < kth, -jnp.inf, sorted_x)
    probs = jax.nn.softmax(sorted_x, axis=-1)
    cum_before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = cum_before < top_p_B[:, None]
    cutoff = jnp.min(jnp.where(keep_sorted, sorted_x, jnp.inf), axis=-1, keepdims=True)
    x = jnp.where((top_p_B[:, None] < 1.0) & (x < cutoff), -jnp.inf, x)
    return x


SAMPLE_BLOCK = 512  # vocabulary entries per block of the two-level inverse CDF


def sample(x_BV, keys_B2, temperature_B):
    """Samples one token per row from processed logits; returns (token, its log-prob).

    Inverse-CDF sampling: one uniform draw per row (a Gumbel draw per vocabulary entry costs
    the CPU more than the tiny model's step), the first token whose cumulative probability
    exceeds it; tokens of zero probability are never drawn. Large vocabularies find the draw in
    two levels (the block, then the token within it), so no pass scans the whole row: a
    full-row cumulative sum is a multi-pass scan on accelerators. The whole row is read twice:
    each block's argmax (which gives the row max and the greedy token), then each block's mass.
    """
    B, V = x_BV.shape
    blk = SAMPLE_BLOCK if V > 4 * SAMPLE_BLOCK else V
    nb = -(-V // blk)
    x3 = jnp.pad(x_BV, ((0, 0), (0, nb * blk - V)), constant_values=-jnp.inf).reshape(B, nb, blk)
    barg = jnp.argmax(x3, axis=-1)  # [B, nb]: each block's first maximum
    bmax = jnp.take_along_axis(x3, barg[:, :, None], axis=-1)[:, :, 0]
    top = jnp.argmax(bmax, axis=-1)  # the block of the row's first maximum
    greedy = top * blk + jnp.take_along_axis(barg, top[:, None], axis=1)[:, 0]
    m = jnp.take_along_axis(bmax, top[:, None], axis=1)  # [B, 1]
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    bsum = jnp.sum(jnp.exp(x3 - m[:, :, None]), axis=-1)  # [B, nb]; masked entries add 0
    bcdf = jnp.cumsum(bsum, axis=-1)
    total = bcdf[:, -1]
    target = uniforms(keys_B2) * total

    def first_above(cdf, mass, t):
        """Index of the first entry whose cumulative mass exceeds t; rounding may put t at the
        total: the last entry of nonzero mass then."""
        i = jnp.sum(cdf <= t[:, None], axis=-1)
        n = cdf.shape[-1]
        last = n - 1 - jnp.argmax((mass > 0)[:, ::-1], axis=-1)
        return jnp.minimum(i, last)

    j = first_above(bcdf, bsum, target)
    within = jnp.exp(jnp.take_along_axis(x3, j[:, None, None], axis=1)[:, 0] - m)  # [B, blk]
    prev = jnp.pad(bcdf, ((0, 0), (1, 0)))  # the mass before each block
    before = jnp.take_along_axis(prev, j[:, None], axis=1)[:, 0]
    i = first_above(before[:, None] + jnp.cumsum(within, axis=-1), within, target)
    sampled = j * blk + i
    tok = jnp.where(temperature_B > 0, sampled, greedy).astype(jnp.int32)
    x_tok = jnp.take_along_axis(x_BV, tok[:, None], axis=-1)[:, 0]
    return tok, x_tok - m[:, 0] - jnp.log(total)


def key_data(seed: int) -> np.ndarray:
    """uint32 [2] threefry key of an integer seed: jax.random.PRNGKey(seed) for 0 <= seed < 2**32,
    and all 64 bits of larger seeds (PRNGKey keeps only 32 of them without x64)."""
    s = int(seed) & 0xFFFFFFFFFFFFFFFF
    return np.array([s >> 32, s & 0xFFFFFFFF], np.uint32)
