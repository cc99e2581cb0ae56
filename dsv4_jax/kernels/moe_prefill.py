"""MoE experts for prefill / verify (many tokens): grouped matmul over expert-pure row tiles.

Alignment (plain jnp, like vLLM's moe_align_block_size): the T·k assignments are sorted by expert and each
expert's group is padded to a multiple of bM rows, so every bM-row tile belongs to one expert. The padded
row count has the static bound M = round_up(T·k + min(E, T·k)·(bM − 1), bM); tiles past the used ones
are skipped inside the kernel (`pl.when`), empty experts get no tile at all.

Kernels (grid (M/bM, N/bN), expert id read from a per-tile int32 ref, weights indexed in-kernel):
1. gate/up: h = silu(min(X W1ᵀ, L)) ⊙ clip(X W3ᵀ, −L, L) for one row tile × one I tile
2. down:    Y = H W2ᵀ
Combine (jnp): y[t] = Σ_j w[t,j] · Y[row of (t, j)], a gather (no scatter-add).
Weights are dense or `ops.quant.QArray`s; a quantized tile is decoded in the kernel to the activations' dtype
(exact for e4m3 / e2m1 / int8 codes) and its block scale applied to the tile's f32 product.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ..ops.moe import align, padded_rows, swiglu  # noqa: F401  (align: the tile layout, shared with ops.moe)
from .common import compiler_params
from .moe_decode import Tile, Tiling, Weight, _row_scale, _same_format, _split, load_tile, tiles, weight_operands


def _mm_tile(a, wt: Weight, t: Tile):
    """a [bM, nc] · (the tile of W)ᵀ -> f32 [bM, nr] (codes decoded to a's dtype, scaled after: e4m3 / e2m1 /
    int8 values are exact in bfloat16)."""
    if wt.fmt is None:
        b = wt.ref[t.e, pl.ds(t.r0, t.nr), pl.ds(t.c0, t.nc)]
        b = b if b.dtype == a.dtype else b.astype(a.dtype)
    else:
        b = load_tile(wt, t).astype(a.dtype)
    prec = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    out = jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=prec,
                              preferred_element_type=jnp.float32)
    if wt.fmt is not None:
        out = out * _row_scale(wt, t)
    return out


def _gate_up_kernel(te_ref, nu_ref, x_ref, *refs, bM: int, t: Tiling):
    (w1, w3), (h_ref,) = _split(refs, t.fmts, t.sblock)
    m = pl.program_id(0)
    n0 = pl.program_id(1) * t.rows

    @pl.when(m < nu_ref[0])
    def _():
        e = te_ref[m]

        def body(c, acc):
            g, u = acc
            d0 = pl.multiple_of(c * t.cols, t.cols)
            a = x_ref[:, pl.ds(d0, t.cols)]
            tile = Tile(e, n0, t.rows, d0, t.cols)
            return g + _mm_tile(a, w1, tile), u + _mm_tile(a, w3, tile)

        zero = jnp.zeros((bM, t.rows), jnp.float32)
        g, u = jax.lax.fori_loop(0, t.n_cols, body, (zero, zero))
        h_ref[...] = swiglu(g, u, t.limit).astype(h_ref.dtype)


def _down_kernel(te_ref, nu_ref, h_ref, *refs, bM: int, t: Tiling):
    (w2,), (y_ref,) = _split(refs, t.fmts, t.sblock)
    m = pl.program_id(0)
    n0 = pl.program_id(1) * t.rows

    @pl.when(m < nu_ref[0])
    def _():
        e = te_ref[m]

        def body(c, acc):
            i0 = pl.multiple_of(c * t.cols, t.cols)
            return acc + _mm_tile(h_ref[:, pl.ds(i0, t.cols)], w2, Tile(e, n0, t.rows, i0, t.cols))

        y_ref[...] = jax.lax.fori_loop(0, t.n_cols, body, jnp.zeros((bM, t.rows), jnp.float32)).astype(y_ref.dtype)


@functools.partial(jax.jit, static_argnames=("limit", "interpret", "blocks"))
def experts_prefill(x, idx, w, p: dict, *, limit: float, interpret: bool = True,
                    blocks: tuple[int, int, int] = (16, 64, 64)):
    """x [T,D], idx int [T,k], w f32 [T,k], p {"w1" [E,I,D], "w2" [E,D,I], "w3" [E,I,D]}, each dense or an
    `ops.quant.QArray` (tiles dequantized in the kernel) -> [T,D] in x.dtype.
    blocks = (bM rows per tile, bN output-column cap, bK contraction cap)."""
    T, D = x.shape
    k = idx.shape[1]
    E, I, _ = p["w1"].shape
    bM = blocks[0]
    up1, up3, dn = weight_operands(p["w1"]), weight_operands(p["w3"]), weight_operands(p["w2"])
    _same_format(up1, up3, "w1 and w3")
    row_token, dest, tile_expert, n_used = align(idx, E, bM)
    M = row_token.shape[0]
    xs = x[row_token]                                                  # [M, D]
    whole = pl.BlockSpec()
    cp = compiler_params()

    fmts = (up1[1], up3[1])
    bN, bD = tiles(I, D, up1[2], blocks[1], blocks[2], up1[1].pack if up1[1] is not None else 1)
    up_args = [tile_expert, n_used, xs] + up1[0] + up3[0]
    h = pl.pallas_call(
        functools.partial(_gate_up_kernel, bM=bM, t=Tiling(bN, bD, D // bD, fmts, up1[2], limit)),
        grid=(M // bM, I // bN),
        in_specs=[whole, whole, pl.BlockSpec((bM, D), lambda m, n: (m, 0))] + [whole] * (len(up_args) - 3),
        out_specs=pl.BlockSpec((bM, bN), lambda m, n: (m, n)),
        out_shape=jax.ShapeDtypeStruct((M, I), x.dtype), compiler_params=cp, interpret=interpret)(*up_args)

    bN2, bI = tiles(D, I, dn[2], blocks[1], blocks[2], dn[1].pack if dn[1] is not None else 1)
    dn_args = [tile_expert, n_used, h] + dn[0]
    ys = pl.pallas_call(
        functools.partial(_down_kernel, bM=bM, t=Tiling(bN2, bI, I // bI, (dn[1],), dn[2])),
        grid=(M // bM, D // bN2),
        in_specs=[whole, whole, pl.BlockSpec((bM, I), lambda m, n: (m, 0))] + [whole] * (len(dn_args) - 3),
        out_specs=pl.BlockSpec((bM, bN2), lambda m, n: (m, n)),
        out_shape=jax.ShapeDtypeStruct((M, D), x.dtype), compiler_params=cp, interpret=interpret)(*dn_args)
    rows = ys[dest].reshape(T, k, D).astype(jnp.float32)
    return jnp.einsum("tkd,tk->td", rows, w.astype(jnp.float32)).astype(x.dtype)
