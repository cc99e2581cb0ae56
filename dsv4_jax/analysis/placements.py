"""Named placements of the expert-parallel traffic study (docs/sharding.md): each a mesh shape or a sharding
preset (`dsv4_jax.parallel.PRESETS`), rules to change, and the MoE backend. Compiled side by side by
`dsv4-aot placements` (`analysis.aot.placement_table`, through `analysis.aot.runner`).

    gspmd-ep        mesh 1x8x1, default rules, moe=reference: GSPMD partitions the `w[idx]` gathers (before)
    gspmd-tp        mesh 1x1x8, default rules, moe=reference (before)
    latency         the "latency" preset: 1x1x8, TP attention + expert-TP experts, moe=ep (after)
    throughput      the "throughput" preset: 1x8x1, DP attention + EP experts, moe=ep (after)
    latency-v1      the latency preset with its small projections replicated (no `parallel.LATENCY_SPLIT`: q
                    latent, compressor and K=V projections, mHC mixing matrices; the placement before the
                    preset's second pass)

The expert-parallel MoE runs on a preset's mesh and rules (changed by a rules dict), so every "ep" variant
names a preset. (The study's earlier "latency-ep" row, whole experts split 8 ways under the default rules,
is in experiments/results/ep_traffic_2026-12-01*.md.)
"""
from __future__ import annotations

from .. import parallel

# name: (mesh shape or preset name, rules (None: the defaults or the preset's; a dict updates them), moe backend)
VARIANTS = {
    "gspmd-ep": ((1, 8, 1), None, "reference"),
    "gspmd-tp": ((1, 1, 8), None, "reference"),
    "latency": ("latency", None, "ep"),
    "throughput": ("throughput", None, "ep"),
    "latency-v1": ("latency", {k: () for k in parallel.LATENCY_SPLIT}, "ep"),
}
