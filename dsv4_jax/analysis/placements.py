"""Named placements of the expert-parallel traffic study (issue 19; docs/sharding.md): each a mesh shape or a
sharding preset (`dsv4_jax.parallel.PRESETS`), rules to change, and the MoE backend. Compiled by
experiments/aot_ep_traffic.py, modelled by experiments/ep_traffic_report.py.

    gspmd-ep        mesh 1x8x1, default rules, moe=reference: GSPMD partitions the `w[idx]` gathers (before)
    gspmd-tp        mesh 1x1x8, default rules, moe=reference (before)
    latency         the "latency" preset: 1x1x8, TP attention + expert-TP experts, moe=ep (after)
    latency-ep      1x1x8, TP attention + whole experts split 8 ways (default rules), moe=ep
    throughput      the "throughput" preset: 1x8x1, DP attention + EP experts, moe=ep (after)
    latency-v1      the latency preset with its small projections replicated (no `parallel.LATENCY_SPLIT`: q
                    latent, compressor and K=V projections, mHC mixing matrices; the placement before issue
                    19's second pass)
"""
from __future__ import annotations

from .. import parallel

# name: (mesh shape or preset name, rules (None: the defaults or the preset's; a dict updates them), moe backend)
VARIANTS = {
    "gspmd-ep": ((1, 8, 1), None, "reference"),
    "gspmd-tp": ((1, 1, 8), None, "reference"),
    "latency": ("latency", None, "ep"),
    "latency-ep": ((1, 1, 8), None, "ep"),
    "throughput": ("throughput", None, "ep"),
    "latency-v1": ("latency", {k: () for k in parallel.LATENCY_SPLIT}, "ep"),
}


def variant_placement(variant: str, chips: int) -> tuple[dict, dict | None]:
    """(mesh sizes {axis: size}, rules or None) of a variant on `chips` devices."""
    shape, rules, _ = VARIANTS[variant]
    if isinstance(shape, str):
        pre = parallel.preset(shape)
        return dict(zip(parallel.MESH_AXES, pre.mesh_shape(chips))), {**pre.rules_dict, **(rules or {})}
    return dict(zip(parallel.MESH_AXES, shape)), rules
