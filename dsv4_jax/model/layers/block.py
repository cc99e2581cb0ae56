"""One decoder layer: X ← HC_attn(X, Attention); X ← HC_ffn(X, MoE) (docs/model_math.md §2.2)."""
from __future__ import annotations

import jax

from ...config import ModelConfig
from ..state import LayerCache, Span
from . import hyper
from .attention import attention_sequence, attention_step
from .moe import moe
from .norms import rms_norm


def ffn_sublayer(X: jax.Array, p: dict, config: ModelConfig, mlp_type: str, tokens: jax.Array) -> jax.Array:
    """X [B,S,n,D] -> X' after the MoE hyper-connection."""
    pre, post, comb = hyper.hc_weights(X, p["hc_ffn"], config)
    h = rms_norm(hyper.collapse(X, pre), p["ffn_norm"], config.rms_norm_eps)
    return hyper.expand(X, moe(h, tokens, p["ffn"], config, mlp_type), post, comb)


def layer_sequence(X: jax.Array, p: dict, config: ModelConfig, layer: int, tokens: jax.Array,
                   positions: jax.Array) -> jax.Array:
    """Full-sequence decoder layer `layer` (its type decides the attention). X [B,S,n,D] -> [B,S,n,D]."""
    layer_type, ratio, mlp_type = config.layer_kind(layer)
    pre, post, comb = hyper.hc_weights(X, p["hc_attn"], config)
    h = rms_norm(hyper.collapse(X, pre), p["attn_norm"], config.rms_norm_eps)
    y = attention_sequence(h, p["attn"], config, layer_type, ratio, positions)
    X = hyper.expand(X, y, post, comb)
    return ffn_sublayer(X, p, config, mlp_type, tokens)


def layer_step(X: jax.Array, p: dict, cache: LayerCache, config: ModelConfig, layer: int, tokens: jax.Array,
               span: Span) -> tuple[jax.Array, LayerCache]:
    """Decoder layer `layer` on a block of tokens [B,S] at `span` against its decode state.
    X [B,S,n,D] -> (X', cache')."""
    layer_type, ratio, mlp_type = config.layer_kind(layer)
    pre, post, comb = hyper.hc_weights(X, p["hc_attn"], config)
    h = rms_norm(hyper.collapse(X, pre), p["attn_norm"], config.rms_norm_eps)
    y, cache = attention_step(h, p["attn"], config, layer_type, ratio, span, cache)
    X = hyper.expand(X, y, post, comb)
    return ffn_sublayer(X, p, config, mlp_type, tokens), cache
