"""Build the parameter tree from named checkpoint tensors, using the one name table (`dsv4_jax.model.names`).

`assemble(config, fmt, source)` walks the abstract tree of `config`, asks `source` for each
leaf's tensor(s) under format `fmt` ('official' | 'hf'), checks every shape, stacks repeated
layers for the scan segments, and reports missing and unexpected tensors by name.
"""
from __future__ import annotations

from typing import Callable, Iterable

import numpy as np
from flax import traverse_util

from ...model import names, params as P
from ...config import ModelConfig
from ...model.schedule import segments


class CheckpointError(ValueError):
    """Missing, unexpected or mis-shaped tensors in a checkpoint."""


def _leaf_tensor(fmt: str, layer: int, leaf: str, get: Callable[[str], np.ndarray], n_experts: int,
                 used: set) -> np.ndarray:
    entry = names.layer_name(fmt, layer, leaf)
    if isinstance(entry, names.FusedPart):
        full = get(entry.tensor)
        used.add(entry.tensor)
        n = full.shape[1] // entry.parts
        return full[:, entry.part * n:(entry.part + 1) * n]
    if "{e}" in entry:
        parts = []
        for e in range(n_experts):
            nm = entry.format(e=e)
            parts.append(get(nm))
            used.add(nm)
        return np.stack(parts)
    used.add(entry)
    return get(entry)


def assemble(config: ModelConfig, fmt: str, available: Iterable[str], get: Callable[[str], np.ndarray],
             convert_leaf: Callable[[str, np.ndarray, object], np.ndarray] | None = None,
             ignore_prefixes: tuple[str, ...] = names.IGNORED_HF):
    """Return the parameter tree (numpy leaves) of `config` from tensors named in format `fmt`.

    available: every tensor name in the checkpoint; get(name) -> array. convert_leaf(path, array, spec)
    may cast or dequantize each leaf (default: cast to the spec's dtype, float32 compute dtype).
    Raises CheckpointError listing missing / unexpected tensors or the first shape mismatch.
    """
    available = set(available)
    missing: list[str] = []
    used: set[str] = set()

    def fetch(name: str) -> np.ndarray:
        if name not in available:
            missing.append(name)
            raise KeyError(name)
        return get(name)

    def finish(path: str, arr, spec: P.ParamSpec):
        if tuple(arr.shape) != tuple(spec.shape):
            raise CheckpointError(f"tensor for {path} has shape {tuple(arr.shape)}, expected {tuple(spec.shape)}")
        if convert_leaf is not None:
            return convert_leaf(path, arr, spec)
        return np.asarray(arr, dtype=spec.dtype(np.float32))

    specs = P.param_specs(config)
    flat_out: dict[str, np.ndarray] = {}
    for leaf, _ in names.TOP_NAMES.items():
        spec = traverse_util.flatten_dict(P._as_dict(specs), sep=".")[leaf]
        nm = names.top_name(fmt, leaf)
        used.add(nm)
        try:
            flat_out[leaf] = finish(leaf, fetch(nm), spec)
        except KeyError:
            pass
    E = config.n_routed_experts
    for s, seg in enumerate(segments(config)):
        for j in range(seg.pattern):
            layer_spec = traverse_util.flatten_dict(P._as_dict(P.layer_specs(config, seg.start + j)), sep=".")
            for leaf, spec in layer_spec.items():
                reps = []
                for r in range(seg.reps):
                    layer = seg.layer_index(j, r)
                    try:
                        arr = _leaf_tensor(fmt, layer, leaf, fetch, E, used)
                    except KeyError:
                        continue
                    if tuple(arr.shape) != tuple(spec.shape):
                        raise CheckpointError(f"layer {layer} {leaf}: shape {tuple(arr.shape)}, expected "
                                              f"{tuple(spec.shape)}")
                    reps.append(arr)
                if len(reps) == seg.reps:
                    path = f"segments.{s}.{j}.{leaf}"
                    stacked = P._stack(spec, seg.reps)
                    flat_out[path] = finish(path, np.stack(reps), stacked)
    if missing:
        raise CheckpointError(f"{len(missing)} tensor(s) missing from the checkpoint, e.g. {sorted(missing)[:8]}")
    unexpected = sorted(n for n in available - used if not n.startswith(ignore_prefixes)
                        and not _unused_hash_bias(n, config, fmt))
    if unexpected:
        raise CheckpointError(f"{len(unexpected)} unexpected tensor(s) in the checkpoint, e.g. {unexpected[:8]}")
    return P.unflatten(flat_out, config)


def _unused_hash_bias(name: str, config: ModelConfig, fmt: str) -> bool:
    """Hash layers may ship an unused router bias (NeMo and llama.cpp drop it): not an error."""
    for i in range(config.num_layers):
        if config.mlp_layer_types[i] == "hash_moe" and name == names.layer_name(fmt, i, "ffn.gate.bias"):
            return True
    return False
