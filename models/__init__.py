"""Tandem's model family (Qwen2 / Llama / Qwen3 in flax.nnx) and its Hugging Face interop."""

from models.config import ModelConfig, llama3_8b, qwen2_0p5b, qwen2_1p5b, tiny
from models.hf import (
    from_hf_tensors,
    load_hf,
    read_hf_tensors,
    save_hf,
    save_hf_tensors,
    to_hf_tensors,
)
from models.kv_cache import KVCache, init_cache
from models.sharding import cache_sharding, create_model, logical_sharding, make_mesh, shard_model
from models.transformer import Transformer

__all__ = [
    "KVCache",
    "ModelConfig",
    "Transformer",
    "cache_sharding",
    "create_model",
    "from_hf_tensors",
    "init_cache",
    "llama3_8b",
    "load_hf",
    "logical_sharding",
    "make_mesh",
    "qwen2_0p5b",
    "qwen2_1p5b",
    "read_hf_tensors",
    "save_hf",
    "save_hf_tensors",
    "shard_model",
    "tiny",
    "to_hf_tensors",
]
