"""Quantized tensors on the host (numpy): the official FP8 / FP4 releases and GGML blocks.

A quantized source tensor becomes the model's own leaf type, `dsv4_jax.ops.quant.QArray`, with numpy
children (format tables in `ops.quant`; docs/checkpoint_formats.md §1.3, §3, §4):

  fp8_e4m3_b128  codes float8_e4m3fn [..., out, in], scale uint8 (ue8m0) [..., ⌈out/128⌉, ⌈in/128⌉]
  fp4_e2m1_b32   codes uint8 [..., out, in/2] (low nibble = element 2k), scale uint8 (ue8m0) [..., out, in/32]
  q8_0           codes int8 [..., in], scale float16 [..., in/32]

It is written to Orbax as is and restored into the same type on the device. GGML MXFP4 is repacked into
fp4_e2m1_b32 losslessly: same e2m1 codes and e8m0 byte, only the nibble order within each 32-block
differs (§1.3: GGML puts element j low and j+16 high). Other GGML types (K- and IQ-quants) are read as
`GGMLBlocks` (host only) and either dequantized exactly to float32 (gguf-py) or requantized to Q8_0
(`repack_q8_0`, lossy: int8 per 32 of the exactly dequantized values; see experiments/results/).
"""
from __future__ import annotations

import dataclasses

import gguf
import ml_dtypes
import numpy as np
from gguf import GGMLQuantizationType as T

from ...ops import quant
from ...ops.quant import FP4, FP8, Q8_0, QArray

GGML_PREFIX = "ggml_"

_U8 = np.arange(256, dtype=np.uint8)
# e8m0: 2^(b-127); b = 0 is the subnormal 2^-127, b = 255 NaN (ml_dtypes decodes both exactly, §3)
E8M0_F32 = _U8.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
E4M3_F32 = _U8.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
FP4_F32 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)

# GGML types read as raw blocks (docs/checkpoint_formats.md §2: those gguf-py can dequantize)
GGML_RAW_TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ1_S,
                            T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ4_NL, T.IQ4_XS,
                            T.TQ1_0, T.TQ2_0, T.NVFP4})


class FormatError(ValueError):
    """A tensor whose stored arrays do not fit its quantization format."""


@dataclasses.dataclass
class GGMLBlocks:
    """Raw GGML blocks of a K- / IQ-quant tensor (host only: repacked or dequantized at conversion)."""

    qtype: T
    raw: np.ndarray          # uint8 [..., in/block · type_size]
    shape: tuple[int, ...]   # logical [..., in]

    @property
    def fmt(self) -> str:
        return GGML_PREFIX + self.qtype.name

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes


def host(codes: np.ndarray, scale: np.ndarray, fmt) -> QArray:
    """A QArray with numpy children (float32 as its nominal dequantized dtype)."""
    return QArray(codes, scale, fmt, np.float32)


def check(q: QArray, what: str = "tensor", shape=None) -> QArray:
    """Raise FormatError unless codes / scale fit the format (and give the logical `shape` if given)."""
    try:
        quant.check(q, what)
    except ValueError as e:
        raise FormatError(str(e)) from None
    if shape is not None and tuple(q.shape) != tuple(shape):
        raise FormatError(f"{what}: {q.fmt.name} codes of shape {q.codes.shape} give shape {q.shape}, "
                          f"expected {tuple(shape)}")
    return q


def ggml_shape(qtype: T, raw_shape) -> tuple[int, ...]:
    *lead, last = raw_shape
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    if last % ts:
        raise FormatError(f"{qtype.name}: row of {last} bytes is not a whole number of {ts}-byte blocks")
    return (*lead, last // ts * bs)


# ---- GGML blocks -> stored arrays ---------------------------------------------------------

def split_q8_0(raw: np.ndarray) -> QArray:
    """GGML Q8_0 rows uint8 [..., nb·34] -> codes int8 [..., nb·32], scale f16 [..., nb] (block = f16 d, 32 × int8)."""
    *lead, nbytes = raw.shape
    nb = nbytes // 34
    b = np.asarray(raw).reshape(*lead, nb, 34)
    scale = np.ascontiguousarray(b[..., :2]).view(np.float16).reshape(*lead, nb)
    codes = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(*lead, nb * 32)
    return host(codes, scale, Q8_0)


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


def repack_mxfp4(raw: np.ndarray, chunk: int = 1 << 14) -> QArray:
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
    return host(codes.reshape(*lead, nb * 16), scale.reshape(*lead, nb), FP4)


def ggml_raw(raw: np.ndarray, qtype: T) -> GGMLBlocks:
    return GGMLBlocks(qtype, np.asarray(raw), ggml_shape(qtype, raw.shape))


def quantize_q8_0(x: np.ndarray) -> QArray:
    """float32 [..., in] -> Q8_0 through gguf-py's own quantizer (ggml's rounding), split into codes / scale."""
    return split_q8_0(gguf.quants.quantize(np.ascontiguousarray(x, np.float32), T.Q8_0))


def repack_q8_0(g: GGMLBlocks) -> tuple[QArray, float]:
    """K- / IQ-quant blocks -> Q8_0 of their exact float32 values; returns (Q8_0 QArray, max |error| / max |value|).

    The error per weight is at most half a Q8_0 step, max|block of 32| / 254 (plus the f16 rounding of the
    block scale): far below the K-quant's own step for ≤ 6-bit types."""
    x = dequantize(g)
    if x.shape[-1] % 32:
        raise FormatError(f"{g.fmt}: rows of {x.shape[-1]} values cannot be repacked to Q8_0 (blocks of 32)")
    q = quantize_q8_0(x)
    err = float(np.max(np.abs(dequantize(q) - x))) if x.size else 0.0
    return q, err / max(float(np.max(np.abs(x))) if x.size else 0.0, 1e-30)


# ---- slicing (for fused tensors) ------------------------------------------------------------

def _ggml_geometry(qtype: T) -> tuple[int, int]:
    return gguf.GGML_QUANT_SIZES[qtype]


def slice_axis(q, axis: int, lo: int, hi: int):
    """Logical `[..., lo:hi, ...]` along `axis` (block-aligned) of a QArray or GGMLBlocks."""
    nd = len(q.shape)
    axis %= nd
    cs = [slice(None)] * nd
    if isinstance(q, GGMLBlocks):
        bs, ts = _ggml_geometry(q.qtype)
        if axis == nd - 1:
            if lo % bs or hi % bs:
                raise FormatError(f"cannot split a {q.fmt} tensor at column {lo}:{hi} (blocks of {bs})")
            cs[axis] = slice(lo // bs * ts, hi // bs * ts)
        else:
            cs[axis] = slice(lo, hi)
        shape = list(q.shape)
        shape[axis] = hi - lo
        return GGMLBlocks(q.qtype, q.raw[tuple(cs)], tuple(shape))
    ss = [slice(None)] * nd
    br, bc = quant.resolved_block(q.fmt, q.shape)
    if axis >= nd - 2:
        b = bc if axis == nd - 1 else br
        if b > 1 and (lo % b or hi % b):
            raise FormatError(f"cannot split a {q.fmt.name} tensor at {lo}:{hi} along axis {axis} (blocks of {b})")
        pack = q.fmt.pack if axis == nd - 1 else 1
        cs[axis] = slice(lo // pack, hi // pack)
        ss[axis] = slice(lo // b, hi // b)
    else:
        cs[axis] = ss[axis] = slice(lo, hi)
    return QArray(q.codes[tuple(cs)], q.scale[tuple(ss)], q.fmt, q.dtype)


def stack(qs: list):
    """Stack per-expert QArrays (or GGMLBlocks) of one format on a new leading axis."""
    fmts = {q.fmt for q in qs}
    if len(fmts) != 1:
        raise FormatError(f"experts stored in mixed formats {sorted(str(f) for f in fmts)}")
    if isinstance(qs[0], GGMLBlocks):
        return GGMLBlocks(qs[0].qtype, np.stack([q.raw for q in qs]), (len(qs), *qs[0].shape))
    return QArray(np.stack([q.codes for q in qs]), np.stack([q.scale for q in qs]), qs[0].fmt, qs[0].dtype)


# ---- dequantization (float32, exact) ---------------------------------------------------------

def dequant_fp8(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """W[i, j] = e4m3(codes[i, j]) · e8m0(scale[i // 128, j // 128]) (§3)."""
    *_, out, inn = codes.shape
    s = E8M0_F32[scale]
    s = np.repeat(np.repeat(s, 128, axis=-2)[..., :out, :], 128, axis=-1)[..., :inn]
    return E4M3_F32[np.asarray(codes).view(np.uint8)] * s


def dequant_fp4(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """W[i, 2k] = e2m1(lo(codes[i, k])) · e8m0(scale[i, 2k // 32]), W[i, 2k+1] from the high nibble (§3)."""
    vals = np.stack([FP4_F32[codes & 0xF], FP4_F32[codes >> 4]], axis=-1).reshape(*codes.shape[:-1], -1)
    s = E8M0_F32[scale]
    return (vals.reshape(*s.shape, 32) * s[..., None]).reshape(vals.shape)


def dequant_q8_0(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    c = codes.astype(np.float32).reshape(*scale.shape, 32)
    return (c * scale.astype(np.float32)[..., None]).reshape(codes.shape)


def dequantize(q) -> np.ndarray:
    """float32 array of shape `q.shape` (a QArray of a release / GGML format, or GGMLBlocks)."""
    if isinstance(q, GGMLBlocks):
        out = gguf.quants.dequantize(np.asarray(q.raw), q.qtype)
        return np.asarray(out, np.float32).reshape(q.shape)
    codes, scale = np.asarray(q.codes), np.asarray(q.scale)
    if q.fmt == FP8:
        return dequant_fp8(codes, scale)
    if q.fmt == FP4:
        return dequant_fp4(codes, scale)
    if q.fmt == Q8_0:
        return dequant_q8_0(codes, scale)
    raise FormatError(f"no host dequantizer for format {q.fmt.name}")
