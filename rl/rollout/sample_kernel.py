"""A decode step's sampling (temperature, then one inverse-CDF draw per row) as two Pallas
(Triton) kernels, for one GPU's decode chunk when no row truncates.

rl.rollout.sampling.sample as XLA runs it is two passes over the float32 logits plus many small
kernels (block cumulative sums, selects, gathers); here one kernel reads each vocabulary block
once (its max, first argmax and sum of exp), and a second, one program per row, finds the draw
from the block statistics and one re-read block. The draw is the same: the first token whose
cumulative probability exceeds u * total, in token order (only the summation order differs).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from rl.rollout.sampling import scale_of, uniforms

try:
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # a jax without Pallas's Triton backend: JaxEngine keeps XLA's sampling
    plgpu = None

BLOCK = 2048  # vocabulary entries per program of the statistics kernel
WARPS = 4
_BIG = 2**30  # an index above any vocabulary position


def _stats_kernel(x_ref, t_ref, max_ref, sum_ref, arg_ref, *, V):
    """Program (b, j): block j of row b's logits / t: its max, first argmax, sum of exp."""
    b, j = pl.program_id(0), pl.program_id(1)
    idx = j * BLOCK + jnp.arange(BLOCK)
    x = plgpu.load(x_ref.at[b, pl.ds(j * BLOCK, BLOCK)], mask=idx < V, other=-jnp.inf)
    x = x / t_ref[b]
    m = jnp.max(x)
    max_ref[b, j] = m
    arg_ref[b, j] = jnp.min(jnp.where(x == m, idx, _BIG))
    sum_ref[b, j] = jnp.sum(jnp.exp(x - m))


def _draw_kernel(
    x_ref, t_ref, temp_ref, u_ref, max_ref, sum_ref, arg_ref, tok_ref, lp_ref, *, V, NB, NBP
):
    """Program b: the row's max and total mass from its blocks' statistics, the block the draw
    falls in, then the token within that block (one re-read); greedy rows take the argmax."""
    b = pl.program_id(0)
    c = jnp.arange(NBP)
    valid = c < NB
    bmax = plgpu.load(max_ref.at[b, pl.ds(0, NBP)], mask=valid, other=-jnp.inf)
    bsum = plgpu.load(sum_ref.at[b, pl.ds(0, NBP)], mask=valid, other=0.0)
    barg = plgpu.load(arg_ref.at[b, pl.ds(0, NBP)], mask=valid, other=0)
    m = jnp.max(bmax)
    w = jnp.where(valid, bsum * jnp.exp(bmax - m), 0.0)  # each block's mass relative to m
    total = jnp.sum(w)
    top = jnp.min(jnp.where(bmax == m, c, _BIG))  # the block of the row's first maximum
    greedy = jnp.sum(jnp.where(c == top, barg, 0))
    target = u_ref[b] * total

    def first_above(cdf, mass, n):
        """Index of the first entry whose cumulative mass exceeds target; rounding may put the
        target at the total: the last entry of nonzero mass then."""
        i = jnp.sum((cdf <= target).astype(jnp.int32))
        return jnp.minimum(i, jnp.max(jnp.where(mass > 0, jnp.arange(n), -1)))

    j = first_above(jnp.cumsum(w), w, NBP)
    before = jnp.sum(jnp.where(c < j, w, 0.0))
    idx = j * BLOCK + jnp.arange(BLOCK)
    t = t_ref[b]
    x = plgpu.load(x_ref.at[b, pl.ds(j * BLOCK, BLOCK)], mask=idx < V, other=-jnp.inf) / t
    e = jnp.exp(x - m)
    i = first_above(before + jnp.cumsum(e), e, BLOCK)
    x_i = jnp.sum(jnp.where(jnp.arange(BLOCK) == i, x, 0.0))
    sampled = temp_ref[b] > 0
    tok_ref[b] = jnp.where(sampled, j * BLOCK + i, greedy).astype(jnp.int32)
    lp_ref[b] = jnp.where(sampled, x_i, m) - m - jnp.log(total)  # greedy: x[greedy] == m


def sample(logits_BV, keys_B2, temperature_B, *, interpret: bool = False):
    """(token [B] int32, its log-prob [B]) as sampling.sample(process_logits(logits, T,
    truncate=False), keys, T) draws them: the same uniform per row, the same inverse CDF."""
    B, V = logits_BV.shape
    x = logits_BV.astype(jnp.float32)
    t = scale_of(temperature_B).astype(jnp.float32)  # the XLA sampler's scale and uniform
    u = uniforms(keys_B2)
    NB = -(-V // BLOCK)
    NBP = max(16, 1 << (NB - 1).bit_length())  # the block statistics as a power-of-two vector
    whole = pl.no_block_spec
    params = plgpu.CompilerParams(num_warps=WARPS, num_stages=1)
    f32 = jnp.float32
    stats = pl.pallas_call(
        functools.partial(_stats_kernel, V=V),
        grid=(B, NB),
        in_specs=[whole, whole],
        out_specs=[whole] * 3,
        out_shape=[jax.ShapeDtypeStruct((B, NBP), d) for d in (f32, f32, jnp.int32)],
        compiler_params=params,
        interpret=interpret,
        name="tandem_sample_stats",
    )(x, t)
    tok, lp = pl.pallas_call(
        functools.partial(_draw_kernel, V=V, NB=NB, NBP=NBP),
        grid=(B,),
        in_specs=[whole] * 7,
        out_specs=[whole] * 2,
        out_shape=[jax.ShapeDtypeStruct((B,), jnp.int32), jax.ShapeDtypeStruct((B,), f32)],
        compiler_params=params,
        interpret=interpret,
        name="tandem_sample_draw",
    )(x, t, temperature_B.astype(f32), u, *stats)
    return tok, lp
