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


def _probe(dtype, group: int, head_dim: int, vocab: int, interpret: bool) -> None:
    """Both kernels at the model's head shapes and vocabulary for one row and a 64-slot cache
    (the attention kernel only where the model would run it), results read."""
    N, K, H, S = group, 1, head_dim, 64
    outs = []
    if da.supported(dtype, N, K, H, S):
        qkv = jnp.ones((1, N + 2 * K, H), dtype)
        rope = (jnp.ones((1, H), jnp.float32), jnp.zeros((1, H), jnp.float32))
        cache = jnp.zeros((1, K, S, H), dtype)
        attend = functools.partial(
            da.decode_attention_qkv, num_heads=N, k_pos=2, interpret=interpret
        )
        outs.append(jax.jit(attend)(qkv, rope, cache, cache, jnp.ones((1,), jnp.int32)))
    draw = jax.jit(functools.partial(sample_kernel.sample, interpret=interpret))
    outs.append(draw(jnp.zeros((1, vocab), dtype), jnp.zeros((1, 2), jnp.uint32), jnp.ones(1)))
    jax.block_until_ready(outs)


@functools.cache
def failure(device: jax.Device, dtype, group: int, head_dim: int, vocab: int) -> str | None:
    """Why the kernels fail on this device for a model of this compute dtype, query heads per
    kv head, head dim and vocabulary (the error's type and first line), or None when they
    compile and run; once per device, shapes and process."""
    if not da.available():
        return f"jax {jax.__version__} has no Pallas Triton backend"
    try:
        with jax.default_device(device):
            _probe(jnp.dtype(dtype), group, head_dim, vocab, interpret=device.platform != "gpu")
    except Exception as e:  # any lowering, compile or launch error means: use XLA's paths
        first = (str(e).strip().splitlines() or [""])[0][:300]
        return f"{type(e).__name__}: {first}"
    return None
