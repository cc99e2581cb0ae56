"""Expert-parallel MoE under `jax.shard_map` (backend moe="ep"; docs/design.md property 10; docs/model_math.md §2.8).

The routed experts' collectives are written down here; everything around them stays GSPMD. The router
runs before (GSPMD, the router weight replicated: its logical axes `router_experts` / `router_in` have no
rule in the presets, and the bias is in `parallel.DEFAULT_REPLICATED`; every device gets every score), then
one `shard_map` over the whole mesh takes, per device,

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
     (`ExpertParallel.local`: a row of the dispatch table `experts.TABLE` that the single-device MoE
     uses too, see `local_experts`) -> a float32 partial sum [T_group, D];
  3. reduce: `psum_scatter` over the gather axes (back to its own tokens), then `psum` over the other
     axes the experts are split over (expert axes not splitting tokens, and the `mlp` axes of
     expert-tensor parallelism). The shared expert runs on the device's own tokens; its partial sum
     (split over its `mlp` axes) joins the same `psum` when those are exactly the remaining axes
     (the usual case: both on `model`), else it is reduced on its own.

Quantized experts (`ops.quant.QArray` leaves, routed or shared) come in as placed: codes and scales
with the specs `parallel.leaf_partition_spec` gives them (`shard_params`), so every device holds the
codes and scales of its own expert slices. Where a scale block straddles the shards (the scale whole
along a split dim; tiny configs only, e.g. FP8's 128-row blocks over a 6-row shard) `local_qarray`
takes this shard's scale rows. The local matmuls dequantize one expert tile at a time (the sliced
path, the expert-pure row tiles of `ops.moe.experts_tiled`), in the kernels (`pallas`, `pallas_tpu`
for the formats `kernels.tpu_moe.supports`; Q8_0 falls back to the reference), or, for `dense`, the
local stack as one expression feeding the matmuls (FP4 word stacks: one expert slice per matmul,
`experts.experts_each`, so XLA:TPU reads each slice in place from the layer-stacked words).

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
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from ...backends import BackendError, ExpertParallel
from ...config import MOE, ModelConfig
from ...ops import moe as ops
from ...ops import quant
from ...ops.quant import QArray
from ..params import ParamSpec, moe_specs
from .experts import Assignments, ExpertCall, routed
from .experts import reads_stack_in_place  # noqa: F401  (the in-place rule `local_experts` follows, named here too)
from .stacked_experts import StackedExperts
from ...ops.partitioning import leaf_partition_spec, mesh_sizes, partition_spec

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
    sizes: dict                            # mesh axis -> devices along it

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
    """Logical axes of a routed ("experts") or shared ("shared_experts") leaf."""
    return moe_specs(config, MOE)[group][name].axes


def leaf_spec(leaf, axes: tuple, sizes: dict, rules):
    """PartitionSpec of a dense expert leaf; for a QArray a QArray(codes spec, scale spec)
    (`parallel.leaf_partition_spec`: the placement `shard_params` gives it)."""
    if not isinstance(leaf, QArray):
        return leaf_partition_spec(ParamSpec(tuple(leaf.shape), axes), sizes, rules)
    sp = leaf_partition_spec(ParamSpec(tuple(leaf.shape), axes, quant=leaf.fmt), sizes, rules)
    return QArray(sp.codes, sp.scale, leaf.fmt, leaf.dtype)     # the leaf's static parts: the same tree node


def _codes_spec(spec):
    return spec.codes if isinstance(spec, QArray) else spec


def layout(ep: ExpertParallel, config: ModelConfig, batch: int, experts: dict, shared: dict | None) -> Layout:
    """The shard_map specs for a batch of `batch` sequences and these (per-layer) expert leaves (dense or
    `ops.quant.QArray`: codes and scales get the placement `shard_params` gave them).

    Raises BackendError for placements the explicit path cannot run: the contraction dimension (`embed`)
    split, routed leaves split differently, or a shared expert split over an axis that splits the tokens.
    """
    sizes, rules = mesh_sizes(ep.mesh), ep.rules_dict
    tok = partition_spec((batch,), ("batch",), sizes, rules)
    token_axes = _dim_axes(tok, 0)

    def specs(tree: dict, group: str) -> dict:
        return {k: leaf_spec(v, leaf_axes(k, config, group), sizes, rules) for k, v in tree.items()}

    e_specs = specs(experts, "experts")
    w1 = _codes_spec(e_specs["w1"])
    expert_axes = _dim_axes(w1, 0)
    mlp_axes = _dim_axes(w1, 1)
    for k, sp in e_specs.items():
        ax, sp = leaf_axes(k, config, "experts"), _codes_spec(sp)
        if _dim_axes(sp, ax.index("embed")):
            raise BackendError(f"expert-parallel MoE: the rules split the contraction axis 'embed' of {k} ({sp})")
        if (_dim_axes(sp, 0), _dim_axes(sp, ax.index("mlp"))) != (expert_axes, mlp_axes):
            raise BackendError(f"expert-parallel MoE: {k} is split as {sp}, unlike w1 ({w1}); the local experts "
                               f"must be the same slices of every matrix")
    split = expert_axes + mlp_axes
    gather = tuple(a for a in token_axes if a in split)
    reduce_ = tuple(a for a in split if a not in gather)
    s_specs, s_axes = None, ()
    if shared is not None:
        s_specs = specs(shared, "shared_experts")
        s_axes = _spec_axes(_codes_spec(s_specs["w1"]))
        if set(s_axes) & set(token_axes) or any(
                _dim_axes(_codes_spec(sp), leaf_axes(k, config, "shared_experts").index("embed"))
                for k, sp in s_specs.items()):
            raise BackendError(f"expert-parallel MoE: the shared expert is split as {s_specs['w1']} over an axis "
                               f"that splits the tokens ({tok}) or over 'embed'; give 'mlp' other mesh axes")
    return Layout(PartitionSpec(tok[0] if len(tok) else None), e_specs, s_specs, expert_axes, gather, reduce_,
                  s_axes, sizes)


# ---- quantized leaves inside the shard_map --------------------------------------------------------------

def local_qarray(q: QArray, spec: QArray, sizes: dict) -> QArray:
    """This device's QArray from its shards. Where the codes are split along a dim but the scale is whole
    there (a scale block straddles the shards, e.g. FP8's 128-row blocks over a small split: tiny configs
    only), the scale is expanded to one per element along that dim and this shard's rows taken: a
    QArray with block 1 on that dim, the same values. q: codes / scale as shard_map passes them."""
    codes, scale, fmt = q.codes, q.scale, q.fmt
    block = list(fmt.block)
    nd = codes.ndim
    for dim in (nd - 2, nd - 1):
        c_axes, s_axes = _dim_axes(spec.codes, dim), _dim_axes(spec.scale, dim)
        if not c_axes or s_axes == c_axes:
            continue
        n_split = math.prod(sizes[a] for a in c_axes)
        n_loc = q.shape[dim]                                         # logical rows / cols of this shard
        full = list(q.shape)
        full[dim] = n_loc * n_split
        b = quant.resolved_block(fmt, full)[dim - (nd - 2)]
        s = jnp.repeat(scale, b, axis=dim) if b > 1 else scale
        s = jax.lax.slice_in_dim(s, 0, full[dim], axis=dim)
        scale = jax.lax.dynamic_slice_in_dim(s, jax.lax.axis_index(c_axes) * n_loc, n_loc, axis=dim)
        block[dim - (nd - 2)] = 1
    return QArray(codes, scale, quant.QFormat(fmt.codes, tuple(block), fmt.scale), q.dtype)


def stacked_spec(spec):
    """A per-layer expert leaf's spec with the segment's layer axis in front, unsplit (how `shard_params`
    places a scanned segment's stacked leaves: the layer axis has no rule)."""
    add = lambda ps: PartitionSpec(None, *ps)
    return QArray(add(spec.codes), add(spec.scale), spec.fmt, spec.dtype) if isinstance(spec, QArray) else add(spec)


def layer_view(stack: dict) -> dict:
    """ShapeDtypeStructs (QArrays of them) of one layer of a stacked expert tree [reps, E, ...]."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), stack)


def local_leaves(tree: dict, specs: dict, sizes: dict) -> dict:
    """`local_qarray` on the QArray leaves of an expert tree, dense leaves as they are."""
    return {k: local_qarray(v, specs[k], sizes) if isinstance(v, QArray) else v for k, v in tree.items()}


# ---- the local grouped matmul --------------------------------------------------------------------------

def local_experts(a: Assignments, e, call: ExpertCall) -> jax.Array:
    """Σ over the local assignments of w · expert(x) on this device's expert slices: the row `ExpertCall.impl`
    (`ExpertParallel.local`) of the dispatch table `experts.TABLE`, in float32. a: x [T,D]; idx [T,k] local ids
    (0 where not local), w [T,k] (0 where not local), local bool [T,k]; e {"w1" [E_loc,I_loc,D],
    "w2" [E_loc,D,I_loc], "w3"}, dense or QArray -> float32 [T,D].

    The kernels get the foreign assignments as expert 0 with weight 0 (a dropless static shape); the
    decode kernels therefore may read local expert 0 once more than the step needs.

    e may be a `StackedExperts` (this device's slice of the segment's stack + the layer's index): the Mosaic
    kernels read it in place through ids offset into the stack (no per-layer copy of the stack before the
    custom call) where `reads_stack_in_place`; every other path takes the layer's slice."""
    return routed(a, e, call).astype(jnp.float32)


# ---- the shard_map block --------------------------------------------------------------------------------

def _local_offset(expert_axes: tuple[str, ...], n_local: int):
    """First global expert id held by this device: its index on the expert axes (major first) × E_loc."""
    if not expert_axes:
        return 0
    return jax.lax.axis_index(expert_axes) * n_local


def _block(tokens, experts, shared, rep=None, *, lay: Layout, call: ExpertCall):
    """Per-device body: tokens (x [T_loc,D], idx/w [T_loc,k]), local expert slices -> y [T_loc,D] (routed +
    shared). With `rep` (the layer's index, a scalar) the experts are this device's slice of the segment's
    stack [reps, E_loc, ...], handed on as `StackedExperts`."""
    x, idx, w = tokens
    sizes, limit = lay.sizes, call.limit
    if rep is None:
        experts = local_leaves(experts, lay.experts, sizes)
        n_local = experts["w1"].shape[0]
    else:
        experts = local_leaves(experts, {k: stacked_spec(v) for k, v in lay.experts.items()}, sizes)
        n_local = experts["w1"].shape[1]
        experts = StackedExperts(experts, rep)
    shared = None if shared is None else local_leaves(shared, lay.shared, sizes)
    x_own = x
    if lay.gather_axes:
        gather = functools.partial(jax.lax.all_gather, axis_name=lay.gather_axes, axis=0, tiled=True)
        x, idx, w = gather(x), gather(idx), gather(w)
    e0 = _local_offset(lay.expert_axes, n_local)
    local = (idx >= e0) & (idx < e0 + n_local)
    y = local_experts(Assignments(x, jnp.where(local, idx - e0, 0), jnp.where(local, w, 0.0), local), experts, call)
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
    p the layer's ffn parameters ({"experts": ..., "shared_experts": ...}; the experts possibly a
    `StackedExperts`, `inplace.reads_expert_stack`: its stack goes into the shard_map whole, each device its
    slice of every layer, with the layer's index) -> [T,D] in x.dtype.
    """
    ep = config.backends.ep
    if ep.local == "auto":
        raise BackendError("ExpertParallel.local 'auto' reached traced code; resolve it first "
                           "(dsv4_jax.backends.resolve)")
    experts, shared = p["experts"], p.get("shared_experts")
    stacked = isinstance(experts, StackedExperts)
    lay = layout(ep, config, batch, layer_view(experts.stack) if stacked else experts, shared)
    body = functools.partial(_block, lay=lay, call=ExpertCall(ep.local, config.swiglu_limit,
                                                              config.backends.interpret))
    in_specs = ((lay.tokens,) * 3, lay.experts, lay.shared)
    args = ((x, idx.astype(jnp.int32), w.astype(jnp.float32)), experts, shared)
    if stacked:
        in_specs = in_specs[:1] + ({k: stacked_spec(v) for k, v in lay.experts.items()}, lay.shared, PartitionSpec())
        args = args[:1] + (experts.stack, shared, jnp.asarray(experts.rep, jnp.int32))
    fn = jax.shard_map(body, mesh=ep.mesh, in_specs=in_specs, out_specs=lay.tokens, check_vma=False)
    return fn(*args)
