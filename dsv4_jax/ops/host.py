"""`to_host`: a result of the devices as numpy arrays holding the full value, on every process
(docs/sharding.md, "Bringing results to the host"). Every CLI and `generate` fetch results through it, so
they work when an array is split across hosts (multi-process `jax.distributed`, docs/sharding.md)."""
from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils


def to_host(tree):
    """Every array leaf of `tree` as a numpy array holding its full value, on every process; same structure.

    Arrays this process can read whole (every single-process array; a fully replicated one) come through one
    `jax.device_get` of all of them (the copies run in parallel; nothing else is copied). An array split
    across hosts (e.g. the logits of `forward` under the `latency` preset, sharded on the vocabulary; the
    batch under data parallelism) is gathered with `multihost_utils.process_allgather` -- a collective, so
    every process must call `to_host` at the same point with the same tree. Non-array leaves (Python
    numbers, numpy arrays) come back as numpy values (`np.asarray`).
    """
    leaves, treedef = jax.tree.flatten(tree)
    split = [_split_across_hosts(x) for x in leaves]
    local = iter(jax.device_get([x for x, s in zip(leaves, split) if not s]))
    return jax.tree.unflatten(treedef, [np.asarray(multihost_utils.process_allgather(x, tiled=True)) if s
                                        else np.asarray(next(local)) for x, s in zip(leaves, split)])


def _split_across_hosts(x) -> bool:
    """True for a jax.Array whose full value no single process holds (neither addressable here nor replicated)."""
    return isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated
