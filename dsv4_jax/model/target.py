"""The target model's full-sequence forward: embed → expand to n streams → layers → hc_head → norm → head."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..config import ModelConfig
from ..schedule import segments
from . import hyper
from .block import layer_sequence
from .norms import rms_norm


def embed(params: dict, config: ModelConfig, tokens: jax.Array) -> jax.Array:
    """tokens int [B,S] -> X [B,S,n,D]: the embedding copied to every stream."""
    e = params["embed"][tokens]
    return jnp.broadcast_to(e[:, :, None, :], e.shape[:2] + (config.hc_mult, e.shape[-1]))


def head(params: dict, config: ModelConfig, X: jax.Array) -> jax.Array:
    """X [B,S,n,D] -> logits [B,S,V] (hc_head collapse, final norm, untied head)."""
    h = rms_norm(hyper.hc_head(X, params["hc_head"], config), params["norm"], config.rms_norm_eps)
    return h @ params["head"].T


def run_segments(params: dict, config: ModelConfig, X: jax.Array, layer_fn) -> jax.Array:
    """Apply every layer in order; repeated segments are a lax.scan over their stacked parameters.

    `layer_fn(X, layer_params, layer_index) -> X` (layer_index is static: it fixes the layer type).
    """
    for seg, slots in zip(segments(config), params["segments"]):
        def one_rep(X, rep_params, rep=None):
            for j, pj in enumerate(rep_params):
                # within a scan every repetition has the same kinds, so the first one's index serves
                X = layer_fn(X, pj, seg.layer_index(j, 0 if rep is None else rep))
            return X

        if seg.reps == 1:
            X = one_rep(X, [jax.tree.map(lambda a: a[0], s) for s in slots], 0)
        else:
            X, _ = jax.lax.scan(lambda X, rp: (one_rep(X, rp), None), X, slots)
    return X


def hidden_states(params: dict, config: ModelConfig, tokens: jax.Array) -> jax.Array:
    """The last layer's HC streams before hc_head: tokens [B,S] -> X [B,S,n,D]."""
    B, S = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    X = embed(params, config, tokens)
    fn = lambda X, p, layer: layer_sequence(X, p, config, layer, tokens, positions)
    return run_segments(params, config, X, fn)


@functools.partial(jax.jit, static_argnums=1)
def forward(params: dict, config: ModelConfig, tokens: jax.Array) -> jax.Array:
    """Full-sequence logits, no cache. tokens int32 [B,S] -> logits [B,S,V] in the parameters' dtype."""
    tokens = jnp.asarray(tokens, jnp.int32)
    return head(params, config, hidden_states(params, config, tokens))
