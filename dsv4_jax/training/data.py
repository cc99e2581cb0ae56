"""A byte-level corpus that exists offline on every machine: the Python standard library's source files."""
from __future__ import annotations

import hashlib
import os
import sysconfig

import numpy as np


def stdlib_files() -> list[str]:
    """Sorted .py files of this interpreter's standard library (site-packages and tests excluded)."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "test", "tests", "idlelib", "__pycache__",
                                                        "lib2to3", "ensurepip", "turtledemo"))
        out += [os.path.join(d, f) for f in sorted(files) if f.endswith(".py")]
    return sorted(out)


def is_heldout(path: str, every: int = 20) -> bool:
    """A fixed ~5 % of files, chosen by a hash of the path relative to the stdlib root."""
    rel = os.path.relpath(path, sysconfig.get_paths()["stdlib"])
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % every == 0


def corpus(split: str, bos: int, max_bytes: int | None = None) -> np.ndarray:
    """All files of a split ('train' | 'heldout') as one int32 stream, each file preceded by BOS."""
    parts, total = [], 0
    for f in stdlib_files():
        if is_heldout(f) != (split == "heldout"):
            continue
        with open(f, "rb") as fh:
            data = fh.read()
        parts.append(np.concatenate([[bos], np.frombuffer(data, np.uint8)]).astype(np.int32))
        total += len(data) + 1
        if max_bytes and total >= max_bytes:
            break
    return np.concatenate(parts)


def batches(stream: np.ndarray, batch: int, length: int, seed: int):
    """Endless random windows [batch, length] of the stream (seeded)."""
    rng = np.random.default_rng(seed)
    hi = len(stream) - length - 1
    while True:
        starts = rng.integers(0, hi, batch)
        yield np.stack([stream[s:s + length] for s in starts])
