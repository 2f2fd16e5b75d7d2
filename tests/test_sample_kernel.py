"""The Pallas sampling kernels (interpreted on a CPU) against the XLA sampler: the same token
from the same key, the same log-prob within float32 rounding, the argmax for greedy rows, and
the engine's generations unchanged with the kernels on."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_weights import randomize

from models import create_model, tiny
from rl.rollout import sample_kernel as sk
from rl.rollout.base import GenerationRequest, SamplingParams
from rl.rollout.jax_engine import JaxEngine
from rl.rollout.sampling import process_logits, sample


def _xla(x, keys, temp):
    B = x.shape[0]
    ones, none = jnp.ones(B), jnp.zeros(B, jnp.int32)
    return jax.jit(lambda x, k, t: sample(process_logits(x, t, none, ones, False), k, t))(
        x, keys, temp
    )


def test_kernel_draws_what_the_xla_sampler_draws():
    """Rows over a vocabulary of three blocks and a partial fourth; one row's mass sits in
    the partial block, one row's at its first entry; temperatures 0 (greedy), 0.5, 1 and 1.7."""
    rng = np.random.default_rng(0)
    B, V = 16, 3 * sk.BLOCK + 37
    x = (3.0 * rng.standard_normal((B, V))).astype(np.float32)
    x[1, V - 5] = 40.0  # the partial last block
    x[2, 0] = 40.0
    temp = np.tile(np.asarray([1.0, 0.5, 0.0, 1.7], np.float32), B // 4)
    keys = jax.random.key_data(jax.random.split(jax.random.key(7), B))
    want_tok, want_lp = _xla(jnp.asarray(x), keys, jnp.asarray(temp))
    tok, lp = sk.sample(jnp.asarray(x), keys, jnp.asarray(temp), interpret=True)
    assert tok.dtype == jnp.int32 and lp.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(want_tok))
    assert np.abs(np.asarray(lp) - np.asarray(want_lp)).max() < 1e-5
    assert tok[1] == V - 5 and tok[2] == 0
    greedy = temp == 0
    np.testing.assert_array_equal(np.asarray(tok)[greedy], np.argmax(x, axis=1)[greedy])


def test_kernel_draws_at_the_softmax_probabilities():
    """Many keys over one row whose mass sits in four tokens of three blocks: the draws'
    frequencies are the softmax probabilities and each log-prob is its token's."""
    rng = np.random.default_rng(1)
    V = 2 * sk.BLOCK + 100
    x = (2.0 * rng.standard_normal(V)).astype(np.float32)
    big = [5, sk.BLOCK - 1, sk.BLOCK, V - 1]
    x[big] = [9.0, 9.5, 8.5, 9.2]
    probs = np.exp(x.astype(np.float64) - x.max())
    probs /= probs.sum()
    n = 1500
    keys = jax.random.key_data(jax.random.split(jax.random.key(3), n))
    xs = jnp.broadcast_to(jnp.asarray(x), (n, V))
    tok, lp = sk.sample(xs, keys, jnp.ones(n), interpret=True)
    tok, lp = np.asarray(tok), np.asarray(lp)
    assert np.abs(lp - np.log(probs[tok])).max() < 1e-5
    freq = np.bincount(tok, minlength=V) / n
    assert np.abs(freq - probs).max() < 0.04
    assert freq[big].sum() > 0.5


@pytest.mark.parametrize("temperature", [1.0, 0.0])
@pytest.mark.parametrize("attention", ["xla", "pallas"])
def test_engine_generates_the_same_with_the_kernels(temperature, attention):
    """The sampling kernels alone, and with the Pallas decode attention (the default pair on
    one GPU): the XLA engine's tokens, its log-probs within float32 rounding."""
    model = randomize(create_model(tiny(), seed=0), seed=0)
    rng = np.random.RandomState(0)
    reqs = [
        GenerationRequest(
            f"r{i}",
            rng.randint(2, 128, 3 + i).astype(np.int32),
            SamplingParams(max_new_tokens=10, temperature=temperature, seed=i),
        )
        for i in range(5)
    ]
    want = JaxEngine(model, chunk=4, sample_kernel=False).generate(reqs)
    engine = JaxEngine(model, chunk=4, decode_attention=attention, sample_kernel=True)
    got = engine.generate(reqs)
    tol = 1e-6 if attention == "xla" else 1e-5  # the kernel sums attention in another order
    for w, g in zip(want, got, strict=True):
        np.testing.assert_array_equal(g.token_ids, w.token_ids)
        assert np.abs(np.asarray(g.logprobs) - np.asarray(w.logprobs)).max() < tol


def test_engine_takes_the_kernels_on_one_device_only():
    model = create_model(tiny())
    assert not JaxEngine(model).sample_kernel  # a CPU: "auto" keeps XLA's sampling
    assert JaxEngine(model, decode_attention="pallas").sample_kernel
    assert not JaxEngine(model, decode_attention="pallas", sample_kernel=False).sample_kernel
    with pytest.raises(ValueError, match="sample_kernel=True runs on one device, got 2"):
        JaxEngine(model, devices=jax.devices()[:2], sample_kernel=True)


def test_a_jax_without_pallas_triton_keeps_the_xla_paths(monkeypatch):
    """Without Pallas's Triton backend (a jax that dropped it) nothing imports it: the kernels
    report unsupported, 'auto' keeps XLA's paths and asking for them names what is missing."""
    from models import decode_attention as da

    monkeypatch.setattr(da, "plgpu", None)
    assert not da.available() and not da.supported(jnp.bfloat16, 14, 2, 64, 384)
    model = create_model(tiny())
    engine = JaxEngine(model)
    assert engine.decode_attention == "xla" and not engine.sample_kernel
    for kwargs in (dict(decode_attention="pallas"), dict(sample_kernel=True)):
        with pytest.raises(ValueError, match="need Pallas's Triton backend, which jax"):
            JaxEngine(model, **kwargs)
