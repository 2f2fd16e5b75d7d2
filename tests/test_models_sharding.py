"""Mesh, rules table and sharded models on 4 fake CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, PartitionSpec
from model_weights import randomize

from models import create_model, logical_sharding, make_mesh, tiny
from models.sharding import cache_sharding, logical_to_spec, shard_model

P = PartitionSpec


def test_make_mesh_axes_and_errors():
    assert len(jax.devices()) == 4
    mesh = make_mesh(data=1, fsdp=2, tensor=2)
    assert mesh.axis_names == ("data", "fsdp", "tensor")
    assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "tensor": 2}
    assert tuple(mesh.axis_types) == (AxisType.Auto,) * 3
    one = make_mesh(devices=jax.devices()[:1])
    assert one.devices.size == 1
    with pytest.raises(ValueError, match="8 devices, but only 4"):
        make_mesh(data=2, fsdp=2, tensor=2)
    with pytest.raises(ValueError, match="2 devices were given"):
        make_mesh(tensor=4, devices=jax.devices()[:2])


def test_rules_table_and_indivisible_dims():
    mesh = make_mesh(data=1, fsdp=2, tensor=2)
    assert logical_to_spec(("embed", "mlp"), mesh) == P("fsdp", "tensor")
    assert logical_to_spec(("vocab", "embed"), mesh) == P("tensor", "fsdp")
    # batch takes (data, fsdp); a later dim cannot reuse fsdp; size-1 axes are dropped.
    assert logical_to_spec(("batch", "length", "embed"), mesh) == P("fsdp", None, None)
    mesh_d = make_mesh(data=2, fsdp=2)
    assert logical_to_spec(("batch", None), mesh_d) == P(("data", "fsdp"), None)
    assert logical_sharding(mesh_d, ("batch", None)).spec == P(("data", "fsdp"), None)
    # A dim not divisible by its mesh axes is replicated instead of failing.
    assert logical_to_spec(("batch", "length"), mesh_d, shape=(6, 8)) == P(None, None)
    assert logical_to_spec(("embed", "vocab"), mesh, shape=(128, 129)) == P("fsdp", None)
    with pytest.raises(ValueError, match="unknown logical axis 'bogus'"):
        logical_to_spec(("bogus",), mesh)


def _spec(var):
    return var[...].sharding.spec


def _shard_shape(var):
    shapes = {s.data.shape for s in var[...].addressable_shards}
    assert len(shapes) == 1
    return shapes.pop()


@pytest.mark.slow
def test_create_model_places_parameters_in_shards():
    config = tiny()
    mesh = make_mesh(fsdp=2, tensor=2)
    model = create_model(config, mesh, seed=0)
    layers = model.model.layers  # stacked: a leading, unsharded axis of 2 layers
    assert _spec(layers.mlp.gate_proj.kernel) == P(None, "fsdp", "tensor")
    assert _shard_shape(layers.mlp.gate_proj.kernel) == (2, 64, 256)
    assert _spec(layers.mlp.down_proj.kernel) == P(None, "tensor", "fsdp")
    assert _spec(layers.self_attn.q_proj.kernel) == P(None, "fsdp", "tensor")
    assert _spec(layers.self_attn.k_proj.kernel) == P(None, "fsdp", "tensor")  # 2 kv heads / 2
    assert _shard_shape(layers.self_attn.k_proj.kernel) == (2, 64, 32)
    assert _spec(layers.self_attn.q_proj.bias) == P(None, "tensor")
    assert _spec(layers.input_layernorm.weight) == P(None, "fsdp")
    assert _spec(model.model.embed_tokens.embedding) == P("tensor", "fsdp")
    assert _shard_shape(model.model.embed_tokens.embedding) == (64, 64)
    assert _spec(model.lm_head.kernel) == P("fsdp", "tensor")
    assert _spec(model.model.norm.weight) == P("fsdp")
    # The same seed gives the same parameters whatever the mesh.
    plain = create_model(config, None, seed=0)
    for a, b in zip(
        jax.tree.leaves(nnx.state(plain, nnx.Param)), jax.tree.leaves(nnx.state(model, nnx.Param))
    ):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_kv_heads_not_divisible_by_tensor_are_replicated():
    config = tiny()  # 4 heads, 2 kv heads
    model = create_model(config, make_mesh(tensor=4), seed=0)
    attn = model.model.layers.self_attn
    assert _spec(attn.q_proj.kernel) == P(None, None, "tensor")  # one head per device
    assert _shard_shape(attn.q_proj.kernel) == (2, 128, 32)
    # k_proj's flat dim (64) divides by 4, but 2 kv heads do not: replicated, never split a head.
    assert _spec(attn.k_proj.kernel) == P(None, None, None)
    assert _spec(attn.k_proj.bias) == P(None, None)


def test_forward_on_one_device_equals_four_device_mesh():
    config = tiny()
    one = randomize(create_model(config, make_mesh(devices=jax.devices()[:1]), seed=0))
    mesh = make_mesh(fsdp=2, tensor=2)
    four = shard_model(one, mesh)
    assert _spec(four.model.layers.mlp.up_proj.kernel) == P(None, "fsdp", "tensor")
    tokens = np.random.RandomState(0).randint(0, config.vocab_size, (4, 12))
    forward = nnx.jit(lambda m, t: m(t))
    ref = np.asarray(forward(one, jnp.asarray(tokens)))
    assert np.abs(ref).max() > 1.0
    tokens4 = jax.device_put(jnp.asarray(tokens), logical_sharding(mesh, ("batch", "length")))
    out = forward(four, tokens4)
    assert len(out.sharding.device_set) == 4
    assert np.abs(np.asarray(out) - ref).max() < 1e-5


def test_load_hf_onto_a_mesh_and_save_from_it(tmp_path):
    from models import load_hf, save_hf
    from models.hf import read_hf_tensors

    config = tiny(tie_word_embeddings=True)
    one = randomize(create_model(config, seed=0))
    save_hf(one, str(tmp_path / "one"))
    mesh = make_mesh(fsdp=2, tensor=2)
    four = load_hf(str(tmp_path / "one"), mesh=mesh)
    assert four.config == config
    assert _spec(four.model.layers.mlp.gate_proj.kernel) == P(None, "fsdp", "tensor")
    assert _spec(four.model.embed_tokens.embedding) == P("tensor", "fsdp")
    tokens = jnp.asarray(np.random.RandomState(1).randint(0, config.vocab_size, (2, 6)))
    forward = nnx.jit(lambda m, t: m(t))
    assert np.abs(np.asarray(forward(four, tokens)) - np.asarray(forward(one, tokens))).max() < 1e-5
    # Saving gathers the shards: the files are identical to the one-device save.
    save_hf(four, str(tmp_path / "four"), max_shard_bytes=100_000)
    a, b = read_hf_tensors(str(tmp_path / "one")), read_hf_tensors(str(tmp_path / "four"))
    assert sorted(a) == sorted(b) and "lm_head.weight" not in a
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_cache_sharding_splits_batch_and_kv_heads():
    config = tiny()  # 2 kv heads
    mesh = make_mesh(fsdp=2, tensor=2)
    assert cache_sharding(config, mesh, batch=4).spec == P(None, "fsdp", None, "tensor", None)
    assert cache_sharding(config, mesh, batch=3).spec == P(None, None, None, "tensor", None)
    four = cache_sharding(config, make_mesh(tensor=4), batch=4)
    assert four.spec == P(None, None, None, None, None)
