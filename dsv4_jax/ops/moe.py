"""Mixture-of-experts math (docs/model_math.md §2.8) on plain arrays.

Routing: s = sqrt(softplus(l)) for router logits l = W_r h (float32); score-routed layers pick the top-k of
s + bias (the bias for selection only, `lax.top_k` order: value desc, lower index first), hash layers take
the ids from tid2eid[token]; weights w = s[idx] / (Σ s[idx] + eps) × routed_scaling_factor.
Experts: SwiGLU with gate ≤ limit and up ∈ [−limit, limit]; y = Σ_j w_j · W2[e_j] swiglu(W1[e_j] x, W3[e_j] x).
Expert weights are [E, I, D] (w1, w3) and [E, D, I] (w2), the checkpoints' [out, in] layout, dense or
`ops.quant.QArray`. Quantized experts are never dequantized as a whole [E, ·, ·] stack: the gather path
gathers the active experts' codes and dequantizes those; the sorted path (`experts_sorted`) runs
expert-pure row tiles (`align`, as the Pallas prefill kernel does), each dequantizing one expert.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .linear import linear
from .quant import QArray, dequantize, take


def router_scores(logits: jax.Array) -> jax.Array:
    """s = sqrt(softplus(l)) in float32: [T,E] -> [T,E]."""
    return jnp.sqrt(jax.nn.softplus(logits.astype(jnp.float32)))


@dataclasses.dataclass(frozen=True)
class Router:
    """Static routing choices: k experts per token, whether the weights are normalised (w / (Σ w + eps)), and
    the routed scaling factor."""

    k: int
    norm: bool
    eps: float
    scale: float


def route_from_logits(logits: jax.Array, bias: jax.Array | None, hash_idx: jax.Array | None, router: Router):
    """logits [T,E], bias f32 [E] (score routing) or hash_idx int [T,k] (hash routing)
    -> (expert ids int32 [T,k], weights f32 [T,k])."""
    s = router_scores(logits)
    if hash_idx is not None:
        idx = hash_idx.astype(jnp.int32)
    else:
        _, idx = jax.lax.top_k(s + bias.astype(jnp.float32), router.k)
    w = jnp.take_along_axis(s, idx, axis=-1)
    return idx.astype(jnp.int32), normalize_weights(w, norm=router.norm, eps=router.eps, scale=router.scale)


def normalize_weights(w: jax.Array, *, norm: bool, eps: float, scale: float) -> jax.Array:
    """w [T,k] -> w / (Σ w + eps) (if norm) × scale (float32)."""
    if norm:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + eps)
    return w * scale


def swiglu(g: jax.Array, u: jax.Array, limit: float) -> jax.Array:
    """silu(min(g, limit)) ⊙ clamp(u, −limit, limit)."""
    return jax.nn.silu(jnp.minimum(g, limit)) * jnp.clip(u, -limit, limit)


def dense_mlp(x: jax.Array, w1: jax.Array, w2: jax.Array, w3: jax.Array, limit: float) -> jax.Array:
    """One SwiGLU expert (the shared expert): x [..., D], w1/w3 [I,D], w2 [D,I] (dense or QArray) -> [..., D]."""
    return linear(swiglu(linear(x, w1), linear(x, w3), limit), w2)


def combine(y: jax.Array, w: jax.Array, dtype) -> jax.Array:
    """Σ_j w[t,j] · y[t,j]: y [T,k,D], w [T,k] -> [T,D] (sum in float32)."""
    return jnp.einsum("tkd,tk->td", y.astype(jnp.float32), w.astype(jnp.float32)).astype(dtype)


def gather_experts(w, idx: jax.Array) -> jax.Array:
    """w[idx] dense: [E, N, K] -> [*idx.shape, N, K]; a QArray gathers codes and scales, then dequantizes."""
    return dequantize(take(w, idx)) if isinstance(w, QArray) else w[idx]


def experts_gather(x: jax.Array, idx: jax.Array, w: jax.Array, w1, w2, w3, limit: float) -> jax.Array:
    """Read only the selected experts' weights (decode: few tokens). x [T,D], idx/w [T,k] -> [T,D]."""
    g = jnp.einsum("td,tkid->tki", x, gather_experts(w1, idx))     # w1[idx]: [T,k,I,D]
    u = jnp.einsum("td,tkid->tki", x, gather_experts(w3, idx))
    y = jnp.einsum("tki,tkdi->tkd", swiglu(g, u, limit), gather_experts(w2, idx))
    return combine(y, w, x.dtype)


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Σ_k lhs[r,k] · rhs[g(r), n, k] with rows sorted by group: [M,K], [G,N,K], sizes [G] -> [M,N]."""
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    return jax.lax.ragged_dot_general(lhs, rhs, group_sizes, dims)


def sort_assignments(idx: jax.Array, n_experts: int):
    """The T·k assignments sorted by expert: (order [T·k] (stable), group sizes int32 [E])."""
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    return order, jnp.bincount(flat, length=n_experts).astype(jnp.int32)


def experts_sorted(x: jax.Array, idx: jax.Array, w: jax.Array, w1, w2, w3, limit: float) -> jax.Array:
    """Sort the T·k assignments by expert, grouped matmuls (prefill / verify). x [T,D], idx/w [T,k] -> [T,D].

    Dense weights: one `ragged_dot` per matrix, except when compiled for CPU: XLA:CPU has no grouped
    matmul and JAX lowers a ragged_dot there densely, every row against every group's matrix
    (`lax._ragged_dot_general_impl`: E× the assigned work), so on CPU the expert-pure row tiles of
    `experts_tiled` run instead (the bundled model's experts, 2048 tokens: 16.3 -> 5.0 ms,
    experiments/results/moe_cpu_paths_2026-12-02.json; same math, sums in float32 either way). The choice is made at
    lowering (`lax.platform_dependent`), so TPU / GPU programs, AOT-compiled ones included, keep the
    ragged_dot. Quantized weights: `experts_tiled` on every platform (a ragged_dot would need the whole
    dequantized [E, ·, ·] layer; at Flash size 4 GiB per matrix per layer in bf16)."""
    if any(isinstance(m, QArray) for m in (w1, w2, w3)):
        return experts_tiled(x, idx, w, w1, w2, w3, limit)
    return jax.lax.platform_dependent(
        x, idx, w, w1, w2, w3, cpu=lambda *a: experts_tiled(*a, limit),
        default=lambda *a: experts_ragged(*a, limit))


def experts_ragged(x: jax.Array, idx: jax.Array, w: jax.Array, w1: jax.Array, w2: jax.Array, w3: jax.Array,
                   limit: float) -> jax.Array:
    """`experts_sorted` with dense weights as one `ragged_dot` per matrix (any platform)."""
    T, k = idx.shape
    order, sizes = sort_assignments(idx, w1.shape[0])
    xs = x[order // k]
    h = swiglu(grouped_matmul(xs, w1, sizes), grouped_matmul(xs, w3, sizes), limit)
    ys = grouped_matmul(h, w2, sizes).astype(jnp.float32) * w.reshape(-1)[order][:, None]
    return jnp.zeros((T, x.shape[-1]), jnp.float32).at[order // k].add(ys).astype(x.dtype)


# Below this many (token, expert) assignments per expert, gathering the active experts' weights is cheaper
# than sorting tokens into groups (and reads only the active experts).
GATHER_MAX_ASSIGNMENTS_PER_EXPERT = 1


def prefer_gather(n_assignments: int, n_experts: int) -> bool:
    """Whether the reference path gathers the active experts (few assignments) instead of sorting."""
    return n_assignments <= GATHER_MAX_ASSIGNMENTS_PER_EXPERT * n_experts


# ---- expert-pure row tiles (quantized experts on the reference path; the Pallas prefill kernel's layout) ----

def padded_rows(n_assign: int, n_experts: int, bM: int) -> int:
    """Static upper bound of the padded row count of `align`."""
    m = n_assign + min(n_experts, n_assign) * (bM - 1)
    return -(-m // bM) * bM


def align(idx: jax.Array, n_experts: int, bM: int):
    """Sort the T·k assignments by expert and pad each expert's group to a multiple of bM rows, so every
    bM-row tile belongs to one expert (like vLLM's moe_align_block_size).

    idx int [T,k] -> (row_token int32 [M], dest int32 [T·k], tile_expert int32 [M/bM], n_used int32 [1]):
    dest[a] is the padded row of assignment a = t·k + j, row_token[r] the token feeding row r (0 for pad);
    tiles past n_used are empty.
    """
    T, k = idx.shape
    A = T * k
    M = padded_rows(A, n_experts, bM)
    flat = idx.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
    padded = (sizes + bM - 1) // bM * bM
    start, pstart = jnp.cumsum(sizes) - sizes, jnp.cumsum(padded) - padded
    e_sorted = flat[order]
    dest_sorted = pstart[e_sorted] + jnp.arange(A, dtype=jnp.int32) - start[e_sorted]
    dest = jnp.zeros((A,), jnp.int32).at[order].set(dest_sorted)
    row_token = jnp.zeros((M,), jnp.int32).at[dest].set(jnp.arange(A, dtype=jnp.int32) // k)
    tile_expert = jnp.searchsorted(jnp.cumsum(padded), jnp.arange(M // bM) * bM, side="right")
    tile_expert = jnp.minimum(tile_expert, n_experts - 1).astype(jnp.int32)
    n_used = (jnp.sum(padded) // bM).astype(jnp.int32)[None]
    return row_token, dest, tile_expert, n_used


def tile_rows(n_assign: int, n_experts: int) -> int:
    """Rows per tile: the mean assignments per expert, as a power of two in [8, 128]."""
    mean = -(-n_assign // n_experts)
    return min(128, max(8, 1 << (mean - 1).bit_length()))


def experts_tiled(x: jax.Array, idx: jax.Array, w: jax.Array, w1, w2, w3, limit: float,
                  bM: int | None = None) -> jax.Array:
    """The sorted path over expert-pure tiles: a sequential map over tiles, each gathering one expert's
    (codes and scales of) w1, w3, w2, dequantizing them and running its bM rows. x [T,D], idx/w [T,k] -> [T,D].

    Dequantized memory in flight: one expert; dequantization work: ≤ T·k/bM + E expert matrices."""
    T, k = idx.shape
    E = w1.shape[0]
    bM = bM or tile_rows(T * k, E)
    row_token, dest, tile_expert, n_used = align(idx, E, bM)
    M, D = row_token.shape[0], x.shape[-1]
    xs = x[row_token].reshape(M // bM, bM, D)

    def expert_rows(xt, e):
        W1, W3, W2 = (gather_experts(m, e) for m in (w1, w3, w2))
        return swiglu(xt @ W1.T, xt @ W3.T, limit) @ W2.T

    def tile(args):
        xt, e, m = args
        return jax.lax.cond(m < n_used[0], expert_rows, lambda xt, e: jnp.zeros_like(xt), xt, e)

    ys = jax.lax.map(tile, (xs, tile_expert, jnp.arange(M // bM))).reshape(M, D)
    return combine(ys[dest].reshape(T, k, D), w, x.dtype)
