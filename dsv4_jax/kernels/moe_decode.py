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

import functools
import math

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


def _row_scale(s_ref, fmt, e, r0, nr: int, c0, br: int, bc: int):
    """Decoded scales of rows r0..r0+nr in the column block holding c0: [nr] (br = 1) or a scalar (nr | br)."""
    s = s_ref[e, pl.ds(r0, nr), c0 // bc] if br == 1 else s_ref[e, r0 // br, c0 // bc]
    return decode_scale(s, fmt)


def load_tile(w_ref, fmt, e, r0, nr: int, c0, nc: int):
    """W[e, r0:r0+nr, c0:c0+nc] as float32 values before scaling (codes decoded, FP4 nibbles unpacked)."""
    if fmt is None:
        return w_ref[e, pl.ds(r0, nr), pl.ds(c0, nc)].astype(jnp.float32)
    return decode_codes(w_ref[e, pl.ds(r0, nr), pl.ds(c0 // fmt.pack, nc // fmt.pack)], fmt)


def _gemv_tile(x_chunk, w_ref, s_ref, fmt, e, r0, nr, c0, nc, sblock):
    """Σ_c W[e, r0:r0+nr, c0:c0+nc] · x_chunk -> f32 [nr] (dequantized in the tile when quantized)."""
    part = jnp.sum(load_tile(w_ref, fmt, e, r0, nr, c0, nc) * x_chunk[None, :], axis=1)
    if fmt is not None:
        part = part * _row_scale(s_ref, fmt, e, r0, nr, c0, *sblock)
    return part


def _split(refs, fmts):
    """Kernel refs -> per weight (codes ref, scale ref or None), in order."""
    out, i = [], 0
    for f in fmts:
        out.append((refs[i], refs[i + 1] if f is not None else None))
        i += 1 if f is None else 2
    return out, refs[i:]


def _gate_up_kernel(ids_ref, x_ref, *refs, bI, bD, nD, limit, sblock, fmts):
    ((w1_ref, s1_ref), (w3_ref, s3_ref)), (h_ref,) = _split(refs, fmts)
    e = ids_ref[pl.program_id(0)]
    i0 = pl.program_id(1) * bI

    def body(c, acc):
        g, u = acc
        d0 = pl.multiple_of(c * bD, bD)
        xc = x_ref[0, pl.ds(d0, bD)].astype(jnp.float32)
        g = g + _gemv_tile(xc, w1_ref, s1_ref, fmts[0], e, i0, bI, d0, bD, sblock)
        u = u + _gemv_tile(xc, w3_ref, s3_ref, fmts[1], e, i0, bI, d0, bD, sblock)
        return g, u

    zero = jnp.zeros((bI,), jnp.float32)
    g, u = jax.lax.fori_loop(0, nD, body, (zero, zero))
    h_ref[0, :] = swiglu(g, u, limit).astype(h_ref.dtype)


def _down_kernel(ids_ref, wts_ref, h_ref, *refs, k, bD, bI, nI, sblock, fmts):
    ((w2_ref, s2_ref),), (y_ref,) = _split(refs, fmts)
    t = pl.program_id(0)
    d0 = pl.program_id(1) * bD
    y = jnp.zeros((bD,), jnp.float32)
    for j in range(k):
        a = t * k + j
        e = ids_ref[a]

        def body(c, acc, a=a, e=e):
            i0 = pl.multiple_of(c * bI, bI)
            hc = h_ref[a, pl.ds(i0, bI)].astype(jnp.float32)
            return acc + _gemv_tile(hc, w2_ref, s2_ref, fmts[0], e, d0, bD, i0, bI, sblock)

        y = y + wts_ref[a] * jax.lax.fori_loop(0, nI, body, jnp.zeros((bD,), jnp.float32))
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


@functools.partial(jax.jit, static_argnames=("limit", "interpret", "blocks", "num_warps"))
def experts_decode(x, idx, w, p: dict, *, limit: float, interpret: bool = True,
                   blocks: tuple[int, int, int, int] = (16, 256, 16, 256), num_warps: int = 4):
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
    cp = compiler_params(num_warps)

    fmts = (up1[1], up3[1])
    pack = up1[1].pack if up1[1] is not None else 1
    bI, bD = tiles(I, D, up1[2], blocks[0], blocks[1], pack)
    up_args = [ids, x] + up1[0] + up3[0]
    h = pl.pallas_call(
        functools.partial(_gate_up_kernel, bI=bI, bD=bD, nD=D // bD, limit=limit, sblock=up1[2], fmts=fmts),
        grid=(A, I // bI),
        in_specs=[whole, pl.BlockSpec((1, D), lambda a, i: (a // k, 0))] + [whole] * (len(up_args) - 2),
        out_specs=pl.BlockSpec((1, bI), lambda a, i: (a, i)),
        out_shape=jax.ShapeDtypeStruct((A, I), x.dtype), compiler_params=cp, interpret=interpret)(*up_args)

    pack = dn[1].pack if dn[1] is not None else 1
    bD2, bI2 = tiles(D, I, dn[2], blocks[2], blocks[3], pack)
    dn_args = [ids, w.reshape(-1).astype(jnp.float32), h] + dn[0]
    return pl.pallas_call(
        functools.partial(_down_kernel, k=k, bD=bD2, bI=bI2, nI=I // bI2, sblock=dn[2], fmts=(dn[1],)),
        grid=(T, D // bD2),
        in_specs=[whole] * len(dn_args),
        out_specs=pl.BlockSpec((1, bD2), lambda t, d: (t, d)),
        out_shape=jax.ShapeDtypeStruct((T, D), x.dtype), compiler_params=cp, interpret=interpret)(*dn_args)
