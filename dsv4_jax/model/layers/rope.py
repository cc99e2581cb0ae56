"""Rotary embeddings: two tables, interleaved pairs on the trailing channels (docs/model_math.md §2.0).

`main` (θ = rope_theta, no scaling) serves sliding-only layers; `compress` (θ = compress_rope_theta,
YaRN frequency blend, no mscale) serves every CSA/HCA layer, their compressed rows and the indexer.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ...config import SLIDING, ModelConfig


def _theta_powers(theta: float, r: int) -> np.ndarray:
    """θ^(2i/r), i < r/2, float32: the exponents in float32 (as the reference computes them), the power
    correctly rounded to float32 (computed in float64). The reference's float32 `pow` (transformers'
    `base ** (arange(0, r, 2) / r)`) agrees with this on Flash's tables; numpy's float32 `pow` does not (it
    differs by 1-2 ulp in 8 of Flash's 64 entries, an angle error of ~2e-4 rad at position 6K — enough to
    flip the indexer's near-tied top-k at long contexts). docs/model_math.md §2.0."""
    exps = np.arange(0, r, 2, dtype=np.float32) / np.float32(r)
    return (np.float64(np.float32(theta)) ** exps.astype(np.float64)).astype(np.float32)


def inv_freq(config: ModelConfig, kind: str) -> np.ndarray:
    """Inverse frequencies f_i, i < r/2, float32, with the reference's float32 operation order (every
    step after the power is one correctly rounded float32 op). kind: 'main' | 'compress'."""
    r = config.rope_head_dim
    theta = config.rope_theta if kind == "main" else config.compress_rope_theta
    powers = _theta_powers(theta, r)
    f = (np.float32(1.0) / powers).astype(np.float32)
    y = config.yarn
    if kind == "main" or y is None:
        return f

    def correction_dim(n_rot):
        return r * math.log(y.original_max_position_embeddings / (n_rot * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
    if y.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, r - 1)
    if lo == hi:
        hi += 0.001
    ramp = np.clip((np.arange(r // 2, dtype=np.float32) - np.float32(lo)) / np.float32(hi - lo), 0, 1)
    keep = (np.float32(1) - ramp).astype(np.float32)   # 1: original frequency, 0: divided by factor
    interp = (np.float32(1.0) / (np.float32(y.factor) * powers)).astype(np.float32)
    return (interp * (1 - keep) + f * keep).astype(np.float32)


def layer_rope_kind(layer_type: str) -> str:
    return "main" if layer_type == SLIDING else "compress"


def apply_rope(x: jax.Array, positions: jax.Array, freqs: np.ndarray, inverse: bool = False) -> jax.Array:
    """Rotate the trailing 2·len(freqs) channels of x in interleaved pairs (complex-multiply convention).

    x: [..., S, (H,) d]; positions: int [..., S] matching x's leading axes. Computed in float32.
    `inverse=True` rotates by −φ (used on the attention output, whose values carry RoPE).
    """
    r = 2 * freqs.shape[0]
    extra = x.ndim - positions.ndim - 1          # head axes between S and d
    ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(freqs)       # [..., S, r/2]
    ang = ang.reshape(ang.shape[:-1] + (1,) * extra + ang.shape[-1:])
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    if inverse:
        sin = -sin
    xr = x[..., -r:].astype(jnp.float32)
    a, b = xr[..., 0::2], xr[..., 1::2]
    rot = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(xr.shape)
    return jnp.concatenate([x[..., :-r], rot.astype(x.dtype)], axis=-1)
