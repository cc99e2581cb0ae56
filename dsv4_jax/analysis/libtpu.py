"""libtpu on a machine without a TPU: compile for a TPU topology from this CPU (no TPU, no network).

`pip install libtpu` (the version matching jax) provides the TPU compiler; with JAX_PLATFORMS=cpu and the
environment below, `jax.experimental.topologies` describes a topology ("v5p:2x2x2", "v6e:2x2") whose abstract
devices `jit(...).lower(...).compile()` targets. Used by `analysis.kernels_aot` and `dsv4-aot`; nothing traced.
"""
from __future__ import annotations

import importlib.util
import os

# keep libtpu off cloud metadata servers when it initialises on a machine that is not a TPU VM
TPU_ENV = {"TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_HOSTNAMES": "localhost", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}

HELP = ("compiling for a TPU topology on this machine needs libtpu, the TPU compiler (no TPU needed): "
        "`pip install libtpu` (the version matching your jax, e.g. `pip install \"jax[tpu]\"`), then run "
        "with JAX_PLATFORMS=cpu")


class LibtpuMissing(RuntimeError):
    """libtpu is not installed, or cannot describe the asked topology."""


def available() -> bool:
    return importlib.util.find_spec("libtpu") is not None


def set_env() -> None:
    """Environment for libtpu on a non-TPU machine (set before libtpu loads; existing values win)."""
    for k, v in TPU_ENV.items():
        os.environ.setdefault(k, v)


def topology_desc(name: str):
    """libtpu's description of topology `name` ("v5p:2x2x1", ...): `.devices` are its abstract chips."""
    if not available():
        raise LibtpuMissing(HELP)
    set_env()
    from jax.experimental import topologies
    try:
        return topologies.get_topology_desc(topology_name=name, platform="tpu")
    except Exception as e:  # noqa: BLE001 - libtpu's message names the problem
        raise LibtpuMissing(f"libtpu cannot describe topology {name!r}: {e}") from e
