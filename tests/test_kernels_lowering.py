"""The kernels lower through the Pallas Triton GPU path (cross-lowering from CPU; nothing runs).

Catches GPU-only constraints that interpret mode ignores (power-of-two tensor shapes, unsupported ops).
"""
import warnings

import jax
import jax.numpy as jnp
import pytest

from dsv4_jax.kernels import lightning_indexer as li
from dsv4_jax.kernels import moe_decode, moe_prefill, routing

S = jax.ShapeDtypeStruct
E, I, D, K = 16, 64, 128, 6


def _lowers_to_triton(fn, *args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        text = jax.jit(lambda *a: fn(*a, **kw)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text.lower()


def _experts(dtype, scales):
    p = {n: S((E, I, D) if n != "w2" else (E, D, I), dtype) for n in ("w1", "w2", "w3")}
    if scales:
        p.update({"w1_scale": S((E, I // 32, D // 32), jnp.float32), "w3_scale": S((E, I // 32, D // 32), jnp.float32),
                  "w2_scale": S((E, D // 32, I // 32), jnp.float32)})
    return p


@pytest.mark.parametrize("dtype,scales", [(jnp.bfloat16, False), (jnp.float8_e4m3fn, True), (jnp.int8, True)])
@pytest.mark.parametrize("mod", [moe_decode.experts_decode, moe_prefill.experts_prefill])
def test_moe_lowers(dtype, scales, mod):
    _lowers_to_triton(mod, S((3, D), jnp.bfloat16), S((3, K), jnp.int32), S((3, K), jnp.float32),
                      _experts(dtype, scales), limit=10.0, interpret=False)


@pytest.mark.parametrize("hashed", [False, True])
def test_routing_lowers(hashed):
    bias, hid = (None, S((4, K), jnp.int32)) if hashed else (S((E,), jnp.float32), None)
    _lowers_to_triton(routing.route_from_logits, S((4, E), jnp.float32), bias, hid, k=K, norm=True, eps=1e-20,
                      scale=1.5, interpret=False)


def test_indexer_lowers():
    _lowers_to_triton(li.scores, S((1, 3, 16, 32), jnp.bfloat16), S((1, 256, 32), jnp.bfloat16),
                      S((1, 3, 16), jnp.float32), S((1, 3), jnp.int32), S((1,), jnp.int32), ratio=4, interpret=False)
