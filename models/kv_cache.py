"""The decoder's KV cache (one array per layer) and XLA's decode attention over it: the write
of a step's key and value into each row's slot, and one query row's attention (the path off a
GPU; models.decode_attention is the kernel's)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values, one array per layer: k[i] [B, num_kv_heads, head_dim, S] (k_pos 3) or
    [B, num_kv_heads, S, head_dim] (k_pos 2) and v[i] [B, num_kv_heads, S, head_dim]; slot s =
    position s.

    With the positions minor in the keys, a decode step's q.k and p.v are plain batched matmuls
    over the layer's own buffer (on a CPU, a cache laid out otherwise is transposed and copied
    whole in every step); the Pallas decode attention reads keys with the head dim minor, where
    a block of slots is one contiguous run.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    k_pos: int = dataclasses.field(default=3, metadata=dict(static=True))

    V_POS = 2  # the position axis of each layer's v

    @property
    def max_len(self) -> int:
        """Number of slots S."""
        return self.v[0].shape[self.V_POS]

    def map(self, f, *others: KVCache) -> KVCache:
        """f(array, *other arrays, position axis) over every layer's k and v."""
        k = tuple(f(*a, self.k_pos) for a in zip(self.k, *(o.k for o in others)))
        v = tuple(f(*a, self.V_POS) for a in zip(self.v, *(o.v for o in others)))
        return KVCache(k=k, v=v, k_pos=self.k_pos)


def init_cache(
    config: ModelConfig, batch: int, max_len: int, dtype=None, k_pos: int = 3
) -> KVCache:
    """An all-zero KV cache for `batch` rows of up to `max_len` positions, keys with their
    positions on axis k_pos (3, or 2 for the Pallas decode attention)."""
    if k_pos not in (2, 3):
        raise ValueError(f"init_cache: k_pos={k_pos!r}; valid: 2, 3")
    L, K, H = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
    dtype = dtype or config.dtype
    zeros = lambda *shape: tuple(jnp.zeros(shape, dtype) for _ in range(L))
    k_shape = (batch, K, H, max_len) if k_pos == 3 else (batch, K, max_len, H)
    return KVCache(k=zeros(*k_shape), v=zeros(batch, K, max_len, H), k_pos=k_pos)


def write_slot(cache, new_BKH, positions_B, axis: int) -> jax.Array:
    """One layer's cache [B, ...] with position positions_B[b] (on `axis`) of row b set to
    new_BKH[b]: one scatter with the rows as its batching dimension, written in place."""
    dims = jax.lax.ScatterDimensionNumbers(
        update_window_dims=(1, 2),  # updates [B, K, H]: K and H are the window
        inserted_window_dims=(axis,),  # one position
        scatter_dims_to_operand_dims=(axis,),
        operand_batching_dims=(0,),
        scatter_indices_batching_dims=(0,),
    )
    return jax.lax.scatter(
        cache,
        positions_B.astype(jnp.int32)[:, None],
        new_BKH.astype(cache.dtype),
        dims,
        indices_are_sorted=True,
        unique_indices=True,
        mode=jax.lax.GatherScatterMode.CLIP,
    )


def xla_decode_attention(q_BNH, k_cache, v_BKSH, valid_BS, k_pos: int) -> jax.Array:
    """One query row per sequence over its cache (GQA): o [B, N, H], as
    jax.nn.dot_product_attention's xla path computes it (float32 logits and softmax). k_cache
    [B, K, H, S] (k_pos 3) or [B, K, S, H] (k_pos 2)."""
    B, N, H = q_BNH.shape
    K = k_cache.shape[1]
    q = q_BNH.reshape(B, K, N // K, H)
    k_cache, v_BKSH = k_cache.astype(q.dtype), v_BKSH.astype(q.dtype)
    f32 = jnp.promote_types(q.dtype, jnp.float32)
    spec = "bkgh,bkhs->bkgs" if k_pos == 3 else "bkgh,bksh->bkgs"
    logits = jnp.einsum(spec, q, k_cache, preferred_element_type=f32)
    logits = logits * jnp.array(1.0 / np.sqrt(H), f32)
    big_neg = -0.7 * jnp.finfo(f32).max
    logits = jnp.where(valid_BS[:, None, None, :], logits, big_neg)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(v_BKSH.dtype)
    o = jnp.einsum("bkgs,bksh->bkgh", probs, v_BKSH)
    return o.reshape(B, N, H).astype(q_BNH.dtype)
