"""On-device dequantization of the checkpoint formats kept by `dsv4-convert --keep-quantized`.

Formats (weight_formats.md §3-4; host-side twins in `dsv4_jax.convert.quant_formats`):
  fp8_e4m3_b128  codes uint8 [..., out, in] (e4m3fn bits), scale uint8 (e8m0) [..., ⌈out/128⌉, ⌈in/128⌉]
  fp4_e2m1_b32   codes uint8 [..., out, in/2] (low nibble = element 2k), scale uint8 (e8m0) [..., out, in/32]
  q8_0           codes int8 [..., in], scale float16 [..., in/32]
FP8 and FP4 values times power-of-two scales are exact in bfloat16 and float32; q8_0 is exact in float32.
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
