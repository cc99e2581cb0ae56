"""MoE routing kernel (docs/model_math.md §2.8; math: `ops.moe.route_from_logits`): s = sqrt(softplus(l)), top-k of s + bias (or hash ids),
w = s[idx] / (Σ s[idx] + eps) · routed_scaling_factor.

The router matmul l = x·W_rᵀ stays in XLA (a [T,D]×[D,E] GEMV, exactly as in `ops.moe.route_from_logits`), so the
kernel sees the same float32 logits. The kernel fuses sqrt-softplus, the bias, the selection (k rounds of
(max, lowest index attaining it): `lax.top_k`'s order, ties included) and the gather s[idx]; the [T,k]
normalisation stays in jnp so its reduction order is the reference's. In interpret mode the result equals
the reference bit for bit; on GPU softplus/sqrt may differ from XLA's by an ulp.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ..ops.moe import Router, normalize_weights
from .common import block, compiler_params


def _route_kernel(*refs, k: int, hashed: bool):
    """Selected ids and their unnormalised scores s[idx], both [bT, kp] (kp = k rounded up to 2^n)."""
    if hashed:
        logits_ref, idx_ref, idx_out, w_out = refs
    else:
        logits_ref, bias_ref, idx_out, w_out = refs
    s = jnp.sqrt(jax.nn.softplus(logits_ref[...]))                  # [bT, E]
    col = jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    n_col = s.shape[1]
    if hashed:
        kcol0 = jax.lax.broadcasted_iota(jnp.int32, idx_ref.shape, 1)
        hid = idx_ref[...]
        picks = [jnp.sum(jnp.where(kcol0 == j, hid, 0), axis=1, keepdims=True) for j in range(k)]
    else:
        v = s + bias_ref[...]
        picks = []
        for _ in range(k):
            m = jnp.max(v, axis=1, keepdims=True)
            i = jnp.min(jnp.where(v == m, col, n_col), axis=1, keepdims=True)   # lowest index on ties
            picks.append(i)
            v = jnp.where(col == i, -jnp.inf, v)
    # Columns stay [bT, 1] and the output is padded to a power of two (Triton tensors): kp >= k.
    ws = [jnp.sum(jnp.where(col == i, s, 0.0), axis=1, keepdims=True) for i in picks]
    kp = idx_out.shape[1]
    kcol = jax.lax.broadcasted_iota(jnp.int32, (s.shape[0], kp), 1)
    idx = jnp.zeros((s.shape[0], kp), jnp.int32)
    w = jnp.zeros((s.shape[0], kp), jnp.float32)
    for j, (i, wj) in enumerate(zip(picks, ws)):
        idx = jnp.where(kcol == j, i, idx)
        w = jnp.where(kcol == j, wj, w)
    idx_out[...] = idx
    w_out[...] = w


@functools.partial(jax.jit, static_argnames=("router", "interpret"))
def route_from_logits(logits, bias, hash_idx, *, router: Router, interpret: bool = True):
    """logits f32 [T,E], bias f32 [E] (or None), hash_idx int [T,k] (or None) -> (idx int32 [T,k], w f32 [T,k])."""
    k = router.k
    T, E = logits.shape
    hashed = hash_idx is not None
    Ep = max(8, 1 << (E - 1).bit_length())                      # Triton blocks are powers of two
    logits = jnp.pad(logits.astype(jnp.float32), ((0, 0), (0, Ep - E)), constant_values=-jnp.inf)
    kp = max(2, 1 << (k - 1).bit_length())
    bT = block(T, 16)
    rows = lambda n: pl.BlockSpec((bT, n), lambda t: (t, 0))
    if hashed:
        second = jnp.pad(hash_idx.astype(jnp.int32), ((0, 0), (0, kp - k)))
        second_spec = rows(kp)
    else:
        second = jnp.pad(bias.astype(jnp.float32), (0, Ep - E), constant_values=-jnp.inf)[None]
        second_spec = pl.BlockSpec((1, Ep), lambda t: (0, 0))
    kern = functools.partial(_route_kernel, k=k, hashed=hashed)
    idx, w = pl.pallas_call(
        kern, grid=(T // bT,), in_specs=[rows(Ep), second_spec], out_specs=[rows(kp), rows(kp)],
        out_shape=[jax.ShapeDtypeStruct((T, kp), jnp.int32), jax.ShapeDtypeStruct((T, kp), jnp.float32)],
        compiler_params=compiler_params(), interpret=interpret)(logits, second)
    # the same [T,k] normalisation as the reference (ops.moe.normalize_weights): the reduction order matches
    return idx[:, :k], normalize_weights(w[:, :k], norm=router.norm, eps=router.eps, scale=router.scale)

