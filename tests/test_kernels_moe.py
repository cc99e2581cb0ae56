"""MoE expert kernels (decode: active experts only; prefill: grouped matmul) vs the jnp references (ops.moe)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax.model import params as params_mod
from dsv4_jax.backends import Backends
from dsv4_jax.config import tiny
from dsv4_jax.kernels import moe_decode, moe_prefill
from dsv4_jax.model.layers import moe as moe_mod
from dsv4_jax.ops import moe as ops_moe
from dsv4_jax.ops import quant

LIMIT = 2.0   # small, so the clamps are active on random data


def _case(T, E, k, D, I, dtype, seed=0, same_expert=False):
    ks = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(ks[0], (T, D), dtype)
    p = {"w1": (jax.random.normal(ks[1], (E, I, D)) * 0.4).astype(dtype),
         "w3": (jax.random.normal(ks[2], (E, I, D)) * 0.4).astype(dtype),
         "w2": (jax.random.normal(ks[3], (E, D, I)) * 0.4).astype(dtype)}
    idx = jnp.argsort(jax.random.uniform(ks[4], (T, E)), axis=-1)[:, :k].astype(jnp.int32)
    if same_expert:
        idx = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (T, k))
    w = jax.random.uniform(ks[5], (T, k), minval=0.1, maxval=1.0)
    return x, idx, w, p


def _dense(p, dtype):
    """Expert weights dequantized to dense arrays (the reference the kernels are checked against)."""
    return {n: quant.dense(m, dtype) for n, m in p.items()}


def _gather_ref(x, idx, w, p):
    e = _dense(p, x.dtype)
    return ops_moe.experts_gather(x, idx, w, e["w1"], e["w2"], e["w3"], LIMIT)


def _sorted_ref(x, idx, w, p):
    e = _dense(p, x.dtype)
    return ops_moe.experts_sorted(x, idx, w, e["w1"], e["w2"], e["w3"], LIMIT)


def _close(a, b, dtype):
    tol = 1e-4 if dtype == jnp.float32 else 4e-2
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol * max(1.0, np.abs(b).max()))


DECODE_CASES = [(1, 16, 6, 64, 32, jnp.float32), (3, 12, 4, 40, 24, jnp.bfloat16),
                pytest.param(8, 9, 2, 48, 40, jnp.float32, marks=pytest.mark.slow)]


@pytest.mark.parametrize("T,E,k,D,I,dtype", DECODE_CASES)
def test_decode_matches_reference(T, E, k, D, I, dtype):
    x, idx, w, p = _case(T, E, k, D, I, dtype, seed=T + E)
    out = moe_decode.experts_decode(x, idx, w, p, limit=LIMIT, interpret=True, blocks=(8, 16, 8, 16))
    _close(out, _gather_ref(x, idx, w, p), dtype)


PREFILL_CASES = [(13, 12, 2, 40, 24, jnp.bfloat16), (64, 7, 3, 32, 16, jnp.float32),
                 pytest.param(1, 16, 6, 64, 32, jnp.float32, marks=pytest.mark.slow),
                 pytest.param(20, 256, 6, 32, 16, jnp.bfloat16, marks=pytest.mark.slow)]


@pytest.mark.parametrize("T,E,k,D,I,dtype", PREFILL_CASES)
def test_prefill_matches_reference(T, E, k, D, I, dtype):
    x, idx, w, p = _case(T, E, k, D, I, dtype, seed=T * E)
    out = moe_prefill.experts_prefill(x, idx, w, p, limit=LIMIT, interpret=True, blocks=(8, 16, 16))
    _close(out, _sorted_ref(x, idx, w, p), dtype)


def test_prefill_one_full_group_and_empty_groups():
    x, idx, w, p = _case(24, 10, 3, 32, 16, jnp.float32, same_expert=True)   # experts 3..9 get nothing
    out = moe_prefill.experts_prefill(x, idx, w, p, limit=LIMIT, interpret=True, blocks=(16, 16, 16))
    _close(out, _sorted_ref(x, idx, w, p), jnp.float32)


def test_align_layout():
    idx = jnp.array([[2, 0], [2, 1], [2, 0]], jnp.int32)
    row_token, dest, tile_expert, n_used = moe_prefill.align(idx, 4, 2)
    assert row_token.shape[0] == moe_prefill.padded_rows(6, 4, 2)
    # expert 0: a=1,5 -> rows 0,1 ; expert 1: a=3 -> row 2 (+pad) ; expert 2: a=0,2,4 -> rows 4,5,6 (+pad)
    np.testing.assert_array_equal(dest, [4, 0, 5, 2, 6, 1])
    np.testing.assert_array_equal(tile_expert[:4], [0, 1, 2, 2])
    assert int(n_used[0]) == 4
    np.testing.assert_array_equal(np.asarray(row_token)[[0, 1, 2, 4, 5, 6]], [0, 2, 1, 0, 1, 2])


FP8_F32_8x16 = quant.QFormat("e4m3", (8, 16), "f32")
INT8_F32_16x8 = quant.QFormat("int8", (16, 8), "f32")


@pytest.mark.parametrize("fmt,path", [(quant.INT8, "decode"), (FP8_F32_8x16, "prefill"), (quant.FP4, "decode"),
                                      (quant.FP4, "prefill"), pytest.param(quant.Q8_0, "prefill", marks=pytest.mark.slow),
                                      pytest.param(quant.FP8, "decode", marks=pytest.mark.slow),
                                      pytest.param(FP8_F32_8x16, "decode", marks=pytest.mark.slow),
                                      pytest.param(INT8_F32_16x8, "prefill", marks=pytest.mark.slow)],
                         ids=lambda v: getattr(v, "name", v))
def test_quantized_matches_dequantized_reference(fmt, path):
    """QArray experts (codes + scales) in the kernels == the dequantized weights in the jnp reference."""
    x, idx, w, p = _case(3, 6, 2, 32, 32, jnp.bfloat16, seed=7)
    q = {n: quant.quantize(m, fmt) for n, m in p.items()}
    assert q["w1"].codes.dtype.itemsize == 1 and q["w1"].fmt == fmt
    if path == "decode":
        out = moe_decode.experts_decode(x, idx, w, q, limit=LIMIT, interpret=True, blocks=(8, 32, 8, 32))
    else:
        out = moe_prefill.experts_prefill(x, idx, w, q, limit=LIMIT, interpret=True, blocks=(16, 32, 32))
    _close(out, _gather_ref(x, idx, w, q), jnp.bfloat16)


def test_quantize_roundtrip_error_is_small():
    wt = jax.random.normal(jax.random.key(0), (3, 32, 64))
    for fmt, tol in ((INT8_F32_16x8, 0.02), (FP8_F32_8x16, 0.1), (quant.FP4, 0.3), (quant.Q8_0, 0.02)):
        rel = jnp.abs(quant.dequantize(quant.quantize(wt, fmt)) - wt).max() / jnp.abs(wt).max()
        assert float(rel) < tol, (fmt, float(rel))


@pytest.mark.parametrize("S", [1, 12])   # 1 token -> decode kernel, 12 -> prefill kernel
def test_model_moe_pallas_equals_reference_in_while_loop(S):
    cfg = tiny()
    layer = _moe_layer_params(cfg)
    h0 = jax.random.normal(jax.random.key(1), (1, S, cfg.hidden_size))
    tokens = jnp.arange(S)[None] % cfg.vocab_size

    def run(impl):
        c_impl = cfg.with_backends(Backends(moe=impl, routing=impl, interpret=True))

        def body(c):
            i, h = c
            return i + 1, moe_mod.moe(h, tokens, layer, c_impl, "moe") * 0.5 + h
        return jax.jit(lambda h: jax.lax.while_loop(lambda c: c[0] < 2, body, (0, h))[1])(h0)

    _close(run("pallas"), run("reference"), jnp.float32)


def _moe_layer_params(cfg):
    """Random score-routed MoE layer parameters with the shapes of `params.moe_specs`."""
    specs = params_mod.moe_specs(cfg, "moe")
    leaves, tree = jax.tree.flatten(specs, is_leaf=params_mod._is_spec)
    keys = jax.random.split(jax.random.key(3), len(leaves))
    vals = [jax.random.normal(kk, sp.shape) * (0.1 if len(sp.shape) == 1 else 0.3) for kk, sp in zip(keys, leaves)]
    return jax.tree.unflatten(tree, vals)
