"""The Pallas GPU (Triton) kernels compiled and run on a GPU (interpret=False) against the jnp references.

Marked `gpu`: deselected by default (pyproject addopts), skipped if selected without a GPU. conftest defaults to the CPU, so name the platform and run
one process (each pytest-xdist worker would reserve the GPU's memory):

    JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false python -m pytest -o addopts="" -q tests/test_kernels_gpu.py

The interpret-mode tests (test_kernels_{moe,routing,indexer}.py) check the same math on the CPU; these catch
what only the Triton compiler sees (tensor shapes, dot sizes, unsupported ops) and its numerics. The
references run with float32 matmul precision "highest" (XLA:GPU's default float32 dot is tf32).
`DSV4_GPU_TESTS_ON_CPU=1` runs them on the CPU in interpret mode (a check of the tests themselves).
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax.backends import Backends
from dsv4_jax.config import HASH_MOE, MOE, tiny
from dsv4_jax.kernels import lightning_indexer as li
from dsv4_jax.kernels import moe_decode, moe_prefill, routing
from dsv4_jax.model.layers import moe as moe_mod
from dsv4_jax.ops import quant
from dsv4_jax.ops.moe import Router

from .test_kernels_indexer import _case as _idx_case
from .test_kernels_indexer import _scores_ref
from .test_kernels_moe import LIMIT, _case, _close, _gather_ref, _moe_layer_params, _sorted_ref
from .test_kernels_routing import _gate

ON_CPU = os.environ.get("DSV4_GPU_TESTS_ON_CPU") == "1"      # interpret mode: checks the tests, not Triton
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(jax.default_backend() != "gpu" and not ON_CPU,
                                reason="needs a GPU (JAX_PLATFORMS=cuda)")]

GPU = Backends(moe="pallas", routing="pallas", indexer="pallas", interpret=ON_CPU)


def _highest(fn, *args):
    with jax.default_matmul_precision("highest"):
        return fn(*args)


def _written(out):
    """Every element finite (outputs start as uninitialised device memory: NaN / garbage shows up here)."""
    assert np.isfinite(np.asarray(out, np.float32)).all()


# ---- MoE decode (GEMV tiles, active experts only) -----------------------------------------------------

@pytest.mark.parametrize("T,E,k,D,I,dtype,blocks", [
    (1, 16, 6, 64, 32, jnp.float32, (8, 16, 8, 16)),
    (3, 12, 4, 40, 24, jnp.bfloat16, (8, 16, 8, 16)),
    (8, 9, 2, 48, 40, jnp.float32, (8, 16, 8, 16)),
    (1, 256, 6, 512, 256, jnp.bfloat16, (16, 256, 16, 256)),      # the default blocks at Flash's E, k
    (8, 256, 6, 512, 256, jnp.bfloat16, (8, 512, 8, 512)),
])
def test_decode_gpu(T, E, k, D, I, dtype, blocks):
    x, idx, w, p = _case(T, E, k, D, I, dtype, seed=T + E)
    out = moe_decode.experts_decode(x, idx, w, p, limit=LIMIT, interpret=ON_CPU, blocks=blocks)
    _written(out)
    _close(out, _highest(_gather_ref, x, idx, w, p), dtype)


# ---- MoE prefill (grouped matmul over expert-pure row tiles: Triton dots need every side >= 16) ---------

@pytest.mark.parametrize("T,E,k,D,I,dtype", [(13, 12, 2, 64, 32, jnp.bfloat16), (64, 7, 3, 32, 16, jnp.float32),
                                             (1, 16, 6, 64, 32, jnp.float32), (20, 256, 6, 64, 32, jnp.bfloat16)])
def test_prefill_gpu(T, E, k, D, I, dtype):
    x, idx, w, p = _case(T, E, k, D, I, dtype, seed=T * E)
    out = moe_prefill.experts_prefill(x, idx, w, p, limit=LIMIT, interpret=ON_CPU, blocks=(16, 16, 16))
    _written(out)
    _close(out, _highest(_sorted_ref, x, idx, w, p), dtype)


def test_prefill_default_blocks_gpu():
    x, idx, w, p = _case(40, 32, 6, 256, 128, jnp.bfloat16, seed=3)
    out = moe_prefill.experts_prefill(x, idx, w, p, limit=LIMIT, interpret=ON_CPU)
    _close(out, _highest(_sorted_ref, x, idx, w, p), jnp.bfloat16)


# ---- quantized experts (codes + block scales decoded in the tile) --------------------------------------

FMTS = [quant.QFormat("e4m3", (32, 32), "f32"), quant.FP8, quant.FP4, quant.Q8_0, quant.INT8]


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.name)
@pytest.mark.parametrize("path", ["decode", "prefill"])
def test_quantized_gpu(fmt, path):
    T = 3 if path == "decode" else 20
    x, idx, w, p = _case(T, 16, 6, 128, 64, jnp.bfloat16, seed=11)
    q = {n: quant.quantize(m, fmt) for n, m in p.items()}
    if path == "decode":
        out = moe_decode.experts_decode(x, idx, w, q, limit=LIMIT, interpret=ON_CPU)
    else:
        out = moe_prefill.experts_prefill(x, idx, w, q, limit=LIMIT, interpret=ON_CPU)
    _written(out)
    _close(out, _highest(_gather_ref, x, idx, w, q), jnp.bfloat16)


# ---- routing ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("T,E,k,dtype", [(1, 8, 1, jnp.float32), (5, 12, 3, jnp.bfloat16),
                                         (16, 256, 6, jnp.bfloat16), (33, 40, 6, jnp.float32)])
@pytest.mark.parametrize("mlp_type", [MOE, HASH_MOE])
def test_route_gpu(T, E, k, dtype, mlp_type):
    cfg = tiny().replace(n_routed_experts=E, num_experts_per_tok=k, hidden_size=32)
    p = _gate(E, 32, k, cfg.vocab_size, T + E, dtype)
    x = jax.random.normal(jax.random.key(T), (T, 32), dtype)
    tokens = jax.random.randint(jax.random.key(E), (T,), 0, cfg.vocab_size)
    idx, w = _highest(lambda: moe_mod.route(x, tokens, p, cfg.with_backends(GPU), mlp_type))
    ridx, rw = _highest(lambda: moe_mod.route(x, tokens, p, cfg, mlp_type))
    np.testing.assert_array_equal(idx, ridx)        # softplus / sqrt may differ by an ulp: no near-ties here
    np.testing.assert_allclose(w, rw, rtol=1e-5, atol=1e-6)


def test_route_ties_gpu():
    idx, _ = routing.route_from_logits(jnp.zeros((2, 10), jnp.float32), jnp.zeros((10,)), None,
                                       router=Router(4, True, 1e-20, 1.0), interpret=ON_CPU)
    np.testing.assert_array_equal(idx, [[0, 1, 2, 3]] * 2)


# ---- lightning indexer scores -------------------------------------------------------------------------

@pytest.mark.parametrize("B,S,T,H,d,dtype", [(1, 1, 37, 16, 32, jnp.float32), (2, 5, 64, 16, 32, jnp.bfloat16),
                                             (1, 6, 300, 64, 128, jnp.bfloat16), (1, 2, 24, 8, 16, jnp.float32)])
def test_indexer_scores_gpu(B, S, T, H, d, dtype):
    q, keys, omega, pos = _idx_case(B, S, T, H, d, dtype, seed=S + H)
    n_rows = jnp.array([T - 3] * B)
    out = li.scores(q, keys, omega, pos, n_rows, ratio=4, interpret=ON_CPU)
    ref = _highest(lambda: _scores_ref(q, keys, omega, pos, n_rows, ratio=4))
    out, ref = np.asarray(out), np.asarray(ref)
    np.testing.assert_array_equal(np.isfinite(out), np.isfinite(ref))
    fin = np.isfinite(ref)
    scale = max(1.0, float(np.abs(np.where(fin, ref, 0)).max()))
    np.testing.assert_allclose(np.where(fin, out, 0), np.where(fin, ref, 0), rtol=1e-4, atol=1e-5 * scale)


# ---- the model with every GPU kernel on (what backends "auto" resolves to on a GPU) ---------------------

@pytest.mark.parametrize("S", [1, 12])   # 1 token -> decode kernel, 12 -> prefill kernel
def test_model_moe_gpu_in_while_loop(S):
    cfg = tiny()
    layer = _moe_layer_params(cfg)
    h0 = jax.random.normal(jax.random.key(1), (1, S, cfg.hidden_size))
    tokens = jnp.arange(S)[None] % cfg.vocab_size

    def run(backends):
        c_impl = cfg.with_backends(backends)

        def body(c):
            i, h = c
            return i + 1, moe_mod.moe(h, tokens, layer, c_impl, "moe") * 0.5 + h
        return jax.jit(lambda h: jax.lax.while_loop(lambda c: c[0] < 2, body, (0, h))[1])(h0)

    _close(run(GPU), _highest(run, Backends()), jnp.float32)


def test_forward_auto_equals_reference_gpu():
    """`forward` on the tiny model: backends "auto" (every Pallas kernel on a GPU) vs the references."""
    from dsv4_jax import forward, init_params
    from dsv4_jax.backends import resolve
    if not ON_CPU:
        assert resolve("auto").moe == "pallas" and not resolve("auto").interpret
    cfg = tiny()
    params = init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 24), 0, cfg.vocab_size)
    out = forward(params, cfg, tokens, backends=GPU if ON_CPU else "auto")
    ref = _highest(lambda: forward(params, cfg, tokens, backends="reference"))
    _written(out)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=2e-2,
                               atol=2e-2 * float(np.abs(np.asarray(ref, np.float32)).max()))
