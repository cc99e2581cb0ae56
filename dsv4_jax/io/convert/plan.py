"""Conversion plans: which checkpoint tensors make which leaf, checked before anything is written.

A plan is a list of `Unit`s (the top-level leaves, one decoder layer, one MTP block, ...), each a
list of `Leaf`s naming its source tensor(s) through the one name table (`dsv4_jax.model.names`). A unit
is the granularity of streaming: it is read, converted and saved before the next one is touched.
`validate` checks presence, shapes (from file headers, without reading data) and that no tensor is
left unused, so a bad checkpoint fails before the output directory exists.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np
from flax import traverse_util

from ...model import names, params as P
from ...config import ModelConfig

from ...ops.quant import QArray

from . import quant_formats as qf


class ConvertError(ValueError):
    """Missing, unexpected or mis-shaped tensors, or an inconsistent conversion request."""


@dataclasses.dataclass(frozen=True)
class Leaf:
    path: str                      # dot path inside the unit, e.g. "attn.wq_a"
    spec: P.ParamSpec              # logical (unstacked) shape and kind
    ref: Any                       # tensor name (may hold "{e}") or names.FusedPart
    optional: bool = False


@dataclasses.dataclass(frozen=True)
class Unit:
    item: str                      # "target" | "mtp" | "dspark": the checkpoint item it belongs to
    key: tuple[str, ...]           # position in the item's tree: (), ("layers", "03"), ("0",), ("stages", "1")
    leaves: tuple[Leaf, ...]
    ignore: tuple[str, ...] = ()   # tensor names this unit tolerates and drops

    @property
    def label(self) -> str:
        return ".".join((self.item,) + self.key)


def _flat(specs) -> dict[str, P.ParamSpec]:
    return traverse_util.flatten_dict(P._as_dict(specs), sep=".")


def _block_leaves(scheme: str, prefix: str, specs) -> list[Leaf]:
    return [Leaf(path, spec, names.block_tensor(scheme, prefix, path)) for path, spec in _flat(specs).items()]


def target_units(config: ModelConfig, scheme: str) -> list[Unit]:
    """The top-level unit, then one unit per decoder layer (docs/checkpoint_formats.md §4 tree)."""
    col = {"official": 0, "hf": 1}.get(scheme, 2)
    top_specs = _flat({k: v for k, v in P.param_specs(config).items() if k != "segments"})
    top = Unit("target", (), tuple(Leaf(k, s, names.TOP_NAMES[k][col]) for k, s in top_specs.items()))
    layers = [Unit("target", ("layers", f"{i:02d}"),
                   tuple(_block_leaves(scheme, names.block_prefix(scheme, "layer", i), P.layer_specs(config, i))))
              for i in range(config.num_layers)]
    return [top] + layers


def mtp_units(config: ModelConfig, scheme: str, n_layers: int) -> list[Unit]:
    """One unit per MTP block (docs/drafter_math.md §1.1): block leaves + e/h projections, norms and hc_head."""
    out = []
    for i in range(n_layers):
        prefix = names.block_prefix(scheme, "mtp", i, config.num_layers)
        specs = P.mtp_specs(config)
        leaves = []
        for path, spec in _flat(specs).items():
            ref = (names.mtp_tensor(scheme, prefix, path) if path.split(".")[0] in
                   ("e_proj", "h_proj", "enorm", "hnorm", "norm", "hc_head")
                   else names.block_tensor(scheme, prefix, path))
            leaves.append(Leaf(path, spec, ref))
        ignore = tuple(t.format(p=prefix) for t in names.MTP_IGNORED.get(scheme, ()))
        out.append(Unit("mtp", (str(i),), tuple(leaves), ignore))
    return out


def dspark_units(config: ModelConfig, scheme: str, meta: dict) -> list[Unit]:
    """The DSpark head unit, then one unit per stage (docs/drafter_math.md §2.2)."""
    n = meta["n_stages"]
    specs = P.dspark_specs(config, n, meta["n_taps"], meta["markov_rank"], meta["conf_bias"])
    head = {k: v for k, v in specs.items() if k != "stages"}
    leaves = tuple(Leaf(k, s, names.dspark_tensor(scheme, k, n), k in names.DSPARK_OPTIONAL)
                   for k, s in _flat(head).items())
    stages = [Unit("dspark", ("stages", str(s)),
                   tuple(_block_leaves(scheme, names.block_prefix(scheme, "dspark", s), specs["stages"][s])))
              for s in range(n)]
    return [Unit("dspark", (), leaves)] + stages


# ---- checking against a source -------------------------------------------------------------------

def _expert_names(ref: str, n_experts: int) -> list[str]:
    return [ref.format(e=e) for e in range(n_experts)]


def leaf_tensors(leaf: Leaf, n_experts: int) -> list[str]:
    ref = leaf.ref
    if isinstance(ref, names.FusedPart):
        return [ref.tensor]
    return _expert_names(ref, n_experts) if "{e}" in ref else [ref]


def _source_shape(src, leaf: Leaf, n_experts: int) -> tuple[int, ...]:
    ref = leaf.ref
    if isinstance(ref, names.FusedPart):
        full = list(src.shape(ref.tensor))
        if len(full) < 2 or full[1] % ref.parts:
            return tuple(full)
        full[1] //= ref.parts
        return tuple(full)
    if "{e}" in ref:
        shapes = {src.shape(n) for n in _expert_names(ref, n_experts)}
        if len(shapes) != 1:
            raise ConvertError(f"experts of {ref} have different shapes {sorted(shapes)}")
        return (n_experts, *shapes.pop())
    return src.shape(ref)


def validate(src, units: list[Unit], n_experts: int, ignore_prefixes: tuple[str, ...] = (),
             allow_unused: tuple[str, ...] = (), what: str = "checkpoint", scope: str = "") -> int:
    """Raise ConvertError on missing / mis-shaped / unexpected tensors; return the bytes to read.

    Only names starting with `scope` count as unexpected when unused (a drafter job inside a target file).
    """
    available = set(src.names())
    used: set[str] = set()
    missing: list[str] = []
    total = 0
    for unit in units:
        used.update(n for n in unit.ignore if n in available)
        for leaf in unit.leaves:
            tensors = leaf_tensors(leaf, n_experts)
            absent = [t for t in tensors if t not in available]
            if absent:
                if not leaf.optional:
                    missing.extend(absent)
                continue
            try:
                shape = _source_shape(src, leaf, n_experts)
            except ConvertError as e:
                raise ConvertError(f"{what}: {e}") from None
            if tuple(shape) != tuple(leaf.spec.shape):
                raise ConvertError(f"{what}: {unit.label}.{leaf.path}: tensor {tensors[0]!r} gives shape "
                                   f"{tuple(shape)}, expected {tuple(leaf.spec.shape)}")
            for t in tensors:
                if t not in used:
                    used.add(t)
                    used.update(src.companions(t))
                    total += src.nbytes(t)
    if missing:
        raise ConvertError(f"{what}: {len(missing)} tensor(s) missing, e.g. {sorted(set(missing))[:6]}")
    unexpected = sorted(n for n in available - used
                        if n.startswith(scope) and not n.startswith(ignore_prefixes) and not any(re.fullmatch(p, n) for p in allow_unused))
    if unexpected:
        raise ConvertError(f"{what}: {len(unexpected)} unexpected tensor(s), e.g. {unexpected[:6]}")
    return total


# ---- reading and converting one leaf ---------------------------------------------------------------

def read_leaf(src, leaf: Leaf, n_experts: int):
    """numpy array, QArray (numpy children) or GGMLBlocks of the leaf's logical shape."""
    ref = leaf.ref
    if isinstance(ref, names.FusedPart):
        full = src.load(ref.tensor)
        n = full.shape[1] // ref.parts
        lo, hi = ref.part * n, (ref.part + 1) * n
        if isinstance(full, (QArray, qf.GGMLBlocks)):
            return qf.slice_axis(full, 1, lo, hi)
        return full[:, lo:hi]
    if "{e}" in ref:
        parts = [src.load(n) for n in _expert_names(ref, n_experts)]
        if isinstance(parts[0], (QArray, qf.GGMLBlocks)):
            return qf.stack(parts)
        return np.stack(parts)
    return src.load(ref)


def _source_name(x) -> str:
    return x.fmt.name if isinstance(x, QArray) else x.fmt if isinstance(x, qf.GGMLBlocks) else np.dtype(x.dtype).name


def _note(losses, src: str, dst: str, err: float) -> None:
    if losses is not None and err > 0:
        n, e = losses.get((src, dst), (0, 0.0))
        losses[(src, dst)] = (n + 1, max(e, err))


def _cast(x32: np.ndarray, dtype, losses, src: str) -> np.ndarray:
    """float32 values -> dtype, noting the largest change relative to the tensor's max |value|."""
    y = x32.astype(dtype)
    if losses is not None and x32.size and np.dtype(dtype) != np.float32:
        diff = np.abs(y.astype(np.float32) - x32)
        err = float(np.nanmax(diff)) / max(float(np.nanmax(np.abs(x32))), 1e-30)
        _note(losses, src, np.dtype(dtype).name, err)
    return y


def convert_leaf(x, spec: P.ParamSpec, dtype, keep_quantized: bool, losses: dict | None = None):
    """Final stored value of a leaf: int32 indices, float32 kept leaves, weights kept as stored or in `dtype`.

    keep_quantized: quantized weights keep their codes (QArray: FP8, FP4, Q8_0) and dense weights their
    dtype; K- / IQ-quants (GGMLBlocks) are requantized to Q8_0 (lossy). Otherwise weights are dequantized
    (exactly, in float32) and cast to `dtype`. Every rounding is noted in `losses`
    {(source format, stored format): (tensors, max |change| / max |value|)}.
    Returns a numpy array or a QArray.
    """
    src = _source_name(x)
    if spec.kind != "index" and isinstance(x, np.ndarray) and not np.issubdtype(x.dtype, np.floating) \
            and x.dtype.kind != "V" and not str(x.dtype).startswith(("bfloat16", "float8")):
        raise ConvertError(f"a {spec.kind} tensor stored as {src}, expected a floating-point or quantized type")
    if spec.kind == "index":
        if isinstance(x, (QArray, qf.GGMLBlocks)) or not np.issubdtype(x.dtype, np.integer):
            raise ConvertError(f"index tensor stored as {src}, expected integers")
        return np.asarray(x, np.int32)
    if spec.kind == "weight" and keep_quantized:
        if isinstance(x, QArray):
            return QArray(np.ascontiguousarray(x.codes), np.ascontiguousarray(x.scale), x.fmt, x.dtype)
        if isinstance(x, qf.GGMLBlocks):
            q, err = qf.repack_q8_0(x)
            _note(losses, src, "q8_0", err)
            return q
        return np.array(x)                     # dense weight: stored dtype kept (copied out of the mmap)
    if isinstance(x, (QArray, qf.GGMLBlocks)):
        x = qf.dequantize(x)                   # exact, float32
    if spec.kind == "f32":
        return np.asarray(x, np.float32)
    if np.dtype(x.dtype) == np.dtype(dtype):
        return np.array(x)
    return _cast(np.asarray(x, np.float32), dtype, losses, src)


# ---- non-finite values ----------------------------------------------------------------------------

_SCALE_NAN = {"e8m0": lambda s: s.view(np.uint8) == 0xFF}      # e8m0: 0xFF is NaN, no infinities


def nonfinite_count(x) -> int:
    """Number of non-finite values a stored leaf decodes to (dense array or QArray with numpy children):
    dense floats directly; quantized ones through their parts (e4m3 codes NaN = 0x7F / 0xFF; e8m0 scale 0xFF;
    f16 / f32 scales non-finite), without materializing the dequantized tensor."""
    if isinstance(x, QArray):
        n = 0
        codes, scale = np.asarray(x.codes), np.asarray(x.scale)
        if x.fmt.codes == "e4m3":
            n += int(np.count_nonzero((codes.view(np.uint8) & 0x7F) == 0x7F))
        bad_scale = _SCALE_NAN.get(x.fmt.scale, lambda s: ~np.isfinite(s.astype(np.float32)))(scale)
        return n + int(np.count_nonzero(bad_scale))
    x = np.asarray(x)
    if x.dtype.kind in "iub":
        return 0
    return int(x.size - np.count_nonzero(np.isfinite(x.astype(np.float32) if x.dtype.itemsize < 4 else x)))


def check_finite(x, what: str) -> None:
    """ConvertError naming the tensor when `x` holds NaN / inf (see `nonfinite_count`)."""
    n = nonfinite_count(x)
    if n:
        raise ConvertError(f"{what}: {n} non-finite value(s) (NaN / inf) after decoding; a corrupt or "
                           "mis-typed tensor (pass --allow-nonfinite to convert it anyway)")
