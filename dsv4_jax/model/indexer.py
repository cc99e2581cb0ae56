"""Lightning indexer of CSA layers (target_model.md §2.7): score compressed rows, keep the top-k valid ones."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..config import ModelConfig
from .rope import apply_rope


def index_queries(qr: jax.Array, p: dict, config: ModelConfig, positions: jax.Array, freqs: np.ndarray):
    """q^I = RoPE_compress((W_qb^I c_q).view(nI, dI)); no norm. qr [B,S,q_lora] -> [B,S,nI,dI]."""
    B, S, _ = qr.shape
    q = (qr @ p["wq_b"].T).reshape(B, S, config.index_n_heads, config.index_head_dim)
    return apply_rope(q, positions, freqs)


def index_scores(q: jax.Array, keys: jax.Array, h: jax.Array, p: dict, config: ModelConfig,
                 impl: str | None = None) -> jax.Array:
    """score(p, w) = Σ_h ω_h · ReLU(q_h · K_w) · dI^-0.5 with ω = (W_ω h)·nI^-0.5, in float32.

    q [B,S,nI,dI], keys [B,T,dI], h [B,S,D] -> [B,S,T]. impl: see `dsv4_jax.kernels` (None = default).
    """
    from .. import kernels  # lazy: kernels import this module
    if kernels.resolve(impl) == "pallas":
        from ..kernels import lightning_indexer
        return lightning_indexer.scores(q, keys, lightning_indexer.omega(h, p, config),
                                        interpret=kernels.use_interpret(None))
    dots = jnp.einsum("bshd,btd->bsht", q.astype(jnp.float32), keys.astype(jnp.float32))
    dots = jax.nn.relu(dots) * config.index_head_dim ** -0.5
    omega = (h @ p["weights_proj"].T).astype(jnp.float32) * config.index_n_heads ** -0.5
    return jnp.einsum("bsht,bsh->bst", dots, omega)


def select_topk(scores: jax.Array, valid: jax.Array, k: int, impl: str | None = None) -> jax.Array:
    """Boolean mask [B,S,T] of the top-k valid rows per query (ties: lower row index first).

    Invalid rows never count: if fewer than k rows are valid, all valid rows are selected.
    impl "pallas"/"auto"-on-GPU: the exact two-stage top-k of `kernels.lightning_indexer` (same result).
    """
    from .. import kernels
    if kernels.resolve(impl) == "pallas":
        from ..kernels import lightning_indexer
        return lightning_indexer.topk_mask(jnp.where(valid, scores, -jnp.inf), k)
    T = scores.shape[-1]
    k = min(k, T)
    masked = jnp.where(valid, scores, -jnp.inf)
    _, idx = jax.lax.top_k(masked, k)                          # [B,S,k]
    lead = jnp.indices(idx.shape[:-1], sparse=True)            # broadcastable batch/query indices
    picked = jnp.zeros(scores.shape, bool).at[(*[i[..., None] for i in lead], idx)].set(True)
    return picked & valid


def index_select(q: jax.Array, keys: jax.Array, h: jax.Array, p: dict, config: ModelConfig, positions: jax.Array,
                 ratio: int, n_rows: jax.Array | None = None, impl: str | None = None) -> jax.Array:
    """Fused scores + validity (w < ⌊(p+1)/m⌋, w < n_rows[b]) + top-k -> mask [B,S,T].

    q [B,S,nI,dI], keys [B,T,dI], h [B,S,D], positions int [B,S], n_rows int [B] or None.
    """
    from ..kernels import lightning_indexer
    return lightning_indexer.select(q, keys, h, p, config, positions, ratio, n_rows, impl=impl)
