"""Whether the JAX sampler's Pallas kernels (the decode attention and sampling) compile and run
on a device: a jax can keep the Triton backend importable and still refuse to lower it, or a GPU
can lack what the kernels need; the engine then falls back to XLA's paths before serving."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from models import decode_attention as da
from rl.rollout import sample_kernel

AUTO_PLATFORMS = ("gpu",)  # where decode_attention 'auto' takes the kernels (one device)


def _probe(interpret: bool) -> None:
    """Both kernels at tiny shapes (one row, two query heads, a 16-slot cache), results read."""
    B, N, K, H, S = 1, 2, 1, 32, 16
    qkv = jnp.ones((B, N + 2 * K, H), jnp.bfloat16)
    rope = (jnp.ones((B, H), jnp.float32), jnp.zeros((B, H), jnp.float32))
    cache = jnp.zeros((B, K, S, H), jnp.bfloat16)
    pos = jnp.ones((B,), jnp.int32)
    o, _, _ = jax.jit(
        functools.partial(da.decode_attention_qkv, num_heads=N, k_pos=2, interpret=interpret)
    )(qkv, rope, cache, cache, pos)
    keys = jnp.zeros((B, 2), jnp.uint32)
    tok, lp = jax.jit(functools.partial(sample_kernel.sample, interpret=interpret))(
        jnp.zeros((B, 256), jnp.float32), keys, jnp.ones((B,), jnp.float32)
    )
    jax.block_until_ready((o, tok, lp))


@functools.cache
def failure(device: jax.Device) -> str | None:
    """Why the kernels fail on this device (the error's type and first line), or None when they
    compile and run; once per device and process."""
    if not da.available():
        return f"jax {jax.__version__} has no Pallas Triton backend"
    try:
        with jax.default_device(device):
            _probe(interpret=device.platform != "gpu")
    except Exception as e:  # any lowering, compile or launch error means: use XLA's paths
        first = (str(e).strip().splitlines() or [""])[0][:300]
        return f"{type(e).__name__}: {first}"
    return None
