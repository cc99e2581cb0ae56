"""Lightning-indexer scores as a Pallas TPU (Mosaic) kernel (docs/model_math.md §2.7; math: `ops.indexer`).

score(p, w) = Σ_h ω_h · ReLU(q_h · K_w) · dI^-0.5, −inf unless w < ⌊(p+1)/m⌋ and w < n_rows[b] —
the contract of `kernels.lightning_indexer.scores` (GPU) and `ops.indexer.scores` + `validity`.

Kernel: grid (B, S/bS, T/bT). A program scores one key tile [bT, dI] against bS queries in one MXU dot
([bS·H, dI] × [dI, bT], bf16 operands, f32 accumulation), then ReLU, the ω-weighted head sum and the
mask. The per-query row limit min(⌊(p+1)/m⌋, n_rows[b], T) is computed outside (an int per query), and
its maximum per query block is scalar-prefetched: key tiles past it are neither computed (−inf written)
nor read (the key BlockSpec's index is clamped to the last useful tile, so a long, mostly empty cache
costs only its filled rows).

Selection: exact top-k outside the kernel, `ops.indexer.topk` (`lax.top_k`, value desc, lower row index
first on ties; two-stage for long rows). Not fused because `lax.top_k` has no Mosaic lowering, and an
in-kernel top-k by k rounds of max-and-mask costs k·T vector passes per query (512 × 256K rows at 1M
context), far above the score matmul; `lax.approx_max_k(recall_target=1.0)` is what tpu-inference uses,
but its tie order and exactness on TPU are not documented, so it is not used.

Equality with the reference: float32 reassociation only (the head sum and dI^-0.5 folded into ω); rows
whose heads are all ReLU-dead score exactly +0.0 on both paths.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import tpu_common as tc


def row_limits(B: int, S: int, T: int, positions=None, n_rows=None, ratio: int = 1) -> jax.Array:
    """Visible rows per query: min(⌊(p+1)/m⌋, n_rows[b], T) -> int32 [B, S]."""
    lim = jnp.full((B, S), T, jnp.int32)
    if positions is not None:
        lim = jnp.minimum(lim, (positions.astype(jnp.int32) + 1) // ratio)
    if n_rows is not None:
        lim = jnp.minimum(lim, jnp.broadcast_to(jnp.asarray(n_rows, jnp.int32), (B,))[:, None])
    return jnp.maximum(lim, 0)


def _score_kernel(blim_ref, q_ref, k_ref, om_ref, lim_ref, o_ref, *, bT):
    b, s, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    t0 = t * bT

    @pl.when(t0 < blim_ref[b, s])
    def _():
        q = q_ref[...]                                                   # [bS, H, dI]
        bS, H, dI = q.shape
        keys = k_ref[...].astype(q.dtype)                                # [bT, dI]
        prec = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
        dots = jax.lax.dot_general(q.reshape(bS * H, dI), keys, (((1,), (1,)), ((), ())), precision=prec,
                                   preferred_element_type=jnp.float32)   # [bS·H, bT]
        dots = jnp.maximum(dots, 0.0).reshape(bS, H, bT) * om_ref[...]   # ω [bS, H, 1] (× dI^-0.5)
        sc = jnp.sum(dots, axis=1) + 0.0                                 # [bS, bT]; + 0.0: −0.0 -> +0.0
        rows = t0 + jax.lax.broadcasted_iota(jnp.int32, (bS, bT), 1)
        o_ref[...] = jnp.where(rows < lim_ref[...], sc, -jnp.inf)        # limits [bS, 1]

    @pl.when(t0 >= blim_ref[b, s])
    def _():
        o_ref[...] = jnp.full(o_ref.shape, -jnp.inf, o_ref.dtype)


QUERY_BLOCK = 64                       # queries per program at most (a key tile is read once per block)
SCORE_TILE_BYTES = 4 * 1024 * 1024     # f32 head scores [bS·H, bT] one program holds
MIN_KEY_TILE, MAX_KEY_TILE = 256, 8192


def tiles(S: int, T: int, H: int, blocks: tuple[int, int] | None = None) -> tuple[int, int]:
    """(bS, bT): as many queries as fit SCORE_TILE_BYTES with MIN_KEY_TILE keys (≤ QUERY_BLOCK; keys are
    re-read once per query block), then the largest power-of-two key tile ≤ MAX_KEY_TILE that fits — long
    key tiles for decode, where the grid is T/bT steps per batch row."""
    if blocks is not None:
        bS, bT = blocks
    else:
        bS = max(1, min(S, QUERY_BLOCK, SCORE_TILE_BYTES // (H * MIN_KEY_TILE * 4)))
        bT = MIN_KEY_TILE
        while bT * 2 <= MAX_KEY_TILE and bS * H * bT * 2 * 4 <= SCORE_TILE_BYTES:
            bT *= 2
    bS = S if S <= bS else max(8, bS // 8 * 8)
    return bS, (T if T <= bT else bT)


def plan(q, keys, *, blocks: tuple[int, int] | None = None):
    """(grid, operands, output operand, bS, S_pad) of the scores kernel for q [B,S,H,dI] and keys [B,T,dI]
    (arrays or ShapeDtypeStructs: their shapes and dtypes)."""
    (B, S, H, dI), T = q.shape, keys.shape[1]
    q_dtype, k_dtype = q.dtype, keys.dtype
    bS, bT = tiles(S, T, H, blocks)
    s_pad = tc.round_up(S, bS)
    nT = pl.cdiv(T, bT)

    def key_tile(b, s, t, blim):          # clamp to the last tile holding a visible row: no copy past it
        last = tc.imax((blim[b, s] + bT - 1) // bT - 1, 0)
        return b, tc.imin(t, last), 0

    ins = [tc.Operand("q", (B, s_pad, H, dI), q_dtype, (None, bS, H, dI), lambda b, s, t, bl: (b, s, 0, 0)),
           tc.Operand("keys", (B, T, dI), k_dtype, (None, bT, dI), key_tile),
           tc.Operand("omega", (B, s_pad, H, 1), jnp.float32, (None, bS, H, 1), lambda b, s, t, bl: (b, s, 0, 0)),
           tc.Operand("limits", (B, s_pad, 1), jnp.int32, (None, bS, 1), lambda b, s, t, bl: (b, s, 0))]
    out = tc.Operand("scores", (B, s_pad, T), jnp.float32, (None, bS, bT), lambda b, s, t, bl: (b, s, t))
    return (B, s_pad // bS, nT), ins, out, bS, s_pad


@functools.partial(jax.jit, static_argnames=("ratio", "interpret", "blocks"))
def scores(q, keys, omega, positions=None, n_rows=None, *, ratio: int = 1, interpret: bool = False,
           blocks: tuple[int, int] | None = None):
    """q [B,S,H,dI], keys [B,T,dI], omega f32 [B,S,H] (already × H^-0.5), positions int [B,S] | None,
    n_rows int [B] | None -> f32 [B,S,T]: scores, −inf where invalid. blocks = (bS queries, bT key rows),
    default `tiles`."""
    B, S, H, dI = q.shape
    T = keys.shape[1]
    grid, ins, out, bS, s_pad = plan(q, keys, blocks=blocks)
    lim = row_limits(B, S, T, positions, n_rows, ratio)
    pad = ((0, 0), (0, s_pad - S))
    lim = jnp.pad(lim, pad)                                              # padded queries see no rows
    blim = jnp.max(lim.reshape(B, s_pad // bS, bS), axis=-1)
    om = omega.astype(jnp.float32) * dI ** -0.5
    args = [jnp.pad(q, pad + ((0, 0), (0, 0))), keys, jnp.pad(om, pad + ((0, 0),))[..., None], lim[..., None]]
    cost = tc.cost_estimate(grid, ins + [out], [np.full(grid[:2], T, np.int32)],          # every row visible
                            flops=2 * B * s_pad * H * dI * T)
    sc = pl.pallas_call(
        functools.partial(_score_kernel, bT=out.block[2]),
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=grid, in_specs=[o.spec for o in ins],
                                               out_specs=out.spec),
        out_shape=jax.ShapeDtypeStruct(out.shape, out.dtype),
        compiler_params=tc.compiler_params(("parallel", "parallel", "arbitrary")),
        interpret=tc.interpret_params(interpret), cost_estimate=cost, name="indexer_scores_tpu")(blim, *args)
    return sc[:, :S]


def traffic(q, keys, positions=None, n_rows=None, ratio: int = 1,
            blocks: tuple[int, int] | None = None) -> dict[str, int]:
    """Bytes the kernel's BlockSpecs move for concrete positions / n_rows (see tpu_common.traffic); q, keys as
    `plan` takes them."""
    grid, ins, out, bS, s_pad = plan(q, keys, blocks=blocks)
    (B, S, _, _), T = q.shape, keys.shape[1]
    lim = jnp.pad(row_limits(B, S, T, positions, n_rows, ratio), ((0, 0), (0, s_pad - S)))
    blim = np.asarray(jnp.max(lim.reshape(B, s_pad // bS, bS), axis=-1))
    return tc.traffic(grid, ins + [out], [blim])
