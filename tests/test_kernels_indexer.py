"""Lightning-indexer kernel (interpret mode) and the exact two-stage top-k vs the references (ops.indexer)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax.backends import Backends
from dsv4_jax.config import tiny
from dsv4_jax.kernels import lightning_indexer as li
from dsv4_jax.model.layers import indexer as model_indexer
from dsv4_jax.ops import indexer as ops

PALLAS = Backends(indexer="pallas", interpret=True)


def _scores_ref(q, keys, omega, positions=None, n_rows=None, ratio=1):
    sc = ops.scores(q, keys, omega)
    return jnp.where(ops.validity(sc.shape, positions, n_rows, ratio), sc, -jnp.inf)


def _case(B, S, T, H, d, dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (B, S, H, d), dtype)
    keys = jax.random.normal(ks[1], (B, T, d), dtype)
    keys = keys.at[:, 2].set(-jnp.abs(keys[:, 2]) * 0 - q[:, 0].astype(jnp.float32).sum(1).astype(dtype))
    omega = jax.random.normal(ks[2], (B, S, H))
    positions = jax.random.randint(ks[3], (B, S), 0, 4 * T + 8)
    return q, keys, omega, positions


@pytest.mark.parametrize("B,S,T,H,d,dtype", [(1, 1, 37, 8, 16, jnp.float32), (2, 5, 64, 8, 32, jnp.bfloat16),
                                             pytest.param(1, 12, 150, 16, 16, jnp.float32, marks=pytest.mark.slow)])
def test_scores_match_reference(B, S, T, H, d, dtype):
    q, keys, omega, pos = _case(B, S, T, H, d, dtype, seed=S)
    n_rows = jnp.array([T - 3] * B)
    out = li.scores(q, keys, omega, pos, n_rows, ratio=4, interpret=True, blocks=(4, 32))
    ref = _scores_ref(q, keys, omega, pos, n_rows, ratio=4)
    np.testing.assert_array_equal(np.isfinite(out), np.isfinite(ref))
    fin = np.isfinite(ref)
    np.testing.assert_allclose(np.where(fin, out, 0), np.where(fin, ref, 0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k", [1, 3, 6, 40])
@pytest.mark.parametrize("chunk", [8, 64, 4096])
def test_two_stage_topk_is_exact_with_ties(k, chunk):
    # integer-valued scores: many exact ties; some rows invalid (-inf); fewer valid than k in one query
    vals = jax.random.randint(jax.random.key(k), (2, 3, 100), 0, 5).astype(jnp.float32)
    valid = jax.random.uniform(jax.random.key(k + 1), (2, 3, 100)) < 0.7
    valid = valid.at[1, 2].set(jnp.arange(100) < 4)
    ref = jax.lax.top_k(jnp.where(valid, vals, -jnp.inf), k)[1]                   # one-stage lax.top_k
    ref = jnp.zeros(vals.shape, bool).at[jnp.arange(2)[:, None, None], jnp.arange(3)[None, :, None], ref].set(True)
    out = ops.topk_mask(jnp.where(valid, vals, -jnp.inf), k, chunk=chunk)
    ref = ref & valid
    np.testing.assert_array_equal(out, ref)


def test_select_matches_reference_decode_and_prefill():
    cfg = tiny().replace(index_topk=5)
    H, d = cfg.index_n_heads, cfg.index_head_dim
    p = {"weights_proj": jax.random.normal(jax.random.key(5), (H, cfg.hidden_size)) * 0.3}
    for S, n_rows in ((1, None), (16, jnp.array([40]))):   # decode 1..k+1, prefill
        q, keys, _, _ = _case(1, S, 48, H, d, jnp.float32, seed=S)
        h = jax.random.normal(jax.random.key(S), (1, S, cfg.hidden_size))
        pos = jnp.arange(100, 100 + S)[None] if S < 16 else jnp.arange(0, 12 * S, 12)[None]
        ref = model_indexer.select_mask(q, keys, h, p, cfg, pos, 4, n_rows)
        out = model_indexer.select_mask(q, keys, h, p, cfg.with_backends(PALLAS), pos, 4, n_rows)
        np.testing.assert_array_equal(out, ref)
        ref_idx, ref_found = model_indexer.select(q, keys, h, p, cfg, pos, 4, n_rows)
        idx, found = model_indexer.select(q, keys, h, p, cfg.with_backends(PALLAS), pos, 4, n_rows)
        np.testing.assert_array_equal(found, ref_found)
        np.testing.assert_array_equal(np.where(found, idx, -1), np.where(ref_found, ref_idx, -1))


def test_zero_ties_dead_rows_ordered_like_reference():
    # every head's dot is negative for rows 10..: those rows score exactly 0 and tie; lower index must win
    H, d = 8, 16
    q = jnp.ones((1, 1, H, d))
    keys = jnp.concatenate([jax.random.uniform(jax.random.key(0), (1, 10, d)), -jnp.ones((1, 30, d))], axis=1)
    omega = jnp.concatenate([-jnp.ones((1, 1, 4)), jnp.ones((1, 1, 4))], axis=2) * 0.5
    masked = li.scores(q, keys, omega, interpret=True)
    ref = _scores_ref(q, keys, omega)
    for k in (12, 20):
        np.testing.assert_array_equal(ops.topk_mask(masked, k, chunk=8),
                                      ops.select_topk(ref, jnp.ones_like(ref, bool), k))


def test_model_hooks_and_while_loop():
    cfg = tiny()
    H, d = cfg.index_n_heads, cfg.index_head_dim
    p = {"weights_proj": jax.random.normal(jax.random.key(5), (H, cfg.hidden_size)) * 0.3}
    q, keys, _, _ = _case(1, 2, 24, H, d, jnp.float32, seed=9)
    h = jax.random.normal(jax.random.key(2), (1, 2, cfg.hidden_size))
    pos = jnp.array([[43, 99]])                            # ratio 4: rows < 11 and < 25 visible

    def run(backends):
        c_impl = cfg.with_backends(backends)

        def body(c):
            i, kk, acc = c
            m = model_indexer.select_mask(q, kk, h, p, c_impl, pos, 4)
            return i + 1, jnp.roll(kk, 1, axis=1), acc + m.astype(jnp.int32)
        return jax.jit(lambda kk: jax.lax.while_loop(lambda c: c[0] < 3, body, (0, kk, jnp.zeros((1, 2, 24),
                                                                                                 jnp.int32)))[2])(keys)

    np.testing.assert_array_equal(run(PALLAS), run(Backends()))
