"""Atomic, streaming Orbax output.

Checkpoint directory layout (format_version 2):

    OUT/dsv4.json     model config, source and per-leaf format metadata (see `dsv4_jax.io.checkpoint`)
    OUT/target/       Orbax (v1 partial save): {embed, head, norm, hc_head, layers: {"00": {...}, ...}}
    OUT/mtp/          optional: {"0": {...block..., e_proj, h_proj, enorm, hnorm, norm, hc_head}}
    OUT/dspark/       optional: {main_proj, main_norm, norm, hc_head, markov_w1, markov_w2, conf_proj, stages: {"0": ...}}

Quantized leaves are the model's own leaf type, `dsv4_jax.ops.quant.QArray` (numpy children): Orbax stores
the node as {"codes", "scale"} in exactly the device dtypes (float8_e4m3fn / uint8 / int8 codes, uint8 e8m0 /
float16 / float32 scales; never float8_e8m0fnu or float4, docs/checkpoint_formats.md §4) and dsv4.json names its format. Everything is written to a temporary directory `<OUT>.incomplete-<pid>` next to the
target, which is renamed only when complete; on any error (or Ctrl-C) the temporary directory is removed
(`dsv4_jax.io.outdir.AtomicDir`, the rule shared with dsv4-sweep: OUT may be missing or empty).
"""
from __future__ import annotations

import json
import os

import numpy as np
import orbax.checkpoint.experimental.v1 as ocp1

from ...ops.quant import QArray
from ..integrity import checksum_np

META_FILE = "dsv4.json"
FORMAT_VERSION = 2      # 2: FP8 codes stored as float8_e4m3fn, no raw GGML leaves (1: uint8 FP8 codes, ggml_*)


def nest(flat: dict[str, object]) -> dict:
    """{"a.b": x} -> {"a": {"b": x}} (QArray leaves stay QArrays: Orbax saves their children)."""
    out: dict = {}
    for path, v in flat.items():
        d = out
        *parents, last = path.split(".")
        for p in parents:
            d = d.setdefault(p, {})
        d[last] = v
    return out


def _array_record(a) -> dict:
    return {"shape": list(a.shape), "dtype": np.dtype(a.dtype).name, "checksum": checksum_np(a)}


def describe(v) -> dict:
    """Metadata record of one stored leaf, with the checksum of each stored array (`dsv4_jax.io.integrity`),
    verified by load_checkpoint and `dsv4-convert verify`."""
    if isinstance(v, QArray):
        return {"format": v.fmt.name, "shape": list(v.shape),
                "arrays": {"codes": _array_record(v.codes), "scale": _array_record(v.scale)}}
    if not isinstance(v, np.ndarray):
        raise TypeError(f"cannot store a {type(v).__name__} leaf (expected a numpy array or a QArray)")
    return {"format": "dense", "shape": list(v.shape), "dtype": np.dtype(v.dtype).name, "checksum": checksum_np(v)}


class ItemWriter:
    """Streams units of one Orbax item (partial saves, additions only) into `path`."""

    def __init__(self, path: str):
        self.path = path
        self.leaves: dict[str, dict] = {}
        self._ctx = ocp1.Context()
        self._ctx.array.saving.use_compression = False   # ~no gain on codes, §4

    def save(self, key: tuple[str, ...], flat: dict[str, object]) -> None:
        tree = nest(flat)
        for k in reversed(key):
            tree = {k: tree}
        with self._ctx:
            ocp1.partial.save(self.path, tree)   # synchronous: overlapping with save_async gained nothing (bench)
        prefix = ".".join(key)
        for p, v in flat.items():
            self.leaves[f"{prefix}.{p}" if prefix else p] = describe(v)

    def finalize(self) -> None:
        with self._ctx:
            ocp1.partial.finalize(self.path)


def write_json_atomic(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


