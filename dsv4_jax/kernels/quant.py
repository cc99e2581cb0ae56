"""Weight-only quantization of expert matrices for the MoE kernels.

A quantized matrix W [..., N, K] (N output rows, K contraction) is (codes, scales): codes int8 or
float8_e4m3fn [..., N, K], scales float32 [..., N/br, K/bc]; W ≈ codes · scales[n // br, k // bc].
Per-channel is (br, bc) = (1, K); DeepSeek's FP8 release is (128, 128). Kernels dequantize tile by tile,
so the weights cross HBM at 1 byte per element.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

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


def dequantize(codes: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
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
    return {n: dequantize(p[n], p[n + "_scale"], dtype) for n in EXPERT_MATRICES}
