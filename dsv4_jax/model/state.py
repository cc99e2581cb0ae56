"""Decode state: fixed-shape pytrees indexed by absolute position (docs/design.md property 3).

One typed struct per cache kind, each field with its shape (per layer; in a `DecodeState` every leaf has a
leading `reps` axis per scan segment, like the parameters):

    every layer   `WindowRing`       kv [B, Rw, d] raw K=V rows, ring slot t mod Rw; pos [B, Rw] their positions
    CSA / HCA     `CompressedRows`   rows [B, T, d] compressed row w at index w (T = ceil(max_len / m));
                                     a / z [B, Rp, cd] pending compressor projections (z with its slot bias),
                                     ring slot t mod Rp; cd = 2d for CSA (A | B halves), d for HCA
    CSA only      `IndexerKeys`      the indexer's own compressor: rows [B, T, dI], a / z [B, Rp, 2·dI]

gathered per layer in a `LayerCache` (window, compressor, indexer: the last two None where the layer kind has
none; the names of the parameter modules `attn.compressor` and `attn.indexer` that write them, `model.names`),
plus `pos [B]`, the number of committed tokens of each sequence. The drafters' rings are `WindowRing`s too
(`drafters.mtp.MTPState`: a sliding layer's `LayerCache`; `drafters.dspark.DSparkState`: one ring per stage).

Nothing is ever "undone": a block of tokens is written at positions pos..pos+S−1 (a `Span`), and only
advancing `pos` commits it. A row of an uncommitted position is invisible (windows and the ⌊(p+1)/m⌋ rule are
decided from `pos` and the stored positions) and is overwritten when that position is processed again.

Ring sizes: a block starting at `pos` needs the W−1 committed raw rows before it, and (for the
compressor) the 2m−1 projections before it (m−1 for HCA); rows written by a rejected block of at
most `max_block` tokens must not clobber them, hence Rw = W + max_block − 1 and
Rp = c·m + max_block − 1 (c = 2 for CSA, 1 for HCA).

Inside the layer scan a row table may be a `model.inplace.StackedRows` (the table where its segment's stacked
buffer holds it) instead of an array; `model.inplace` says why.
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from ..config import CSA, SLIDING, ModelConfig
from .schedule import segments

class CapacityError(ValueError):
    """A sequence would exceed the decode state's capacity (max_len), a block its max_block, or a state the
    positions the config supports (max_position_embeddings)."""


EMPTY = -(2 ** 30)   # position tag of a never-written ring slot: outside every window


@struct.dataclass
class WindowRing:
    """A position-indexed ring of raw K=V rows: the sliding window of every layer (Rw = W + max_block − 1 slots),
    the MTP block's window, a DSpark stage's context (W slots; a leading stage axis in `DSparkState`)."""

    kv: jax.Array    # [B, R, d] rows, the row of position t in slot t mod R
    pos: jax.Array   # [B, R] int32 absolute position each slot holds (EMPTY when never written)


# Field order a, rows, z (and compressor, indexer, window in LayerCache) flattens a state's leaves in the order
# of the former dict keys (comp_a, comp_kv, comp_z, idx_*, win_*): the same program arguments as before.
@struct.dataclass
class CompressedRows:
    """A compressor's rows and its pending projections (CSA / HCA layers, `attn.compressor`)."""

    a: jax.Array     # [B, Rp, cd] projections W_kv h of the last positions, slot t mod Rp
    rows: Any        # [B, T, d] row w at index w (a `model.inplace.StackedRows` inside the layer scan)
    z: jax.Array     # [B, Rp, cd] float32 gate projections W_gate h + B[t mod m], slot t mod Rp


@struct.dataclass
class IndexerKeys(CompressedRows):
    """The lightning indexer's keys (CSA layers, `attn.indexer.compressor`): rows [B, T, dI], a / z
    [B, Rp, 2·dI] — an overlapping compressor of width dI."""


@struct.dataclass
class LayerCache:
    """One layer's decode state; compressor / indexer are None where the layer kind has none."""

    compressor: CompressedRows | None   # CSA, HCA
    indexer: IndexerKeys | None         # CSA
    window: WindowRing                  # every layer


@struct.dataclass
class Span:
    """Where a block of S tokens sits against the decode state: positions start..start+S−1 per sequence, the
    first n_valid of them real (the rest, e.g. right padding, is never stored)."""

    positions: jax.Array   # [B, S] int32 absolute position of each token
    start: jax.Array       # [B] int32 the block start (= committed tokens, `DecodeState.pos`)
    n_valid: jax.Array     # [B] int32 real tokens of the block

    @classmethod
    def of(cls, start: jax.Array, size: int, n_valid: jax.Array) -> "Span":
        """The span of `size` tokens from start [B]."""
        return cls(start[:, None] + jnp.arange(size, dtype=jnp.int32)[None, :], start, n_valid)


@struct.dataclass
class DecodeState:
    pos: jax.Array                                     # [B] int32 committed tokens per sequence
    layers: list                                       # layers[s][j]: LayerCache of [reps, B, ...] arrays
    max_len: int = struct.field(pytree_node=False)     # capacity in tokens
    max_block: int = struct.field(pytree_node=False)   # widest decode/verify block (k + 1)

    @property
    def batch(self) -> int:
        return self.pos.shape[0]


def ring_sizes(config: ModelConfig, layer: int, max_block: int) -> tuple[int, int]:
    """(Rw, Rp) of layer `layer`: raw-window ring and compressor-projection ring (0 if none)."""
    lt, m, _ = config.layer_kind(layer)
    rw = config.sliding_window + max_block - 1
    rp = 0 if lt == SLIDING else (2 if lt == CSA else 1) * m + max_block - 1
    return rw, rp


def layer_cache_shapes(config: ModelConfig, layer: int, batch: int, max_len: int, max_block: int,
                       dtype) -> LayerCache:
    """Shapes and dtypes of one layer's cache (no reps axis): a LayerCache of jax.ShapeDtypeStruct."""
    lt, m, _ = config.layer_kind(layer)
    d, B = config.head_dim, batch
    rw, rp = ring_sizes(config, layer, max_block)
    sds = jax.ShapeDtypeStruct
    window = WindowRing(kv=sds((B, rw, d), dtype), pos=sds((B, rw), jnp.int32))
    compressed = indexer = None
    if lt != SLIDING:
        T = math.ceil(max_len / m)
        cd = 2 * d if lt == CSA else d
        compressed = CompressedRows(a=sds((B, rp, cd), dtype), rows=sds((B, T, d), dtype),
                                    z=sds((B, rp, cd), jnp.float32))
    if lt == CSA:
        dI = config.index_head_dim
        indexer = IndexerKeys(a=sds((B, rp, 2 * dI), dtype), rows=sds((B, T, dI), dtype),
                              z=sds((B, rp, 2 * dI), jnp.float32))
    return LayerCache(compressor=compressed, indexer=indexer, window=window)


def state_shapes(config: ModelConfig, batch: int, max_len: int, max_block: int, dtype=jnp.float32):
    """Abstract DecodeState (jax.ShapeDtypeStruct leaves): sizes without allocating."""
    layers = []
    for seg in segments(config):
        slots = []
        for j in range(seg.pattern):
            shapes = layer_cache_shapes(config, seg.start + j, batch, max_len, max_block, dtype)
            slots.append(jax.tree.map(lambda v: jax.ShapeDtypeStruct((seg.reps,) + v.shape, v.dtype), shapes))
        layers.append(slots)
    return DecodeState(pos=jax.ShapeDtypeStruct((batch,), jnp.int32), layers=layers, max_len=max_len,
                       max_block=max_block)


def empty_cache(shapes: LayerCache) -> LayerCache:
    """A cache of the given shapes: ring slots tagged EMPTY, everything else zero."""
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    pos = shapes.window.pos
    return zeros.replace(window=zeros.window.replace(pos=jnp.full(pos.shape, EMPTY, pos.dtype)))


def init_state(config: ModelConfig, batch: int, max_len: int, max_block: int = 8, dtype=jnp.float32) -> DecodeState:
    """An empty state: pos = 0, rings tagged EMPTY, everything else zero."""
    if max_len <= 0 or max_block <= 0 or batch <= 0:
        raise ValueError(f"batch, max_len and max_block must be positive (got {batch}, {max_len}, {max_block})")
    if max_len > config.max_position_embeddings:
        raise CapacityError(f"a decode state of max_len={max_len} positions is past what {config.name} supports "
                            f"(max_position_embeddings={config.max_position_embeddings}); shorten the prompt or "
                            f"max_new_tokens")
    shapes = state_shapes(config, batch, max_len, max_block, dtype)
    layers = [[empty_cache(c) for c in slots] for slots in shapes.layers]
    return DecodeState(pos=jnp.zeros((batch,), jnp.int32), layers=layers, max_len=max_len, max_block=max_block)


def tree_bytes(tree) -> int:
    """Bytes of the arrays (or jax.ShapeDtypeStruct) of a pytree."""
    return sum(math.prod(v.shape) * jnp.dtype(v.dtype).itemsize for v in jax.tree.leaves(tree))


def state_bytes(config: ModelConfig, batch: int, max_len: int, max_block: int = 8, dtype=jnp.bfloat16) -> dict:
    """Bytes of the decode state by part, from the shapes alone."""
    out = {"window": 0, "compressed": 0, "compressor_pending": 0, "indexer_keys": 0, "indexer_pending": 0}
    shapes = state_shapes(config, batch, max_len, max_block, dtype)
    for c in (c for slots in shapes.layers for c in slots):
        out["window"] += tree_bytes(c.window)
        if c.compressor is not None:
            out["compressed"] += tree_bytes(c.compressor.rows)
            out["compressor_pending"] += tree_bytes((c.compressor.a, c.compressor.z))
        if c.indexer is not None:
            out["indexer_keys"] += tree_bytes(c.indexer.rows)
            out["indexer_pending"] += tree_bytes((c.indexer.a, c.indexer.z))
    out["total"] = sum(out.values())
    return out
