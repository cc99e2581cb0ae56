"""Restore a `dsv4-convert` checkpoint into the model's parameter tree, quantized leaves kept or dequantized.

On disk (see `dsv4_jax.io.convert.writer`): `dsv4.json` + Orbax items `target/`, optional `mtp/`,
`dspark/`, all with per-layer leaves. A quantized leaf is stored as its `ops.quant.QArray` (Orbax keeps
the node's children as {codes, scale}) with its format named in dsv4.json. `load_checkpoint` restores one
scan segment at a time (Orbax partial load, each array straight into its sharding) and stacks the layers of
a segment on the scan axis, so peak memory is about the model plus one segment. Every restore target comes
from the leaf's `params.ParamSpec` (with `quant` set from dsv4.json): `params.abstract_leaf` with the
shardings of `parallel.spec_sharding` (mesh given) — each device reads only its own slice, scales follow
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
from ..config import ConfigError, ModelConfig
from ..ops import quant
from ..model.schedule import segments
from ..parallel import preset as sharding_preset, spec_sharding
from ..parallel.expert_words import for_run as expert_words_for_run
from .integrity import ChecksumError, checksums

META_FILE = "dsv4.json"
FORMAT_VERSIONS = (1, 2)


class CheckpointFormatError(ValueError):
    """A checkpoint this version cannot read as asked (unknown format_version, leaf format or layout)."""


def read_metadata(path: str | os.PathLike) -> dict:
    """dsv4.json of a checkpoint, its structure checked (CheckpointFormatError naming the file and field)."""
    p = os.path.join(os.fspath(path), META_FILE)
    if not os.path.exists(p):
        raise FileNotFoundError(f"{path}: not a dsv4 checkpoint (no {META_FILE}); convert one with dsv4-convert")
    if not os.path.isfile(p):
        raise CheckpointFormatError(f"{p}: not a regular file")
    try:
        with open(p, "rb") as f:
            meta = json.loads(f.read().decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise CheckpointFormatError(f"{p}: corrupt JSON ({type(e).__name__}: {e})") from None
    if isinstance(meta, dict) and meta.get("format_version") not in FORMAT_VERSIONS:
        raise CheckpointFormatError(f"{path}: checkpoint format_version {meta.get('format_version')!r}; this "
                                    f"dsv4_jax reads {FORMAT_VERSIONS} (re-convert the source with this dsv4-convert)")
    _check_meta(meta, p)
    return meta


def _check_meta(meta, p: str) -> None:
    """The fields load_checkpoint reads, with their types."""
    def need(cond, what):
        if not cond:
            raise CheckpointFormatError(f"{p}: malformed: {what}")
    need(isinstance(meta, dict), f"the top level is a {type(meta).__name__}, expected an object")
    need(isinstance(meta.get("config"), dict), "'config' missing or not an object")
    items = meta.get("items")
    need(isinstance(items, dict) and isinstance(items.get("target"), dict), "'items.target' missing or not an object")
    need(isinstance(meta.get("conversion", {}), dict), "'conversion' is not an object")
    for name, item in items.items():
        need(name in ("target", "mtp", "dspark"), f"unknown item {name!r} (expected target, mtp, dspark)")
        need(isinstance(item, dict) and isinstance(item.get("leaves"), dict), f"'items.{name}.leaves' missing")
        for leaf, rec in item["leaves"].items():
            need(isinstance(rec, dict) and isinstance(rec.get("format"), str) and isinstance(rec.get("shape"), list)
                 and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in rec["shape"]),
                 f"leaf record {name}.{leaf} lacks a valid 'format' / 'shape'")
            arrays = {"": rec} if rec["format"] == "dense" else rec.get("arrays")
            need(isinstance(arrays, dict) and arrays, f"leaf record {name}.{leaf} lacks its 'arrays'")
            for k, a in arrays.items():
                need(isinstance(a, dict) and isinstance(a.get("dtype"), str) and isinstance(a.get("shape"), list)
                     and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in a["shape"])
                     and isinstance(a.get("checksum", ""), str),
                     f"leaf record {name}.{leaf} {k or 'array'}: bad 'dtype' / 'shape' / 'checksum'")
                try:
                    np.dtype(a["dtype"])
                except TypeError:
                    need(False, f"leaf record {name}.{leaf}: unknown dtype {a['dtype']!r}")
    if "mtp" in items:
        n = items["mtp"].get("num_layers")
        need(isinstance(n, int) and not isinstance(n, bool) and n >= 0, "'items.mtp.num_layers' is not an int")
    if "dspark" in items:
        c = items["dspark"].get("config")
        need(isinstance(c, dict) and all(isinstance(c.get(k), int) for k in ("n_stages", "n_taps", "markov_rank"))
             and isinstance(c.get("conf_bias"), bool), "'items.dspark.config' lacks n_stages / n_taps / "
             "markov_rank / conf_bias")


def _arrays_of(rec: dict, path: str) -> dict[str, tuple[tuple[int, ...], np.dtype, str | None]]:
    """{stored array path: (shape, dtype, checksum or None)} of one leaf record."""
    if rec["format"] == "dense":
        return {path: (tuple(rec["shape"]), np.dtype(rec["dtype"]), rec.get("checksum"))}
    return {f"{path}.{k}": (tuple(a["shape"]), np.dtype(a["dtype"]), a.get("checksum"))
            for k, a in rec["arrays"].items()}


def _orbax_arrays(item_path: str) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """{array path: (shape, dtype)} as Orbax recorded them (its own metadata of the item)."""
    try:
        tree = ocp1.metadata(item_path).metadata
    except Exception as e:  # noqa: BLE001 - Orbax / TensorStore raise many kinds on corrupt metadata
        raise CheckpointFormatError(f"{item_path}: cannot read the Orbax metadata ({type(e).__name__}: "
                                    f"{str(e)[:300]})") from None
    if not isinstance(tree, dict):
        raise CheckpointFormatError(f"{item_path}: the Orbax metadata is not a tree of arrays")
    out = {}
    for k, v in traverse_util.flatten_dict(tree, sep=".").items():
        shape, dtype = getattr(v, "shape", None), getattr(v, "dtype", None)
        if shape is None or dtype is None:
            raise CheckpointFormatError(f"{item_path}: stored entry {k} is not an array")
        out[k] = (tuple(shape), np.dtype(dtype))
    return out


def cross_check(item_path: str, leaves: dict, expected: set[str]) -> None:
    """dsv4.json's leaf records against the leaves the config needs (`expected`) and against what Orbax
    stored (names, shapes, dtypes): any disagreement is a CheckpointFormatError naming item and leaf."""
    extra = sorted(set(leaves) - expected)
    missing = sorted(expected - set(leaves))
    meta = os.path.join(os.path.dirname(item_path), META_FILE)
    if missing:
        raise CheckpointFormatError(f"{meta}: {os.path.basename(item_path)} leaves {missing[:6]} are not in the "
                                    "checkpoint")
    if extra:
        raise CheckpointFormatError(f"{meta}: lists {os.path.basename(item_path)} leaves the config does not use: "
                                    f"{extra[:6]} (config and stored leaves disagree)")
    want = {}
    for p, rec in leaves.items():
        want.update({k: v[:2] for k, v in _arrays_of(rec, p).items()})
    have = _orbax_arrays(item_path)
    for k in sorted(set(want) | set(have)):
        if want.get(k) != have.get(k):
            w, h = want.get(k), have.get(k)
            raise CheckpointFormatError(
                f"{item_path}: leaf {k}: {META_FILE} says {_fmt(w)}, the stored array is {_fmt(h)}")


def _fmt(v) -> str:
    return "absent" if v is None else f"{v[1].name}{list(v[0])}"


class _Placement:
    """Sharding of each restored leaf: one device, or rule-derived per leaf (a QArray of two for a quantized one)."""

    def __init__(self, mesh=None, rules=None, verify: bool = True):
        self.mesh, self.rules, self.verify = mesh, rules, verify
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
    if fmt is None:          # restored as stored (checksummed), cast to the compute dtype on the device
        return jax.ShapeDtypeStruct(leaf.shape, np.dtype(rec["dtype"]), sharding=leaf.sharding)
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
        want = jnp.dtype(spec.dtype(dtype))
        return stored if stored.dtype == want else stored.astype(want)
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
    """Restore the given flat leaves of one item, checksums verified; returns {path: model leaf}."""
    missing = sorted(p for p in specs if p not in leaves)
    if missing:
        raise CheckpointFormatError(f"{item_path}: leaves {missing[:6]} are not in the checkpoint")
    abstract = {p: _target(leaves[p], specs[p], dtype, place, p, version) for p in specs}
    ctx = ocp1.Context()
    ctx.pytree.loading.partial_load = True
    try:
        with ctx:
            got = ocp1.load(item_path, traverse_util.unflatten_dict(abstract, sep="."))
    except Exception as e:  # noqa: BLE001 - Orbax / TensorStore raise many kinds on corrupt data
        names = sorted(specs)
        raise CheckpointFormatError(f"{item_path}: cannot restore leaves {names[0]} .. {names[-1]} "
                                    f"({len(names)} leaves): {type(e).__name__}: {str(e)[:400]}") from None
    nodes = {}
    for p in specs:
        node = got
        for k in p.split("."):
            node = node[k]
        nodes[p] = node
    if place.verify:
        _verify(item_path, leaves, nodes)
    return {p: _to_model(leaves[p], nodes[p], specs[p], dtype, place, p, keep) for p in specs}


def _verify(item_path: str, leaves: dict, nodes: dict) -> None:
    """Compare every restored array with the checksum dsv4.json recorded for it (arrays without one, as
    in checkpoints written before checksums existed, are skipped); ChecksumError naming item and leaf."""
    arrays, want = {}, {}
    for p, node in nodes.items():
        for k, (_, _, ck) in _arrays_of(leaves[p], p).items():
            if ck is None:
                continue
            sub = k[len(p) + 1:]
            arrays[k] = node if not sub else getattr(node, sub, None) if not isinstance(node, dict) else node[sub]
            want[k] = ck
    if not arrays:
        return
    got = checksums(arrays)
    bad = sorted(k for k in arrays if got[k] != want[k])
    if bad:
        raise ChecksumError(f"{item_path}: stored array(s) {bad[:6]} do not match the checksums in {META_FILE} "
                            f"(corrupt data: e.g. {bad[0]} sums to {got[bad[0]]}, recorded {want[bad[0]]})")


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
                    sharding=None, verify: bool = True, expert_words: bool | None = None):
    """(config, params) of a checkpoint written by `dsv4-convert`.

    dtype: compute dtype of the weight leaves (default: the dtype chosen at conversion; bfloat16 for kept
    codes). Norms, HC parameters, sinks, biases and `ape` stay float32, `tid2eid` int32.
    keep_quantized: every leaf stored quantized (FP8, FP4, Q8_0, int8) stays an `ops.quant.QArray` on the
    device (codes + scales, dequantizing to `dtype` where it is used), sharded like its dense twin. Default:
    dequantized on the device to `dtype` (exactly: FP8 / FP4 also in bf16, Q8_0 / int8 in f32).
    mesh: a `jax.sharding.Mesh` (e.g. `dsv4_jax.parallel.make_mesh()`); every array is restored
    straight into the NamedSharding derived from its logical axes by `dsv4_jax.parallel` (`rules`:
    logical axis -> mesh axes, default `parallel.DEFAULT_RULES`), the same shardings as
    `parallel.param_shardings(config, mesh, formats=params.formats_of(params))`. Default: the first local device.
    sharding: a preset name ("latency", "throughput": `dsv4_jax.parallel.PRESETS`) or `ShardingPreset`:
    its rules and, unless `mesh` is given, its mesh over all devices; the returned config carries the
    preset's backends (the expert-parallel MoE on that mesh).
    expert_words (keep_quantized only): routed FP4 experts in the uint32 word layout per shard and, on TPU,
    routed codes and scales stored contraction-dim major (`parallel.expert_words.for_run`, the rule `dsv4-aot`
    compiles; the same values). None (default): when the run's expert-parallel local matmul reads words
    (`parallel.wants_words`: the XLA one a TPU preset resolves to); True / False: always / never.

    verify (default): dsv4.json is cross-checked against the stored leaves (names, shapes, dtypes, the
    layer count of the config) and every restored array against the checksum recorded when it was written
    (`dsv4_jax.io.integrity`; on the device, one fused pass per unit; cost in docs/converting.md). A
    mismatch raises CheckpointFormatError / ChecksumError naming the file and the leaf.

    Returns (ModelConfig, params) for a target-only checkpoint. When the checkpoint holds drafters
    the config is a `CheckpointConfig(target, mtp_layers, dspark)` and params gain `params["mtp"]`
    (list of MTP block trees) and/or `params["dspark"]` ({main_proj, ..., stages: [...]}).
    """
    path = os.path.abspath(os.fspath(path))
    meta, config, version = _open(path)
    conv = meta.get("conversion") or {}
    try:
        dtype = jnp.dtype(dtype if dtype is not None else conv.get("dtype", "bfloat16"))
    except TypeError:
        raise CheckpointFormatError(f"{path}/{META_FILE}: conversion.dtype {conv.get('dtype')!r} is not a dtype") \
            from None
    if sharding is not None:
        preset = sharding_preset(sharding)
        if rules is not None:
            raise ValueError("give rules or a sharding preset, not both (the preset brings its rules)")
        mesh, rules = mesh if mesh is not None else preset.make_mesh(), preset.rules_dict
        config = preset.apply(config, mesh)
    sharding = _Placement(mesh, rules, verify)
    items = meta["items"]
    keep = bool(keep_quantized)
    params = _load_target(path, config, items["target"]["leaves"], dtype, sharding, version, keep)
    mtp_layers, dspark = 0, None
    if "mtp" in items:
        params["mtp"] = _load_mtp(path, config, items["mtp"], dtype, sharding, version, keep)
        mtp_layers = len(params["mtp"])
    if "dspark" in items:
        params["dspark"], dspark = _load_dspark(path, config, items["dspark"], dtype, sharding, version, keep)
    if keep:
        params = expert_words_for_run(params, config.backends, words=expert_words)
    if mtp_layers or dspark is not None:
        return CheckpointConfig(config, mtp_layers, dspark), params
    return config, params


def _expected_leaves(config: ModelConfig, name: str, item: dict) -> set[str]:
    """Flat leaf paths the config (and the item's own drafter metadata) needs in item `name`."""
    return set(_leaf_specs(config, name, item))


def _open(path: str) -> tuple[dict, ModelConfig, int]:
    """(dsv4.json, config, format_version) of a checkpoint, cross-checked against its stored leaves."""
    meta = read_metadata(path)
    version = meta.get("format_version")
    if version not in FORMAT_VERSIONS:
        raise CheckpointFormatError(f"{path}: checkpoint format_version {version!r}; this dsv4_jax reads "
                                    f"{FORMAT_VERSIONS} (re-convert the source with this dsv4-convert)")
    try:
        config = ModelConfig.from_dict(meta["config"])
    except (ConfigError, TypeError, ValueError, KeyError) as e:
        raise CheckpointFormatError(f"{os.path.join(path, META_FILE)}: invalid 'config': {type(e).__name__}: "
                                    f"{e}") from None
    for name, item in meta["items"].items():
        item_path = os.path.join(path, name)
        if not os.path.isdir(item_path):
            raise CheckpointFormatError(f"{item_path}: missing (dsv4.json lists item {name!r})")
        try:
            expected = _expected_leaves(config, name, item)
        except (ConfigError, TypeError, ValueError) as e:
            raise CheckpointFormatError(f"{os.path.join(path, META_FILE)}: invalid items.{name}: {e}") from None
        cross_check(item_path, item["leaves"], expected)
    return meta, config, version


def verify_checkpoint(path: str | os.PathLike) -> dict:
    """Check a checkpoint without keeping it: dsv4.json against the stored leaves, then every array against
    its checksum, one unit (layer, block, stage) at a time on the first local device. Returns
    {item: number of arrays verified}; raises CheckpointFormatError / ChecksumError naming file and leaf."""
    path = os.path.abspath(os.fspath(path))
    meta, config, version = _open(path)
    place = _Placement(None, None, True)
    counts = {}
    for name, item in meta["items"].items():
        leaves = item["leaves"]
        n_arrays = sum(1 for p, r in leaves.items() for k, v in _arrays_of(r, p).items() if v[2] is not None)
        if not n_arrays:
            raise CheckpointFormatError(f"{path}/{META_FILE}: item {name!r} records no checksums (written before "
                                        "checksums existed); re-save or re-convert it to verify")
        groups: dict[str, list[str]] = {}
        for p in leaves:
            parts = p.split(".")
            unit = ".".join(parts[:2]) if parts[0] in ("layers", "stages") else parts[0] if name == "mtp" else ""
            groups.setdefault(unit, []).append(p)
        specs = _leaf_specs(config, name, item)
        for unit, paths in groups.items():
            _restore(os.path.join(path, name), leaves, {p: specs[p] for p in paths}, jnp.float32, place, version,
                     True)
        counts[name] = n_arrays
    return counts


def _leaf_specs(config: ModelConfig, name: str, item: dict) -> dict[str, P.ParamSpec]:
    """{flat leaf path: ParamSpec} of one item (unstacked, as stored)."""
    if name == "target":
        out = _flat_specs({k: v for k, v in P.param_specs(config).items() if k != "segments"})
        for i in range(config.num_layers):
            out.update({f"layers.{i:02d}.{p}": sp for p, sp in _flat_specs(P.layer_specs(config, i)).items()})
        return out
    if name == "mtp":
        return {f"{i}.{p}": sp for i in range(item["num_layers"]) for p, sp in _flat_specs(P.mtp_specs(config)).items()}
    m = item["config"]
    specs = P.dspark_specs(config, m["n_stages"], m["n_taps"], m["markov_rank"], m["conf_bias"])
    out = _flat_specs({k: v for k, v in specs.items() if k != "stages"})
    for s, st in enumerate(specs["stages"]):
        out.update({f"stages.{s}.{p}": sp for p, sp in _flat_specs(st).items()})
    return out
