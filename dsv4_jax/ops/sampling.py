"""Target and draft distributions, and lossless verification (docs/drafter_math.md §3.1): pure math on logits.

Both distributions go through the same `filtered_probs` (softmax at temperature T, then top-p), so
rejection sampling against them reproduces plain sampling from the target's filtered distribution.
The drafters (`dsv4_jax.drafters`) and the speculative loop (`dsv4_jax.speculative`) both import it from here.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def filtered_probs(logits: jax.Array, temperature, top_p) -> jax.Array:
    """softmax(logits / T) restricted to the top-p nucleus (smallest set with mass ≥ top_p; the top-1 always kept).

    logits [..., V] -> probs [..., V] float32, renormalised.
    """
    p = jax.nn.softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    sorted_p = -jnp.sort(-p, axis=-1)
    mass_before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
    kept = jnp.where(mass_before < top_p, sorted_p, jnp.inf)
    threshold = jnp.min(kept, axis=-1, keepdims=True)                    # smallest kept probability
    p = jnp.where(p >= threshold, p, 0.0)
    return p / jnp.sum(p, axis=-1, keepdims=True)


def leading_true(ok: jax.Array) -> jax.Array:
    """Length of the all-True prefix of each row. ok bool [B,k] -> int32 [B]."""
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def verify_greedy(target_logits: jax.Array, drafts: jax.Array, n_draft: jax.Array):
    """Greedy verification: accept the longest prefix of drafts equal to the target's argmax.

    target_logits [B,k+1,V] (row j predicts the token after block token j), drafts [B,k], n_draft [B]
    drafts actually proposed. Returns (n_accept [B], next token [B]): next = argmax of row n_accept.
    """
    k = drafts.shape[1]
    best = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)          # [B,k+1]
    ok = (drafts == best[:, :k]) & (jnp.arange(k)[None, :] < n_draft[:, None])
    a = leading_true(ok)
    return a, jnp.take_along_axis(best, a[:, None], axis=1)[:, 0]


def verify_forced(target_logits: jax.Array, drafts: jax.Array, n_draft: jax.Array):
    """Cost benchmarks only (not lossless): run the greedy check, then accept every proposed draft.

    n_accept = max(greedy n_accept, n_draft) = n_draft; the next token is the target's argmax after the
    last draft. The real verification is still computed (its cost is paid), only its decision is
    overridden, so a round commits n_draft + 1 tokens whatever the weights. Shapes as verify_greedy.
    """
    a_real, _ = verify_greedy(target_logits, drafts, n_draft)
    a = jnp.maximum(a_real, n_draft)
    best = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)
    return a, jnp.take_along_axis(best, a[:, None], axis=1)[:, 0]


def verify_sampled(key, target_logits, drafts, draft_probs, n_draft, temperature, top_p):
    """Lossless rejection sampling (Leviathan et al.; docs/drafter_math.md §3.1).

    Draft j is accepted with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection the next
    token is drawn from norm(max(p_j − q_j, 0)); if every proposed draft is accepted (or the chain
    was truncated at n_draft) it is drawn from p_{n_accept}. target_logits [B,k+1,V],
    draft_probs [B,k,V], drafts/n_draft as in verify_greedy. Returns (n_accept [B], next [B]).
    """
    B, k = drafts.shape
    p = filtered_probs(target_logits, temperature, top_p)               # [B,k+1,V]
    k_u, k_next = jax.random.split(key)
    if k > 0:
        pt = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]
        pq = jnp.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]
        u = jax.random.uniform(k_u, (B, k))
        ok = (u * pq < pt) & (jnp.arange(k)[None, :] < n_draft[:, None])
        a = leading_true(ok)
        q_a = jnp.take_along_axis(draft_probs, jnp.minimum(a, k - 1)[:, None, None], axis=1)[:, 0]
        rejected = (a < n_draft)[:, None]
    else:
        a = jnp.zeros((B,), jnp.int32)
        q_a, rejected = jnp.zeros_like(p[:, 0]), jnp.zeros((B, 1), bool)
    p_a = jnp.take_along_axis(p, a[:, None, None], axis=1)[:, 0]          # [B,V]
    resid = jnp.maximum(p_a - jnp.where(rejected, q_a, 0.0), 0.0)
    mass = jnp.sum(resid, axis=-1, keepdims=True)
    dist = jnp.where(mass > 1e-20, resid / jnp.maximum(mass, 1e-30), p_a)  # fallback when p ≈ q
    nxt = jax.random.categorical(k_next, jnp.log(dist), axis=-1).astype(jnp.int32)
    return a, nxt


def sample_first(key, logits: jax.Array, temperature, top_p, greedy: bool) -> jax.Array:
    """A token per row from the target's logits [B,V] (the token after the prompt)."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, jnp.log(filtered_probs(logits, temperature, top_p)), axis=-1).astype(jnp.int32)
