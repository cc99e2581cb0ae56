"""TPU generations, topology names and the abstract devices libtpu gives for them (no TPU needed).

A topology is named the way libtpu names it: `<generation>:<chip grid>`, e.g. "v5p:2x2x2" (8 chips, a
3-D torus), "v5e:4x4" (16 chips, 2-D), "v6e:2x4". `devices(name)` asks libtpu for the topology's abstract
devices (`dsv4_jax.analysis.libtpu.topology_desc`, the project's one libtpu entry); a program lowered onto a mesh of them and compiled
is the TPU program, compiled on this CPU machine. "cpu" / "cpu:N" names the host's own CPU devices (jax's CPU
backend compiles the same code path; tests use it where libtpu is absent).

Per-chip numbers (`CHIPS`): HBM bandwidth and peak bf16 / int8 matmul rates from the Cloud TPU system
architecture pages (v5e: 819 GB/s, 197 / 393 TFLOP/s; v5p: 2765 GB/s, 459 / 918; v6e: 1638 GB/s, 918 / 1836;
v4: 1228 GB/s, 275 / 275). The HBM a program may use per device is asked from the compiler itself
(`hbm_bytes`: libtpu reports "available HBM" when a program is too large — 95.74 GiB on v5p, 15.75 GiB on v5e,
31.25 GiB on v6e with libtpu 0.0.42); `CHIPS[..].hbm_gib` is the fallback when that probe fails.

Latencies of the latency-aware roofline (`Chip.collective_latency_us`, `Chip.op_overhead_us`): no per-chip
figure is published on the Cloud TPU pages for either, so both are stated assumptions, the same on every
generation: 5 µs per collective (a small-message ICI all-reduce / all-gather / all-to-all over a slice of a
few hops: the order of magnitude public write-ups give for small ICI collectives, "< 10 µs") and 1 µs per
launched op (a fusion or Mosaic kernel: its pipeline fill and drain, the first DMA's wait; order 1 µs or less).
`with_latencies` replaces them (`dsv4-aot --collective-latency-us / --op-overhead-us`); the report records
the values used (each run's "chip", the meta's "latency").
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re

import numpy as np

from .. import libtpu
from ..libtpu import LibtpuMissing

GIB = 1024 ** 3

# compiler options of the report's TPU compiles: finish compiling a program that does not fit, so that its
# memory and costs are reported (its peak then says by how much it misses)
TPU_COMPILE_OPTIONS = {"xla_tpu_no_crash_on_oom": True}

LIBTPU_HELP = libtpu.HELP + "; or use --topology cpu to compile for this machine's CPU instead"


def no_prefetch_options(chip: Chip) -> dict | None:
    """Compiler options that switch XLA:TPU's VMEM memory-space assignment off for `chip` (None: not known,
    e.g. v4 or the CPU backend). With it on (the default), XLA prefetches weights into on-chip VMEM with
    copy-start / copy-done pairs, and `cost_analysis()` counts such a weight three times (the HBM read, the
    VMEM write, the consumer's VMEM read) although HBM is read once; without it every operand is read from
    HBM where it is used, so XLA's bytes are HBM bytes. The flag per generation was found by compiling the
    same scan for v5e:1x1, v5p:1x1x1 and v6e:1x1 with libtpu 0.0.52: v5e / v5p take the `vf` flag, v6e the
    `gf` one (the other flag leaves the prefetches in place)."""
    return {chip.vmem_msa_flag: False} if chip.vmem_msa_flag else None


class TopologyError(ValueError):
    """An unknown or malformed topology name."""


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator chip (device) generation: what a roofline estimate needs."""

    name: str                 # generation as in topology names: v5e, v5p, v6e, v4, cpu
    device_kind: str          # jax Device.device_kind
    hbm_gib: float            # memory per device (fallback when the compiler is not asked)
    hbm_gbps: float           # HBM bandwidth, GB/s (1e9 bytes)
    bf16_tflops: float        # peak dense bf16 matmul rate
    int8_tops: float          # peak int8 rate
    dims: int                 # chip-grid dimensions in topology names (2-D or 3-D torus)
    vmem_msa_flag: str | None = None   # libtpu option that switches VMEM prefetching off (`no_prefetch_options`)
    collective_latency_us: float = 5.0  # fixed cost per collective, µs (assumed: module docstring)
    op_overhead_us: float = 1.0         # fixed cost per launched op (fusion, custom call, ...), µs (assumed)

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_gbps * 1e9

    @property
    def flops_per_s(self) -> float:
        return self.bf16_tflops * 1e12


LATENCY_SOURCE = ("assumed (no published per-chip figure): 5 us per collective (small-message ICI collective), "
                  "1 us per launched op (fusion / kernel start-up)")


def with_latencies(chip: Chip, collective_us: float | None = None, op_us: float | None = None) -> Chip:
    """`chip` with its per-collective latency and per-op launch overhead (µs) replaced where given (None: kept);
    a negative value is a ValueError."""
    for name, v in (("collective latency", collective_us), ("op overhead", op_us)):
        if v is not None and not v >= 0:
            raise ValueError(f"{name} must be >= 0 µs, got {v:g}")
    return dataclasses.replace(chip, **{k: v for k, v in (("collective_latency_us", collective_us),
                                                          ("op_overhead_us", op_us)) if v is not None})


CHIPS: dict[str, Chip] = {
    "v4": Chip("v4", "TPU v4", 32.0, 1228.0, 275.0, 275.0, 3),
    "v5e": Chip("v5e", "TPU v5 lite", 16.0, 819.0, 197.0, 393.0, 2, "xla_vf_vmem_memory_space_assignment"),
    "v5p": Chip("v5p", "TPU v5", 95.0, 2765.0, 459.0, 918.0, 3, "xla_vf_vmem_memory_space_assignment"),
    "v6e": Chip("v6e", "TPU v6 lite", 32.0, 1638.0, 918.0, 1836.0, 2, "xla_gf_vmem_memory_space_assignment"),
}
ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6lite": "v6e", "trillium": "v6e"}
# nominal numbers for compiles on the host CPU (tests, --topology cpu): not a roofline of anything real
CPU = Chip("cpu", "cpu", 16.0, 20.0, 1.0, 1.0, 1)


@dataclasses.dataclass(frozen=True)
class Topology:
    """A parsed topology name: generation, chip grid, chips."""

    name: str
    chip: Chip
    grid: tuple[int, ...]

    @property
    def chips(self) -> int:
        return math.prod(self.grid)

    @property
    def is_tpu(self) -> bool:
        return self.chip.name != "cpu"


def parse(name: str) -> Topology:
    """"v5p:2x2x2" -> Topology(v5p, (2, 2, 2)); "cpu" / "cpu:N" -> the host CPU backend (N devices)."""
    text = name.strip().lower()
    m = re.fullmatch(r"([a-z0-9]+)(?:[:_=]([0-9]+(?:x[0-9]+)*))?", text)
    if not m:
        raise TopologyError(f"topology {name!r} must look like v5p:2x2x2, v5e:4x4 or v6e:2x4 (generation:grid)")
    gen, grid = ALIASES.get(m.group(1), m.group(1)), m.group(2)
    if gen == "cpu":
        return Topology(text, CPU, (int(grid),) if grid else (1,))
    if gen not in CHIPS:
        raise TopologyError(f"unknown TPU generation {m.group(1)!r} in {name!r}; known: {sorted(CHIPS)}")
    if grid is None:
        raise TopologyError(f"topology {name!r} needs a chip grid, e.g. {gen}:{'2x2x1' if CHIPS[gen].dims == 3 else '2x2'}")
    dims = tuple(int(v) for v in grid.split("x"))
    chip = CHIPS[gen]
    if len(dims) != chip.dims or min(dims) < 1:
        raise TopologyError(f"{gen} topologies have a {chip.dims}-D chip grid of positive sizes, got {grid!r}")
    return Topology(f"{gen}:{grid}", chip, dims)


def devices(topology: Topology) -> list:
    """The topology's devices: abstract TPU devices from libtpu, or the host's CPU devices."""
    import jax
    if not topology.is_tpu:
        devs = jax.devices("cpu")
        if len(devs) < topology.chips:
            raise TopologyError(f"{topology.name} needs {topology.chips} CPU devices, jax has {len(devs)} (set "
                                f"XLA_FLAGS=--xla_force_host_platform_device_count={topology.chips} before jax starts)")
        return list(devs[:topology.chips])
    if not libtpu.available():
        raise LibtpuMissing(LIBTPU_HELP)
    try:
        desc = libtpu.topology_desc(topology.name)
    except LibtpuMissing as e:      # libtpu is there: it rejected the name
        raise TopologyError(f"libtpu rejected topology {topology.name!r}: {str(e).splitlines()[0][:300]}") from e
    return list(desc.devices)


def host_count(devs) -> int:
    return len({getattr(d, "process_index", 0) for d in devs})


_SIZE = re.compile(r"([0-9.]+)\s*([KMGTP]?)(?:i?B)?\b")
_UNITS = {"": 1, "K": 1024, "M": 1024 ** 2, "G": GIB, "T": 1024 ** 4, "P": 1024 ** 5}


def parse_size(text: str) -> float | None:
    """"95.74G" -> bytes (binary units, as XLA prints them)."""
    m = _SIZE.fullmatch(text.strip())
    return float(m.group(1)) * _UNITS[m.group(2)] if m else None


def hbm_from_error(message: str) -> float | None:
    """The per-device HBM the TPU compiler reports in an out-of-memory error ("exceeds available HBM (95.74G)",
    "Used 120.1G of 95.74G hbm"), in bytes; None when the message has none."""
    for pat in (r"available HBM \(([0-9.]+\s*[KMGTP]?)", r"of\s+([0-9.]+\s*[KMGTP]?)\s+hbm"):
        m = re.search(pat, message)
        if m:
            return parse_size(m.group(1))
    return None


def required_from_error(message: str) -> float | None:
    """The bytes a too-large program needs per device, from the TPU compiler's out-of-memory message
    ("memory required for HLO temporaries (128.52G)", "Used 120.1G of 95.74G hbm")."""
    for pat in (r"required for HLO temporaries \(([0-9.]+\s*[KMGTP]?)\)", r"Used\s+([0-9.]+\s*[KMGTP]?)\s+of"):
        m = re.search(pat, message)
        if m:
            return parse_size(m.group(1))
    return None


@functools.lru_cache(maxsize=None)
def _probe_hbm(device_kind: str, device) -> float | None:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    mesh = Mesh(np.asarray([device], dtype=object), ("x",))
    big = jax.ShapeDtypeStruct((1 << 40,), jnp.int8, sharding=NamedSharding(mesh, PartitionSpec()))
    try:
        jax.jit(lambda a: a + 1).lower(big).compile()
    except Exception as e:  # noqa: BLE001 - the error is the answer
        return hbm_from_error(str(e))
    return None


def hbm_bytes(topology: Topology, devs) -> tuple[float, str]:
    """(bytes of memory one device may use, where the number came from)."""
    if topology.is_tpu:
        got = _probe_hbm(devs[0].device_kind, devs[0])
        if got:
            return got, "TPU compiler (available HBM)"
    return topology.chip.hbm_gib * GIB, "table"
