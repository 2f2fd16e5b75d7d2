"""ModelConfig: validation, presets and the config.json round trip through transformers."""

import json

import pytest
import transformers

from models import ModelConfig, qwen2_0p5b, qwen2_1p5b, tiny

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
CONFIGS = {
    "tiny": tiny(),
    "llama": tiny(model_type="llama", rope_scaling=LLAMA3, rope_theta=5e5, eos_token_id=(1, 2)),
    "qwen3": tiny(
        model_type="qwen3",
        head_dim=48,
        attention_bias=True,
        tie_word_embeddings=True,
        bos_token_id=3,
    ),
}


def test_presets_have_the_published_parameter_counts():
    # Qwen2.5-0.5B and Qwen2.5-1.5B as reported by transformers (num_parameters()).
    assert qwen2_0p5b().num_params == 494_032_768
    assert qwen2_1p5b().num_params == 1_543_714_304
    t = tiny()
    assert (t.vocab_size, t.hidden_size, t.num_hidden_layers, t.head_dim) == (128, 128, 2, 32)
    assert t.head_dim * t.num_attention_heads == t.hidden_size  # what vLLM's Qwen2 assumes
    assert t.attention_bias and not t.qk_norm and not t.tie_word_embeddings


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(num_key_value_heads=3), "multiple of num_key_value_heads=3"),
        (dict(head_dim=16), "qwen2 requires head_dim"),
        (dict(model_type="gpt2"), "model_type='gpt2'"),
        (dict(model_type="llama", qk_norm=True), "qk_norm=True is only valid for qwen3"),
        (dict(attention_bias=False), "qwen2 always has q/k/v biases"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_type='yarn'"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "lacks"),
        (dict(remat="everything"), "remat='everything'"),
        (dict(dtype="float16"), "dtype='float16'"),
        (dict(attention_impl="cudnn"), "needs dtype='bfloat16'"),
        (dict(vocab_size=0), "vocab_size=0"),
    ],
)
def test_invalid_configs_name_the_value(changes, message):
    with pytest.raises(ValueError, match=message):
        tiny(**changes)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_to_hf_round_trips_and_loads_in_transformers(name, tmp_path):
    config = CONFIGS[name]
    hf = config.to_hf()
    assert ModelConfig.from_hf(hf) == config
    assert hash(ModelConfig.from_hf(hf)) == hash(config)  # usable as a static jit argument
    (tmp_path / "config.json").write_text(json.dumps(hf))
    loaded = transformers.AutoConfig.from_pretrained(str(tmp_path))
    assert loaded.model_type == config.model_type
    assert loaded.head_dim == config.head_dim
    assert loaded.tie_word_embeddings == config.tie_word_embeddings
    assert loaded.rope_parameters["rope_theta"] == config.rope_theta
    want_type = config.rope_scaling["rope_type"] if config.rope_scaling else "default"
    assert loaded.rope_parameters["rope_type"] == want_type
    # What transformers writes back reads as the same config.
    assert ModelConfig.from_hf(loaded.to_dict()) == config
    # transformers builds a model of exactly the size the config describes.
    model = transformers.AutoModelForCausalLM.from_config(loaded)
    assert sum(p.numel() for p in model.parameters()) == config.num_params


def test_from_hf_reads_legacy_and_new_rope_fields():
    base = tiny(model_type="llama").to_hf()
    for key in ("rope_scaling", "rope_parameters", "rope_theta"):
        base.pop(key)
    legacy = dict(base, rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    new = dict(base, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5})
    for hf in (legacy, new):
        config = ModelConfig.from_hf(hf)
        assert config.rope_theta == 5e5
        assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    default = ModelConfig.from_hf(dict(base, rope_parameters={"rope_type": "default"}))
    assert default.rope_scaling is None and default.rope_theta == 10000.0


def test_from_hf_runtime_fields_and_unsupported_features():
    hf = tiny().to_hf()
    assert (
        ModelConfig.from_hf(dict(hf, torch_dtype="bfloat16", dtype=None)).param_dtype == "bfloat16"
    )
    config = ModelConfig.from_hf(hf, remat="full", dtype="bfloat16")
    assert config.remat == "full" and config.dtype == "bfloat16" and config.param_dtype == "float32"
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        ModelConfig.from_hf(dict(hf, hidden_act="gelu"))
    with pytest.raises(ValueError, match="use_sliding_window"):
        ModelConfig.from_hf(dict(hf, use_sliding_window=True))
    with pytest.raises(ValueError, match="model_type='mistral'"):
        ModelConfig.from_hf(dict(hf, model_type="mistral"))
