"""A safetensors checkpoint directory (official DeepSeek release or transformers) as a tensor source.

Official FP8 linears are `<x>.weight` F8_E4M3 + `<x>.scale` F8_E8M0 (128×128 blocks); FP4 experts are
`<x>.weight` I8 (two e2m1 per byte) + `<x>.scale` F8_E8M0 (1×32 blocks). The expert format is
detected from the stored dtype (docs/checkpoint_formats.md §3: I8 -> FP4, F8_E4M3 -> FP8). NeMo's
`.weight_scale_inv` suffix is accepted for the scale too.
"""
from __future__ import annotations

import os

import ml_dtypes
import numpy as np

from . import quant_formats as qf
from .safetensors_io import SafetensorsError, open_dir

_SCALE_SUFFIXES = (".scale", ".weight_scale_inv")


class SafetensorsSource:
    """`names()`, `shape(name)` (logical), `dtype(name)`, `companions(name)`, `load(name)` over a directory."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._files = open_dir(self.path)

    def names(self) -> list[str]:
        return list(self._files)

    def dtype(self, name: str) -> str:
        return self._files[name].header(name)["dtype"]

    def _scale_name(self, name: str) -> str | None:
        if not name.endswith(".weight") or self.dtype(name) not in ("F8_E4M3", "I8"):
            return None
        base = name[: -len(".weight")]
        for suf in _SCALE_SUFFIXES:
            if base + suf in self._files:
                return base + suf
        raise SafetensorsError(f"{self.path}: quantized tensor {name!r} ({self.dtype(name)}) has no "
                               f"{base}.scale tensor")

    def companions(self, name: str) -> tuple[str, ...]:
        s = self._scale_name(name)
        return () if s is None else (s,)

    def shape(self, name: str) -> tuple[int, ...]:
        shape = tuple(self._files[name].header(name)["shape"])
        if self._scale_name(name) is not None and self.dtype(name) == "I8":
            return (*shape[:-1], 2 * shape[-1])
        return shape

    def nbytes(self, name: str) -> int:
        lo, hi = self._files[name].header(name)["data_offsets"]
        return hi - lo + sum(self.nbytes(c) for c in self.companions(name))

    def _raw(self, name: str) -> np.ndarray:
        return self._files[name].get(name)

    def load(self, name: str):
        """numpy array, or a QArray (numpy children) for FP8 / FP4 weights."""
        s = self._scale_name(name)
        if s is None:
            return self._raw(name)
        if self.dtype(s) != "F8_E8M0":
            raise SafetensorsError(f"{self.path}: scale {s!r} is {self.dtype(s)}, expected F8_E8M0 (ue8m0)")
        fp8 = self.dtype(name) == "F8_E4M3"
        codes = self._raw(name).view(ml_dtypes.float8_e4m3fn if fp8 else np.uint8)
        scale = self._raw(s).view(np.uint8)
        return qf.check(qf.host(codes, scale, qf.FP8 if fp8 else qf.FP4), f"{self.path}: {name}", self.shape(name))
