"""Verify rules beside token-wise rejection sampling, their analytic acceptance, and synthetic outcomes
(docs/verification.md): pure jnp math on the verify block's distributions.

Notation (docs/verification.md §1): a round proposes drafts d_1..d_n (n = n_draft <= k, zero-indexed
columns 0..k-1 here); P_j = the target's filtered distribution after the block's first j drafts (row j of
the verify logits, j = 0..k), Q_j = the draft distribution d_{j+1} was drawn from (j = 0..k-1).

  * `verify_block`: block verification (Sun et al. 2024, arXiv 2403.10444, Algorithm 2): lossless, and its
    expected accepted length is never below token-wise verification's.
  * `analytic_token` / `analytic_block`: per round and position j, the conditional probability that
    draft j is accepted given what the round has drawn — the exact expectation of the empirical
    indicator 1[n_accept >= j], so their means agree with the empirical rates within sampling error.
  * `verify_synthetic`: each draft's outcome an independent Bernoulli(r_j) draw (cost studies; not lossless).
  * `calibration_counts`: binned (confidence, realised acceptance) counts of one round (DSpark's head).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from .sampling import filtered_probs, leading_true, verify_forced, verify_greedy, verify_sampled

RULES = ("token", "block")
CALIBRATION_BINS = 20          # reliability-diagram bins of the in-loop calibration counts


class Outcome(NamedTuple):
    """A verify decision and its analytic acceptance. n_accept [B], next [B]; expected [B,k]: P(draft j
    accepted | the round's draws) (0 where not proposed); alpha [B,k]: Σ_v min(P_j(v), Q_j(v)) at the realised
    prefix (token-wise acceptance of draft j given its prefix was accepted; 0 where not proposed)."""

    n_accept: jax.Array
    next: jax.Array
    expected: jax.Array
    alpha: jax.Array


def _proposed(n_draft: jax.Array, k: int) -> jax.Array:
    """[B] -> bool [B,k]: column j < n_draft."""
    return jnp.arange(k)[None, :] < n_draft[:, None]


def _at(x: jax.Array, tokens: jax.Array) -> jax.Array:
    """x [B,k,V] at tokens [B,k] -> [B,k]."""
    return jnp.take_along_axis(x, tokens[..., None], axis=-1)[..., 0]


def _row(x: jax.Array, j: jax.Array) -> jax.Array:
    """x [B,m,V] row j [B] -> [B,V]."""
    return jnp.take_along_axis(x, j[:, None, None], axis=1)[:, 0]


def ratios(p: jax.Array, q: jax.Array, drafts: jax.Array, clip: bool = True) -> jax.Array:
    """P_j(d_{j+1}) / Q_j(d_{j+1}), clipped at 1 (β_j) unless clip=False: p [B,k+1,V], q [B,k,V], drafts [B,k]
    -> [B,k] (1 where Q = 0: a column beyond the proposed drafts)."""
    k = drafts.shape[1]
    pt, pq = _at(p[:, :k], drafts), _at(q, drafts)
    r = jnp.where(pq > 0, pt / jnp.where(pq > 0, pq, 1.0), 1.0)
    return jnp.minimum(r, 1.0) if clip else r


def block_weights(p: jax.Array, q: jax.Array, drafts: jax.Array, n_draft: jax.Array):
    """Algorithm 2's per-prefix quantities (docs/verification.md §2).

    p [B,k+1,V], q [B,k,V], drafts [B,k], n_draft [B]. Returns (keep [B,k+1]: p_0 = 1, p_i =
    min(p_{i-1}·P_{i-1}(d_i)/Q_{i-1}(d_i), 1); h [B,k]: column i-1 holds h_i — for i < n
    Σ_x (p_i P_i − Q_i)_+ / (Σ_x (p_i P_i − Q_i)_+ + 1 − p_i) (0 when the residual is empty), h_n = p_n,
    0 beyond n).
    """
    k = drafts.shape[1]
    ratio = ratios(p, q, drafts, clip=False)       # unclipped: a later high ratio makes up for an earlier low one
    keep = [jnp.ones(drafts.shape[:1], jnp.float32)]
    for i in range(k):                                   # k is small and static: a short unrolled chain
        keep.append(jnp.minimum(keep[-1] * ratio[:, i], 1.0))
    keep = jnp.stack(keep, axis=1)                                            # [B,k+1]
    if k > 1:
        resid = jnp.sum(jnp.maximum(keep[:, 1:k, None] * p[:, 1:k] - q[:, 1:k], 0.0), axis=-1)   # [B,k-1], i=1..k-1
        denom = resid + 1.0 - keep[:, 1:k]
        inner = jnp.where(resid > 0, resid / jnp.where(denom > 0, denom, 1.0), 0.0)
        inner = jnp.pad(inner, ((0, 0), (0, 1)))
    else:
        inner = jnp.zeros_like(ratio)
    i = jnp.arange(1, k + 1)[None, :]
    n = n_draft[:, None]
    h = jnp.where(i == n, keep[:, 1:], jnp.where(i < n, inner, 0.0))
    return keep, h


def analytic_block(h: jax.Array, n_draft: jax.Array) -> jax.Array:
    """P(τ >= j | drafts) = 1 − Π_{i=j..n} (1 − h_i) (τ = the largest i with η_i <= h_i): h [B,k] -> [B,k]."""
    k = h.shape[1]
    h = jnp.where(_proposed(n_draft, k), h, 0.0)
    miss_from = jnp.flip(jnp.cumprod(jnp.flip(1.0 - h, axis=1), axis=1), axis=1)    # Π_{i>=j} (1 − h_i)
    return jnp.where(_proposed(n_draft, k), 1.0 - miss_from, 0.0)


def analytic_token(p: jax.Array, q: jax.Array, drafts: jax.Array, n_draft: jax.Array):
    """Token-wise: (expected [B,k] = Π_{i<j} β_i · α_j, alpha [B,k] = α_j = Σ_v min(P_j(v), Q_j(v))).

    The chain of Σ min(p, q), its earlier links at the drafts actually drawn: E[1[n_accept >= j] | d_1..d_{j-1}]."""
    k = drafts.shape[1]
    alpha = jnp.sum(jnp.minimum(p[:, :k], q), axis=-1)
    before = jnp.cumprod(jnp.pad(ratios(p, q, drafts), ((0, 0), (1, 0)), constant_values=1.0), axis=1)[:, :k]
    on = _proposed(n_draft, k)
    return jnp.where(on, before * alpha, 0.0), jnp.where(on, alpha, 0.0)


def greedy_dists(target_logits: jax.Array, drafts: jax.Array, vocab: int):
    """Greedy as distributions: (P one-hot of the target's argmax [B,k+1,V], Q one-hot of the drafts [B,k,V])."""
    p = jax.nn.one_hot(jnp.argmax(target_logits, axis=-1), vocab, dtype=jnp.float32)
    return p, jax.nn.one_hot(drafts, vocab, dtype=jnp.float32)


def verify_block(key, target_logits, drafts, draft_probs, n_draft, temperature, top_p) -> Outcome:
    """Block verification (Sun et al. 2024, Algorithm 2; docs/verification.md §2), lossless at any T / top-p.

    η_i ~ U(0,1) independent; τ = max{i : η_i <= h_i} (0 if none); emit d_1..d_τ, then Y ~ P_n if τ = n, else
    Y ~ norm((p_τ P_τ − Q_τ)_+). Shapes as `sampling.verify_sampled`; draft_probs [B,k,V] are Q.
    """
    B, k = drafts.shape
    p = filtered_probs(target_logits, temperature, top_p)                  # [B,k+1,V]
    if k == 0:
        a, nxt = verify_sampled(key, target_logits, drafts, draft_probs, n_draft, temperature, top_p)
        return Outcome(a, nxt, jnp.zeros((B, 0)), jnp.zeros((B, 0)))
    k_eta, k_next = jax.random.split(key)
    keep, h = block_weights(p, draft_probs, drafts, n_draft)
    eta = jax.random.uniform(k_eta, (B, k))
    i = jnp.arange(1, k + 1)[None, :]
    tau = jnp.max(jnp.where(eta < h, i, 0), axis=1).astype(jnp.int32)
    p_tau = _row(p, tau)
    q_tau = _row(draft_probs, jnp.minimum(tau, k - 1))
    keep_tau = jnp.take_along_axis(keep, tau[:, None], axis=1)                       # [B,1]
    resid = jnp.maximum(keep_tau * p_tau - q_tau, 0.0)
    mass = jnp.sum(resid, axis=-1, keepdims=True)
    dist = jnp.where((tau < n_draft)[:, None] & (mass > 1e-20), resid / jnp.maximum(mass, 1e-30), p_tau)
    nxt = jax.random.categorical(k_next, jnp.log(dist), axis=-1).astype(jnp.int32)
    _, alpha = analytic_token(p, draft_probs, drafts, n_draft)
    return Outcome(tau, nxt, analytic_block(h, n_draft), alpha)


def verify_synthetic(key, target_logits, drafts, n_draft, rates: tuple, sample: tuple) -> Outcome:
    """Synthetic acceptance (cost studies, not lossless): draft j accepted iff u_j < r_j, u_j ~ U(0,1)
    independent; n_accept = the accepted prefix; the next token from the target's row n_accept, drawn as
    sample = (temperature, top_p, greedy) says (argmax when greedy). rates: one rate, or one per position (the
    last repeats). expected [B,j] = Π_{i<=j} r_i."""
    temperature, top_p, greedy = sample
    B, k = drafts.shape
    r = jnp.asarray([rates[min(j, len(rates) - 1)] for j in range(k)], jnp.float32)[None, :]
    k_u, k_next = jax.random.split(key)
    on = _proposed(n_draft, k)
    a = leading_true((jax.random.uniform(k_u, (B, k)) < r) & on)
    row = _row(target_logits, a)
    if greedy:
        nxt = jnp.argmax(row, axis=-1).astype(jnp.int32)
    else:
        nxt = jax.random.categorical(k_next, jnp.log(filtered_probs(row, temperature, top_p)), axis=-1).astype(jnp.int32)
    rr = jnp.broadcast_to(r, (B, k))
    return Outcome(a, nxt, jnp.where(on, jnp.cumprod(rr, axis=1), 0.0), jnp.where(on, rr, 0.0))


def verify(key, target_logits, drafts, draft_probs, n_draft, temperature, top_p, *, greedy: bool, rule: str = "token",
           synthetic: tuple | None = None, forced: bool = False) -> Outcome:
    """The loop's verify step under its static choices: forced (every draft), synthetic rates, greedy
    (prefix match: block and token-wise coincide), or the sampled rule ("token" | "block").
    target_logits [B,k+1,V], drafts [B,k], draft_probs [B,k,V], n_draft [B]."""
    if rule not in RULES:
        raise ValueError(f"verify rule must be one of {RULES}, got {rule!r}")
    k, V = drafts.shape[1], target_logits.shape[-1]
    if synthetic is not None:
        return verify_synthetic(key, target_logits, drafts, n_draft, tuple(synthetic), (temperature, top_p, greedy))
    if forced or greedy:
        a, nxt = (verify_forced if forced else verify_greedy)(target_logits, drafts, n_draft)
        p, q = greedy_dists(target_logits, drafts, V)
        expected, alpha = analytic_token(p, q, drafts, n_draft)
        if forced:
            expected = _proposed(n_draft, k).astype(jnp.float32)
        return Outcome(a, nxt, expected, alpha)
    if rule == "block":
        return verify_block(key, target_logits, drafts, draft_probs, n_draft, temperature, top_p)
    a, nxt = verify_sampled(key, target_logits, drafts, draft_probs, n_draft, temperature, top_p)
    expected, alpha = analytic_token(filtered_probs(target_logits, temperature, top_p), draft_probs, drafts, n_draft)
    return Outcome(a, nxt, expected, alpha)


def calibration_counts(conf: jax.Array, n_accept: jax.Array, n_draft: jax.Array, active: jax.Array,
                       n_bins: int = CALIBRATION_BINS):
    """One round's calibration evidence (docs/verification.md §4): draft j counts when it was verified with
    its prefix accepted (j < n_draft, j <= n_accept), labelled accepted iff j < n_accept — the conditional
    acceptance the confidence head is trained on. conf [B,k] in [0,1] (< 0: no confidence), n_accept,
    n_draft [B], active bool [B]. Returns (bins [B,k,n_bins,3]: count, accepted, Σ confidence per bin of
    c; brier [B,k]: Σ (c − y)²)."""
    k = conf.shape[1]
    j = jnp.arange(k)[None, :]
    seen = (j < n_draft[:, None]) & (j <= n_accept[:, None]) & active[:, None] & (conf >= 0)
    y = (j < n_accept[:, None]).astype(jnp.float32)
    c = jnp.clip(conf, 0.0, 1.0)
    hot = jax.nn.one_hot(jnp.clip((c * n_bins).astype(jnp.int32), 0, n_bins - 1), n_bins) * seen[..., None]
    bins = jnp.stack([hot, hot * y[..., None], hot * c[..., None]], axis=-1)
    return bins, jnp.where(seen, (c - y) ** 2, 0.0)


def expected_accepted(rates, k: int) -> float:
    """Host side: E[n_accept] = Σ_{j=1..k} Π_{i<=j} r_i for per-position rates (the last repeats)."""
    out, run = 0.0, 1.0
    for j in range(k):
        run *= float(rates[min(j, len(rates) - 1)])
        out += run
    return out
