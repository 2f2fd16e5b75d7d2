"""A decode step's attention as one Pallas (Triton) kernel: each (row, kv head) program reads
only the row's valid cache positions, adds the current token from registers and writes that
token's key and value into the cache in place.

The XLA path (models.kv_cache.xla_decode_attention after write_slot) runs two scatters, two
batched GEMMs and a masked softmax over the whole allocated cache per layer, and before them
the split of the fused q/k/v projection and rotary; on a GPU, where a decode step is a few
hundred small kernels, this one kernel replaces them (rotary only for models without q/k norms,
which come between the projection and rotary).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

try:
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # a jax without Pallas's Triton backend: XLA's decode attention only
    plgpu = None

BLOCK_S = (64, 32, 16)  # cache positions per inner step: the largest that divides the cache
HEADS_PAD = 16  # query heads of a kv head, padded to Triton's smallest dot tile
WARPS, STAGES = 2, 3  # Triton launch parameters
# Programs per (row, kv head), each over its share of the row's valid blocks (split-KV), their
# partial softmaxes combined after the kernel: more programs in flight for short rows.
SPLITS = 1
_NEG = -0.7 * float(np.finfo(np.float32).max)


def available() -> bool:
    """Whether this jax has Pallas's Triton backend, which the kernel is written in."""
    return plgpu is not None


def supported(dtype, num_heads: int, num_kv_heads: int, head_dim: int, cache_len: int) -> bool:
    """Whether the kernel takes these shapes: a floating compute dtype (float32 stays float32),
    at most HEADS_PAD query heads per kv head, a power-of-two head dim and a cache of whole
    blocks."""
    H = head_dim
    return (
        available()
        and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16, jnp.float32)
        and num_heads // num_kv_heads <= HEADS_PAD
        and H >= 32  # rotary in the kernel takes the head dim in halves of 16 or more
        and H & (H - 1) == 0
        and _block(cache_len) is not None
    )


def _block(cache_len: int) -> int | None:
    return next((b for b in BLOCK_S if cache_len % b == 0), None)


def row_inv_rms(x_ref, b, eps: float):
    """In a kernel: 1/rms of row b of x_ref [B, D] in float32 (D padded to a power of two by a
    masked load, as Triton's blocks are)."""
    D = x_ref.shape[-1]
    Dp = pl.next_power_of_2(D)
    row = plgpu.load(x_ref.at[b, pl.ds(0, Dp)], mask=jnp.arange(Dp) < D, other=0)
    row = row.astype(jnp.float32)
    return jax.lax.rsqrt(jnp.sum(row * row) / D + eps)


def _kernel(
    pos_ref,
    q_ref,
    kn_ref,
    vn_ref,
    cos_ref,
    sin_ref,
    x_ref,
    bias_ref,
    k_ref,
    v_ref,
    o_ref,
    k_out,
    v_out,
    *stats,
    block,
    G,
    q0,
    k0,
    v0,
    splits,
    k_pos,
    eps,
):
    """Program (b, h[, p]): query rows q0 + h G .. of q_ref, key row k0 + h, value row v0 + h;
    with splits > 1, part p of the row's valid blocks, its unnormalized output and softmax
    statistics written to o_ref [B, K, splits, HEADS_PAD, H] and stats (max, sum). With x_ref
    (the layer's input [B, D]) the projection is of the unnormalized input with the norm's
    weight folded in: each head is scaled by the row's 1/rms, then bias_ref's row is added."""
    b, h = pl.program_id(0), pl.program_id(1)
    part = pl.program_id(2) if splits > 1 else 0
    H = q_ref.shape[-1]
    # With rotary here the head dim is taken in halves (rotate-half pairs d with d + H/2).
    parts = (pl.ds(0, H),) if cos_ref is None else (pl.ds(0, H // 2), pl.ds(H // 2, H // 2))
    dtype, f32 = q_ref.dtype, jnp.float32
    scale = 1.0 / float(np.sqrt(H))
    exact = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None  # no TF32
    pos = pos_ref[b]
    # The group's G query heads, padded to HEADS_PAD rows by the masked load (rows past G: 0).
    rows = pl.ds(q0 + h * G, HEADS_PAD)
    in_group = (jnp.arange(HEADS_PAD) < G)[:, None]
    q = [plgpu.load(q_ref.at[b, rows, d], mask=in_group, other=0).astype(f32) for d in parts]
    kn = [kn_ref[b, k0 + h, d].astype(f32) for d in parts]
    vn = vn_ref[b, v0 + h, :]
    if x_ref is not None:  # the input norm, folded: 1/rms of the row, then the bias
        scale_b = row_inv_rms(x_ref, b, eps)
        q, kn = [scale_b * y for y in q], [scale_b * y for y in kn]
        vn = scale_b * vn.astype(f32)
        if bias_ref is not None:
            bq = [plgpu.load(bias_ref.at[rows, d], mask=in_group, other=0) for d in parts]
            q = [y + c.astype(f32) for y, c in zip(q, bq)]
            kn = [y + bias_ref[k0 + h, d].astype(f32) for y, d in zip(kn, parts)]
            vn = vn + bias_ref[v0 + h, :].astype(f32)
    if cos_ref is not None:  # rotary here, as models.transformer.apply_rotary computes it
        cos, sin = cos_ref[b, parts[0]].astype(f32), sin_ref[b, parts[0]].astype(f32)
        rot = lambda lo, hi: (lo * cos - hi * sin, hi * cos + lo * sin)
        q, kn = list(rot(*q)), list(rot(*kn))
    q = [x.astype(dtype) for x in q]  # the dot operands in the compute dtype, as XLA's
    kn = [x.astype(dtype) for x in kn]
    vn = vn.astype(vn_ref.dtype)
    # The current token, from registers: it starts the running softmax.
    m = sum(jnp.sum(x.astype(f32) * y.astype(f32)[None, :], axis=1) for x, y in zip(q, kn))
    m = m * scale  # [HEADS_PAD]
    total = jnp.ones_like(m)  # the softmax denominator so far
    o = jnp.broadcast_to(vn.astype(f32)[None, :], (HEADS_PAD, H))
    n_blocks = pl.cdiv(pos, block)
    lo, hi = 0, n_blocks
    if splits > 1:  # the current token belongs to part 0; the others start empty
        per = pl.cdiv(n_blocks, splits)
        lo = part * per
        hi = jnp.minimum(n_blocks, lo + per)
        first = part == 0
        m = jnp.where(first, m, _NEG)
        total = jnp.where(first, total, 0.0)
        o = jnp.where(first, o, 0.0)

    def body(j, carry):
        o, m, total = carry
        start = pl.multiple_of(j * block, block)
        cols = pl.ds(start, block)
        # Keys [B, K, H, S] (k_pos 3) or [B, K, S, H] (k_pos 2: a block is one contiguous run).
        ks = [k_ref[b, h, d, cols] if k_pos == 3 else k_ref[b, h, cols, d] for d in parts]
        v = v_ref[b, h, cols, :]  # [block, H]
        t = k_pos == 2  # keys [block, H] against q [HEADS_PAD, H]
        s = sum(plgpu.dot(x, k, trans_b=t, precision=exact) for x, k in zip(q, ks))
        s = s * scale  # float32 [HEADS_PAD, block]
        valid = start + jnp.arange(block) < pos  # cache slots before the current token
        s = jnp.where(valid[None, :], s, _NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        c = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        o = c[:, None] * o + plgpu.dot(p.astype(v.dtype), v, precision=exact)
        return o, m_new, c * total + jnp.sum(p, axis=1)

    o, m, total = jax.lax.fori_loop(lo, hi, body, (o, m, total))
    if splits > 1:
        o_ref[b, h, part] = o
        m_ref, l_ref = stats
        m_ref[b, h, part] = m
        l_ref[b, h, part] = total
    else:
        out_rows = pl.ds(h * G, HEADS_PAD)
        o = (o / total[:, None]).astype(o_ref.dtype)
        plgpu.store(o_ref.at[b, out_rows, :], o, mask=in_group)

    @pl.when(part == 0)
    def _():
        for x, d in zip(kn, parts):
            if k_pos == 3:
                k_out[b, h, d, pl.ds(pos, 1)] = x.astype(k_out.dtype)[:, None]
            else:
                k_out[b, h, pl.ds(pos, 1), d] = x.astype(k_out.dtype)[None, :]
        v_out[b, h, pl.ds(pos, 1), :] = vn.astype(v_out.dtype)[None, :]


def _call(q, kn, vn, rope, k_cache, v_cache, positions_B, offsets, N, k_pos, interpret, norm=None):
    if k_pos not in (2, 3):
        raise ValueError(f"decode_attention: k_pos={k_pos!r}; valid: 2, 3")
    B, H = q.shape[0], q.shape[-1]
    K, S = k_cache.shape[1], v_cache.shape[2]
    q0, k0, v0 = offsets
    P = max(1, min(SPLITS, S // _block(S)))
    G = N // K
    x, bias, eps = norm if norm is not None else (None, None, 0.0)
    eps = float(eps)  # a Python number: the kernel takes no traced constants
    kernel = functools.partial(
        _kernel, block=_block(S), G=G, q0=q0, k0=k0, v0=v0, splits=P, k_pos=k_pos, eps=eps
    )
    whole = pl.no_block_spec
    cos, sin = rope if rope is not None else (None, None)
    optional = (cos, sin, x, bias)
    n_in = 4 + sum(a is not None for a in optional)  # operands before the caches
    f32 = jnp.float32
    if P == 1:
        o_shape = [jax.ShapeDtypeStruct((B, N, H), q.dtype)]
    else:  # unnormalized partial outputs and their softmax max and sum
        o_shape = [
            jax.ShapeDtypeStruct((B, K, P, HEADS_PAD, H), f32),
            jax.ShapeDtypeStruct((B, K, P, HEADS_PAD), f32),
            jax.ShapeDtypeStruct((B, K, P, HEADS_PAD), f32),
        ]
    cache_shape = [
        jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
        jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
    ]
    out = pl.pallas_call(
        kernel,
        grid=(B, K) if P == 1 else (B, K, P),
        in_specs=[whole] * 4 + [None if a is None else whole for a in optional] + [whole] * 2,
        out_specs=[whole] * (len(o_shape) + 2),
        out_shape=o_shape[:1] + cache_shape + o_shape[1:],
        input_output_aliases={n_in: 1, n_in + 1: 2},  # the caches, updated in place
        compiler_params=plgpu.CompilerParams(num_warps=WARPS, num_stages=STAGES),
        interpret=interpret,
        name="tandem_decode_attention",
    )(positions_B.astype(jnp.int32), q, kn, vn, *optional, k_cache, v_cache)
    o, k_cache, v_cache = out[:3]
    if P > 1:  # the parts' softmaxes combined: [B, K, HEADS_PAD, H] -> the group's rows
        m_part, l_part = out[3:]
        w = jnp.exp(m_part - jnp.max(m_part, axis=2, keepdims=True))
        o = jnp.sum(w[..., None] * o, axis=2) / jnp.sum(w * l_part, axis=2)[..., None]
        o = o[:, :, :G].reshape(B, N, H).astype(q.dtype)
    return o, k_cache, v_cache


def decode_attention(
    q_BNH, k_BKH, v_BKH, k_cache, v_cache, positions_B, *, k_pos: int = 3, interpret=False
):
    """(o [B, N, H], k_cache, v_cache): row b's query heads attend to its cache slots
    [0, positions[b]) and the current token (k_BKH, v_BKH), which is written to slot
    positions[b]. k_cache [B, K, H, S] (k_pos 3) or [B, K, S, H] (k_pos 2), v_cache
    [B, K, S, H] (models.kv_cache.KVCache); float32 logits and softmax, as the XLA path."""
    N = q_BNH.shape[1]
    kn, vn = k_BKH.astype(k_cache.dtype), v_BKH.astype(v_cache.dtype)
    offsets = (0, 0, 0)
    return _call(q_BNH, kn, vn, None, k_cache, v_cache, positions_B, offsets, N, k_pos, interpret)


def decode_attention_qkv(
    qkv_BXH,
    rope,
    k_cache,
    v_cache,
    positions_B,
    *,
    num_heads: int,
    k_pos: int = 3,
    interpret=False,
    norm=None,
):
    """decode_attention of the fused projection's raw output qkv [B, N + 2K, H] (q heads, then
    k, then v, before rotary), with rotary applied in the kernel: rope = (cos, sin) [B, H] of
    models.transformer.rotary at the positions. Saves the split and rotary kernels per layer.

    norm: (x [B, D], bias [N + 2K, H] or None, eps) when qkv projects the layer's unnormalized
    input x with the input norm's weight folded into the kernel: each head is scaled by the
    row's 1 / rms(x) and the bias added here, which saves the norm's kernel per layer."""
    N, K = num_heads, k_cache.shape[1]
    return _call(
        qkv_BXH,
        qkv_BXH,
        qkv_BXH,
        rope,
        k_cache,
        v_cache,
        positions_B,
        (0, N, N + K),
        N,
        k_pos,
        interpret,
        norm,
    )
