"""Expert-parallel MoE under `jax.shard_map` (backend moe="ep"; DESIGN property 10; target_model.md §2.8).

The routed experts' collectives are written down here; everything around them stays GSPMD. The router
runs before (GSPMD, router weights replicated by `sharding.DEFAULT_REPLICATED`, once per token on the
device that holds it), then one `shard_map` over the whole mesh takes, per device,

    x [T/n_tok, D], idx / w [T/n_tok, k]   the tokens split like the batch (logical axis "batch")
    w1 / w3 [E/n_e, I/n_i, D], w2 [E/n_e, D, I/n_i]   the routed experts as placed (logical axes
                                            "experts", "mlp": expert parallelism and/or expert-tensor
                                            parallelism, whatever the rules gave)
    shared w1 / w3 [I/n_s, D], w2 [D, I/n_s]   the shared expert as placed ("mlp")

and does, for any split (the rules' divisibility fallback included):

  1. all-gather the tokens (and idx, w) over the mesh axes that split both the tokens and the experts
     ("gather axes": every device of an expert group sees the group's tokens; decode / verify / prefill);
  2. keep the assignments to its local experts (ids e0 .. e0 + E_loc − 1, e0 from the device's index on
     the expert axes), weight 0 for the others, and run the local grouped matmul on them
     (`ExpertParallel.local`, see `local_experts`) -> a float32 partial sum [T_group, D];
  3. reduce: `psum_scatter` over the gather axes (back to its own tokens), then `psum` over the other
     axes the experts are split over (expert axes not splitting tokens, and the `mlp` axes of
     expert-tensor parallelism). The shared expert runs on the device's own tokens; its partial sum
     (split over its `mlp` axes) joins the same `psum` when those are exactly the remaining axes
     (the usual case: both on `model`), else it is reduced on its own.

Prefill uses the same gather path. `jax.lax.ragged_all_to_all` (the dropless dispatch that sends each
token only to the devices of its experts) is not implemented by XLA:CPU in jax 0.10.2, so it cannot be
tested here, and a dense `all_to_all` that drops nothing needs a per-destination capacity of every
local token (a token may have an expert on every device) — exactly the all-gather's volume. Cost: per
layer the group's tokens are all-gathered and the partial outputs reduce-scattered, 2·T_group·D
elements per device, vs. 2·T_loc·n·(1 − (1 − 1/n)^k)·D for an ideal ragged all-to-all (1.8× more at
n = 8, k = 6). Odd expert counts (E not divisible by the expert axes) need no special path: the rules
replicate the expert dimension (or split `mlp` instead) and the same code runs with E_loc = E.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from ..backends import BackendError, ExpertParallel
from ..config import MOE, ModelConfig
from ..kernels import moe_decode, moe_prefill
from ..ops import moe as ops
from ..ops import quant
from ..params import moe_specs
from ..sharding import mesh_sizes, partition_spec

ROUTED = ("w1", "w2", "w3")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Static per-call shard_map layout (derived from the mesh, the rules and the shapes)."""

    tokens: PartitionSpec                  # x [T, D], idx / w [T, k]
    experts: dict                          # routed leaf name -> PartitionSpec
    shared: dict | None                    # shared-expert leaf name -> PartitionSpec
    expert_axes: tuple[str, ...]           # mesh axes splitting the expert dimension (major first)
    gather_axes: tuple[str, ...]           # token axes the experts are split over: gather, then scatter
    reduce_axes: tuple[str, ...]           # the other expert-split axes: psum
    shared_axes: tuple[str, ...]           # axes the shared expert's `mlp` is split over

    @property
    def fold_shared(self) -> bool:
        """The shared expert's partial sum can join the routed psum (same axes)."""
        return set(self.shared_axes) == set(self.reduce_axes)


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


def _spec_axes(spec: PartitionSpec) -> tuple[str, ...]:
    return tuple(a for e in spec for a in _axes(e))


def _dim_axes(spec: PartitionSpec, dim: int) -> tuple[str, ...]:
    return _axes(spec[dim]) if dim < len(spec) else ()


def leaf_axes(name: str, config: ModelConfig, group: str) -> tuple:
    """Logical axes of a routed ("experts") or shared ("shared_experts") leaf; scales take their matrix's."""
    specs = moe_specs(config, MOE)[group]
    return specs[name.removesuffix("_scale")].axes


def layout(ep: ExpertParallel, config: ModelConfig, batch: int, experts: dict, shared: dict | None) -> Layout:
    """The shard_map specs for a batch of `batch` sequences and these (per-layer) expert leaves.

    Raises BackendError for placements the explicit path cannot run: the contraction dimension (`embed`)
    split, routed leaves split differently, or a shared expert split over an axis that splits the tokens.
    """
    sizes, rules = mesh_sizes(ep.mesh), ep.rules_dict
    tok = partition_spec((batch,), ("batch",), sizes, rules)
    token_axes = _dim_axes(tok, 0)

    def specs(tree: dict, group: str) -> dict:
        return {k: partition_spec(v.shape, leaf_axes(k, config, group), sizes, rules) for k, v in tree.items()}

    e_specs = specs(experts, "experts")
    w1 = e_specs["w1"]
    expert_axes = _dim_axes(w1, 0)
    mlp_axes = _dim_axes(w1, 1)
    for k, sp in e_specs.items():
        ax = leaf_axes(k, config, "experts")
        if _dim_axes(sp, ax.index("embed")):
            raise BackendError(f"expert-parallel MoE: the rules split the contraction axis 'embed' of {k} ({sp})")
        if (_dim_axes(sp, 0), _dim_axes(sp, ax.index("mlp"))) != (expert_axes, mlp_axes):
            raise BackendError(f"expert-parallel MoE: {k} is split as {sp}, unlike w1 ({w1}); the local experts "
                               f"must be the same slices of every matrix (and of its scales)")
    split = expert_axes + mlp_axes
    gather = tuple(a for a in token_axes if a in split)
    reduce_ = tuple(a for a in split if a not in gather)
    s_specs, s_axes = None, ()
    if shared is not None:
        s_specs = specs(shared, "shared_experts")
        s_axes = _spec_axes(s_specs["w1"])
        if set(s_axes) & set(token_axes) or any(_dim_axes(sp, leaf_axes(k, config, "shared_experts").index("embed"))
                                                for k, sp in s_specs.items()):
            raise BackendError(f"expert-parallel MoE: the shared expert is split as {s_specs['w1']} over an axis "
                               f"that splits the tokens ({tok}) or over 'embed'; give 'mlp' other mesh axes")
    return Layout(PartitionSpec(tok[0] if len(tok) else None), e_specs, s_specs, expert_axes, gather, reduce_,
                  s_axes)


# ---- the local grouped matmul --------------------------------------------------------------------------

def experts_sliced(x: jax.Array, idx: jax.Array, w: jax.Array, w1: jax.Array, w2: jax.Array, w3: jax.Array,
                   limit: float) -> jax.Array:
    """Few assignments: one expert slice per assignment (read as a dynamic slice feeding its matmul, so
    XLA reads exactly the assigned experts; `w1[idx]` gathers lower to copies of the whole stack on TPU).
    x [T,D], idx/w [T,k] (idx in range) -> float32 [T,D]."""
    T, k = idx.shape
    rows = []
    for a in range(T * k):
        t, j = divmod(a, k)
        e = idx[t, j]
        xt = x[t:t + 1]
        pick = lambda m: jax.lax.dynamic_index_in_dim(m, e, 0, keepdims=False)
        h = ops.swiglu(xt @ pick(w1).T, xt @ pick(w3).T, limit)
        rows.append(h @ pick(w2).T)                                     # [1, D]
    y = jnp.concatenate(rows, axis=0).reshape(T, k, -1)
    return jnp.einsum("tkd,tk->td", y.astype(jnp.float32), w.astype(jnp.float32))


def experts_sorted_local(x: jax.Array, idx: jax.Array, w: jax.Array, local: jax.Array, w1: jax.Array,
                         w2: jax.Array, w3: jax.Array, limit: float) -> jax.Array:
    """Many assignments: the local ones sorted into expert groups, grouped `ragged_dot`; the others sort
    past the last group (ragged_dot leaves those rows zero). x [T,D], idx/w/local [T,k] -> float32 [T,D]."""
    T, k = idx.shape
    E = w1.shape[0]
    key = jnp.where(local, idx, E).reshape(-1)
    order = jnp.argsort(key, stable=True)
    sizes = jnp.bincount(key, length=E + 1)[:E].astype(jnp.int32)
    xs = x[order // k]
    h = ops.swiglu(ops.grouped_matmul(xs, w1, sizes), ops.grouped_matmul(xs, w3, sizes), limit)
    ys = ops.grouped_matmul(h, w2, sizes).astype(jnp.float32) * w.reshape(-1)[order][:, None].astype(jnp.float32)
    return jnp.zeros((T, x.shape[-1]), jnp.float32).at[order // k].add(ys)


def experts_dense(x: jax.Array, idx: jax.Array, w: jax.Array, w1: jax.Array, w2: jax.Array, w3: jax.Array,
                  limit: float) -> jax.Array:
    """Many assignments: every local expert once over all tokens, the routing weight (0 when not routed)
    folded into the hidden activations. x [T,D], idx/w [T,k] -> float32 [T,D]."""
    T, _ = idx.shape
    E = w1.shape[0]
    cw = jnp.zeros((T, E), jnp.float32).at[jnp.arange(T)[:, None], idx].add(w.astype(jnp.float32))
    h = ops.swiglu(jnp.einsum("td,eid->tei", x, w1), jnp.einsum("td,eid->tei", x, w3), limit)
    h = (h.astype(jnp.float32) * cw[..., None]).astype(x.dtype)
    return jnp.einsum("tei,edi->td", h, w2, preferred_element_type=jnp.float32)


def local_experts(x: jax.Array, idx: jax.Array, w: jax.Array, local: jax.Array, e: dict, impl: str,
                  limit: float, interpret: bool) -> jax.Array:
    """Σ over the local assignments of w · expert(x) on this device's expert slices (the one entry point for
    the local computation). x [T,D]; idx [T,k] local ids (0 where not local), w [T,k] (0 where not local),
    local bool [T,k]; e {"w1" [E_loc,I_loc,D], "w2" [E_loc,D,I_loc], "w3"} (+ "*_scale") -> float32 [T,D]."""
    if impl == "pallas":
        kernel = moe_decode.experts_decode if x.shape[0] <= moe_decode.DECODE_MAX_TOKENS else \
            moe_prefill.experts_prefill
        return kernel(x, idx, w, e, limit=limit, interpret=interpret).astype(jnp.float32)
    d = quant.dequantize_experts(e, x.dtype)
    if ops.prefer_gather(idx.size, d["w1"].shape[0]):
        return experts_sliced(x, idx, w, d["w1"], d["w2"], d["w3"], limit)
    if impl == "dense":
        return experts_dense(x, idx, w, d["w1"], d["w2"], d["w3"], limit)
    return experts_sorted_local(x, idx, w, local, d["w1"], d["w2"], d["w3"], limit)


# ---- the shard_map block --------------------------------------------------------------------------------

def _local_offset(expert_axes: tuple[str, ...], n_local: int):
    """First global expert id held by this device: its index on the expert axes (major first) × E_loc."""
    if not expert_axes:
        return 0
    return jax.lax.axis_index(expert_axes) * n_local


def _block(x, idx, w, experts, shared, *, lay: Layout, impl: str, limit: float, interpret: bool):
    """Per-device body: x [T_loc,D], idx/w [T_loc,k], local expert slices -> y [T_loc,D] (routed + shared)."""
    x_own = x
    if lay.gather_axes:
        gather = functools.partial(jax.lax.all_gather, axis_name=lay.gather_axes, axis=0, tiled=True)
        x, idx, w = gather(x), gather(idx), gather(w)
    n_local = experts["w1"].shape[0]
    e0 = _local_offset(lay.expert_axes, n_local)
    local = (idx >= e0) & (idx < e0 + n_local)
    y = local_experts(x, jnp.where(local, idx - e0, 0), jnp.where(local, w, 0.0), local, experts, impl, limit,
                      interpret)
    if lay.gather_axes:
        y = jax.lax.psum_scatter(y, lay.gather_axes, scatter_dimension=0, tiled=True)
    ys = None
    if shared is not None:
        ys = ops.dense_mlp(x_own, shared["w1"], shared["w2"], shared["w3"], limit).astype(jnp.float32)
        if lay.fold_shared:
            y, ys = y + ys, None
    if lay.reduce_axes:
        y = jax.lax.psum(y, lay.reduce_axes)
    if ys is not None:
        y = y + (jax.lax.psum(ys, lay.shared_axes) if lay.shared_axes else ys)
    return y.astype(x_own.dtype)


def moe_block(x: jax.Array, idx: jax.Array, w: jax.Array, p: dict, config: ModelConfig, batch: int) -> jax.Array:
    """Routed experts + shared expert of one MoE layer on the mesh of `config.backends.ep`.

    x [T,D] with T = batch·S (the batch-major flattening of [batch, S, D]), idx / w [T,k] from the router,
    p the layer's ffn parameters ({"experts": ..., "shared_experts": ...}) -> [T,D] in x.dtype.
    """
    ep = config.backends.ep
    if ep.local == "auto":
        raise BackendError("ExpertParallel.local 'auto' reached traced code; resolve it first "
                           "(dsv4_jax.backends.resolve)")
    experts, shared = p["experts"], p.get("shared_experts")
    lay = layout(ep, config, batch, experts, shared)
    body = functools.partial(_block, lay=lay, impl=ep.local, limit=config.swiglu_limit,
                             interpret=config.backends.interpret)
    in_specs = (lay.tokens, lay.tokens, lay.tokens, lay.experts, lay.shared)
    fn = jax.shard_map(body, mesh=ep.mesh, in_specs=in_specs, out_specs=lay.tokens, check_vma=False)
    return fn(x, idx.astype(jnp.int32), w.astype(jnp.float32), experts, shared)
