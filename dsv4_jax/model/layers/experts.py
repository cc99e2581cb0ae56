"""The routed experts' dispatch table: which implementation computes Σ_j w[t,j] · expert_{idx[t,j]}(x[t]) for a
static choice, one table for the single-device MoE (`moe.routed_experts`, the choice `Backends.moe`) and the
per-device local matmul of the expert-parallel MoE (`moe_ep.local_experts`, the choice `ExpertParallel.local`).

    pallas_tpu  `kernels.tpu_moe.routed` (Mosaic decode / grouped matmul); formats it does not take
                (`tpu_moe.supports`: Q8_0) run the reference row
    pallas      the GPU kernels: `kernels.moe_decode` for ≤ DECODE_MAX_TOKENS tokens, `kernels.moe_prefill` above
    reference   every expert on this device (`Assignments.local` None): few assignments gather the active
                experts (`ops.moe.experts_gather`), many sort them (`ops.moe.experts_sorted`: ragged_dot, or
                expert-pure row tiles when compiled for CPU). A device's local experts (`local` given): one
                expert slice per assignment for few (`experts_sliced`), expert-pure row tiles for QArray experts
                (`ops.moe.experts_tiled`), the local groups' ragged_dot otherwise (`experts_sorted_local`)
    dense       (local experts) few assignments: `experts_sliced`; many: every local expert once over all tokens
                (`experts_dense`; FP4 word stacks one expert slice at a time, `experts_each`)

Experts may arrive as their segment's stack (`StackedExperts`, `inplace.reads_expert_stack`): a row that reads
the stack in place (`reads_stack_in_place`: the GPU kernels always, the Mosaic kernels while their padded tile
bound stays small) gets the stack seen as [reps·E, ...] with ids offset by rep·E; every other row gets the
layer's slice.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from ...kernels import moe_decode, moe_prefill, tpu_moe
from ...ops import moe as ops
from ...ops import quant
from ...ops.quant import QArray
from .stacked_experts import StackedExperts


class Assignments(NamedTuple):
    """The tokens and their routed experts: x [T,D], idx int [T,k] (ids into the experts handed over), w f32
    [T,k]; local bool [T,k] under expert parallelism (the assignments to this device's experts; the others
    come as id 0, weight 0), None on a single device."""

    x: jax.Array
    idx: jax.Array
    w: jax.Array
    local: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class ExpertCall:
    """Static part of a routed-experts call: the implementation (a row of TABLE), the SwiGLU limit and the
    Pallas interpret mode."""

    impl: str
    limit: float
    interpret: bool = False


@dataclasses.dataclass(frozen=True)
class Row:
    """One implementation: run(assignments, experts {"w1","w2","w3"}, call) -> [T,D]; takes(experts): the
    expert formats it runs (else the reference row); in_place(n_tokens, n_assign, stacked): whether it reads a
    `StackedExperts` in place."""

    run: Callable
    takes: Callable[[dict], bool]
    in_place: Callable[[int, int, StackedExperts], bool]


# ---- the per-device paths of the local experts (expert parallelism) ------------------------------------

def _expert_matmul(x: jax.Array, m, e: jax.Array) -> jax.Array:
    """x · W[e]ᵀ for expert e of a local stack [E_loc, N, K]: a dynamic slice of the dense stack, or of a
    QArray's codes and scales contracted as codes (`quant.matmul_codes`: no dequantized copy). x [1, K]."""
    pick = lambda a: jax.lax.dynamic_index_in_dim(a, e, 0, keepdims=False)
    if isinstance(m, QArray):
        return quant.matmul_codes(x, QArray(pick(m.codes), pick(m.scale), m.fmt, m.dtype))
    return x @ pick(m).T


def experts_sliced(x: jax.Array, idx: jax.Array, w: jax.Array, w1, w2, w3, limit: float) -> jax.Array:
    """Few assignments: one expert slice per assignment (read as a dynamic slice feeding its matmul, so
    XLA reads exactly the assigned experts; `w1[idx]` gathers lower to copies of the whole stack on TPU;
    a QArray expert is read as codes, `quant.matmul_codes`). x [T,D], idx/w [T,k] (idx in range), w1/w3 [E,I,D],
    w2 [E,D,I] dense or QArray -> float32 [T,D]."""
    T, k = idx.shape
    rows = []
    for a in range(T * k):
        t, j = divmod(a, k)
        e = idx[t, j]
        xt = x[t:t + 1]
        mm = lambda v, m: _expert_matmul(v, m, e)
        h = ops.swiglu(mm(xt, w1), mm(xt, w3), limit)
        rows.append(mm(h, w2))                                          # [1, D]
    y = jnp.concatenate(rows, axis=0).reshape(T, k, -1)
    return jnp.einsum("tkd,tk->td", y.astype(jnp.float32), w.astype(jnp.float32))


def experts_sorted_local(a: Assignments, e: dict, limit: float) -> jax.Array:
    """Many assignments, dense experts: the local ones sorted into expert groups, grouped `ragged_dot`; the
    others sort past the last group (ragged_dot leaves those rows zero). a: x [T,D], idx/w/local [T,k];
    e {"w1","w2","w3"} dense -> float32 [T,D]."""
    x, idx, w, local = a
    w1, w2, w3 = e["w1"], e["w2"], e["w3"]
    T, k = idx.shape
    E = w1.shape[0]
    key = jnp.where(local, idx, E).reshape(-1)
    order = jnp.argsort(key, stable=True)
    sizes = jnp.bincount(key, length=E + 1)[:E].astype(jnp.int32)
    xs = x[order // k]
    h = ops.swiglu(ops.grouped_matmul(xs, w1, sizes), ops.grouped_matmul(xs, w3, sizes), limit)
    ys = ops.grouped_matmul(h, w2, sizes).astype(jnp.float32) * w.reshape(-1)[order][:, None].astype(jnp.float32)
    return jnp.zeros((T, x.shape[-1]), jnp.float32).at[order // k].add(ys)


def experts_dense(x: jax.Array, idx: jax.Array, w: jax.Array, w1, w2, w3, limit: float) -> jax.Array:
    """Many assignments: every local expert once over all tokens, the routing weight (0 when not routed)
    folded into the hidden activations. x [T,D], idx/w [T,k], experts dense or QArray -> float32 [T,D].
    FP4 word-layout stacks (`quant.words_format`, what TPU runs place) take `experts_each`; other QArrays
    are dequantized as one expression feeding the matmul, for XLA to fuse."""
    T, _ = idx.shape
    E = w1.shape[0]
    cw = jnp.zeros((T, E), jnp.float32).at[jnp.arange(T)[:, None], idx].add(w.astype(jnp.float32))
    if all(isinstance(m, QArray) and m.fmt.codes == "e2m1x8" for m in (w1, w2, w3)):
        return experts_each(x, cw, w1, w2, w3, limit)
    w1, w2, w3 = (quant.dense(m, x.dtype) for m in (w1, w2, w3))
    h = ops.swiglu(jnp.einsum("td,eid->tei", x, w1), jnp.einsum("td,eid->tei", x, w3), limit)
    h = (h.astype(jnp.float32) * cw[..., None]).astype(x.dtype)
    return jnp.einsum("tei,edi->td", h, w2, preferred_element_type=jnp.float32)


def experts_each(x: jax.Array, cw: jax.Array, w1, w2, w3, limit: float) -> jax.Array:
    """Every local expert over all tokens, one expert slice at a time (the decode slot path with one slot
    per expert: each slice read in place by its matmul, `_expert_matmul`). A matmul batched over the whole
    stack makes XLA:TPU copy the layer's slice of the layer-stacked words out first (read + write + read:
    3.5× the words in a one-chip probe, v6e); one matmul per expert reads each word
    once (1.15×; experiments/results/aot_release_ep_2026-12-04.md, fifth step).
    x [T,D], cw [T,E] routing weights (0 where not routed), w1/w3 [E,I,D], w2 [E,D,I] -> float32 [T,D]."""
    y = jnp.zeros((x.shape[0], w2.shape[1]), jnp.float32)
    for e in range(cw.shape[1]):
        mm = lambda v, m: _expert_matmul(v, m, e)
        h = ops.swiglu(mm(x, w1), mm(x, w3), limit)
        h = (h.astype(jnp.float32) * cw[:, e:e + 1]).astype(x.dtype)
        y = y + mm(h, w2).astype(jnp.float32)
    return y


# ---- the rows ------------------------------------------------------------------------------------------

def _reference(a: Assignments, e: dict, call: ExpertCall) -> jax.Array:
    x, idx, w, local = a
    w1, w2, w3 = e["w1"], e["w2"], e["w3"]
    few = ops.prefer_gather(idx.size, w1.shape[0])
    if local is None:                                            # every expert is on this device
        path = ops.experts_gather if few else ops.experts_sorted
        return path(x, idx, w, w1, w2, w3, call.limit)
    if few:
        return experts_sliced(x, idx, w, w1, w2, w3, call.limit)
    if any(isinstance(m, QArray) for m in (w1, w2, w3)):        # expert-pure row tiles, one expert dequantized
        return ops.experts_tiled(x, idx, w, w1, w2, w3, call.limit)
    return experts_sorted_local(a, e, call.limit)


def _dense(a: Assignments, e: dict, call: ExpertCall) -> jax.Array:
    x, idx, w, _ = a
    path = experts_sliced if ops.prefer_gather(idx.size, e["w1"].shape[0]) else experts_dense
    return path(x, idx, w, e["w1"], e["w2"], e["w3"], call.limit)


def _pallas(a: Assignments, e: dict, call: ExpertCall) -> jax.Array:
    kernel = moe_decode.experts_decode if a.x.shape[0] <= moe_decode.DECODE_MAX_TOKENS else \
        moe_prefill.experts_prefill
    return kernel(a.x, a.idx, a.w, e, limit=call.limit, interpret=call.interpret)


def _pallas_tpu(a: Assignments, e: dict, call: ExpertCall) -> jax.Array:
    return tpu_moe.routed(a.x, a.idx, a.w, e, limit=call.limit, interpret=call.interpret)


STACK_TILE_GROWTH = 1.25   # how much larger the grouped kernel's padded tile bound may get on a whole stack


def _tpu_reads_stack(n_tokens: int, n_assign: int, e: StackedExperts) -> bool:
    """The Mosaic kernels take the whole stack: always the decode kernel (≤ DECODE_MAX_TOKENS tokens: its
    slots are min(E, T·k), the active experts, whatever E is); the grouped kernel while its padded row bound,
    which grows with min(experts handed, T·k) (`ops.moe.align`), grows by at most STACK_TILE_GROWTH (verify
    blocks: T·k near E_loc; not a prefill chunk, whose bound would grow with every layer's experts)."""
    if not tpu_moe.supports(e.stack):
        return False
    if n_tokens <= tpu_moe.DECODE_MAX_TOKENS:
        return True
    E, reps = e.n_experts, e.stack["w1"].shape[0]
    return min(reps * E, n_assign) <= STACK_TILE_GROWTH * min(E, n_assign)


def _every(e) -> bool:
    return True


def _always(n_tokens: int, n_assign: int, e: StackedExperts) -> bool:
    return True


def _never(n_tokens: int, n_assign: int, e: StackedExperts) -> bool:
    return False


TABLE: dict[str, Row] = {
    "reference": Row(_reference, _every, _never),
    "dense": Row(_dense, _every, _never),
    "pallas": Row(_pallas, _every, _always),
    "pallas_tpu": Row(_pallas_tpu, tpu_moe.supports, _tpu_reads_stack),
}


def reads_stack_in_place(impl: str, n_tokens: int, n_assign: int, e: StackedExperts) -> bool:
    """Whether implementation `impl` takes the whole stack `e` (ids offset by rep·E) rather than the layer's
    slice (`Row.in_place`; False for a name without a row)."""
    row = TABLE.get(impl)
    return row is not None and row.in_place(n_tokens, n_assign, e)


def routed(a: Assignments, e, call: ExpertCall) -> jax.Array:
    """Σ_j w[t,j] · expert_{idx[t,j]}(x[t]) by the row `ExpertCall.impl` (see the module docstring). e {"w1" [E,I,D],
    "w2" [E,D,I], "w3" [E,I,D]} dense or QArray, or a `StackedExperts` -> [T,D] (the row's dtype: x.dtype for
    the single-device reference and the kernels, float32 for the local paths)."""
    row = TABLE[call.impl]
    if isinstance(e, StackedExperts):
        if row.in_place(a.x.shape[0], a.idx.size, e):
            flat, ids = e.flat(a.idx)
            return row.run(a._replace(idx=ids), flat, call)
        e = e.layer()
    if not row.takes(e):
        row = TABLE["reference"]
    return row.run(a, e, call)
