"""Token log-probs and entropy from hidden states, chunked over the vocabulary.

Full float32 logits [B, T, V] are never built: the vocabulary is scanned in chunks with an
online log-sum-exp (and an online sum of p * (logit - running max) for the entropy, so a peaked
distribution's near-zero entropy is not lost to cancellation). The backward pass (a custom VJP)
recomputes each chunk's logits once and applies the analytic gradient of log-softmax and
entropy from the saved log-sum-exp and entropy: one elementwise pass per chunk, not autodiff
through the running max; the logit gradient enters the two backward matmuls in the compute dtype
of h (bf16 x bf16 with float32 accumulation, like every other matmul of the backward pass).
Temperature divides the logits exactly as the sampler does, so behavior and learner log-probs
compare like with like.
"""

from __future__ import annotations

import functools

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
    return _chunked(h_BTD, w_DV, targets_BT, float(temperature), int(chunk))


def _chunks(w_DV: jax.Array, chunk: int) -> tuple[jax.Array, jax.Array]:
    """The kernel as [n_chunks, D, chunk] (zero-padded) and each chunk's first vocabulary id."""
    V = w_DV.shape[1]
    n_chunks = -(-V // chunk)
    w = jnp.pad(w_DV, ((0, 0), (0, n_chunks * chunk - V)))
    return w.reshape(w.shape[0], n_chunks, chunk).transpose(1, 0, 2), jnp.arange(n_chunks) * chunk


def _chunk_logits(h_BTD, w_DK, start, V, temperature):
    """Tempered logits [B, T, K] (float32) of one chunk, -inf beyond the vocabulary; valid ids."""
    chunk = w_DK.shape[1]
    l_BTK = jnp.einsum("btd,dk->btk", h_BTD, w_DK, preferred_element_type=jnp.float32)
    valid_K = start + jnp.arange(chunk) < V
    return jnp.where(valid_K, l_BTK / temperature, -jnp.inf), valid_K


def _chunked_forward(h_BTD, w_DV, targets_BT, temperature, chunk):
    """(logp, entropy, log-sum-exp) [B, T] by an online log-sum-exp over vocabulary chunks."""
    V = w_DV.shape[1]
    w_CDK, starts = _chunks(w_DV, chunk)
    B, T = targets_BT.shape
    init = (
        jnp.full((B, T), -jnp.inf, jnp.float32),  # running max
        jnp.zeros((B, T), jnp.float32),  # sum exp(l - m)
        jnp.zeros((B, T), jnp.float32),  # sum exp(l - m) * (l - m)
        jnp.zeros((B, T), jnp.float32),  # target logit
    )

    def body(carry, xs):
        m, s, sd, tgt = carry
        w_DK, start = xs
        l_BTK, valid_K = _chunk_logits(h_BTD, w_DK, start, V, temperature)
        m_new = jnp.maximum(m, jnp.max(l_BTK, axis=-1))
        scale = jnp.exp(m - m_new)
        shift = jnp.where(jnp.isfinite(m), m - m_new, 0.0)  # m = -inf only while s = sd = 0
        d_BTK = jnp.where(valid_K, l_BTK - m_new[..., None], 0.0)
        e = jnp.exp(jnp.where(valid_K, d_BTK, -jnp.inf))
        # sum exp(l - m_new) * (l - m_new) = scale * (sd + shift * s) over the earlier chunks
        sd = scale * (sd + shift * s) + jnp.sum(e * d_BTK, axis=-1)
        s = s * scale + jnp.sum(e, axis=-1)
        local = targets_BT - start
        hit = (local >= 0) & (local < chunk)
        got = jnp.take_along_axis(l_BTK, jnp.clip(local, 0, chunk - 1)[..., None], axis=-1)[..., 0]
        tgt = jnp.where(hit, got, tgt)
        return (m_new, s, sd, tgt), None

    (m, s, sd, tgt), _ = jax.lax.scan(body, init, (w_CDK, starts))
    lse = m + jnp.log(s)
    logp = tgt - lse
    entropy = jnp.log(s) - sd / s  # lse - E[l] with lse = m + log s, E[l] = m + sd / s
    return logp, entropy, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _chunked(h_BTD, w_DV, targets_BT, temperature, chunk):
    return _chunked_forward(h_BTD, w_DV, targets_BT, temperature, chunk)[:2]


def _chunked_fwd(h_BTD, w_DV, targets_BT, temperature, chunk):
    logp, entropy, lse = _chunked_forward(h_BTD, w_DV, targets_BT, temperature, chunk)
    return (logp, entropy), (h_BTD, w_DV, targets_BT, lse, entropy)


def _chunked_bwd(temperature, chunk, res, cotangents):
    """One pass per chunk: recompute its logits, then the analytic logit gradient
    d/dl_k = g_logp * (1[k = y] - p_k) - g_ent * p_k * (log p_k + H)."""
    h_BTD, w_DV, targets_BT, lse, entropy = res
    g_logp, g_ent = cotangents
    V = w_DV.shape[1]
    w_CDK, starts = _chunks(w_DV, chunk)

    def body(dh_BTD, xs):
        w_DK, start = xs
        l_BTK, valid_K = _chunk_logits(h_BTD, w_DK, start, V, temperature)
        logp_BTK = jnp.where(valid_K, l_BTK - lse[..., None], 0.0)
        p_BTK = jnp.where(valid_K, jnp.exp(logp_BTK), 0.0)
        dl_BTK = -p_BTK * (g_logp[..., None] + g_ent[..., None] * (logp_BTK + entropy[..., None]))
        hit_BTK = (targets_BT - start)[..., None] == jnp.arange(w_DK.shape[1])
        dl_BTK = jnp.where(hit_BTK, dl_BTK + g_logp[..., None], dl_BTK) / temperature
        dl_BTK = dl_BTK.astype(h_BTD.dtype)
        dh_BTD = dh_BTD + jnp.einsum(
            "btk,dk->btd", dl_BTK, w_DK, preferred_element_type=jnp.float32
        )
        dw_DK = jnp.einsum("btd,btk->dk", h_BTD, dl_BTK, preferred_element_type=jnp.float32)
        return dh_BTD, dw_DK

    dh_BTD, dw_CDK = jax.lax.scan(body, jnp.zeros(h_BTD.shape, jnp.float32), (w_CDK, starts))
    dw_DV = dw_CDK.transpose(1, 0, 2).reshape(w_DV.shape[0], -1)[:, :V]
    return dh_BTD.astype(h_BTD.dtype), dw_DV.astype(w_DV.dtype), None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)
