"""Abstract inputs of the compiled programs: `jax.ShapeDtypeStruct`s carrying their NamedShardings.

Nothing is allocated. Placements come from `dsv4_jax.sharding` (the same logical-axis rules a real run
uses: `param_shardings`, `drafter_shardings`, `state_shardings`); arrays the rules do not cover (the
speculative loop's carry, drafter states, tokens) are split on their batch axis with the `batch` rule.

Weight formats (`WEIGHTS`):
    bf16     every weight bfloat16; float32 / int32 leaves as the specs say
    fp8      routed experts in the MoE kernels' storage (`ops.quant.quantize_experts(..., "fp8", (128, 128))`):
             float8_e4m3fn codes [.., E, N, K] + a float32 scale per 128×128 block ("w1_scale", ...); the
             rest bf16 (what experiments/bench_decode.py runs as "fp8-experts")
    release  the official release precision (FP4 experts, FP8 projections) kept quantized on device: needs the
             quantized-weight leaf type (issue 18); refused until it exists
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from .. import params as P
from .. import sharding as S
from ..cache import state_shapes
from ..config import ModelConfig

WEIGHTS = ("bf16", "fp8", "release")
FP8_BLOCK = (128, 128)
COMPUTE_DTYPE = jnp.bfloat16
DSPARK_STAGES, DSPARK_TAPS, DSPARK_MARKOV_RANK = 3, 3, 256   # the released Flash drafter (drafters.md §2.1)


class WeightFormatError(ValueError):
    """A weight format this build cannot place on device."""


def check_weights(weights: str) -> None:
    if weights not in WEIGHTS:
        raise WeightFormatError(f"unknown weight format {weights!r}; choose from {WEIGHTS}")
    if weights == "release":
        raise WeightFormatError("--weights release needs quantized weights kept as pytree leaves on device "
                                "(issue 18, ops/quant.py); not in this build — use bf16 or fp8")


def sds(shape, dtype, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sharding)


def _fp8_experts(specs: dict, shardings: dict, mesh, prefix: str) -> dict:
    """{"w1","w2","w3"} ParamSpecs -> fp8 codes + float32 block scales, sharded like the dense leaf."""
    out = {}
    for name, spec in specs.items():
        *lead, n, k = spec.shape
        br, bc = min(FP8_BLOCK[0], n), min(FP8_BLOCK[1], k)
        scale_shape = (*lead, n // br, k // bc)
        out[name] = sds(spec.shape, jnp.float8_e4m3fn, shardings[name])
        out[name + "_scale"] = sds(scale_shape, jnp.float32,
                                   S.spec_sharding(spec, mesh, path=f"{prefix}{name}", shape=scale_shape))
    return out


def abstract_tree(specs, shardings, weights: str, mesh, prefix: str = ""):
    """ShapeDtypeStructs for a ParamSpec tree and its parallel NamedSharding tree, in format `weights`."""
    if isinstance(specs, P.ParamSpec):
        return sds(specs.shape, specs.dtype(COMPUTE_DTYPE), shardings)
    if isinstance(specs, (list, tuple)):
        return [abstract_tree(s, sh, weights, mesh, f"{prefix}{i}.") for i, (s, sh) in enumerate(zip(specs, shardings))]
    out = {}
    for key, s in specs.items():
        if key == "experts" and weights == "fp8":
            out[key] = _fp8_experts(s, shardings[key], mesh, f"{prefix}{key}.")
        else:
            out[key] = abstract_tree(s, shardings[key], weights, mesh, f"{prefix}{key}.")
    return out


def target_params(config: ModelConfig, mesh, weights: str, rules=None) -> dict:
    check_weights(weights)
    return abstract_tree(P.param_specs(config), S.param_shardings(config, mesh, rules), weights, mesh)


def mtp_params(config: ModelConfig, mesh, weights: str, rules=None) -> list:
    specs = P.mtp_specs(config)
    return [abstract_tree(specs, S.drafter_shardings(specs, mesh, rules), weights, mesh)]


def dspark_params(config: ModelConfig, mesh, weights: str, rules=None) -> dict:
    specs = dspark_specs(config)
    return abstract_tree(specs, S.drafter_shardings(specs, mesh, rules), weights, mesh)


def dspark_specs(config: ModelConfig):
    rank = DSPARK_MARKOV_RANK if config.hidden_size >= 1024 else 8
    return P.dspark_specs(config, DSPARK_STAGES, DSPARK_TAPS, rank, False)


def decode_state(config: ModelConfig, mesh, batch: int, max_len: int, max_block: int, rules=None):
    """The target's DecodeState (bf16 caches) for `batch` sequences of capacity `max_len`."""
    shapes = state_shapes(config, batch, max_len, max_block, COMPUTE_DTYPE)
    shard = S.state_shardings(config, mesh, batch, max_len, max_block, COMPUTE_DTYPE, rules)
    return jax.tree.map(lambda s, sh: sds(s.shape, s.dtype, sh), shapes, shard)


def batch_split(mesh, shape, batch_axis: int = 0, rules=None) -> NamedSharding:
    """A NamedSharding splitting axis `batch_axis` of `shape` by the `batch` rule (replicated otherwise)."""
    axes = [None] * len(shape)
    if len(shape) > batch_axis:
        axes[batch_axis] = "batch"
    return NamedSharding(mesh, S.partition_spec(shape, axes, S.mesh_sizes(mesh), rules))


def batch_array(mesh, shape, dtype, batch_axis: int = 0, rules=None) -> jax.ShapeDtypeStruct:
    return sds(shape, dtype, batch_split(mesh, shape, batch_axis, rules))


def replicated(mesh, shape, dtype) -> jax.ShapeDtypeStruct:
    return sds(shape, dtype, NamedSharding(mesh, PartitionSpec()))


def per_device_bytes(tree) -> float:
    """Bytes one device holds of an abstract tree (the largest shard of each leaf; shared leaves counted
    each time they appear)."""
    total = 0.0
    for x in jax.tree.leaves(tree):
        shard = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shard) * jnp.dtype(x.dtype).itemsize
    return total


def total_bytes(tree) -> float:
    return float(sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The sizes a report is compiled for."""

    batch: int
    context: int          # committed tokens the step runs at (the state's capacity is context + slack)
    draft_n_max: int      # k: the verify block is k + 1 tokens
    prefill_chunk: int    # tokens per sequence in one prefill call

    @property
    def max_block(self) -> int:
        return self.draft_n_max + 1

    @property
    def max_len(self) -> int:
        """State capacity: the context plus one round's block (a round at `context` writes k + 1 rows)."""
        return self.context + self.max_block
