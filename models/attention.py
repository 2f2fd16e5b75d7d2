"""The training forward's causal self-attention: one entry point for every backend."""

from __future__ import annotations

import jax


def segment_mask(segment_ids_BT: jax.Array) -> jax.Array:
    """The dense [B, 1, T, T] mask of tokens in the same segment (padding, 0, is one segment)."""
    return (segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :])[:, None]


def attention(
    q_BTNH: jax.Array,
    k_BTKH: jax.Array,
    v_BTKH: jax.Array,
    *,
    segment_ids: jax.Array | None,
    implementation: str,
) -> jax.Array:
    """Causal grouped-query attention o[B, T, N, H] of q [B, T, N, H] and k/v [B, T, K, H].

    segment_ids[B, T] (packed sequences, 0 = padding) keep each token to its own segment; None
    attends over the whole row. `implementation` is jax.nn.dot_product_attention's ("xla",
    "cudnn"); both take the segments as a dense mask built here.
    """
    mask = None if segment_ids is None else segment_mask(segment_ids)
    return jax.nn.dot_product_attention(
        q_BTNH, k_BTKH, v_BTKH, mask=mask, is_causal=True, implementation=implementation
    )
