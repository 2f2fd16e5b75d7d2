"""Transformer: remat policies change nothing, bfloat16 dtypes, attention backend errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_weights import randomize

from models import Transformer, create_model, init_cache, tiny


def _loss_and_grads(model, tokens, weights):
    def loss(m):
        return jnp.sum(m(tokens) * weights)

    return nnx.jit(nnx.value_and_grad(loss))(model)


@pytest.mark.slow
def test_remat_policies_give_identical_values_and_gradients():
    rng = np.random.RandomState(0)
    tokens = jnp.asarray(rng.randint(0, 128, (2, 10)))
    weights = jnp.asarray(rng.standard_normal((2, 10, 128)).astype(np.float32))
    ref_loss, ref_grads = _loss_and_grads(randomize(create_model(tiny(), seed=0)), tokens, weights)
    ref_leaves = jax.tree.leaves(ref_grads)
    assert max(float(jnp.abs(g).max()) for g in ref_leaves) > 1e-2
    for policy in ("full", "dots_saveable"):
        model = randomize(create_model(tiny(remat=policy), seed=0))
        jaxpr = str(jax.make_jaxpr(lambda m: nnx.grad(lambda m: m(tokens).sum())(m))(model))
        assert "remat" in jaxpr or "checkpoint" in jaxpr  # the policy is really applied
        loss, grads = _loss_and_grads(model, tokens, weights)
        assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
        for g, r in zip(jax.tree.leaves(grads), ref_leaves):  # float32 rounding only
            scale = float(np.abs(np.asarray(r)).max())
            assert np.abs(np.asarray(g) - np.asarray(r)).max() <= 1e-5 * scale


@pytest.mark.slow
def test_bfloat16_params_and_compute():
    tokens = jnp.asarray(np.random.RandomState(1).randint(0, 128, (2, 8)))
    f32 = randomize(create_model(tiny(), seed=0))
    bf16 = create_model(tiny(dtype="bfloat16", param_dtype="bfloat16"), seed=0)
    params = nnx.state(bf16, nnx.Param)
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    nnx.update(bf16, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(f32, nnx.Param)))

    logits = nnx.jit(lambda m, t: m(t))(bf16, tokens)
    assert logits.dtype == jnp.float32 and bool(jnp.isfinite(logits).all())
    h = nnx.jit(lambda m, t: m.hidden_states(t))(bf16, tokens)
    assert h.dtype == jnp.bfloat16 and bf16.lm_head_kernel().dtype == jnp.bfloat16
    # Same weights in float32: bfloat16 is close but not bit-equal.
    ref = nnx.jit(lambda m, t: m(t))(f32, tokens)
    diff = float(jnp.abs(logits - ref).max())
    assert 0 < diff < 0.1 * float(jnp.abs(ref).max())

    cache = init_cache(bf16.config, 2, 12)
    assert {a.dtype for a in jax.tree.leaves(cache)} == {jnp.dtype(jnp.bfloat16)}
    lengths = jnp.array([8, 5])
    _, cache = nnx.jit(lambda m, t, n, c: m.prefill(t, n, c))(bf16, tokens, lengths, cache)
    step, cache = nnx.jit(lambda m, t, p, c: m.decode(t, p, c))(bf16, tokens[:, 0], lengths, cache)
    assert step.dtype == jnp.float32 and bool(jnp.isfinite(step).all())


def test_float32_params_with_bfloat16_compute():
    model = create_model(tiny(dtype="bfloat16", param_dtype="float32"), seed=0)
    assert {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))} == {
        jnp.dtype(jnp.float32)
    }
    h = nnx.jit(lambda m, t: m.hidden_states(t))(model, jnp.zeros((1, 4), jnp.int32))
    assert h.dtype == jnp.bfloat16


def test_cudnn_attention_needs_a_gpu(monkeypatch):
    config = tiny(attention_impl="cudnn", dtype="bfloat16")
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")  # as on a machine without one
    with pytest.raises(ValueError, match="attention_impl='cudnn' needs a GPU"):
        Transformer(config, rngs=nnx.Rngs(0))


def test_segment_lengths_lists_each_rows_segments_then_its_padding():
    """cuDNN's packed attention gets each row's segment lengths (padding as one more segment),
    -1 filled to a power-of-two width."""
    from models.attention import segment_lengths

    seg = np.array([[1, 1, 2, 2, 2, 0, 0], [1, 1, 1, 1, 1, 1, 1], [1, 2, 3, 4, 0, 0, 0]])
    got = segment_lengths(seg)
    assert got.dtype == np.int32 and got.shape == (3, 8)
    assert got[0].tolist() == [2, 3, 2, -1, -1, -1, -1, -1]
    assert got[1].tolist() == [7] + [-1] * 7
    assert got[2].tolist() == [1, 1, 1, 1, 3, -1, -1, -1]
    assert (np.where(got >= 0, got, 0).sum(1) == seg.shape[1]).all()  # every token once
    assert segment_lengths(np.array([[1, 1, 1, 0]])).tolist() == [[3, 1]]
