"""The kernels lower through the Pallas Triton GPU path (cross-lowering from CPU; nothing runs).

Catches GPU-only constraints that interpret mode ignores (power-of-two tensor shapes, unsupported ops).
"""
import warnings

import jax
import jax.numpy as jnp
import pytest

from dsv4_jax.kernels import lightning_indexer as li
from dsv4_jax.kernels import moe_decode, moe_prefill, routing
from dsv4_jax.ops import quant
from dsv4_jax.ops.moe import Router

S = jax.ShapeDtypeStruct
E, I, D, K = 16, 64, 128, 6


def _lowers_to_triton(fn, *args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        text = jax.jit(lambda *a: fn(*a, **kw)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text.lower()


def _experts(fmt):
    """Abstract expert weights: bf16 arrays (fmt None) or QArrays of ShapeDtypeStructs."""
    shapes = {n: (E, I, D) if n != "w2" else (E, D, I) for n in ("w1", "w2", "w3")}
    if fmt is None:
        return {n: S(s, jnp.bfloat16) for n, s in shapes.items()}
    return {n: quant.abstract(fmt, s, jnp.bfloat16) for n, s in shapes.items()}


@pytest.mark.parametrize("fmt", [None, quant.QFormat("e4m3", (32, 32), "f32"), quant.FP8, quant.FP4, quant.Q8_0,
                                 quant.INT8], ids=lambda f: "bf16" if f is None else f.name)
@pytest.mark.parametrize("mod", [moe_decode.experts_decode, moe_prefill.experts_prefill])
def test_moe_lowers(fmt, mod):
    _lowers_to_triton(mod, S((3, D), jnp.bfloat16), S((3, K), jnp.int32), S((3, K), jnp.float32),
                      _experts(fmt), limit=10.0, interpret=False)


@pytest.mark.parametrize("hashed", [False, True])
def test_routing_lowers(hashed):
    bias, hid = (None, S((4, K), jnp.int32)) if hashed else (S((E,), jnp.float32), None)
    _lowers_to_triton(routing.route_from_logits, S((4, E), jnp.float32), bias, hid, router=Router(K, True, 1e-20, 1.5),
                      interpret=False)


def test_indexer_lowers():
    _lowers_to_triton(li.scores, S((1, 3, 16, 32), jnp.bfloat16), S((1, 256, 32), jnp.bfloat16),
                      S((1, 3, 16), jnp.float32), S((1, 3), jnp.int32), S((1,), jnp.int32), ratio=4, interpret=False)
