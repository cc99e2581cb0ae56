"""Restore a `dsv4-convert` checkpoint into the model's parameter tree.

On disk (see `dsv4_jax.convert.writer`): `dsv4.json` + Orbax items `target/`, optional `mtp/`,
`dspark/`, all with per-layer leaves. `load_checkpoint` restores one scan segment at a time
(Orbax partial load, each array straight into its sharding), dequantizes kept codes on device,
casts, and stacks the layers of a segment on the scan axis, so peak memory is about the model plus
one segment. With a mesh, every leaf (and every stored codes / scale array) is restored into the
NamedSharding that `dsv4_jax.sharding` derives from its logical axes: each device reads only its
own slice, and the per-layer slices are stacked shard by shard.
"""
from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint.experimental.v1 as ocp1
from flax import traverse_util
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from . import params as P
from .ops import quant
from .config import ModelConfig
from .schedule import segments
from .sharding import preset as sharding_preset

META_FILE = "dsv4.json"


@dataclasses.dataclass(frozen=True)
class DSparkMeta:
    """Shape-defining DSpark values read from the checkpoint (drafters.md §2.1-2.2)."""

    n_stages: int
    n_taps: int
    markov_rank: int
    conf_bias: bool
    block_size: int | None = None
    noise_token_id: int | None = None
    target_layer_ids: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Config bundle of a checkpoint holding drafters: the target config plus drafter metadata."""

    target: ModelConfig
    mtp_layers: int = 0
    dspark: DSparkMeta | None = None


def read_metadata(path: str | os.PathLike) -> dict:
    p = os.path.join(os.fspath(path), META_FILE)
    if not os.path.exists(p):
        raise FileNotFoundError(f"{path}: not a dsv4 checkpoint (no {META_FILE}); convert one with dsv4-convert")
    with open(p) as f:
        return json.load(f)


def _leaf_dtype(spec: P.ParamSpec, dtype):
    return spec.dtype(dtype)


class _Placement:
    """Sharding of each restored array: one sharding for all (single device), or rule-derived per leaf."""

    def __init__(self, mesh=None, rules=None):
        self.mesh, self.rules = mesh, rules
        self.single = SingleDeviceSharding(jax.local_devices()[0]) if mesh is None else None

    def __call__(self, path: str, spec: P.ParamSpec, shape=None):
        if self.mesh is None:
            return self.single
        from .sharding import spec_sharding
        return spec_sharding(spec, self.mesh, self.rules, path, shape=shape)

    def stacked(self, sharding):
        """Sharding of per-layer arrays stacked on a new leading (replicated) scan axis."""
        if self.mesh is None:
            return None
        spec = tuple(sharding.spec)
        return NamedSharding(self.mesh, PartitionSpec(None, *spec) if spec else PartitionSpec())


def _abstract(rec: dict, spec: P.ParamSpec, dtype, sharding, path: str = ""):
    """sharding(path, spec, shape=None) -> Sharding of the leaf (or of one of its stored arrays)."""
    if rec["format"] == "dense":
        return jax.ShapeDtypeStruct(tuple(rec["shape"]), _leaf_dtype(spec, dtype), sharding=sharding(path, spec))
    return {k: jax.ShapeDtypeStruct(tuple(a["shape"]), np.dtype(a["dtype"]),
                                    sharding=sharding(path, spec, tuple(a["shape"])))
            for k, a in rec["arrays"].items()}


def _materialize(rec: dict, stored, spec: P.ParamSpec, dtype, sharding):
    """Stored leaf -> model array: dense leaves come cast by Orbax; kept codes are dequantized here."""
    fmt = rec["format"]
    if fmt == "dense":
        return stored
    target = _leaf_dtype(spec, dtype)
    if fmt in quant.DEVICE_FORMATS:
        out = quant.dequantize(fmt, stored, target)
        return out if sharding is None else jax.device_put(out, sharding)
    if fmt.startswith("ggml_"):          # K- / IQ-quants: gguf-py's host dequantizer
        import gguf
        arr = gguf.quants.dequantize(np.asarray(stored["codes"]), gguf.GGMLQuantizationType[fmt[5:]])
        return jax.device_put(np.asarray(arr, np.float32).reshape(rec["shape"]).astype(target),
                              sharding or jax.local_devices()[0])
    raise ValueError(f"unknown stored format {fmt!r}")


def _restore(item_path: str, leaves: dict[str, dict], specs: dict[str, P.ParamSpec], dtype, sharding) -> dict:
    """Restore the given flat leaves of one item; returns {path: model array}.

    sharding: a Sharding for every array, or a `_Placement` (per-leaf, rule-derived shardings).
    """
    place = sharding if callable(sharding) else (lambda s: lambda *_a, **_k: s)(sharding)
    abstract = {p: _abstract(leaves[p], specs[p], dtype, place, p) for p in specs}
    ctx = ocp1.Context()
    ctx.pytree.loading.partial_load = True
    with ctx:
        got = ocp1.load(item_path, traverse_util.unflatten_dict(abstract, sep="."))
    flat_stored = {}
    for p in specs:
        node = got
        for k in p.split("."):
            node = node[k]
        flat_stored[p] = node
    return {p: _materialize(leaves[p], flat_stored[p], specs[p], dtype, place(p, specs[p])) for p in specs}


def _flat_specs(tree) -> dict[str, P.ParamSpec]:
    return traverse_util.flatten_dict(P._as_dict(tree), sep=".")


def _load_target(path: str, config: ModelConfig, leaves: dict, dtype, sharding) -> dict:
    item = os.path.join(path, "target")
    full = P.param_specs(config)
    top_specs = _flat_specs({k: v for k, v in full.items() if k != "segments"})
    flat = _restore(item, leaves, top_specs, dtype, sharding)
    for s, seg in enumerate(segments(config)):
        for j in range(seg.pattern):
            layer_specs = _flat_specs(P.layer_specs(config, seg.start + j))
            per_rep = []
            for r in range(seg.reps):
                key = f"layers.{seg.layer_index(j, r):02d}"
                specs = {f"{key}.{p}": sp for p, sp in layer_specs.items()}
                got = _restore(item, leaves, specs, dtype, sharding)
                per_rep.append({p: got[f"{key}.{p}"] for p in layer_specs})
            for p in layer_specs:
                flat[f"segments.{s}.{j}.{p}"] = _stack([rep[p] for rep in per_rep], sharding)
                for rep in per_rep:
                    del rep[p]
    return P.unflatten(flat, config)


def _stack(parts: list, sharding):
    """Stack per-layer arrays on a new leading axis; with a mesh, straight into the stacked sharding."""
    if not isinstance(sharding, _Placement) or sharding.mesh is None:
        return jnp.stack(parts)
    return jax.jit(_stack_arrays, out_shardings=sharding.stacked(parts[0].sharding))(parts)


def _stack_arrays(xs):
    return jnp.stack(xs)


def _load_mtp(path: str, config: ModelConfig, item: dict, dtype, sharding) -> list:
    out = []
    for i in range(item["num_layers"]):
        specs = {f"{i}.{p}": sp for p, sp in _flat_specs(P.mtp_specs(config)).items()}
        got = _restore(os.path.join(path, "mtp"), item["leaves"], specs, dtype, sharding)
        out.append(traverse_util.unflatten_dict({k[len(f"{i}."):]: v for k, v in got.items()}, sep="."))
    return out


def _load_dspark(path: str, config: ModelConfig, item: dict, dtype, sharding) -> tuple[dict, DSparkMeta]:
    m = item["config"]
    meta = DSparkMeta(n_stages=m["n_stages"], n_taps=m["n_taps"], markov_rank=m["markov_rank"],
                      conf_bias=m["conf_bias"], block_size=m.get("block_size"), noise_token_id=m.get("noise_token_id"),
                      target_layer_ids=None if m.get("target_layer_ids") is None else tuple(m["target_layer_ids"]))
    specs = P.dspark_specs(config, meta.n_stages, meta.n_taps, meta.markov_rank, meta.conf_bias)
    head = _flat_specs({k: v for k, v in specs.items() if k != "stages"})
    tree = traverse_util.unflatten_dict(_restore(os.path.join(path, "dspark"), item["leaves"], head, dtype, sharding),
                                        sep=".")
    stages = []
    for s in range(meta.n_stages):
        st = {f"stages.{s}.{p}": sp for p, sp in _flat_specs(specs["stages"][s]).items()}
        got = _restore(os.path.join(path, "dspark"), item["leaves"], st, dtype, sharding)
        stages.append(traverse_util.unflatten_dict({k[len(f"stages.{s}."):]: v for k, v in got.items()}, sep="."))
    tree["stages"] = stages
    return tree, meta


def load_checkpoint(path: str | os.PathLike, *, dtype=None, mesh=None, rules=None, sharding=None):
    """(config, params) of a checkpoint written by `dsv4-convert`.

    dtype: compute dtype of the weight leaves (default: the dtype chosen at conversion, bfloat16 for
    kept codes). Norms, HC parameters, sinks, biases and `ape` stay float32, `tid2eid` int32. Kept
    FP8 / FP4 codes are dequantized exactly.
    mesh: a `jax.sharding.Mesh` (e.g. `dsv4_jax.sharding.make_mesh()`); every array is restored
    straight into the NamedSharding derived from its logical axes by `dsv4_jax.sharding` (`rules`:
    logical axis -> mesh axes, default `sharding.DEFAULT_RULES`), the same shardings as
    `sharding.param_shardings(config, mesh)`. Default: the first local device.
    sharding: a preset name ("latency", "throughput": `dsv4_jax.sharding.PRESETS`) or `ShardingPreset`:
    its rules and, unless `mesh` is given, its mesh over all devices; the returned config carries the
    preset's backends (the expert-parallel MoE on that mesh).

    Returns (ModelConfig, params) for a target-only checkpoint. When the checkpoint holds drafters
    the config is a `CheckpointConfig(target, mtp_layers, dspark)` and params gain `params["mtp"]`
    (list of MTP block trees) and/or `params["dspark"]` ({main_proj, ..., stages: [...]}).
    """
    path = os.path.abspath(os.fspath(path))
    meta = read_metadata(path)
    if meta.get("format_version") != 1:
        raise ValueError(f"{path}: unsupported checkpoint format_version {meta.get('format_version')}")
    config = ModelConfig.from_dict(meta["config"])
    dtype = jnp.dtype(dtype if dtype is not None else meta["conversion"].get("dtype", "bfloat16"))
    if sharding is not None:
        preset = sharding_preset(sharding)
        if rules is not None:
            raise ValueError("give rules or a sharding preset, not both (the preset brings its rules)")
        mesh, rules = mesh if mesh is not None else preset.make_mesh(), preset.rules_dict
        config = preset.apply(config, mesh)
    sharding = _Placement(mesh, rules)
    items = meta["items"]
    params = _load_target(path, config, items["target"]["leaves"], dtype, sharding)
    mtp_layers, dspark = 0, None
    if "mtp" in items:
        params["mtp"] = _load_mtp(path, config, items["mtp"], dtype, sharding)
        mtp_layers = len(params["mtp"])
    if "dspark" in items:
        params["dspark"], dspark = _load_dspark(path, config, items["dspark"], dtype, sharding)
    if mtp_layers or dspark is not None:
        return CheckpointConfig(config, mtp_layers, dspark), params
    return config, params
