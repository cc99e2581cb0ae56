"""Mixture-of-experts math (target_model.md §2.8) on plain arrays.

Routing: s = sqrt(softplus(l)) for router logits l = W_r h (float32); score-routed layers pick the top-k of
s + bias (the bias for selection only, `lax.top_k` order: value desc, lower index first), hash layers take
the ids from tid2eid[token]; weights w = s[idx] / (Σ s[idx] + eps) × routed_scaling_factor.
Experts: SwiGLU with gate ≤ limit and up ∈ [−limit, limit]; y = Σ_j w_j · W2[e_j] swiglu(W1[e_j] x, W3[e_j] x).
Expert weights are [E, I, D] (w1, w3) and [E, D, I] (w2), the checkpoints' [out, in] layout.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def router_scores(logits: jax.Array) -> jax.Array:
    """s = sqrt(softplus(l)) in float32: [T,E] -> [T,E]."""
    return jnp.sqrt(jax.nn.softplus(logits.astype(jnp.float32)))


def route_from_logits(logits: jax.Array, bias: jax.Array | None, hash_idx: jax.Array | None, *, k: int,
                      norm: bool, eps: float, scale: float):
    """logits [T,E], bias f32 [E] (score routing) or hash_idx int [T,k] (hash routing)
    -> (expert ids int32 [T,k], weights f32 [T,k])."""
    s = router_scores(logits)
    if hash_idx is not None:
        idx = hash_idx.astype(jnp.int32)
    else:
        _, idx = jax.lax.top_k(s + bias.astype(jnp.float32), k)
    w = jnp.take_along_axis(s, idx, axis=-1)
    return idx.astype(jnp.int32), normalize_weights(w, norm=norm, eps=eps, scale=scale)


def normalize_weights(w: jax.Array, *, norm: bool, eps: float, scale: float) -> jax.Array:
    """w [T,k] -> w / (Σ w + eps) (if norm) × scale (float32)."""
    if norm:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + eps)
    return w * scale


def swiglu(g: jax.Array, u: jax.Array, limit: float) -> jax.Array:
    """silu(min(g, limit)) ⊙ clamp(u, −limit, limit)."""
    return jax.nn.silu(jnp.minimum(g, limit)) * jnp.clip(u, -limit, limit)


def dense_mlp(x: jax.Array, w1: jax.Array, w2: jax.Array, w3: jax.Array, limit: float) -> jax.Array:
    """One SwiGLU expert (the shared expert): x [..., D], w1/w3 [I,D], w2 [D,I] -> [..., D]."""
    return swiglu(x @ w1.T, x @ w3.T, limit) @ w2.T


def combine(y: jax.Array, w: jax.Array, dtype) -> jax.Array:
    """Σ_j w[t,j] · y[t,j]: y [T,k,D], w [T,k] -> [T,D] (sum in float32)."""
    return jnp.einsum("tkd,tk->td", y.astype(jnp.float32), w.astype(jnp.float32)).astype(dtype)


def experts_gather(x: jax.Array, idx: jax.Array, w: jax.Array, w1: jax.Array, w2: jax.Array, w3: jax.Array,
                   limit: float) -> jax.Array:
    """Read only the selected experts' weights (decode: few tokens). x [T,D], idx/w [T,k] -> [T,D]."""
    g = jnp.einsum("td,tkid->tki", x, w1[idx])                     # w1[idx]: [T,k,I,D]
    u = jnp.einsum("td,tkid->tki", x, w3[idx])
    y = jnp.einsum("tki,tkdi->tkd", swiglu(g, u, limit), w2[idx])
    return combine(y, w, x.dtype)


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Σ_k lhs[r,k] · rhs[g(r), n, k] with rows sorted by group: [M,K], [G,N,K], sizes [G] -> [M,N]."""
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    return jax.lax.ragged_dot_general(lhs, rhs, group_sizes, dims)


def sort_assignments(idx: jax.Array, n_experts: int):
    """The T·k assignments sorted by expert: (order [T·k] (stable), group sizes int32 [E])."""
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    return order, jnp.bincount(flat, length=n_experts).astype(jnp.int32)


def experts_sorted(x: jax.Array, idx: jax.Array, w: jax.Array, w1: jax.Array, w2: jax.Array, w3: jax.Array,
                   limit: float) -> jax.Array:
    """Sort the T·k assignments by expert, grouped matmuls (prefill / verify). x [T,D], idx/w [T,k] -> [T,D]."""
    T, k = idx.shape
    order, sizes = sort_assignments(idx, w1.shape[0])
    xs = x[order // k]
    h = swiglu(grouped_matmul(xs, w1, sizes), grouped_matmul(xs, w3, sizes), limit)
    ys = grouped_matmul(h, w2, sizes).astype(jnp.float32) * w.reshape(-1)[order][:, None]
    return jnp.zeros((T, x.shape[-1]), jnp.float32).at[order // k].add(ys).astype(x.dtype)


# Below this many (token, expert) assignments per expert, gathering the active experts' weights is cheaper
# than sorting tokens into groups (and reads only the active experts).
GATHER_MAX_ASSIGNMENTS_PER_EXPERT = 1


def prefer_gather(n_assignments: int, n_experts: int) -> bool:
    """Whether the reference path gathers the active experts (few assignments) instead of sorting."""
    return n_assignments <= GATHER_MAX_ASSIGNMENTS_PER_EXPERT * n_experts
