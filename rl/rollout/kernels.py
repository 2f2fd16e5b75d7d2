"""Which of the JAX sampler's Pallas kernels (the decode attention and activation, sampling) an
engine uses, and whether they compile and run on its device: a jax can keep the Triton backend
importable and still refuse to lower it, or a GPU can lack what the kernels need; 'auto' then
keeps XLA's paths and says why, before serving."""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp

from models import decode_attention as da
from models import decode_mlp
from rl.rollout import sample_kernel

AUTO_PLATFORMS = ("gpu",)  # where decode_attention 'auto' takes the kernels (one device)


def _probe(dtype, group: int, head_dim: int, vocab: int, hidden: int, interpret: bool) -> None:
    """The kernels at the model's head shapes, hidden size and vocabulary for one row and a
    64-slot cache (the decode attention and activation only where the model would run them,
    finishing the norms as with folded norms; sampling always), results read."""
    N, K, H, S = group, 1, head_dim, 64
    outs = []
    if da.supported(dtype, N, K, H, S):
        qkv = jnp.ones((1, N + 2 * K, H), dtype)
        rope = (jnp.ones((1, H), jnp.float32), jnp.zeros((1, H), jnp.float32))
        cache = jnp.zeros((1, K, S, H), dtype)
        x, bias = jnp.ones((1, hidden), dtype), jnp.zeros((N + 2 * K, H), dtype)

        @jax.jit
        def attend(qkv, rope, cache, pos, x, bias):
            return da.decode_attention_qkv(
                qkv,
                rope,
                cache,
                cache,
                pos,
                num_heads=N,
                k_pos=2,
                interpret=interpret,
                norm=(x, bias, 1e-6),
            )

        outs.append(attend(qkv, rope, cache, jnp.ones((1,), jnp.int32), x, bias))
        F = decode_mlp.BLOCK + 1  # any width runs the same code; one past a block: the mask
        act = functools.partial(decode_mlp.folded_activation, eps=1e-6, interpret=interpret)
        outs.append(jax.jit(act)(jnp.ones((1, 2 * F), dtype), x))
    draw = jax.jit(functools.partial(sample_kernel.sample, interpret=interpret))
    outs.append(draw(jnp.zeros((1, vocab), dtype), jnp.zeros((1, 2), jnp.uint32), jnp.ones(1)))
    jax.block_until_ready(outs)


@functools.cache
def failure(
    device: jax.Device, dtype, group: int, head_dim: int, vocab: int, hidden: int
) -> str | None:
    """Why the kernels fail on this device for a model of this compute dtype, query heads per
    kv head, head dim, vocabulary and hidden size (the error's type and first line), or None
    when they compile and run; once per device, shapes and process."""
    if not da.available():
        return f"jax {jax.__version__} has no Pallas Triton backend"
    try:
        with jax.default_device(device):
            shapes = (group, head_dim, vocab, hidden)
            _probe(jnp.dtype(dtype), *shapes, interpret=device.platform != "gpu")
    except Exception as e:  # any lowering, compile or launch error means: use XLA's paths
        first = (str(e).strip().splitlines() or [""])[0][:300]
        return f"{type(e).__name__}: {first}"
    return None


def choose(decode_attention: str, sample_kernel: bool | None, devices, config, compute):
    """(decode_attention 'pallas' or 'xla', sample_kernel True or False) for an engine on these
    devices serving a model of this config in the compute dtype; a ValueError naming what is
    asked and why it cannot be, before any decoding. The kernels run on one device (a custom
    call the row-sharding does not split); sample_kernel None follows the attention."""
    device, nd = devices[0], len(devices)
    group = config.num_attention_heads // config.num_key_value_heads
    shapes = (compute, group, config.head_dim, config.vocab_size, config.hidden_size)
    asked = decode_attention == "pallas" or bool(sample_kernel)  # not by 'auto'
    if decode_attention == "auto":
        use = device.platform in AUTO_PLATFORMS and nd == 1 and da.available()
        why = failure(device, *shapes) if use else None
        if why:  # this jax or GPU cannot run the kernels: XLA's paths, and why
            print(
                f"JaxEngine: the Pallas kernels fail on {device.device_kind} ({why}); decoding "
                "with XLA's attention and sampling",
                file=sys.stderr,
            )
        decode_attention = "pallas" if use and not why else "xla"
    if (decode_attention == "pallas" or sample_kernel) and not da.available():
        raise ValueError(
            f"JaxEngine: decode_attention={decode_attention!r}, sample_kernel={sample_kernel} "
            f"need Pallas's Triton backend, which jax {jax.__version__} lacks; valid: "
            "decode_attention 'auto' or 'xla', sample_kernel None or False"
        )
    if decode_attention == "pallas" and nd > 1:
        raise ValueError(
            f"JaxEngine: decode_attention 'pallas' runs on one device, got {nd}; valid with "
            "several: 'auto' or 'xla'"
        )
    if sample_kernel and nd > 1:
        raise ValueError(
            f"JaxEngine: sample_kernel=True runs on one device, got {nd}; valid with "
            "several: None or False"
        )
    if asked and (why := failure(device, *shapes)):  # now, not at the first decode step
        raise ValueError(
            f"JaxEngine: decode_attention={decode_attention!r}, sample_kernel={sample_kernel}: "
            f"the Pallas kernels fail on {device.device_kind}: {why}; valid: "
            "decode_attention 'auto' or 'xla', sample_kernel None or False"
        )
    pallas = decode_attention == "pallas"
    return decode_attention, pallas if sample_kernel is None else bool(sample_kernel)
