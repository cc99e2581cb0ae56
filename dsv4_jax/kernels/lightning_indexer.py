"""Lightning indexer (target_model.md §2.7): masked scores + exact top-k over the compressed rows.

score(p, w) = Σ_h ω_h · ReLU(q_h · K_w) · dI^-0.5, valid(p, w) = w < ⌊(p+1)/m⌋ and w < n_rows.

Kernel: grid (B, S/bS, T/bT); a program loads one key tile [bT, dI] once and scores it against bS queries
(decode: the k+1 verify queries share every key read), one [H, dI]×[dI, bT] dot each (bf16 operands,
float32 accumulation), ReLU, ω-weighted head sum and the validity mask (−inf), all in registers.

Selection (`topk`): exact two-stage top-k: `lax.top_k` inside chunks of C rows, then over the n·k
candidates. The candidates are laid out chunk by chunk, each chunk's sorted by (value desc, index asc), so
among equal values a lower candidate slot is a lower row: the order is `lax.top_k`'s, ties included.
Fusing the selection into the Pallas kernel is not done (Triton-Pallas has no sort; see the results file).

Equality with `model.indexer` (index_scores + select_topk): given the same scores, the selection is
identical bit for bit (tests). The kernel's scores differ from the einsum's by float32 reassociation only
(~1e-6 relative), so the selected sets agree unless two scores at the k-th boundary are that close; rows
whose heads are all ReLU-dead score exactly 0 on both paths (−0.0 is normalised to +0.0 in the kernel).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ..config import ModelConfig
from ..model import indexer as indexer_ref
from .dispatch import block, compiler_params, resolve, use_interpret


def _score_kernel(*refs, bS, bT, T, ratio, scale, masked_pos, has_rows):
    q_ref, k_ref, om_ref = refs[:3]
    rest = list(refs[3:])
    pos_ref = rest.pop(0) if masked_pos else None
    rows_ref = rest.pop(0) if has_rows else None
    o_ref = rest[0]
    keys = k_ref[0]                                                     # [bT, dI]
    t_idx = pl.program_id(2) * bT + jax.lax.broadcasted_iota(jnp.int32, (bT,), 0)
    base = t_idx < T
    if has_rows:
        base = base & (t_idx < rows_ref[pl.program_id(0)])
    prec = jax.lax.Precision.HIGHEST if keys.dtype == jnp.float32 else None
    for s in range(bS):
        q = q_ref[0, s]                                                  # [H, dI]
        dots = jax.lax.dot_general(q, keys.astype(q.dtype), (((1,), (1,)), ((), ())), precision=prec,
                                   preferred_element_type=jnp.float32)   # [H, bT]
        dots = jnp.maximum(dots, 0.0) * scale
        sc = jnp.sum(dots * om_ref[0, s][:, None], axis=0) + 0.0        # [bT]; + 0.0 turns −0.0 into +0.0
        valid = base
        if masked_pos:
            valid = valid & (t_idx < (pos_ref[0, s] + 1) // ratio)
        o_ref[0, s, :] = jnp.where(valid, sc, -jnp.inf)


@functools.partial(jax.jit, static_argnames=("ratio", "interpret", "blocks", "num_warps"))
def scores(q, keys, omega, positions=None, n_rows=None, *, ratio: int = 1, interpret: bool = True,
           blocks: tuple[int, int] = (8, 128), num_warps: int = 4):
    """q [B,S,H,dI], keys [B,T,dI], omega f32 [B,S,H] (already × H^-0.5), positions int [B,S] | None,
    n_rows int [B] | None -> f32 [B,S,T]: scores, −inf where invalid (no masking for a None argument)."""
    B, S, H, dI = q.shape
    T = keys.shape[1]
    bS = block(S, blocks[0])
    bT = min(blocks[1], max(16, 1 << (T - 1).bit_length()))
    args = [q, keys.astype(q.dtype), omega.astype(jnp.float32)]
    specs = [pl.BlockSpec((1, bS, H, dI), lambda b, s, t: (b, s, 0, 0)),
             pl.BlockSpec((1, bT, dI), lambda b, s, t: (b, t, 0)),
             pl.BlockSpec((1, bS, H), lambda b, s, t: (b, s, 0))]
    if positions is not None:
        args.append(positions.astype(jnp.int32))
        specs.append(pl.BlockSpec((1, bS), lambda b, s, t: (b, s)))
    if n_rows is not None:
        args.append(jnp.broadcast_to(jnp.asarray(n_rows, jnp.int32), (B,)))
        specs.append(pl.BlockSpec())
    kern = functools.partial(_score_kernel, bS=bS, bT=bT, T=T, ratio=ratio, scale=dI ** -0.5,
                             masked_pos=positions is not None, has_rows=n_rows is not None)
    return pl.pallas_call(
        kern, grid=(B, S // bS, pl.cdiv(T, bT)), in_specs=specs,
        out_specs=pl.BlockSpec((1, bS, bT), lambda b, s, t: (b, s, t)),
        out_shape=jax.ShapeDtypeStruct((B, S, T), jnp.float32), compiler_params=compiler_params(num_warps),
        interpret=interpret)(*args)


def scores_reference(q, keys, omega, positions=None, n_rows=None, *, ratio: int = 1):
    """Plain-jnp twin of `scores` (the einsums of `model.indexer.index_scores`)."""
    dI = q.shape[-1]
    dots = jnp.einsum("bshd,btd->bsht", q.astype(jnp.float32), keys.astype(jnp.float32))
    sc = jnp.einsum("bsht,bsh->bst", jax.nn.relu(dots) * dI ** -0.5, omega.astype(jnp.float32))
    return jnp.where(validity(sc.shape, positions, n_rows, ratio), sc, -jnp.inf)


def validity(shape, positions, n_rows, ratio: int):
    """[B,S,T] bool: w < ⌊(p+1)/m⌋ (if positions) and w < n_rows[b] (if n_rows)."""
    B, S, T = shape
    w = jnp.arange(T)[None, None, :]
    valid = jnp.ones(shape, bool)
    if positions is not None:
        valid = valid & (w < ((positions + 1) // ratio)[:, :, None])
    if n_rows is not None:
        valid = valid & (w < jnp.broadcast_to(jnp.asarray(n_rows), (B,))[:, None, None])
    return valid


def topk(masked: jax.Array, k: int, chunk: int = 4096):
    """masked f32 [..., T] (−inf = invalid) -> (idx int32 [..., k'], found bool [..., k']), k' = min(k, T).

    Exact, lax.top_k order (value desc, index asc); `found` is False for picks that are −inf (dropped).
    """
    T = masked.shape[-1]
    k = min(k, T)
    if T <= chunk or k >= chunk:
        vals, idx = jax.lax.top_k(masked, k)
        return idx.astype(jnp.int32), vals > -jnp.inf
    n = -(-T // chunk)
    lead = masked.shape[:-1]
    padded = jnp.pad(masked, [(0, 0)] * len(lead) + [(0, n * chunk - T)], constant_values=-jnp.inf)
    v1, i1 = jax.lax.top_k(padded.reshape(*lead, n, chunk), k)          # [..., n, k]
    i1 = i1 + (jnp.arange(n, dtype=i1.dtype) * chunk)[:, None]
    vals, j = jax.lax.top_k(v1.reshape(*lead, n * k), k)
    idx = jnp.take_along_axis(i1.reshape(*lead, n * k), j, axis=-1)
    return idx.astype(jnp.int32), vals > -jnp.inf


def topk_mask(masked: jax.Array, k: int, chunk: int = 4096) -> jax.Array:
    """Boolean [..., T] of the top-k finite entries (the `model.indexer.select_topk` contract)."""
    idx, found = topk(masked, k, chunk)
    onehot = jnp.zeros(masked.shape, bool)
    lead = jnp.indices(idx.shape[:-1], sparse=True)
    return onehot.at[(*[i[..., None] for i in lead], idx)].max(found)


def omega(h: jax.Array, p: dict, config: ModelConfig) -> jax.Array:
    """ω = (W_ω h) · nI^-0.5 in float32: h [B,S,D] -> [B,S,nI]."""
    return (h @ p["weights_proj"].T).astype(jnp.float32) * config.index_n_heads ** -0.5


def select(q, keys, h, p: dict, config: ModelConfig, positions, ratio: int, n_rows=None, *,
           impl: str | None = "auto", interpret: bool | None = None, chunk: int = 4096):
    """Mask [B,S,T] of the indexer's top-k valid rows. q [B,S,nI,dI], keys [B,T,dI], h [B,S,D], positions [B,S]."""
    if resolve(impl) == "reference":
        sc = indexer_ref.index_scores(q, keys, h, p, config)
        valid = validity(sc.shape, positions, n_rows, ratio)
        return indexer_ref.select_topk(sc, valid, config.index_topk)
    masked = scores(q, keys, omega(h, p, config), positions, n_rows, ratio=ratio,
                    interpret=use_interpret(interpret))
    return topk_mask(masked, config.index_topk, chunk)
