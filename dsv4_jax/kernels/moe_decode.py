"""MoE experts for decode (few tokens): read only the selected experts' weights.

Two Pallas calls, both indexing the expert id *inside* the kernel (the id is a scalar loaded from a small
int32 ref, then used as the leading index of the whole-array weight ref), so only the active experts'
tiles ever leave HBM. This is the GPU (Triton) form of TPU scalar prefetch: BlockSpec index maps cannot
read refs in the Triton lowering.

1. gate/up, grid (T·k assignments, I/bI): h[a, tile] = silu(min(x W1ᵀ, L)) ⊙ clip(x W3ᵀ, −L, L)
2. down + combine, grid (T, D/bD): y[t, tile] = Σ_j w[t,j] · h[t·k+j] W2[e_tj, tile]ᵀ

Each program is a GEMV tile (broadcast-multiply + row sum in float32), the right shape for T·k ≤ a few
dozen. Weights are bf16/f32 arrays or `ops.quant.QArray`s (FP8 e4m3, packed FP4 e2m1, int8 codes with e8m0 /
f16 / f32 block scales), dequantized per tile inside the kernel: the codes cross HBM at their stored width.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ..ops.moe import swiglu
from ..ops.quant import QArray, decode_codes, decode_scale, resolved_block
from .common import block, compiler_params

# Token counts up to this use the decode kernel under the "pallas" moe backend (`model.moe`); more use moe_prefill.
DECODE_MAX_TOKENS = 8


def weight_operands(w):
    """(refs to pass, format or None, scale block (br, bc)) of a dense or QArray expert weight [E, N, K]."""
    if isinstance(w, QArray):
        return [w.codes, w.scale], w.fmt, resolved_block(w.fmt, w.shape)
    return [w], None, (1, w.shape[-1])


class Weight(NamedTuple):
    """One expert weight [E, N, K] inside a kernel: its codes (or dense values) ref, its scale ref (None when
    dense), its format (None when dense) and scale block (br, bc)."""

    ref: object
    scale: object
    fmt: object
    sblock: tuple[int, int]


class Tile(NamedTuple):
    """W[e, r0:r0+nr, c0:c0+nc]: expert e, nr rows from r0, nc columns from c0."""

    e: object
    r0: object
    nr: int
    c0: object
    nc: int


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Static tiling of one kernel: output tile `rows`, contraction `cols` per step and `n_cols` steps, the
    weights' formats (None: dense) and scale block, the SwiGLU limit (gate / up kernels)."""

    rows: int
    cols: int
    n_cols: int
    fmts: tuple
    sblock: tuple[int, int]
    limit: float | None = None


def _row_scale(wt: Weight, t: Tile):
    """Decoded scales of the tile's rows in the column block holding c0: [nr] (br = 1) or a scalar (nr | br)."""
    br, bc = wt.sblock
    s = wt.scale[t.e, pl.ds(t.r0, t.nr), t.c0 // bc] if br == 1 else wt.scale[t.e, t.r0 // br, t.c0 // bc]
    return decode_scale(s, wt.fmt)


def load_tile(wt: Weight, t: Tile):
    """The tile of W as float32 values before scaling (codes decoded, FP4 nibbles unpacked)."""
    if wt.fmt is None:
        return wt.ref[t.e, pl.ds(t.r0, t.nr), pl.ds(t.c0, t.nc)].astype(jnp.float32)
    return decode_codes(wt.ref[t.e, pl.ds(t.r0, t.nr), pl.ds(t.c0 // wt.fmt.pack, t.nc // wt.fmt.pack)], wt.fmt)


def _gemv_tile(x_chunk, wt: Weight, t: Tile):
    """Σ_c tile · x_chunk -> f32 [nr] (dequantized in the tile when quantized)."""
    part = jnp.sum(load_tile(wt, t) * x_chunk[None, :], axis=1)
    if wt.fmt is not None:
        part = part * _row_scale(wt, t)
    return part


def _split(refs, fmts, sblock):
    """Kernel refs -> (a `Weight` per format, in order; the remaining refs)."""
    out, i = [], 0
    for f in fmts:
        out.append(Weight(refs[i], refs[i + 1] if f is not None else None, f, sblock))
        i += 1 if f is None else 2
    return out, refs[i:]


def _gate_up_kernel(ids_ref, x_ref, *refs, t: Tiling):
    (w1, w3), (h_ref,) = _split(refs, t.fmts, t.sblock)
    e = ids_ref[pl.program_id(0)]
    i0 = pl.program_id(1) * t.rows

    def body(c, acc):
        g, u = acc
        d0 = pl.multiple_of(c * t.cols, t.cols)
        xc = x_ref[0, pl.ds(d0, t.cols)].astype(jnp.float32)
        tile = Tile(e, i0, t.rows, d0, t.cols)
        return g + _gemv_tile(xc, w1, tile), u + _gemv_tile(xc, w3, tile)

    zero = jnp.zeros((t.rows,), jnp.float32)
    g, u = jax.lax.fori_loop(0, t.n_cols, body, (zero, zero))
    h_ref[0, :] = swiglu(g, u, t.limit).astype(h_ref.dtype)


def _down_kernel(ids_ref, wts_ref, h_ref, *refs, k: int, t: Tiling):
    (w2,), (y_ref,) = _split(refs, t.fmts, t.sblock)
    tok = pl.program_id(0)
    d0 = pl.program_id(1) * t.rows
    y = jnp.zeros((t.rows,), jnp.float32)
    for j in range(k):
        a = tok * k + j
        e = ids_ref[a]

        def body(c, acc, a=a, e=e):
            i0 = pl.multiple_of(c * t.cols, t.cols)
            hc = h_ref[a, pl.ds(i0, t.cols)].astype(jnp.float32)
            return acc + _gemv_tile(hc, w2, Tile(e, d0, t.rows, i0, t.cols))

        y = y + wts_ref[a] * jax.lax.fori_loop(0, t.n_cols, body, jnp.zeros((t.rows,), jnp.float32))
    y_ref[0, :] = y.astype(y_ref.dtype)


def tiles(rows: int, cols: int, sblock, cap_r: int, cap_c: int, pack: int = 1):
    """Row / column tile sizes that divide the matrix, nest inside the scale blocks and hold whole packed bytes."""
    br, bc = sblock
    bn = block(math.gcd(br, rows) if br > 1 else rows, cap_r)
    bk = block(math.gcd(bc, cols), cap_c)
    if bk % pack:
        raise ValueError(f"column tile {bk} does not hold whole packed codes ({pack} per byte)")
    return bn, bk


def _same_format(a, b, what: str):
    if (a[1], a[2]) != (b[1], b[2]):
        raise ValueError(f"{what} are stored in different formats / blocks: {a[1]} {a[2]} vs {b[1]} {b[2]}")


@functools.partial(jax.jit, static_argnames=("limit", "interpret", "blocks"))
def experts_decode(x, idx, w, p: dict, *, limit: float, interpret: bool = True,
                   blocks: tuple[int, int, int, int] = (16, 256, 16, 256)):
    """x [T,D], idx int [T,k], w f32 [T,k], p {"w1" [E,I,D], "w2" [E,D,I], "w3" [E,I,D]}, each dense or an
    `ops.quant.QArray` (any format: FP8 / FP4 / Q8_0 / int8, tiles dequantized in the kernel)
    -> [T,D] in x.dtype. blocks = (gate/up rows bI, gate/up cols bD, down rows bD, down cols bI) caps."""
    T, D = x.shape
    k = idx.shape[1]
    E, I, _ = p["w1"].shape
    up1, up3, dn = weight_operands(p["w1"]), weight_operands(p["w3"]), weight_operands(p["w2"])
    _same_format(up1, up3, "w1 and w3")
    ids = idx.reshape(-1).astype(jnp.int32)
    A = T * k
    whole = pl.BlockSpec()
    cp = compiler_params()

    fmts = (up1[1], up3[1])
    pack = up1[1].pack if up1[1] is not None else 1
    bI, bD = tiles(I, D, up1[2], blocks[0], blocks[1], pack)
    up_args = [ids, x] + up1[0] + up3[0]
    h = pl.pallas_call(
        functools.partial(_gate_up_kernel, t=Tiling(bI, bD, D // bD, fmts, up1[2], limit)),
        grid=(A, I // bI),
        in_specs=[whole, pl.BlockSpec((1, D), lambda a, i: (a // k, 0))] + [whole] * (len(up_args) - 2),
        out_specs=pl.BlockSpec((1, bI), lambda a, i: (a, i)),
        out_shape=jax.ShapeDtypeStruct((A, I), x.dtype), compiler_params=cp, interpret=interpret)(*up_args)

    pack = dn[1].pack if dn[1] is not None else 1
    bD2, bI2 = tiles(D, I, dn[2], blocks[2], blocks[3], pack)
    dn_args = [ids, w.reshape(-1).astype(jnp.float32), h] + dn[0]
    return pl.pallas_call(
        functools.partial(_down_kernel, k=k, t=Tiling(bD2, bI2, I // bI2, (dn[1],), dn[2])),
        grid=(T, D // bD2),
        in_specs=[whole] * len(dn_args),
        out_specs=pl.BlockSpec((1, bD2), lambda t, d: (t, d)),
        out_shape=jax.ShapeDtypeStruct((T, D), x.dtype), compiler_params=cp, interpret=interpret)(*dn_args)
