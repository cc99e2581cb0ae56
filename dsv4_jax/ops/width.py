"""The verify width of a round, chosen on the device from the drafts' acceptance estimates and a cost table
(docs/width_scheduler.md): pure jnp math, no model.

Notation (docs/width_scheduler.md §1): a round of width w verifies the first w drafts (w = 0: a plain decode
step) and costs cost[w] seconds for the whole batch. e_{b,j} = the estimated probability that draft j of
sequence b is accepted given drafts 1..j−1 were; then the expected tokens committed by the round are
T_w(b) = 1 + Σ_{i<=min(w, n_b)} Π_{l<=i} e_{b,l} (the bonus / correction token always comes), and the
width that maximises the batch's expected tokens per second is argmax_w Σ_b T_w(b) / cost[w].

The raw estimates (a confidence head, the draft's own probability, 1 for a point-mass draft) are rescaled
per position by online calibration factors f_j = (accepted_j + 1) / (Σ raw_j + 1) over the drafts verified
so far with their prefix accepted (`scale`), so a drafter whose scores are over- or under-confident, or
carry no information at all (n-gram), still predicts its realised acceptance.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

PRIOR = 1.0     # pseudo-count of the calibration factors (f_j = 1 before any evidence)


def expected_tokens(est: jax.Array, n_draft: jax.Array, live: jax.Array) -> jax.Array:
    """Σ over live sequences of T_w, for w = 0..k. est [B,k] in [0,1], n_draft [B], live bool [B] -> [k+1]."""
    k = est.shape[1]
    on = jnp.arange(k)[None, :] < n_draft[:, None]
    reach = jnp.cumprod(jnp.where(on, jnp.clip(est, 0.0, 1.0), 0.0), axis=1)        # P(first j+1 accepted)
    per_seq = 1.0 + jnp.concatenate([jnp.zeros_like(reach[:, :1]), jnp.cumsum(reach, axis=1)], axis=1)
    return jnp.sum(jnp.where(live[:, None], per_seq, 0.0), axis=0)


def best_width(tokens: jax.Array, cost: jax.Array, bound: jax.Array) -> jax.Array:
    """argmax over w <= bound of tokens[w] / cost[w] (ties: the narrower). tokens, cost [k+1] -> int32 []."""
    w = jnp.arange(tokens.shape[0])
    rate = jnp.where(w <= bound, tokens / jnp.maximum(cost, 1e-12), -1.0)
    return jnp.argmax(rate).astype(jnp.int32)


def choose(est: jax.Array, n_draft: jax.Array, live: jax.Array, cost: jax.Array, bound: jax.Array) -> jax.Array:
    """The round's width (int32 []): `best_width` of the live sequences' expected tokens, at most the most drafts
    any live sequence proposed."""
    tokens = expected_tokens(est, n_draft, live)
    return best_width(tokens, cost, jnp.minimum(bound, jnp.max(jnp.where(live, n_draft, 0))))


def keep_drafting(est: jax.Array, j: jax.Array, cost: jax.Array, bound: jax.Array) -> jax.Array:
    """Sequential drafters (MTP's chain): after j drafts with estimates est[:, :j] (est [B,k], later columns
    ignored), is draft j+1 worth computing? Yes iff width j+1, its estimate taken equal to draft j's, beats
    every width <= j. bool []."""
    B, k = est.shape
    col = jnp.arange(k)[None, :]
    last = jnp.take_along_axis(est, jnp.clip(j - 1, 0, k - 1)[None, None].repeat(B, 0), axis=1)
    guess = jnp.where(col < j, est, jnp.where(col == j, last, 0.0))
    tokens = expected_tokens(guess, jnp.full((B,), j + 1), jnp.ones((B,), bool))
    w = jnp.arange(k + 1)
    rate = tokens / jnp.maximum(cost, 1e-12)
    return (j < bound) & (rate[jnp.minimum(j + 1, k)] > jnp.max(jnp.where(w <= j, rate, -1.0)))


def scale(accepted: jax.Array, raw_sum: jax.Array) -> jax.Array:
    """Per-position calibration factors f_j = (accepted_j + PRIOR) / (raw_sum_j + PRIOR) from batch-summed
    counts [B,k] of drafts verified with their prefix accepted -> [k]."""
    return (jnp.sum(accepted, 0) + PRIOR) / (jnp.sum(raw_sum, 0) + PRIOR)


def calibrated(raw: jax.Array, factors: jax.Array) -> jax.Array:
    """raw [B,k] estimates × factors [k], clipped to [0,1]."""
    return jnp.clip(raw * factors[None, : raw.shape[1]], 0.0, 1.0)


def draft_probability(drafts: jax.Array, q: jax.Array) -> jax.Array:
    """The probability each draft had under its own draft distribution: q [B,k,V] at drafts [B,k] -> [B,k]."""
    return jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
