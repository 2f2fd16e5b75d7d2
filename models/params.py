"""The weight wire format: a params tree <-> flat {path: numpy array} (host copies)."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx


def flat_params(params) -> dict[str, np.ndarray]:
    """An nnx.State / nnx.Module / pytree of params as {path: numpy array} (a host copy)."""
    if isinstance(params, nnx.Module):
        params = nnx.state(params, nnx.Param)
    leaves = jax.tree.flatten_with_path(params)[0]
    host = jax.device_get([x for _, x in leaves])
    return {jax.tree_util.keystr(p): np.asarray(x) for (p, _), x in zip(leaves, host)}


def fill_params(template, flat: dict[str, np.ndarray]):
    """`template` (a params pytree) with its leaves replaced by flat[path]; names must match."""
    leaves, treedef = jax.tree.flatten_with_path(template)
    names = [jax.tree_util.keystr(p) for p, _ in leaves]
    missing = sorted(set(names) - set(flat))
    extra = sorted(set(flat) - set(names))
    if missing or extra:
        raise ValueError(f"params do not match the model: missing {missing[:4]}, extra {extra[:4]}")
    out = []
    for name, (_, old) in zip(names, leaves):
        new = flat[name]
        if tuple(new.shape) != tuple(old.shape):
            raise ValueError(f"param {name}: shape {new.shape}, the model has {old.shape}")
        out.append(new)
    return jax.tree.unflatten(treedef, out)


def abstract_params(config):
    """(graphdef, params template) of a Transformer of `config`, without allocating weights."""
    from models.transformer import Transformer

    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    return nnx.split(abstract, nnx.Param)
