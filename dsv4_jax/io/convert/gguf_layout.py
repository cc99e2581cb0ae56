"""A bounds-checked walk over the layout of a GGUF file, to say why it cannot be read.

GGUF (v2/v3, docs/checkpoint_formats.md §1): header (magic, version u32, tensor count u64, metadata count u64),
metadata entries (key string, value type u32, value), the tensor-info table (name string, n_dims u32,
dims u64 × n_dims, ggml type u32, data offset u64), padding to `general.alignment` (default 32),
then the tensor data. gguf-py's reader fails on a cut-short file with raw numpy errors; `diagnose`
walks the same structure with a bounds check on every read and names the first part that is
missing: the header field, the metadata key, or the tensor, with the bytes expected and present.
Nothing but the header region is read (the data is only compared with the file size).
"""
from __future__ import annotations

import math
import mmap
import os
import struct

import gguf

from .truncation import cut_message

_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4                              # GGML_MAX_DIMS
_MAX_KV, _MAX_TENSORS = 1 << 20, 1 << 24   # far above any real file: larger counts mean a corrupt header


class _Cut(Exception):
    def __init__(self, section: str, what: str, offset: int, need: int):
        super().__init__(section, what, offset, need)
        self.section, self.what, self.offset, self.need = section, what, offset, need


class _Corrupt(Exception):
    pass


class _Cursor:
    """Sequential little/big-endian reads of a buffer, each checked against the file size."""

    def __init__(self, buf, size: int):
        self.buf, self.size, self.pos, self.order = buf, size, 0, "<"
        self.section = "header"

    def take(self, n: int, what: str) -> int:
        """Advance over n bytes; returns their offset (raises _Cut past the end)."""
        if self.pos + n > self.size:
            raise _Cut(self.section, what, self.pos, n)
        at, self.pos = self.pos, self.pos + n
        return at

    def scalar(self, fmt: str, what: str):
        at = self.take(struct.calcsize(fmt), what)
        return struct.unpack_from(self.order + fmt, self.buf, at)[0]

    def string(self, what: str) -> str:
        n = self.scalar("Q", f"the length of {what}")
        at = self.take(n, what)
        return bytes(self.buf[at:at + n]).decode("utf-8", errors="replace")


def _skip_value(c: _Cursor, vtype: int, what: str) -> int | None:
    """Step over one metadata value; returns it when it is a u32 (for general.alignment)."""
    if vtype in _SCALAR:
        return c.scalar(_SCALAR[vtype], what)
    if vtype == _STRING:
        c.string(what)
        return None
    if vtype == _ARRAY:
        itype = c.scalar("I", f"the item type of {what}")
        count = c.scalar("Q", f"the length of {what}")
        if itype in _SCALAR:
            c.take(count * struct.calcsize(_SCALAR[itype]), f"{what} ({count} items)")
        elif itype in (_STRING, _ARRAY):
            for i in range(count):
                _skip_value(c, itype, f"item {i} of {what}")
        else:
            raise _Corrupt(f"{what} has unknown item type {itype}")
        return None
    raise _Corrupt(f"{what} has unknown value type {vtype}")


def _walk(c: _Cursor) -> list[tuple[str, str, tuple[int, ...], int, int]]:
    """Header, metadata and tensor-info table -> [(name, type name, numpy shape, data start, bytes)]."""
    if bytes(c.buf[:4]) != b"GGUF" and c.size >= 4:
        raise _Corrupt(f"not a GGUF file (starts with {bytes(c.buf[:4])!r}, expected b'GGUF')")
    c.take(4, "the magic")
    version = c.scalar("I", "the version")
    if version & 0xFFFF == 0:              # written with the other byte order
        c.order = ">"
        version = struct.unpack(">I", struct.pack("<I", version))[0]
    n_tensors = c.scalar("Q", "the tensor count")
    n_kv = c.scalar("Q", "the metadata count")
    if n_kv > _MAX_KV or n_tensors > _MAX_TENSORS:
        raise _Corrupt(f"corrupt header: it claims {n_kv} metadata entries and {n_tensors} tensors")
    c.section, alignment, key = "metadata", 32, None
    for i in range(n_kv):
        key = c.string(f"the key of metadata entry {i}" + (f" (after {key!r})" if key else ""))
        vtype = c.scalar("I", f"the value type of key {key!r}")
        v = _skip_value(c, vtype, f"the value of key {key!r}")
        if key == "general.alignment" and v:
            alignment = int(v)
    c.section, infos, name = "tensor-info table", [], None
    for i in range(n_tensors):
        name = c.string(f"the name of tensor {i}" + (f" (after {name!r})" if name else ""))
        n_dims = c.scalar("I", f"the dimension count of tensor {name!r}")
        if n_dims > _MAX_DIMS:
            raise _Corrupt(f"tensor {name!r} claims {n_dims} dimensions (at most {_MAX_DIMS})")
        at = c.take(8 * n_dims, f"the shape of tensor {name!r} ({n_dims} dims)")
        ne = struct.unpack_from(f"{c.order}{n_dims}Q", c.buf, at)
        qtype = c.scalar("I", f"the ggml type of tensor {name!r}")
        offset = c.scalar("Q", f"the data offset of tensor {name!r}")
        infos.append((name, qtype, ne, offset))
    start = -(-c.pos // alignment) * alignment
    out = []
    for name, qtype, ne, offset in infos:
        try:
            t = gguf.GGMLQuantizationType(qtype)
        except ValueError:
            raise _Corrupt(f"tensor {name!r} has unknown ggml tensor type {qtype}") from None
        block, size = gguf.GGML_QUANT_SIZES[t]
        out.append((name, t.name, tuple(reversed(ne)), start + offset, math.prod(ne) // block * size))
    return out


def diagnose(path: str) -> str | None:
    """A message naming the first missing or corrupt part of the GGUF file at path; None if its layout
    is complete (every tensor's bytes lie inside the file)."""
    size = os.path.getsize(path)
    if size == 0:
        return f"{path}: empty file (0 bytes), not a GGUF file"
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        c = _Cursor(buf, size)
        try:
            tensors = _walk(c)
        except _Cut as e:
            return cut_message(path, e.section, e.what, e.offset, e.need, size)
        except _Corrupt as e:
            return f"{path}: {e}"
    beyond = [t for t in tensors if t[3] + t[4] > size]
    if not beyond:
        return None
    name, tname, shape, start, nbytes = min(beyond, key=lambda t: t[3])
    msg = cut_message(path, "tensor data", f"tensor {name!r} ({tname} {list(shape)})", start, nbytes, size)
    return msg + (f"; {len(beyond) - 1} more tensor(s) lie beyond the end" if len(beyond) > 1 else "")


def check_offsets(path: str, tensors, data_start: int, alignment: int, size: int) -> str | None:
    """ggml's own rule for the tensor data (gguf.cpp): in tensor-info order, each tensor's offset (from the
    aligned data start) is exactly the running sum of the previous tensors' sizes, each padded to the
    alignment; a size is the type's block bytes × the element count / block size, and the first dimension
    holds whole blocks; every tensor lies inside the file. So no tensor is misaligned, overlaps or aliases
    another, or has a size changed by an edited type id. tensors: gguf-py ReaderTensors.
    Returns a message naming the file and the first offending tensor, or None."""
    if alignment <= 0 or alignment & (alignment - 1):
        return f"{path}: general.alignment = {alignment}, expected a positive power of two"
    expect = 0
    for t in tensors:
        qt = gguf.GGMLQuantizationType(int(t.tensor_type))
        block, tsize = gguf.GGML_QUANT_SIZES[qt]
        ne = [int(x) for x in t.shape.tolist()]
        if any(x < 0 for x in ne) or (ne and ne[0] % block):
            return (f"{path}: tensor {t.name!r} ({qt.name}, ne {ne}): the first dimension is not a whole number "
                    f"of {block}-element blocks")
        nbytes = math.prod(ne) // block * tsize
        rel = int(t.data_offset) - data_start
        if rel != expect:
            why = ("not aligned to %d bytes" % alignment if rel % alignment else
                   "overlapping the previous tensor" if rel < expect else "leaving a gap after the previous tensor")
            return (f"{path}: tensor {t.name!r} ({qt.name}, ne {ne}, {nbytes} bytes) has data offset {rel}, but the "
                    f"tensors before it end at {expect} (offsets must be the running padded sizes): {why}")
        if int(t.n_bytes) != nbytes:
            return f"{path}: tensor {t.name!r} declares {int(t.n_bytes)} bytes, its type and shape need {nbytes}"
        if data_start + rel + nbytes > size:
            return cut_message(path, "tensor data", f"tensor {t.name!r} ({qt.name} {ne})", data_start + rel, nbytes,
                               size)
        expect = rel + -(-nbytes // alignment) * alignment
    return None
