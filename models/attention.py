"""The training forward's causal self-attention: one entry point for every backend.

Packed rows (several sequences per row, told apart by segment ids) cost no [T, T] mask on a GPU:
with segment_lengths, cuDNN's flash attention takes the segments natively (its ragged layout);
the xla path builds the dense segment mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from models.config import RULES


def segment_mask(segment_ids_BT: jax.Array) -> jax.Array:
    """The dense [B, 1, T, T] mask of tokens in the same segment (padding, 0, is one segment)."""
    return (segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :])[:, None]


def segment_lengths(segment_ids_BT) -> np.ndarray:
    """Host-side lengths[B, M] of each row's segments in order, the padding tail counted as one
    more, -1 after the last. M, a power of two, is static in the shape, so a handful of
    compilations. Rows hold contiguous segments numbered from 1 with padding (0) at the end, as
    rl.learner packs them."""
    seg = np.asarray(segment_ids_BT)
    B = seg.shape[0]
    counts = [np.bincount(row, minlength=int(row.max(initial=0)) + 1) for row in seg]
    n = max((int(row.max(initial=0)) + int(c[0] > 0) for row, c in zip(seg, counts)), default=1)
    M = 1 << max(0, n - 1).bit_length()
    out = np.full((B, M), -1, np.int32)
    for b, (row, c) in enumerate(zip(seg, counts)):
        k = int(row.max(initial=0))
        out[b, :k] = c[1 : k + 1]
        if c[0] > 0:
            out[b, k] = c[0]
    return out


def rows_only(x: jax.Array) -> jax.Array:
    """x sharded over its rows alone on the mesh in context (jax.set_mesh), if there is one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    rows = tuple(a for a in RULES["batch"] if mesh.shape.get(a, 1) > 1)
    spec = jax.sharding.PartitionSpec(rows or None, *([None] * (x.ndim - 1)))
    return jax.lax.with_sharding_constraint(x, spec)


def _cudnn_segments(q_BTNH, k_BTKH, v_BTKH, lengths_BM):
    """cuDNN flash attention over packed segments (lengths_BM: segment_lengths)."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    if jax.__version_info__ < (0, 11, 2):  # earlier JAX strode packed K/V by the query heads
        rep = q_BTNH.shape[2] // k_BTKH.shape[2]
        k_BTKH, v_BTKH = (jnp.repeat(x, rep, axis=2) for x in (k_BTKH, v_BTKH))
    lens = lengths_BM.astype(jnp.int32)
    sizes = jnp.maximum(lens, 0)
    starts = jnp.where(lens >= 0, jnp.cumsum(sizes, axis=1) - sizes, -1)
    offsets = jnp.concatenate([starts, jnp.full((lens.shape[0], 1), -1, jnp.int32)], axis=1)
    return fa.dot_product_attention(
        q_BTNH,
        k_BTKH,
        v_BTKH,
        None,
        None,
        lens,
        lens,
        offsets,
        offsets,
        scale=1.0 / float(np.sqrt(q_BTNH.shape[-1])),
        mask_type=fa.MaskType.PADDING_CAUSAL,
        qkv_layout="BTNH",
    )


def attention(
    q_BTNH: jax.Array,
    k_BTKH: jax.Array,
    v_BTKH: jax.Array,
    *,
    segment_ids: jax.Array | None,
    implementation: str,
    segment_lengths: jax.Array | None = None,
) -> jax.Array:
    """Causal grouped-query attention o[B, T, N, H] of q [B, T, N, H] and k/v [B, T, K, H].

    segment_ids[B, T] (packed sequences, 0 = padding) keep each token to its own segment; None
    attends over the whole row. `implementation` is jax.nn.dot_product_attention's ("xla",
    "cudnn"). With segment_lengths (segment_lengths(segment_ids), on the host) cuDNN takes the
    segments natively; otherwise the segments become a dense mask built here.
    """
    if implementation == "cudnn":  # its partitioner needs q, k, v sharded alike
        q_BTNH, k_BTKH, v_BTKH = (rows_only(x) for x in (q_BTNH, k_BTKH, v_BTKH))
    if implementation == "cudnn" and segment_lengths is not None:
        return _cudnn_segments(q_BTNH, k_BTKH, v_BTKH, rows_only(segment_lengths))
    mask = None if segment_ids is None else segment_mask(segment_ids)
    return jax.nn.dot_product_attention(
        q_BTNH, k_BTKH, v_BTKH, mask=mask, is_causal=True, implementation=implementation
    )
