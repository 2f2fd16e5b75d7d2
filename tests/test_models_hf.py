"""HF interop against transformers: load -> logits, save -> transformers, bit-exact round trips."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
import torch
import transformers
from flax import nnx
from safetensors import safe_open

from models import from_hf_tensors, load_hf, save_hf, save_hf_tensors, to_hf_tensors
from models.hf import INDEX_FILE, SINGLE_FILE, read_hf_tensors

FAMILIES = ("qwen2", "llama", "qwen3")
COMMON = dict(
    vocab_size=128,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _torch_model(family: str):
    """A tiny float32 transformers model with every weight random (norms near 1, biases != 0)."""
    if family == "qwen2":  # q/k/v biases, tied embeddings
        cfg = transformers.Qwen2Config(tie_word_embeddings=True, **COMMON)
        cls = transformers.Qwen2ForCausalLM
    elif family == "llama":  # untied, llama3 rope scaling
        cfg = transformers.LlamaConfig(
            tie_word_embeddings=False, rope_scaling=dict(LLAMA3), **COMMON
        )
        cls = transformers.LlamaForCausalLM
    else:  # q/k norms, head_dim != hidden / heads, biases on q/k/v/o
        cfg = transformers.Qwen3Config(
            head_dim=48, attention_bias=True, tie_word_embeddings=False, **COMMON
        )
        cls = transformers.Qwen3ForCausalLM
    torch.manual_seed(FAMILIES.index(family))
    model = cls(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """family -> (transformers model, its save_pretrained directory)."""
    out = {}
    for family in FAMILIES:
        model = _torch_model(family)
        path = str(tmp_path_factory.mktemp(f"hf_{family}"))
        model.save_pretrained(path)
        out[family] = (model, path)
    return out


_forward = nnx.jit(lambda m, t, p, s: m(t, p, s))
_hidden = nnx.jit(lambda m, t, p: m.hidden_states(t, p) @ m.lm_head_kernel())


def _tokens(B=2, T=16, seed=0):
    return np.random.RandomState(seed).randint(0, COMMON["vocab_size"], (B, T))


def _torch_logits(model, tokens, positions=None):
    with torch.no_grad():
        pos = None if positions is None else torch.tensor(positions)
        return model(torch.tensor(tokens), position_ids=pos).logits.numpy()


@pytest.mark.parametrize("family", FAMILIES)
def test_load_hf_logits_match_transformers(hf, family):
    torch_model, path = hf[family]
    model = load_hf(path)
    assert model.config.model_type == family
    assert model.config.tie_word_embeddings == (family == "qwen2")
    tokens = _tokens()
    positions = np.arange(16)[None].repeat(2, 0) + 37  # offset positions exercise the rotary
    ref = _torch_logits(torch_model, tokens, positions)
    assert np.abs(ref).max() > 1.0  # random weights give non-trivial logits
    out = np.asarray(_forward(model, jnp.asarray(tokens), jnp.asarray(positions), None))
    assert out.dtype == np.float32 and out.shape == (2, 16, COMMON["vocab_size"])
    assert np.abs(out - ref).max() < 1e-4
    # The learner's path: final hidden states times the LM-head kernel.
    via_hidden = np.asarray(_hidden(model, jnp.asarray(tokens), jnp.asarray(positions)))
    assert np.abs(via_hidden - ref).max() < 1e-4


def test_llama3_rope_scaling_is_applied(hf):
    """Control: the same weights without the llama3 scaling disagree with transformers."""
    torch_model, path = hf["llama"]
    assert load_hf(path).config.rope_scaling["rope_type"] == "llama3"
    unscaled = load_hf(path, rope_scaling=None)
    tokens = _tokens()
    positions = np.arange(16)[None].repeat(2, 0) + 37
    ref = _torch_logits(torch_model, tokens, positions)
    out = np.asarray(_forward(unscaled, jnp.asarray(tokens), jnp.asarray(positions), None))
    assert np.abs(out - ref).max() > 1e-2


def _assert_same_tensors(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert a[name].shape == b[name].shape, name
        assert np.array_equal(a[name], b[name]), name


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("family", FAMILIES)
def test_save_hf_loads_in_transformers_and_round_trips(hf, family, sharded, tmp_path):
    torch_model, src = hf[family]
    model = load_hf(src)
    out_dir = str(tmp_path / "out")
    written = save_hf(model, out_dir, max_shard_bytes=150_000 if sharded else 10**9)
    files = sorted(os.listdir(out_dir))
    shards = [f for f in files if f.endswith(".safetensors")]
    if sharded:
        assert INDEX_FILE in files and SINGLE_FILE not in files and len(shards) > 2
        with open(os.path.join(out_dir, INDEX_FILE)) as f:
            index = json.load(f)
        assert sorted(set(index["weight_map"].values())) == shards
        members = {s: [k for k, v in index["weight_map"].items() if v == s] for s in shards}
        saved = read_hf_tensors(out_dir)
        for names in members.values():  # within the limit, or a single tensor larger than it
            assert sum(saved[n].nbytes for n in names) <= 150_000 or len(names) == 1
        assert max(len(names) for names in members.values()) > 1
        assert index["metadata"]["total_size"] == sum(v.nbytes for v in saved.values())
    else:
        assert shards == [SINGLE_FILE] and INDEX_FILE not in files
    assert set(written) >= set(shards) | {"config.json", "generation_config.json"}
    for shard in shards:
        with safe_open(os.path.join(out_dir, shard), framework="numpy") as f:
            assert f.metadata() == {"format": "pt"}

    # HF -> ours -> HF is the identity on every tensor; a tied model writes no lm_head.
    original, saved = read_hf_tensors(src), read_hf_tensors(out_dir)
    _assert_same_tensors(original, saved)
    assert ("lm_head.weight" in saved) == (family != "qwen2")

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out_dir).float().eval()
    assert type(reloaded) is type(torch_model)
    tokens = _tokens(seed=1)
    ours = np.asarray(_forward(model, jnp.asarray(tokens), None, None))
    assert np.abs(_torch_logits(reloaded, tokens) - ours).max() < 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_pure_conversions_round_trip(hf, family):
    _, path = hf[family]
    model = load_hf(path)
    tensors = read_hf_tensors(path)
    pure = from_hf_tensors(model.config, tensors)
    state = nnx.state(model, nnx.Param)
    assert jax.tree.structure(pure) == jax.tree.structure(nnx.to_pure_dict(state))
    _assert_same_tensors(to_hf_tensors(model.config, pure), tensors)
    _assert_same_tensors(to_hf_tensors(model.config, state), tensors)

    # Orbax restores dict keys as strings and may keep {"value": x} nodes: same tensors.
    def orbax_form(tree):
        if isinstance(tree, dict):
            return {str(k): orbax_form(v) for k, v in tree.items()}
        return {"value": tree}

    _assert_same_tensors(to_hf_tensors(model.config, orbax_form(pure)), tensors)
    # The pure dict is what nnx.replace_by_pure_dict takes.
    nnx.replace_by_pure_dict(state, pure)
    assert np.array_equal(
        np.asarray(state["model"]["embed_tokens"]["embedding"][...]),
        tensors["model.embed_tokens.weight"],
    )


def test_from_hf_tensors_errors_name_the_tensor(hf):
    _, path = hf["qwen2"]
    config = load_hf(path).config
    tensors = read_hf_tensors(path)
    missing = {k: v for k, v in tensors.items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match="model.norm.weight"):
        from_hf_tensors(config, missing)
    wrong = dict(tensors, **{"model.norm.weight": np.ones(7, np.float32)})
    with pytest.raises(ValueError, match=r"model.norm.weight.*\(7,\)"):
        from_hf_tensors(config, wrong)
    extra = dict(tensors, **{"model.layers.9.mlp.up_proj.weight": np.ones(3, np.float32)})
    with pytest.raises(ValueError, match="layers.9"):
        from_hf_tensors(config, extra)
    # A tied checkpoint that still carries lm_head.weight loads (HF ties it to the embedding).
    with_head = dict(tensors, **{"lm_head.weight": tensors["model.embed_tokens.weight"]})
    from_hf_tensors(config, with_head)


def test_packed_sequences_match_each_sequence_alone(hf):
    torch_model, path = hf["qwen2"]
    model = load_hf(path)
    rng = np.random.RandomState(3)
    lengths = [5, 7, 3]
    seqs = [rng.randint(0, COMMON["vocab_size"], n) for n in lengths]
    T = 18  # 15 real tokens + 3 padding
    tokens = np.zeros((1, T), np.int64)
    segments = np.zeros((1, T), np.int32)
    positions = np.zeros((1, T), np.int32)
    start = 0
    for i, seq in enumerate(seqs):
        tokens[0, start : start + len(seq)] = seq
        segments[0, start : start + len(seq)] = i + 1
        positions[0, start : start + len(seq)] = np.arange(len(seq))
        start += len(seq)
    tokens[0, start:] = 11  # padding tokens must not leak into real ones
    packed = np.asarray(  # keyword arguments: the public signature
        nnx.jit(lambda m, t, p, s: m(t, positions=p, segment_ids=s))(
            model, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segments)
        )
    )
    assert np.isfinite(packed).all()
    # Each sequence alone: one right-padded batch (causal attention never sees the padding).
    alone = np.full((len(seqs), max(lengths)), 11, np.int64)
    for i, seq in enumerate(seqs):
        alone[i, : len(seq)] = seq
    alone_ref = _torch_logits(torch_model, alone)
    alone_ours = np.asarray(_forward(model, jnp.asarray(alone), None, None))
    start = 0
    for i, seq in enumerate(seqs):
        got = packed[0, start : start + len(seq)]
        assert np.abs(got - alone_ref[i, : len(seq)]).max() < 1e-4
        assert np.abs(got - alone_ours[i, : len(seq)]).max() < 1e-5
        start += len(seq)
    # Control: without segment ids the later sequences see the earlier ones.
    unmasked = np.asarray(_forward(model, jnp.asarray(tokens), jnp.asarray(positions), None))
    assert np.abs(unmasked[0, 5:12] - alone_ours[1, :7]).max() > 1e-2


def test_save_hf_tensors_bfloat16_with_tokenizer(hf, tmp_path):
    _, path = hf["llama"]
    model = load_hf(path)
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    vocab = {f"t{i}": i for i in range(COMMON["vocab_size"])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0"})
    )
    (tok_dir / "notes.txt").write_text("not a tokenizer file")

    tensors = to_hf_tensors(model.config, nnx.state(model, nnx.Param), dtype="bfloat16")
    assert all(str(v.dtype) == "bfloat16" for v in tensors.values())
    out_dir = str(tmp_path / "out")
    save_hf_tensors(model.config, tensors, out_dir, tokenizer_dir=str(tok_dir))
    files = set(os.listdir(out_dir))
    assert {"tokenizer.json", "tokenizer_config.json"} <= files and "notes.txt" not in files
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tok_dir / name).read_bytes() == open(os.path.join(out_dir, name), "rb").read()
    with open(os.path.join(out_dir, "config.json")) as f:
        assert json.load(f)["torch_dtype"] == "bfloat16"
    with open(os.path.join(out_dir, "generation_config.json")) as f:
        generation = json.load(f)
    assert generation["eos_token_id"] == model.config.eos_token_id

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out_dir)
    assert reloaded.dtype == torch.bfloat16
    expected = tensors["model.layers.1.mlp.down_proj.weight"].astype(np.float32)
    got = reloaded.model.layers[1].mlp.down_proj.weight.float().detach().numpy()
    assert np.array_equal(got, expected)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out_dir)
    assert tokenizer("t5 t7")["input_ids"] == [5, 7]
    # load_hf keeps the checkpoint's dtype unless told otherwise.
    assert load_hf(out_dir).config.param_dtype == "bfloat16"
    assert load_hf(out_dir, dtype="float32").model.norm.weight[...].dtype == jnp.float32
