"""Shared by the Pallas TPU (Mosaic) kernels: weight formats, in-kernel dequantization, BlockSpec traffic.

Expert weight formats the TPU kernels read (static `fmt`; one expert matrix stack [E, N, K], N output rows,
K contraction, the checkpoints' [out, in] layout):

    fmt             codes                       scale                                 applied
    dense           bf16 / f32 [E, N, K]        —                                     —
    int8 | fp8      int8 | float8_e4m3fn        f32 [E, N/br, K/bc] (`ops.quant.quantize`)
                    [E, N, K]                     per-channel (br, bc) = (1, K)         on the dot output
                                                  blocks with br, bc multiples of 128   on the dot output
    fp8_e4m3_b128   e4m3fn (or its uint8 bits)  uint8 e8m0 [E, N/128, K/128]          on the dot output
                    [E, N, K]                     (the release format of the dense / FP8 checkpoints)
    fp4_e2m1_b32    uint8 [E, N, K/2]           uint8 e8m0 [E, N, K/32]               on the weight tile
                    (low nibble = element 2k)     (the release format of routed experts)

`prepare` maps the stored arrays onto what a kernel's BlockSpecs read, with cheap ops only (bitcasts,
reshapes, and an f32 conversion of the small 128-block scales): block scales go to SMEM (one scalar per
128×128 block, read at dynamic indices), per-channel scales to a lane vector, FP4 codes and scales stay
as stored so that only the active experts' bytes are read.

In-kernel dequantization (`matmul_tile`): codes are cast to the activation dtype one K-chunk at a time and
fed to the MXU (float32 accumulation); a per-channel or 128-block scale multiplies the chunk's dot output
(one scale per output column and chunk), so the weights cross HBM once at their stored width. FP4 codes
are decoded from their bits (`fp4_values`) and scaled per 32 elements before the dot: the e8m0 scales
are expanded along K by a 0/1 matmul (exact: powers of two times 0/1). FP8 release codes stay uint8 in
HBM and are bitcast to float8 in the kernel. Because FP4 packs two elements of
K in one byte, the activation is given pair-split (`split_pairs`: the even elements of K, then the odd
ones), so the low nibbles meet the even half and the high nibbles the odd half — no lane interleave. The split is
done within blocks of 2 × the chunk (`split_pairs`): on x outside the kernels, on h inside them.

`traffic` counts the bytes a pallas_call's BlockSpecs move for concrete scalar-prefetch values: Pallas TPU
pipelining copies a block when its block index differs from the previous grid step's (row-major grid
order), and writes an output block back when its index changes and at the end.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

FORMATS = ("dense", "int8", "fp8", "fp8_e4m3_b128", "fp4_e2m1_b32")
# scoped VMEM a kernel may use: above the 16 MiB default, below v5p's 64 MiB per core (v5e / v6e: 128 MiB)
VMEM_LIMIT_BYTES = 48 * 1024 * 1024
# contraction chunk (elements of K) of one MXU dot for the dense / per-channel formats, and for FP4 (bytes)
DOT_CHUNK = 512
FP4_CHUNK_BYTES = 256


class FormatError(ValueError):
    """Expert weights whose arrays do not match their declared format."""


def interpret_params(interpret: bool):
    """`interpret` argument of pallas_call: TPU interpret mode (simulated VMEM/SMEM, DMAs) or compiled."""
    return pltpu.InterpretParams() if interpret else False


def compiler_params(semantics: tuple[str, ...], vmem_limit_bytes: int = VMEM_LIMIT_BYTES):
    return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=vmem_limit_bytes)


def block(n: int, cap: int) -> int:
    """Largest power of two ≤ cap that divides n (chunk sizes that need no masking)."""
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def sublanes(dtype) -> int:
    """Rows of one (sublane × 128-lane) tile: 8 for 32-bit, 16 for 16-bit, 32 for 8-bit dtypes."""
    return 32 // jnp.dtype(dtype).itemsize


# ---- formats ----


@dataclasses.dataclass(frozen=True)
class MatFormat:
    """Static description of one expert matrix stack [E, N, K] as a kernel reads it."""

    fmt: str
    rows: int                          # N
    cols: int                          # K (logical, FP4 stores K/2 bytes)
    block: tuple[int, int] | None      # scale block (br, bc); None for dense
    scale_t: bool = False              # FP4 scale passed transposed, [E, K/32, N] (see `prepare`)

    @property
    def kind(self) -> str:
        """How scales apply: "dense", "channel" (per output row), "block" (SMEM scalars), "fp4"."""
        if self.fmt == "dense":
            return "dense"
        if self.fmt == "fp4_e2m1_b32":
            return "fp4"
        return "channel" if self.block == (1, self.cols) else "block"

    @property
    def packed_cols(self) -> int:
        """Stored columns of the codes: K, or K/2 for FP4."""
        return self.cols // 2 if self.kind == "fp4" else self.cols


def _fail(name: str, msg: str):
    raise FormatError(f"{name}: {msg}")


def prepare(name: str, codes: jax.Array, scale: jax.Array | None, fmt: str, block=None):
    """Stored (codes, scale) of format `fmt` -> (codes, scale, MatFormat) as the kernels read them.

    codes / scale as in the module table; `block` (br, bc) is optional for int8 / fp8 (read from the
    shapes) and fixed for the release formats. Raises FormatError naming `name` on any mismatch.
    """
    if fmt not in FORMATS:
        raise FormatError(f"{name}: unknown weight format {fmt!r}; choose from {FORMATS}")
    if codes.ndim != 3:
        _fail(name, f"expected codes [E, N, K], got shape {codes.shape}")
    E, N, Kc = codes.shape
    if fmt == "dense":
        if scale is not None:
            _fail(name, "dense weights take no scale")
        if codes.dtype not in (jnp.bfloat16, jnp.float32):
            _fail(name, f"dense weights must be bfloat16 or float32, got {codes.dtype}")
        return codes, None, MatFormat("dense", N, Kc, None)
    if scale is None:
        _fail(name, f"format {fmt} needs a scale array")
    if fmt == "fp4_e2m1_b32":
        K = 2 * Kc
        if codes.dtype != jnp.uint8 or scale.dtype != jnp.uint8:
            _fail(name, f"fp4_e2m1_b32 codes and scales are uint8, got {codes.dtype} / {scale.dtype}")
        if scale.shape != (E, N, K // 32) or K % 32:
            _fail(name, f"fp4_e2m1_b32 scale must be [E, N, K/32] = {(E, N, K // 32)}, got {scale.shape}")
        if block not in (None, (1, 32)):
            _fail(name, f"fp4_e2m1_b32 has block (1, 32), got {block}")
        # XLA's default TPU layout of a uint8 [E, N, G] array with G < 128 puts N minor; the kernel reads
        # such a scale as [E, G, N] (then a bitcast, not a copy of every expert's scales per call)
        scale_t = K // 32 < 128
        scale = jnp.swapaxes(scale, 1, 2) if scale_t else scale
        return codes, scale, MatFormat(fmt, N, K, (1, 32), scale_t)
    K = Kc
    if fmt == "fp8_e4m3_b128":
        if codes.dtype not in (jnp.uint8, jnp.float8_e4m3fn) or scale.dtype != jnp.uint8:
            _fail(name, f"fp8_e4m3_b128 codes are float8_e4m3fn (QArray) or their uint8 bits, scales uint8; got "
                        f"{codes.dtype} / {scale.dtype}")
        if N % 128 or K % 128:
            _fail(name, f"fp8_e4m3_b128 in the TPU kernels needs N, K multiples of 128, got {N} x {K}")
        if scale.shape != (E, N // 128, K // 128):
            _fail(name, f"fp8_e4m3_b128 scale must be {(E, N // 128, K // 128)}, got {scale.shape}")
        if block not in (None, (128, 128)):
            _fail(name, f"fp8_e4m3_b128 has block (128, 128), got {block}")
        # codes stay uint8 (bitcast to float8 in the kernel: outside it XLA copies every expert's codes);
        # e8m0 -> f32 2^(s-127) here (small: one scale per 128×128 block)
        scale = e8m0_to_f32(scale)
        return codes, scale, MatFormat(fmt, N, K, (128, 128))
    want = jnp.int8 if fmt == "int8" else jnp.float8_e4m3fn
    if codes.dtype != want:
        _fail(name, f"format {fmt} codes must be {jnp.dtype(want).name}, got {codes.dtype}")
    if scale.ndim != 3 or scale.shape[0] != E or N % scale.shape[1] or K % scale.shape[2]:
        _fail(name, f"scale shape {scale.shape} does not tile codes {codes.shape}")
    br, bc = N // scale.shape[1], K // scale.shape[2]
    if block is not None and tuple(block) != (br, bc if block[1] is not None else K):
        _fail(name, f"block {block} does not match the scale shape (block {(br, bc)})")
    scale = scale.astype(jnp.float32)
    if (br, bc) == (1, K):
        return codes, scale.reshape(E, 1, N), MatFormat(fmt, N, K, (1, K))
    if br % 128 or bc % 128:
        _fail(name, f"scale block {(br, bc)} is not supported by the TPU kernels: use per-channel (1, K) or "
                    f"blocks with both sides multiples of 128")
    return codes, scale, MatFormat(fmt, N, K, (br, bc))


def scale_operand(name: str, scale: jax.Array, mf: MatFormat, tile_rows: int, rows_index: Callable,
                  expert_index: Callable) -> "Operand":
    """The scale array's operand for weight tiles of `tile_rows` rows and the full K.

    rows_index(*grid, *prefetch) -> the tile's row-block index; expert_index(...) -> the expert id.
    channel: a lane vector [1, tile_rows]; block: the expert's whole [N/br, K/bc] scalars in SMEM;
    fp4: [tile_rows, K/32] bytes, or [K/32, tile_rows] when passed transposed.
    """
    kind = mf.kind
    if kind == "channel":
        return Operand(name, scale.shape, scale.dtype, (None, 1, tile_rows),
                       lambda *a: (expert_index(*a), 0, rows_index(*a)))
    if kind == "block":
        return Operand(name, scale.shape, scale.dtype, (None,) + scale.shape[1:],
                       lambda *a: (expert_index(*a), 0, 0), smem=True)
    if kind == "fp4" and mf.scale_t:
        return Operand(name, scale.shape, scale.dtype, (None, scale.shape[1], tile_rows),
                       lambda *a: (expert_index(*a), 0, rows_index(*a)))
    if kind == "fp4":
        return Operand(name, scale.shape, scale.dtype, (None, tile_rows, scale.shape[2]),
                       lambda *a: (expert_index(*a), rows_index(*a), 0))
    raise AssertionError(kind)


# ---- in-kernel decoding ----


def e8m0_to_f32(s: jax.Array) -> jax.Array:
    """uint8 e8m0 -> f32 2^(s-127) by placing s in the exponent field (s = 0 gives 0, not 2^-127, and
    s = 255 gives +inf, not NaN: neither occurs in real scales; TPUs flush the 2^-127 denormal anyway)."""
    return jax.lax.bitcast_convert_type(s.astype(jnp.int32) << 23, jnp.float32)


def fp4_values(nib: jax.Array) -> jax.Array:
    """e2m1 codes (int32, 0..15: sign | 2 exponent bits | 1 mantissa bit) -> f32 values, from the bits.

    Magnitudes ≥ 1 (exponent e ≥ 1): 2^(e-1)·(1 + m/2), i.e. f32 exponent field e + 126 and mantissa bit
    22 = m, which is (mag << 22) + (126 << 23); magnitudes 0 and 0.5 (e = 0) are selected separately.
    """
    mag = nib & 7
    sign = (nib & 8) << 28
    normal = (mag << 22) + (126 << 23)
    small = mag * 0x3F000000                                             # 0 -> 0.0, 1 -> 0.5
    return jax.lax.bitcast_convert_type(sign | jnp.where(mag < 2, small, normal), jnp.float32)


def split_pairs(a: jax.Array, block: int) -> jax.Array:
    """[..., K] -> [..., K]: within each block of `block` elements, the even ones then the odd ones (the FP4
    activation order; `block` = 2 × the kernel's FP4 chunk of bytes)."""
    *lead, K = a.shape
    b = a.reshape(*lead, K // block, block // 2, 2)
    return jnp.concatenate([b[..., 0], b[..., 1]], axis=-1).reshape(a.shape)


def split_pairs_tile(a: jax.Array) -> jax.Array:
    """`split_pairs` of a whole tile [M, K] (one block) inside a kernel, as a 0/1 permutation matmul
    (exact: one product per output)."""
    K = a.shape[-1]
    src = jax.lax.broadcasted_iota(jnp.int32, (K, K), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (K, K), 1)
    half = K // 2
    perm = (src == jnp.where(j < half, 2 * j, 2 * (j - half) + 1)).astype(a.dtype)
    return _dot(a, perm, ((1,), (0,))).astype(a.dtype)


def fp4_pair_block(k: int) -> int:
    """Elements per pair-split block of an FP4 contraction of length k (2 × the chunk of bytes)."""
    return 2 * block(k // 2, FP4_CHUNK_BYTES)


def _precision(dtype):
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _dot(a, b, contract=((1,), (1,))):
    """f32-accumulated dot; contract ((1,),(1,)) = a · bᵀ."""
    return jax.lax.dot_general(a, b, (contract, ((), ())), precision=_precision(a.dtype),
                               preferred_element_type=jnp.float32)


def _expand_groups(s: jax.Array, g0, n: int, rep_log2: int, transposed: bool) -> jax.Array:
    """Scales s [R, G] (or [G, R] if transposed) -> [R, n]: column j is s[:, g0 + (j >> rep_log2)], by a
    0/1 matmul (exact for e8m0 scales in bfloat16)."""
    G = s.shape[0] if transposed else s.shape[1]
    g = jax.lax.broadcasted_iota(jnp.int32, (G, n), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (G, n), 1)
    sel = (g == g0 + (j >> rep_log2)).astype(s.dtype)
    return _dot(s, sel, ((0,), (0,)) if transposed else ((1,), (0,)))


class WeightRefs(NamedTuple):
    """One weight tile inside a kernel: ref the tile [Nt, Kt] (FP4: [Nt, Kt/2] bytes), scale its scale ref as
    `scale_operand` lays it out (None when dense), mf its `MatFormat`."""

    ref: object
    scale: object
    mf: MatFormat


def matmul_tile(a: jax.Array, wt: WeightRefs, *, r0: int, nr: int, tile_row0, tile_col0,
                pair_block: int | None = None):
    """a [M, Kt] · W[r0:r0+nr, :Kt]ᵀ for one weight tile -> f32 [M, nr], dequantized chunk by chunk.

    wt: the tile's refs and format (FP4: `a` pair-split within blocks of `pair_block` elements). r0, nr:
    static rows inside the tile; tile_row0 / tile_col0: the tile's first row / column in the whole matrix
    (dynamic; they locate the tile's scales in the SMEM block scales and the FP4 scale columns).
    """
    w_ref, s_ref, mf = wt
    kind = mf.kind
    Kt = a.shape[1]
    cdt = a.dtype
    out = jnp.zeros((a.shape[0], nr), jnp.float32)
    if kind == "fp4":
        P = pair_block or fp4_pair_block(Kt)
        ck = P // 2                                                      # bytes per chunk
        if mf.scale_t:
            s = e8m0_to_f32(s_ref[:, pl.ds(r0, nr)]).astype(jnp.bfloat16)   # [K/32, nr]
        else:
            s = e8m0_to_f32(s_ref[pl.ds(r0, nr), :]).astype(jnp.bfloat16)   # [nr, K/32]; powers of two: exact
        for c0 in range(0, Kt // 2, ck):
            codes = w_ref[pl.ds(r0, nr), pl.ds(c0, ck)].astype(jnp.int32)
            # a byte at packed column c holds elements 2c (low) and 2c+1 (high): scale group (2c) // 32
            sx = _expand_groups(s, (tile_col0 + 2 * c0) // 32, ck, 4, mf.scale_t)
            lo = (fp4_values(codes & 15) * sx).astype(cdt)
            hi = (fp4_values(codes >> 4) * sx).astype(cdt)
            e0 = 2 * c0                                                  # the chunk's pair-split block
            out = out + _dot(a[:, e0:e0 + ck], lo) + _dot(a[:, e0 + ck:e0 + P], hi)
        return out
    if kind == "block":
        br, bc = mf.block
        ck = block(bc, DOT_CHUNK)
        for c0 in range(0, Kt, ck):
            w = w_ref[pl.ds(r0, nr), pl.ds(c0, ck)]
            if w.dtype == jnp.uint8:                                     # fp8_e4m3_b128: e4m3fn bits
                w = jax.lax.bitcast_convert_type(w, jnp.float8_e4m3fn)
            part = _dot(a[:, c0:c0 + ck], w.astype(cdt))
            col = (tile_col0 + c0) // bc
            row = (tile_row0 + r0) // br
            svec = jnp.concatenate([jnp.full((1, br), s_ref[row + j, col], jnp.float32)
                                    for j in range(nr // br)], axis=1)
            out = out + part * svec
        return out
    ck = block(Kt, DOT_CHUNK)
    for c0 in range(0, Kt, ck):
        out = out + _dot(a[:, c0:c0 + ck], w_ref[pl.ds(r0, nr), pl.ds(c0, ck)].astype(cdt))
    if kind == "channel":
        out = out * s_ref[:, pl.ds(r0, nr)]
    return out


def check_tiles(mf: MatFormat, tile_rows: int, tile_cols: int, what: str):
    """Tile sizes the format's scale layout and the TPU (8, 128) tiling accept."""
    if mf.rows % tile_rows or mf.cols % tile_cols:
        raise ValueError(f"{what}: tile {tile_rows} x {tile_cols} does not divide the matrix {mf.rows} x {mf.cols}")
    if mf.kind == "block":
        br, bc = mf.block
        if tile_rows % br or tile_cols % block(bc, DOT_CHUNK):
            raise ValueError(f"{what}: tile {tile_rows} x {tile_cols} must cover whole {br} x {bc} scale blocks")
    if mf.kind == "fp4" and tile_cols % 64:
        raise ValueError(f"{what}: FP4 tiles need a multiple of 64 columns (whole 32-element scale groups in "
                         f"each byte chunk), got {tile_cols}")


# ---- BlockSpec traffic ----


@dataclasses.dataclass(frozen=True)
class Operand:
    """One pallas_call operand: its BlockSpec (block shape, index map, memory space), also for `traffic`.

    The index map takes (*grid indices, *scalar-prefetch refs) and must use only integer operators
    (`imin`, `imax`, `iwhere`) and indexing, so that `traffic` can evaluate it on numpy arrays of every grid
    step at once.
    """

    name: str
    shape: tuple[int, ...]
    dtype: object
    block: tuple[int | None, ...]
    index_map: Callable
    smem: bool = False

    @property
    def spec(self) -> pl.BlockSpec:
        return pl.BlockSpec(self.block, self.index_map, memory_space=pltpu.SMEM if self.smem else None)

    @property
    def block_bytes(self) -> int:
        return int(np.prod([1 if d is None else d for d in self.block])) * jnp.dtype(self.dtype).itemsize


def imin(a, b):
    """min of ints with operators only: the same code on traced index-map scalars and numpy arrays."""
    return b + (a - b) * (a < b)


def imax(a, b):
    return a + (b - a) * (b > a)


def iwhere(c, a, b):
    return b + (a - b) * c


def traffic(grid: tuple[int, ...], operands: list[Operand], prefetch: list[np.ndarray]) -> dict[str, int]:
    """Bytes moved per operand for concrete scalar-prefetch values (grid walked in row-major order).

    The index maps run on numpy arrays of all grid steps at once (they use `imin` / `imax` / `iwhere` and
    indexing only), so this also works while a kernel is being traced (`cost_estimate`)."""
    idx = np.meshgrid(*[np.arange(g) for g in grid], indexing="ij")
    idx = [i.reshape(-1) for i in idx]
    refs = [np.asarray(p) for p in prefetch]
    out = {}
    for op in operands:
        blocks = np.stack([np.broadcast_to(np.asarray(b), idx[0].shape) for b in op.index_map(*idx, *refs)], -1)
        changed = np.ones(blocks.shape[0], bool)
        changed[1:] = np.any(blocks[1:] != blocks[:-1], axis=-1)
        out[op.name] = int(changed.sum()) * op.block_bytes
    return out


def cost_estimate(grid, operands: list[Operand], prefetch: list[np.ndarray], flops: int,
                  transcendentals: int = 0) -> pl.CostEstimate:
    """XLA's cost model entry for a pallas_call: the BlockSpec bytes for the given (worst-case) prefetch."""
    return pl.CostEstimate(flops=int(flops), transcendentals=int(transcendentals),
                           bytes_accessed=int(sum(traffic(grid, operands, prefetch).values())))
