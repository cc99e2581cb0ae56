"""Lightning-indexer math (docs/model_math.md §2.7) on plain arrays: scores, validity, exact top-k.

score(p, w) = Σ_h ω_h · ReLU(q_h · K_w) · dI^-0.5 with ω = (W_ω h) · nI^-0.5, in float32;
valid(p, w) = w < ⌊(p+1)/m⌋ (and w < n_rows[b]). The top-k keeps the k highest valid scores, ties to the
lower row index (`lax.top_k` order); rows that are invalid never count, so fewer than k valid rows are all
selected.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .linear import linear


def omega(h: jax.Array, weights_proj: jax.Array, n_heads: int) -> jax.Array:
    """ω = (W_ω h) · nI^-0.5 in float32: h [B,S,D], weights_proj [nI,D] (dense or QArray) -> [B,S,nI]."""
    return linear(h, weights_proj).astype(jnp.float32) * n_heads ** -0.5


# the per-head dots [B,S,H,rows] of one block of rows stay under this many bytes: a prefill chunk against a long
# context scores its rows block by block instead of materialising [B,S,H,T] (T = context / m)
SCORE_BLOCK_BYTES = 1 << 28


def _scores(q: jax.Array, keys: jax.Array, om: jax.Array) -> jax.Array:
    dots = jnp.einsum("bshd,btd->bsht", q.astype(jnp.float32), keys.astype(jnp.float32))
    dots = jax.nn.relu(dots) * q.shape[-1] ** -0.5
    return jnp.einsum("bsht,bsh->bst", dots, om.astype(jnp.float32))


def scores(q: jax.Array, keys: jax.Array, om: jax.Array) -> jax.Array:
    """Σ_h ω_h · ReLU(q_h · K_w) · dI^-0.5: q [B,S,H,dI], keys [B,T,dI], ω f32 [B,S,H] -> f32 [B,S,T].

    Rows in blocks of SCORE_BLOCK_BYTES / (B·S·H·4) (a multiple of 128) when T is larger: temporaries
    [B,S,H,block] + the result, linear in T for a fixed block of queries (the same sums per row)."""
    B, S, H, _ = q.shape
    T = keys.shape[1]
    block = max(128, SCORE_BLOCK_BYTES // (B * S * H * 4) // 128 * 128)
    if T <= block:
        return _scores(q, keys, om)
    n = -(-T // block)
    kb = jnp.pad(keys, ((0, 0), (0, n * block - T), (0, 0))).reshape(B, n, block, -1).swapaxes(0, 1)
    out = jax.lax.map(lambda k: _scores(q, k, om), kb)                    # [n, B, S, block]
    return jnp.moveaxis(out, 0, 2).reshape(B, S, n * block)[..., :T]


def validity(shape, positions=None, n_rows=None, ratio: int = 1) -> jax.Array:
    """[B,S,T] bool: w < ⌊(p+1)/m⌋ (if positions [B,S]) and w < n_rows[b] (if n_rows [B])."""
    B, S, T = shape
    w = jnp.arange(T)[None, None, :]
    valid = jnp.ones(shape, bool)
    if positions is not None:
        valid = valid & (w < ((positions + 1) // ratio)[:, :, None])
    if n_rows is not None:
        valid = valid & (w < jnp.broadcast_to(jnp.asarray(n_rows), (B,))[:, None, None])
    return valid


def topk(masked: jax.Array, k: int, chunk: int = 4096):
    """masked f32 [..., T] (−inf = invalid) -> (idx int32 [..., k'], found bool [..., k']), k' = min(k, T).

    Exact, `lax.top_k` order (value desc, index asc). Long rows take two stages: top-k inside chunks of
    `chunk` rows, then over the n·k candidates, laid out chunk by chunk with each chunk's sorted by
    (value desc, index asc) so that among equal values a lower candidate slot is a lower row. `found` is
    False for picks that are −inf (fewer than k valid rows).
    """
    T = masked.shape[-1]
    k = min(k, T)
    if T <= chunk or k >= chunk:
        vals, idx = jax.lax.top_k(masked, k)
        return idx.astype(jnp.int32), vals > -jnp.inf
    n = -(-T // chunk)
    lead = masked.shape[:-1]
    padded = jnp.pad(masked, [(0, 0)] * len(lead) + [(0, n * chunk - T)], constant_values=-jnp.inf)
    v1, i1 = jax.lax.top_k(padded.reshape(*lead, n, chunk), k)          # [..., n, k]
    i1 = i1 + (jnp.arange(n, dtype=i1.dtype) * chunk)[:, None]
    vals, j = jax.lax.top_k(v1.reshape(*lead, n * k), k)
    idx = jnp.take_along_axis(i1.reshape(*lead, n * k), j, axis=-1)
    return idx.astype(jnp.int32), vals > -jnp.inf


def topk_mask(masked: jax.Array, k: int, chunk: int = 4096) -> jax.Array:
    """Boolean [..., T] of the top-k finite entries of masked (−inf = invalid)."""
    idx, found = topk(masked, k, chunk)
    lead = jnp.indices(idx.shape[:-1], sparse=True)
    return jnp.zeros(masked.shape, bool).at[(*[i[..., None] for i in lead], idx)].max(found)


def select_topk(scores_: jax.Array, valid: jax.Array, k: int) -> jax.Array:
    """Boolean mask [B,S,T] of the top-k valid rows per query (ties: lower row index first)."""
    return topk_mask(jnp.where(valid, scores_, -jnp.inf), k)
