"""Token log-probs and entropy from hidden states, chunked over the vocabulary.

Full float32 logits [B, T, V] are never built: the vocabulary is scanned in chunks with an
online log-sum-exp (and an online sum of p * (logit - running max) for the entropy, so a peaked
distribution's near-zero entropy is not lost to cancellation), each chunk rematerialised in the
backward pass. Temperature divides the logits exactly as the sampler does, so behavior and
learner log-probs compare like with like.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_logprobs_full(
    logits_BTV: jax.Array, targets_BT: jax.Array, temperature: float = 1.0
) -> tuple[jax.Array, jax.Array]:
    """(log p(target), entropy) from materialised logits; the reference for the chunked path."""
    logits = logits_BTV.astype(jnp.float32) / temperature
    logp_all = jax.nn.log_softmax(logits, axis=-1)
    logp = jnp.take_along_axis(logp_all, targets_BT[..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return logp, entropy


def token_logprobs(
    h_BTD: jax.Array,
    w_DV: jax.Array,
    targets_BT: jax.Array,
    temperature: float = 1.0,
    chunk: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """(log p(target), entropy) [B, T] float32 from hidden states and the LM-head kernel."""
    V = w_DV.shape[1]
    if chunk <= 0 or chunk >= V:
        return token_logprobs_full(
            jnp.einsum("btd,dv->btv", h_BTD, w_DV, preferred_element_type=jnp.float32),
            targets_BT,
            temperature,
        )
    n_chunks = -(-V // chunk)
    pad = n_chunks * chunk - V
    w = jnp.pad(w_DV, ((0, 0), (0, pad)))
    w_CDK = w.reshape(w.shape[0], n_chunks, chunk).transpose(1, 0, 2)
    B, T = targets_BT.shape
    init = (
        jnp.full((B, T), -jnp.inf, jnp.float32),  # running max
        jnp.zeros((B, T), jnp.float32),  # sum exp(l - m)
        jnp.zeros((B, T), jnp.float32),  # sum exp(l - m) * (l - m)
        jnp.zeros((B, T), jnp.float32),  # target logit
    )

    @jax.checkpoint
    def body(carry, xs):
        m, s, sd, tgt = carry
        w_DK, start = xs
        l_BTK = jnp.einsum("btd,dk->btk", h_BTD, w_DK, preferred_element_type=jnp.float32)
        l_BTK = l_BTK / temperature
        ids = start + jnp.arange(chunk)
        l_BTK = jnp.where(ids < V, l_BTK, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(l_BTK, axis=-1))
        scale = jnp.exp(m - m_new)
        shift = jnp.where(jnp.isfinite(m), m - m_new, 0.0)  # m = -inf only while s = sd = 0
        d_BTK = jnp.where(ids < V, l_BTK - m_new[..., None], 0.0)
        e = jnp.exp(jnp.where(ids < V, d_BTK, -jnp.inf))
        # sum exp(l - m_new) * (l - m_new) = scale * (sd + shift * s) over the earlier chunks
        sd = scale * (sd + shift * s) + jnp.sum(e * d_BTK, axis=-1)
        s = s * scale + jnp.sum(e, axis=-1)
        local = targets_BT - start
        hit = (local >= 0) & (local < chunk)
        got = jnp.take_along_axis(l_BTK, jnp.clip(local, 0, chunk - 1)[..., None], axis=-1)[..., 0]
        tgt = jnp.where(hit, got, tgt)
        return (m_new, s, sd, tgt), None

    starts = jnp.arange(n_chunks) * chunk
    (m, s, sd, tgt), _ = jax.lax.scan(body, init, (w_CDK, starts))
    logp = tgt - (m + jnp.log(s))
    entropy = jnp.log(s) - sd / s  # lse - E[l] with lse = m + log s, E[l] = m + sd / s
    return logp, entropy
