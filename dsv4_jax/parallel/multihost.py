"""Multi-host start-up (`jax.distributed` from arguments or DSV4_* environment variables), and `to_host`
(defined in `dsv4_jax.ops.host`, below every layer that fetches results), which brings a result spread over
hosts to every host (docs/sharding.md, multi-host section)."""
from __future__ import annotations

import os
from typing import Sequence

import jax

from ..ops.host import to_host  # noqa: F401  (re-exported: parallel.to_host)


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
