"""Decoder-only LM (Qwen2 / Llama / Qwen3) in flax.nnx: HF attribute names, logical axes, KV cache.

Attribute paths equal the HF parameter names (`model.layers.0.self_attn.q_proj` ...), kernels
are (in, out), so HF conversion is a rename of `kernel`/`embedding` to `weight` plus a transpose.
Every parameter carries logical axis names (models/sharding.py maps them to mesh axes).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import decode_attention, decode_mlp
from models.attention import attention, rows_only
from models.config import ModelConfig
from models.kv_cache import KVCache, write_slot, xla_decode_attention

INIT_STD = 0.02  # HF initializer_range
_LAYERS_AXIS = {nnx.PARTITION_NAME: "layers"}  # the stacked layers' logical axis (unsharded)


_NORMAL = nnx.initializers.normal(INIT_STD)
_ZEROS = nnx.initializers.zeros_init()


def _init(axes: tuple[str, ...], init=_NORMAL):
    """An initializer that tags its parameter with logical axes (sharded later, not eagerly)."""
    return nnx.with_partitioning(init, axes, eager_sharding=False)


class RMSNorm(nnx.Module):
    """RMS norm over the last axis, computed in float32 like HF."""

    def __init__(self, dim: int, axis: str, config: ModelConfig):
        self.weight = nnx.Param(
            jnp.ones((dim,), config.param_dtype), out_sharding=(axis,), eager_sharding=False
        )
        self.eps = config.rms_norm_eps
        self.dtype = config.dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32) * self.inv_rms(x)
        return self.weight[...].astype(self.dtype) * x32.astype(self.dtype)

    def inv_rms(self, x: jax.Array) -> jax.Array:
        """1 / rms over the last axis, float32 [..., 1]: the norm without its weight."""
        x32 = x.astype(jnp.float32)
        return jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)

    def fold(self, kernel: jax.Array) -> jax.Array:
        """kernel [D, out] with this norm's weight folded into its rows (rounded once):
        norm(x) @ kernel == inv_rms(x) * (x @ fold(kernel)), one kernel fewer per use."""
        w = self.weight[...].astype(jnp.float32)[:, None]
        return (w * kernel.astype(jnp.float32)).astype(kernel.dtype)

    def unfold(self, kernel: jax.Array) -> jax.Array:
        """fold's inverse, within one rounding (not finite where a weight is 0)."""
        w = self.weight[...].astype(jnp.float32)[:, None]
        return (kernel.astype(jnp.float32) / w).astype(kernel.dtype)


@functools.lru_cache(maxsize=64)
def _inv_freq(head_dim: int, theta: float, scaling: tuple | None) -> np.ndarray:
    """Rotary inverse frequencies [head_dim / 2] (float32), with HF's linear / llama3 scaling."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float64) / head_dim
    inv = 1.0 / (theta**exponents)
    rope = dict(scaling) if scaling else {}
    kind = rope.get("rope_type")
    if kind == "linear":
        inv = inv / rope["factor"]
    elif kind == "llama3":
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old_len = rope["original_max_position_embeddings"]
        low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_freq_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def rotary(config: ModelConfig, positions_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) [B, T, 1, head_dim] in the compute dtype, HF rotate-half layout."""
    scaling = tuple(sorted(config.rope_scaling.items())) if config.rope_scaling else None
    inv = jnp.asarray(_inv_freq(config.head_dim, config.rope_theta, scaling))
    freqs_BTF = positions_BT.astype(jnp.float32)[..., None] * inv
    emb_BTH = jnp.concatenate([freqs_BTF, freqs_BTF], axis=-1)
    cos, sin = jnp.cos(emb_BTH), jnp.sin(emb_BTH)
    return cos[:, :, None, :].astype(config.dtype), sin[:, :, None, :].astype(config.dtype)


def apply_rotary(x_BTNH: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotary embedding (rotate-half) of x with rotary()'s cos and sin at its positions."""
    half = x_BTNH.shape[-1] // 2
    rotated = jnp.concatenate([-x_BTNH[..., half:], x_BTNH[..., :half]], axis=-1)
    return x_BTNH * cos + rotated * sin


def _linear(x: jax.Array, kernel: jax.Array, bias: jax.Array | None, dtype) -> jax.Array:
    """x @ kernel (+ bias) in `dtype`, as nnx.Linear computes it."""
    x, kernel = x.astype(dtype), kernel.astype(dtype)
    y = jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
    return y if bias is None else y + bias.astype(dtype)


class Attention(nnx.Module):
    """Grouped-query self-attention projections (q/k/v/o, optional q/k norms)."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        D, N, K, H = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        linear = functools.partial(
            nnx.Linear, dtype=config.dtype, param_dtype=config.param_dtype, rngs=rngs
        )
        bias = config.attention_bias
        self.q_proj = linear(
            D,
            N * H,
            use_bias=bias,
            kernel_init=_init(("embed", "heads")),
            bias_init=_init(("heads",), _ZEROS),
        )
        self.k_proj = linear(
            D,
            K * H,
            use_bias=bias,
            kernel_init=_init(("embed", "kv_heads")),
            bias_init=_init(("kv_heads",), _ZEROS),
        )
        self.v_proj = linear(
            D,
            K * H,
            use_bias=bias,
            kernel_init=_init(("embed", "kv_heads")),
            bias_init=_init(("kv_heads",), _ZEROS),
        )
        self.o_proj = linear(
            N * H,
            D,
            use_bias=bias and config.model_type != "qwen2",  # Qwen2: q/k/v biases only
            kernel_init=_init(("heads", "embed")),
            bias_init=_init(("embed",), _ZEROS),
        )
        if config.qk_norm:
            self.q_norm = RMSNorm(H, "head_dim", config)
            self.k_norm = RMSNorm(H, "head_dim", config)
        else:
            self.q_norm = self.k_norm = None
        self.num_heads, self.num_kv_heads, self.head_dim = N, K, H

    def project(
        self, x_BTD: jax.Array, rope: tuple[jax.Array, jax.Array], fused=None, inv_rms=None
    ):
        """(q [B,T,N,H], k [B,T,K,H], v [B,T,K,H]) with q/k norms and rotary applied.

        fused: fused_qkv()'s (kernel, bias), one GEMM in place of three (decode steps).
        inv_rms: [B, T, 1] when x is the unnormalized input and fused's kernel has the input
        norm's weight folded in (fused_qkv(fold=...)): the GEMM's rows are scaled, then biased.
        """
        B, T, _ = x_BTD.shape
        N, K, H = self.num_heads, self.num_kv_heads, self.head_dim
        dtype = self.q_proj.dtype
        if fused is None:
            q, k, v = self.q_proj(x_BTD), self.k_proj(x_BTD), self.v_proj(x_BTD)
        else:
            w, bias = fused
            if inv_rms is None:
                y = _linear(x_BTD, w, bias, dtype)
            else:
                y = inv_rms * _linear(x_BTD, w, None, dtype).astype(jnp.float32)
                y = (y if bias is None else y + bias.astype(jnp.float32)).astype(dtype)
            q, k, v = jnp.split(y, [N * H, (N + K) * H], axis=-1)
        q, k, v = q.reshape(B, T, N, H), k.reshape(B, T, K, H), v.reshape(B, T, K, H)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def fused_qkv(self, fold: RMSNorm | None = None) -> tuple[jax.Array, jax.Array | None]:
        """The q, k and v kernels side by side [D, (N + 2K) H] (with fold's weight folded in),
        and their biases (or None)."""
        proj = (self.q_proj, self.k_proj, self.v_proj)
        w = jnp.concatenate([p.kernel[...] for p in proj], axis=1)
        w = w if fold is None else fold.fold(w)
        if self.q_proj.bias is None:
            return w, None
        return w, jnp.concatenate([p.bias[...] for p in proj])


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        D, F = config.hidden_size, config.intermediate_size
        linear = functools.partial(
            nnx.Linear,
            use_bias=False,
            dtype=config.dtype,
            param_dtype=config.param_dtype,
            rngs=rngs,
        )
        self.gate_proj = linear(D, F, kernel_init=_init(("embed", "mlp")))
        self.up_proj = linear(D, F, kernel_init=_init(("embed", "mlp")))
        self.down_proj = linear(F, D, kernel_init=_init(("mlp", "embed")))

    def __call__(self, x_BTD: jax.Array, fused: jax.Array | None = None) -> jax.Array:
        """fused: fused_gate_up()'s kernel, one GEMM in place of two (decode steps)."""
        if fused is None:
            gate, up = self.gate_proj(x_BTD), self.up_proj(x_BTD)
        else:
            gate, up = jnp.split(_linear(x_BTD, fused, None, self.gate_proj.dtype), 2, axis=-1)
        return self.down_proj(jax.nn.silu(gate) * up)

    def folded(self, x_BTD, gate_up, norm: RMSNorm, activation=None) -> jax.Array:
        """__call__ of the unnormalized input x with fused_gate_up(fold=norm)'s kernel: the
        GEMM's rows scaled by norm.inv_rms(x) before the activation (float32 until h), or
        `activation(gu [B, T, 2F], x) -> h [B, T, F]` doing both (the decode kernel)."""
        dtype = self.gate_proj.dtype
        gu = _linear(x_BTD, gate_up, None, dtype)
        if activation is not None:
            return self.down_proj(activation(gu, x_BTD))
        gate, up = jnp.split(norm.inv_rms(x_BTD) * gu.astype(jnp.float32), 2, axis=-1)
        return self.down_proj((jax.nn.silu(gate) * up).astype(dtype))

    def fused_gate_up(self, fold: RMSNorm | None = None) -> jax.Array:
        """The gate and up kernels side by side [D, 2F] (with fold's weight folded in)."""
        w = jnp.concatenate([self.gate_proj.kernel[...], self.up_proj.kernel[...]], axis=1)
        return w if fold is None else fold.fold(w)


class DecoderLayer(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.self_attn = Attention(config, rngs)
        self.mlp = MLP(config, rngs)
        self.input_layernorm = RMSNorm(config.hidden_size, "embed", config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, "embed", config)

    def __call__(self, x_BTD, rope, attend, fused=None, folded: bool = False):
        """The block's output and whatever `attend(q, k, v) -> (o_BTNH, extra)` returned.

        fused: fused()'s kernels (decode steps: fewer, larger GEMMs); folded: they are
        fused(fold=True)'s, with the norms' weights in them.
        """
        qkv, gate_up = fused if fused is not None else (None, None)
        extra = []

        def attention(h_BTD):
            inv_rms = self.input_layernorm.inv_rms(h_BTD) if folded else None
            o_BTNH, e = attend(*self.self_attn.project(h_BTD, rope, qkv, inv_rms))
            extra.append(e)
            return o_BTNH

        return self._residual(x_BTD, attention, gate_up, folded), extra[0]

    def decode_step(self, x_BTD, attend_qkv, fused, folded: bool = False, activation=None):
        """The block with fused() kernels and an attention that takes the fused q/k/v
        projection's raw output: `attend_qkv(qkv [B, T, (N + 2K) H], norm) -> o [B, T, N, H]`
        applies rotary and splits the heads itself (the decode kernel, one call instead of
        several). folded (fused(fold=True)'s kernels): qkv projects the unnormalized input and
        norm = (x, bias, eps) for attend_qkv to finish the input norm and add the bias; the
        MLP's activation then as in MLP.folded."""
        (w, bias), gate_up = fused
        dtype = self.self_attn.q_proj.dtype
        if not folded:
            attention = lambda h: attend_qkv(_linear(h, w, bias, dtype), None)
        else:
            eps = self.input_layernorm.eps
            attention = lambda x: attend_qkv(_linear(x, w, None, dtype), (x, bias, eps))
        return self._residual(x_BTD, attention, gate_up, folded, activation)

    def _residual(self, x_BTD, attention, gate_up, folded: bool = False, activation=None):
        """x + o_proj(attention(norm(x))), then x + mlp(norm(x)); folded: the norms' weights
        are in the kernels, attention takes x itself and the MLP scales its GEMM's rows."""
        B, T, _ = x_BTD.shape
        o_BTNH = attention(x_BTD if folded else self.input_layernorm(x_BTD))
        x_BTD = x_BTD + self.self_attn.o_proj(o_BTNH.reshape(B, T, -1))
        if folded:
            norm = self.post_attention_layernorm
            return x_BTD + self.mlp.folded(x_BTD, gate_up, norm, activation)
        return x_BTD + self.mlp(self.post_attention_layernorm(x_BTD), gate_up)

    def fused(self, fold: bool = False) -> tuple:
        """((qkv kernel, bias), gate/up kernel): the projections that share an input, fused;
        fold: with the norm before each folded into its kernel (RMSNorm.fold)."""
        norms = (self.input_layernorm, self.post_attention_layernorm) if fold else (None, None)
        return self.self_attn.fused_qkv(norms[0]), self.mlp.fused_gate_up(norms[1])


class Decoder(nnx.Module):
    """Embedding, decoder layers and final norm (HF's `model.` prefix).

    `layers` is ONE DecoderLayer whose parameters carry a leading `layers` axis (slice i is
    HF's `model.layers.{i}`); the forward passes run it under jax.lax.scan (_scan_layers), so
    compile time does not grow with depth.
    """

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Embed(
            config.vocab_size,
            config.hidden_size,
            dtype=config.dtype,
            param_dtype=config.param_dtype,
            embedding_init=_init(("vocab", "embed")),
            rngs=rngs,
        )

        @nnx.split_rngs(splits=config.num_hidden_layers)
        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata=_LAYERS_AXIS)
        def stacked(rngs: nnx.Rngs) -> DecoderLayer:
            return DecoderLayer(config, rngs)

        self.layers = stacked(rngs)
        self.norm = RMSNorm(config.hidden_size, "embed", config)


_REMAT_POLICIES = {"full": None, "dots_saveable": jax.checkpoint_policies.dots_saveable}


def _scan_layers(layers: DecoderLayer, body, carry, xs=None, *, remat: str = "none"):
    """`body(layer, carry, x) -> (carry, y)` over the stacked layers (x, y: leading L axis).

    A jax.lax.scan over the layers' split state (each step merges its slice into a one-layer
    module), so the model can be called inside other jax loops (nnx.scan refuses modules from
    an outer trace). remat (none / full / dots_saveable) applies to each layer's step.
    """
    graphdef, state = nnx.split(layers)

    def step(carry, scanned):
        state_i, x = scanned
        state_i = nnx.spmd.remove_axis(state_i, 0, _LAYERS_AXIS)  # metadata of one slice
        return body(nnx.merge(graphdef, state_i), carry, x)

    if remat != "none":
        step = jax.checkpoint(step, policy=_REMAT_POLICIES[remat], prevent_cse=False)
    if xs is None:  # nothing per layer: scan over the layer index
        xs = jnp.arange(layers.input_layernorm.weight.shape[0])
    return jax.lax.scan(step, carry, (state, xs))


def _precise(method):
    """Runs a model method under the config's matmul precision (float32 means float32)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with jax.default_matmul_precision(self.config.precision):
            return method(self, *args, **kwargs)

    return wrapper


class Transformer(nnx.Module):
    """Causal LM: `model(tokens[B, T], positions, segment_ids) -> logits[B, T, V]` (float32)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        if config.attention_impl == "cudnn" and jax.default_backend() != "gpu":
            raise ValueError(
                f"attention_impl='cudnn' needs a GPU backend, but jax.default_backend() is "
                f"{jax.default_backend()!r}; use attention_impl='xla'"
            )
        self.config = config
        self.model = Decoder(config, rngs)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nnx.Linear(
                config.hidden_size,
                config.vocab_size,
                use_bias=False,
                dtype=config.dtype,
                param_dtype=config.param_dtype,
                kernel_init=_init(("embed", "vocab")),
                rngs=rngs,
            )

    def lm_head_kernel(self) -> jax.Array:
        """The output projection w_DV in the compute dtype (the embedding transposed when tied)."""
        if self.lm_head is None:
            w_DV = self.model.embed_tokens.embedding[...].T
        else:
            w_DV = self.lm_head.kernel[...]
        return w_DV.astype(self.config.dtype)

    def _logits(self, h_BTD: jax.Array) -> jax.Array:
        return jnp.einsum(
            "btd,dv->btv", h_BTD, self.lm_head_kernel(), preferred_element_type=jnp.float32
        )

    @_precise
    def hidden_states(
        self, tokens, positions=None, segment_ids=None, segment_lengths=None
    ) -> jax.Array:
        """Final-norm hidden states h[B, T, D] (compute dtype) of tokens[B, T].

        positions[B, T] default to arange(T) in every row; segment_ids[B, T] (packed sequences,
        0 = padding) restrict attention to tokens of the same segment; segment_lengths[B, M]
        (models.attention.segment_lengths of them) let cuDNN take them without a mask.
        """
        B, T = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        rope = rotary(self.config, positions)
        impl = self.config.attention_impl

        def attend(q, k, v):
            o = attention(
                q,
                k,
                v,
                segment_ids=segment_ids,
                implementation=impl,
                segment_lengths=segment_lengths,
            )
            return o, None

        # The residual stream stays split by rows over the learner's batch axes (rows_only):
        # under fsdp XLA then gathers each layer's weights, not every row's activations.
        def body(layer: DecoderLayer, x_BTD, _):
            return rows_only(layer(rows_only(x_BTD), rope, attend)[0]), None

        x_BTD = rows_only(self.model.embed_tokens(tokens))
        x_BTD, _ = _scan_layers(self.model.layers, body, x_BTD, remat=self.config.remat)
        return self.model.norm(x_BTD)

    @_precise
    def __call__(self, tokens, positions=None, segment_ids=None, segment_lengths=None) -> jax.Array:
        """Logits[B, T, V] in float32 of tokens[B, T] (arguments as in hidden_states)."""
        return self._logits(self.hidden_states(tokens, positions, segment_ids, segment_lengths))

    @_precise
    def prefill(
        self,
        tokens,
        lengths,
        cache: KVCache,
        *,
        last_only: bool = False,
        layers=None,
        folded: bool = False,
    ) -> tuple[jax.Array, KVCache]:
        """Logits[B, T, V] of right-padded prompts tokens[B, T] with lengths[B] real tokens,
        and the cache with slots [0, T) written: row b's first lengths[b] hold its keys and
        values, the rest zeros.

        last_only: return only each row's last-token logits [B, V] (what sampling needs).
        layers: per_layer()'s modules and fused kernels (a sampler's serving layout): the
        layers unrolled over them instead of scanned over the stacked parameters; folded: they
        are per_layer(fold=True)'s.
        """
        B, T = tokens.shape
        if T > cache.max_len:
            raise ValueError(f"prompt length T={T} exceeds the cache's max_len={cache.max_len}")
        positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        valid_BT11 = (positions_BT < lengths[:, None])[:, :, None, None]
        rope = rotary(self.config, positions_BT)
        impl = self.config.attention_impl

        def attend(q, k, v):
            o = attention(q, k, v, segment_ids=None, implementation=impl)
            keep = lambda a, c: jnp.where(valid_BT11, a, 0).astype(c.dtype)
            return o, (keep(k, cache.v[0]), keep(v, cache.v[0]))

        def body(layer: DecoderLayer, x_BTD, _):
            return layer(x_BTD, rope, attend)

        x_BTD = self.model.embed_tokens(tokens)
        if layers is None:
            if folded:
                raise ValueError("prefill: folded=True needs layers=per_layer(fold=True)")
            x_BTD, (k_LBTKH, v_LBTKH) = _scan_layers(self.model.layers, body, x_BTD)
        else:
            kv = []
            for layer, fused in layers:
                x_BTD, kv_i = layer(x_BTD, rope, attend, fused, folded)
                kv.append(kv_i)
            k_LBTKH, v_LBTKH = (jnp.stack(a) for a in zip(*kv))
        h_BTD = self.model.norm(x_BTD)
        k_perm = (0, 1, 3, 4, 2) if cache.k_pos == 3 else (0, 1, 3, 2, 4)
        new = KVCache(
            k=tuple(jnp.transpose(k_LBTKH, k_perm)),  # [B, K, H, T] or [B, K, T, H] per layer
            v=tuple(jnp.transpose(v_LBTKH, (0, 1, 3, 2, 4))),  # [B, K, T, H]
            k_pos=cache.k_pos,
        )
        cache = cache.map(lambda c, x, _: jax.lax.dynamic_update_slice(c, x, (0,) * c.ndim), new)
        if last_only:
            h_B1D = jnp.take_along_axis(h_BTD, (lengths - 1)[:, None, None], axis=1)
            return self._logits(h_B1D)[:, 0], cache
        return self._logits(h_BTD), cache

    def per_layer(
        self, serving: bool = False, fold: bool = False
    ) -> list[tuple[DecoderLayer, tuple]]:
        """Each decoder layer as its own module (slices of the stacked parameters) with its
        fused projection kernels (DecoderLayer.fused, with the norms' weights in them when
        fold: then prefill and decode take folded=True).

        serving: the unfused q/k/v and gate/up kernels and biases are left empty (decode and
        prefill with the fused kernels never read them), so a sampler that keeps this layout
        holds each weight once.
        """
        graphdef, state = nnx.split(self.model.layers)
        n = self.model.layers.input_layernorm.weight.shape[0]
        layers = [
            nnx.merge(
                graphdef,
                nnx.spmd.remove_axis(jax.tree.map(lambda x, i=i: x[i], state), 0, _LAYERS_AXIS),
            )
            for i in range(n)
        ]
        out = [(layer, layer.fused(fold)) for layer in layers]
        if serving:
            for layer, _ in out:
                a, m = layer.self_attn, layer.mlp
                for proj in (a.q_proj, a.k_proj, a.v_proj, m.gate_proj, m.up_proj):
                    for p in (proj.kernel, proj.bias):
                        if p is not None:
                            p.set_value(jnp.zeros((0,), p.get_value().dtype))
        return out

    @_precise
    def decode(
        self,
        tokens,
        positions,
        cache: KVCache,
        layers=None,
        attention: str = "xla",
        interpret: bool | None = None,
        folded: bool = False,
    ) -> tuple[jax.Array, KVCache]:
        """Next-token logits[B, V] for tokens[B] at positions[B], each written to its own slot.

        Row b attends to cache slots <= positions[b]; positions must be < cache.max_len.
        layers: per_layer()'s modules and fused kernels, for a caller that decodes many steps
        with the same weights (each step then reads them in place, without slicing or fusing
        them again); the layers are unrolled either way (one cache array per layer).
        attention: "xla", or "pallas" (models.decode_attention: one kernel per layer that reads
        only the valid slots, where it applies).
        interpret: run that kernel in Pallas's interpreter (tests off a GPU); None: when the
        default backend is not a GPU (a caller placing work on other devices says which).
        folded: layers are per_layer(fold=True)'s (the kernel then also finishes the input norm).
        """
        if attention not in ("xla", "pallas"):
            raise ValueError(f"decode: attention={attention!r}; valid: 'xla', 'pallas'")
        S = cache.max_len
        rope = rotary(self.config, positions[:, None])
        valid_BS = jnp.arange(S)[None, :] <= positions[:, None]
        if layers is None:
            if folded:
                raise ValueError("decode: folded=True needs layers=per_layer(fold=True)")
            layers = self.per_layer()
        ks, vs = list(cache.k), list(cache.v)
        x_B1D = self.model.embed_tokens(tokens[:, None])
        c = self.config
        B, N, H = tokens.shape[0], c.num_attention_heads, c.head_dim
        kernel = attention == "pallas" and decode_attention.supported(
            c.dtype, N, c.num_key_value_heads, H, S
        )
        if interpret is None:
            interpret = jax.default_backend() != "gpu"
        # Without q/k norms the kernel also applies rotary and splits the fused projection.
        in_kernel_rope = kernel and not c.qk_norm
        rope_BH = tuple(r.reshape(B, H) for r in rope)  # [B, 1, 1, H]: one position a row
        for i, (layer, fused) in enumerate(layers):
            if in_kernel_rope:

                def attend_qkv(qkv_B1X, norm, i=i):
                    if norm is not None:  # (x [B, 1, D], bias [X H] or None, eps)
                        x, bias, eps = norm
                        bias = None if bias is None else bias.reshape(-1, H)
                        norm = (x.reshape(B, -1), bias, eps)
                    o, ks[i], vs[i] = decode_attention.decode_attention_qkv(
                        qkv_B1X.reshape(B, -1, H),
                        rope_BH,
                        ks[i],
                        vs[i],
                        positions,
                        num_heads=N,
                        k_pos=cache.k_pos,
                        interpret=interpret,
                        norm=norm,
                    )
                    return o[:, None]

                def activation(gu_B1X, x_B1D, eps=layer.post_attention_layernorm.eps):
                    h = decode_mlp.folded_activation(
                        gu_B1X.reshape(B, -1), x_B1D.reshape(B, -1), eps, interpret=interpret
                    )
                    return h[:, None]

                act = activation if folded else None
                x_B1D = layer.decode_step(x_B1D, attend_qkv, fused, folded, act)
                continue

            def attend(q, k, v, i=i):
                if kernel:
                    o, ks[i], vs[i] = decode_attention.decode_attention(
                        q[:, 0],
                        k[:, 0],
                        v[:, 0],
                        ks[i],
                        vs[i],
                        positions,
                        k_pos=cache.k_pos,
                        interpret=interpret,
                    )
                    return o[:, None], None
                # Only the new slots are written, in place in the layer's own buffers.
                ks[i] = write_slot(ks[i], k[:, 0], positions, cache.k_pos)
                vs[i] = write_slot(vs[i], v[:, 0], positions, KVCache.V_POS)
                o = xla_decode_attention(q[:, 0], ks[i], vs[i], valid_BS, cache.k_pos)
                return o[:, None], None

            x_B1D, _ = layer(x_B1D, rope, attend, fused, folded)
        logits_BV = self._logits(self.model.norm(x_B1D))[:, 0]
        return logits_BV, KVCache(k=tuple(ks), v=tuple(vs), k_pos=cache.k_pos)
