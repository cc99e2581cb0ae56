"""Mixture of experts of every layer (target_model.md §2.8).

Routing: s = sqrt(softplus(W_r h)); score-routed layers pick top-k of s + bias (bias for selection
only), hash layers look the experts up in tid2eid[token]; weights s[idx] / (Σ s[idx] + eps) ×
routed_scaling_factor. Experts and the shared expert are SwiGLU with gate ≤ limit and
up ∈ [−limit, limit].
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..config import HASH_MOE, ModelConfig

# Below this many (token, expert) assignments per expert, gathering the active experts' weights
# is cheaper than sorting tokens into groups.
GATHER_MAX_ASSIGNMENTS_PER_EXPERT = 1


def route(x: jax.Array, tokens: jax.Array, p: dict, config: ModelConfig, mlp_type: str):
    """x [T,D], tokens int [T] -> (expert ids int32 [T,k], weights f32 [T,k])."""
    logits = (x @ p["weight"].T).astype(jnp.float32)
    s = jnp.sqrt(jax.nn.softplus(logits))
    if mlp_type == HASH_MOE:
        idx = p["tid2eid"][tokens].astype(jnp.int32)
    else:
        _, idx = jax.lax.top_k(s + p["bias"].astype(jnp.float32), config.num_experts_per_tok)
    w = jnp.take_along_axis(s, idx, axis=-1)
    if config.norm_topk_prob:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + config.router_eps)
    return idx.astype(jnp.int32), w * config.routed_scaling_factor


def swiglu(g: jax.Array, u: jax.Array, limit: float) -> jax.Array:
    """silu(min(g, limit)) ⊙ clamp(u, −limit, limit)."""
    return jax.nn.silu(jnp.minimum(g, limit)) * jnp.clip(u, -limit, limit)


def shared_expert(x: jax.Array, p: dict, config: ModelConfig) -> jax.Array:
    return swiglu(x @ p["w1"].T, x @ p["w3"].T, config.swiglu_limit) @ p["w2"].T


def experts_gather(x, idx, w, p, config: ModelConfig):
    """Read only the selected experts' weights (decode: few tokens). x [T,D] -> [T,D]."""
    w1, w2, w3 = p["w1"][idx], p["w2"][idx], p["w3"][idx]          # [T,k,I,D], [T,k,D,I]
    g = jnp.einsum("td,tkid->tki", x, w1)
    u = jnp.einsum("td,tkid->tki", x, w3)
    y = jnp.einsum("tki,tkdi->tkd", swiglu(g, u, config.swiglu_limit), w2)
    return jnp.einsum("tkd,tk->td", y.astype(jnp.float32), w).astype(x.dtype)


def _grouped(lhs, rhs, group_sizes):
    """Σ_k lhs[r,k] · rhs[g(r), n, k] with rows sorted by group: [M,K], [G,N,K] -> [M,N]."""
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    return jax.lax.ragged_dot_general(lhs, rhs, group_sizes, dims)


def experts_sorted(x, idx, w, p, config: ModelConfig):
    """Sort the T·k assignments by expert and run grouped matmuls (prefill / verify). x [T,D] -> [T,D]."""
    T, k = idx.shape
    E = config.n_routed_experts
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    xs = x[order // k]
    h = swiglu(_grouped(xs, p["w1"], sizes), _grouped(xs, p["w3"], sizes), config.swiglu_limit)
    ys = _grouped(h, p["w2"], sizes).astype(jnp.float32) * w.reshape(-1)[order][:, None]
    return jnp.zeros((T, x.shape[-1]), jnp.float32).at[order // k].add(ys).astype(x.dtype)


def moe(h: jax.Array, tokens: jax.Array, p: dict, config: ModelConfig, mlp_type: str,
        impl: str | None = None) -> jax.Array:
    """h [B,S,D], tokens int [B,S] -> [B,S,D].

    impl (static): "reference" (these jnp functions), "pallas" or "auto" (`dsv4_jax.kernels`); None means
    `kernels.default_impl()` (env DSV4_KERNELS, "reference" unless set). Quantized experts
    ("w1_scale", ... present) are dequantized on the reference path and in-kernel on the Pallas path.
    """
    from .. import kernels  # lazy: kernels import this module

    B, S, D = h.shape
    x = h.reshape(B * S, D)
    if kernels.resolve(impl) == "pallas":
        from ..kernels import moe_decode, moe_prefill, routing
        idx, w = routing.route(x, tokens.reshape(-1), p["gate"], config, mlp_type, impl="pallas")
        few = B * S <= moe_decode.DECODE_MAX_TOKENS
        y = (moe_decode if few else moe_prefill).experts(x, idx, w, p["experts"], config, impl="pallas")
    else:
        idx, w = route(x, tokens.reshape(-1), p["gate"], config, mlp_type)
        experts = kernels.quant.dequantize_experts(p["experts"], x.dtype)
        if B * S * config.num_experts_per_tok <= GATHER_MAX_ASSIGNMENTS_PER_EXPERT * config.n_routed_experts:
            y = experts_gather(x, idx, w, experts, config)
        else:
            y = experts_sorted(x, idx, w, experts, config)
    if "shared_experts" in p:
        y = y + shared_expert(x, p["shared_experts"], config)
    return y.reshape(B, S, D)
