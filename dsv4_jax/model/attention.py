"""Attention of every layer type (target_model.md §2.4–2.7) over explicit key sets.

Common part: Q-LoRA with an unweighted per-head q norm, one shared K=V head, RoPE on the trailing
channels, a per-head sink logit in the softmax denominator, inverse RoPE on the output (values
carry RoPE) and the grouped O-LoRA. The key set of query p is its raw window (p−W, p] plus, for
CSA/HCA layers, the visible (and for CSA, indexer-selected) compressed rows.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..config import CSA, SLIDING, ModelConfig
from . import compressor, indexer
from .norms import rms_norm
from .rope import apply_rope, inv_freq, layer_rope_kind


def project_q(h: jax.Array, p: dict, config: ModelConfig, positions: jax.Array, freqs):
    """c_q = RMSNorm(W_qa h) [B,S,q_lora]; q = RoPE(unweighted-norm_per_head(W_qb c_q)) [B,S,H,d]."""
    B, S, _ = h.shape
    eps = config.rms_norm_eps
    qr = rms_norm(h @ p["wq_a"].T, p["q_norm"], eps)
    q = (qr @ p["wq_b"].T).reshape(B, S, config.num_heads, config.head_dim)
    return qr, apply_rope(rms_norm(q, None, eps), positions, freqs)


def project_kv(h: jax.Array, p: dict, config: ModelConfig, positions: jax.Array, freqs) -> jax.Array:
    """k = v = RoPE(RMSNorm(W_kv h)): [B,S,D] -> [B,S,d]."""
    return apply_rope(rms_norm(h @ p["wkv"].T, p["kv_norm"], config.rms_norm_eps), positions, freqs)


def attend(q: jax.Array, keys: jax.Array, mask: jax.Array, sinks: jax.Array) -> jax.Array:
    """Softmax attention with a per-head sink logit; values are the keys.

    q [B,S,H,d], keys [B,T,d], mask bool [B,S,T], sinks [H] -> [B,S,H,d]. Softmax in float32.
    """
    d = q.shape[-1]
    logits = jnp.einsum("bshd,btd->bsht", q, keys).astype(jnp.float32) * d ** -0.5
    logits = jnp.where(mask[:, :, None, :], logits, -jnp.inf)
    sink = sinks.astype(jnp.float32)[None, None, :]
    top = jnp.maximum(jnp.max(logits, axis=-1), sink)                       # [B,S,H]
    e = jnp.exp(logits - top[..., None])
    probs = e / (jnp.sum(e, axis=-1) + jnp.exp(sink - top))[..., None]
    return jnp.einsum("bsht,btd->bshd", probs.astype(keys.dtype), keys)


def grouped_output(o: jax.Array, p: dict, config: ModelConfig) -> jax.Array:
    """u_g = Wa_g · concat(heads of group g); out = W_ob · concat_g u_g. [B,S,H,d] -> [B,S,D]."""
    B, S, H, d = o.shape
    G, R = config.o_groups, config.o_lora_rank
    wa = p["wo_a"].reshape(G, R, H * d // G)
    u = jnp.einsum("bsgi,gri->bsgr", o.reshape(B, S, G, H * d // G), wa)
    return u.reshape(B, S, G * R) @ p["wo_b"].T


def window_mask(q_pos: jax.Array, k_pos: jax.Array, window: int) -> jax.Array:
    """Key t visible to query p iff p − W < t ≤ p. q_pos [B,S], k_pos [B,T] -> [B,S,T]."""
    diff = q_pos[:, :, None] - k_pos[:, None, :]
    return (diff >= 0) & (diff < window)


def compressed_visible(q_pos: jax.Array, n_rows: int, ratio: int) -> jax.Array:
    """Row w visible to query p iff w < ⌊(p+1)/m⌋. q_pos [B,S] -> [B,S,n_rows]."""
    return jnp.arange(n_rows)[None, None, :] < ((q_pos + 1) // ratio)[:, :, None]


def attention_sequence(h: jax.Array, p: dict, config: ModelConfig, layer_type: str, ratio: int,
                       positions: jax.Array) -> jax.Array:
    """Full-sequence attention (no cache). h [B,S,D] normed, positions [B,S] = 0..S-1 -> [B,S,D]."""
    freqs = inv_freq(config, layer_rope_kind(layer_type))
    eps = config.rms_norm_eps
    qr, q = project_q(h, p, config, positions, freqs)
    kv = project_kv(h, p, config, positions, freqs)
    keys, mask = kv, window_mask(positions, positions, config.sliding_window)
    if layer_type != SLIDING and h.shape[1] >= ratio:
        rows = compressor.compress_sequence(h, p["compressor"], ratio, config.head_dim, layer_type == CSA,
                                            freqs, eps)
        visible = compressed_visible(positions, rows.shape[1], ratio)
        if layer_type == CSA:
            pi = p["indexer"]
            idx_keys = compressor.compress_sequence(h, pi["compressor"], ratio, config.index_head_dim, True,
                                                    freqs, eps)
            qi = indexer.index_queries(qr, pi, config, positions, freqs)
            scores = indexer.index_scores(qi, idx_keys, h, pi, config)
            visible = indexer.select_topk(scores, visible, config.index_topk)
        keys = jnp.concatenate([kv, rows], axis=1)
        mask = jnp.concatenate([mask, visible], axis=2)
    o = attend(q, keys, mask, p["attn_sink"])
    o = apply_rope(o, positions, freqs, inverse=True)
    return grouped_output(o, p, config)
