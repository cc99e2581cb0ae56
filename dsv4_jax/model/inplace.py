"""Copy avoidance in the layer scan of `model.target.run_segments`: buffers read and written where they live.

A scan over a segment's repeated layers hands each layer its slice of the stacked parameters and decode state
([reps, ...] -> [...]) and stacks what the layer returns. Written plainly, XLA materialises those slices
wherever their user cannot read the stack in place, and two kinds of buffer are too big for that:

* the row tables of the decode state (the rows of a `model.state.CompressedRows` and of the
  `model.state.IndexerKeys`, [B, T, c] per layer: T = max_len / m rows). Sliced out of the stack and written back after the step, each is
  copied twice although a step writes a few rows (~2 × 64 MiB per CSA layer and step at B = 8, 32K). Here the
  tables travel whole as the scan's carry and each layer gets its table as a `StackedRows` (the slab and the
  layer's index in it): it reads the rows it needs from the slab (`take_rows`, `rows_of`) and writes its new
  rows into the slab (`model.layers.compressor.write_rows`), so a step moves only the rows it writes
  (`in_place_tables`). The rings (a few hundred rows) are sliced and stacked as usual.
* the routed experts under the MoE kernels (`reads_expert_stack`): a kernel is a custom call, whose operand
  XLA must materialise, so a scan's per-layer slice of the experts is a copy of every expert of the layer
  (4 GiB per Flash weight on an H200). `hoist_stacked_experts` takes them out of the per-layer parameters and
  `with_stacked_experts` hands the layer the whole stack and its index (`moe.StackedExperts`), which the
  kernels read in place.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from ..config import ModelConfig
from .layers.stacked_experts import StackedExperts


@struct.dataclass
class StackedRows:
    """One layer's row table [B, T, c] where it lives: slab [reps, B, T, c] of its scan segment, at rep `index`
    (traced int32). The layer reads `view()` and writes rows into the slab in place
    (`model.layers.compressor.write_rows`): slicing the table out of the stack and writing it back after the step
    would copy the whole table (XLA materialises both; ~2 × 64 MiB per CSA layer and step at B = 8, 32K)."""

    slab: jax.Array
    index: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The table's shape [B, T, c]."""
        return self.slab.shape[1:]

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


# ---- row tables carried whole through the scan ----------------------------------------------------------

def row_tables(cache) -> tuple:
    """The row tables of a `model.state.LayerCache`: the compressor's rows, then the indexer keys (those the
    layer kind has: 0, 1 or 2)."""
    return tuple(part.rows for part in (cache.compressor, cache.indexer) if part is not None)


def with_row_tables(cache, tables):
    """`cache` with its row tables replaced, in `row_tables` order (None: taken out)."""
    tables = iter(tables)
    compressor = None if cache.compressor is None else cache.compressor.replace(rows=next(tables))
    indexer = None if cache.indexer is None else cache.indexer.replace(rows=next(tables))
    return cache.replace(compressor=compressor, indexer=indexer)


def split_tables(cache):
    """A segment slot's stacked cache (`model.state.LayerCache` of [reps, B, ...]) -> (the cache with its row
    tables taken out, the row tables `row_tables`); None -> (None, None)."""
    if cache is None:
        return None, None
    tables = row_tables(cache)
    return with_row_tables(cache, [None] * len(tables)), tables


def in_place_tables(one_rep):
    """`one_rep` with the row tables carried whole ((carry, tables) in, (carry, tables) out): rep r's layer
    gets each table as `StackedRows(slab, r)` and writes its rows into the slab, so a step moves only the rows
    it writes (scan: the slabs are loop-carried buffers, updated in place)."""
    def body(carry_tables, rep_params, rep_rest, rep):
        carry, tables = carry_tables
        caches = [None if r is None else with_row_tables(r, [StackedRows(v, rep) for v in t])
                  for r, t in zip(rep_rest, tables)]
        carry, outs = one_rep(carry, rep_params, caches, rep)
        rest, new_tables = zip(*map(split_tables, outs))
        new_tables = [None if t is None else tuple(_slab(v) for v in t) for t in new_tables]
        return (carry, new_tables), list(rest)
    return body


def _slab(table):
    if not isinstance(table, StackedRows):
        raise TypeError(f"a layer returned its row table as {type(table).__name__}, not the StackedRows it got")
    return table.slab


# ---- routed experts left in their stack ---------------------------------------------------------------------

def reads_expert_stack(config: ModelConfig) -> bool:
    """Whether the routed experts reach the MoE as their segment's stack (`moe.StackedExperts`): under the GPU
    kernels ("pallas"), and under expert parallelism with the Mosaic kernels as its local matmul
    (`ExpertParallel.local == "pallas_tpu"`) — a kernel is a custom call, whose operand XLA must materialise."""
    b = config.backends
    return b.moe == "pallas" or (b.moe == "ep" and b.ep is not None and b.ep.local == "pallas_tpu")


def hoist_stacked_experts(slots: list, config: ModelConfig) -> tuple[list, list]:
    """Under the MoE kernels (`reads_expert_stack`): each slot's stacked routed experts [reps, E, ...] taken
    out of the per-rep parameters (None where a slot has none, or for other backends). A scan's per-rep slice
    of them would be materialised before the kernel's custom call (a copy of every expert of the layer: 4 GiB
    per Flash weight, measured on an H200; 1.64 GB per chip in the 5-layer TPU EP decode at B = 8); the kernel
    reads the stack itself (`moe.StackedExperts`)."""
    if not reads_expert_stack(config):
        return slots, [None] * len(slots)
    out, stacked = [], []
    for slot in slots:
        ffn = slot.get("ffn") if isinstance(slot, dict) else None
        if not isinstance(ffn, dict) or "experts" not in ffn:
            out.append(slot)
            stacked.append(None)
            continue
        out.append({**slot, "ffn": {k: v for k, v in ffn.items() if k != "experts"}})
        stacked.append(ffn["experts"])
    return out, stacked


def with_stacked_experts(rep_params: dict, stacked, rep) -> dict:
    """rep_params with its routed experts as `moe.StackedExperts(stacked, rep)` (no-op when stacked is None)."""
    if stacked is None:
        return rep_params
    return {**rep_params, "ffn": {**rep_params["ffn"], "experts": StackedExperts(stacked, rep)}}
