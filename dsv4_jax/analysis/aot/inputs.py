"""Abstract inputs of the compiled programs: `jax.ShapeDtypeStruct`s carrying their NamedShardings.

Nothing is allocated. Placements come from `dsv4_jax.parallel` (the same logical-axis rules a real run
uses: `param_shardings`, `drafter_shardings`, `state_shardings`); arrays the rules do not cover (the
speculative loop's carry, drafter states, tokens) are split on their batch axis with the `batch` rule.

Weight formats (`WEIGHTS`), each leaf a dense ShapeDtypeStruct or an `ops.quant.QArray` of them (codes and
scale, each with the NamedSharding `parallel.spec_sharding` gives its quantized spec):
    bf16     every weight bfloat16; float32 / int32 leaves as the specs say
    fp8      routed experts in the MoE kernels' FP8 storage (`random_init`'s expert_format="fp8"): e4m3 codes
             [.., E, N, K] + a float32 scale per 128×128 block; the rest bf16 (traffic's "fp8-experts")
    release  the official release precision kept quantized on device (`params.release_format`): FP4 e2m1
             routed experts (e8m0 scale per 32), FP8 e4m3 attention projections / shared experts (e8m0 per
             128×128), the rest bf16 (traffic's "release", memplan's "quantized")
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from ...model import params as P
from ... import parallel
from ...model.state import state_shapes
from ...parallel.expert_words import ROUTED_EXPERTS
from ...config import ModelConfig
from ...ops import quant

WEIGHTS = ("bf16", "fp8", "release")
COMPUTE_DTYPE = jnp.bfloat16
DSPARK_STAGES, DSPARK_TAPS, DSPARK_MARKOV_RANK = 3, 3, 256   # the released Flash drafter (docs/drafter_math.md §2.1)


class WeightFormatError(ValueError):
    """An unknown weight format name."""


def check_weights(weights: str) -> None:
    if weights not in WEIGHTS:
        raise WeightFormatError(f"unknown weight format {weights!r}; choose from {WEIGHTS}")


def fp8_expert_format(shape) -> quant.QFormat:
    """The MoE kernels' FP8 expert storage for a [.., N, K] expert matrix: e4m3 codes, a float32 scale per
    128×128 block (one block along a smaller dim, as `random_init` makes them)."""
    return quant.QFormat("e4m3", (min(128, shape[-2]), min(128, shape[-1])), "f32")


def leaf_format(weights: str, path: str, spec: P.ParamSpec) -> quant.QFormat | None:
    """Storage of the leaf at flat `path` in weight format `weights` (None: dense)."""
    if weights == "fp8":
        return fp8_expert_format(spec.shape) if spec.kind == "weight" and ROUTED_EXPERTS.search(path) else None
    if weights == "release":
        return P.release_format(path, spec)
    return None


def quantized_specs(specs, weights: str):
    """The ParamSpec tree with `quant` set for format `weights`."""
    check_weights(weights)
    return P.with_formats(specs, lambda path, spec: leaf_format(weights, path, spec))


def sds(shape, dtype, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sharding)


def abstract_tree(specs, shardings):
    """`params.abstract_leaf` of every ParamSpec (quantized ones: QArrays) with the parallel shardings (a
    NamedSharding or a QArray of them per leaf)."""
    return jax.tree.map(lambda spec, sh: P.abstract_leaf(spec, COMPUTE_DTYPE, sh), specs, shardings,
                        is_leaf=lambda x: isinstance(x, P.ParamSpec))


def drafter_params(specs, mesh, weights: str, rules=None):
    q = quantized_specs(specs, weights)
    return abstract_tree(q, parallel.drafter_shardings(q, mesh, rules))


def target_params(config: ModelConfig, mesh, weights: str, rules=None) -> dict:
    """Abstract target parameters of `config` in format `weights`, placed by `parallel.param_shardings`."""
    rule = lambda path, spec: leaf_format(weights, path, spec)
    return abstract_tree(quantized_specs(P.param_specs(config), weights),
                         parallel.param_shardings(config, mesh, rules, formats=rule))


def mtp_params(config: ModelConfig, mesh, weights: str, rules=None) -> list:
    return [drafter_params(P.mtp_specs(config), mesh, weights, rules)]


def dspark_params(config: ModelConfig, mesh, weights: str, rules=None) -> dict:
    return drafter_params(dspark_specs(config), mesh, weights, rules)


def dspark_specs(config: ModelConfig):
    rank = DSPARK_MARKOV_RANK if config.hidden_size >= 1024 else 8
    return P.dspark_specs(config, DSPARK_STAGES, DSPARK_TAPS, rank, False)


def decode_state(config: ModelConfig, mesh, batch: int, max_len: int, max_block: int, rules=None):
    """The target's DecodeState (bf16 caches) for `batch` sequences of capacity `max_len`."""
    shapes = state_shapes(config, batch, max_len, max_block, COMPUTE_DTYPE)
    shard = parallel.state_shardings(config, mesh, batch, max_len, max_block, COMPUTE_DTYPE, rules)
    return jax.tree.map(lambda s, sh: sds(s.shape, s.dtype, sh), shapes, shard)


def batch_split(mesh, shape, batch_axis: int = 0, rules=None) -> NamedSharding:
    """A NamedSharding splitting axis `batch_axis` of `shape` by the `batch` rule (replicated otherwise)."""
    axes = [None] * len(shape)
    if len(shape) > batch_axis:
        axes[batch_axis] = "batch"
    return NamedSharding(mesh, parallel.partition_spec(shape, axes, parallel.mesh_sizes(mesh), rules))


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
