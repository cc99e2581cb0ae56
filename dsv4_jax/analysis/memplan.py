"""Memory plan from abstract shapes: weights (+ drafter) + decode state per device, for a mesh.

Nothing is allocated: every weight's bytes are those of its abstract leaf (`params.abstract_leaf`: a
ShapeDtypeStruct, or a QArray of codes + scale ShapeDtypeStructs for a quantized leaf) built from
`params.param_specs` / `mtp_specs` / `dspark_specs`, the decode state's from `model.state.state_shapes`; the
per-device share of each array comes from the placement rules themselves (`parallel.leaf_partition_spec`,
divisibility fallback to replication), so the plan is what `load_checkpoint(..., mesh=...)` holds.

Weight storage (`--dtype`):
    f32        every weight float32
    bf16       every weight bfloat16 (HC, norms, sinks, `ape`, router bias stay float32; tid2eid int32)
    quantized  the official release (`params.release_format`, docs/checkpoint_formats.md §6): routed experts FP4
               e2m1 codes (½ byte) + e8m0 scale per 32; attention projections, indexer `wq_b`, shared
               expert (and the MTP / DSpark projections) FP8 e4m3 codes + e8m0 scale per 128×128 block;
               embedding, head, router, compressor and indexer `weights_proj` bf16; the float32 leaves as above.

`--checkpoint DIR` loads a converted checkpoint with keep_quantized=True (on `--devices`' first mesh) and
prints, per part, the plan of its stored formats next to the bytes measured on the device(s).

Command: `dsv4-memplan --help` (also `python -m dsv4_jax.analysis.memplan`).
"""
from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp

from ..model import params as P
from ..model.state import layer_cache_shapes, state_shapes
from ..io.checkpoint import load_checkpoint
from ..config import MOE, SLIDING, ModelConfig
from ..ops import quant
from ..parallel import (DEFAULT_REPLICATED, MESH_AXES, default_mesh_shape,
                       leaf_partition_spec, logical_rules, make_mesh, partition_spec, preset as sharding_preset,
                       state_partition_specs)

GIB = 1024 ** 3
FORMATS = ("f32", "bf16", "quantized")
H200_GIB = 139.0   # usable HBM of one H200 (docs/checkpoint_formats.md §6)

_EMBED_LEAF = re.compile(r"^(embed|head)$")

PARTS = ("routed experts", "attention + shared expert", "embedding + head", "other weights", "f32 + int32 leaves")
_DENSE = {"f32": jnp.float32, "bf16": jnp.bfloat16, "quantized": jnp.bfloat16}


def part_of(path: str, spec: P.ParamSpec) -> str:
    """Which row of the plan a parameter leaf belongs to."""
    if spec.kind != "weight":
        return "f32 + int32 leaves"
    if P.RELEASE_FP4.search(path):
        return "routed experts"
    if P.RELEASE_FP8.search(path):
        return "attention + shared expert"
    if _EMBED_LEAF.search(path):
        return "embedding + head"
    return "other weights"


def storage_formats(fmt: str):
    """The `params.with_formats` rule of a `--dtype` choice (None: every weight dense)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; choose from {FORMATS}")
    return P.release_format if fmt == "quantized" else None


def _split(pspec, sizes: dict) -> int:
    n = 1
    for entry in pspec:
        for ax in (entry if isinstance(entry, tuple) else (entry,)):
            if ax is not None:
                n *= sizes[ax]
    return n


def leaf_bytes(path: str, spec: P.ParamSpec, dtype, sizes: dict, rules=None,
               replicated=DEFAULT_REPLICATED) -> tuple[float, float]:
    """(total, per-device) bytes of one leaf as `params.abstract_leaf` describes it (codes + scale when
    quantized), split as `parallel.leaf_partition_spec` places it."""
    leaf = P.abstract_leaf(spec, dtype)
    pspec = leaf_partition_spec(spec, sizes, rules, any(re.search(p, path) for p in replicated))
    arrays = (leaf.codes, leaf.scale) if isinstance(leaf, quant.QArray) else (leaf,)
    pspecs = (pspec.codes, pspec.scale) if isinstance(pspec, quant.QArray) else (pspec,)
    total = per = 0.0
    for a, ps in zip(arrays, pspecs):
        b = math.prod(a.shape) * jnp.dtype(a.dtype).itemsize
        total += b
        per += b / _split(ps, sizes)
    return total, per


def _flat_specs(tree) -> dict[str, P.ParamSpec]:
    return P.flatten(jax.tree.map(lambda s: s, tree, is_leaf=lambda x: isinstance(x, P.ParamSpec)))


def _weights(specs, fmt, sizes: dict, rules, dtype=None) -> dict[str, list[float]]:
    """{part: [total bytes, per-device bytes]} of a ParamSpec tree stored as `fmt` (a --dtype choice, or a
    `params.with_formats` rule / {path: format} with dense weights in `dtype`)."""
    rule = storage_formats(fmt) if isinstance(fmt, str) else fmt
    dtype = dtype or _DENSE.get(fmt if isinstance(fmt, str) else "", jnp.bfloat16)
    if rule is not None:
        specs = P.with_formats(specs, rule)
    out = {p: [0.0, 0.0] for p in PARTS}
    for path, spec in _flat_specs(specs).items():
        t, d = leaf_bytes(path, spec, dtype, sizes, rules)
        out[part_of(path, spec)][0] += t
        out[part_of(path, spec)][1] += d
    return out


def _drafter_specs(config: ModelConfig, drafter: str, dspark_stages: int, markov_rank: int) -> list:
    if drafter == "mtp":
        return [P.mtp_specs(config)] * max(1, config.num_nextn_predict_layers)
    if drafter == "dspark":
        return [P.dspark_specs(config, dspark_stages, 3, markov_rank, False)]
    return []


def _state_bytes(config: ModelConfig, sizes: dict, rules, dims: tuple, drafter_layers: int) -> tuple[float, float]:
    """(total, per-device) bytes of the target decode state plus the drafters' sliding-window rings; dims:
    (batch, context, max_block, dtype) of the state."""
    batch, context, max_block, dtype = dims
    shapes = state_shapes(config, batch, context, max_block, dtype)
    specs = state_partition_specs(shapes, sizes, rules)
    total = per = 0.0
    for s, sp in zip(jax.tree.leaves(shapes.layers), jax.tree.leaves(specs.layers,
                                                                     is_leaf=lambda x: isinstance(x, type(specs.pos)))):
        b = math.prod(s.shape) * jnp.dtype(s.dtype).itemsize
        split = math.prod(sizes[ax] for e in sp for ax in (e if isinstance(e, tuple) else (e,)) if ax is not None)
        total += b
        per += b / split
    if drafter_layers:
        one = config.replace(num_layers=1, layer_types=(SLIDING,), compress_ratios=(0,), mlp_layer_types=(MOE,))
        for s in jax.tree.leaves(layer_cache_shapes(one, 0, batch, context, max_block, dtype)):
            b = math.prod(s.shape) * jnp.dtype(s.dtype).itemsize * drafter_layers
            sp = partition_spec(s.shape, ("state_batch",) + (None,) * (len(s.shape) - 1), sizes, rules)
            split = math.prod(sizes[ax] for e in sp for ax in (e if isinstance(e, tuple) else (e,)) if ax is not None)
            total += b
            per += b / split
    return total, per


def plan(config: ModelConfig, *, devices: int = 1, mesh_shape: tuple[int, ...] | None = None, weights: str = "bf16",
         batch: int = 1, context: int = 4096, max_block: int = 8, drafter: str = "mtp", dspark_stages: int = 3,
         markov_rank: int = 256, rules=None, sharding: str | None = None) -> dict:
    """Bytes of weights, drafter and decode state: totals and per device on a (data, expert, model) mesh.

    mesh_shape: default `parallel.default_mesh_shape(devices)` (all devices on `expert`); `sharding`: a
    preset name (`parallel.PRESETS`) whose mesh shape and rules replace mesh_shape and rules. The decode
    state is in bfloat16 (float32 when weights are f32) for `batch` sequences of `context` tokens.
    Returns a dict of bytes: parts {name: {"total", "per_device"}}, "total", "per_device".
    """
    if sharding is not None:
        pre = sharding_preset(sharding)
        mesh_shape, rules = pre.mesh_shape(devices), pre.rules_dict
    shape = tuple(mesh_shape or default_mesh_shape(devices))
    if math.prod(shape) != devices:
        raise ValueError(f"mesh {shape} has {math.prod(shape)} devices, not {devices}")
    sizes = dict(zip(MESH_AXES, shape))
    parts = {k: {"total": v[0], "per_device": v[1]} for k, v in _weights(P.param_specs(config), weights, sizes,
                                                                           rules).items()}
    drafters = _drafter_specs(config, drafter, dspark_stages, markov_rank)
    tot = per = 0.0
    for specs in drafters:
        for v in _weights(specs, weights, sizes, rules).values():
            tot += v[0]
            per += v[1]
    if drafter != "none":
        parts[f"drafter ({drafter})"] = {"total": tot, "per_device": per}
    n_draft_layers = (len(drafters) if drafter == "mtp" else dspark_stages if drafter == "dspark" else 0)
    dtype = jnp.float32 if weights == "f32" else jnp.bfloat16
    st = _state_bytes(config, sizes, rules, (batch, context, max_block, dtype), n_draft_layers)
    parts["decode state"] = {"total": st[0], "per_device": st[1]}
    weights_total = sum(v["total"] for k, v in parts.items() if k != "decode state")
    return {"model": config.name, "weights": weights, "devices": devices, "mesh": sizes, "sharding": sharding,
            "batch": batch,
            "context": context, "max_block": max_block, "drafter": drafter, "parts": parts,
            "weights_total": weights_total, "total": sum(v["total"] for v in parts.values()),
            "per_device": sum(v["per_device"] for v in parts.values()),
            "notes": batch_split_notes(batch, sizes, rules)}


def batch_split_notes(batch: int, sizes: dict, rules=None) -> list[str]:
    """Why the decode state is split fewer ways than the mesh allows: mesh axes of the `state_batch` rule
    (size > 1) that the batch does not divide, so the state is replicated along them."""
    mesh_axes = [ax for ax in logical_rules(rules).get("state_batch", ()) if sizes.get(ax, 1) > 1]
    spec = partition_spec((batch,), ("state_batch",), sizes, rules)
    used = [ax for e in spec for ax in (e if isinstance(e, tuple) else (e,)) if ax is not None]
    skipped = [ax for ax in mesh_axes if ax not in used]
    if not skipped:
        return []
    split = math.prod(sizes[ax] for ax in used)
    full = math.prod(sizes[ax] for ax in mesh_axes)
    axes = " x ".join(f"{ax!r} ({sizes[ax]})" for ax in skipped)
    return [f"decode state: batch {batch} does not divide over mesh {'axes' if len(skipped) > 1 else 'axis'} "
            f"{axes}, so the state falls back to replication along {'them' if len(skipped) > 1 else 'it'} "
            f"(split {split} way{'s' if split > 1 else ''} instead of {full}); a batch that is a multiple of "
            f"{full} splits it {full} ways"]


# ---- a loaded checkpoint: estimate from its stored formats next to the bytes on the device(s) ---------------

def _measure(tree) -> tuple[float, dict]:
    """(logical bytes, {device: bytes of the shards it holds}) of a tree of device arrays / QArrays."""
    total, per = 0.0, {}
    for a in jax.tree.leaves(tree):
        total += a.nbytes
        for sh in a.addressable_shards:
            per[sh.device] = per.get(sh.device, 0) + sh.data.nbytes
    return total, per


def _checkpoint_parts(config: ModelConfig, ckpt_config, params: dict) -> list[tuple[str, object, dict]]:
    """(part name, ParamSpec tree with the checkpoint's formats, the loaded tree) per part."""
    target = {k: v for k, v in params.items() if k not in ("mtp", "dspark")}
    specs = P.with_formats(P.param_specs(config), P.formats_of(target))
    flat_specs, flat = _flat_specs(specs), P.flatten(target)
    out = []
    for part in PARTS:
        keys = [k for k, s in flat_specs.items() if part_of(k, s) == part]
        out.append((part, {k: flat_specs[k] for k in keys}, {k: flat[k] for k in keys}))
    for i, m in enumerate(params.get("mtp", [])):
        out.append((f"drafter (mtp {i})", P.with_formats(P.mtp_specs(config), P.formats_of(m)), m))
    if "dspark" in params:
        d, meta = params["dspark"], ckpt_config.dspark
        specs = P.dspark_specs(config, meta.n_stages, meta.n_taps, meta.markov_rank, meta.conf_bias)
        out.append(("drafter (dspark)", P.with_formats(specs, P.formats_of(d)), d))
    return out


def measure_checkpoint(path, mesh_shape: tuple[int, ...] | None = None, rules=None) -> dict:
    """Load a converted checkpoint with keep_quantized=True on a mesh (default: one device) and return, per
    part, the plan's bytes for its stored formats ("estimate") next to the bytes of the arrays on the
    devices ("measured": total = logical bytes, per_device = the most any device holds)."""
    n = len(jax.devices())
    shape = tuple(mesh_shape or (1, 1, 1))
    if math.prod(shape) > n:
        raise ValueError(f"mesh {shape} needs {math.prod(shape)} devices, have {n}")
    mesh = make_mesh(shape, jax.devices()[:math.prod(shape)]) if math.prod(shape) > 1 else None
    stats0 = _bytes_in_use()
    ckpt_config, params = load_checkpoint(path, mesh=mesh, rules=rules, keep_quantized=True)
    params = jax.block_until_ready(params)
    config = getattr(ckpt_config, "target", ckpt_config)
    sizes = dict(zip(MESH_AXES, shape))
    dtype = jnp.dtype(params["head"].dtype)            # the compute dtype (a QArray's too)
    parts = {}
    for name, specs, tree in _checkpoint_parts(config, ckpt_config, params):
        est = [0.0, 0.0]
        for path_, spec in _flat_specs(specs).items():
            t, d = leaf_bytes(path_, spec, dtype, sizes, rules)
            est[0] += t
            est[1] += d
        total, per = _measure(tree)
        parts[name] = {"estimate": {"total": est[0], "per_device": est[1]},
                       "measured": {"total": total, "per_device": max(per.values(), default=0)}}
    out = {"checkpoint": str(path), "model": config.name, "mesh": sizes, "dtype": dtype.name, "parts": parts,
           "formats": sorted({f.name for f in P.formats_of(params).values()})}
    for key in ("estimate", "measured"):
        out[key] = {k: sum(p[key][k] for p in parts.values()) for k in ("total", "per_device")}
    _, per = _measure(params)
    out["measured"]["per_device"] = max(per.values(), default=0)
    stats1 = _bytes_in_use()
    if stats0 is not None and stats1 is not None:
        out["measured"]["bytes_in_use_delta"] = stats1 - stats0      # allocator's view (GPU / TPU only)
    return out


def _bytes_in_use():
    stats = jax.local_devices()[0].memory_stats()
    return None if not stats else stats.get("bytes_in_use")


def checkpoint_unit(m: dict) -> tuple[str, int]:
    """GiB for real checkpoints, MiB below 1 GiB."""
    return ("GiB", GIB) if m["measured"]["total"] >= GIB else ("MiB", 1024 ** 2)


def checkpoint_table(m: dict) -> str:
    """Text table of `measure_checkpoint`: per part, the plan next to the measured bytes (`checkpoint_unit`)."""
    unit = checkpoint_unit(m)[1]
    head = ["part", "estimate total", "measured total", "estimate / device", "measured / device"]
    rows = [head]
    for name, p in list(m["parts"].items()) + [("total", {"estimate": m["estimate"], "measured": m["measured"]})]:
        rows.append([name] + [f"{p[k]['total'] / unit:.2f}" for k in ("estimate", "measured")]
                    + [f"{p[k]['per_device'] / unit:.2f}" for k in ("estimate", "measured")])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([fmt(rows[0]), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows[1:]])
