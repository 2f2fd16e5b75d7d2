"""KV cache: right-padded prefill + per-row decode reproduce the full forward pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_weights import randomize

from models import create_model, init_cache, tiny
from models.kv_cache import KVCache

CONFIGS = {
    "qwen2_untied": tiny(),
    "qwen3_tied": tiny(model_type="qwen3", tie_word_embeddings=True, num_key_value_heads=1),
}


@pytest.mark.parametrize("k_pos", [3, 2])
@pytest.mark.parametrize("attention", ["xla", "pallas"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prefill_then_decode_matches_full_forward(name, attention, k_pos):
    """Also with the Pallas decode kernel (interpreted on a CPU), and with keys laid out
    [B, K, S, H] (k_pos 2, the kernel's) as well as [B, K, H, S]: float32 stays float32."""
    _prefill_then_decode(name, attention, k_pos, fold=False)


@pytest.mark.parametrize("attention", ["xla", "pallas"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_folded_norms_prefill_then_decode_matches_full_forward(name, attention):
    """The sampler's layout with the norms' weights folded into the q/k/v and gate/up kernels
    (per_layer(fold=True)): the same logits within 1e-5 in float32, with the kernel finishing
    the input norm (qwen2) and with XLA's steps."""
    _prefill_then_decode(name, attention, 2, fold=True)


def _prefill_then_decode(name, attention, k_pos, fold):
    config = CONFIGS[name]
    model = randomize(create_model(config, seed=1))
    rng = np.random.RandomState(0)
    lengths = np.array([5, 2, 7])
    B, T_prompt, steps, S = 3, 8, 5, 16
    # Each row: lengths[b] prompt tokens, then `steps` fed tokens (teacher forcing).
    full = rng.randint(1, config.vocab_size, (B, max(lengths) + steps))
    prompts = np.full((B, T_prompt), 99)  # right padding with a real token id: must not leak
    for b, n in enumerate(lengths):
        prompts[b, :n] = full[b, :n]
    forward = nnx.jit(lambda m, t: m(t))
    ref = np.asarray(forward(model, jnp.asarray(full)))  # rows right-padded by other tokens
    assert np.abs(ref).max() > 1.0

    if fold:
        layers = lambda m: m.per_layer(fold=True)
        prefill = nnx.jit(lambda m, t, n, c: m.prefill(t, n, c, layers=layers(m), folded=True))
        decode = nnx.jit(lambda m, t, p, c: m.decode(t, p, c, layers(m), attention, folded=True))
    else:
        prefill = nnx.jit(lambda m, t, n, c: m.prefill(t, n, c))
        decode = nnx.jit(lambda m, t, p, c: m.decode(t, p, c, attention=attention))
    cache = init_cache(config, B, S, k_pos=k_pos)
    logits, cache = prefill(model, jnp.asarray(prompts), jnp.asarray(lengths), cache)
    assert logits.dtype == jnp.float32 and logits.shape == (B, T_prompt, config.vocab_size)
    logits = np.asarray(logits)
    k0 = np.moveaxis(np.asarray(cache.k[0]), k_pos, 3)  # layer 0: [B, K, H, S]
    for b, n in enumerate(lengths):
        assert np.abs(logits[b, :n] - ref[b, :n]).max() < 1e-5
        # Slots past the prompt hold nothing; slots inside it hold real keys.
        assert not k0[b, ..., n:].any() and k0[b, ..., n - 1].any()

    positions = jnp.asarray(lengths)
    for step in range(steps):
        tokens = jnp.asarray(full[np.arange(B), lengths + step])
        logits_BV, cache = decode(model, tokens, positions, cache)
        assert logits_BV.dtype == jnp.float32 and logits_BV.shape == (B, config.vocab_size)
        want = ref[np.arange(B), lengths + step]
        assert np.abs(np.asarray(logits_BV) - want).max() < 1e-5, step
        positions = positions + 1
    assert isinstance(cache, KVCache) and cache.max_len == S and cache.k_pos == k_pos
    L, K, H = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
    assert len(cache.k) == len(cache.v) == L
    assert {k.shape for k in cache.k} == {(B, K, H, S) if k_pos == 3 else (B, K, S, H)}
    assert {v.shape for v in cache.v} == {(B, K, S, H)}


@pytest.fixture(scope="module")
def tiny_model():
    return randomize(create_model(tiny()))


def test_decode_is_one_compiled_program_and_cache_is_a_pytree(tiny_model):
    config, model = tiny_model.config, tiny_model
    graphdef, state = nnx.split(model)
    traces = []

    @jax.jit
    def step(state, tokens, positions, cache):
        traces.append(1)
        return nnx.merge(graphdef, state).decode(tokens, positions, cache)

    cache = init_cache(config, 2, 8, dtype=jnp.float32)
    assert len(jax.tree.leaves(cache)) == 2 * config.num_hidden_layers  # k and v per layer
    for t in range(4):
        positions = jnp.array([t, t + 2])  # rows at different positions in one call
        _, cache = step(state, jnp.array([3, 4]), positions, cache)
    assert len(traces) == 1
    # Row 0 wrote slots 0..3, row 1 wrote slots 2..5, in every layer; nothing else.
    want = [
        [True, True, True, True, False, False, False, False],
        [False, False, True, True, True, True, False, False],
    ]
    for layer in range(config.num_hidden_layers):
        written = np.abs(np.asarray(cache.v[layer])).sum(axis=(1, 3)) > 0  # [B, K, S, H]
        assert written.tolist() == want, layer


def test_a_key_layout_other_than_2_or_3_is_an_error(tiny_model):
    with pytest.raises(ValueError, match="k_pos=1; valid: 2, 3"):
        init_cache(tiny_model.config, 1, 4, k_pos=1)


def test_prefill_longer_than_cache_is_an_error(tiny_model):
    config, model = tiny_model.config, tiny_model
    with pytest.raises(ValueError, match="max_len=4"):
        model.prefill(jnp.zeros((1, 6), jnp.int32), jnp.array([6]), init_cache(config, 1, 4))


def test_decode_writes_the_cache_in_place(tiny_model):
    """Decode steps in a loop compile to in-place slot writes: no instruction copies or
    transposes a layer's whole cache array (a per-row vmapped write did, and so did a stacked
    [L, B, S, K, H] cache, whose layer slices the attention copied and transposed)."""
    config, model = tiny_model.config, tiny_model
    graphdef, state = nnx.split(model)
    B, S = 4, 64

    def steps(state, cache, positions):
        m = nnx.merge(graphdef, state)

        def one(i, c):
            return m.decode(jnp.arange(B), positions + i, c)[1]

        return jax.lax.fori_loop(0, 3, one, cache)

    cache = init_cache(config, B, S, dtype=jnp.float32)
    hlo = jax.jit(steps, donate_argnums=(1,)).lower(state, cache, jnp.zeros(B, jnp.int32))
    text = hlo.compile().as_text()
    K, H = config.num_key_value_heads, config.head_dim
    wholes = (f"f32[{B},{K},{H},{S}]", f"f32[{B},{K},{S},{H}]")
    assert "scatter(" in text
    moved = [
        line.strip()
        for line in text.splitlines()
        for whole in wholes
        if f"= {whole}" in line
        and (" copy(" in line or " transpose(" in line or "fusion(" in line)
        and "scatter" not in line
    ]
    assert not moved, moved[:3]


def test_folded_without_the_folded_layers_is_refused(tiny_model):
    """folded=True with the stacked (unfolded) weights would drop the norms' weights."""
    config, model = tiny_model.config, tiny_model
    cache = init_cache(config, 2, 16)
    tokens = jnp.ones((2, 4), jnp.int32)
    with pytest.raises(ValueError, match="folded=True needs layers=per_layer"):
        model.prefill(tokens, jnp.asarray([4, 2]), cache, folded=True)
    with pytest.raises(ValueError, match="folded=True needs layers=per_layer"):
        model.decode(tokens[:, 0], jnp.asarray([4, 2]), cache, folded=True)
