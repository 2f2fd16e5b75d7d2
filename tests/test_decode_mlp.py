"""The decode step's folded activation kernel (interpreted on a CPU) against XLA: 1/rms of the
unnormalized input applied to the gate/up GEMM's rows, then silu(gate) * up."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import decode_mlp


def _want(gu, x, eps):
    x32 = x.astype(jnp.float32)
    s = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    gate, up = jnp.split(s * gu.astype(jnp.float32), 2, axis=-1)
    return jax.nn.silu(gate) * up


@pytest.mark.parametrize(
    "B, D, F",
    [
        (4, 96, 200),  # one partial block; a hidden size that is not a power of two
        (3, 64, 2 * decode_mlp.BLOCK),  # whole blocks
        (2, 896, 4864),  # Qwen2-0.5B's widths: 4 whole blocks and a partial one
    ],
)
def test_folded_activation_matches_xla_in_float32(B, D, F):
    rng = np.random.default_rng(F)
    gu = jnp.asarray(3.0 * rng.normal(size=(B, 2 * F)), jnp.float32)
    x = jnp.asarray(5.0 * rng.normal(size=(B, D)), jnp.float32)
    h = decode_mlp.folded_activation(gu, x, 1e-6, interpret=True)
    want = _want(gu, x, 1e-6)
    assert h.shape == (B, F) and h.dtype == jnp.float32
    assert np.abs(np.asarray(h) - np.asarray(want)).max() < 1e-6 * np.abs(want).max()


def test_folded_activation_in_bfloat16_rounds_once():
    """bfloat16 in and out, float32 inside: within one bfloat16 rounding of the float32 result
    of the same inputs."""
    rng = np.random.default_rng(1)
    gu = jnp.asarray(3.0 * rng.normal(size=(3, 2 * 300)), jnp.bfloat16)
    x = jnp.asarray(5.0 * rng.normal(size=(3, 96)), jnp.bfloat16)
    h = decode_mlp.folded_activation(gu, x, 1e-6, interpret=True)
    assert h.dtype == jnp.bfloat16
    want = np.asarray(_want(gu, x, 1e-6))
    err = np.abs(np.asarray(h, np.float32) - want)
    assert (err <= 2.0**-8 * np.abs(want) * (1 + 1e-6)).all()  # plus the float32 difference
