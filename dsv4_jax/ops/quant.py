"""Quantized weights as one pytree leaf type, `QArray`: formats, dequantization, quantization.

A quantized matrix W [..., N, K] (N output rows, K the contraction dim: the checkpoints' [out, in]) is
codes + scales, W[..., n, k] = code(codes[..., n, k]) · scale(scale[..., n // br, k // bc]), described
by a static `QFormat(codes, block, scale)`:

    codes  "e4m3"  float8_e4m3fn [..., N, K]
           "e2m1"  uint8 [..., N, K/2]: two e2m1 values per byte, low nibble = element 2k (official packing)
           "int8"  int8 [..., N, K]
    block  (br, bc): rows × columns sharing one scale; 0 = the whole dim (per channel: (1, 0))
    scale  "e8m0" uint8 holding 2^(b − 127) (b = 0: 2^-127, b = 255: NaN) | "f16" float16 | "f32" float32,
           shape [..., ⌈N/br⌉, ⌈K/bc⌉]; leading dims (experts, stacked layers) are never blocked

Word layout of FP4 (`words_format(G)`, made from FP4 by `to_words`; for XLA:TPU, which re-tiles uint8
stacks), laid out within each group of G columns (block (1, G), 0 = the whole dim; G a multiple of 256; a
split of K into shards of whole groups leaves each shard in the same layout):
    codes  "e2m1x8" uint32 [..., N, K/8]: in group g, nibble i of word j holds column g·G + i·G/8 + j
    scale  "e8m0x4" uint32 [..., N, K/128]: in group g, byte b of word m holds the e8m0 scale of the
           32-column block g·G/32 + b·G/128 + m

Named formats (docs/checkpoint_formats.md §1.3, §3, §6):

    fp8_e4m3_b128  e4m3, (128, 128), e8m0   the official FP8 linears
    fp4_e2m1_b32   e2m1, (1, 32), e8m0      the official FP4 routed experts (= GGML MXFP4, nibbles reordered)
    q8_0           int8, (1, 32), f16       GGML Q8_0
    int8_channel   int8, (1, 0), f32        int8 per output channel

Every code × scale product is exact in float32 (FP8 / FP4 also in bfloat16), so dequantization is exact.

`QArray(codes, scale, fmt, dtype)` is a registered pytree node: children `codes`, `scale` (arrays; or
`jax.ShapeDtypeStruct`s in abstract trees, `NamedSharding`s / `PartitionSpec`s in sharding trees); static
`fmt` and `dtype` (what it dequantizes to: the compute dtype). Its logical shape is derived from the codes,
so it stays right when `lax.scan`, `vmap` or indexing slice the children's leading axes. Orbax saves it as
{codes, scale} and restores it into an abstract QArray target. The model reads weights through
`ops.linear` and `ops.moe`, which accept dense arrays or QArrays; kernels read `q.codes`, `q.scale`,
`q.fmt.codes`, `resolved_block(q.fmt, q.shape)`.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

CODES = {"e4m3": np.dtype(jnp.float8_e4m3fn), "e2m1": np.dtype(np.uint8), "int8": np.dtype(np.int8),
         "e2m1x8": np.dtype(np.uint32)}
SCALES = {"e8m0": np.dtype(np.uint8), "f16": np.dtype(np.float16), "f32": np.dtype(np.float32),
          "e8m0x4": np.dtype(np.uint32)}
QMAX = {"e4m3": 448.0, "e2m1": 6.0, "int8": 127.0}     # largest code magnitude


@dataclasses.dataclass(frozen=True)
class QFormat:
    """How a quantized matrix is stored (see the module docstring); hashable, a static part of QArray."""

    codes: str
    block: tuple[int, int]
    scale: str

    def __post_init__(self):
        if self.codes not in CODES or self.scale not in SCALES:
            raise ValueError(f"unknown quantization format codes={self.codes!r} scale={self.scale!r}; codes in "
                             f"{sorted(CODES)}, scales in {sorted(SCALES)}")
        if len(self.block) != 2 or min(self.block) < 0:
            raise ValueError(f"block must be (rows, cols) with 0 = whole dim, got {self.block}")
        object.__setattr__(self, "block", tuple(int(b) for b in self.block))

    @property
    def pack(self) -> int:
        """Elements per code along the last axis (2 for packed e2m1, 8 for its uint32 words)."""
        return {"e2m1": 2, "e2m1x8": 8}.get(self.codes, 1)

    @property
    def name(self) -> str:
        for n, f in FORMATS.items():
            if f == self:
                return n
        return f"{self.codes}_{self.scale}_{self.block[0]}x{self.block[1]}"

    def __str__(self) -> str:
        return self.name


FP8 = QFormat("e4m3", (128, 128), "e8m0")
FP4 = QFormat("e2m1", (1, 32), "e8m0")
Q8_0 = QFormat("int8", (1, 32), "f16")
INT8 = QFormat("int8", (1, 0), "f32")
FORMATS = {"fp8_e4m3_b128": FP8, "fp4_e2m1_b32": FP4, "q8_0": Q8_0, "int8_channel": INT8}


def words_format(group: int = 0) -> QFormat:
    """FP4 in uint32 words laid out within groups of `group` columns (0: the whole K; module docstring)."""
    return QFormat("e2m1x8", (1, group), "e8m0x4")


FP4_WORDS = words_format()                           # FP4 as uint32 words over the whole K (not a file format)


def qformat(fmt: str | QFormat) -> QFormat:
    """A QFormat from itself, a named format or a generic name `<codes>_<scale>_<br>x<bc>`."""
    if isinstance(fmt, QFormat):
        return fmt
    if fmt in FORMATS:
        return FORMATS[fmt]
    try:
        codes, scale, block = fmt.split("_")
        br, bc = block.split("x")
        return QFormat(codes, (int(br), int(bc)), scale)
    except (ValueError, AttributeError):
        raise ValueError(f"unknown quantization format {fmt!r}; named formats: {sorted(FORMATS)}") from None


def resolved_block(fmt: QFormat, shape) -> tuple[int, int]:
    """(br, bc) of a logical [..., N, K] shape (0 replaced by the dim)."""
    br, bc = fmt.block
    return br or shape[-2], bc or shape[-1]


def stored_shapes(fmt: QFormat, shape) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(codes shape, scale shape) of a logical [..., N, K] matrix."""
    *lead, n, k = shape
    br, bc = resolved_block(fmt, shape)
    if k % fmt.pack:
        raise ValueError(f"{fmt}: last dim {k} is not a multiple of {fmt.pack}")
    if fmt.codes == "e2m1x8":
        if bc % 256 or k % bc:
            raise ValueError(f"{fmt}: column groups of {bc} must be a multiple of 256 and divide the last dim {k}")
        return (*lead, n, k // 8), (*lead, n, k // 128)
    return (*lead, n, k // fmt.pack), (*lead, -(-n // br), -(-k // bc))


def block_grid(fmt: QFormat, shape) -> tuple[int, ...]:
    """Whole blocks per dim, 1 where a dim ends in a partial block: a split of this grid splits codes and
    scales consistently (every shard holds whole blocks), so it is what shardings are computed on."""
    *lead, n, k = shape
    br, bc = resolved_block(fmt, shape)
    return (*lead, n // br if n % br == 0 else 1, k // bc if k % bc == 0 else 1)


def _nbytes(a) -> int:
    return math.prod(a.shape) * np.dtype(a.dtype).itemsize


@jax.tree_util.register_pytree_with_keys_class
class QArray:
    """A quantized weight (module docstring): children codes, scale; static fmt, dtype."""

    __slots__ = ("codes", "scale", "fmt", "dtype")

    def __init__(self, codes, scale, fmt: QFormat | str, dtype=jnp.float32):
        self.codes, self.scale = codes, scale
        self.fmt = qformat(fmt)
        self.dtype = np.dtype(dtype)

    # -- logical (dense twin) view
    @property
    def shape(self) -> tuple[int, ...]:
        *lead, last = self.codes.shape
        return (*lead, last * self.fmt.pack)

    @property
    def ndim(self) -> int:
        return len(self.codes.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of codes + scales (what the weight occupies)."""
        return _nbytes(self.codes) + _nbytes(self.scale)

    def astype(self, dtype) -> "QArray":
        """The same codes dequantizing to `dtype` (no data touched)."""
        return QArray(self.codes, self.scale, self.fmt, dtype)

    def __repr__(self) -> str:
        return (f"QArray({self.fmt.name}, shape={self.shape}, dtype={self.dtype.name}, "
                f"codes={getattr(self.codes, 'dtype', '?')}{tuple(getattr(self.codes, 'shape', ()))}, "
                f"scale={getattr(self.scale, 'dtype', '?')}{tuple(getattr(self.scale, 'shape', ()))})")

    # -- pytree
    def tree_flatten_with_keys(self):
        return (((jax.tree_util.GetAttrKey("codes"), self.codes), (jax.tree_util.GetAttrKey("scale"), self.scale)),
                (self.fmt, self.dtype))

    def tree_flatten(self):
        return (self.codes, self.scale), (self.fmt, self.dtype)

    @classmethod
    def tree_unflatten(cls, aux, children):
        q = object.__new__(cls)          # no conversion: jax passes placeholders and tracers through here
        q.codes, q.scale = children
        q.fmt, q.dtype = aux
        return q


def is_qarray(x) -> bool:
    return isinstance(x, QArray)


def check(q: QArray, what: str = "weight") -> QArray:
    """Raise ValueError unless the children's shapes and dtypes fit the format."""
    want_c, want_s = stored_shapes(q.fmt, q.shape)
    dc, ds = CODES[q.fmt.codes], SCALES[q.fmt.scale]
    got = ((tuple(q.codes.shape), np.dtype(q.codes.dtype)), (tuple(q.scale.shape), np.dtype(q.scale.dtype)))
    if got != ((want_c, dc), (want_s, ds)):
        raise ValueError(f"{what}: {q.fmt.name} needs codes {dc.name}{want_c} and scale {ds.name}{want_s}, got "
                         f"codes {got[0][1].name}{got[0][0]} and scale {got[1][1].name}{got[1][0]}")
    return q


def abstract(fmt: QFormat | str, shape, dtype, codes_sharding=None, scale_sharding=None) -> QArray:
    """QArray of jax.ShapeDtypeStruct children for a logical [..., N, K] shape (an Orbax restore target
    when shardings are given; `jax.eval_shape` gives the same)."""
    fmt = qformat(fmt)
    cs, ss = stored_shapes(fmt, shape)
    return QArray(jax.ShapeDtypeStruct(cs, CODES[fmt.codes], sharding=codes_sharding),
                  jax.ShapeDtypeStruct(ss, SCALES[fmt.scale], sharding=scale_sharding), fmt, dtype)


# ---- decoding (jnp; also used inside the Pallas kernels: plain integer / bitcast ops) -------------------

def decode_e8m0(s: jax.Array) -> jax.Array:
    """uint8 b -> float32 2^(b − 127), exact: b = 0 is the subnormal 2^-127, b = 255 NaN
    (docs/checkpoint_formats.md §3)."""
    b = s.astype(jnp.int32)
    bits = jnp.where(b == 0, 0x00400000, b << 23)
    bits = jnp.where(b == 255, 0x7FC00000, bits)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def decode_e2m1(n: jax.Array) -> jax.Array:
    """4-bit codes (int, 0..15) -> float32 e2m1: 0, .5, 1, 1.5, 2, 3, 4, 6 and their negatives (bit 3 = sign)."""
    n = n.astype(jnp.int32)
    e, m = (n >> 1) & 3, n & 1
    mag = jnp.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22))   # e = 0: 0 or 0.5 (subnormal)
    return jax.lax.bitcast_convert_type(mag | ((n & 8) << 28), jnp.float32)


def unpack_e2m1(codes: jax.Array) -> jax.Array:
    """uint8 [..., K/2] -> float32 [..., K]: element 2k from the low nibble of byte k, 2k+1 from the high one."""
    vals = jnp.stack([decode_e2m1(codes & 0xF), decode_e2m1(codes >> 4)], axis=-1)
    return vals.reshape(*codes.shape[:-1], codes.shape[-1] * 2)


def unpack_words(words: jax.Array, bits: int, groups: int) -> jax.Array:
    """uint32 [..., M] in `groups` groups -> its 32/bits-bit fields [..., M·32/bits] (uint32), in each group
    field i of every word before field i + 1 (the word layout, module docstring)."""
    *lead, m = words.shape
    w = words.reshape(*lead, groups, 1, m // groups)
    i = jax.lax.broadcasted_iota(jnp.uint32, (32 // bits, 1), 0)
    return ((w >> (bits * i)) & ((1 << bits) - 1)).reshape(*lead, m * 32 // bits)


def word_groups(fmt: QFormat, k: int) -> int:
    """Column groups of a word-layout weight with last dim k."""
    return k // (fmt.block[1] or k)


def decode_codes(codes: jax.Array, fmt: QFormat) -> jax.Array:
    """Codes -> float32 values of the logical shape (before scaling)."""
    if fmt.codes == "e2m1":
        return unpack_e2m1(codes)
    if fmt.codes == "e2m1x8":
        return decode_e2m1(unpack_words(codes, 4, word_groups(fmt, codes.shape[-1] * 8)))
    return codes.astype(jnp.float32)


def decode_scale(scale: jax.Array, fmt: QFormat) -> jax.Array:
    """Scales -> float32 [..., ⌈N/br⌉, ⌈K/bc⌉] (e8m0x4 words: one per 32-column block, [..., N, K/32])."""
    if fmt.scale == "e8m0x4":
        return decode_e8m0(unpack_words(scale, 8, word_groups(fmt, scale.shape[-1] * 128)))
    return decode_e8m0(scale) if fmt.scale == "e8m0" else scale.astype(jnp.float32)


def scale_block(fmt: QFormat, shape) -> tuple[int, int]:
    """The block one decoded scale (`decode_scale`) covers: `resolved_block`, (1, 32) for e8m0x4 words."""
    return (1, 32) if fmt.scale == "e8m0x4" else resolved_block(fmt, shape)


def expand_scale(s: jax.Array, block: tuple[int, int], n: int, k: int) -> jax.Array:
    """Scales [..., ⌈n/br⌉, ⌈k/bc⌉] -> one per element [..., n, k] (partial last blocks cut)."""
    br, bc = block
    s = jnp.repeat(s, br, axis=-2)[..., :n, :] if br > 1 else s
    return jnp.repeat(s, bc, axis=-1)[..., :k] if bc > 1 else s


def dequantize(q: QArray, dtype=None) -> jax.Array:
    """The dense weight [..., N, K] in `dtype` (default q.dtype). Exact (see the module docstring)."""
    *_, n, k = q.shape
    vals = decode_codes(q.codes, q.fmt)
    s = expand_scale(decode_scale(q.scale, q.fmt), scale_block(q.fmt, q.shape), n, k)
    return (vals * s).astype(q.dtype if dtype is None else dtype)


def dense(w, dtype=None) -> jax.Array:
    """A weight leaf as a dense array: QArrays dequantized (inside the caller's jit), arrays as they are."""
    if isinstance(w, QArray):
        return dequantize(w, dtype)
    return w if dtype is None else w.astype(dtype)


# ---- a matmul reading the codes (no dequantized copy of the weight) ------------------------------------

def decode_e2m1_float(n: jax.Array, dtype=jnp.float32) -> jax.Array:
    """4-bit codes (uint8, 0..15) -> e2m1 values in `dtype` with uint8 ops and one convert (no 32-bit
    integer or bitcast step, so XLA:TPU fuses it into the consumer of the codes): magnitude m = n & 7 ->
    0, .5, 1, 1.5 (m/2), 2, 3 (m − 2), 4, 6 (2m − 8); bit 3 the sign (8 -> −0, as `decode_e2m1`)."""
    m = (n & 7).astype(dtype)
    mag = jnp.where(m < 4, m * 0.5, jnp.where(m < 6, m - 2, m * 2 - 8))
    return jnp.where(n >= 8, -mag, mag)


def matmul_codes(x: jax.Array, q: QArray) -> jax.Array:
    """x Wᵀ for a [N, K] QArray W without a dequantized W: x [..., K] -> [..., N] in x.dtype.

    Packed e2m1 (two columns per byte) contracts the even and odd columns of x separately against the low
    and high nibbles, x[..., 0::2] LOᵀ + x[..., 1::2] HIᵀ, each nibble plane decoded elementwise from the
    codes (`decode_e2m1_float`) and scaled per block: no interleave, so XLA fuses the decode into the
    matmul and reads the codes once (docs/aot.md, "release decode"). Other formats: x · dequantize(q)ᵀ.
    Same values as the dense path; only the float32 summation order differs."""
    if q.ndim != 2:
        raise ValueError(f"matmul_codes needs a [N, K] weight, got shape {q.shape}")
    if q.fmt.codes == "e2m1x8":
        return matmul_words(x, q)
    br, bc = resolved_block(q.fmt, q.shape)
    if q.fmt.codes != "e2m1" or br != 1 or bc % 2:
        return x @ dequantize(q, x.dtype).T
    n, kp = q.codes.shape
    s = decode_scale(q.scale, q.fmt)
    if q.fmt.scale == "e8m0" and x.dtype in (jnp.bfloat16, jnp.float32):   # powers of two: exact in both
        s = s.astype(x.dtype)
    s = jnp.repeat(s, bc // 2, axis=-1)[..., :kp] if bc > 2 else s            # one per code byte [N, K/2]
    plane = lambda nib: (decode_e2m1_float(nib) * s.astype(jnp.float32)).astype(x.dtype)
    return x[..., 0::2] @ plane(q.codes & 0xF).T + x[..., 1::2] @ plane(q.codes >> 4).T


def matmul_words(x: jax.Array, q: QArray) -> jax.Array:
    """x Wᵀ for a [N, K] word-layout QArray (`words_format`): x [..., K] -> [..., N] in x.dtype. In each
    column group, plane i (nibble i of every word) is decoded with its scales (bytes i // 2 of the group's
    scale words of half i % 2) as one broadcast expression [8, N, groups, G/8] and contracted as one batched
    matmul against x's matching column ranges, then summed: XLA:TPU reads each word once, with no re-tiling
    of the stack (experiments/results/aot_release_ep_2026-12-04.md)."""
    g, gw = _word_groups_of(q)
    xs = x.reshape(*x.shape[:-1], g, 8, gw)
    y = jnp.einsum("...gij,ingj->...in", xs, word_planes(q, x.dtype), preferred_element_type=jnp.float32)
    return y.sum(-2).astype(x.dtype)


def _word_groups_of(q: QArray) -> tuple[int, int]:
    """(column groups, words per group G/8) of a word-layout QArray [..., N, K]."""
    kw = q.codes.shape[-1]
    g = word_groups(q.fmt, kw * 8)
    return g, kw // g


def word_planes(q: QArray, dtype) -> jax.Array:
    """The 8 nibble planes of a word-layout QArray [..., N, K], decoded and scaled as one broadcast
    expression (for XLA to fuse into the consuming matmul): [8, ..., N, groups, G/8] in `dtype`, plane i
    word j of group g = W[..., n, g·G + i·G/8 + j] (the word layout, module docstring)."""
    *lead, n, kw = q.codes.shape
    g, gw = _word_groups_of(q)
    one = (1,) * len(lead)
    i = jax.lax.broadcasted_iota(jnp.uint32, (8, *one, 1, 1, 1), 0)
    vals = decode_e2m1_float((q.codes.reshape(1, *lead, n, g, gw) >> (4 * i)) & 0xF)  # [8, ..., N, g, G/8]
    nl = len(lead)
    halves = q.scale.reshape(*lead, n, g, 2, gw // 32)
    halves = jnp.moveaxis(halves, nl + 2, 0)                                          # [2, ..., N, g, G/256]
    b = (jnp.tile(halves, (4,) + (1,) * (nl + 3)) >> (8 * (i // 2))) & 0xFF          # plane i: half i % 2
    return (vals * jnp.repeat(decode_e8m0(b), 32, axis=-1)).astype(dtype)


ROW_TILE = 8      # `matmul_blocks` pads x's rows to a multiple of this (the TPU sublane count)


def blocks_fit(q: QArray, rows: int, groups: int = 1) -> bool:
    """Whether `matmul_blocks` takes x [rows, ..., K] · Wᵀ: a [N, K] weight with int8 / e4m3 codes and e8m0
    scales (powers of two: scaling x by one is exact) over 2-D blocks (br, bc) that tile each of the
    `groups` row groups of W and K exactly, and rows ≤ br / 2: then its scaled copies of x, [rows, N/br, K]
    in a 16-bit dtype, are no larger than the 8-bit codes (beyond, e.g. at prefill, x · dequantize(W)ᵀ)."""
    if q.ndim != 2 or q.fmt.codes not in ("e4m3", "int8") or q.fmt.scale != "e8m0":
        return False
    n, k = q.shape
    br, bc = resolved_block(q.fmt, q.shape)
    return br > 1 and bc > 1 and n % (groups * br) == 0 and k % bc == 0 and rows <= br // 2


def matmul_blocks(x: jax.Array, q: QArray, groups: int = 0, row_tile: int = ROW_TILE) -> jax.Array:
    """x Wᵀ for a block-scaled [N, K] QArray (`blocks_fit`) without a per-element scale: x [..., K] ->
    [..., N]; with groups G: x [..., G, K], W [G·R, K] -> [..., G, R] (u_g = W_g x_g).

    The block scales multiply x, not W: x is copied once per row block of W and scaled per column block
    ([..., R/br, K], small while few tokens), then contracted with the codes converted to the compute dtype
    as one matmul batched over the row blocks, x's rows (tokens) zero-padded to a multiple of `row_tile`
    (0: none). W's values are code · 2^e and x's copies x · 2^e, so every
    product equals the dequantized path's; only the float32 summation order differs. The dequantized path
    broadcasts the [N/br, K/bc] scales to a [N, K] array first; the contraction-blocked form (partial sums
    [..., K/bc, N] × scales) and, for one token, a per-block multiply-reduce compile to more bytes on TPU
    (experiments/results/aot_release_ep_2026-12-04.md)."""
    n, k = q.shape
    br, bc = resolved_block(q.fmt, q.shape)
    g = groups or 1
    r = n // g
    dt = jnp.result_type(x.dtype, q.dtype)
    lead = x.shape[:-2] if groups else x.shape[:-1]
    t = math.prod(lead)
    tp = -(-t // row_tile) * row_tile if row_tile else t
    # the rows padded to a multiple of row_tile (zeros, sliced off): XLA:TPU rewrites a batched dot with
    # fewer rows (one decode token) into x broadcast over W's rows, [R/br, br, K] f32 in HBM on v5p
    xt = jnp.pad(x.astype(dt).reshape(t, g, k), ((0, tp - t), (0, 0), (0, 0)))            # [T', G, K]
    s = decode_scale(q.scale, q.fmt).astype(dt).reshape(g, r // br, k // bc, 1)         # [G, R/br, K/bc, 1]
    xs = (xt.reshape(tp, g, 1, k // bc, bc) * s).reshape(tp, g, r // br, k)             # [T', G, R/br, K]
    w = q.codes.astype(dt).reshape(g, r // br, br, k)                                   # [G, R/br, br, K]
    y = jnp.einsum("tgbk,gbjk->tgbj", xs, w, preferred_element_type=jnp.float32).astype(dt)[:t]
    return y.reshape(*lead, g, r) if groups else y.reshape(*lead, n)


def words_fit(q: QArray, group: int = 0) -> bool:
    """Whether `to_words(q, group)` converts q: FP4, groups (0: the last dim) a multiple of 256 dividing it."""
    k = q.shape[-1]
    g = group or k
    return q.fmt == FP4 and g % 256 == 0 and k % g == 0


def to_words(q: QArray, group: int = 0) -> QArray:
    """An FP4 QArray [..., N, K] in the word layout `words_format(group)` (module docstring; group 0: the
    whole K): the same values, codes uint32 [..., N, K/8], scales uint32 [..., N, K/128]. A weight whose K
    is split over S shards needs group = K / S (or a divisor of it) to stay right per shard."""
    if q.fmt != FP4:
        raise ValueError(f"to_words converts {FP4.name} weights, got {q.fmt.name}")
    if not words_fit(q, group):
        raise ValueError(f"to_words needs column groups that are a multiple of 256 and divide the last dim, got "
                         f"group {group or q.shape[-1]} for shape {q.shape}")
    *lead, n, k = q.shape
    g = group or k
    nib = jnp.stack([q.codes & 0xF, q.codes >> 4], axis=-1).reshape(*lead, n, k // g, 8, g // 8)
    sc = q.scale.reshape(*lead, n, k // g, 4, g // 128)
    pack = lambda a, bits: sum(a[..., i, :].astype(jnp.uint32) << (bits * i) for i in range(a.shape[-2]))
    return QArray(pack(nib, 4).reshape(*lead, n, k // 8).astype(jnp.uint32),
                  pack(sc, 8).reshape(*lead, n, k // 128).astype(jnp.uint32), words_format(group), q.dtype)


# ---- indexing without dequantizing the whole weight ----------------------------------------------------

def take(q: QArray, idx) -> QArray:
    """q[idx] along the leading axis (experts, layers: never blocked): codes and scales gathered."""
    if q.ndim < 3:
        raise ValueError(f"take indexes a leading (unblocked) axis; {q.fmt.name} weight of shape {q.shape} has none")
    return QArray(q.codes[idx], q.scale[idx], q.fmt, q.dtype)


def take_rows(q: QArray, ids: jax.Array, dtype=None) -> jax.Array:
    """Rows ids [...] of a [N, K] weight (embedding lookup) -> dense [..., K]: only those rows are decoded."""
    if q.ndim != 2:
        raise ValueError(f"take_rows needs a [N, K] weight, got shape {q.shape}")
    n, k = q.shape
    br, bc = scale_block(q.fmt, q.shape)
    vals = decode_codes(q.codes[ids], q.fmt)                               # [..., K]
    s = decode_scale(q.scale[ids // br], q.fmt)                            # [..., ⌈K/bc⌉]
    s = jnp.repeat(s, bc, axis=-1)[..., :k] if bc > 1 else s
    return (vals * s).astype(q.dtype if dtype is None else dtype)


# ---- quantization (jnp): tests, benchmarks, and weights quantized on the device --------------------------

def _block_amax(w: jax.Array, block: tuple[int, int]) -> jax.Array:
    """max |w| per block: [..., N, K] -> [..., ⌈N/br⌉, ⌈K/bc⌉] (partial blocks zero-padded)."""
    *lead, n, k = w.shape
    br, bc = block
    pn, pk = -(-n // br) * br, -(-k // bc) * bc
    a = jnp.pad(jnp.abs(w.astype(jnp.float32)), [(0, 0)] * len(lead) + [(0, pn - n), (0, pk - k)])
    return jnp.max(a.reshape(*lead, pn // br, br, pk // bc, bc), axis=(-3, -1))


def quantize(w: jax.Array, fmt: QFormat | str, dtype=None) -> QArray:
    """Dense w [..., N, K] -> QArray. e8m0 scales are 2^⌈log2(amax / qmax)⌉ (the release's rounding up),
    linear scales amax / qmax; codes round to nearest (even), e2m1 / e4m3 by the float cast."""
    fmt = qformat(fmt)
    if fmt.codes not in QMAX:
        raise ValueError(f"quantize does not make {fmt.name} directly; quantize to {FP4.name}, then `to_words`")
    *_, n, k = w.shape
    block = resolved_block(fmt, w.shape)
    amax = _block_amax(w, block)
    qmax = QMAX[fmt.codes]
    if fmt.scale == "e8m0":
        e = jnp.ceil(jnp.log2(jnp.maximum(amax, 1e-30) / qmax)).astype(jnp.int32)
        scale = jnp.clip(e + 127, 1, 254).astype(jnp.uint8)
    else:
        scale = jnp.where(amax > 0, amax / qmax, 1.0).astype(SCALES[fmt.scale])
    x = w.astype(jnp.float32) / expand_scale(decode_scale(scale, fmt), block, n, k)
    if fmt.codes == "int8":
        codes = jnp.clip(jnp.round(x), -127, 127).astype(jnp.int8)
    elif fmt.codes == "e4m3":
        codes = jnp.clip(x, -448, 448).astype(jnp.float8_e4m3fn)
    else:
        f4 = jnp.clip(x, -6, 6).astype(jnp.float4_e2m1fn)
        nib = jax.lax.bitcast_convert_type(f4, jnp.uint4).astype(jnp.uint8)
        codes = nib[..., 0::2] | (nib[..., 1::2] << 4)
    return QArray(codes, scale, fmt, w.dtype if dtype is None else dtype)


def quantize_tree(tree, formats, dtype=None):
    """Quantize the leaves of a weight tree: formats(path, leaf) -> QFormat | None (None: kept dense).

    path is the flat dot path ("segments.0.1.attn.wq_a"); see `params.release_format` for the release."""
    def one(path, x):
        flat = ".".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)
        fmt = formats(flat, x)
        return x if fmt is None else quantize(x, fmt, dtype)

    return jax.tree_util.tree_map_with_path(one, tree)
