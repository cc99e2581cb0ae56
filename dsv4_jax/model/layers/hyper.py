"""Manifold-constrained hyper-connections (mHC) and the final HC head (docs/model_math.md §2.2, §2.3).

The residual state is X: [B, S, n, D] (n = hc_mult streams).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ...config import ModelConfig
from .norms import rms_norm


def _mix(X: jax.Array, fn: jax.Array, eps: float) -> jax.Array:
    """μ = fn · x̂ with x̂ the unweighted RMS norm of the flattened streams. [B,S,n,D] -> [B,S,rows] f32."""
    flat = X.reshape(X.shape[:-2] + (-1,)).astype(jnp.float32)
    return rms_norm(flat, None, eps) @ fn.astype(jnp.float32).T


def sinkhorn(logits: jax.Array, iters: int, eps: float, unroll: bool = False) -> jax.Array:
    """Row softmax + eps, a column normalisation, then (row, column) × (iters − 1). [..., n, n] f32."""
    C = jax.nn.softmax(logits, axis=-1) + eps
    C = C / (C.sum(axis=-2, keepdims=True) + eps)

    def step(C, _):
        C = C / (C.sum(axis=-1, keepdims=True) + eps)
        return C / (C.sum(axis=-2, keepdims=True) + eps), None

    # unroll (a static choice, `Backends.unroll_sinkhorn`, set for GPUs): rolled, the loop is a while loop
    # there, a few tiny kernels and a copy per iteration (190 iterations, ~1100 kernels per decode step of the
    # 5-layer Flash benchmark on an H200); unrolled, XLA:CPU compiled a 12-call test function 7x slower.
    C, _ = jax.lax.scan(step, C, None, length=iters - 1, unroll=unroll)
    return C



def hc_weights(X: jax.Array, p: dict, config: ModelConfig):
    """pre [B,S,n], post [B,S,n], comb C [B,S,n,n] (float32) for one hyper-connection."""
    n, eps = config.hc_mult, config.hc_eps
    mu = _mix(X, p["fn"], config.rms_norm_eps)
    base, scale = p["base"].astype(jnp.float32), p["scale"].astype(jnp.float32)
    pre = jax.nn.sigmoid(mu[..., :n] * scale[0] + base[:n]) + eps
    post = 2.0 * jax.nn.sigmoid(mu[..., n:2 * n] * scale[1] + base[n:2 * n])
    A = (mu[..., 2 * n:] * scale[2] + base[2 * n:]).reshape(mu.shape[:-1] + (n, n))
    return pre, post, sinkhorn(A, config.hc_sinkhorn_iters, eps, config.backends.unroll_sinkhorn)


def collapse(X: jax.Array, pre: jax.Array) -> jax.Array:
    """h = Σ_j pre_j X[j]: [B,S,n,D], [B,S,n] -> [B,S,D] (mixing in float32, cast to X.dtype)."""
    return jnp.einsum("bsn,bsnd->bsd", pre, X.astype(jnp.float32)).astype(X.dtype)


def expand(X: jax.Array, y: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:
    """X'[k] = post_k · y + Σ_j C[j,k] X[j]  (post ⊗ y + Cᵀ X). Returns [B,S,n,D] in X.dtype."""
    mixed = jnp.einsum("bsjk,bsjd->bskd", comb, X.astype(jnp.float32))
    return (post[..., None] * y.astype(jnp.float32)[..., None, :] + mixed).astype(X.dtype)


def hc_head(X: jax.Array, p: dict, config: ModelConfig) -> jax.Array:
    """Final collapse: pre = sigmoid(μ·scale + base) + eps; h = Σ pre_j X[j]. [B,S,n,D] -> [B,S,D]."""
    mu = _mix(X, p["fn"], config.rms_norm_eps)
    pre = jax.nn.sigmoid(mu * p["scale"].astype(jnp.float32)[0] + p["base"].astype(jnp.float32)) + config.hc_eps
    return collapse(X, pre)
