"""The JAX sampler's serving layout of a model's weights and its inverse: per-layer slices with
the fused q/k/v and gate/up kernels, built once per weights version so decode chunks read them
in place; each weight held once (the stacked and unfused copies emptied)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.params import fill_params

_LAYERS = "['model']['layers']"  # the stacked layers' path prefix in the params tree


def _flat(tree) -> dict:
    return {jax.tree_util.keystr(p): x for p, x in jax.tree.flatten_with_path(tree)[0]}


def _is_param(x) -> bool:
    return isinstance(x, nnx.Param)


def serving_layout(model, fold: bool = False):
    """(head, layers, layer graphdef) of a model (traced: call under jit). layers are
    per_layer(serving=True, fold)'s (state, fused kernels) of every decoder layer; head is the
    rest (embedding, final norm, LM head), the stacked layer weights left empty."""
    layers, layer_def = [], None
    for layer, fused in model.per_layer(serving=True, fold=fold):
        layer_def, state = nnx.split(layer)
        layers.append((state, fused))
    for p in jax.tree.leaves(nnx.state(model.model.layers, nnx.Param), is_leaf=_is_param):
        p.set_value(jnp.zeros((0,), p.get_value().dtype))
    return nnx.state(model, nnx.Param), layers, layer_def


def params_of_layout(params, layer_def, config, template, folded: bool = False):
    """serving_layout's (head, layers) as the model's params tree shaped like `template`
    (the layers stacked back, the fused kernels split): host copies, for comparisons. folded
    kernels are divided by their norm's weight again: within one rounding of the weights given
    (exact without folding), and not finite where a norm weight is 0."""
    head, layers = params
    nq, nk = (
        config.num_attention_heads * config.head_dim,
        config.num_key_value_heads * config.head_dim,
    )
    per = []
    for st, ((w, b), gate_up) in layers:
        layer = nnx.merge(layer_def, st)
        a, m = layer.self_attn, layer.mlp
        if folded:
            w = layer.input_layernorm.unfold(w)
            gate_up = layer.post_attention_layernorm.unfold(gate_up)
        cols = ((0, nq), (nq, nq + nk), (nq + nk, None))
        for proj, (lo, hi) in zip((a.q_proj, a.k_proj, a.v_proj), cols):
            proj.kernel.set_value(w[:, lo:hi])
            if b is not None:
                proj.bias.set_value(b[lo:hi])
        gate, up = jnp.split(gate_up, 2, axis=1)
        m.gate_proj.kernel.set_value(gate)
        m.up_proj.kernel.set_value(up)
        per.append(_flat(nnx.state(layer, nnx.Param)))
    flat = {k: v for k, v in _flat(head).items() if not k.startswith(_LAYERS)}
    for k in per[0]:
        flat[_LAYERS + k] = np.stack([np.asarray(f[k]) for f in per])
    return fill_params(template, {k: np.asarray(v) for k, v in flat.items()})
