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


@pytest.mark.slow
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


LOWERING_ERROR = "Unimplemented primitive in Pallas Triton lowering: run_scoped"


def refuse_lowering(*args, **kwargs):
    """A kernel call failing as jax's lowering does when it cannot lower the kernel."""
    raise NotImplementedError(LOWERING_ERROR)


@pytest.fixture
def fresh_probe():
    """kernels.failure's per-device answer forgotten before and after the test."""
    from rl.rollout import kernels

    kernels.failure.cache_clear()
    yield kernels
    kernels.failure.cache_clear()


def _shapes(model):
    """kernels.failure's arguments for a model on this machine's first device."""
    c = model.config
    G = c.num_attention_heads // c.num_key_value_heads
    return jax.devices()[0], jnp.dtype(c.dtype), G, c.head_dim, c.vocab_size, c.hidden_size


def test_kernel_probe_runs_both_kernels_on_this_device(fresh_probe, monkeypatch):
    """Both kernels compile (interpreted here) and run at the model's head shapes and
    vocabulary; the attention kernel only at shapes the model would run it for."""
    from models import decode_attention as da

    calls, real = [], da.decode_attention_qkv

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(da, "decode_attention_qkv", counted)
    model = create_model(tiny())
    assert fresh_probe.failure(*_shapes(model)) is None and len(calls) == 1
    dev, dtype, _, _, vocab, hidden = _shapes(model)
    # 17 query heads a kv head (more than HEADS_PAD): the attention kernel is not tried
    assert fresh_probe.failure(dev, dtype, 17, 32, vocab, hidden) is None and len(calls) == 1


def test_kernels_asked_for_that_fail_on_the_device_are_a_config_error_fake_lowering_fault(
    fresh_probe, monkeypatch
):
    """A jax that keeps the Triton backend importable but cannot lower a kernel (simulated: the
    kernel raises as jax's lowering does): asking for the kernels fails at construction with
    the device and the error, not at the first decode step; 'auto' off a GPU keeps XLA's."""
    from models import decode_attention as da

    monkeypatch.setattr(da, "decode_attention_qkv", refuse_lowering)
    model = create_model(tiny())
    assert fresh_probe.failure(*_shapes(model)) == f"NotImplementedError: {LOWERING_ERROR}"
    for kwargs in (dict(decode_attention="pallas"), dict(sample_kernel=True)):
        with pytest.raises(ValueError, match="the Pallas kernels fail on cpu: NotImplementedError"):
            JaxEngine(model, **kwargs)
    engine = JaxEngine(model)
    assert engine.decode_attention == "xla" and not engine.sample_kernel


@pytest.mark.slow
def test_auto_decodes_with_xla_when_the_kernels_fail_fake_gpu_platform_and_lowering_fault(
    fresh_probe, monkeypatch, capsys
):
    """'auto' as on a GPU (this CPU counted as one, its kernels interpreted): the kernels when
    the probe passes; when they fail (simulated), XLA's paths, the reason on stderr, and
    generation goes on."""
    from models import decode_attention as da

    monkeypatch.setattr(fresh_probe, "AUTO_PLATFORMS", ("gpu", "cpu"))
    model = create_model(tiny())
    engine = JaxEngine(model)
    assert engine.decode_attention == "pallas" and engine.sample_kernel
    assert capsys.readouterr().err == ""

    fresh_probe.failure.cache_clear()
    monkeypatch.setattr(da, "decode_attention_qkv", refuse_lowering)
    engine = JaxEngine(model)
    assert engine.decode_attention == "xla" and not engine.sample_kernel
    err = capsys.readouterr().err
    assert "the Pallas kernels fail on cpu (NotImplementedError: Unimplemented" in err, err
    req = GenerationRequest("r", np.arange(1, 6, dtype=np.int32), SamplingParams(8, seed=0))
    (out,) = engine.generate([req])
    assert len(out.token_ids) == 8
