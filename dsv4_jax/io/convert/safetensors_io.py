"""A raw, memory-mapped safetensors reader for every dtype of the DeepSeek-V4 releases.

The `safetensors` package cannot hand BF16 / F8_E4M3 / F8_E8M0 to numpy (docs/checkpoint_formats.md §3);
this reader parses the header itself and views the mapped bytes with ml_dtypes types.
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
from typing import Iterator

import ml_dtypes
import numpy as np

from .truncation import TruncatedFileError, cut_message, file_kind

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}


def read_range(path: str, offset: int, nbytes: int, what: str = "the data") -> np.ndarray:
    """nbytes of a file from offset as a fresh uint8 array, read with large sequential reads.

    The converter reads tensors this way rather than by faulting in pages of a memory map: on a
    cold page cache a plain read is 2-3x faster (one request per chunk instead of per page).
    what: the tensor being read, for the error when the file ends early (e.g. "tensor 'embed.weight'").
    """
    out = np.empty(nbytes, np.uint8)
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        view, done = memoryview(out), 0
        while done < nbytes:
            n = f.readinto(view[done:done + (64 << 20)])
            if not n:
                raise TruncatedFileError(cut_message(path, "tensor data", what, offset, nbytes, offset + done))
            done += n
    return out


class SafetensorsError(ValueError):
    """A safetensors file that is truncated, corrupt or uses an unknown dtype."""


def _entry_at(header_text: str, pos: int) -> str | None:
    """Name of the last top-level tensor entry that starts before character pos of a (cut) JSON header."""
    names = [m.group(1) for m in _ENTRY.finditer(header_text, 0, pos) if m.group(1) != "__metadata__"]
    return names[-1] if names else None


_ENTRY = re.compile(r'"((?:[^"\\]|\\.)*)"\s*:\s*\{')


def _read_header(path: str, size: int) -> tuple[dict, int]:
    """(parsed JSON header, byte offset of the data) of a safetensors file, every cut reported."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise SafetensorsError(cut_message(path, "header", "the header length (u64)", 0, 8, size))
        (n,) = struct.unpack("<Q", raw)
        text = f.read(min(n, size - 8))
    if n > size - 8:
        where = _entry_at(text.decode("utf-8", errors="replace"), len(text))
        raise SafetensorsError(cut_message(path, "JSON header", "the header", 8, n, size)
                               + (f"; the cut falls in or after the entry of tensor {where!r}" if where else ""))
    try:
        return json.loads(text), 8 + n
    except (ValueError, RecursionError) as e:        # JSONDecodeError, UnicodeDecodeError, nesting
        raise SafetensorsError(f"{path}: corrupt JSON header ({n} bytes at offset 8): {e}") from None


def _check_entry(path: str, name, e) -> tuple[str, list[int], int, int]:
    """(dtype, shape, lo, hi) of one header entry, its types checked as the reference loader does."""
    if not isinstance(name, str) or not isinstance(e, dict):
        raise SafetensorsError(f"{path}: corrupt header: entry {name!r} is a {type(e).__name__}, expected an object "
                               "with dtype, shape and data_offsets")
    keys = set(e)
    if keys != {"dtype", "shape", "data_offsets"}:
        raise SafetensorsError(f"{path}: corrupt header: tensor {name!r} has fields {sorted(keys)}, expected "
                               "['data_offsets', 'dtype', 'shape']")
    dt, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
    if not isinstance(dt, str) or dt not in DTYPES:
        raise SafetensorsError(f"{path}: tensor {name!r} has unknown dtype {dt!r}; known: {sorted(DTYPES)}")

    def nat(x):
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0
    if not isinstance(shape, list) or not all(nat(x) for x in shape):
        raise SafetensorsError(f"{path}: corrupt header: tensor {name!r} has shape {shape!r}, expected a list of "
                               "non-negative integers")
    if not isinstance(offs, list) or len(offs) != 2 or not all(nat(x) for x in offs) or offs[0] > offs[1]:
        raise SafetensorsError(f"{path}: corrupt header: tensor {name!r} has data_offsets {offs!r}, expected "
                               "[begin, end] with 0 <= begin <= end")
    return dt, shape, offs[0], offs[1]


class SafetensorsFile:
    """Lazy view of one .safetensors file: `names()`, `header(name)`, `get(name) -> np.ndarray` (read on demand).

    The header is checked as the reference loader (safetensors' `Metadata::validate`) does: a JSON object of
    entries {dtype, shape, data_offsets} (+ an optional `__metadata__` of strings), the entries' byte ranges
    contiguous from 0 in offset order, each of dtype size × shape bytes, the last ending exactly at the end of
    the file. A header length off by a few bytes, shared or shifted offsets, or a wrong shape all fail here,
    before any tensor is read."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise SafetensorsError(f"{self.path}: not a regular file ({file_kind(self.path)})")
        size = os.path.getsize(self.path)
        header, self._data_start = _read_header(self.path, size)
        if not isinstance(header, dict):
            raise SafetensorsError(f"{self.path}: corrupt header: the JSON header is a {type(header).__name__}, "
                                   "expected an object")
        meta = header.pop("__metadata__", None)
        if meta is not None and (not isinstance(meta, dict)
                                 or not all(isinstance(v, str) for v in meta.values())):
            raise SafetensorsError(f"{self.path}: corrupt header: __metadata__ must be an object of strings, got "
                                   f"{meta!r:.80}")
        self.metadata = meta or {}
        self._entries = header
        ranges = []
        for name, e in header.items():
            dt, shape, lo, hi = _check_entry(self.path, name, e)
            want = math.prod(shape) * DTYPES[dt].itemsize
            if hi - lo != want:
                raise SafetensorsError(f"{self.path}: corrupt header: tensor {name!r} ({dt} {shape}) "
                                       f"needs {want} bytes but its data_offsets {[lo, hi]} span {hi - lo}")
            ranges.append((lo, hi, name, e))
        ranges.sort(key=lambda r: (r[0], r[1]))
        beyond = [r for r in ranges if self._data_start + r[1] > size]
        if beyond:
            lo, hi, name, e = beyond[0]
            msg = cut_message(self.path, "tensor data", f"tensor {name!r} ({e['dtype']} {e['shape']})",
                              self._data_start + lo, hi - lo, size)
            raise SafetensorsError(msg + (f"; {len(beyond) - 1} more tensor(s) lie beyond the end"
                                          if len(beyond) > 1 else ""))
        end = 0
        for lo, hi, name, _ in ranges:
            if lo != end:
                raise SafetensorsError(f"{self.path}: corrupt header: tensor {name!r} has data_offsets {[lo, hi]}, "
                                       f"but the tensors before it end at {end} (offsets must be contiguous from "
                                       f"0: {'overlapping or shared' if lo < end else 'a gap'})")
            end = hi
        if self._data_start + end != size:
            raise SafetensorsError(f"{self.path}: corrupt header: the tensors end at byte {self._data_start + end} "
                                   f"(header length {self._data_start - 8} + data {end}), but the file has {size} "
                                   "bytes (a wrong header length or trailing bytes)")

    def names(self) -> list[str]:
        return list(self._entries)

    def header(self, name: str) -> dict:
        return self._entries[name]

    def get(self, name: str) -> np.ndarray:
        e = self._entries[name]
        lo, hi = e["data_offsets"]
        raw = read_range(self.path, self._data_start + lo, hi - lo, f"tensor {name!r}")
        return raw.view(DTYPES[e["dtype"]]).reshape(e["shape"])


def open_dir(path: str | os.PathLike) -> dict[str, SafetensorsFile]:
    """Every tensor of a checkpoint directory -> the file holding it (uses the index json when present)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise SafetensorsError(f"{path}: not a directory" + (f" ({file_kind(path)})" if os.path.exists(path)
                                                               else " (no such path)"))
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise SafetensorsError(f"{path}: no .safetensors files")
    where: dict[str, SafetensorsFile] = {}
    for f in files:
        st = SafetensorsFile(os.path.join(path, f))
        for name in st.names():
            if name in where:
                raise SafetensorsError(f"{path}: tensor {name!r} appears in two files")
            where[name] = st
    return where


def iter_tensors(path: str | os.PathLike) -> Iterator[tuple[str, np.ndarray]]:
    for name, st in open_dir(path).items():
        yield name, st.get(name)
