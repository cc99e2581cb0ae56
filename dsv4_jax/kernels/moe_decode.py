"""MoE experts for decode (few tokens): read only the selected experts' weights.

Two Pallas calls, both indexing the expert id *inside* the kernel (the id is a scalar loaded from a small
int32 ref, then used as the leading index of the whole-array weight ref), so only the active experts'
tiles ever leave HBM. This is the GPU (Triton) form of TPU scalar prefetch: BlockSpec index maps cannot
read refs in the Triton lowering.

1. gate/up, grid (T·k assignments, I/bI): h[a, tile] = silu(min(x W1ᵀ, L)) ⊙ clip(x W3ᵀ, −L, L)
2. down + combine, grid (T, D/bD): y[t, tile] = Σ_j w[t,j] · h[t·k+j] W2[e_tj, tile]ᵀ

Each program is a GEMV tile (broadcast-multiply + row sum in float32), the right shape for T·k ≤ a few
dozen. Weights are bf16/f32 or quantized (codes + scales, see `ops/quant.py`), dequantized per tile.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ..ops import quant
from ..ops.moe import swiglu
from .common import block, compiler_params

# Token counts up to this use the decode kernel under the "pallas" moe backend (`model.moe`); more use moe_prefill.
DECODE_MAX_TOKENS = 8


def _row_scale(s_ref, e, r0, nr: int, c0, br: int, bc: int):
    """Scales of rows r0..r0+nr in the column block holding c0: [nr] (br = 1) or a scalar (nr | br)."""
    if br == 1:
        return s_ref[e, pl.ds(r0, nr), c0 // bc]
    return s_ref[e, r0 // br, c0 // bc]


def _gemv_tile(x_chunk, w_ref, s_ref, e, r0, nr, c0, nc, sblock):
    """Σ_c W[e, r0:r0+nr, c0:c0+nc] · x_chunk -> f32 [nr] (dequantized when s_ref is given)."""
    w = w_ref[e, pl.ds(r0, nr), pl.ds(c0, nc)].astype(jnp.float32)
    part = jnp.sum(w * x_chunk[None, :], axis=1)
    if s_ref is not None:
        part = part * _row_scale(s_ref, e, r0, nr, c0, *sblock)
    return part


def _gate_up_kernel(ids_ref, x_ref, w1_ref, w3_ref, *rest, bI, bD, nD, limit, sblock, quantized):
    s1_ref, s3_ref, h_ref = rest if quantized else (None, None, rest[0])
    e = ids_ref[pl.program_id(0)]
    i0 = pl.program_id(1) * bI

    def body(c, acc):
        g, u = acc
        d0 = pl.multiple_of(c * bD, bD)
        xc = x_ref[0, pl.ds(d0, bD)].astype(jnp.float32)
        g = g + _gemv_tile(xc, w1_ref, s1_ref, e, i0, bI, d0, bD, sblock)
        u = u + _gemv_tile(xc, w3_ref, s3_ref, e, i0, bI, d0, bD, sblock)
        return g, u

    zero = jnp.zeros((bI,), jnp.float32)
    g, u = jax.lax.fori_loop(0, nD, body, (zero, zero))
    h_ref[0, :] = swiglu(g, u, limit).astype(h_ref.dtype)


def _down_kernel(ids_ref, wts_ref, h_ref, w2_ref, *rest, k, bD, bI, nI, sblock, quantized):
    s2_ref, y_ref = rest if quantized else (None, rest[0])
    t = pl.program_id(0)
    d0 = pl.program_id(1) * bD
    y = jnp.zeros((bD,), jnp.float32)
    for j in range(k):
        a = t * k + j
        e = ids_ref[a]

        def body(c, acc, a=a, e=e):
            i0 = pl.multiple_of(c * bI, bI)
            hc = h_ref[a, pl.ds(i0, bI)].astype(jnp.float32)
            return acc + _gemv_tile(hc, w2_ref, s2_ref, e, d0, bD, i0, bI, sblock)

        y = y + wts_ref[a] * jax.lax.fori_loop(0, nI, body, jnp.zeros((bD,), jnp.float32))
    y_ref[0, :] = y.astype(y_ref.dtype)


def _tiles(rows: int, cols: int, sblock, cap_r: int, cap_c: int):
    """Row/column tile sizes that divide the matrix and nest inside the scale blocks."""
    br, bc = sblock
    return block(br if br > 1 else rows, cap_r), block(bc, cap_c)


@functools.partial(jax.jit, static_argnames=("limit", "interpret", "blocks", "num_warps"))
def experts_decode(x, idx, w, p: dict, *, limit: float, interpret: bool = True,
                   blocks: tuple[int, int, int, int] = (16, 256, 16, 256), num_warps: int = 4):
    """x [T,D], idx int [T,k], w f32 [T,k], p {"w1" [E,I,D], "w2" [E,D,I], "w3" [E,I,D]} (+ "*_scale")
    -> [T,D] in x.dtype. blocks = (gate/up rows bI, gate/up cols bD, down rows bD, down cols bI) caps."""
    T, D = x.shape
    k = idx.shape[1]
    E, I, _ = p["w1"].shape
    quantized = quant.is_quantized(p)
    s_up = quant.scale_block(p["w1"].shape, p["w1_scale"].shape) if quantized else (1, D)
    s_dn = quant.scale_block(p["w2"].shape, p["w2_scale"].shape) if quantized else (1, I)
    ids = idx.reshape(-1).astype(jnp.int32)
    A = T * k
    whole = pl.BlockSpec()
    cp = compiler_params(num_warps)

    bI, bD = _tiles(I, D, s_up, blocks[0], blocks[1])
    up_args = [ids, x, p["w1"], p["w3"]] + ([p["w1_scale"], p["w3_scale"]] if quantized else [])
    h = pl.pallas_call(
        functools.partial(_gate_up_kernel, bI=bI, bD=bD, nD=D // bD, limit=limit, sblock=s_up,
                          quantized=quantized),
        grid=(A, I // bI),
        in_specs=[whole, pl.BlockSpec((1, D), lambda a, i: (a // k, 0))] + [whole] * (len(up_args) - 2),
        out_specs=pl.BlockSpec((1, bI), lambda a, i: (a, i)),
        out_shape=jax.ShapeDtypeStruct((A, I), x.dtype), compiler_params=cp, interpret=interpret)(*up_args)

    bD2, bI2 = _tiles(D, I, s_dn, blocks[2], blocks[3])
    dn_args = [ids, w.reshape(-1).astype(jnp.float32), h, p["w2"]] + ([p["w2_scale"]] if quantized else [])
    return pl.pallas_call(
        functools.partial(_down_kernel, k=k, bD=bD2, bI=bI2, nI=I // bI2, sblock=s_dn, quantized=quantized),
        grid=(T, D // bD2),
        in_specs=[whole] * len(dn_args),
        out_specs=pl.BlockSpec((1, bD2), lambda t, d: (t, d)),
        out_shape=jax.ShapeDtypeStruct((T, D), x.dtype), compiler_params=cp, interpret=interpret)(*dn_args)

