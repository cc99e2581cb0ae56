"""`dsv4-aot --sharding`: the expert-parallel set-up a user runs (docs/sharding.md, docs/aot.md).

A sharding preset (`parallel.presets`: "latency" = tensor-parallel attention + expert-tensor-parallel experts on
`model`; "throughput" = data-parallel attention + expert-parallel experts on `expert`) fixes the mesh, the
logical-axis rules and the expert-parallel MoE backend (`model.layers.moe_ep`). `--kernels pallas_tpu` makes the
Mosaic kernels the EP program's per-device local matmul (`ExpertParallel.local`); otherwise the preset's "auto"
local matmul resolved for the platform. "auto" picks the preset for the batch: latency while the batch is
smaller than twice the chips (few sequences per chip: split every matrix), throughput above.
"""
from __future__ import annotations

import dataclasses

from ... import parallel as S
from ...backends import ExpertParallel
from ...config import ModelConfig

SHARDINGS = ("auto", "latency", "throughput")


def preset_for(batch: int, chips: int) -> str:
    """The preset a user would pick for `batch` sequences on `chips` chips."""
    return "latency" if batch < 2 * chips else "throughput"


def resolve_name(name: str, batch: int, chips: int) -> str:
    if name not in SHARDINGS:
        raise ValueError(f"unknown sharding {name!r}; choose from {SHARDINGS}")
    return preset_for(batch, chips) if name == "auto" else name


def gspmd_safe(backends, chips: int):
    """The backends with the kernels that would run in the GSPMD-partitioned part of the program replaced by
    their references on more than one chip: a Mosaic kernel is a custom call XLA cannot partition ("Mosaic
    kernels cannot be automatically partitioned"), and only the MoE's local matmul runs under a shard_map.
    So the indexer's scores kernel (`pallas_tpu`) becomes the reference there."""
    if chips > 1 and backends.indexer == "pallas_tpu":
        return backends.replace(indexer="reference")
    return backends


def setup(name: str, config: ModelConfig, devices, batch: int,
          rules: dict | None = None) -> tuple[str, ModelConfig, object, dict]:
    """(preset name, config with the preset's EP backends, mesh, rules dict) for `devices`. The config's own
    backends (unroll, kernels) are kept; with moe="pallas_tpu" the EP local matmul is the Mosaic kernels.
    `rules` updates the preset's logical-axis rules (placement studies: e.g. a projection replicated)."""
    name = resolve_name(name, batch, len(devices))
    pre = S.preset(name)
    if rules:
        pre = dataclasses.replace(pre, rules=ExpertParallel.freeze_rules({**pre.rules_dict, **rules}))
    if config.backends.moe == "pallas_tpu":
        pre = dataclasses.replace(pre, local="pallas_tpu")
    config = config.with_backends(gspmd_safe(config.backends, len(devices)))
    mesh = pre.make_mesh(devices)
    return name, config.with_backends(pre.backends(mesh, config.backends)), mesh, pre.rules_dict
