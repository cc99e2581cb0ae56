"""GPU MoE kernels inside a scanned segment read the segment's stacked experts in place (`moe.StackedExperts`).

A scan's per-layer slice of the experts was materialised before the kernel's custom call: on an H200 that was
a 4 GiB copy per Flash expert weight and layer (experiments/results/h200_2026-12-04.md). Checked here on the
CPU: the "pallas" program slices no per-layer expert stack, and its logits equal the reference's (interpret
mode; 5 tokens take the decode kernel, 12 the prefill kernel, both with ids offset into the stack).
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax import forward, init_params
from dsv4_jax.backends import Backends
from dsv4_jax.config import tiny_flash_like
from dsv4_jax.model.target import forward_jit
from dsv4_jax.model.schedule import segments

PALLAS = Backends(moe="pallas", interpret=True)


def test_no_per_layer_expert_slice():
    cfg = tiny_flash_like()
    assert any(s.reps > 1 for s in segments(cfg))
    params = jax.eval_shape(lambda: init_params(cfg, 0))
    tok = jax.ShapeDtypeStruct((1, 5), jnp.int32)
    E, I, D = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    pat = re.compile(r"stablehlo.dynamic_slice.*-> tensor<1x%dx(%dx%d|%dx%d)x" % (E, I, D, D, I))

    def slices(b):
        return len(pat.findall(jax.jit(forward_jit, static_argnums=1).lower(params, cfg.with_backends(b), tok).as_text()))

    assert slices(Backends()) > 0          # the reference gathers from the per-layer slice (fused on GPU)
    assert slices(PALLAS) == 0


@pytest.mark.parametrize("S", [5, pytest.param(12, marks=pytest.mark.slow)])
def test_scanned_pallas_equals_reference(S):
    cfg = tiny_flash_like()
    params = init_params(cfg, 0)
    tok = jax.random.randint(jax.random.key(1), (1, S), 0, cfg.vocab_size)
    ref = np.asarray(forward(params, cfg, tok, backends="reference"))
    out = np.asarray(forward(params, cfg, tok, backends=PALLAS))
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_sinkhorn_unrolled_equals_rolled():
    """The GPU choice (Backends.unroll_sinkhorn) changes the program, not the numbers (float32, 1e-6)."""
    from dsv4_jax.model.layers.hyper import sinkhorn
    logits = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 4, 4), jnp.float32)
    rolled = sinkhorn(logits, 20, 1e-6)
    unrolled = sinkhorn(logits, 20, 1e-6, unroll=True)
    np.testing.assert_allclose(np.asarray(unrolled), np.asarray(rolled), rtol=0, atol=1e-6)
    assert jnp.abs(rolled.sum(-1) - 1).max() < 1e-3 and jnp.abs(rolled.sum(-2) - 1).max() < 1e-3   # doubly stochastic


def _ep(cfg, local: str):
    """The latency preset on this host's one device with `local` as the EP local matmul (the Mosaic kernels
    run interpreted on the CPU)."""
    import dataclasses
    from dsv4_jax import parallel
    pre = dataclasses.replace(parallel.preset("latency"), local=local)
    return pre.apply(cfg, parallel.make_mesh((1, 1, 1)))


def test_ep_mosaic_local_reads_the_stack_in_place():
    """Expert parallelism with the Mosaic kernels as its local matmul (`ExpertParallel.local="pallas_tpu"`):
    the scanned segments hand the shard_map their whole expert stacks and the layer index (no per-layer
    slice of a stack is taken, where the reference EP local matmul takes one per layer), and the logits
    equal the reference model's (decode-kernel sizes: 5 tokens; float32, 1e-4 of the largest logit — the
    kernels' tolerance in tests/test_kernels_tpu.py)."""
    cfg = tiny_flash_like().replace(hidden_size=128, moe_intermediate_size=128)   # the kernels' 128-wide tiles
    kcfg = _ep(cfg, "pallas_tpu")
    assert any(s.reps > 1 for s in segments(cfg)) and kcfg.backends.ep.local == "pallas_tpu"
    E, I, D = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    pat = re.compile(r"stablehlo.dynamic_slice.*-> tensor<1x%dx(%dx%d|%dx%d)x" % (E, I, D, D, I))
    shapes = jax.eval_shape(lambda: init_params(cfg, 0))
    tok_shape = jax.ShapeDtypeStruct((1, 5), jnp.int32)
    lowered = lambda c: jax.jit(forward_jit, static_argnums=1).lower(shapes, c, tok_shape).as_text()
    ref_ep = _ep(cfg, "reference")
    assert len(pat.findall(lowered(ref_ep))) > 0 and len(pat.findall(lowered(kcfg))) == 0
    params = init_params(cfg, 0)
    tok = jax.random.randint(jax.random.key(1), (1, 5), 0, cfg.vocab_size)
    ref = np.asarray(forward(params, cfg, tok, backends="reference"))
    out = np.asarray(forward(params, kcfg, tok, backends=kcfg.backends))
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
