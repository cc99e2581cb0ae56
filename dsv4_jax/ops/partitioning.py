"""Logical axes -> mesh axes: PartitionSpecs and the sharding constraints the model places on its activations.

A leaf's PartitionSpec is built dimension by dimension from its logical axis names and an ordered rules
mapping (logical axis -> mesh axes): a mesh axis is used for a dimension when the dimension stays
divisible by the product of the axes chosen so far and the axis is not already used by an earlier
dimension of the same leaf; anything not divisible is replicated, so every config shards on every mesh.
The model calls the `constrain_*` functions with the mesh and rules of its expert-parallel backend
(`config.backends.ep`); without that backend they return their input. Placing whole parameter and
decode-state trees is `dsv4_jax.parallel` (docs/sharding.md).
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

from . import quant


def mesh_sizes(mesh) -> dict[str, int]:
    """{axis name: size} of a Mesh, AbstractMesh or a plain mapping."""
    return dict(mesh.shape) if hasattr(mesh, "shape") and not isinstance(mesh, Mapping) else dict(mesh)


# logical axis -> mesh axes, in order of use (see the module docstring)
DEFAULT_RULES: dict[str, tuple[str, ...]] = {
    # parameters
    "experts": ("expert", "model"),
    "mlp": ("model",),
    "q_heads": ("model",),
    "heads": ("model",),
    "o_groups": ("model",),
    "index_heads": ("model",),
    "vocab": ("model",),
    # the batch of the tokens and activations
    "batch": ("data", "expert"),
    # the batch of the decode state and of the attention core that reads it (a rules mapping without it
    # uses its "batch" entry)
    "state_batch": ("data", "expert"),
}


def logical_rules(rules: Mapping[str, Sequence[str]] | None) -> dict[str, tuple[str, ...]]:
    """The rules mapping in effect: DEFAULT_RULES for None, `state_batch` from `batch` where it is missing."""
    out = dict(DEFAULT_RULES if rules is None else {k: tuple(v) for k, v in rules.items()})
    if "state_batch" not in out and "batch" in out:
        out["state_batch"] = out["batch"]
    return out


def partition_spec(shape: Sequence[int], axes: Sequence[str | None], sizes: Mapping[str, int],
                   rules: Mapping[str, Sequence[str]] | None = None) -> PartitionSpec:
    """PartitionSpec of one array from its logical axes (greedy, divisibility fallback, see module doc).

    shape [d0, d1, ...], axes (name | None per dim), sizes {mesh axis: size}. Trailing replicated
    dims are dropped (P("expert") rather than P("expert", None, None)).
    """
    rules = logical_rules(rules)
    if len(axes) != len(shape):
        raise ValueError(f"{len(axes)} logical axes {tuple(axes)} for shape {tuple(shape)}")
    used: set[str] = set()
    out: list = []
    for dim, name in zip(shape, axes):
        chosen: list[str] = []
        prod = 1
        for ax in rules.get(name, ()) if name is not None else ():
            n = sizes.get(ax, 1)
            if n == 1 or ax in used or dim % (prod * n):
                continue
            chosen.append(ax)
            prod *= n
        used.update(chosen)
        out.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    while out and out[-1] is None:
        out.pop()
    return PartitionSpec(*out)


def leaf_partition_spec(spec, sizes: Mapping[str, int], rules=None, replicated: bool = False):
    """PartitionSpec of one leaf. A quantized spec gives QArray(codes spec, scale spec): the codes are split
    like the dense twin (the rules applied to the codes' shape: the same spec unless FP4 packing breaks a
    divisibility), the scale keeps a dim's mesh axes when every shard then holds whole blocks
    (`ops.quant.block_grid`) and is replicated along it otherwise. At Flash sizes both equal the dense twin's
    spec; in tiny configs FP8's single partial 128-block stays whole (still correct under GSPMD)."""
    if replicated:
        ps = PartitionSpec()
        return ps if spec.quant is None else quant.QArray(ps, ps, spec.quant)
    if spec.quant is None:
        return partition_spec(spec.shape, spec.axes, sizes, rules)
    codes_shape, _ = quant.stored_shapes(spec.quant, spec.shape)
    codes = partition_spec(codes_shape, spec.axes, sizes, rules)
    grid = quant.block_grid(spec.quant, spec.shape)
    entries = tuple(codes) + (None,) * (len(grid) - len(codes))
    scale = []
    for g, e in zip(grid, entries):
        n = math.prod(sizes[a] for a in (e if isinstance(e, tuple) else (e,)) if a is not None)
        scale.append(e if g % n == 0 else None)
    while scale and scale[-1] is None:
        scale.pop()
    return quant.QArray(codes, PartitionSpec(*scale), spec.quant)


def constrain(x, mesh: jax.sharding.Mesh, axes: Sequence[str | None], rules=None):
    """`with_sharding_constraint` of an activation by logical axes (inside jit; identity on 1 device)."""
    spec = partition_spec(x.shape, axes, mesh_sizes(mesh), rules)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def _expert_parallel(config):
    """The config's expert-parallel placement (`backends.ExpertParallel`: mesh + rules), None without it."""
    return config.backends.ep if config.backends.moe == "ep" else None


def constrain_rows(x: jax.Array, config, batch_axis: str = "batch") -> jax.Array:
    """A [B, ...] activation with its batch dim split per the logical axis `batch_axis` and every other dim
    whole. With the expert-parallel backend (the presets) the mesh and rules come from `config.backends.ep`;
    identity otherwise."""
    return constrain_logical(x, config, (batch_axis,) + (None,) * (x.ndim - 1))


def constrain_logical(x: jax.Array, config, axes: Sequence[str | None]) -> jax.Array:
    """`constrain` by logical axes on the expert-parallel backend's mesh and rules (identity without it)."""
    ep = _expert_parallel(config)
    return x if ep is None else constrain(x, ep.mesh, axes, ep.rules_dict)


def constrain_state_rows(x: jax.Array, config) -> jax.Array:
    """A [B, ...] activation bound for the decode state (new K=V rows, compressed rows, ring entries, the
    queries of the attention core) placed like the state: split by `state_batch`, every other dim whole.

    Without it GSPMD carries a split of the projection's output dim (the latency preset splits W_kv and the
    compressors by output row) into the cache tables it writes, and then all-gathers whole tables where
    the attention reads them. The rows are first placed like the tokens (`batch`): where the state is split
    further (the latency preset at B ≥ chips) GSPMD then slices a gathered [B, d] result instead of
    all-gathering the projection's weight to compute each device's rows (v5p AOT, 7 layers, B = 8: 2.72 →
    2.56 GiB per chip)."""
    if state_split_beyond_tokens(config, x.shape[0]):
        x = constrain_rows(x, config)
    return constrain_rows(x, config, "state_batch")


def state_batch_entry(config, batch: int):
    """How the batch dim (`state_batch`) of a [B, ...] decode-state leaf is split under the config's
    expert-parallel backend: ("split", PartitionSpec entry), ("whole", None), or ("unknown", None) without
    that backend (plain GSPMD or one device: the model code cannot see the placement)."""
    spec = _batch_spec(config, batch, "state_batch")
    if spec is None:
        return "unknown", None
    return ("split", spec[0]) if len(spec) else ("whole", None)


def state_split_beyond_tokens(config, batch: int) -> bool:
    """Whether a batch of `batch` sequences has its decode state split over mesh axes its tokens are not
    (the latency preset at B ≥ chips): the attention core then runs where the state is."""
    return _batch_spec(config, batch, "state_batch") != _batch_spec(config, batch, "batch")


def _batch_spec(config, batch: int, axis: str) -> PartitionSpec | None:
    """PartitionSpec of a batch of `batch` along logical `axis` on the expert-parallel backend's mesh (None
    without that backend)."""
    ep = _expert_parallel(config)
    return None if ep is None else partition_spec((batch,), (axis,), mesh_sizes(ep.mesh), ep.rules_dict)
