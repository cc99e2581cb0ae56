"""Quantized tensor formats on the host (numpy): the official FP8 / FP4 releases and GGML blocks.

A `QTensor` holds the stored arrays of one quantized tensor plus its format tag and logical
(dequantized) shape. Formats (weight_formats.md §1.3, §3, §4):

  fp8_e4m3_b128  codes uint8 (e4m3fn bits) [..., out, in], scale uint8 (ue8m0) [..., ⌈out/128⌉, ⌈in/128⌉]
  fp4_e2m1_b32   codes uint8 [..., out, in/2] (low nibble = element 2k), scale uint8 (ue8m0) [..., out, in/32]
  q8_0           codes int8 [..., in], scale float16 [..., in/32]
  ggml_<TYPE>    codes uint8, the raw GGML blocks [..., in/block·type_size] (K- and IQ-quants);
                 dequantized through `gguf.quants.dequantize`

GGML MXFP4 is repacked into fp4_e2m1_b32 losslessly: same e2m1 codes and e8m0 byte, only the
nibble order within each 32-block differs (§1.3: GGML puts element j low and j+16 high).
Every dequantization here is exact (FP8/FP4 times powers of two; Q8_0 in float32).
"""
from __future__ import annotations

import dataclasses

import gguf
import ml_dtypes
import numpy as np
from gguf import GGMLQuantizationType as T

FP8 = "fp8_e4m3_b128"
FP4 = "fp4_e2m1_b32"
Q8_0 = "q8_0"
GGML_PREFIX = "ggml_"

_U8 = np.arange(256, dtype=np.uint8)
# e8m0: 2^(b-127); b = 0 is the subnormal 2^-127, b = 255 NaN (ml_dtypes decodes both exactly, §3)
E8M0_F32 = _U8.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
E4M3_F32 = _U8.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
FP4_F32 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)

# GGML types kept as raw blocks and dequantized by gguf-py (weight_formats.md §2: those with a dequantizer)
GGML_RAW_TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ1_S,
                            T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ4_NL, T.IQ4_XS,
                            T.TQ1_0, T.TQ2_0, T.NVFP4})


class FormatError(ValueError):
    """A tensor whose stored arrays do not fit its quantization format."""


@dataclasses.dataclass
class QTensor:
    """One quantized tensor: format tag, stored arrays and logical shape."""

    fmt: str
    codes: np.ndarray
    scale: np.ndarray | None
    shape: tuple[int, ...]

    def arrays(self) -> dict[str, np.ndarray]:
        return {"codes": self.codes} if self.scale is None else {"codes": self.codes, "scale": self.scale}

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays().values())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def ggml_type(fmt: str) -> T:
    return T[fmt[len(GGML_PREFIX):]]


def block_geometry(fmt: str) -> tuple[int, int, int]:
    """(elements per code unit along the last axis, code units per block, elements per scale) of `fmt`."""
    if fmt == FP4:
        return 2, 16, 32
    if fmt == Q8_0:
        return 1, 32, 32
    if fmt == FP8:
        return 1, 128, 128
    bs, ts = gguf.GGML_QUANT_SIZES[ggml_type(fmt)]
    return bs, ts, bs  # ggml: a "unit" is one block of `bs` elements stored in `ts` bytes


def logical_shape(fmt: str, codes_shape) -> tuple[int, ...]:
    """Dequantized shape from the codes' shape."""
    *lead, last = codes_shape
    if fmt == FP4:
        return (*lead, 2 * last)
    if fmt.startswith(GGML_PREFIX):
        bs, ts = gguf.GGML_QUANT_SIZES[ggml_type(fmt)]
        if last % ts:
            raise FormatError(f"{fmt}: row of {last} bytes is not a whole number of {ts}-byte blocks")
        return (*lead, last // ts * bs)
    return tuple(codes_shape)


def expected_scale_shape(fmt: str, shape) -> tuple[int, ...] | None:
    *lead, last = shape
    if fmt == FP8:
        return (*lead[:-1], _cdiv(lead[-1], 128), _cdiv(last, 128))
    if fmt in (FP4, Q8_0):
        return (*lead, last // 32)
    return None


def check(q: QTensor, what: str = "tensor") -> QTensor:
    """Raise FormatError unless codes/scale shapes fit `q.fmt` and `q.shape`."""
    if logical_shape(q.fmt, q.codes.shape) != tuple(q.shape):
        raise FormatError(f"{what}: {q.fmt} codes of shape {q.codes.shape} do not give shape {q.shape}")
    if q.fmt in (FP4, Q8_0) and q.shape[-1] % 32:
        raise FormatError(f"{what}: {q.fmt} needs the input dim to be a multiple of 32, got {q.shape}")
    want = expected_scale_shape(q.fmt, q.shape)
    if want is not None and (q.scale is None or tuple(q.scale.shape) != want):
        got = None if q.scale is None else tuple(q.scale.shape)
        raise FormatError(f"{what}: {q.fmt} scale has shape {got}, expected {want}")
    return q


# ---- GGML blocks -> stored arrays ---------------------------------------------------------

def split_q8_0(raw: np.ndarray) -> QTensor:
    """GGML Q8_0 rows uint8 [..., nb·34] -> codes int8 [..., nb·32], scale f16 [..., nb] (block = f16 d, 32 × int8)."""
    *lead, nbytes = raw.shape
    nb = nbytes // 34
    b = np.asarray(raw).reshape(*lead, nb, 34)
    scale = np.ascontiguousarray(b[..., :2]).view(np.float16).reshape(*lead, nb)
    codes = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(*lead, nb * 32)
    return QTensor(Q8_0, codes, scale, (*lead, nb * 32))


def _repack_blocks(b: np.ndarray, codes: np.ndarray, scale: np.ndarray) -> None:
    """b uint8 [n, 17] GGML blocks -> codes [n, 16] (official order), scale [n] (in place).

    Read qs as little-endian pairs v = qs[2k] | qs[2k+1] << 8: official byte k (< 8) holds elements
    (2k, 2k+1) = the low nibbles of the pair, byte 8+k elements (2k+16, 2k+17) = their high nibbles.
    """
    scale[:] = b[:, 0]
    v = np.ascontiguousarray(b[:, 1:]).view("<u2")               # [n, 8]
    t = v >> 4
    lo = v & 0x0F
    lo |= t & 0xF0                                                # (lo nibble of qs[2k]) | (lo of qs[2k+1]) << 4
    np.copyto(codes[:, :8], lo, casting="unsafe")
    t &= 0x0F
    t |= (v >> 8) & 0xF0                                          # (hi nibble of qs[2k]) | (hi of qs[2k+1]) << 4
    np.copyto(codes[:, 8:], t, casting="unsafe")


def repack_mxfp4(raw: np.ndarray, chunk: int = 1 << 14) -> QTensor:
    """GGML MXFP4 rows uint8 [..., nb·17] -> fp4_e2m1_b32 (official nibble order) codes [..., nb·16], scale [..., nb].

    A GGML block is (e8m0 e, 16 bytes qs) with element j in the low nibble of qs[j] and element j+16 in
    its high nibble; the official packing holds elements (2k, 2k+1) in (low, high) of byte k. GGML's
    kvalues are twice the e2m1 values and its scale half of 2^(e-127), so codes and e carry over as is.
    Vectorised over 16-bit pairs, in cache-sized chunks (~900 MB/s on one core of the 2-core VM).
    """
    *lead, nbytes = raw.shape
    nb = nbytes // 17
    b = np.asarray(raw).reshape(-1, 17)
    codes = np.empty((b.shape[0], 16), np.uint8)
    scale = np.empty(b.shape[0], np.uint8)
    for i in range(0, b.shape[0], chunk):
        _repack_blocks(b[i:i + chunk], codes[i:i + chunk], scale[i:i + chunk])
    return QTensor(FP4, codes.reshape(*lead, nb * 16), scale.reshape(*lead, nb), (*lead, nb * 32))


def ggml_raw(raw: np.ndarray, qtype: T) -> QTensor:
    fmt = GGML_PREFIX + qtype.name
    return QTensor(fmt, np.asarray(raw), None, logical_shape(fmt, raw.shape))


# ---- slicing (for fused tensors) ------------------------------------------------------------

def slice_axis(q: QTensor, axis: int, lo: int, hi: int) -> QTensor:
    """Logical `[..., lo:hi, ...]` along `axis` (block-aligned) of a QTensor."""
    nd = len(q.shape)
    axis %= nd
    shape = list(q.shape)
    shape[axis] = hi - lo
    cs = [slice(None)] * nd
    ss = [slice(None)] * nd
    per_unit, units_per_block, per_scale = block_geometry(q.fmt)
    if axis == nd - 1:
        if lo % per_scale or hi % per_scale:
            raise FormatError(f"cannot split a {q.fmt} tensor at column {lo}:{hi} (blocks of {per_scale})")
        if q.fmt.startswith(GGML_PREFIX):
            cs[axis] = slice(lo // per_unit * units_per_block, hi // per_unit * units_per_block)
        else:
            cs[axis] = slice(lo // per_unit, hi // per_unit)
        ss[axis] = slice(lo // per_scale, hi // per_scale)
    else:
        cs[axis] = slice(lo, hi)
        if q.fmt == FP8 and axis == nd - 2:
            if lo % 128 or hi % 128:
                raise FormatError(f"cannot split an FP8 tensor at row {lo}:{hi} (128-row blocks)")
            ss[axis] = slice(lo // 128, hi // 128)
        else:
            ss[axis] = slice(lo, hi)
    scale = None if q.scale is None else q.scale[tuple(ss)]
    return QTensor(q.fmt, q.codes[tuple(cs)], scale, tuple(shape))


def stack(qs: list[QTensor]) -> QTensor:
    """Stack per-expert QTensors of one format on a new leading axis."""
    fmts = {q.fmt for q in qs}
    if len(fmts) != 1:
        raise FormatError(f"experts stored in mixed formats {sorted(fmts)}")
    scale = None if qs[0].scale is None else np.stack([q.scale for q in qs])
    return QTensor(qs[0].fmt, np.stack([q.codes for q in qs]), scale, (len(qs), *qs[0].shape))


# ---- dequantization (float32, exact) ---------------------------------------------------------

def dequant_fp8(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """W[i, j] = e4m3(codes[i, j]) · e8m0(scale[i // 128, j // 128]) (§3)."""
    *_, out, inn = codes.shape
    s = E8M0_F32[scale]
    s = np.repeat(np.repeat(s, 128, axis=-2)[..., :out, :], 128, axis=-1)[..., :inn]
    return E4M3_F32[codes] * s


def dequant_fp4(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """W[i, 2k] = e2m1(lo(codes[i, k])) · e8m0(scale[i, 2k // 32]), W[i, 2k+1] from the high nibble (§3)."""
    vals = np.stack([FP4_F32[codes & 0xF], FP4_F32[codes >> 4]], axis=-1).reshape(*codes.shape[:-1], -1)
    s = E8M0_F32[scale]
    return (vals.reshape(*s.shape, 32) * s[..., None]).reshape(vals.shape)


def dequant_q8_0(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    c = codes.astype(np.float32).reshape(*scale.shape, 32)
    return (c * scale.astype(np.float32)[..., None]).reshape(codes.shape)


def dequantize(q: QTensor) -> np.ndarray:
    """float32 array of shape `q.shape`."""
    if q.fmt == FP8:
        return dequant_fp8(np.asarray(q.codes), np.asarray(q.scale))
    if q.fmt == FP4:
        return dequant_fp4(np.asarray(q.codes), np.asarray(q.scale))
    if q.fmt == Q8_0:
        return dequant_q8_0(np.asarray(q.codes), np.asarray(q.scale))
    if q.fmt.startswith(GGML_PREFIX):
        out = gguf.quants.dequantize(np.asarray(q.codes), ggml_type(q.fmt))
        return np.asarray(out, np.float32).reshape(q.shape)
    raise FormatError(f"unknown quantization format {q.fmt!r}")
