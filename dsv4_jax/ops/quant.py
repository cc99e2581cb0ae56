"""On-device dequantization of stored weight formats, and weight-only quantization for the kernels.

Checkpoint formats kept by `dsv4-convert --keep-quantized` (weight_formats.md §3-4; host-side twins in
`dsv4_jax.convert.quant_formats`):
  fp8_e4m3_b128  codes uint8 [..., out, in] (e4m3fn bits), scale uint8 (e8m0) [..., ⌈out/128⌉, ⌈in/128⌉]
  fp4_e2m1_b32   codes uint8 [..., out, in/2] (low nibble = element 2k), scale uint8 (e8m0) [..., out, in/32]
  q8_0           codes int8 [..., in], scale float16 [..., in/32]
FP8 and FP4 values times power-of-two scales are exact in bfloat16 and float32; q8_0 is exact in float32.

Kernel weight-only formats (`quantize`): a matrix W [..., N, K] (N output rows, K contraction) is
(codes, scales): codes int8 or float8_e4m3fn [..., N, K], scales float32 [..., N/br, K/bc];
W ≈ codes · scales[n // br, k // bc]. Per-channel is (br, bc) = (1, K); DeepSeek's FP8 release is
(128, 128). Kernels dequantize tile by tile, so the weights cross HBM at 1 byte per element.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

_U8 = np.arange(256, dtype=np.uint8)
_E8M0 = _U8.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
_E4M3 = _U8.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
_FP4 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)

DEVICE_FORMATS = ("fp8_e4m3_b128", "fp4_e2m1_b32", "q8_0")


@functools.partial(jax.jit, static_argnums=(2,))
def dequant_fp8(codes: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """codes uint8 [..., out, in], scale uint8 [..., ⌈out/128⌉, ⌈in/128⌉] -> dtype [..., out, in]."""
    out, inn = codes.shape[-2:]
    s = jnp.asarray(_E8M0)[scale]
    s = jnp.repeat(jnp.repeat(s, 128, axis=-2)[..., :out, :], 128, axis=-1)[..., :inn]
    return (jnp.asarray(_E4M3)[codes] * s).astype(dtype)


@functools.partial(jax.jit, static_argnums=(2,))
def dequant_fp4(codes: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """codes uint8 [..., out, in/2], scale uint8 [..., out, in/32] -> dtype [..., out, in]."""
    t = jnp.asarray(_FP4)
    vals = jnp.stack([t[codes & 0xF], t[codes >> 4]], axis=-1).reshape(*codes.shape[:-1], -1)
    s = jnp.asarray(_E8M0)[scale]
    return (vals.reshape(*s.shape, 32) * s[..., None]).reshape(vals.shape).astype(dtype)


@functools.partial(jax.jit, static_argnums=(2,))
def dequant_q8_0(codes: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """codes int8 [..., in], scale float16 [..., in/32] -> dtype [..., in]."""
    c = codes.astype(jnp.float32).reshape(*scale.shape, 32)
    return (c * scale.astype(jnp.float32)[..., None]).reshape(codes.shape).astype(dtype)


def dequantize(fmt: str, arrays: dict, dtype) -> jax.Array:
    """Dequantize one stored tensor ({"codes", "scale"}) of device format `fmt` to `dtype`."""
    fn = {"fp8_e4m3_b128": dequant_fp8, "fp4_e2m1_b32": dequant_fp4, "q8_0": dequant_q8_0}.get(fmt)
    if fn is None:
        raise ValueError(f"no device dequantizer for format {fmt!r}; known: {DEVICE_FORMATS}")
    return fn(arrays["codes"], arrays["scale"], jnp.dtype(dtype))


# ---- weight-only quantization of expert matrices (kernel formats) ----


FORMATS = {"int8": (jnp.int8, 127.0), "fp8": (jnp.float8_e4m3fn, 448.0)}
EXPERT_MATRICES = ("w1", "w2", "w3")


def quantize(w: jax.Array, fmt: str = "int8", block: tuple[int, int | None] = (1, None)):
    """w [..., N, K] -> (codes [..., N, K], scales f32 [..., N/br, K/bc]); block (br, bc), bc None = K."""
    dtype, qmax = FORMATS[fmt]
    *lead, N, K = w.shape
    br, bc = block[0], block[1] or K
    if N % br or K % bc:
        raise ValueError(f"block {block} does not divide [{N}, {K}]")
    blocks = w.astype(jnp.float32).reshape(*lead, N // br, br, K // bc, bc)
    amax = jnp.max(jnp.abs(blocks), axis=(-3, -1))
    scales = jnp.where(amax > 0, amax / qmax, 1.0)
    q = blocks / scales[..., :, None, :, None]
    q = jnp.round(q) if fmt == "int8" else q
    return q.reshape(w.shape).astype(dtype), scales


def scale_block(codes_shape, scales_shape) -> tuple[int, int]:
    """(br, bc) of a (codes, scales) pair."""
    return codes_shape[-2] // scales_shape[-2], codes_shape[-1] // scales_shape[-1]


def dequantize_blocks(codes: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
    br, bc = scale_block(codes.shape, scales.shape)
    s = jnp.repeat(jnp.repeat(scales, br, axis=-2), bc, axis=-1)
    return (codes.astype(jnp.float32) * s).astype(dtype)


def quantize_experts(p: dict, fmt: str = "int8", block: tuple[int, int | None] = (1, None)) -> dict:
    """{"w1","w2","w3"} -> same keys holding codes plus "w1_scale", "w2_scale", "w3_scale"."""
    out = {}
    for name in EXPERT_MATRICES:
        out[name], out[name + "_scale"] = quantize(p[name], fmt, block)
    return out


def is_quantized(p: dict) -> bool:
    return "w1_scale" in p


def dequantize_experts(p: dict, dtype) -> dict:
    if not is_quantized(p):
        return p
    return {n: dequantize_blocks(p[n], p[n + "_scale"], dtype) for n in EXPERT_MATRICES}
