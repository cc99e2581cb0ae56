"""Decode state: fixed-shape pytrees indexed by absolute position (docs/design.md property 3).

Per layer (leaves stacked on a leading `reps` axis per scan segment, like the parameters):

    all layers  win_kv  [B, Rw, d]   raw K=V rows, ring slot t mod Rw
                win_pos [B, Rw]      absolute position held by each slot (EMPTY when never written)
    CSA / HCA   comp_kv [B, T, d]    compressed row w at index w (T = ceil(max_len / m))
                comp_a / comp_z [B, Rp, cd]   pending compressor projections (z with its slot bias),
                                     ring slot t mod Rp; cd = 2d for CSA (A | B halves), d for HCA
    CSA only    idx_keys [B, T, dI], idx_a / idx_z [B, Rp, 2·dI]   the indexer's own compressor

plus `pos [B]`, the number of committed tokens of each sequence. Nothing is ever "undone": a
block of tokens is written at positions pos..pos+S−1, and only advancing `pos` commits it. A row
of an uncommitted position is invisible (windows and the ⌊(p+1)/m⌋ rule are decided from `pos`
and the stored positions) and is overwritten when that position is processed again.

Ring sizes: a block starting at `pos` needs the W−1 committed raw rows before it, and (for the
compressor) the 2m−1 projections before it (m−1 for HCA); rows written by a rejected block of at
most `max_block` tokens must not clobber them, hence Rw = W + max_block − 1 and
Rp = c·m + max_block − 1 (c = 2 for CSA, 1 for HCA).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from ..config import CSA, SLIDING, ModelConfig
from .schedule import segments

class CapacityError(ValueError):
    """A sequence would exceed the decode state's capacity (max_len), a block its max_block, or a state the
    positions the config supports (max_position_embeddings)."""


EMPTY = -(2 ** 30)   # position tag of a never-written ring slot: outside every window

# The row tables a layer reads and writes where its segment's stacked buffer holds them (`StackedRows`);
# the rings (a few hundred rows) are sliced out and written back whole.
STACKED_TABLES = ("comp_kv", "idx_keys")


@struct.dataclass
class StackedRows:
    """One layer's row table [B, T, c] where it lives: slab [reps, B, T, c] of its scan segment, at rep `index`
    (traced int32). The layer reads `view()` and writes rows into the slab in place
    (`model.layers.compressor.write_rows`): slicing the table out of the stack and writing it back after the step
    would copy the whole table (XLA materialises both; ~2 × 64 MiB per CSA layer and step at B = 8, 32K)."""

    slab: jax.Array
    index: jax.Array

    def view(self) -> jax.Array:
        return jax.lax.dynamic_index_in_dim(self.slab, self.index, 0, keepdims=False)


def rows_of(table) -> jax.Array:
    """The [B, T, c] rows of a table given as an array or a `StackedRows`."""
    return table.view() if isinstance(table, StackedRows) else table


def take_rows(table, sel: jax.Array, batch_split: bool = True) -> jax.Array:
    """table[b, sel[b, ...]] for a table [B, T, c] or a `StackedRows`: sel int [B, ...] -> [B, ..., c]. A stacked
    table is gathered from its slab directly (a gather from `view()` would first copy the whole table out):
    batched over the slab's B axis when the batch may be split (GSPMD then splits the gather like B), else one
    gather with explicit (rep, sequence, row) indices (v5p AOT, latency preset, 7 layers, B = 8: 3.00 against
    3.52 GiB per chip with the batched form)."""
    if not isinstance(table, StackedRows):
        return jax.vmap(lambda rows, i: rows[i])(table, sel)
    if batch_split:
        return jax.vmap(lambda s, i: s[table.index, i], in_axes=(1, 0))(table.slab, sel)
    b = jnp.arange(sel.shape[0]).reshape((-1,) + (1,) * (sel.ndim - 1))
    return table.slab[table.index, b, sel]


@struct.dataclass
class DecodeState:
    pos: jax.Array                                     # [B] int32 committed tokens per sequence
    layers: list                                       # layers[s][j]: dict of [reps, B, ...] arrays
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
                       dtype) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes and dtypes of one layer's cache (no reps axis)."""
    lt, m, _ = config.layer_kind(layer)
    d, B = config.head_dim, batch
    rw, rp = ring_sizes(config, layer, max_block)
    out = {"win_kv": jax.ShapeDtypeStruct((B, rw, d), dtype), "win_pos": jax.ShapeDtypeStruct((B, rw), jnp.int32)}
    if lt != SLIDING:
        T = math.ceil(max_len / m)
        cd = 2 * d if lt == CSA else d
        out.update(comp_kv=jax.ShapeDtypeStruct((B, T, d), dtype),
                   comp_a=jax.ShapeDtypeStruct((B, rp, cd), dtype),
                   comp_z=jax.ShapeDtypeStruct((B, rp, cd), jnp.float32))
    if lt == CSA:
        dI = config.index_head_dim
        out.update(idx_keys=jax.ShapeDtypeStruct((B, T, dI), dtype),
                   idx_a=jax.ShapeDtypeStruct((B, rp, 2 * dI), dtype),
                   idx_z=jax.ShapeDtypeStruct((B, rp, 2 * dI), jnp.float32))
    return out


def state_shapes(config: ModelConfig, batch: int, max_len: int, max_block: int, dtype=jnp.float32):
    """Abstract DecodeState (jax.ShapeDtypeStruct leaves): sizes without allocating."""
    layers = []
    for seg in segments(config):
        slots = []
        for j in range(seg.pattern):
            shapes = layer_cache_shapes(config, seg.start + j, batch, max_len, max_block, dtype)
            slots.append({k: jax.ShapeDtypeStruct((seg.reps,) + v.shape, v.dtype) for k, v in shapes.items()})
        layers.append(slots)
    return DecodeState(pos=jax.ShapeDtypeStruct((batch,), jnp.int32), layers=layers, max_len=max_len,
                       max_block=max_block)


def init_state(config: ModelConfig, batch: int, max_len: int, max_block: int = 8, dtype=jnp.float32) -> DecodeState:
    """An empty state: pos = 0, rings tagged EMPTY, everything else zero."""
    if max_len <= 0 or max_block <= 0 or batch <= 0:
        raise ValueError(f"batch, max_len and max_block must be positive (got {batch}, {max_len}, {max_block})")
    if max_len > config.max_position_embeddings:
        raise CapacityError(f"a decode state of max_len={max_len} positions is past what {config.name} supports "
                            f"(max_position_embeddings={config.max_position_embeddings}); shorten the prompt or "
                            f"max_new_tokens")
    shapes = state_shapes(config, batch, max_len, max_block, dtype)

    def make(path, s):
        name = path[-1].key if hasattr(path[-1], "key") else None
        return jnp.full(s.shape, EMPTY, s.dtype) if name == "win_pos" else jnp.zeros(s.shape, s.dtype)

    layers = jax.tree_util.tree_map_with_path(make, shapes.layers)
    return DecodeState(pos=jnp.zeros((batch,), jnp.int32), layers=layers, max_len=max_len, max_block=max_block)


def state_bytes(config: ModelConfig, batch: int, max_len: int, max_block: int = 8, dtype=jnp.bfloat16) -> dict:
    """Bytes of the decode state by part, from the shapes alone."""
    out = {"window": 0, "compressed": 0, "compressor_pending": 0, "indexer_keys": 0, "indexer_pending": 0}
    part = {"win_kv": "window", "win_pos": "window", "comp_kv": "compressed", "comp_a": "compressor_pending",
            "comp_z": "compressor_pending", "idx_keys": "indexer_keys", "idx_a": "indexer_pending",
            "idx_z": "indexer_pending"}
    shapes = state_shapes(config, batch, max_len, max_block, dtype)
    for slots in shapes.layers:
        for slot in slots:
            for k, v in slot.items():
                out[part[k]] += math.prod(v.shape) * jnp.dtype(v.dtype).itemsize
    out["total"] = sum(out.values())
    return out
