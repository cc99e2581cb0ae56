"""Mixture of experts of every layer (docs/model_math.md §2.8); the math is `dsv4_jax.ops.moe`.

The config's static backends pick the implementation: routing "reference" (`ops.moe.route_from_logits`)
or "pallas" (`kernels.routing`); routed experts by the dispatch table `experts.TABLE` ("reference": gather the
active experts for few tokens, sorted `ragged_dot` for many — expert-pure row tiles when compiled for CPU,
`ops.moe.experts_sorted`; "pallas": `kernels.moe_decode` for ≤ DECODE_MAX_TOKENS tokens, `kernels.moe_prefill`
above; "pallas_tpu": `kernels.tpu_moe.routed`, Mosaic decode / grouped matmul), or "ep": routed and shared
experts under an explicit `shard_map` (`model.layers.moe_ep`, expert parallelism on `config.backends.ep.mesh`,
each device running the same table's row `config.backends.ep.local` on its local experts).
Every weight may be dense or an `ops.quant.QArray`: the router and shared expert go through `ops.linear`;
routed experts are dequantized after gathering the active experts' codes (reference gather path), per
expert-pure row tile (reference sorted path), or tile by tile in the kernels.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ...backends import require
from ...config import HASH_MOE, ModelConfig
from ...kernels import routing
from ...ops import moe as ops
from ...ops.linear import linear
from . import experts, moe_ep
from .stacked_experts import StackedExperts  # noqa: F401  (the MoE's expert input type; target.py imports it from here)


def route(x: jax.Array, tokens: jax.Array, p: dict, config: ModelConfig, mlp_type: str):
    """x [T,D], tokens int [T] -> (expert ids int32 [T,k], weights f32 [T,k])."""
    logits = linear(x, p["weight"]).astype(jnp.float32)
    hashed = mlp_type == HASH_MOE
    bias = None if hashed else p["bias"]
    hash_idx = p["tid2eid"][tokens] if hashed else None
    router = ops.Router(config.num_experts_per_tok, config.norm_topk_prob, config.router_eps,
                        config.routed_scaling_factor)
    if require(config.backends.routing, "routing") == "pallas":
        return routing.route_from_logits(logits, bias, hash_idx, router=router, interpret=config.backends.interpret)
    return ops.route_from_logits(logits, bias, hash_idx, router)


def routed_experts(x: jax.Array, idx: jax.Array, w: jax.Array, p: dict, config: ModelConfig) -> jax.Array:
    """The experts entry: Σ_j w[t,j] · expert_{idx[t,j]}(x[t]). x [T,D], idx int [T,k] (ids into p's
    expert axis), w f32 [T,k], p {"w1" [E,I,D], "w2" [E,D,I], "w3" [E,I,D]} dense or QArray (or a
    `StackedExperts`) -> [T,D]; the row `config.backends.moe` of the dispatch table `experts.TABLE`.

    Pure per call (no collectives): under expert parallelism `moe_ep` runs the same table per shard on the
    local experts (ids made local, weights of foreign experts zeroed)."""
    call = experts.ExpertCall(require(config.backends.moe, "moe"), config.swiglu_limit, config.backends.interpret)
    return experts.routed(experts.Assignments(x, idx, w), p, call)


def shared_expert(x: jax.Array, p: dict, config: ModelConfig) -> jax.Array:
    return ops.dense_mlp(x, p["w1"], p["w2"], p["w3"], config.swiglu_limit)


def moe(h: jax.Array, tokens: jax.Array, p: dict, config: ModelConfig, mlp_type: str) -> jax.Array:
    """h [B,S,D], tokens int [B,S] -> [B,S,D]."""
    B, S, D = h.shape
    x = h.reshape(B * S, D)
    idx, w = route(x, tokens.reshape(-1), p["gate"], config, mlp_type)
    if require(config.backends.moe, "moe") == "ep":
        return moe_ep.moe_block(x, idx, w, p, config, batch=B).reshape(B, S, D)
    y = routed_experts(x, idx, w, p["experts"], config)
    if "shared_experts" in p:
        y = y + shared_expert(x, p["shared_experts"], config)
    return y.reshape(B, S, D)
