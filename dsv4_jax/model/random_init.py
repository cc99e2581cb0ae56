"""Random parameter trees made on the device (jax.random), for benchmarks at sizes the host cannot hold.

`params.init_params` draws on the host with numpy (tests: fast, small); here every leaf is drawn by a
jitted jax.random call straight into device memory, with the same distributions (norms ~ 1 ± 0.1,
embedding ~ N(0, 1), matrices ~ N(0, 1/fan_in), vectors ~ N(0, 0.5), HC scales ~ U(0.5, 1.5), router
bias ~ N(0, 0.1), tid2eid distinct experts per token). One compilation per distinct (shape, dtype, kind).

Routed experts can be made in the kernels' FP8 storage (`expert_format="fp8"`, see `ops.quant`): codes
float8_e4m3fn ~ N(0, 1) with a float32 scale 1/sqrt(fan_in) per 128×128 block (smaller blocks when a
dimension is below 128), held as `ops.quant.QArray` leaves that the MoE kernels read tile by tile.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from . import params as P
from ..ops import quant
from ..config import ModelConfig

EXPERT_FORMATS = ("dense", "fp8")
FP8_BLOCK = 128
# (scale, shift) of a normal draw per ParamSpec.init kind; "matrix" (default) is N(0, 1/fan_in)
_NORMAL = {"norm": (0.1, 1.0), "embed": (1.0, 0.0), "vector": (0.5, 0.0), "bias": (0.1, 0.0), "codes": (1.0, 0.0)}


def _normal(key, shape, dtype):
    """N(0, 1) in dtype; arrays with leading axes are drawn per [.., N, K] matrix (keeps each draw < 2^31)."""
    if len(shape) <= 2:
        return jax.random.normal(key, shape, dtype)
    keys = jax.random.split(key, math.prod(shape[:-2]))
    return jax.vmap(lambda k: jax.random.normal(k, shape[-2:], dtype))(keys).reshape(shape)


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "init", "n_experts", "top_k"))
def random_leaf(key, shape: tuple[int, ...], dtype, init: str, n_experts: int = 0, top_k: int = 0) -> jax.Array:
    """One leaf of ParamSpec.init kind `init` ("codes": N(0, 1) FP8 codes), drawn on the device."""
    if init == "tid2eid":
        noise = jax.random.uniform(key, shape[:-1] + (n_experts,))
        return jnp.argsort(noise, axis=-1)[..., :top_k].astype(jnp.int32)
    gen = dtype if jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize >= 2 else jnp.bfloat16
    if init == "hc_scale":
        return (0.5 + jax.random.uniform(key, shape, gen)).astype(dtype)
    scale, shift = _NORMAL.get(init, (1.0 / math.sqrt(shape[-1]), 0.0))
    return (_normal(key, shape, gen) * scale + shift).astype(dtype)


def random_experts(key, specs: dict, dtype=jnp.bfloat16, expert_format: str = "dense") -> dict:
    """Routed experts {"w1", "w2", "w3"} [E, N, K] ("dense": dtype), or `QArray`s of FP8 codes [E, N, K] and a
    float32 scale [E, N/br, K/bc] with (br, bc) = (min(128, N), min(128, K)), dequantizing to dtype."""
    if expert_format not in EXPERT_FORMATS:
        raise ValueError(f"unknown expert format {expert_format!r}; choose from {EXPERT_FORMATS}")
    out = {}
    for i, name in enumerate(("w1", "w2", "w3")):
        *lead, N, K = shape = tuple(specs[name].shape)
        k = jax.random.fold_in(key, i)
        if expert_format == "dense":
            out[name] = random_leaf(k, shape, jnp.dtype(dtype), specs[name].init)
            continue
        br, bc = min(FP8_BLOCK, N), min(FP8_BLOCK, K)
        codes = random_leaf(k, shape, jnp.dtype(jnp.float8_e4m3fn), "codes")
        scale = jnp.full((*lead, N // br, K // bc), 1.0 / math.sqrt(K), jnp.float32)
        out[name] = quant.QArray(codes, scale, quant.QFormat("e4m3", (br, bc), "f32"), jnp.dtype(dtype))
    return out


def random_tree(specs, config: ModelConfig, key, dtype=jnp.bfloat16, expert_format: str = "dense",
                experts: dict | None = None):
    """A random tree for a ParamSpec tree (leaf i drawn from fold_in(key, i), in traversal order).

    experts: a routed-expert tree used for every `ffn.experts` subtree instead of drawing one (drafter
    blocks that share one set of buffers, to fit a benchmark in memory)."""
    counter = [0]

    def build(node, name):
        counter[0] += 1
        k = jax.random.fold_in(key, counter[0])
        if isinstance(node, P.ParamSpec):
            return random_leaf(k, tuple(node.shape), jnp.dtype(node.dtype(dtype)), node.init,
                               config.n_routed_experts, config.num_experts_per_tok)
        if isinstance(node, list):
            return [build(v, name) for v in node]
        if name == "experts":
            return experts if experts is not None else random_experts(k, node, dtype, expert_format)
        return {n: build(v, n) for n, v in node.items()}

    return build(specs, "")


def random_params_on_device(config: ModelConfig, key, dtype=jnp.bfloat16, expert_format: str = "dense") -> dict:
    """Random target parameters (the `params.param_specs` tree) drawn on the default device."""
    return random_tree(P.param_specs(config), config, key, dtype, expert_format)
