"""Placing the model's trees on a mesh: PartitionSpecs / NamedShardings of parameters, drafters and decode state
from their logical axes (`ops.partitioning` holds the per-leaf rule and the in-graph constraints)."""
from __future__ import annotations

import re
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..model import state as cache
from ..model import params as P
from ..model.state import DecodeState, state_shapes
from ..config import ModelConfig
from ..ops import quant
from ..ops.partitioning import (leaf_partition_spec, mesh_sizes, partition_spec)


# Flat parameter paths (regex, searched) kept replicated whatever their axes: the router bias (its top-k
# wants every expert's score on every device; the router weight's own axes, `router_experts` and
# `router_in`, have no default rule, so it is replicated too unless a preset splits its contraction).
DEFAULT_REPLICATED: tuple[str, ...] = (r"(^|\.)ffn\.gate\.bias$",)


# ---- logical axes -> PartitionSpec ---------------------------------------------------------------


def _is_spec(x) -> bool:
    return isinstance(x, P.ParamSpec)


def _replicated_path(path: str, replicated: Sequence[str]) -> bool:
    return any(re.search(p, path) for p in replicated)


def _is_pspec(x) -> bool:
    return isinstance(x, PartitionSpec)


def _named(mesh, tree):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), tree, is_leaf=_is_pspec)


def spec_tree_partition_specs(specs, sizes: Mapping[str, int], rules=None,
                              replicated: Sequence[str] | None = None):
    """Tree of PartitionSpec parallel to a tree of ParamSpec (target, MTP or DSpark specs; quantized specs
    give QArray nodes of PartitionSpecs, parallel to the QArray leaves of the parameters)."""
    replicated = DEFAULT_REPLICATED if replicated is None else tuple(replicated)

    def one(path, s):
        flat = ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        return leaf_partition_spec(s, sizes, rules, _replicated_path(flat, replicated))

    return jax.tree_util.tree_map_with_path(one, specs, is_leaf=_is_spec)


def _target_specs(config: ModelConfig, formats):
    specs = P.param_specs(config)
    return specs if formats is None else P.with_formats(specs, formats)


def param_partition_specs(config: ModelConfig, mesh, rules=None, replicated=None, formats=None):
    """Tree of PartitionSpec parallel to the parameters of `config` (mesh: Mesh, AbstractMesh or sizes).
    formats: quantized leaves (`params.with_formats`: a rule or {path: format}, e.g. `params.formats_of(tree)`)."""
    return spec_tree_partition_specs(_target_specs(config, formats), mesh_sizes(mesh), rules, replicated)


def param_shardings(config: ModelConfig, mesh: Mesh, rules=None, replicated=None, formats=None):
    """Tree of NamedSharding parallel to the parameters of `config` (QArray nodes for quantized leaves)."""
    return _named(mesh, param_partition_specs(config, mesh, rules, replicated, formats))


def spec_sharding(spec: P.ParamSpec, mesh: Mesh, rules=None, path: str = "", replicated=None):
    """NamedSharding of one ParamSpec leaf at flat `path`; a QArray of two NamedShardings (codes, scale)
    for a quantized spec."""
    replicated = DEFAULT_REPLICATED if replicated is None else tuple(replicated)
    return _named(mesh, leaf_partition_spec(spec, mesh_sizes(mesh), rules, _replicated_path(path, replicated)))


# ---- decode state ----------------------------------------------------------------------------------

def state_partition_specs(state: DecodeState, mesh, rules=None) -> DecodeState:
    """PartitionSpecs of a DecodeState (or its `state_shapes`): layer leaves [reps, B, ...] split on
    the batch (`batch` rule), everything else replicated; `pos [B]` stays replicated so the host-side
    capacity checks (`np.asarray(state.pos)`) work on every host."""
    sizes = mesh_sizes(mesh)

    def layer_leaf(x):
        axes = ("layers", "state_batch") + (None,) * (len(x.shape) - 2)
        return partition_spec(x.shape, axes, sizes, rules)

    layers = jax.tree.map(layer_leaf, state.layers)
    return state.replace(pos=PartitionSpec(), layers=layers)


def state_shardings(config: ModelConfig, mesh: Mesh, batch: int, max_len: int, max_block: int = 8,
                    dtype=jnp.float32, rules=None) -> DecodeState:
    """DecodeState of NamedSharding for a state of the given size (parallel to `model.state.init_state`)."""
    specs = state_partition_specs(state_shapes(config, batch, max_len, max_block, dtype), mesh, rules)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def shardings_like(state: DecodeState, mesh: Mesh, rules=None) -> DecodeState:
    """NamedShardings for an existing DecodeState (any batch / sizes)."""
    specs = state_partition_specs(state, mesh, rules)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def init_sharded_state(config: ModelConfig, mesh: Mesh, batch: int, max_len: int, max_block: int = 8,
               dtype=jnp.float32, rules=None) -> DecodeState:
    """`model.state.init_state` created directly in its shardings (never whole on one device)."""
    if max_len <= 0 or max_block <= 0 or batch <= 0:
        raise ValueError(f"batch, max_len and max_block must be positive (got {batch}, {max_len}, {max_block})")
    shard = state_shardings(config, mesh, batch, max_len, max_block, dtype, rules)
    make = jax.jit(lambda: cache.init_state(config, batch, max_len, max_block, dtype), out_shardings=shard)
    return make()


# ---- placing trees ---------------------------------------------------------------------------------

def shard_params(params, config: ModelConfig, mesh: Mesh, rules=None, replicated=None):
    """device_put a target parameter tree (optionally with "mtp" / "dspark" entries) onto its shardings;
    QArray leaves (quantized weights) are placed like their dense twins, scales following their codes."""
    target = {k: v for k, v in params.items() if k not in ("mtp", "dspark")}
    out = _put(target, param_shardings(config, mesh, rules, replicated, P.formats_of(target)))
    if "mtp" in params:
        out["mtp"] = [_put(m, drafter_shardings(P.with_formats(P.mtp_specs(config), P.formats_of(m)), mesh, rules,
                                                replicated)) for m in params["mtp"]]
    if "dspark" in params:
        d = params["dspark"]
        out["dspark"] = _put(d, _dspark_shardings_like(d, config, mesh, rules, replicated))
    return out


def _put(tree, shardings):
    """device_put onto a sharding tree whose QArray nodes carry the leaves' own (static) dtype."""
    like = jax.tree.map(lambda s, x: quant.QArray(s.codes, s.scale, x.fmt, x.dtype) if isinstance(s, quant.QArray)
                        else s, shardings, tree, is_leaf=quant.is_qarray)
    return jax.device_put(tree, like)


def drafter_shardings(specs, mesh: Mesh, rules=None, replicated=None):
    """NamedShardings for a drafter ParamSpec tree (`params.mtp_specs`, `params.dspark_specs`)."""
    return _named(mesh, spec_tree_partition_specs(specs, mesh_sizes(mesh), rules, replicated))


def _dspark_shardings_like(d: dict, config: ModelConfig, mesh: Mesh, rules, replicated):
    n_taps = d["main_proj"].shape[1] // config.hidden_size
    specs = P.dspark_specs(config, len(d["stages"]), n_taps, d["markov_w1"].shape[1], "bias" in d["conf_proj"])
    return drafter_shardings(P.with_formats(specs, P.formats_of(d)), mesh, rules, replicated)


def shard_state(state: DecodeState, mesh: Mesh, rules=None) -> DecodeState:
    """device_put a DecodeState onto its shardings."""
    return jax.device_put(state, shardings_like(state, mesh, rules))


def shard_batch(x, mesh: Mesh, rules=None):
    """device_put a [B, ...] array (tokens, lengths) split on the batch (`batch` rule)."""
    x = jnp.asarray(x)
    spec = partition_spec(x.shape, ("batch",) + (None,) * (x.ndim - 1), mesh_sizes(mesh), rules)
    return jax.device_put(x, NamedSharding(mesh, spec))


def describe(shardings) -> dict[str, str]:
    """{flat path: str(PartitionSpec)} of a sharding tree (for logs and docs); a quantized leaf gives
    "path.codes" and "path.scale" entries."""
    flat = {}
    for path, s in P.flatten(shardings).items():
        if isinstance(s, quant.QArray):
            flat[path + ".codes"], flat[path + ".scale"] = str(s.codes.spec), str(s.scale.spec)
        else:
            flat[path] = str(s.spec)
    return dict(sorted(flat.items()))


