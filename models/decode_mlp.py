"""A decode step's MLP activation as one Pallas (Triton) kernel that also finishes the folded
post-attention norm: with the norm's weight folded into the gate/up kernel, the GEMM takes the
unnormalized input x and each row of its output is scaled by 1/rms(x) here.

XLA runs that as three kernels per layer (the row reduction, its rsqrt, the activation); on a
GPU, where a decode step is a few hundred small kernels, one is what the step can afford.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from models.decode_attention import plgpu, row_inv_rms

BLOCK = 1024  # activation columns per program
WARPS = 4


def _kernel(gu_ref, x_ref, h_ref, *, eps):
    """Program (b, c): columns [c BLOCK, (c + 1) BLOCK) of row b's silu(s g) * (s u), s the
    row's 1/rms(x); g and u are the two halves of gu_ref's row (float32 until the store)."""
    b, c = pl.program_id(0), pl.program_id(1)
    F, f32 = h_ref.shape[-1], jnp.float32
    s = row_inv_rms(x_ref, b, eps)
    cols = c * BLOCK + jnp.arange(BLOCK)
    keep = cols < F
    g = plgpu.load(gu_ref.at[b, pl.ds(c * BLOCK, BLOCK)], mask=keep, other=0).astype(f32) * s
    u = plgpu.load(gu_ref.at[b, pl.ds(F + c * BLOCK, BLOCK)], mask=keep, other=0).astype(f32)
    h = g / (1.0 + jnp.exp(-g)) * (u * s)  # silu(g) (s u), as jax.nn.silu
    plgpu.store(h_ref.at[b, pl.ds(c * BLOCK, BLOCK)], h.astype(h_ref.dtype), mask=keep)


def folded_activation(gu_BX, x_BD, eps: float, *, interpret: bool = False):
    """h [B, F] = silu(s gate) * (s up) in gu's dtype, for gu [B, 2F] = x @ (the gate/up
    kernel with the post-attention norm's weight folded in) and s = 1/rms(x) of x [B, D]."""
    B, F = gu_BX.shape[0], gu_BX.shape[1] // 2
    return pl.pallas_call(
        functools.partial(_kernel, eps=float(eps)),
        grid=(B, pl.cdiv(F, BLOCK)),
        in_specs=[pl.no_block_spec] * 2,
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct((B, F), gu_BX.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=WARPS, num_stages=1),
        interpret=interpret,
        name="tandem_folded_activation",
    )(gu_BX, x_BD)
