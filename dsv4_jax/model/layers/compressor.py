"""KV compressors: HCA (non-overlapping, §2.5) and CSA / indexer (overlapping, §2.6).

A compressor projects each token to (a_t, z_t) = (W_kv h_t, W_gate h_t + B[t mod m]) and pools
every complete window of m tokens with a per-channel softmax over its slots. The overlapping form
pools 2m slots for row w: the A-halves `[:dim]` of window w−1 and the B-halves `[dim:]` of window w
(window 0 gets −inf gates for its A-slots). Row w is RMS-normed and roped at position w·m.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..inplace import StackedRows, rows_of
from ..state import CompressedRows, Span
from ...ops.linear import linear
from .norms import rms_norm
from .rope import apply_rope


def project(h: jax.Array, p: dict) -> tuple[jax.Array, jax.Array]:
    """(a, z) without the position bias: [B,S,D] -> 2 × [B,S,cd] (z in float32)."""
    a = linear(h, p["wkv"])
    z = linear(h, p["wgate"]).astype(jnp.float32)
    return a, z


def pool(a: jax.Array, z: jax.Array) -> jax.Array:
    """Softmax-weighted sum over the slot axis (-2), per channel; softmax in float32. [..., slots, c] -> [..., c]."""
    w = jax.nn.softmax(z.astype(jnp.float32), axis=-2)
    return jnp.sum(w * a.astype(jnp.float32), axis=-2).astype(a.dtype)


def overlap_slots(a: jax.Array, z: jax.Array, dim: int) -> tuple[jax.Array, jax.Array]:
    """Build the 2m overlapped slots of each window. a, z: [B, nW, m, 2·dim] -> [B, nW, 2m, dim]."""
    B, nW, m, _ = a.shape
    a_prev = jnp.concatenate([jnp.zeros((B, 1, m, dim), a.dtype), a[:, :-1, :, :dim]], axis=1)
    z_prev = jnp.concatenate([jnp.full((B, 1, m, dim), -jnp.inf, z.dtype), z[:, :-1, :, :dim]], axis=1)
    return (jnp.concatenate([a_prev, a[..., dim:]], axis=2),
            jnp.concatenate([z_prev, z[..., dim:]], axis=2))


def finish_rows(rows: jax.Array, norm_w: jax.Array, row_positions: jax.Array, freqs: np.ndarray,
                eps: float) -> jax.Array:
    """RMSNorm then RoPE at the window's first position. rows [B,T,dim], row_positions int [B,T]."""
    return apply_rope(rms_norm(rows, norm_w, eps), row_positions, freqs)


def compress_sequence(h: jax.Array, p: dict, ratio: int, dim: int, overlap: bool, freqs: np.ndarray,
                      eps: float) -> jax.Array:
    """All complete-window rows of a full sequence starting at position 0: [B,S,D] -> [B, S//ratio, dim]."""
    B, S, _ = h.shape
    nW = S // ratio
    if nW == 0:
        return jnp.zeros((B, 0, dim), h.dtype)
    a, z = project(h[:, : nW * ratio], p)
    a = a.reshape(B, nW, ratio, -1)
    z = z.reshape(B, nW, ratio, -1) + p["ape"].astype(jnp.float32)
    if overlap:
        a, z = overlap_slots(a, z, dim)
    rows = pool(a, z)
    row_pos = jnp.broadcast_to(jnp.arange(nW, dtype=jnp.int32) * ratio, (B, nW))
    return finish_rows(rows, p["norm"], row_pos, freqs, eps)


# ---- incremental form (decode state, see dsv4_jax/model/state.py) ------------------------------

def block_projections(h: jax.Array, p: dict, positions: jax.Array, ratio: int) -> tuple[jax.Array, jax.Array]:
    """(a, z + B[t mod m]) of a block of tokens at absolute positions [B,S]: 2 × [B,S,cd]."""
    a, z = project(h, p)
    return a, z + p["ape"].astype(jnp.float32)[positions % ratio]


def _gather_positions(src: jax.Array, t: jax.Array, pos: jax.Array, ring: int) -> jax.Array:
    """Rows of absolute positions t [B,...] from src = concat(ring [B,R,c], block [B,S,c]) [B,R+S,c].

    Positions ≥ pos (the block start) come from the block, earlier ones from ring slot t mod R.
    """
    lead = (slice(None),) + (None,) * (t.ndim - 1)
    start = pos[lead]
    idx = jnp.where(t >= start, ring + t - start, jnp.mod(t, ring))
    return jax.vmap(lambda s, i: s[i])(src, idx)


def close_windows(a: jax.Array, z: jax.Array, cache: CompressedRows, span: Span, ratio: int, dim: int,
                  overlap: bool):
    """Pool every window that closes inside the block [start, start + n_valid) of `span`.

    a, z: the block's projections [B,S,cd]; cache.a / cache.z: earlier projections [B,Rp,cd]. Returns
    (rows [B,J,dim] un-normed, window index w [B,J], ok [B,J]) for the J = ⌊(S−1)/m⌋+1 candidate
    windows w = ⌊start/m⌋ + j; ok marks those whose last token lies inside the valid block.
    """
    ring_a, ring_z, pos, n_valid = cache.a, cache.z, span.start, span.n_valid
    S = a.shape[1]
    R = ring_a.shape[1]
    J = (S - 1) // ratio + 1
    w = pos[:, None] // ratio + jnp.arange(J, dtype=pos.dtype)[None, :]
    ok = w * ratio + ratio - 1 <= (pos + n_valid - 1)[:, None]
    src_a = jnp.concatenate([ring_a, a], axis=1)
    src_z = jnp.concatenate([ring_z, z], axis=1)
    own = w[..., None] * ratio + jnp.arange(ratio, dtype=pos.dtype)          # [B,J,m]
    own_a = _gather_positions(src_a, own, pos, R)
    own_z = _gather_positions(src_z, own, pos, R)
    if overlap:
        prev = own - ratio
        safe = jnp.maximum(prev, 0)
        prev_a = _gather_positions(src_a, safe, pos, R)[..., :dim]
        prev_z = jnp.where((prev >= 0)[..., None], _gather_positions(src_z, safe, pos, R)[..., :dim], -jnp.inf)
        slots_a = jnp.concatenate([prev_a, own_a[..., dim:]], axis=2)
        slots_z = jnp.concatenate([prev_z, own_z[..., dim:]], axis=2)
    else:
        slots_a, slots_z = own_a, own_z
    return pool(slots_a, slots_z), w, ok


# At most this many rows (B·J) are written one `dynamic_update_slice` each; more (prefill) as one scatter.
# Both update the table in place, but XLA's cost model counts a scatter fusion as a read and a write of
# the whole table (a [8, 8193, 512] compressed cache: 128 MiB per layer and step at B = 8) and an in-place
# dynamic-update-slice as its update only, the bytes the step really moves.
ROW_UPDATES_MAX = 64


def write_rows(table, rows: jax.Array, index: jax.Array, ok: jax.Array, per_row: bool = True):
    """table[b, index[b,j]] = rows[b,j] where ok[b,j] (others dropped). table [B,T,c] (or a `model.inplace.StackedRows`,
    written in its stacked buffer, returned as one), rows [B,J,c]. per_row=False: always the scatter (a batch
    split by GSPMD: a row update at a constant sequence index b would gather the whole table)."""
    stacked = isinstance(table, StackedRows)
    buf = table.slab if stacked else table
    lead = (table.index.astype(jnp.int32),) if stacked else ()
    B, T = buf.shape[len(lead):len(lead) + 2]
    J = index.shape[1]
    if B * J > ROW_UPDATES_MAX or not per_row:
        idx = jnp.where(ok, index, T)
        out = jax.vmap(lambda t, i, r: t.at[i].set(r.astype(t.dtype), mode="drop"))(rows_of(table), idx, rows)
        return StackedRows(jax.lax.dynamic_update_index_in_dim(buf, out, lead[0], 0), table.index) if stacked else out
    tail = tuple(jnp.int32(0) for _ in buf.shape[len(lead) + 2:])
    one = (1,) * (len(lead) + 2) + buf.shape[len(lead) + 2:]
    for b in range(B):
        for j in range(J):
            start = lead + (jnp.int32(b), jnp.clip(index[b, j], 0, T - 1).astype(jnp.int32)) + tail
            old = jax.lax.dynamic_slice(buf, start, one)
            new = jnp.where(ok[b, j], rows[b, j].astype(buf.dtype).reshape(one), old)   # not ok: rewrite the row
            buf = jax.lax.dynamic_update_slice(buf, new, start)
    return StackedRows(buf, table.index) if stacked else buf


def write_ring(ring: jax.Array, values: jax.Array, pos: jax.Array, n_valid: jax.Array) -> jax.Array:
    """Store the valid block entries at slots t mod R (only the last R of them). ring [B,R,...], values [B,S,...]."""
    R, S = ring.shape[1], values.shape[1]
    i = jnp.arange(S, dtype=pos.dtype)[None, :]
    keep = (i < n_valid[:, None]) & (i >= n_valid[:, None] - R)
    slot = jnp.where(keep, jnp.mod(pos[:, None] + i, R), R)
    return jax.vmap(lambda r, s, v: r.at[s].set(v.astype(r.dtype), mode="drop"))(ring, slot, values)
