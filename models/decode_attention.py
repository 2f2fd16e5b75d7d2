"""A decode step's attention as one Pallas (Triton) kernel: each (row, kv head) program reads
only the row's valid cache positions, adds the current token from registers and writes that
token's key and value into the cache in place.

The XLA path (models.transformer._decode_attention after _write_slot) runs two scatters, two
batched GEMMs and a masked softmax over the whole allocated cache per layer; on a GPU, where a
decode step is a few hundred small kernels, this one kernel replaces those five.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

BLOCK_S = (64, 32, 16)  # cache positions per inner step: the largest that divides the cache
HEADS_PAD = 16  # query heads of a kv head, padded to Triton's smallest dot tile
WARPS, STAGES = 2, 3  # Triton launch parameters
_NEG = -0.7 * float(np.finfo(np.float32).max)


def supported(q_BNH: jax.Array, num_kv_heads: int, cache_len: int) -> bool:
    """Whether the kernel takes these shapes: a floating q (float32 stays float32), a group of
    at most HEADS_PAD query heads, a power-of-two head dim and a cache of whole blocks."""
    H = q_BNH.shape[-1]
    return (
        q_BNH.dtype in (jnp.bfloat16, jnp.float16, jnp.float32)
        and q_BNH.shape[1] // num_kv_heads <= HEADS_PAD
        and H >= 16
        and H & (H - 1) == 0
        and _block(cache_len) is not None
    )


def _block(cache_len: int) -> int | None:
    return next((b for b in BLOCK_S if cache_len % b == 0), None)


def _kernel(pos_ref, q_ref, kn_ref, vn_ref, k_ref, v_ref, o_ref, k_out, v_out, *, block, G):
    b, h = pl.program_id(0), pl.program_id(1)
    H = q_ref.shape[-1]
    scale = 1.0 / float(np.sqrt(H))
    exact = jax.lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None  # no TF32
    pos = pos_ref[b]
    # The group's G query heads, padded to HEADS_PAD rows by the masked load (rows past G: 0).
    rows = pl.ds(h * G, HEADS_PAD)
    in_group = (jnp.arange(HEADS_PAD) < G)[:, None]
    q = plgpu.load(q_ref.at[b, rows, :], mask=in_group, other=0)  # [HEADS_PAD, H]
    kn, vn = kn_ref[...], vn_ref[...]  # [H]
    f32 = jnp.float32
    # The current token, from registers: it starts the running softmax.
    m = jnp.sum(q.astype(f32) * kn.astype(f32)[None, :], axis=1) * scale  # [HEADS_PAD]
    total = jnp.ones_like(m)  # the softmax denominator so far
    o = jnp.broadcast_to(vn.astype(f32)[None, :], q.shape)

    def body(j, carry):
        o, m, total = carry
        start = pl.multiple_of(j * block, block)
        k = k_ref[b, h, :, pl.ds(start, block)]  # [H, block]
        s = plgpu.dot(q, k, precision=exact) * scale  # float32 [HEADS_PAD, block]
        valid = start + jnp.arange(block) < pos  # cache slots before the current token
        s = jnp.where(valid[None, :], s, _NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        c = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        v = v_ref[b, h, pl.ds(start, block), :]  # [block, H]
        o = c[:, None] * o + plgpu.dot(p.astype(v.dtype), v, precision=exact)
        return o, m_new, c * total + jnp.sum(p, axis=1)

    o, m, total = jax.lax.fori_loop(0, pl.cdiv(pos, block), body, (o, m, total))
    plgpu.store(o_ref.at[b, rows, :], (o / total[:, None]).astype(o_ref.dtype), mask=in_group)
    k_out[b, h, :, pl.ds(pos, 1)] = kn[:, None]
    v_out[b, h, pl.ds(pos, 1), :] = vn[None, :]


def decode_attention(q_BNH, k_BKH, v_BKH, k_cache, v_cache, positions_B, *, interpret=False):
    """(o [B, N, H], k_cache, v_cache): row b's query heads attend to its cache slots
    [0, positions[b]) and the current token (k_BKH, v_BKH), which is written to slot
    positions[b]. k_cache [B, K, H, S], v_cache [B, K, S, H] (models.transformer.KVCache);
    float32 logits and softmax, as the XLA path."""
    B, N, H = q_BNH.shape
    K, S = k_cache.shape[1], k_cache.shape[3]
    kernel = functools.partial(_kernel, block=_block(S), G=N // K)
    one = pl.BlockSpec((None, None, H), lambda b, h: (b, h, 0))  # row b, kv head h
    whole = pl.no_block_spec
    o, k_cache, v_cache = pl.pallas_call(
        kernel,
        grid=(B, K),
        in_specs=[whole, whole, one, one, whole, whole],
        out_specs=[whole, whole, whole],
        out_shape=[
            jax.ShapeDtypeStruct(q_BNH.shape, q_BNH.dtype),
            jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
            jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
        ],
        input_output_aliases={4: 1, 5: 2},
        compiler_params=plgpu.CompilerParams(num_warps=WARPS, num_stages=STAGES),
        interpret=interpret,
        name="tandem_decode_attention",
    )(
        positions_B.astype(jnp.int32),
        q_BNH,
        k_BKH.astype(k_cache.dtype),
        v_BKH.astype(v_cache.dtype),
        k_cache,
        v_cache,
    )
    return o, k_cache, v_cache
