"""Meshes: the three named axes ("data", "expert", "model") and how devices are laid on them."""
from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh



MESH_AXES = ("data", "expert", "model")

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




