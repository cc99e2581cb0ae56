"""MoE routed experts as Pallas TPU (Mosaic) kernels: decode over the active experts, grouped prefill.

Contract (as `kernels.moe_decode.experts_decode` / `kernels.moe_prefill.experts_prefill` and the references
`ops.moe.experts_gather` / `experts_sorted`): x [T, D], idx int [T, k], w f32 [T, k], expert weights
w1 / w3 [E, I, D] and w2 [E, D, I] in one of the formats of `tpu_common` (the codes (w1, w2, w3) and their scales
as two tuples; the format, the SwiGLU limit and the tiling static in one `Spec`), y[t] = Σ_j w[t,j] · W2[e] swiglu(W1[e] x[t], W3[e] x[t]) with e = idx[t, j] -> [T, D] in x.dtype.

Decode (`experts_decode`, few tokens): one fused kernel. The distinct experts of the T·k assignments are
sorted into U = min(E, T·k) slots; their ids are scalar-prefetched (`PrefetchScalarGridSpec`) and read by
the BlockSpec index maps, so only the active experts' weight tiles are DMA'd (slots past the active count
repeat the last block index: no copy, no compute). Grid (P, U, I/(P·bI)): for an I-tile of one expert,
gate / up for all T tokens, SwiGLU with the clamps, times each token's routing weight for that expert
(0 if not routed), then the down projection accumulates into y [T, D] in VMEM — h never goes to HBM.
The P = 2 leading "parallel" axis splits I between the two TensorCores of a v5p chip (partial sums).

Prefill / verify (`experts_prefill`, many tokens): megablox-style grouped matmul, dropless. Assignments
are sorted by expert and each group padded to a multiple of bM rows (`moe_prefill.align`), so every row
tile is one expert's; the per-tile expert id is scalar-prefetched. Kernel 1: h = swiglu(Xs W1ᵀ, Xs W3ᵀ)
per (row tile, I tile); kernel 2: Ys = H W2ᵀ per (row tile, D tile); y[t] = Σ_j w[t,j] Ys[row of (t,j)].
Tiles past the used ones read nothing new (clamped block index) and write to a spare tile.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..ops import quant
from ..ops.moe import swiglu
from . import tpu_common as tc
from .moe_prefill import align

# Token counts up to this use the decode kernel under the "pallas_tpu" moe backend (`model.moe`): it computes
# every token against every active expert (at most T·k of them), cheap while T is a verify block or less.
DECODE_MAX_TOKENS = 16
DOWN_ROW_CHUNK = 512     # rows of W2 dequantized at a time in the decode kernel
PREFILL_BLOCK_N = (256, 512)   # output-column tiles of the grouped kernels: (I of gate/up, D of down)


class Prepared(NamedTuple):
    """The three expert stacks as the kernels read them: codes (w1, w3, w2), their scales (s1, s3, s2; None
    when dense) and the `tpu_common.MatFormat` of gate / up and of down."""

    weights: tuple
    scales: tuple
    up: tc.MatFormat
    down: tc.MatFormat


@dataclasses.dataclass(frozen=True)
class Spec:
    """Static choices of one Mosaic MoE call: the SwiGLU limit, the experts' storage format (`tpu_common`
    table; FP4 codes are [.., K/2] bytes) and scale block (optional, checked), interpret mode, and the tiling:
    block_i the decode kernel's I-tile, splits its parallel split of I (v5p's 2 cores); block_m the grouped
    kernels' rows per tile (default `row_tile`), block_n their output-column tiles (I of gate/up, D of down)."""

    limit: float
    fmt: str = "dense"
    block: tuple | None = None
    interpret: bool = False
    block_i: int = 256
    splits: int = 2
    block_m: int | None = None
    block_n: tuple[int, int] = PREFILL_BLOCK_N


def prepare_experts(w1, w2, w3, scales=(None, None, None), fmt: str = "dense", block=None) -> Prepared:
    """Validate and lay out the three expert stacks: -> `Prepared` ((w1, w3, w2) codes, (s1, s3, s2), up, down)."""
    if w1.shape != w3.shape or w1.dtype != w3.dtype:
        raise tc.FormatError(f"w1 {w1.shape} {w1.dtype} and w3 {w3.shape} {w3.dtype} differ")
    c1, s1, up = tc.prepare("w1", w1, scales[0], fmt, block)
    c3, s3, _ = tc.prepare("w3", w3, scales[2], fmt, block)
    c2, s2, down = tc.prepare("w2", w2, scales[1], fmt, block)
    E, I, D = w1.shape[0], up.rows, up.cols
    if w2.shape[0] != E or (down.rows, down.cols) != (D, I):
        raise tc.FormatError(f"w2 must be [E, D, I] = {(E, D, I)} (logical), got {w2.shape} for format {fmt}")
    return Prepared((c1, c3, c2), (s1, s3, s2), up, down)


def abstract_experts(w1, w2, w3, scales, fmt: str, block=None) -> Prepared:
    """`prepare_experts` on ShapeDtypeStructs (for plans and traffic without arrays)."""
    box = {}

    def f(*a):
        weights, sc, box["up"], box["down"] = prepare_experts(*a[:3], a[3:], fmt, block)
        return weights, sc
    weights, sc = jax.eval_shape(f, w1, w2, w3, *scales)
    return Prepared(weights, sc, box["up"], box["down"])


def _scaled_inputs(names, arrays, fmts, tile_rows, rows_index, expert_index):
    """Operands of the scale arrays that exist (None for dense)."""
    return [tc.scale_operand(n, a, mf, r, ri, expert_index)
            for n, a, mf, r, ri in zip(names, arrays, fmts, tile_rows, rows_index) if a is not None]


# ---- decode ----


def decode_slots(idx: jax.Array, w: jax.Array, n_experts: int, t_pad: int):
    """The distinct experts of idx [T, k] in slots: (slot_expert int32 [U], n_active int32 [1],
    slot_weight f32 [U, t_pad, 1] = Σ_j w[t, j]·[idx[t, j] = slot's expert]), U = min(E, T·k)."""
    T, k = idx.shape
    U = min(n_experts, T * k)
    flat = idx.reshape(-1).astype(jnp.int32)
    experts = jnp.unique(flat, size=U, fill_value=jnp.max(flat))
    n_active = jnp.sum(jnp.sort(flat)[1:] != jnp.sort(flat)[:-1]).astype(jnp.int32) + 1
    used = jnp.arange(U) < n_active
    hit = (idx[None, :, :] == experts[:, None, None]) & used[:, None, None]     # [U, T, k]
    sw = jnp.sum(jnp.where(hit, w[None].astype(jnp.float32), 0.0), axis=-1)     # [U, T]
    sw = jnp.pad(sw, ((0, 0), (0, t_pad - T)))
    return experts.astype(jnp.int32), n_active[None], sw[:, :, None]


class DecodeTiling(NamedTuple):
    """Static layout of the decode kernel: the formats of gate / up and down, the I-tile bI and the I-tiles
    per parallel split."""

    up: tc.MatFormat
    down: tc.MatFormat
    bI: int
    n_split_tiles: int


def _decode_kernel(se_ref, na_ref, x_ref, sw_ref, *refs, t: DecodeTiling, limit: float):
    (w1_ref, w3_ref, w2_ref), (*s_refs, y_ref) = refs[:3], refs[3:]
    s1_ref, s3_ref, s2_ref = s_refs if s_refs else (None, None, None)
    up, down, bI = t.up, t.down, t.bI
    p, u, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    i_tile = p * t.n_split_tiles + i

    @pl.when((u == 0) & (i == 0))
    def _():
        y_ref[...] = jnp.zeros_like(y_ref)

    @pl.when(u < na_ref[0])
    def _():
        x = x_ref[...]
        kw = dict(r0=0, nr=bI, tile_row0=i_tile * bI, tile_col0=0)
        g = tc.matmul_tile(x, tc.WeightRefs(w1_ref, s1_ref, up), **kw)
        v = tc.matmul_tile(x, tc.WeightRefs(w3_ref, s3_ref, up), **kw)
        h = (swiglu(g, v, limit) * sw_ref[...]).astype(x.dtype)          # [T_pad, bI] × [T_pad, 1]
        if down.kind == "fp4":
            h = tc.split_pairs_tile(h)
        D = down.rows
        rc = down_row_chunk(down)
        for r0 in range(0, D, rc):
            y_ref[:, pl.ds(r0, rc)] += tc.matmul_tile(h, tc.WeightRefs(w2_ref, s2_ref, down), r0=r0, nr=rc,
                                                      tile_row0=0, tile_col0=i_tile * bI, pair_block=bI)


def down_row_chunk(down: tc.MatFormat) -> int:
    """Rows of W2 per dequantization step in the decode kernel (whole scale blocks)."""
    br = down.block[0] if down.kind == "block" else 1
    return tc.block(down.rows, max(DOWN_ROW_CHUNK, br))


def decode_plan(x_shape, x_dtype, idx_shape, ex: Prepared, *, block_i: int = 256, splits: int = 2):
    """(grid, operands, output operand, kernel) of the decode kernel (shared by the call and `traffic`)."""
    weights, scales, up, down = ex
    T, D = x_shape
    k = idx_shape[1]
    E, I = weights[0].shape[0], up.rows
    U = min(E, T * k)
    t_pad = tc.round_up(T, tc.sublanes(x_dtype))
    bI = min(block_i, I)
    nI = I // bI
    P = splits if nI % splits == 0 else 1
    tc.check_tiles(up, bI, D, "decode w1/w3")
    tc.check_tiles(down, D, bI, "decode w2")

    def slot(p, u, i, se, na):
        return tc.imin(u, na[0] - 1)

    def expert(*a):
        return a[3][slot(*a)]

    def i_tile(p, u, i, se, na):          # past the active slots: stay on the last block read (no copy)
        return p * (nI // P) + tc.iwhere(u < na[0], i, nI // P - 1)

    c1, c3, c2 = weights
    ins = [tc.Operand("x", (t_pad, D), x_dtype, (t_pad, D), lambda *a: (0, 0)),
           tc.Operand("slot_weight", (U, t_pad, 1), jnp.float32, (None, t_pad, 1), lambda *a: (slot(*a), 0, 0)),
           tc.Operand("w1", c1.shape, c1.dtype, (None, bI, c1.shape[2]), lambda *a: (expert(*a), i_tile(*a), 0)),
           tc.Operand("w3", c3.shape, c3.dtype, (None, bI, c3.shape[2]), lambda *a: (expert(*a), i_tile(*a), 0)),
           tc.Operand("w2", c2.shape, c2.dtype, (None, D, bI * c2.shape[2] // I),
                      lambda *a: (expert(*a), 0, i_tile(*a)))]
    ins += _scaled_inputs(("w1_scale", "w3_scale", "w2_scale"), scales, (up, up, down), (bI, bI, D),
                          (i_tile, i_tile, lambda *a: 0), expert)
    out = tc.Operand("y_partial", (P, t_pad, D), jnp.float32, (None, t_pad, D), lambda p, *a: (p, 0, 0))
    kernel = functools.partial(_decode_kernel, t=DecodeTiling(up, down, bI, nI // P))
    return (P, U, nI // P), ins, out, kernel


@functools.partial(jax.jit, static_argnames=("spec",))
def experts_decode(x, idx, w, codes, scales, spec: Spec):
    """Routed experts for few tokens (see the module docstring) -> [T, D] in x.dtype.

    x [T, D] bf16 / f32; idx int [T, k]; w f32 [T, k]; codes (w1, w2, w3): w1, w3 [E, I, D] and w2 [E, D, I]
    codes of format `Spec.fmt` with their scales (w1_scale, w2_scale, w3_scale; None when dense).
    """
    ex = prepare_experts(*codes, scales, spec.fmt, spec.block)
    weights, scales, up, down = ex
    T, D = x.shape
    grid, ins, out, kernel = decode_plan(x.shape, x.dtype, idx.shape, ex, block_i=spec.block_i, splits=spec.splits)
    t_pad = out.shape[1]
    experts, n_active, sw = decode_slots(idx, w, weights[0].shape[0], t_pad)
    xk = tc.split_pairs(x, tc.fp4_pair_block(D)) if up.kind == "fp4" else x
    xk = jnp.pad(xk, ((0, t_pad - T), (0, 0)))
    args = [xk, sw, *weights] + [s for s in scales if s is not None]
    U = grid[1]
    cost = tc.cost_estimate(grid, ins + [out], [np.arange(U), np.array([U])],      # every slot active
                            flops=6 * U * t_pad * D * up.rows, transcendentals=U * t_pad * up.rows)
    y = pl.pallas_call(
        functools.partial(kernel, limit=spec.limit),
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=2, grid=grid, in_specs=[o.spec for o in ins],
                                               out_specs=out.spec),
        out_shape=jax.ShapeDtypeStruct(out.shape, out.dtype),
        compiler_params=tc.compiler_params(("parallel", "arbitrary", "arbitrary")),
        interpret=tc.interpret_params(spec.interpret), cost_estimate=cost,
        name="moe_decode_tpu")(experts, n_active, *args)
    return jnp.sum(y, axis=0)[:T].astype(x.dtype)


# ---- prefill / verify ----


def _gate_up_kernel(te_ref, nu_ref, x_ref, *refs, up, bN, split_out, limit):
    (w1_ref, w3_ref), (*s_refs, h_ref) = refs[:2], refs[2:]
    s1_ref, s3_ref = s_refs if s_refs else (None, None)
    n, m = pl.program_id(0), pl.program_id(1)

    @pl.when(m < nu_ref[0])
    def _():
        x = x_ref[...]
        kw = dict(r0=0, nr=bN, tile_row0=n * bN, tile_col0=0)
        g = tc.matmul_tile(x, tc.WeightRefs(w1_ref, s1_ref, up), **kw)
        v = tc.matmul_tile(x, tc.WeightRefs(w3_ref, s3_ref, up), **kw)
        h = swiglu(g, v, limit).astype(h_ref.dtype)
        h_ref[...] = tc.split_pairs_tile(h) if split_out else h          # FP4 down weights: pair-split h


def _down_kernel(te_ref, nu_ref, h_ref, w2_ref, *rest, down, bN, pair_block):
    *s_refs, y_ref = rest
    s2_ref = s_refs[0] if s_refs else None
    n, m = pl.program_id(0), pl.program_id(1)

    @pl.when(m < nu_ref[0])
    def _():
        y_ref[...] = tc.matmul_tile(h_ref[...], tc.WeightRefs(w2_ref, s2_ref, down), r0=0, nr=bN,
                                    tile_row0=n * bN, tile_col0=0, pair_block=pair_block).astype(y_ref.dtype)


def prefill_plans(n_rows: int, x_dtype, ex: Prepared, *, block_m: int, block_n: tuple[int, int]):
    """The two grouped-matmul kernels' (grid, operands, output operand, kernel); n_rows = padded rows M.

    Grid (output-column tile n, row tile m), m inner: an expert's row tiles are consecutive, so each of its
    weight tiles is read once per n; the row tiles are re-read once per n.
    """
    (c1, c3, c2), scales, up, down = ex
    I, D = up.rows, up.cols
    bM = block_m
    nM = n_rows // bM
    bN1, bN2 = min(block_n[0], I), min(block_n[1], D)
    tc.check_tiles(up, bN1, D, "prefill w1/w3")
    tc.check_tiles(down, bN2, I, "prefill w2")

    def used(n, m, te, nu):
        return tc.imin(m, nu[0] - 1)

    def expert(*a):
        return a[2][used(*a)]

    def out_tile(n, m, te, nu):                      # unused tiles write to the spare tile nM
        return tc.iwhere(m < nu[0], m, nM)

    def n_tile(n, m, te, nu):
        return n

    rows_out = n_rows + bM
    ins1 = [tc.Operand("xs", (rows_out, D), x_dtype, (bM, D), lambda *a: (used(*a), 0)),
            tc.Operand("w1", c1.shape, c1.dtype, (None, bN1, c1.shape[2]), lambda *a: (expert(*a), a[0], 0)),
            tc.Operand("w3", c3.shape, c3.dtype, (None, bN1, c3.shape[2]), lambda *a: (expert(*a), a[0], 0))]
    ins1 += _scaled_inputs(("w1_scale", "w3_scale"), scales[:2], (up, up), (bN1, bN1), (n_tile, n_tile), expert)
    out1 = tc.Operand("h", (rows_out, I), x_dtype, (bM, bN1), lambda *a: (out_tile(*a), a[0]))
    ins2 = [tc.Operand("hs", (rows_out, I), x_dtype, (bM, I), lambda *a: (used(*a), 0)),
            tc.Operand("w2", c2.shape, c2.dtype, (None, bN2, c2.shape[2]), lambda *a: (expert(*a), a[0], 0))]
    ins2 += _scaled_inputs(("w2_scale",), scales[2:], (down,), (bN2,), (n_tile,), expert)
    out2 = tc.Operand("ys", (rows_out, D), x_dtype, (bM, bN2), lambda *a: (out_tile(*a), a[0]))
    fp4_down = down.kind == "fp4"
    return ((I // bN1, nM), ins1, out1, functools.partial(_gate_up_kernel, up=up, bN=bN1, split_out=fp4_down)), \
           ((D // bN2, nM), ins2, out2, functools.partial(_down_kernel, down=down, bN=bN2,
                                                          pair_block=bN1 if fp4_down else None))


def row_tile(n_assign: int, n_experts: int, dtype) -> int:
    """Rows per expert tile: the largest of 128, 64, 32 whose group padding (≤ bM − 1 rows per used expert)
    stays within the assignments themselves, else the dtype's sublane tile (16 for bf16)."""
    for bM in (128, 64, 32):
        if min(n_experts, n_assign) * (bM - 1) <= n_assign:
            return bM
    return max(16, tc.sublanes(dtype)) if jnp.dtype(dtype).itemsize < 4 else 8


def worst_tiles(n_tiles: int, n_experts: int) -> list[np.ndarray]:
    """Scalar prefetch of the grouped kernels with every tile used and every expert present (cost bound)."""
    return [np.minimum(np.arange(n_tiles) * n_experts // n_tiles, n_experts - 1), np.array([n_tiles])]


def _grouped_call(plan, prefetch, args, name, interpret, flops, **kw):
    grid, ins, out, kernel = plan
    n_experts = ins[1].shape[0]
    cost = tc.cost_estimate(grid, ins + [out], worst_tiles(grid[1], n_experts), flops)
    return pl.pallas_call(
        functools.partial(kernel, **kw),
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=len(prefetch), grid=grid,
                                               in_specs=[o.spec for o in ins], out_specs=out.spec),
        out_shape=jax.ShapeDtypeStruct(out.shape, out.dtype),
        compiler_params=tc.compiler_params(("parallel", "arbitrary")),
        interpret=tc.interpret_params(interpret), cost_estimate=cost, name=name)(*prefetch, *args)


@functools.partial(jax.jit, static_argnames=("spec",))
def experts_prefill(x, idx, w, codes, scales, spec: Spec):
    """Routed experts for many tokens, grouped matmul over expert-sorted row tiles -> [T, D] in x.dtype.

    Arguments as `experts_decode` (the tiling: `Spec.block_m`, `Spec.block_n`).
    """
    ex = prepare_experts(*codes, scales, spec.fmt, spec.block)
    weights, scales, up, down = ex
    T, D = x.shape
    k = idx.shape[1]
    E = weights[0].shape[0]
    bM = spec.block_m or row_tile(T * k, E, x.dtype)
    row_token, dest, tile_expert, n_used = align(idx, E, bM)
    M = row_token.shape[0]
    plan1, plan2 = prefill_plans(M, x.dtype, ex, block_m=bM, block_n=spec.block_n)
    xk = tc.split_pairs(x, tc.fp4_pair_block(D)) if up.kind == "fp4" else x
    xs = jnp.pad(xk[row_token], ((0, bM), (0, 0)))
    prefetch = (tile_expert, n_used)
    s1, s3, s2 = scales
    I = up.rows
    h = _grouped_call(plan1, prefetch, [xs, *weights[:2]] + [s for s in (s1, s3) if s is not None],
                      "moe_gate_up_tpu", spec.interpret, 4 * M * D * I, limit=spec.limit)
    ys = _grouped_call(plan2, prefetch, [h, weights[2]] + ([s2] if s2 is not None else []), "moe_down_tpu",
                       spec.interpret, 2 * M * D * I)
    dest = dest.reshape(T, k)
    y = sum(w[:, j, None].astype(jnp.float32) * ys[dest[:, j]].astype(jnp.float32) for j in range(k))
    return y.astype(x.dtype)                                             # k gathers: no [T, k, D] temporary


# ---- the model's expert dict ----


def kernel_format(w) -> tuple[str, jax.Array, jax.Array | None] | None:
    """(format, codes, scale) of a dense array or `ops.quant.QArray` as the kernels take them, or None when
    the TPU kernels have no such format (Q8_0's (1, 32) f16 blocks: the caller falls back to the reference)."""
    if not isinstance(w, quant.QArray):
        return "dense", w, None
    f = w.fmt
    if f == quant.FP8:
        return "fp8_e4m3_b128", w.codes, w.scale
    if f == quant.FP4:
        return "fp4_e2m1_b32", w.codes, w.scale
    if f.scale == "f32" and f.codes in ("int8", "e4m3"):
        return ("int8" if f.codes == "int8" else "fp8"), w.codes, w.scale
    return None


def supports(p: dict) -> bool:
    """Whether the TPU kernels take these experts (one format for w1, w2, w3 that `kernel_format` maps)."""
    fmts = [kernel_format(p[n]) for n in ("w1", "w2", "w3")]
    return all(f is not None for f in fmts) and len({f[0] for f in fmts}) == 1


def routed(x, idx, w, p: dict, *, limit: float, interpret: bool = False):
    """`model.layers.moe.routed_experts` entry: p {"w1","w2","w3"} dense or QArray (`supports(p)`) -> the decode
    kernel for ≤ DECODE_MAX_TOKENS tokens, the grouped matmul above."""
    (fmt, c1, s1), (_, c2, s2), (_, c3, s3) = (kernel_format(p[n]) for n in ("w1", "w2", "w3"))
    kernel = experts_decode if x.shape[0] <= DECODE_MAX_TOKENS else experts_prefill
    return kernel(x, idx, w, (c1, c2, c3), (s1, s2, s3), Spec(limit, fmt, interpret=interpret))


def decode_traffic(plan, idx: np.ndarray) -> dict[str, int]:
    """Bytes the decode kernel's BlockSpecs move for a concrete routing idx [T, k] (see tpu_common.traffic)."""
    grid, ins, out, _ = plan
    experts = np.unique(np.asarray(idx))                                # the slots of `decode_slots`
    slots = np.concatenate([experts, np.full(grid[1] - experts.size, experts[-1])]).astype(np.int32)
    return tc.traffic(grid, ins + [out], [slots, np.array([experts.size], np.int32)])


def prefill_traffic(plans, idx: np.ndarray, n_experts: int, block_m: int) -> dict[str, int]:
    """Bytes both grouped kernels' BlockSpecs move for a concrete routing idx [T, k]."""
    _, _, tile_expert, n_used = align(jnp.asarray(idx), n_experts, block_m)
    pre = [np.asarray(tile_expert), np.asarray(n_used)]
    out = {}
    for tag, (grid, ins, o, _) in zip(("gate_up", "down"), plans):
        for name, b in tc.traffic(grid, ins + [o], pre).items():
            out[f"{tag}.{name}"] = b
    return out
