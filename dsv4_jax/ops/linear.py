"""The one entry for a weight use outside the routed experts: y = x Wᵀ for a dense or quantized W.

W is a dense array or an `ops.quant.QArray` [..., N, K] (the checkpoints' [out, in] layout). A block-scaled
QArray (FP8) used by a few tokens (decode, verify: `quant.blocks_fit`) is multiplied per scale block without
a dequantized copy, `quant.matmul_blocks`. Otherwise a QArray is dequantized here, inside the caller's jit,
one matrix at a time (a layer's slice inside the layer scan), never a stacked layer set; the matmul then is
the dense path's. Either way a kept-quantized model computes the same values as one dequantized at load.
The routed experts have their own entry, `ops.moe.experts_*` (through `model.layers.moe.routed_experts`), which
gathers the active experts' codes before dequantizing.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from .quant import QArray, blocks_fit, dense, matmul_blocks, take_rows


def linear(x: jax.Array, w) -> jax.Array:
    """y = x Wᵀ: x [..., K], W [N, K] (dense or QArray) -> [..., N]."""
    if isinstance(w, QArray) and blocks_fit(w, math.prod(x.shape[:-1])):
        return matmul_blocks(x, w)
    return x @ dense(w).T


def grouped_linear(x: jax.Array, w, groups: int) -> jax.Array:
    """Per-group projections (grouped O-LoRA): x [..., G, K], W [G·R, K] -> [..., G, R] (u_g = W_g x_g)."""
    if isinstance(w, QArray) and blocks_fit(w, math.prod(x.shape[:-2]), groups):
        return matmul_blocks(x, w, groups)
    wd = dense(w)
    lead = "abcdef"[:x.ndim - 2]
    return jnp.einsum(f"{lead}gi,gri->{lead}gr", x, wd.reshape(groups, wd.shape[0] // groups, wd.shape[1]))


def embed(w, ids: jax.Array) -> jax.Array:
    """Rows of a [V, D] table: ids int [...] -> [..., D] (a QArray decodes only the gathered rows)."""
    if isinstance(w, QArray):
        return take_rows(w, ids)
    return w[ids]
