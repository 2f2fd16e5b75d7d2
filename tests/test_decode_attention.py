"""The Pallas decode-attention kernel (interpreted on a CPU) against the XLA path: outputs in
float32 within 1e-6, the current token's key and value written to its slot and nothing else;
with the valid blocks split over several programs (SPLITS) as well, and for both key layouts
(KVCache.k_pos)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import create_model, init_cache, tiny
from models import decode_attention as da
from models.decode_attention import decode_attention, decode_attention_qkv, supported
from models.kv_cache import write_slot, xla_decode_attention
from models.transformer import apply_rotary, rotary
from rl.rollout.jax_engine import JaxEngine


def _case(B, K, G, H, S, dtype, seed=0, k_pos=3):
    rng = np.random.default_rng(seed)
    arr = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
    kc = arr(B, K, H, S) if k_pos == 3 else arr(B, K, S, H)
    return arr(B, K * G, H), arr(B, K, H), arr(B, K, H), kc, arr(B, K, S, H)


def _xla(q, kn, vn, kc, vc, pos, k_pos=3):
    k2, v2 = write_slot(kc, kn, pos, k_pos), write_slot(vc, vn, pos, 2)
    valid = jnp.arange(vc.shape[2])[None, :] <= pos[:, None]
    return xla_decode_attention(q, k2, v2, valid, k_pos), k2, v2


@pytest.mark.parametrize(
    "K, G, S, positions",
    [
        (2, 7, 128, [0, 1, 63, 64, 65, 127]),  # block edges of 64, the first and last slot
        (1, 1, 48, [0, 15, 16, 47]),  # one query head per kv head; 48 slots: blocks of 16
        (4, 16, 32, [3, 31]),  # a full group of 16 query heads
    ],
)
@pytest.mark.parametrize("splits", [1, 2, 3])
@pytest.mark.parametrize("k_pos", [3, 2])
def test_kernel_matches_the_xla_path_in_float32(K, G, S, positions, splits, k_pos, monkeypatch):
    """Against the XLA path in the same key layout (a transposed operand sums in another
    order in the interpreter's dot)."""
    monkeypatch.setattr(da, "SPLITS", splits)  # 3 parts of 2 blocks: one part may be empty
    pos = jnp.asarray(positions, jnp.int32)
    q, kn, vn, kc, vc = _case(len(positions), K, G, 64, S, jnp.float32, k_pos=k_pos)
    want_o, want_k, want_v = _xla(q, kn, vn, kc, vc, pos, k_pos)
    o, k, v = decode_attention(q, kn, vn, kc, vc, pos, k_pos=k_pos, interpret=True)
    assert o.shape == want_o.shape and o.dtype == jnp.float32
    assert np.abs(np.asarray(o) - np.asarray(want_o)).max() < 1e-6
    assert np.array_equal(np.asarray(k), np.asarray(want_k))
    assert np.array_equal(np.asarray(v), np.asarray(want_v))


def test_kernel_in_bfloat16_is_within_rounding_of_the_xla_path():
    pos = jnp.asarray([0, 5, 64, 127], jnp.int32)
    q, kn, vn, kc, vc = _case(4, 2, 7, 64, 128, jnp.bfloat16, seed=1)
    want_o, want_k, want_v = _xla(q, kn, vn, kc, vc, pos)
    o, k, v = decode_attention(q, kn, vn, kc, vc, pos, interpret=True)
    want = np.asarray(want_o, np.float32)
    # The kernel normalizes after p.v (flash order), XLA before: one bfloat16 rounding apart.
    assert np.abs(np.asarray(o, np.float32) - want).max() <= 2**-7 * max(1.0, np.abs(want).max())
    assert np.array_equal(np.asarray(k), np.asarray(want_k))
    assert np.array_equal(np.asarray(v), np.asarray(want_v))


def test_supported_shapes():
    bf16 = jnp.bfloat16
    assert supported(bf16, 14, 2, 64, 384) and supported(bf16, 14, 2, 64, 48)
    assert supported(bf16, 14, 2, 64, 16)
    assert not supported(bf16, 14, 2, 16, 384)  # halves below 16
    assert not supported(bf16, 14, 2, 64, 24)  # no block of 16 or more divides the cache
    assert not supported(bf16, 32, 1, 64, 384)  # 32 heads per kv head
    assert not supported(bf16, 14, 2, 48, 384)  # head dim not 2^n
    assert not supported(jnp.int32, 14, 2, 64, 384)


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("k_pos", [3, 2])
def test_kernel_with_rotary_matches_rotary_then_the_xla_path(splits, k_pos, monkeypatch):
    """decode_attention_qkv takes the fused projection's raw [B, N + 2K, H] output and applies
    rotary itself: against apply_rotary then the XLA path (float32; the kernel's two half-dim
    dots sum in another order than one dot, hence 1e-5 rather than 1e-6)."""
    monkeypatch.setattr(da, "SPLITS", splits)
    B, K, G, H, S = 6, 2, 7, 64, 128
    N = K * G
    rng = np.random.default_rng(2)
    qkv = jnp.asarray(rng.normal(size=(B, N + 2 * K, H)), jnp.float32)
    kc = jnp.asarray(rng.normal(size=(B, K, H, S) if k_pos == 3 else (B, K, S, H)), jnp.float32)
    vc = jnp.asarray(rng.normal(size=(B, K, S, H)), jnp.float32)
    pos = jnp.asarray([0, 1, 63, 64, 100, 127], jnp.int32)
    config = tiny(head_dim=H, hidden_size=4 * H, rope_theta=10000.0)
    cos, sin = rotary(config, pos[:, None])  # [B, 1, 1, H]
    q, k, v = qkv[:, :N], qkv[:, N : N + K], qkv[:, N + K :]
    q, k = (apply_rotary(x[:, None], cos, sin)[:, 0] for x in (q, k))
    want_o, want_k, want_v = _xla(q, k, v, kc, vc, pos, k_pos)
    rope = (cos.reshape(B, H), sin.reshape(B, H))
    o, k2, v2 = decode_attention_qkv(
        qkv, rope, kc, vc, pos, num_heads=N, k_pos=k_pos, interpret=True
    )
    assert np.abs(np.asarray(o) - np.asarray(want_o)).max() < 1e-5
    assert np.abs(np.asarray(k2) - np.asarray(want_k)).max() < 1e-5
    assert np.array_equal(np.asarray(v2), np.asarray(want_v))


@pytest.mark.slow
def test_engine_picks_xla_off_a_gpu_and_rejects_bad_choices():
    model = create_model(tiny())
    assert JaxEngine(model).decode_attention == "xla"  # a CPU: "auto" keeps XLA
    assert JaxEngine(model).k_pos == 3  # keys with the positions minor for XLA's matmuls
    pallas = JaxEngine(model, decode_attention="pallas")
    assert pallas.decode_attention == "pallas" and pallas.k_pos == 2
    with pytest.raises(ValueError, match="decode_attention 'flash'; valid"):
        JaxEngine(model, decode_attention="flash")
    assert len(jax.devices()) == 4  # tests/conftest.py: four host devices
    with pytest.raises(ValueError, match="runs on one device, got 2"):
        JaxEngine(model, devices=jax.devices()[:2], decode_attention="pallas")
    assert JaxEngine(model, devices=jax.devices()[:2]).decode_attention == "xla"


@pytest.mark.slow
def test_decode_runs_the_kernel_as_the_caller_says():
    """interpret=None interprets off a GPU; False compiles it, which a CPU cannot (so the
    caller's choice, e.g. the engine's from its own devices, is the one taken)."""
    model = create_model(tiny())
    cache = init_cache(model.config, 2, 16, k_pos=2)
    tok, pos = jnp.asarray([3, 4]), jnp.asarray([0, 5])
    logits, _ = model.decode(tok, pos, cache, attention="pallas")
    assert np.isfinite(np.asarray(logits)).all()
    with pytest.raises(ValueError, match="interpret mode"):
        model.decode(tok, pos, cache, attention="pallas", interpret=False)
    assert JaxEngine(model, decode_attention="pallas").interpret  # its device is a CPU


@pytest.mark.parametrize("with_bias", [True, False])
def test_kernel_finishing_the_input_norm_matches_the_xla_path(with_bias):
    """decode_attention_qkv of x @ (the input norm's weight folded into the kernel), given x
    and the bias: each head scaled by the row's 1/rms(x), biased, then rotary and attention,
    against those steps in XLA (float32; a hidden size of 96, not a power of two, so the
    kernel's masked load of the row is exercised)."""
    B, K, G, H, S, D = 4, 2, 7, 64, 128, 96
    N, X = K * G, K * G + 2 * K
    rng = np.random.default_rng(3)
    arr = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    x, w = 3.0 * arr(B, D), arr(D, X * H) / np.sqrt(D)
    bias = arr(X, H) if with_bias else None
    kc, vc = arr(B, K, S, H), arr(B, K, S, H)
    pos = jnp.asarray([0, 63, 64, 127], jnp.int32)
    eps = 1e-6
    raw = jnp.dot(x, w, precision="highest").reshape(B, X, H)
    inv_rms = jax.lax.rsqrt(jnp.mean(x * x, axis=-1) + eps)[:, None, None]
    qkv = inv_rms * raw + (0.0 if bias is None else bias)
    config = tiny(head_dim=H, hidden_size=4 * H, rope_theta=10000.0)  # rotary only
    cos, sin = rotary(config, pos[:, None])
    q, k, v = qkv[:, :N], qkv[:, N : N + K], qkv[:, N + K :]
    q, k = (apply_rotary(a[:, None], cos, sin)[:, 0] for a in (q, k))
    want_o, want_k, want_v = _xla(q, k, v, kc, vc, pos, 2)
    rope = (cos.reshape(B, H), sin.reshape(B, H))
    o, k2, v2 = decode_attention_qkv(
        raw, rope, kc, vc, pos, num_heads=N, k_pos=2, interpret=True, norm=(x, bias, eps)
    )
    assert np.abs(np.asarray(o) - np.asarray(want_o)).max() < 1e-5
    assert np.abs(np.asarray(k2) - np.asarray(want_k)).max() < 1e-5
    assert np.abs(np.asarray(v2) - np.asarray(want_v)).max() < 1e-5
