"""Device mesh, the ONE logical-axis -> mesh-axis rules table, and sharded model creation."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from models.config import MESH_AXES, RULES, ModelConfig
from models.transformer import Transformer


def make_mesh(
    data: int = 1, fsdp: int = 1, tensor: int = 1, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """A (data, fsdp, tensor) mesh with Auto axis types over `devices` (default: the first ones)."""
    shape = (data, fsdp, tensor)
    if any(not isinstance(n, int) or n < 1 for n in shape):
        raise ValueError(
            f"mesh sizes must be positive ints, got data={data} fsdp={fsdp} tensor={tensor}"
        )
    n = math.prod(shape)
    if devices is None:
        available = jax.devices()
        if n > len(available):
            raise ValueError(
                f"mesh data={data} x fsdp={fsdp} x tensor={tensor} = {n} devices, "
                f"but only {len(available)} are available"
            )
        devices = available[:n]
    devices = list(devices)
    if len(devices) != n:
        raise ValueError(
            f"mesh data={data} x fsdp={fsdp} x tensor={tensor} = {n} devices, "
            f"but {len(devices)} devices were given"
        )
    return Mesh(
        np.asarray(devices, dtype=object).reshape(shape),
        MESH_AXES,
        axis_types=(AxisType.Auto,) * len(MESH_AXES),
    )


def logical_to_spec(
    logical_axes: Sequence[str | None],
    mesh: Mesh,
    shape: Sequence[int] | None = None,
    sizes: dict[str, int] | None = None,
) -> PartitionSpec:
    """The PartitionSpec for logical axes; a dim not divisible by its mesh axes is replicated.

    `shape` gives the array dims to check; `sizes` gives a logical axis's size in its own units
    (e.g. "kv_heads": 2 for a flat [D, 2 * head_dim] kernel), checked before `shape`.
    """
    spec = []
    used: set[str] = set()
    for i, name in enumerate(logical_axes):
        if name is None:
            spec.append(None)
            continue
        if name not in RULES:
            raise ValueError(f"unknown logical axis {name!r}; valid: {sorted(RULES)}")
        axes = tuple(a for a in RULES[name] if mesh.shape.get(a, 1) > 1 and a not in used)
        ways = math.prod(mesh.shape[a] for a in axes)
        dims = []
        if sizes and name in sizes:
            dims.append(sizes[name])
        if shape is not None:
            dims.append(shape[i])
        if not axes or any(d % ways for d in dims):
            spec.append(None)
            continue
        used.update(axes)
        spec.append(axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*spec)


def logical_sharding(
    mesh: Mesh,
    logical_axes: Sequence[str | None],
    shape: Sequence[int] | None = None,
) -> NamedSharding:
    """The NamedSharding of an array with these logical axes on `mesh` (see logical_to_spec)."""
    return NamedSharding(mesh, logical_to_spec(logical_axes, mesh, shape))


def config_sizes(config: ModelConfig) -> dict[str, int]:
    """Each model logical axis's size in its own units (heads count heads, not features)."""
    return {
        "embed": config.hidden_size,
        "heads": config.num_attention_heads,
        "kv_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "mlp": config.intermediate_size,
        "vocab": config.vocab_size,
        "layers": config.num_hidden_layers,
    }


def state_shardings(config: ModelConfig, state: nnx.State, mesh: Mesh) -> nnx.State:
    """NamedShardings for a (possibly abstract) parameter state, from its logical annotations."""
    sizes = config_sizes(config)

    def one(var):
        axes = var.get_metadata().get("out_sharding") or (None,) * len(var.get_value().shape)
        return var.replace(
            NamedSharding(mesh, logical_to_spec(axes, mesh, var.get_value().shape, sizes))
        )

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def create_model(config: ModelConfig, mesh: Mesh | None = None, seed: int = 0) -> Transformer:
    """A freshly initialised Transformer, each parameter created directly in its shards.

    One compiled program initialises the whole model (the decoder layers are one vmapped
    layer, so it does not grow with depth). Same seed, same values, whatever the mesh.
    """
    build = lambda rngs: Transformer(config, rngs=rngs)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: build(nnx.Rngs(0))))
    out = None if mesh is None else state_shardings(config, abstract, mesh)
    init = jax.jit(lambda key: nnx.state(build(nnx.Rngs(key))), out_shardings=out)
    return nnx.merge(graphdef, init(jax.random.key(seed)))


def cache_sharding(config: ModelConfig, mesh: Mesh, batch: int) -> NamedSharding:
    """The sharding of a KV-cache array [L, B, S, num_kv_heads, head_dim] on `mesh`."""
    axes = ("layers", "batch", "length", "kv_heads", "head_dim")
    sizes = dict(config_sizes(config), batch=batch)
    return NamedSharding(mesh, logical_to_spec(axes, mesh, sizes=sizes))


def shard_model(model: Transformer, mesh: Mesh) -> Transformer:
    """The same model with its parameters moved onto `mesh` by the rules table."""
    graphdef, state = nnx.split(model)
    shardings = state_shardings(model.config, state, mesh)
    return nnx.merge(graphdef, jax.device_put(state, shardings))
