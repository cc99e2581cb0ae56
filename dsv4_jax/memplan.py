"""Memory plan from abstract shapes: weights (+ drafter) + decode state per device, for a mesh.

Nothing is allocated: sizes come from `params.param_specs` / `mtp_specs` / `dspark_specs` and
`cache.state_shapes`; the per-device share of each array comes from the same logical-axis rules as
the real placement (`dsv4_jax.sharding.partition_spec`, divisibility fallback to replication), so
the plan is what `load_checkpoint(..., mesh=...)` would hold on each device.

Weight storage (`--dtype`):
    f32        every weight float32
    bf16       every weight bfloat16 (HC, norms, sinks, `ape`, router bias stay float32; tid2eid int32)
    quantized  the official release (weight_formats.md §6): routed experts FP4 e2m1 codes (½ byte) +
               e8m0 scale per 32; attention projections, indexer `wq_b`, shared expert (and the MTP /
               DSpark projections) FP8 e4m3 codes + e8m0 scale per 128×128 block; embedding, head,
               router, compressor and indexer `weights_proj` bf16; the float32 leaves as above.

Command: `dsv4-memplan --help` (also `python -m dsv4_jax.memplan`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from typing import Iterable

import jax
import jax.numpy as jnp

from . import params as P
from .cache import layer_cache_shapes, state_shapes
from .config import MOE, PRESETS, SLIDING, ModelConfig, preset
from .sharding import (DEFAULT_REPLICATED, MESH_AXES, PRESETS, default_mesh_shape, partition_spec, preset as
                       sharding_preset, state_partition_specs)

GIB = 1024 ** 3
FORMATS = ("f32", "bf16", "quantized")
H200_GIB = 139.0   # usable HBM of one H200 (weight_formats.md §6)

# leaves stored as FP8 (+ e8m0 per 128×128) in the release; routed experts are FP4
_FP8_LEAF = re.compile(r"(^|\.)(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]"
                       r"|e_proj|h_proj|main_proj)$")
_EXPERT_LEAF = re.compile(r"(^|\.)ffn\.experts\.w[123]$")
_EMBED_LEAF = re.compile(r"^(embed|head)$")

PARTS = ("routed experts", "attention + shared expert", "embedding + head", "other weights", "f32 + int32 leaves")


@dataclasses.dataclass(frozen=True)
class Array:
    """One stored array of a leaf: shape, logical axes, bytes per element (may be ½ for packed FP4)."""

    shape: tuple[int, ...]
    axes: tuple
    itemsize: float
    path: str

    @property
    def nbytes(self) -> float:
        return math.prod(self.shape) * self.itemsize


def part_of(path: str, spec: P.ParamSpec) -> str:
    """Which row of the plan a parameter leaf belongs to."""
    if spec.kind != "weight":
        return "f32 + int32 leaves"
    if _EXPERT_LEAF.search(path):
        return "routed experts"
    if _FP8_LEAF.search(path):
        return "attention + shared expert"
    if _EMBED_LEAF.search(path):
        return "embedding + head"
    return "other weights"


def stored_arrays(path: str, spec: P.ParamSpec, fmt: str) -> list[Array]:
    """The arrays a leaf is stored as in format `fmt` (codes + scales for quantized leaves)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; choose from {FORMATS}")
    shape, axes = tuple(spec.shape), tuple(spec.axes)
    if spec.kind != "weight":
        return [Array(shape, axes, 4, path)]
    if fmt == "f32":
        return [Array(shape, axes, 4, path)]
    if fmt == "bf16" or not (_EXPERT_LEAF.search(path) or _FP8_LEAF.search(path)):
        return [Array(shape, axes, 2, path)]
    *lead, n, k = shape
    if _EXPERT_LEAF.search(path):      # FP4 codes (2 per byte) + e8m0 per 32 along the input
        return [Array(shape, axes, 0.5, path), Array((*lead, n, math.ceil(k / 32)), axes, 1, path)]
    return [Array(shape, axes, 1, path),  # FP8 codes + e8m0 per 128×128 block
            Array((*lead, math.ceil(n / 128), math.ceil(k / 128)), axes, 1, path)]


def shard_fraction(a: Array, sizes: dict, rules=None, replicated=DEFAULT_REPLICATED) -> int:
    """How many devices one copy of the array is split over (1 = replicated)."""
    if any(re.search(p, a.path) for p in replicated):
        return 1
    spec = partition_spec(a.shape, a.axes, sizes, rules)
    n = 1
    for entry in spec:
        for ax in (entry if isinstance(entry, tuple) else (entry,)):
            if ax is not None:
                n *= sizes[ax]
    return n


def _flat_specs(tree) -> dict[str, P.ParamSpec]:
    return P.flatten(jax.tree.map(lambda s: s, tree, is_leaf=lambda x: isinstance(x, P.ParamSpec)))


def _weights(specs, fmt: str, sizes: dict, rules, prefix: str = "") -> dict[str, list[float]]:
    """{part: [total bytes, per-device bytes]} of a ParamSpec tree."""
    out = {p: [0.0, 0.0] for p in PARTS}
    for path, spec in _flat_specs(specs).items():
        part = part_of(path, spec)
        for a in stored_arrays(path, spec, fmt):
            out[part][0] += a.nbytes
            out[part][1] += a.nbytes / shard_fraction(a, sizes, rules)
    return out


def _drafter_specs(config: ModelConfig, drafter: str, dspark_stages: int, markov_rank: int) -> list:
    if drafter == "mtp":
        return [P.mtp_specs(config)] * max(1, config.num_nextn_predict_layers)
    if drafter == "dspark":
        return [P.dspark_specs(config, dspark_stages, 3, markov_rank, False)]
    return []


def _state_bytes(config: ModelConfig, sizes: dict, batch: int, context: int, max_block: int, dtype,
                 rules, drafter_layers: int) -> tuple[float, float]:
    """(total, per-device) bytes of the target decode state plus the drafters' sliding-window rings."""
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
        for s in layer_cache_shapes(one, 0, batch, context, max_block, dtype).values():
            b = math.prod(s.shape) * jnp.dtype(s.dtype).itemsize * drafter_layers
            sp = partition_spec(s.shape, ("batch",) + (None,) * (len(s.shape) - 1), sizes, rules)
            split = math.prod(sizes[ax] for e in sp for ax in (e if isinstance(e, tuple) else (e,)) if ax is not None)
            total += b
            per += b / split
    return total, per


def plan(config: ModelConfig, *, devices: int = 1, mesh_shape: tuple[int, ...] | None = None, weights: str = "bf16",
         batch: int = 1, context: int = 4096, max_block: int = 8, drafter: str = "mtp", dspark_stages: int = 3,
         markov_rank: int = 256, rules=None, sharding: str | None = None) -> dict:
    """Bytes of weights, drafter and decode state: totals and per device on a (data, expert, model) mesh.

    mesh_shape: default `sharding.default_mesh_shape(devices)` (all devices on `expert`); `sharding`: a
    preset name (`sharding.PRESETS`) whose mesh shape and rules replace mesh_shape and rules. The decode
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
    st = _state_bytes(config, sizes, batch, context, max_block, dtype, rules, n_draft_layers)
    parts["decode state"] = {"total": st[0], "per_device": st[1]}
    weights_total = sum(v["total"] for k, v in parts.items() if k != "decode state")
    return {"model": config.name, "weights": weights, "devices": devices, "mesh": sizes, "sharding": sharding,
            "batch": batch,
            "context": context, "max_block": max_block, "drafter": drafter, "parts": parts,
            "weights_total": weights_total, "total": sum(v["total"] for v in parts.values()),
            "per_device": sum(v["per_device"] for v in parts.values())}


def _mesh_arg(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"mesh must look like 1x8x1 (data x expert x model), got {text!r}") from None
    if len(shape) != len(MESH_AXES) or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"mesh must have {len(MESH_AXES)} positive sizes (data x expert x model)")
    return shape


def _int_list(text: str) -> list[int]:
    try:
        out = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return out


def _formats(text: str) -> list[str]:
    out = [v for v in text.split(",") if v]
    bad = [v for v in out if v not in FORMATS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"unknown weight format(s) {bad}; choose from {','.join(FORMATS)}")
    return out


def _presets(text: str) -> list[str]:
    out = [v for v in text.split(",") if v]
    bad = [v for v in out if v not in PRESETS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"unknown sharding preset(s) {bad}; choose from {','.join(PRESETS)}")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dsv4-memplan",
        description="Memory plan (GiB) of a DeepSeek-V4 model from abstract shapes: weights, drafter and decode "
                    "state, in total and per device on a (data, expert, model) mesh. Nothing is allocated.",
        epilog="Example: dsv4-memplan --devices 1,8,16 --dtype bf16,quantized --batch 8 --context 32768")
    p.add_argument("--preset", default="flash", choices=sorted(PRESETS), help="model config (default flash)")
    p.add_argument("--devices", type=_int_list, default=[1, 8, 16],
                   help="comma-separated device counts, one column each (default 1,8,16)")
    p.add_argument("--mesh", type=_mesh_arg, action="append", default=None,
                   help="explicit mesh DATAxEXPERTxMODEL, e.g. 1x1x8 (repeatable; replaces --devices); default "
                        "for n devices: 1xnx1 (experts split n ways, attention data-parallel)")
    p.add_argument("--sharding", type=_presets, default=None, metavar="PRESETS",
                   help=f"sharding presets, comma-separated from {','.join(PRESETS)} (dsv4_jax.sharding.PRESETS): "
                        "one column per preset and --devices count, with the preset's mesh and rules "
                        "(replaces --mesh)")
    p.add_argument("--dtype", type=_formats, default=["bf16", "quantized"],
                   help="weight storage, comma-separated from f32,bf16,quantized (default bf16,quantized); "
                        "quantized = release FP4 experts + FP8 projections with e8m0 scales")
    p.add_argument("--batch", type=int, default=1, help="sequences in the decode state (default 1)")
    p.add_argument("--context", type=int, default=4096, help="decode-state capacity in tokens (default 4096)")
    p.add_argument("--max-block", type=int, default=8, help="widest verify block, k + 1 (default 8)")
    p.add_argument("--drafter", default="mtp", choices=("none", "mtp", "dspark"),
                   help="drafter weights and state to add (default mtp: one block)")
    p.add_argument("--hbm-gib", type=float, default=H200_GIB,
                   help=f"per-device memory for the fits line (default {H200_GIB}, one H200)")
    p.add_argument("--json", action="store_true", help="print the plans as JSON (bytes) instead of tables")
    return p


def table(plans: list[dict], hbm_gib: float) -> str:
    """Text table of plans of one weight format: rows = parts, columns = total and per device per mesh."""
    head = ["part", "total"] + [f"{p['devices']} dev {p['sharding'] + ' ' if p.get('sharding') else ''}"
                                f"({'x'.join(str(v) for v in p['mesh'].values())})" for p in plans]
    rows = [head]
    for part in plans[0]["parts"]:
        rows.append([part, f"{plans[0]['parts'][part]['total'] / GIB:.2f}"]
                    + [f"{p['parts'][part]['per_device'] / GIB:.2f}" for p in plans])
    rows.append(["total", f"{plans[0]['total'] / GIB:.2f}"] + [f"{p['per_device'] / GIB:.2f}" for p in plans])
    rows.append([f"fits {hbm_gib:g} GiB", ""] + ["yes" if p["per_device"] / GIB <= hbm_gib else "NO" for p in plans])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    lines = [fmt(rows[0]), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows[1:]]
    return "\n".join(lines)


def main(argv: Iterable[str] | None = None) -> int:
    a = build_parser().parse_args(None if argv is None else list(argv))
    if a.batch < 1 or a.context < 1 or a.max_block < 1:
        print("dsv4-memplan: --batch, --context and --max-block must be positive", file=sys.stderr)
        return 2
    config = preset(a.preset)
    if a.sharding:
        columns = [(n, None, name) for name in a.sharding for n in a.devices]
    else:
        columns = [(math.prod(m), m, None) for m in (a.mesh or [default_mesh_shape(n) for n in a.devices])]
    out = []
    for fmt in a.dtype:
        plans = [plan(config, devices=n, mesh_shape=m, weights=fmt, batch=a.batch, context=a.context,
                      max_block=a.max_block, drafter=a.drafter, sharding=name) for n, m, name in columns]
        out.append((fmt, plans))
    if a.json:
        print(json.dumps({fmt: plans for fmt, plans in out}, indent=1))
        return 0
    print(f"{config.name}: {P.count_params(config) / 1e9:.2f} B parameters (target); decode state for batch "
          f"{a.batch} x {a.context} tokens (max block {a.max_block}); GiB; mesh = data x expert x model")
    for fmt, plans in out:
        print(f"\nweights: {fmt}")
        print(table(plans, a.hbm_gib))
    return 0


if __name__ == "__main__":
    sys.exit(main())
