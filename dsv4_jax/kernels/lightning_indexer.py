"""Lightning-indexer scores kernel (docs/model_math.md §2.7; math and top-k: `dsv4_jax.ops.indexer`).

score(p, w) = Σ_h ω_h · ReLU(q_h · K_w) · dI^-0.5, −inf unless valid(p, w) = w < ⌊(p+1)/m⌋ and w < n_rows.

Kernel: grid (B, S/bS, T/bT); a program loads one key tile [bT, dI] once and scores it against bS queries
(decode: the k+1 verify queries share every key read), one [H, dI]×[dI, bT] dot each (bf16 operands,
float32 accumulation), ReLU, ω-weighted head sum and the validity mask (−inf), all in registers.

Selection is `ops.indexer.topk` (exact, two-stage for long rows): fusing it into the Pallas kernel is not
done (Triton-Pallas has no sort; see the results file).

Equality with the reference (`ops.indexer.scores` + `validity`): the kernel's scores differ from the
einsum's by float32 reassociation only (~1e-6 relative), so the selected sets agree unless two scores at
the k-th boundary are that close; rows whose heads are all ReLU-dead score exactly 0 on both paths (−0.0 is
normalised to +0.0 in the kernel).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .common import block, compiler_params


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

