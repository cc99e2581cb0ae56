"""A cache of the frozen target's states for a fixed set of training windows (`--cache-targets`).

Layout of a cache directory (written to `<DIR>.incomplete-<pid>` and renamed when complete):

    manifest.json     what the cache holds and for which model / windows (checked before it is used)
    tokens.npy        int32 [rows, L]: the windows
    <state>.npy       [rows, L, ...] per state of the task (`drafter_tasks.state_fields`: MTP `hidden`,
                      DSpark `taps` + `head_in`), in the compute dtype (bf16 stored as uint16 bits)

Row r holds window r of the training run that wrote it: step s, micro-batch m, sequence b is row
(s·grad_accum + m)·batch + b, i.e. exactly the windows of an on-the-fly run with the same seed. A run
reading the cache takes rows in that order and starts again at row 0 after the last one (epochs).
Bytes per token: MTP n·D, DSpark (t + 1)·D values (Flash, bf16: 32 KiB and 32 KiB).
"""
from __future__ import annotations

import json
import os
import shutil
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ..config import ModelConfig
from ..ops.host import to_host
from . import drafter_tasks as T

MANIFEST = "manifest.json"
FORMAT = 1


class CacheError(ValueError):
    """A target cache that does not fit the run (other model, drafter, taps, window length, dtype)."""


def bytes_per_token(task: T.Task, config: ModelConfig, dtype) -> int:
    item = jnp.dtype(dtype).itemsize
    return int(sum(np.prod(s) for s in T.state_fields(task, config).values()) * item)


def describe(task: T.Task, config: ModelConfig, dtype, seq_len: int, model_fingerprint: str) -> dict:
    """The manifest fields a reader checks against its own run."""
    return {"format": FORMAT, "model": model_fingerprint, "drafter": task.kind,
            "taps": None if task.kind == "mtp" else list(task.dcfg.target_layer_ids),
            "dtype": jnp.dtype(dtype).name, "seq_len": seq_len,
            "fields": {k: list(v) for k, v in T.state_fields(task, config).items()},
            "bytes_per_token": bytes_per_token(task, config, dtype)}


def _storage(dtype) -> np.dtype:
    return np.dtype(np.uint16) if jnp.dtype(dtype) == jnp.bfloat16 else np.dtype(jnp.dtype(dtype))


_states_jit = jax.jit(T.target_states, static_argnames=("task", "config"))


def write(path: str, task: T.Task, config: ModelConfig, target: dict, dtype, *, fingerprint: str,
          window_fn, n_steps: int, per_step: int, seq_len: int, place=lambda x: x, progress=None) -> dict:
    """Compute the target states of every window of n_steps steps and write them atomically.

    window_fn(step) -> int32 [per_step, seq_len] (the run's windows, micro-batches flattened).
    place(tokens) -> device array (sharded over the batch on a mesh). Returns the manifest.
    """
    rows = n_steps * per_step
    meta = dict(describe(task, config, dtype, seq_len, fingerprint), rows=rows, per_step=per_step)
    tmp = f"{os.path.abspath(path)}.incomplete-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    t0 = time.perf_counter()
    try:
        tok_out = np.lib.format.open_memmap(os.path.join(tmp, "tokens.npy"), "w+", np.int32, (rows, seq_len))
        outs = {k: np.lib.format.open_memmap(os.path.join(tmp, f"{k}.npy"), "w+", _storage(dtype),
                                             (rows, seq_len) + tuple(shape))
                for k, shape in T.state_fields(task, config).items()}
        for s in range(n_steps):
            toks = window_fn(s)
            states = _states_jit(task, target, config, place(toks))
            sl = slice(s * per_step, (s + 1) * per_step)
            tok_out[sl] = toks
            for k, v in states.items():
                v = to_host(v.astype(dtype))
                outs[k][sl] = v.view(np.uint16) if v.dtype == ml_dtypes.bfloat16 else v
            if progress is not None:
                progress(s + 1)
        for a in (tok_out, *outs.values()):
            a.flush()
        del tok_out, outs
        meta["write_s"] = time.perf_counter() - t0
        meta["bytes"] = sum(os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp))
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(meta, f, indent=1)
        if os.path.exists(path):
            shutil.rmtree(path)
        os.rename(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return meta


def read_manifest(path: str) -> dict | None:
    p = os.path.join(path, MANIFEST)
    if not os.path.exists(p):
        return None
    with open(p) as f:
        return json.load(f)


def check(manifest: dict, want: dict, path: str) -> None:
    """CacheError naming the first field where the cache differs from the run (`describe` fields)."""
    for k, v in want.items():
        if manifest.get(k) != v:
            raise CacheError(f"target cache {path}: {k} is {manifest.get(k)!r}, this run needs {v!r}")


class Reader:
    """Rows of a cache as training batches: batch(step, accum, batch) -> {"tokens", "states"}."""

    def __init__(self, path: str, dtype):
        self.manifest = read_manifest(path)
        if self.manifest is None:
            raise CacheError(f"{path}: not a target cache (no {MANIFEST})")
        self.rows = self.manifest["rows"]
        self.dtype = jnp.dtype(dtype)
        self.tokens = np.load(os.path.join(path, "tokens.npy"), mmap_mode="r")
        self.states = {k: np.load(os.path.join(path, f"{k}.npy"), mmap_mode="r") for k in self.manifest["fields"]}

    def _rows(self, idx: np.ndarray, arr) -> np.ndarray:
        out = np.asarray(arr[idx])
        return out.view(ml_dtypes.bfloat16) if self.dtype == jnp.bfloat16 else out

    def batch(self, step: int, accum: int, batch: int) -> dict:
        per = accum * batch
        idx = (step * per + np.arange(per)) % self.rows
        shape = (accum, batch)
        return {"tokens": np.asarray(self.tokens[idx]).reshape(shape + self.tokens.shape[1:]),
                "states": {k: self._rows(idx, a).reshape(shape + a.shape[1:]) for k, a in self.states.items()}}
