"""ModelConfig: the shapes of a Qwen2 / Llama / Qwen3 decoder, and its HF config.json form."""

from __future__ import annotations

import dataclasses
from typing import Any

MESH_AXES = ("data", "fsdp", "tensor")

# Logical axis -> mesh axes. Parameters and activations are annotated with logical names only.
RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp"),
    "length": (),
    "embed": ("fsdp",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": (),
    "mlp": ("tensor",),
    "vocab": ("tensor",),
    "layers": (),
}


MODEL_TYPES = ("qwen2", "llama", "qwen3")
DTYPES = ("float32", "bfloat16")
ATTENTION_IMPLS = ("xla", "cudnn")
REMAT_POLICIES = ("none", "full", "dots_saveable")
MATMUL_PRECISIONS = ("auto", "highest", "high", "default")
ROPE_TYPES = ("linear", "llama3")  # besides "default" (stored as rope_scaling=None)
_ARCHITECTURES = {
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of a decoder-only LM (HF fields plus runtime-only fields)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3" | "linear", ...}; None = default
    tie_word_embeddings: bool = False
    attention_bias: bool | None = None  # None: True for qwen2 (q/k/v bias), else False
    qk_norm: bool | None = None  # None: True for qwen3, else False
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    # Runtime fields (not in config.json).
    dtype: str = "float32"  # compute dtype of activations
    param_dtype: str = "float32"
    attention_impl: str = "xla"  # "cudnn" needs a GPU and bfloat16 compute
    remat: str = "none"  # per-layer rematerialisation policy
    # auto: "highest" (true float32 matmuls) for float32 compute, the backend's fast path
    # ("default": TF32 on GPUs, bf16 passes on TPUs) for bfloat16 compute.
    matmul_precision: str = "auto"

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)
        if self.model_type not in MODEL_TYPES:
            raise ValueError(
                f"model_type={self.model_type!r} is not supported; use one of {MODEL_TYPES}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size={self.hidden_size} is not divisible by "
                    f"num_attention_heads={self.num_attention_heads}; give head_dim explicitly"
                )
            set_("head_dim", self.hidden_size // self.num_attention_heads)
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be a positive even int (rotary)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if (
            self.model_type == "qwen2"
            and self.head_dim * self.num_attention_heads != self.hidden_size
        ):
            raise ValueError(
                f"qwen2 requires head_dim = hidden_size / num_attention_heads "
                f"(vLLM's Qwen2 ignores head_dim), got head_dim={self.head_dim}, "
                f"hidden_size={self.hidden_size}, num_attention_heads={self.num_attention_heads}"
            )
        if self.attention_bias is None:
            set_("attention_bias", self.model_type == "qwen2")
        if self.qk_norm is None:
            set_("qk_norm", self.model_type == "qwen3")
        if self.model_type == "qwen2" and not self.attention_bias:
            raise ValueError("qwen2 always has q/k/v biases; attention_bias=False is not valid")
        if self.model_type != "qwen3" and self.qk_norm:
            raise ValueError(f"qk_norm=True is only valid for qwen3, not {self.model_type!r}")
        if self.model_type == "qwen3" and not self.qk_norm:
            raise ValueError("qwen3 always has q/k norms; qk_norm=False is not valid")
        if isinstance(self.eos_token_id, list):
            set_("eos_token_id", tuple(self.eos_token_id))
        set_("rope_scaling", _normalize_rope_scaling(self.rope_scaling))
        for name, valid in (
            ("dtype", DTYPES),
            ("param_dtype", DTYPES),
            ("attention_impl", ATTENTION_IMPLS),
            ("remat", REMAT_POLICIES),
            ("matmul_precision", MATMUL_PRECISIONS),
        ):
            if getattr(self, name) not in valid:
                raise ValueError(f"{name}={getattr(self, name)!r} is not valid; use one of {valid}")
        if self.attention_impl == "cudnn" and self.dtype != "bfloat16":
            raise ValueError(
                f"attention_impl='cudnn' needs dtype='bfloat16' (cuDNN flash attention has no "
                f"float32 kernel), got dtype={self.dtype!r}; use attention_impl='xla'"
            )

    def __hash__(self):
        scaling = tuple(sorted(self.rope_scaling.items())) if self.rope_scaling else None
        return hash(
            tuple(
                scaling if f.name == "rope_scaling" else getattr(self, f.name)
                for f in dataclasses.fields(self)
            )
        )

    @property
    def precision(self) -> str:
        """The jax matmul precision of this model's computations (matmul_precision resolved)."""
        if self.matmul_precision != "auto":
            return self.matmul_precision
        return "highest" if self.dtype == "float32" else "default"

    def replace(self, **changes) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @property
    def num_params(self) -> int:
        """Number of parameters of the model this config describes."""
        D, F, L, V = (
            self.hidden_size,
            self.intermediate_size,
            self.num_hidden_layers,
            self.vocab_size,
        )
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        attn = D * q + 2 * D * kv + q * D
        if self.attention_bias:
            attn += q + 2 * kv + (D if self.model_type != "qwen2" else 0)
        if self.qk_norm:
            attn += 2 * self.head_dim
        layer = attn + 3 * D * F + 2 * D
        return V * D * (1 if self.tie_word_embeddings else 2) + L * layer + D

    @classmethod
    def from_hf(cls, hf: dict[str, Any], **overrides) -> ModelConfig:
        """A ModelConfig from the content of an HF config.json (runtime fields as overrides)."""
        model_type = hf.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(
                f"config.json model_type={model_type!r} is not supported; use one of {MODEL_TYPES}"
            )
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported; only 'silu'")
        if hf.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported")
        if hf.get("use_sliding_window"):
            raise ValueError("use_sliding_window=True is not supported")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling")
        rope = dict(rope) if rope else {}
        theta = rope.pop("rope_theta", None)
        theta = hf.get("rope_theta", theta)
        fields: dict[str, Any] = dict(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=hf["num_attention_heads"],
            num_key_value_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim"),
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta if theta is not None else 10000.0),
            rope_scaling=rope or None,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
        )
        if model_type != "qwen2":  # Qwen2 always has q/k/v biases and no flag for them
            fields["attention_bias"] = bool(hf.get("attention_bias", False))
        stored = hf.get("dtype") or hf.get("torch_dtype")
        if stored in DTYPES:
            fields["param_dtype"] = stored
            fields["dtype"] = stored
        fields.update(overrides)
        return cls(**fields)

    def to_hf(self) -> dict[str, Any]:
        """The config.json content that transformers (4.x and 5.x) and vLLM load."""
        rope_parameters = dict(self.rope_scaling or {"rope_type": "default"})
        rope_parameters["rope_theta"] = self.rope_theta
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        out: dict[str, Any] = {
            "architectures": [_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "rope_parameters": rope_parameters,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "use_cache": True,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": self.param_dtype,
            "dtype": self.param_dtype,
        }
        if self.model_type == "llama":
            out.update(attention_bias=self.attention_bias, mlp_bias=False, pretraining_tp=1)
        else:
            out.update(
                use_sliding_window=False,
                sliding_window=None,
                max_window_layers=self.num_hidden_layers,
            )
        if self.model_type == "qwen3":
            out["attention_bias"] = self.attention_bias
        return out


def _normalize_rope_scaling(rope: dict | None) -> dict | None:
    """rope_scaling as {"rope_type": ..., params}; None for the default rotary embedding."""
    if not rope:
        return None
    rope = {k: v for k, v in rope.items() if k != "rope_theta"}
    if "type" in rope:  # legacy key
        rope.setdefault("rope_type", rope.pop("type"))
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return None
    if kind not in ROPE_TYPES:
        raise ValueError(
            f"rope_type={kind!r} is not supported; use 'default' or one of {ROPE_TYPES}"
        )
    need = _LLAMA3_KEYS if kind == "llama3" else ("factor",)
    missing = [k for k in need if k not in rope]
    if missing:
        raise ValueError(f"rope_scaling of type {kind!r} lacks {missing}; got {rope}")
    return rope


def tiny(**overrides) -> ModelConfig:
    """A 2-layer, hidden-128 Qwen2-style model (untied; vLLM-compatible head_dim 32)."""
    fields = dict(
        model_type="qwen2",
        vocab_size=128,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def qwen2_0p5b(**overrides) -> ModelConfig:
    """The shapes of Qwen2.5-0.5B."""
    fields = dict(
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151643,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def qwen2_1p5b(**overrides) -> ModelConfig:
    """The shapes of Qwen2.5-1.5B."""
    fields = dict(
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        head_dim=128,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151643,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def llama3_8b(**overrides) -> ModelConfig:
    """The shapes of Llama-3-8B (untied, grouped-query attention, no q/k/v bias)."""
    fields = dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_id=128001,
    )
    fields.update(overrides)
    return ModelConfig(**fields)
