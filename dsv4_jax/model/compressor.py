"""KV compressors: HCA (non-overlapping, §2.5) and CSA / indexer (overlapping, §2.6).

A compressor projects each token to (a_t, z_t) = (W_kv h_t, W_gate h_t + B[t mod m]) and pools
every complete window of m tokens with a per-channel softmax over its slots. The overlapping form
pools 2m slots for row w: the A-halves `[:dim]` of window w−1 and the B-halves `[dim:]` of window w
(window 0 gets −inf gates for its A-slots). Row w is RMS-normed and roped at position w·m.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .norms import rms_norm
from .rope import apply_rope


def project(h: jax.Array, p: dict) -> tuple[jax.Array, jax.Array]:
    """(a, z) without the position bias: [B,S,D] -> 2 × [B,S,cd] (z in float32)."""
    a = h @ p["wkv"].T
    z = (h @ p["wgate"].T).astype(jnp.float32)
    return a, z


def pool(a: jax.Array, z: jax.Array) -> jax.Array:
    """Softmax-weighted sum over the slot axis (-2), per channel; softmax in float32. [..., slots, c] -> [..., c]."""
    w = jax.nn.softmax(z.astype(jnp.float32), axis=-2)
    return jnp.sum(w * a.astype(jnp.float32), axis=-2).astype(a.dtype)


def overlap_slots(a: jax.Array, z: jax.Array, dim: int) -> tuple[jax.Array, jax.Array]:
    """Build the 2m overlapped slots of each window. a, z: [B, nW, m, 2·dim] -> [B, nW, 2m, dim]."""
    B, nW, m, _ = a.shape
    a_prev = jnp.concatenate([jnp.zeros((B, 1, m, dim), a.dtype), a[:, :-1, :, :dim]], axis=1)
    z_prev = jnp.concatenate([jnp.full((B, 1, m, dim), -jnp.inf, z.dtype), z[:, :-1, :, :dim]], axis=1)
    return (jnp.concatenate([a_prev, a[..., dim:]], axis=2),
            jnp.concatenate([z_prev, z[..., dim:]], axis=2))


def finish_rows(rows: jax.Array, norm_w: jax.Array, row_positions: jax.Array, freqs: np.ndarray,
                eps: float) -> jax.Array:
    """RMSNorm then RoPE at the window's first position. rows [B,T,dim], row_positions int [B,T]."""
    return apply_rope(rms_norm(rows, norm_w, eps), row_positions, freqs)


def compress_sequence(h: jax.Array, p: dict, ratio: int, dim: int, overlap: bool, freqs: np.ndarray,
                      eps: float) -> jax.Array:
    """All complete-window rows of a full sequence starting at position 0: [B,S,D] -> [B, S//ratio, dim]."""
    B, S, _ = h.shape
    nW = S // ratio
    if nW == 0:
        return jnp.zeros((B, 0, dim), h.dtype)
    a, z = project(h[:, : nW * ratio], p)
    a = a.reshape(B, nW, ratio, -1)
    z = z.reshape(B, nW, ratio, -1) + p["ape"].astype(jnp.float32)
    if overlap:
        a, z = overlap_slots(a, z, dim)
    rows = pool(a, z)
    row_pos = jnp.broadcast_to(jnp.arange(nW, dtype=jnp.int32) * ratio, (B, nW))
    return finish_rows(rows, p["norm"], row_pos, freqs, eps)
