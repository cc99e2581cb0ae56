"""Attention of every layer type (docs/model_math.md §2.4–2.7) over explicit key sets.

Common part: Q-LoRA with an unweighted per-head q norm, one shared K=V head, RoPE on the trailing
channels, a per-head sink logit in the softmax denominator, inverse RoPE on the output (values
carry RoPE) and the grouped O-LoRA. The key set of query p is its raw window (p−W, p] plus, for
CSA/HCA layers, the visible (and for CSA, indexer-selected) compressed rows.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from ..inplace import StackedRows, rows_of, take_rows
from ..state import EMPTY, CompressedRows, LayerCache, Span, WindowRing
from ...config import CSA, SLIDING, ModelConfig
from ...ops.linear import grouped_linear, linear
from ...ops.partitioning import (constrain_logical, constrain_rows, constrain_state_rows, state_batch_entry,
                        state_split_beyond_tokens)
from . import compressor, indexer
from .norms import rms_norm
from .rope import apply_rope, inv_freq, layer_rope_kind


def project_q(h: jax.Array, p: dict, config: ModelConfig, positions: jax.Array, freqs):
    """c_q = RMSNorm(W_qa h) [B,S,q_lora]; q = RoPE(unweighted-norm_per_head(W_qb c_q)) [B,S,H,d]."""
    B, S, _ = h.shape
    eps = config.rms_norm_eps
    # c_q placed whole (batch like the tokens): with the latency preset's split q latent GSPMD otherwise
    # multiplies W_qb as a windowed all-gather loop (issue 19: ≈ 4 MiB more per layer at B = 8).
    qr = constrain_rows(rms_norm(linear(h, p["wq_a"]), p["q_norm"], eps), config)
    # The barrier keeps the per-head norm's reduction out of W_qb's matmul: fused, XLA:TPU rewrites the dot
    # per head and first copies each layer's W_qb out of its stacked parameter (issue 19: v5p AOT, 7 layers,
    # B = 8: 2.97 → 2.88 GiB per chip).
    q = jax.lax.optimization_barrier(linear(qr, p["wq_b"])).reshape(B, S, config.num_heads, config.head_dim)
    return qr, apply_rope(rms_norm(q, None, eps), positions, freqs)


def project_kv(h: jax.Array, p: dict, config: ModelConfig, positions: jax.Array, freqs) -> jax.Array:
    """k = v = RoPE(RMSNorm(W_kv h)): [B,S,D] -> [B,S,d]."""
    return apply_rope(rms_norm(linear(h, p["wkv"]), p["kv_norm"], config.rms_norm_eps), positions, freqs)


def attend(q: jax.Array, keys: jax.Array, mask: jax.Array, sinks: jax.Array,
           query_keys: jax.Array | None = None, query_mask: jax.Array | None = None) -> jax.Array:
    """Softmax attention with a per-head sink logit; values are the keys.

    q [B,S,H,d], keys [B,T,d] shared by all queries with mask bool [B,S,T], sinks [H]; optional
    per-query keys [B,S,K,d] with query_mask [B,S,K] (the CSA rows the indexer selected for each
    query). Softmax in float32 over both sets plus the sink. Returns [B,S,H,d].
    """
    d = q.shape[-1]
    logits = jnp.einsum("bshd,btd->bsht", q, keys).astype(jnp.float32) * d ** -0.5
    logits = jnp.where(mask[:, :, None, :], logits, -jnp.inf)
    if query_keys is not None:
        ql = jnp.einsum("bshd,bskd->bshk", q, query_keys).astype(jnp.float32) * d ** -0.5
        logits = jnp.concatenate([logits, jnp.where(query_mask[:, :, None, :], ql, -jnp.inf)], axis=-1)
    sink = sinks.astype(jnp.float32)[None, None, :]
    top = jnp.maximum(jnp.max(logits, axis=-1), sink)                       # [B,S,H]
    e = jnp.exp(logits - top[..., None])
    probs = (e / (jnp.sum(e, axis=-1) + jnp.exp(sink - top))[..., None]).astype(keys.dtype)
    T = keys.shape[1]
    out = jnp.einsum("bsht,btd->bshd", probs[..., :T], keys)
    if query_keys is not None:
        out = out + jnp.einsum("bshk,bskd->bshd", probs[..., T:], query_keys)
    return out


def grouped_output(o: jax.Array, p: dict, config: ModelConfig) -> jax.Array:
    """u_g = Wa_g · concat(heads of group g); out = W_ob · concat_g u_g. [B,S,H,d] -> [B,S,D]."""
    B, S, H, d = o.shape
    G, R = config.o_groups, config.o_lora_rank
    u = grouped_linear(o.reshape(B, S, G, H * d // G), p["wo_a"], G)                      # [B,S,G,R]
    return linear(u.reshape(B, S, G * R), p["wo_b"])


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
            visible = indexer.select_mask(qi, idx_keys, h, pi, config, positions, ratio)
        keys = jnp.concatenate([kv, rows], axis=1)
        mask = jnp.concatenate([mask, visible], axis=2)
    o = attend(q, keys, mask, p["attn_sink"])
    o = apply_rope(o, positions, freqs, inverse=True)
    return grouped_output(o, p, config)


def write_state_rows(table, rows: jax.Array, index: jax.Array, ok: jax.Array, config: ModelConfig):
    """`compressor.write_rows` where the decode state lives: one in-place row update per (sequence, window)
    when the batch is whole on every device; per device on its own sequences (a `shard_map` over the batch
    axes, no collective) when the expert-parallel backend splits the batch; the batched scatter when the
    placement is unknown (plain GSPMD, one device). table [B,T,c] or `model.inplace.StackedRows`, rows [B,J,c]."""
    how, entry = state_batch_entry(config, rows.shape[0])
    if how != "split":
        return compressor.write_rows(table, rows, index, ok, per_row=how == "whole")
    b = PartitionSpec(entry)
    mesh = config.backends.ep.mesh
    if isinstance(table, StackedRows):
        body = lambda slab, r, *a: compressor.write_rows(StackedRows(slab, r), *a).slab
        slab = jax.shard_map(body, mesh=mesh, in_specs=(PartitionSpec(None, entry), PartitionSpec(), b, b, b),
                             out_specs=PartitionSpec(None, entry), check_vma=False)(table.slab, table.index, rows,
                                                                                   index, ok)
        return StackedRows(slab, table.index)
    return jax.shard_map(compressor.write_rows, mesh=mesh, in_specs=(b, b, b, b), out_specs=b,
                         check_vma=False)(table, rows, index, ok)


def push_window(ring: WindowRing, kv: jax.Array, span: Span) -> WindowRing:
    """The block's valid rows kv [B,S,d] written into the window ring at their positions' slots."""
    return WindowRing(kv=compressor.write_ring(ring.kv, kv, span.start, span.n_valid),
                      pos=compressor.write_ring(ring.pos, span.positions, span.start, span.n_valid))


def compress_block(h: jax.Array, p: dict, config: ModelConfig, layer_type: str, ratio: int, span: Span,
                   cache: CompressedRows) -> CompressedRows:
    """Close this block's windows into the cache's rows and push its projections to the cache's rings.

    p: the compressor's parameters (`attn.compressor`, or `attn.indexer.compressor` with an `IndexerKeys`
    cache); rows of width dim = cache.rows.shape[-1]; overlapping windows in CSA layers (the indexer's too).
    Returns the cache of the same type."""
    dim, overlap = cache.rows.shape[-1], layer_type == CSA
    freqs = inv_freq(config, layer_rope_kind(layer_type))
    a, z = (constrain_state_rows(v, config) for v in compressor.block_projections(h, p, span.positions, ratio))
    rows, w, ok = compressor.close_windows(a, z, cache, span, ratio, dim, overlap)
    rows = compressor.finish_rows(rows, p["norm"], w * ratio, freqs, config.rms_norm_eps)
    rows = constrain_state_rows(rows, config)
    table = write_state_rows(cache.rows, rows, w, ok, config)
    ring_a = compressor.write_ring(cache.a, a, span.start, span.n_valid)
    return cache.replace(a=ring_a, rows=table, z=compressor.write_ring(cache.z, z, span.start, span.n_valid))


def attention_step(h: jax.Array, p: dict, config: ModelConfig, layer_type: str, ratio: int, span: Span,
                   cache: LayerCache) -> tuple[jax.Array, LayerCache]:
    """Attention of a block of S tokens at `span` (positions start..start+S−1) against one layer's decode state.

    h [B,S,D] normed; span.start [B] the block start (= committed tokens); span.n_valid [B] how many of the
    block's tokens are real (the rest, e.g. right padding, is never stored). Returns (y [B,S,D], new cache).
    Rows of every block token are written; only advancing pos commits them.
    """
    positions, pos = span.positions, span.start
    freqs = inv_freq(config, layer_rope_kind(layer_type))
    # Where the state is split further than the tokens (the latency preset at B ≥ chips) the attention core
    # (queries, scores, selected rows) runs where the state is, for every head; the projections read the
    # layer input and the output leaves placed like the tokens. Otherwise GSPMD keeps the head split.
    on_state = state_split_beyond_tokens(config, h.shape[0])

    def core(x):                                   # queries entering the attention core
        return constrain_state_rows(x, config) if on_state else x

    if on_state:
        h = constrain_rows(h, config)
    qr, q = project_q(h, p, config, positions, freqs)
    kv = constrain_state_rows(project_kv(h, p, config, positions, freqs), config)
    win = cache.window
    ring_pos = jnp.where(win.pos < pos[:, None], win.pos, EMPTY)                 # committed rows only
    keys = jnp.concatenate([win.kv, kv], axis=1)
    mask = window_mask(positions, jnp.concatenate([ring_pos, positions], axis=1), config.sliding_window)
    new = cache.replace(window=push_window(win, kv, span))
    query_keys = query_mask = None
    if layer_type != SLIDING:
        new = new.replace(compressor=compress_block(h, p["compressor"], config, layer_type, ratio, span,
                                                    cache.compressor))
        if layer_type == CSA:
            pi = p["indexer"]
            new = new.replace(indexer=compress_block(h, pi["compressor"], config, layer_type, ratio, span,
                                                     cache.indexer))
            qi = core(indexer.index_queries(qr, pi, config, positions, freqs))
            sel, query_mask = indexer.select(qi, rows_of(new.indexer.rows), h, pi, config, positions, ratio)  # [B,S,k]
            whole = state_batch_entry(config, sel.shape[0])[0] == "whole"
            query_keys = take_rows(new.compressor.rows, sel, batch_split=not whole)       # [B,S,k,d]
        else:
            comp = rows_of(new.compressor.rows)
            keys = jnp.concatenate([keys, comp], axis=1)
            mask = jnp.concatenate([mask, compressed_visible(positions, comp.shape[1], ratio)], axis=2)
    o = apply_rope(attend(core(q), keys, mask, p["attn_sink"], query_keys, query_mask), positions, freqs,
                   inverse=True)
    if not on_state:
        return grouped_output(o, p, config), new
    o = constrain_logical(o, config, ("batch", None, "heads", None))
    return constrain_rows(grouped_output(o, p, config), config), new
