"""Meshes, logical-axis sharding rules and multi-host set-up (GSPMD; see docs/sharding.md).

Mesh: three named axes, `MESH_AXES = ("data", "expert", "model")`:

    data    pure data parallelism: the batch of the decode state (and of the tokens) is split,
            the weights are replicated.
    expert  expert parallelism for the routed experts (the `experts` axis of w1/w2/w3) and data
            parallelism of the batch for everything else ("DP attention": each expert-group
            device attends its own sequences, then tokens meet their experts).
    model   tensor parallelism: attention heads (`q_heads`, `heads`), O-LoRA groups (`o_groups`),
            indexer heads (`index_heads`), the shared expert's `mlp` and the vocabulary (`vocab`:
            embedding, head, hash table). The routed experts also use it (expert parallelism over
            expert × model), so an 8-way `model` mesh still holds 1/8 of the experts per device.

Rules map each logical axis name of `params.ParamSpec` (and of the decode state) to an ordered tuple
of mesh axes. A leaf's PartitionSpec is built dimension by dimension, greedily: a mesh axis is used
for a dimension when the dimension stays divisible by the product of the axes chosen so far and the
axis is not already used by an earlier dimension of the same leaf. Anything not divisible falls back
to replication, so every config (tiny test ones included) shards on every mesh. Mesh axes of size 1
are skipped (specs stay short and readable). The stacking axis `layers` is never split.

The model code is not changed: params and state are placed with `jax.device_put` onto the
shardings returned here and the existing jitted functions (`forward`, `decode.process_block`, ...)
run as GSPMD programs; with the expert-parallel backend (`Backends(moe="ep")`, set by the presets
below) the routed experts run under an explicit `shard_map` (`model.moe_ep`).

Presets (`PRESETS`, `preset(name)`): a mesh shape for n devices + rules + backends, by name:
"latency" (tensor-parallel attention / vocabulary and expert-tensor-parallel experts on `model`,
small batches) and "throughput" (data-parallel attention and expert-parallel experts on `expert`,
large batches); see docs/sharding.md. Axis types must be `Auto` (jax 0.10's `jax.make_mesh` defaults to
`Explicit`, which would demand sharding annotations inside the model), so use `make_mesh` below.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from . import cache
from . import params as P
from .backends import REFERENCE, Backends, ExpertParallel, resolve
from .cache import DecodeState, state_shapes
from .config import ModelConfig
from .ops import quant

MESH_AXES = ("data", "expert", "model")

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

# Flat parameter paths (regex, searched) kept replicated whatever their axes: the router bias (its top-k
# wants every expert's score on every device; the router weight's own axes, `router_experts` and
# `router_in`, have no default rule, so it is replicated too unless a preset splits its contraction).
DEFAULT_REPLICATED: tuple[str, ...] = (r"(^|\.)ffn\.gate\.bias$",)


# ---- meshes --------------------------------------------------------------------------------------

def default_mesh_shape(n_devices: int) -> tuple[int, int, int]:
    """(data, expert, model) for n devices: all of them on `expert` (EP for experts, DP attention)."""
    return (1, n_devices, 1)


def parse_mesh_shape(text: str) -> tuple[int, ...]:
    """'1x8x1' -> (1, 8, 1): positive DATAxEXPERTxMODEL sizes; ValueError naming the problem otherwise."""
    try:
        shape = tuple(int(v) for v in text.lower().split("x"))
    except ValueError:
        shape = ()
    if len(shape) != len(MESH_AXES) or min(shape) < 1:
        raise ValueError(f"mesh {text!r}: expected DATAxEXPERTxMODEL sizes ({len(MESH_AXES)} positive integers) like 1x8x1")
    return shape


def make_mesh(shape: Sequence[int] | None = None, devices: Sequence[Any] | None = None,
              axis_names: Sequence[str] = MESH_AXES) -> Mesh:
    """A Mesh with `Auto` axis types over `devices` (default: all, `jax.devices()`, every host).

    shape: sizes of (data, expert, model), product = number of devices; default `default_mesh_shape`.
    One size may be -1 (inferred).
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    shape = list(default_mesh_shape(n) if shape is None else shape)
    if len(shape) != len(axis_names):
        raise ValueError(f"mesh shape {tuple(shape)} does not match axes {tuple(axis_names)}")
    if shape.count(-1) > 1:
        raise ValueError("at most one mesh size may be -1")
    if -1 in shape:
        rest = math.prod(s for s in shape if s != -1)
        shape[shape.index(-1)] = n // rest if rest and n % rest == 0 else 0
    if math.prod(shape) != n or min(shape) < 1:
        raise ValueError(f"mesh shape {tuple(shape)} needs {math.prod(shape)} devices, have {n}")
    types = (AxisType.Auto,) * len(axis_names)
    try:
        return jax.make_mesh(tuple(shape), tuple(axis_names), axis_types=types, devices=devices)
    except Exception:  # noqa: BLE001 - topology-aware placement unavailable: plain row-major order
        return Mesh(np.asarray(devices, dtype=object).reshape(shape), tuple(axis_names), axis_types=types)


def mesh_sizes(mesh) -> dict[str, int]:
    """{axis name: size} of a Mesh, AbstractMesh or a plain mapping."""
    return dict(mesh.shape) if hasattr(mesh, "shape") and not isinstance(mesh, Mapping) else dict(mesh)


# ---- logical axes -> PartitionSpec ---------------------------------------------------------------

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


def _is_spec(x) -> bool:
    return isinstance(x, P.ParamSpec)


def _replicated_path(path: str, replicated: Sequence[str]) -> bool:
    return any(re.search(p, path) for p in replicated)


def leaf_partition_spec(spec: P.ParamSpec, sizes: Mapping[str, int], rules=None, replicated: bool = False):
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
    """DecodeState of NamedSharding for a state of the given size (parallel to `cache.init_state`)."""
    specs = state_partition_specs(state_shapes(config, batch, max_len, max_block, dtype), mesh, rules)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def shardings_like(state: DecodeState, mesh: Mesh, rules=None) -> DecodeState:
    """NamedShardings for an existing DecodeState (any batch / sizes)."""
    specs = state_partition_specs(state, mesh, rules)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def init_state(config: ModelConfig, mesh: Mesh, batch: int, max_len: int, max_block: int = 8,
               dtype=jnp.float32, rules=None) -> DecodeState:
    """`cache.init_state` created directly in its shardings (never whole on one device)."""
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


def constrain(x, mesh: Mesh, axes: Sequence[str | None], rules=None):
    """`with_sharding_constraint` of an activation by logical axes (inside jit; identity on 1 device)."""
    spec = partition_spec(x.shape, axes, mesh_sizes(mesh), rules)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def _expert_parallel(config: ModelConfig):
    """The config's expert-parallel placement (`backends.ExpertParallel`: mesh + rules), None without it."""
    return config.backends.ep if config.backends.moe == "ep" else None


def constrain_rows(x: jax.Array, config: ModelConfig, batch_axis: str = "batch") -> jax.Array:
    """A [B, ...] activation with its batch dim split per the logical axis `batch_axis` and every other dim
    whole. With the expert-parallel backend (the presets) the mesh and rules come from `config.backends.ep`;
    identity otherwise."""
    return constrain_logical(x, config, (batch_axis,) + (None,) * (x.ndim - 1))


def constrain_logical(x: jax.Array, config: ModelConfig, axes: Sequence[str | None]) -> jax.Array:
    """`constrain` by logical axes on the expert-parallel backend's mesh and rules (identity without it)."""
    ep = _expert_parallel(config)
    return x if ep is None else constrain(x, ep.mesh, axes, ep.rules_dict)


def constrain_state_rows(x: jax.Array, config: ModelConfig) -> jax.Array:
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


def state_batch_entry(config: ModelConfig, batch: int):
    """How the batch dim (`state_batch`) of a [B, ...] decode-state leaf is split under the config's
    expert-parallel backend: ("split", PartitionSpec entry), ("whole", None), or ("unknown", None) without
    that backend (plain GSPMD or one device: the model code cannot see the placement)."""
    spec = _batch_spec(config, batch, "state_batch")
    if spec is None:
        return "unknown", None
    return ("split", spec[0]) if len(spec) else ("whole", None)


def state_split_beyond_tokens(config: ModelConfig, batch: int) -> bool:
    """Whether a batch of `batch` sequences has its decode state split over mesh axes its tokens are not
    (the latency preset at B ≥ chips): the attention core then runs where the state is."""
    return _batch_spec(config, batch, "state_batch") != _batch_spec(config, batch, "batch")


def _batch_spec(config: ModelConfig, batch: int, axis: str) -> PartitionSpec | None:
    """PartitionSpec of a batch of `batch` along logical `axis` on the expert-parallel backend's mesh (None
    without that backend)."""
    ep = _expert_parallel(config)
    return None if ep is None else partition_spec((batch,), (axis,), mesh_sizes(ep.mesh), ep.rules_dict)


# ---- presets: mesh shape + rules + backends ---------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ShardingPreset:
    """A named placement: all devices on one mesh axis, logical-axis rules, the expert-parallel MoE.

    axis: the mesh axis that takes every device ("model" or "expert"); rules: ((logical axis, mesh axes),
    ...) (hashable form of a rules mapping); local: the per-device grouped matmul of the EP MoE
    (backends.EP_LOCAL, "auto": by platform).
    """

    name: str
    axis: str
    rules: tuple[tuple[str, tuple[str, ...]], ...]
    summary: str
    local: str = "auto"

    def mesh_shape(self, n_devices: int) -> tuple[int, int, int]:
        """(data, expert, model) with all n devices on `axis`."""
        return tuple(n_devices if a == self.axis else 1 for a in MESH_AXES)

    def make_mesh(self, devices: Sequence[Any] | None = None) -> Mesh:
        devices = list(jax.devices() if devices is None else devices)
        return make_mesh(self.mesh_shape(len(devices)), devices)

    @property
    def rules_dict(self) -> dict[str, tuple[str, ...]]:
        return dict(self.rules)

    def backends(self, mesh: Mesh, base: Backends = REFERENCE) -> Backends:
        """`base` with the expert-parallel MoE on `mesh`, resolved for the mesh's platform."""
        ep = ExpertParallel(mesh=mesh, rules=self.rules, local=self.local)
        platform = mesh.devices.flat[0].platform
        return resolve(base.replace(moe="ep", ep=ep), platform)

    def apply(self, config: ModelConfig, mesh: Mesh) -> ModelConfig:
        """The config with this preset's backends on `mesh` (other backend choices kept)."""
        return config.with_backends(self.backends(mesh, config.backends))


# The latency preset's splits of the matrices that have no head / group / vocabulary axis, all over `model`
# (GSPMD inserts the small collectives: an all-gather of the [T, q_lora] / [T, d] / [T, cd] outputs, a psum of
# the [T, E] router logits and of the [T, n_out] mHC mixes):
#   q_lora    W_qa [q_lora, D] by output row (and q_norm); W_qb / the indexer's W_qb keep their head split
#   head_dim  the K=V projection W_kv [d, D] by output row (and kv_norm, the compressors' norms)
#   comp_dim  the compressors' W_kv / W_gate [cd, D] by output row (and the position biases B)
#   hc_embed  the mHC mixing matrices [n_out, n_hc·D] along their contraction
# The router W_r [E, D] (0.2 % of the non-expert bytes) stays replicated: split along its contraction
# (`router_in`) GSPMD all-gathers the weight at B = 8 (v5p AOT) instead of summing the [T, E] logits.
# The rows these projections write to the decode state are placed like the state
# (`constrain_state_rows`), so the split output dims do not spread into the cache tables.
LATENCY_SPLIT: dict[str, tuple[str, ...]] = {"q_lora": ("model",), "head_dim": ("model",), "comp_dim": ("model",),
                                              "hc_embed": ("model",)}


def _preset_rules(**changes) -> tuple[tuple[str, tuple[str, ...]], ...]:
    return ExpertParallel.freeze_rules({**DEFAULT_RULES, **changes})


PRESETS: dict[str, ShardingPreset] = {
    # Decode latency, small batches: attention heads, O-LoRA groups, indexer heads and the vocabulary are
    # split over `model` (tensor parallelism); each routed expert is split along its intermediate axis
    # `mlp` over `model` too (expert-tensor parallelism), so a decode step reads 1/n of every *active*
    # expert on each device instead of whole experts on the few devices that hold them. The small
    # projections are split too, so no device reads a whole non-expert matrix (`LATENCY_SPLIT`). The
    # decode state (one shared K=V head: nothing to split by head) is split by sequence over `model` when
    # the batch divides (`state_batch`): each device scores, gathers and attends its own sequences' rows
    # for every head (the queries gathered there, the output back to the head split), instead of every
    # device reading every sequence's cache (v5p AOT, 7 layers, B = 8: 2.88 → 2.56 GiB per chip);
    # replicated otherwise (B = 1).
    "latency": ShardingPreset(
        "latency", "model", _preset_rules(experts=(), state_batch=("model",), **LATENCY_SPLIT),
        "tensor-parallel attention / O-LoRA groups / vocabulary + expert-tensor-parallel experts on 'model' "
        "(small batches)"),
    # Throughput, large batches: the batch (decode state, attention) is split over `expert` (data-parallel
    # attention, weights other than experts replicated) and the routed experts are split over `expert`
    # (expert parallelism, E/n whole experts per device).
    "throughput": ShardingPreset(
        "throughput", "expert", _preset_rules(),
        "data-parallel attention + expert-parallel experts on 'expert' (large batches)"),
}


def preset(name: str | ShardingPreset) -> ShardingPreset:
    """A sharding preset by name (or itself)."""
    if isinstance(name, ShardingPreset):
        return name
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown sharding preset {name!r}; choose from {sorted(PRESETS)}") from None


# ---- multi-host --------------------------------------------------------------------------------------

def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, local_device_ids: Sequence[int] | None = None,
                           **kwargs) -> bool:
    """`jax.distributed.initialize` with environment defaults; call once per process, before any jax op.

    Arguments default to DSV4_COORDINATOR (host:port of process 0), DSV4_NUM_PROCESSES, DSV4_PROCESS_ID
    and DSV4_LOCAL_DEVICE_IDS (comma list). When none is given anywhere, jax's own auto-detection
    runs (TPU pods, SLURM, Open MPI, ...). A single process with nothing configured is a no-op.
    Returns True when jax.distributed was initialised.
    """
    env = os.environ
    coordinator_address = coordinator_address or env.get("DSV4_COORDINATOR")
    if num_processes is None and env.get("DSV4_NUM_PROCESSES"):
        num_processes = int(env["DSV4_NUM_PROCESSES"])
    if process_id is None and env.get("DSV4_PROCESS_ID"):
        process_id = int(env["DSV4_PROCESS_ID"])
    if local_device_ids is None and env.get("DSV4_LOCAL_DEVICE_IDS"):
        local_device_ids = [int(i) for i in env["DSV4_LOCAL_DEVICE_IDS"].split(",")]
    explicit = coordinator_address is not None or num_processes is not None
    if not explicit and not _cluster_detected():
        return False
    if num_processes == 1 and coordinator_address is None:
        return False
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id, local_device_ids=local_device_ids, **kwargs)
    return True


def _cluster_detected() -> bool:
    """A cluster environment jax.distributed can auto-detect (TPU pod, SLURM job step, Open MPI, Kubernetes)."""
    env = os.environ
    return any(k in env for k in ("TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS", "OMPI_COMM_WORLD_SIZE")) or \
        ("SLURM_JOB_ID" in env and int(env.get("SLURM_NTASKS", "1")) > 1)


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


__all__ = ["DEFAULT_REPLICATED", "DEFAULT_RULES", "LATENCY_SPLIT", "MESH_AXES", "PRESETS", "ShardingPreset",
           "constrain", "constrain_logical", "constrain_rows", "constrain_state_rows",
           "default_mesh_shape", "logical_rules", "state_batch_entry", "state_split_beyond_tokens",
           "describe", "drafter_shardings", "init_state", "initialize_distributed", "leaf_partition_spec", "make_mesh", "mesh_sizes",
           "param_partition_specs", "param_shardings", "partition_spec", "preset", "shard_batch", "shard_params",
           "shard_state", "shardings_like", "spec_sharding", "spec_tree_partition_specs", "state_partition_specs",
           "state_shardings"]
