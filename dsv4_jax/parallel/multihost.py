"""Multi-host start-up (`jax.distributed` from arguments or DSV4_* environment variables) and `to_host`,
which brings a result spread over hosts to every host (docs/sharding.md, multi-host section)."""
from __future__ import annotations

import os
from typing import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils


# ---- multi-host --------------------------------------------------------------------------------------

def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, local_device_ids: Sequence[int] | None = None,
                           **kwargs) -> bool:
    """`jax.distributed.initialize` with environment defaults; call once per process, before any jax op.

    Arguments default to DSV4_COORDINATOR (host:port of process 0), DSV4_NUM_PROCESSES, DSV4_PROCESS_ID
    and DSV4_LOCAL_DEVICE_IDS (comma list). When none is given anywhere, jax's own auto-detection
    runs (TPU pods, SLURM, Open MPI, ...). A single process with nothing configured is a no-op.
    Returns True when jax.distributed was initialised.
    """
    env = os.environ
    coordinator_address = coordinator_address or env.get("DSV4_COORDINATOR")
    if num_processes is None and env.get("DSV4_NUM_PROCESSES"):
        num_processes = int(env["DSV4_NUM_PROCESSES"])
    if process_id is None and env.get("DSV4_PROCESS_ID"):
        process_id = int(env["DSV4_PROCESS_ID"])
    if local_device_ids is None and env.get("DSV4_LOCAL_DEVICE_IDS"):
        local_device_ids = [int(i) for i in env["DSV4_LOCAL_DEVICE_IDS"].split(",")]
    explicit = coordinator_address is not None or num_processes is not None
    if not explicit and not _cluster_detected():
        return False
    if num_processes == 1 and coordinator_address is None:
        return False
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id, local_device_ids=local_device_ids, **kwargs)
    return True


def _cluster_detected() -> bool:
    """A cluster environment jax.distributed can auto-detect (TPU pod, SLURM job step, Open MPI, Kubernetes)."""
    env = os.environ
    return any(k in env for k in ("TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS", "OMPI_COMM_WORLD_SIZE")) or \
        ("SLURM_JOB_ID" in env and int(env.get("SLURM_NTASKS", "1")) > 1)



def to_host(tree):
    """Every array of `tree` as a numpy array holding its full value, on every process.

    A single-process array (or one whose shards are all on this host) is copied as is; a fully replicated
    one from the local copy; an array split across hosts (e.g. the logits of `forward` under the `latency`
    preset, sharded on the vocabulary) is gathered with `multihost_utils.process_allgather` -- a collective,
    so every process must call it at the same point. Non-array leaves pass through `np.asarray`.
    """
    return jax.tree.map(_to_host, tree)


def _to_host(x):
    if not isinstance(x, jax.Array):
        return np.asarray(x)
    if x.is_fully_addressable:
        return np.asarray(x)
    if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
