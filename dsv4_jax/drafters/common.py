"""Pieces shared by the drafters: the one-layer block config, draft sampling and the p_min rule."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..config import MOE, SLIDING, ModelConfig
from ..ops.sampling import filtered_probs


@functools.lru_cache(maxsize=None)
def block_config(config: ModelConfig) -> ModelConfig:
    """A drafter block is a full V4 layer with ratio 0 (sliding window) and a score-routed MoE."""
    return config.replace(num_layers=1, layer_types=(SLIDING,), compress_ratios=(0,), mlp_layer_types=(MOE,),
                          name=config.name + "/drafter-block")


def draw(key, logits: jax.Array, temperature, top_p, greedy: bool):
    """One draft token per row from logits [B,V]: (token [B], draft probs q [B,V], top-1 prob [B]).

    Greedy drafts are argmax and their confidence is the top-1 probability of softmax(logits);
    sampled drafts come from q = top-p-filtered softmax(logits / T), also used for rejection sampling.
    """
    if greedy:
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), probs, jnp.max(probs, axis=-1)
    q = filtered_probs(logits, temperature, top_p)
    tok = jax.random.categorical(key, jnp.log(q), axis=-1).astype(jnp.int32)
    return tok, q, jnp.max(q, axis=-1)


def chain_length(top1: jax.Array, p_min) -> jax.Array:
    """Drafts kept per row: the chain stops before the first draft whose top-1 probability < p_min. [B,k] -> [B]."""
    keep = jnp.cumprod((top1 >= p_min).astype(jnp.int32), axis=-1)
    return jnp.sum(keep, axis=-1).astype(jnp.int32)
