"""Restore a `dsv4-convert` checkpoint into the model's parameter tree, quantized leaves kept or dequantized.

On disk (see `dsv4_jax.io.convert.writer`): `dsv4.json` + Orbax items `target/`, optional `mtp/`,
`dspark/`, all with per-layer leaves. A quantized leaf is stored as its `ops.quant.QArray` (Orbax keeps
the node's children as {codes, scale}) with its format named in dsv4.json. `load_checkpoint` restores one
scan segment at a time (Orbax partial load, each array straight into its sharding) and stacks the layers of
a segment on the scan axis, so peak memory is about the model plus one segment. Every restore target comes
from the leaf's `params.ParamSpec` (with `quant` set from dsv4.json): `params.abstract_leaf` with the
shardings of `sharding.spec_sharding` (mesh given) — each device reads only its own slice, scales follow
their codes. `keep_quantized=True` keeps QArrays on the device; otherwise they are dequantized on device.

format_version 2 (this version) stores FP8 codes as float8_e4m3fn and has no raw GGML leaves (K- / IQ-quants
are repacked to Q8_0 at conversion). Version 1 checkpoints load too: their uint8 FP8 codes are reinterpreted
on the device, their raw GGML leaves dequantized on the host (keep_quantized=True refuses those).
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

from ..model import params as P
from ..bundle import CheckpointConfig, DSparkMeta
from ..config import ModelConfig
from ..ops import quant
from ..model.schedule import segments
from ..parallel import preset as sharding_preset, spec_sharding

META_FILE = "dsv4.json"
FORMAT_VERSIONS = (1, 2)


class CheckpointFormatError(ValueError):
    """A checkpoint this version cannot read as asked (unknown format_version, leaf format or layout)."""


def read_metadata(path: str | os.PathLike) -> dict:
    p = os.path.join(os.fspath(path), META_FILE)
    if not os.path.exists(p):
        raise FileNotFoundError(f"{path}: not a dsv4 checkpoint (no {META_FILE}); convert one with dsv4-convert")
    with open(p) as f:
        return json.load(f)


class _Placement:
    """Sharding of each restored leaf: one device, or rule-derived per leaf (a QArray of two for a quantized one)."""

    def __init__(self, mesh=None, rules=None):
        self.mesh, self.rules = mesh, rules
        self.single = SingleDeviceSharding(jax.local_devices()[0]) if mesh is None else None

    def __call__(self, path: str, spec: P.ParamSpec):
        if self.mesh is None:
            return self.single if spec.quant is None else quant.QArray(self.single, self.single, spec.quant)
        return spec_sharding(spec, self.mesh, self.rules, path)

    def stacked(self, sharding):
        """Sharding of per-layer arrays stacked on a new leading (replicated) scan axis."""
        if self.mesh is None:
            return None
        spec = tuple(sharding.spec)
        return NamedSharding(self.mesh, PartitionSpec(None, *spec) if spec else PartitionSpec())


def _stored_format(rec: dict, path: str) -> quant.QFormat | None:
    fmt = rec["format"]
    if fmt == "dense":
        return None
    if fmt.startswith("ggml_"):
        return None                      # v1 raw GGML blocks: handled by _restore_ggml
    try:
        return quant.qformat(fmt)
    except ValueError as e:
        raise CheckpointFormatError(f"leaf {path}: {e}") from None


def _target(rec: dict, spec: P.ParamSpec, dtype, place: _Placement, path: str, version: int):
    """Orbax restore target of one stored leaf: ShapeDtypeStruct or QArray of them (stored dtypes for v1)."""
    fmt = _stored_format(rec, path)
    if rec["format"].startswith("ggml_"):
        return {"codes": jax.ShapeDtypeStruct(tuple(rec["arrays"]["codes"]["shape"]),
                                              np.dtype(rec["arrays"]["codes"]["dtype"]), sharding=place.single
                                              or NamedSharding(place.mesh, PartitionSpec()))}
    spec = dataclasses.replace(spec, quant=fmt)
    if tuple(rec["shape"]) != tuple(spec.shape):
        raise CheckpointFormatError(f"leaf {path}: stored shape {tuple(rec['shape'])}, the config needs "
                                    f"{tuple(spec.shape)}")
    leaf = P.abstract_leaf(spec, dtype, place(path, spec))
    if fmt is None:
        return leaf
    stored = {k: (tuple(a["shape"]), np.dtype(a["dtype"])) for k, a in rec["arrays"].items()}
    want = {"codes": (leaf.codes.shape, leaf.codes.dtype), "scale": (leaf.scale.shape, leaf.scale.dtype)}
    if version == 1 and fmt == quant.FP8 and stored.get("codes", (None,))[1] == np.uint8:
        want["codes"] = (leaf.codes.shape, np.dtype(np.uint8))       # e4m3 bits as uint8: bitcast after load
        leaf = quant.QArray(jax.ShapeDtypeStruct(leaf.codes.shape, np.uint8, sharding=leaf.codes.sharding),
                            leaf.scale, fmt, leaf.dtype)
    if stored != want:
        raise CheckpointFormatError(f"leaf {path}: stored arrays {stored} do not match format {fmt.name} "
                                    f"of shape {tuple(spec.shape)} (expected {want})")
    return leaf


def _restore_ggml(rec: dict, stored, spec: P.ParamSpec, dtype, sharding, path: str, keep: bool):
    """A version-1 raw GGML leaf (K- / IQ-quant blocks): dequantized on the host by gguf-py."""
    import gguf   # only version-1 checkpoints hold raw GGML blocks
    if keep:
        raise CheckpointFormatError(
            f"leaf {path} is stored as raw GGML {rec['format'][5:]} blocks (checkpoint format_version 1), which "
            "cannot stay quantized on the device; re-convert the GGUF with this dsv4-convert (it repacks K- / "
            "IQ-quants to Q8_0) or load with keep_quantized=False")
    arr = gguf.quants.dequantize(np.asarray(stored["codes"]), gguf.GGMLQuantizationType[rec["format"][5:]])
    return jax.device_put(np.asarray(arr, np.float32).reshape(rec["shape"]).astype(spec.dtype(dtype)), sharding)


def _to_model(rec: dict, stored, spec: P.ParamSpec, dtype, place: _Placement, path: str, keep: bool):
    """A restored leaf as the model holds it: dense arrays as restored (cast by Orbax); QArrays kept, or
    dequantized on their device(s) into the dense twin's sharding."""
    if rec["format"].startswith("ggml_"):
        dense_sh = place(path, dataclasses.replace(spec, quant=None))
        return _restore_ggml(rec, stored, spec, dtype, dense_sh, path, keep)
    if not isinstance(stored, quant.QArray):
        return stored
    if stored.codes.dtype != quant.CODES[stored.fmt.codes]:            # version 1 FP8: uint8 bits
        stored = quant.QArray(_bitcast(stored.codes, quant.CODES[stored.fmt.codes]), stored.scale, stored.fmt,
                              stored.dtype)
    if keep:
        return stored
    dense_sh = place(path, dataclasses.replace(spec, quant=None))
    return jax.jit(quant.dequantize, out_shardings=dense_sh)(stored)


def _bitcast(x, dtype):
    return jax.jit(lambda a: jax.lax.bitcast_convert_type(a, dtype), out_shardings=x.sharding)(x)


def _restore(item_path: str, leaves: dict[str, dict], specs: dict[str, P.ParamSpec], dtype, place: _Placement,
             version: int, keep: bool) -> dict:
    """Restore the given flat leaves of one item; returns {path: model leaf}."""
    missing = sorted(p for p in specs if p not in leaves)
    if missing:
        raise CheckpointFormatError(f"{item_path}: leaves {missing[:6]} are not in the checkpoint")
    abstract = {p: _target(leaves[p], specs[p], dtype, place, p, version) for p in specs}
    ctx = ocp1.Context()
    ctx.pytree.loading.partial_load = True
    with ctx:
        got = ocp1.load(item_path, traverse_util.unflatten_dict(abstract, sep="."))
    out = {}
    for p in specs:
        node = got
        for k in p.split("."):
            node = node[k]
        out[p] = _to_model(leaves[p], node, specs[p], dtype, place, p, keep)
    return out


def _flat_specs(tree) -> dict[str, P.ParamSpec]:
    return traverse_util.flatten_dict(P._as_dict(tree), sep=".")


def _load_target(path: str, config: ModelConfig, leaves: dict, dtype, sharding, version: int, keep: bool) -> dict:
    item = os.path.join(path, "target")
    full = P.param_specs(config)
    top_specs = _flat_specs({k: v for k, v in full.items() if k != "segments"})
    flat = _restore(item, leaves, top_specs, dtype, sharding, version, keep)
    for s, seg in enumerate(segments(config)):
        for j in range(seg.pattern):
            layer_specs = _flat_specs(P.layer_specs(config, seg.start + j))
            per_rep = []
            for r in range(seg.reps):
                key = f"layers.{seg.layer_index(j, r):02d}"
                specs = {f"{key}.{p}": sp for p, sp in layer_specs.items()}
                got = _restore(item, leaves, specs, dtype, sharding, version, keep)
                per_rep.append({p: got[f"{key}.{p}"] for p in layer_specs})
            for p in layer_specs:
                flat[f"segments.{s}.{j}.{p}"] = _stack([rep[p] for rep in per_rep], sharding)
                for rep in per_rep:
                    del rep[p]
    return P.unflatten(flat, config)


def _stack(parts: list, sharding: _Placement):
    """Stack per-layer leaves (arrays or QArrays) on a new leading axis; with a mesh, straight into the
    stacked sharding."""
    if sharding.mesh is None:
        return _stack_leaves(parts)
    out = jax.tree.map(lambda a: sharding.stacked(a.sharding), parts[0])
    return jax.jit(_stack_leaves, out_shardings=out)(parts)


def _stack_leaves(xs):
    return jax.tree.map(lambda *a: jnp.stack(a), *xs)


def _load_mtp(path: str, config: ModelConfig, item: dict, dtype, sharding, version: int, keep: bool) -> list:
    out = []
    for i in range(item["num_layers"]):
        specs = {f"{i}.{p}": sp for p, sp in _flat_specs(P.mtp_specs(config)).items()}
        got = _restore(os.path.join(path, "mtp"), item["leaves"], specs, dtype, sharding, version, keep)
        out.append(traverse_util.unflatten_dict({k[len(f"{i}."):]: v for k, v in got.items()}, sep="."))
    return out


def _load_dspark(path: str, config: ModelConfig, item: dict, dtype, sharding, version: int,
                 keep: bool) -> tuple[dict, DSparkMeta]:
    m = item["config"]
    meta = DSparkMeta(n_stages=m["n_stages"], n_taps=m["n_taps"], markov_rank=m["markov_rank"],
                      conf_bias=m["conf_bias"], block_size=m.get("block_size"), noise_token_id=m.get("noise_token_id"),
                      target_layer_ids=None if m.get("target_layer_ids") is None else tuple(m["target_layer_ids"]))
    specs = P.dspark_specs(config, meta.n_stages, meta.n_taps, meta.markov_rank, meta.conf_bias)
    head = _flat_specs({k: v for k, v in specs.items() if k != "stages"})
    tree = traverse_util.unflatten_dict(_restore(os.path.join(path, "dspark"), item["leaves"], head, dtype, sharding,
                                                 version, keep), sep=".")
    stages = []
    for s in range(meta.n_stages):
        st = {f"stages.{s}.{p}": sp for p, sp in _flat_specs(specs["stages"][s]).items()}
        got = _restore(os.path.join(path, "dspark"), item["leaves"], st, dtype, sharding, version, keep)
        stages.append(traverse_util.unflatten_dict({k[len(f"stages.{s}."):]: v for k, v in got.items()}, sep="."))
    tree["stages"] = stages
    return tree, meta


def load_checkpoint(path: str | os.PathLike, *, dtype=None, mesh=None, rules=None, keep_quantized: bool = False,
                    sharding=None):
    """(config, params) of a checkpoint written by `dsv4-convert`.

    dtype: compute dtype of the weight leaves (default: the dtype chosen at conversion; bfloat16 for kept
    codes). Norms, HC parameters, sinks, biases and `ape` stay float32, `tid2eid` int32.
    keep_quantized: every leaf stored quantized (FP8, FP4, Q8_0, int8) stays an `ops.quant.QArray` on the
    device (codes + scales, dequantizing to `dtype` where it is used), sharded like its dense twin. Default:
    dequantized on the device to `dtype` (exactly: FP8 / FP4 also in bf16, Q8_0 / int8 in f32).
    mesh: a `jax.sharding.Mesh` (e.g. `dsv4_jax.parallel.make_mesh()`); every array is restored
    straight into the NamedSharding derived from its logical axes by `dsv4_jax.parallel` (`rules`:
    logical axis -> mesh axes, default `sharding.DEFAULT_RULES`), the same shardings as
    `sharding.param_shardings(config, mesh, formats=params.formats_of(params))`. Default: the first local device.
    sharding: a preset name ("latency", "throughput": `dsv4_jax.parallel.PRESETS`) or `ShardingPreset`:
    its rules and, unless `mesh` is given, its mesh over all devices; the returned config carries the
    preset's backends (the expert-parallel MoE on that mesh).

    Returns (ModelConfig, params) for a target-only checkpoint. When the checkpoint holds drafters
    the config is a `CheckpointConfig(target, mtp_layers, dspark)` and params gain `params["mtp"]`
    (list of MTP block trees) and/or `params["dspark"]` ({main_proj, ..., stages: [...]}).
    """
    path = os.path.abspath(os.fspath(path))
    meta = read_metadata(path)
    version = meta.get("format_version")
    if version not in FORMAT_VERSIONS:
        raise CheckpointFormatError(f"{path}: checkpoint format_version {version!r}; this dsv4_jax reads "
                                    f"{FORMAT_VERSIONS} (re-convert the source with this dsv4-convert)")
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
    keep = bool(keep_quantized)
    params = _load_target(path, config, items["target"]["leaves"], dtype, sharding, version, keep)
    mtp_layers, dspark = 0, None
    if "mtp" in items:
        params["mtp"] = _load_mtp(path, config, items["mtp"], dtype, sharding, version, keep)
        mtp_layers = len(params["mtp"])
    if "dspark" in items:
        params["dspark"], dspark = _load_dspark(path, config, items["dspark"], dtype, sharding, version, keep)
    if mtp_layers or dspark is not None:
        return CheckpointConfig(config, mtp_layers, dspark), params
    return config, params
