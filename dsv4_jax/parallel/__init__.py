"""Meshes, logical-axis sharding rules and multi-host set-up (GSPMD; see docs/sharding.md).

Mesh: three named axes, `MESH_AXES = ("data", "expert", "model")`:

    data    pure data parallelism: the batch of the decode state (and of the tokens) is split,
            the weights are replicated.
    expert  expert parallelism for the routed experts (the `experts` axis of w1/w2/w3) and data
            parallelism of the batch for everything else ("DP attention": each expert-group
            device attends its own sequences, then tokens meet their experts).
    model   tensor parallelism: attention heads (`q_heads`, `heads`), O-LoRA groups (`o_groups`),
            indexer heads (`index_heads`), the shared expert's `mlp` and the vocabulary (`vocab`:
            embedding, head, hash table). The routed experts also use it (expert parallelism over
            expert × model), so an 8-way `model` mesh still holds 1/8 of the experts per device.

Rules map each logical axis name of `params.ParamSpec` (and of the decode state) to an ordered tuple
of mesh axes. A leaf's PartitionSpec is built dimension by dimension, greedily: a mesh axis is used
for a dimension when the dimension stays divisible by the product of the axes chosen so far and the
axis is not already used by an earlier dimension of the same leaf. Anything not divisible falls back
to replication, so every config (tiny test ones included) shards on every mesh. Mesh axes of size 1
are skipped (specs stay short and readable). The stacking axis `layers` is never split.

The model code is not changed: params and state are placed with `jax.device_put` onto the
shardings returned here and the existing jitted functions (`forward`, `decode.process_block`, ...)
run as GSPMD programs; with the expert-parallel backend (`Backends(moe="ep")`, set by the presets
below) the routed experts run under an explicit `shard_map` (`model.layers.moe_ep`).

Presets (`PRESETS`, `preset(name)`): a mesh shape for n devices + rules + backends, by name:
"latency" (tensor-parallel attention / vocabulary and expert-tensor-parallel experts on `model`,
small batches) and "throughput" (data-parallel attention and expert-parallel experts on `expert`,
large batches); see docs/sharding.md. Axis types must be `Auto` (jax 0.10's `jax.make_mesh` defaults to
`Explicit`, which would demand sharding annotations inside the model), so use `make_mesh` below.
"""
from __future__ import annotations

from ..ops.partitioning import (DEFAULT_RULES, constrain, constrain_logical, constrain_rows, constrain_state_rows,
                                leaf_partition_spec, logical_rules, mesh_sizes, partition_spec, state_batch_entry,
                                state_split_beyond_tokens)
from .expert_words import routed_experts_as_words, wants_words
from .meshes import MESH_AXES, default_mesh_shape, make_mesh, parse_mesh_shape
from .multihost import initialize_distributed, to_host
from .presets import LATENCY_SPLIT, PRESETS, ShardingPreset, preset
from .rules import (DEFAULT_REPLICATED, describe, drafter_shardings, init_sharded_state, param_partition_specs,
                    param_shardings, shard_batch, shard_params, shard_state, shardings_like, spec_sharding,
                    spec_tree_partition_specs, state_partition_specs, state_shardings)

__all__ = ["DEFAULT_REPLICATED", "DEFAULT_RULES", "LATENCY_SPLIT", "MESH_AXES", "parse_mesh_shape", "PRESETS", "ShardingPreset",
           "constrain", "constrain_logical", "constrain_rows", "constrain_state_rows",
           "default_mesh_shape", "logical_rules", "state_batch_entry", "state_split_beyond_tokens",
           "describe", "drafter_shardings", "init_sharded_state", "initialize_distributed", "leaf_partition_spec", "make_mesh", "mesh_sizes",
           "param_partition_specs", "routed_experts_as_words", "wants_words", "param_shardings", "partition_spec", "preset", "shard_batch", "shard_params",
           "shard_state", "shardings_like", "spec_sharding", "spec_tree_partition_specs", "state_partition_specs",
           "state_shardings", "to_host"]
