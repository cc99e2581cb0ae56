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
from .moe_decode import _row_scale, _same_format, _split, load_tile, tiles, weight_operands


def _mm_tile(a, w_ref, s_ref, fmt, e, n0, nn, c0, nc, sblock):
    """a [bM, nc] · W[e, n0:n0+nn, c0:c0+nc]ᵀ -> f32 [bM, nn] (codes decoded to a's dtype, scaled after:
    e4m3 / e2m1 / int8 values are exact in bfloat16)."""
    if fmt is None:
        b = w_ref[e, pl.ds(n0, nn), pl.ds(c0, nc)]
        b = b if b.dtype == a.dtype else b.astype(a.dtype)
    else:
        b = load_tile(w_ref, fmt, e, n0, nn, c0, nc).astype(a.dtype)
    prec = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    out = jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=prec,
                              preferred_element_type=jnp.float32)
    if fmt is not None:
        out = out * _row_scale(s_ref, fmt, e, n0, nn, c0, *sblock)
    return out


def _gate_up_kernel(te_ref, nu_ref, x_ref, *refs, bM, bN, bD, nD, limit, sblock, fmts):
    ((w1_ref, s1_ref), (w3_ref, s3_ref)), (h_ref,) = _split(refs, fmts)
    m = pl.program_id(0)
    n0 = pl.program_id(1) * bN

    @pl.when(m < nu_ref[0])
    def _():
        e = te_ref[m]

        def body(c, acc):
            g, u = acc
            d0 = pl.multiple_of(c * bD, bD)
            a = x_ref[:, pl.ds(d0, bD)]
            g = g + _mm_tile(a, w1_ref, s1_ref, fmts[0], e, n0, bN, d0, bD, sblock)
            u = u + _mm_tile(a, w3_ref, s3_ref, fmts[1], e, n0, bN, d0, bD, sblock)
            return g, u

        zero = jnp.zeros((bM, bN), jnp.float32)
        g, u = jax.lax.fori_loop(0, nD, body, (zero, zero))
        h_ref[...] = swiglu(g, u, limit).astype(h_ref.dtype)


def _down_kernel(te_ref, nu_ref, h_ref, *refs, bM, bN, bI, nI, sblock, fmts):
    ((w2_ref, s2_ref),), (y_ref,) = _split(refs, fmts)
    m = pl.program_id(0)
    n0 = pl.program_id(1) * bN

    @pl.when(m < nu_ref[0])
    def _():
        e = te_ref[m]

        def body(c, acc):
            i0 = pl.multiple_of(c * bI, bI)
            return acc + _mm_tile(h_ref[:, pl.ds(i0, bI)], w2_ref, s2_ref, fmts[0], e, n0, bN, i0, bI, sblock)

        y_ref[...] = jax.lax.fori_loop(0, nI, body, jnp.zeros((bM, bN), jnp.float32)).astype(y_ref.dtype)


@functools.partial(jax.jit, static_argnames=("limit", "interpret", "blocks", "num_warps"))
def experts_prefill(x, idx, w, p: dict, *, limit: float, interpret: bool = True,
                    blocks: tuple[int, int, int] = (16, 64, 64), num_warps: int = 4):
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
    cp = compiler_params(num_warps)

    fmts = (up1[1], up3[1])
    bN, bD = tiles(I, D, up1[2], blocks[1], blocks[2], up1[1].pack if up1[1] is not None else 1)
    up_args = [tile_expert, n_used, xs] + up1[0] + up3[0]
    h = pl.pallas_call(
        functools.partial(_gate_up_kernel, bM=bM, bN=bN, bD=bD, nD=D // bD, limit=limit, sblock=up1[2],
                          fmts=fmts),
        grid=(M // bM, I // bN),
        in_specs=[whole, whole, pl.BlockSpec((bM, D), lambda m, n: (m, 0))] + [whole] * (len(up_args) - 3),
        out_specs=pl.BlockSpec((bM, bN), lambda m, n: (m, n)),
        out_shape=jax.ShapeDtypeStruct((M, I), x.dtype), compiler_params=cp, interpret=interpret)(*up_args)

    bN2, bI = tiles(D, I, dn[2], blocks[1], blocks[2], dn[1].pack if dn[1] is not None else 1)
    dn_args = [tile_expert, n_used, h] + dn[0]
    ys = pl.pallas_call(
        functools.partial(_down_kernel, bM=bM, bN=bN2, bI=bI, nI=I // bI, sblock=dn[2], fmts=(dn[1],)),
        grid=(M // bM, D // bN2),
        in_specs=[whole, whole, pl.BlockSpec((bM, I), lambda m, n: (m, 0))] + [whole] * (len(dn_args) - 3),
        out_specs=pl.BlockSpec((bM, bN2), lambda m, n: (m, n)),
        out_shape=jax.ShapeDtypeStruct((M, D), x.dtype), compiler_params=cp, interpret=interpret)(*dn_args)
    rows = ys[dest].reshape(T, k, D).astype(jnp.float32)
    return jnp.einsum("tkd,tk->td", rows, w.astype(jnp.float32)).astype(x.dtype)
