"""MoE experts for prefill / verify (many tokens): grouped matmul over expert-pure row tiles.

Alignment (plain jnp, like vLLM's moe_align_block_size): the T·k assignments are sorted by expert and each
expert's group is padded to a multiple of bM rows, so every bM-row tile belongs to one expert. The padded
row count has the static bound M = round_up(T·k + min(E, T·k)·(bM − 1), bM); tiles past the used ones
are skipped inside the kernel (`pl.when`), empty experts get no tile at all.

Kernels (grid (M/bM, N/bN), expert id read from a per-tile int32 ref, weights indexed in-kernel):
1. gate/up: h = silu(min(X W1ᵀ, L)) ⊙ clip(X W3ᵀ, −L, L) for one row tile × one I tile
2. down:    Y = H W2ᵀ
Combine (jnp): y[t] = Σ_j w[t,j] · Y[row of (t, j)], a gather (no scatter-add).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ..ops import quant
from ..ops.moe import swiglu
from .common import block, compiler_params
from .moe_decode import _row_scale, _tiles


def padded_rows(n_assign: int, n_experts: int, bM: int) -> int:
    """Static upper bound of the padded row count."""
    m = n_assign + min(n_experts, n_assign) * (bM - 1)
    return -(-m // bM) * bM


def align(idx: jax.Array, n_experts: int, bM: int):
    """idx int [T,k] -> (row_token int32 [M], dest int32 [T·k], tile_expert int32 [M/bM], n_used int32 [1]).

    dest[a] is the padded row of assignment a = t·k + j; row_token[r] the token feeding row r (0 for pad).
    """
    T, k = idx.shape
    A = T * k
    M = padded_rows(A, n_experts, bM)
    flat = idx.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
    padded = (sizes + bM - 1) // bM * bM
    start, pstart = jnp.cumsum(sizes) - sizes, jnp.cumsum(padded) - padded
    e_sorted = flat[order]
    dest_sorted = pstart[e_sorted] + jnp.arange(A, dtype=jnp.int32) - start[e_sorted]
    dest = jnp.zeros((A,), jnp.int32).at[order].set(dest_sorted)
    row_token = jnp.zeros((M,), jnp.int32).at[dest].set(jnp.arange(A, dtype=jnp.int32) // k)
    tile_expert = jnp.searchsorted(jnp.cumsum(padded), jnp.arange(M // bM) * bM, side="right")
    tile_expert = jnp.minimum(tile_expert, n_experts - 1).astype(jnp.int32)
    n_used = (jnp.sum(padded) // bM).astype(jnp.int32)[None]
    return row_token, dest, tile_expert, n_used


def _mm_tile(a, w_ref, s_ref, e, n0, nn, c0, nc, sblock):
    """a [bM, nc] · W[e, n0:n0+nn, c0:c0+nc]ᵀ -> f32 [bM, nn] (codes cast to a's dtype, scaled after)."""
    b = w_ref[e, pl.ds(n0, nn), pl.ds(c0, nc)]
    if s_ref is not None or b.dtype != a.dtype:
        b = b.astype(a.dtype)
    prec = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    out = jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=prec,
                              preferred_element_type=jnp.float32)
    if s_ref is not None:
        out = out * _row_scale(s_ref, e, n0, nn, c0, *sblock)
    return out


def _gate_up_kernel(te_ref, nu_ref, x_ref, w1_ref, w3_ref, *rest, bM, bN, bD, nD, limit, sblock, quantized):
    s1_ref, s3_ref, h_ref = rest if quantized else (None, None, rest[0])
    m = pl.program_id(0)
    n0 = pl.program_id(1) * bN

    @pl.when(m < nu_ref[0])
    def _():
        e = te_ref[m]

        def body(c, acc):
            g, u = acc
            d0 = pl.multiple_of(c * bD, bD)
            a = x_ref[:, pl.ds(d0, bD)]
            g = g + _mm_tile(a, w1_ref, s1_ref, e, n0, bN, d0, bD, sblock)
            u = u + _mm_tile(a, w3_ref, s3_ref, e, n0, bN, d0, bD, sblock)
            return g, u

        zero = jnp.zeros((bM, bN), jnp.float32)
        g, u = jax.lax.fori_loop(0, nD, body, (zero, zero))
        h_ref[...] = swiglu(g, u, limit).astype(h_ref.dtype)


def _down_kernel(te_ref, nu_ref, h_ref, w2_ref, *rest, bM, bN, bI, nI, sblock, quantized):
    s2_ref, y_ref = rest if quantized else (None, rest[0])
    m = pl.program_id(0)
    n0 = pl.program_id(1) * bN

    @pl.when(m < nu_ref[0])
    def _():
        e = te_ref[m]

        def body(c, acc):
            i0 = pl.multiple_of(c * bI, bI)
            return acc + _mm_tile(h_ref[:, pl.ds(i0, bI)], w2_ref, s2_ref, e, n0, bN, i0, bI, sblock)

        y_ref[...] = jax.lax.fori_loop(0, nI, body, jnp.zeros((bM, bN), jnp.float32)).astype(y_ref.dtype)


@functools.partial(jax.jit, static_argnames=("limit", "interpret", "blocks", "num_warps"))
def experts_prefill(x, idx, w, p: dict, *, limit: float, interpret: bool = True,
                    blocks: tuple[int, int, int] = (16, 64, 64), num_warps: int = 4):
    """x [T,D], idx int [T,k], w f32 [T,k], p {"w1" [E,I,D], "w2" [E,D,I], "w3" [E,I,D]} (+ "*_scale")
    -> [T,D] in x.dtype. blocks = (bM rows per tile, bN output-column cap, bK contraction cap)."""
    T, D = x.shape
    k = idx.shape[1]
    E, I, _ = p["w1"].shape
    bM = blocks[0]
    quantized = quant.is_quantized(p)
    s_up = quant.scale_block(p["w1"].shape, p["w1_scale"].shape) if quantized else (1, D)
    s_dn = quant.scale_block(p["w2"].shape, p["w2_scale"].shape) if quantized else (1, I)
    row_token, dest, tile_expert, n_used = align(idx, E, bM)
    M = row_token.shape[0]
    xs = x[row_token]                                                  # [M, D]
    whole = pl.BlockSpec()
    cp = compiler_params(num_warps)

    bN, bD = _tiles(I, D, s_up, blocks[1], blocks[2])
    up_args = [tile_expert, n_used, xs, p["w1"], p["w3"]] + ([p["w1_scale"], p["w3_scale"]] if quantized else [])
    h = pl.pallas_call(
        functools.partial(_gate_up_kernel, bM=bM, bN=bN, bD=bD, nD=D // bD, limit=limit, sblock=s_up,
                          quantized=quantized),
        grid=(M // bM, I // bN),
        in_specs=[whole, whole, pl.BlockSpec((bM, D), lambda m, n: (m, 0))] + [whole] * (len(up_args) - 3),
        out_specs=pl.BlockSpec((bM, bN), lambda m, n: (m, n)),
        out_shape=jax.ShapeDtypeStruct((M, I), x.dtype), compiler_params=cp, interpret=interpret)(*up_args)

    bN2, bI = _tiles(D, I, s_dn, blocks[1], blocks[2])
    dn_args = [tile_expert, n_used, h, p["w2"]] + ([p["w2_scale"]] if quantized else [])
    ys = pl.pallas_call(
        functools.partial(_down_kernel, bM=bM, bN=bN2, bI=bI, nI=I // bI, sblock=s_dn, quantized=quantized),
        grid=(M // bM, D // bN2),
        in_specs=[whole, whole, pl.BlockSpec((bM, I), lambda m, n: (m, 0))] + [whole] * (len(dn_args) - 3),
        out_specs=pl.BlockSpec((bM, bN2), lambda m, n: (m, n)),
        out_shape=jax.ShapeDtypeStruct((M, D), x.dtype), compiler_params=cp, interpret=interpret)(*dn_args)
    rows = ys[dest].reshape(T, k, D).astype(jnp.float32)
    return jnp.einsum("tkd,tk->td", rows, w.astype(jnp.float32)).astype(x.dtype)

