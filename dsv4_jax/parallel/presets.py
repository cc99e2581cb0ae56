"""Sharding presets: a mesh shape for n devices + logical-axis rules + the expert-parallel MoE, by name."""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
from jax.sharding import Mesh

from ..backends import REFERENCE, Backends, ExpertParallel, resolve
from ..config import ModelConfig
from .meshes import MESH_AXES, make_mesh
from ..ops.partitioning import DEFAULT_RULES

# ---- presets: mesh shape + rules + backends ---------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ShardingPreset:
    """A named placement: all devices on one mesh axis, logical-axis rules, the expert-parallel MoE.

    axis: the mesh axis that takes every device ("model" or "expert"); rules: ((logical axis, mesh axes),
    ...) (hashable form of a rules mapping); local: the per-device grouped matmul of the EP MoE
    (backends.EP_LOCAL, "auto": by platform).
    """

    name: str
    axis: str
    rules: tuple[tuple[str, tuple[str, ...]], ...]
    summary: str
    local: str = "auto"

    def mesh_shape(self, n_devices: int) -> tuple[int, int, int]:
        """(data, expert, model) with all n devices on `axis`."""
        return tuple(n_devices if a == self.axis else 1 for a in MESH_AXES)

    def make_mesh(self, devices: Sequence[Any] | None = None) -> Mesh:
        devices = list(jax.devices() if devices is None else devices)
        return make_mesh(self.mesh_shape(len(devices)), devices)

    @property
    def rules_dict(self) -> dict[str, tuple[str, ...]]:
        return dict(self.rules)

    def backends(self, mesh: Mesh, base: Backends = REFERENCE) -> Backends:
        """`base` with the expert-parallel MoE on `mesh`, resolved for the mesh's platform."""
        ep = ExpertParallel(mesh=mesh, rules=self.rules, local=self.local)
        platform = mesh.devices.flat[0].platform
        return resolve(base.replace(moe="ep", ep=ep), platform)

    def apply(self, config: ModelConfig, mesh: Mesh) -> ModelConfig:
        """The config with this preset's backends on `mesh` (other backend choices kept)."""
        return config.with_backends(self.backends(mesh, config.backends))


# The latency preset's splits of the matrices that have no head / group / vocabulary axis, all over `model`
# (GSPMD inserts the small collectives: an all-gather of the [T, q_lora] / [T, d] / [T, cd] outputs, a psum of
# the [T, E] router logits and of the [T, n_out] mHC mixes):
#   q_lora    W_qa [q_lora, D] by output row (and q_norm); W_qb / the indexer's W_qb keep their head split
#   head_dim  the K=V projection W_kv [d, D] by output row (and kv_norm, the compressors' norms)
#   comp_dim  the compressors' W_kv / W_gate [cd, D] by output row (and the position biases B)
#   hc_embed  the mHC mixing matrices [n_out, n_hc·D] along their contraction
#   o_out     W_ob [D, G·R] by output row (its contraction `o_groups` then stays whole: `model` is taken):
#             split along the O-LoRA groups instead, GSPMD all-gathers the whole FP8 W_ob in every layer
#             on v5p once `quant.matmul_blocks` pads the decode token to 8 rows (v5p AOT, 43 × 33.5 MB)
# The router W_r [E, D] (0.2 % of the non-expert bytes) stays replicated: split along its contraction
# (`router_in`) GSPMD all-gathers the weight at B = 8 (v5p AOT) instead of summing the [T, E] logits.
# The rows these projections write to the decode state are placed like the state
# (`constrain_state_rows`), so the split output dims do not spread into the cache tables.
LATENCY_SPLIT: dict[str, tuple[str, ...]] = {"q_lora": ("model",), "head_dim": ("model",), "comp_dim": ("model",),
                                              "hc_embed": ("model",), "o_out": ("model",)}


def _preset_rules(**changes) -> tuple[tuple[str, tuple[str, ...]], ...]:
    return ExpertParallel.freeze_rules({**DEFAULT_RULES, **changes})


PRESETS: dict[str, ShardingPreset] = {
    # Decode latency, small batches: attention heads, O-LoRA groups, indexer heads and the vocabulary are
    # split over `model` (tensor parallelism); each routed expert is split along its intermediate axis
    # `mlp` over `model` too (expert-tensor parallelism), so a decode step reads 1/n of every *active*
    # expert on each device instead of whole experts on the few devices that hold them. The small
    # projections are split too, so no device reads a whole non-expert matrix (`LATENCY_SPLIT`). The
    # decode state (one shared K=V head: nothing to split by head) is split by sequence over `model` when
    # the batch divides (`state_batch`): each device scores, gathers and attends its own sequences' rows
    # for every head (the queries gathered there, the output back to the head split), instead of every
    # device reading every sequence's cache (v5p AOT, 7 layers, B = 8: 2.88 → 2.56 GiB per chip);
    # replicated otherwise (B = 1).
    "latency": ShardingPreset(
        "latency", "model", _preset_rules(experts=(), state_batch=("model",), **LATENCY_SPLIT),
        "tensor-parallel attention / O-LoRA groups / vocabulary + expert-tensor-parallel experts on 'model' "
        "(small batches)"),
    # Throughput, large batches: the batch (decode state, attention) is split over `expert` (data-parallel
    # attention, weights other than experts replicated) and the routed experts are split over `expert`
    # (expert parallelism, E/n whole experts per device).
    "throughput": ShardingPreset(
        "throughput", "expert", _preset_rules(),
        "data-parallel attention + expert-parallel experts on 'expert' (large batches)"),
}


def preset(name: str | ShardingPreset) -> ShardingPreset:
    """A sharding preset by name (or itself)."""
    if isinstance(name, ShardingPreset):
        return name
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown sharding preset {name!r}; choose from {sorted(PRESETS)}") from None


