"""Save / load a small parameter bundle (target + drafters) as one compressed .npz plus JSON metadata.

Used for the bundled tiny demo model: a single small file that installs with the package (Orbax
checkpoints are for the large converted models; see dsv4_jax.io.checkpoint).
"""
from __future__ import annotations

import json
import os
import tempfile

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ..config import ModelConfig
from ..model.params import flatten

WEIGHTS = "weights.npz"
META = "bundle.json"


def save_bundle(path: str, config: ModelConfig, params: dict, info: dict, dtype=jnp.bfloat16) -> None:
    """Write params (compute-dtype leaves cast to `dtype`; float32 and int leaves kept) atomically."""
    flat = flatten(params, sep="/")
    arrays, dtypes = {}, {}
    for name, a in flat.items():
        a = np.asarray(a)
        if a.dtype == np.float32 and dtype == jnp.bfloat16 and a.ndim >= 2:
            a = a.astype(ml_dtypes.bfloat16)
        dtypes[name] = str(a.dtype)
        arrays[name] = a.view(np.uint16) if a.dtype == ml_dtypes.bfloat16 else a
    os.makedirs(path, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path, suffix=".npz.tmp")
    with os.fdopen(fd, "wb") as f:
        np.savez_compressed(f, **arrays)
    os.chmod(tmp, 0o644)                      # mkstemp creates 0600; the bundle ships with the package
    os.replace(tmp, os.path.join(path, WEIGHTS))
    with open(os.path.join(path, META), "w") as f:
        json.dump({"config": config.to_dict(), "dtypes": dtypes, "info": info}, f, indent=1)


def _nest(flat: dict):
    """'a/0/b' keys -> nested dicts, with all-digit levels turned into lists."""
    root: dict = {}
    for key, v in flat.items():
        node = root
        parts = key.split("/")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = v

    def fix(n):
        if isinstance(n, dict):
            if n and all(k.isdigit() for k in n):
                return [fix(n[str(i)]) for i in range(len(n))]
            return {k: fix(v) for k, v in n.items()}
        return n

    return fix(root)


def load_bundle(path: str, dtype=None):
    """(config, params, info); weight leaves cast to `dtype` when given (default: as stored)."""
    with open(os.path.join(path, META)) as f:
        meta = json.load(f)
    config = ModelConfig.from_dict(meta["config"])
    with np.load(os.path.join(path, WEIGHTS)) as z:
        flat = {}
        for name, kind in meta["dtypes"].items():
            a = z[name]
            if kind == "bfloat16":
                a = a.view(ml_dtypes.bfloat16)
            if dtype is not None and jnp.issubdtype(a.dtype, jnp.floating) and a.ndim >= 2:
                a = a.astype(jnp.dtype(dtype))   # on the host: a device cast compiles one program per shape
            flat[name] = jnp.asarray(a)
    return config, _nest(flat), meta.get("info", {})
