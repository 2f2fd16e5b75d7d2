"""Shared test helper: random weights of a useful scale for the tiny test models."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def randomize(model, seed=0):
    """Random weights of a useful scale (norm weights near 1): peaked, well-separated logits,
    so logit errors are visible. Each leaf keeps its dtype and sharding."""
    leaves, treedef = jax.tree.flatten_with_path(nnx.state(model, nnx.Param))
    rng = np.random.RandomState(seed)
    new = []
    for path, x in leaves:
        noise = rng.standard_normal(x.shape).astype(np.float32)
        value = 1 + 0.2 * noise if "norm" in jax.tree_util.keystr(path) else 0.08 * noise
        new.append(jax.device_put(jnp.asarray(value, x.dtype), x.sharding))
    nnx.update(model, jax.tree.unflatten(treedef, new))
    return model
