"""Unit tests of the model's building blocks against direct numpy formulations of the spec.

Every reference below is written from docs/model_math.md §2 with explicit loops in
float64 numpy and shares no code with the library (the only library objects used are the
functions under test and, for their static arguments, a config). Inputs are random and chosen so
that the feature under test matters (non-symmetric C, active SwiGLU clamps, a router bias that
changes the selection, index ties, ...); where that is not automatic the test asserts it.
"""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax.config import HASH_MOE, MOE, flash, tiny
from dsv4_jax.model.layers import attention, compressor, hyper, indexer, moe, rope
from dsv4_jax.ops import indexer as ops_indexer
from dsv4_jax.ops import moe as ops_moe

CFG = tiny()          # n = 4 streams, D = 64, H = 4, d = 32, r = 8, nI = 8, dI = 16, E = 8, k = 2, I = 32


def jit(fn, **static):
    """jit with the config (and other static arguments) closed over: one compile instead of per-op dispatch."""
    return jax.jit(functools.partial(fn, **static))


def rng(seed):
    return np.random.default_rng(seed)


def f32(x):
    return jnp.asarray(np.asarray(x, np.float32))


def close(got, want, atol, rtol=0.0):
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=atol, rtol=rtol)


# ---- numpy formulations of the spec ----------------------------------------------------------

def np_rms(x, w=None, eps=1e-6):
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if w is None else y * w


def np_sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def np_rope_freqs(r, theta):
    return np.array([theta ** (-2.0 * i / r) for i in range(r // 2)])


def np_yarn_bounds(r, theta, L0, beta_fast, beta_slow, truncate=True):
    def cd(k):
        return r * math.log(L0 / (2 * math.pi * k)) / (2 * math.log(theta))
    lo, hi = cd(beta_fast), cd(beta_slow)
    if truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, r - 1)
    if lo == hi:
        hi += 0.001
    return lo, hi


def np_yarn_freqs(r, theta, factor, L0, beta_fast, beta_slow, truncate=True):
    lo, hi = np_yarn_bounds(r, theta, L0, beta_fast, beta_slow, truncate)
    out = []
    for i, f in enumerate(np_rope_freqs(r, theta)):
        ramp = min(max((i - lo) / (hi - lo), 0.0), 1.0)
        out.append(f * (1 - ramp) + (f / factor) * ramp)
    return np.array(out)


def np_rope_vec(v, pos, freqs, inverse=False):
    """Rotate the trailing 2·len(freqs) channels of one vector, interleaved pairs (complex multiply)."""
    v = np.array(v, np.float64)
    d, r = v.shape[-1], 2 * len(freqs)
    for i, f in enumerate(freqs):
        phi = (-1 if inverse else 1) * pos * f
        a, b = v[d - r + 2 * i], v[d - r + 2 * i + 1]
        v[d - r + 2 * i] = a * math.cos(phi) - b * math.sin(phi)
        v[d - r + 2 * i + 1] = a * math.sin(phi) + b * math.cos(phi)
    return v


def np_hc(x_tok, fn, base, scale, n, iters, eps, rms_eps=1e-6):
    """mHC weights of one token (docs/model_math.md §2.2). x_tok [n, D] -> pre [n], post [n], C [n, n]."""
    xh = x_tok.reshape(-1)
    xh = xh / np.sqrt(np.mean(xh ** 2) + rms_eps)
    mu = fn @ xh
    pre = np.array([np_sigmoid(mu[j] * scale[0] + base[j]) + eps for j in range(n)])
    post = np.array([2 * np_sigmoid(mu[n + j] * scale[1] + base[n + j]) for j in range(n)])
    A = np.array([[mu[2 * n + n * j + k] * scale[2] + base[2 * n + n * j + k] for k in range(n)] for j in range(n)])
    return pre, post, np_sinkhorn(A, iters, eps)


def np_sinkhorn(A, iters, eps):
    n = A.shape[0]
    C = np.zeros_like(A)
    for j in range(n):                                    # row softmax over k, + eps
        e = np.exp(A[j] - A[j].max())
        C[j] = e / e.sum() + eps
    C = C / (C.sum(axis=0, keepdims=True) + eps)          # column normalisation first
    for _ in range(iters - 1):
        C = C / (C.sum(axis=1, keepdims=True) + eps)      # rows
        C = C / (C.sum(axis=0, keepdims=True) + eps)      # columns
    return C


def np_softplus(x):
    return np.log1p(np.exp(x))


def np_silu(x):
    return x / (1 + np.exp(-x))


def np_swiglu(g, u, lim):
    return np_silu(np.minimum(g, lim)) * np.clip(u, -lim, lim)


# ---- mHC ------------------------------------------------------------------------------------

def _hc_inputs(seed, B=2, S=3, n=4, D=64, amp=3.0):
    r = rng(seed)
    X = r.normal(size=(B, S, n, D))
    fn = r.normal(size=((2 + n) * n, n * D)) * amp / math.sqrt(n * D)
    base = r.normal(size=((2 + n) * n,))
    scale = 0.5 + r.random(3)
    return X, fn, base, scale


@pytest.mark.parametrize("iters", [1, 2, 20])
def test_hc_weights_match_spec(iters):
    cfg = CFG.replace(hc_sinkhorn_iters=iters)
    n = cfg.hc_mult
    X, fn, base, scale = _hc_inputs(0)
    pre, post, comb = jit(hyper.hc_weights, config=cfg)(f32(X), {"fn": f32(fn), "base": f32(base), "scale": f32(scale)})
    for b in range(X.shape[0]):
        for s in range(X.shape[1]):
            p_, q_, C = np_hc(X[b, s], fn, base, scale, n, iters, cfg.hc_eps)
            close(pre[b, s], p_, 1e-5)
            close(post[b, s], q_, 1e-5)
            close(comb[b, s], C, 2e-5)
    # column-first: the last operation is always a column normalisation
    close(np.asarray(comb).sum(axis=-2), np.ones((2, 3, n)), 1e-4)
    if iters == 1:   # one column pass only: rows are not normalised yet (would be if rows went first)
        assert np.abs(np.asarray(comb).sum(axis=-1) - 1).max() > 0.05


def test_sinkhorn_direct():
    A = rng(1).normal(size=(5, 4, 4)) * 2
    got = jit(hyper.sinkhorn, iters=20, eps=1e-6)(f32(A))
    for i in range(5):
        close(got[i], np_sinkhorn(A[i], 20, 1e-6), 2e-6)
    # 20 iterations are close to doubly stochastic but far from symmetric
    close(np.asarray(got).sum(-1), np.ones((5, 4)), 1e-3)
    assert np.abs(np.asarray(got) - np.swapaxes(np.asarray(got), -1, -2)).max() > 0.05


def test_expand_uses_c_transpose():
    r = rng(2)
    B, S, n, D = 1, 2, 4, 8
    X, y = r.normal(size=(B, S, n, D)), r.normal(size=(B, S, D))
    post = 2 * r.random((B, S, n))
    comb = r.random((B, S, n, n)) * np.arange(1, n + 1)[:, None]      # clearly non-symmetric
    got = np.asarray(jax.jit(hyper.expand)(f32(X), f32(y), f32(post), f32(comb)))
    want = np.zeros_like(X)
    for b in range(B):
        for s in range(S):
            for k in range(n):
                want[b, s, k] = post[b, s, k] * y[b, s] + sum(comb[b, s, j, k] * X[b, s, j] for j in range(n))
    close(got, want, 1e-5)
    wrong = np.einsum("bsn,bsd->bsnd", post, y) + np.einsum("bskj,bsjd->bskd", comb, X)   # C X instead of Cᵀ X
    assert np.abs(wrong - want).max() > 0.1


def test_collapse_and_hc_head():
    r = rng(3)
    n, D = CFG.hc_mult, CFG.hidden_size
    X = r.normal(size=(2, 3, n, D))
    fn = r.normal(size=(n, n * D)) * 3 / math.sqrt(n * D)
    base, scale = r.normal(size=(n,)), 0.5 + r.random(1)
    got = np.asarray(jit(hyper.hc_head, config=CFG)(f32(X), {"fn": f32(fn), "base": f32(base), "scale": f32(scale)}))
    want = np.zeros((2, 3, D))
    for b in range(2):
        for s in range(3):
            xh = X[b, s].reshape(-1)
            xh = xh / np.sqrt(np.mean(xh ** 2) + 1e-6)
            mu = fn @ xh
            pre = np_sigmoid(mu * scale[0] + base) + CFG.hc_eps
            want[b, s] = sum(pre[j] * X[b, s, j] for j in range(n))
    close(got, want, 1e-5)


# ---- RoPE -----------------------------------------------------------------------------------

def test_main_rope_is_plain_theta():
    for cfg in (flash(), CFG):
        close(rope.inv_freq(cfg, "main"), np_rope_freqs(cfg.rope_head_dim, cfg.rope_theta), 0, 2e-6)
    assert rope.layer_rope_kind("sliding_attention") == "main"
    assert rope.layer_rope_kind("compressed_sparse_attention") == "compress"
    assert rope.layer_rope_kind("heavily_compressed_attention") == "compress"


def test_compress_rope_flash_yarn_values():
    c = flash()
    r, th = c.rope_head_dim, c.compress_rope_theta
    assert np_yarn_bounds(r, th, 65536, 32, 1) == (15, 25)         # docs/model_math.md §2.0
    got = rope.inv_freq(c, "compress").astype(np.float64)
    plain = np_rope_freqs(r, th)
    close(got, np_yarn_freqs(r, th, 16, 65536, 32, 1), 0, 2e-6)
    close(got[:16], plain[:16], 0, 2e-6)                           # pairs 0..15 unscaled
    close(got[25:], plain[25:] / 16, 0, 2e-6)                      # pairs >= 25 divided by 16
    mid = got[16:25]
    assert np.all(mid < plain[16:25] * (1 - 1e-3)) and np.all(mid > plain[16:25] / 16 * (1 + 1e-3))


@pytest.mark.parametrize("r,theta,factor,L0,truncate", [
    (8, 160000.0, 16.0, 16, True),        # the tiny configs: lo = 0, hi = 1
    (16, 160000.0, 8.0, 32, True),
    (32, 10000.0, 4.0, 4096, True),
    (64, 160000.0, 16.0, 65536, False),
    (8, 160000.0, 16.0, 2, True),         # lo == hi == 0 -> hi = 0.001
])
def test_compress_rope_yarn_general(r, theta, factor, L0, truncate):
    from dsv4_jax.config import YarnScaling
    c = CFG.replace(rope_head_dim=r, head_dim=max(CFG.head_dim, r), index_head_dim=max(CFG.index_head_dim, r),
                    compress_rope_theta=theta,
                    yarn=YarnScaling(factor=factor, original_max_position_embeddings=L0, truncate=truncate))
    close(rope.inv_freq(c, "compress"), np_yarn_freqs(r, theta, factor, L0, 32, 1, truncate), 0, 2e-6)
    # no YaRN configured: the compress table is plain θ_compress
    close(rope.inv_freq(c.replace(yarn=None), "compress"), np_rope_freqs(r, theta), 0, 2e-6)


def test_apply_rope_interleaved_trailing_and_inverse():
    r_ = rng(4)
    B, S, H, d = 2, 5, 3, 32
    freqs = np_yarn_freqs(8, 160000.0, 16.0, 16, 32, 1).astype(np.float32)
    x = r_.normal(size=(B, S, H, d))
    pos = r_.integers(0, 300, size=(B, S))
    got = np.asarray(jit(rope.apply_rope, freqs=freqs)(f32(x), jnp.asarray(pos, jnp.int32)))
    want = np.array([[[np_rope_vec(x[b, s, h], pos[b, s], freqs) for h in range(H)] for s in range(S)]
                     for b in range(B)])
    close(got, want, 1e-4)
    np.testing.assert_array_equal(got[..., :-8], x.astype(np.float32)[..., :-8])   # nope channels untouched
    # no head axis: x [B, S, d]
    got2 = np.asarray(jit(rope.apply_rope, freqs=freqs)(f32(x[:, :, 0]), jnp.asarray(pos, jnp.int32)))
    close(got2, want[:, :, 0], 1e-4)
    inv = np.asarray(jit(rope.apply_rope, freqs=freqs, inverse=True)(f32(x), jnp.asarray(pos, jnp.int32)))
    want_inv = np.array([[[np_rope_vec(x[b, s, h], pos[b, s], freqs, inverse=True) for h in range(H)]
                          for s in range(S)] for b in range(B)])
    close(inv, want_inv, 1e-4)
    back = jit(rope.apply_rope, freqs=freqs, inverse=True)(jnp.asarray(got), jnp.asarray(pos, jnp.int32))
    close(back, x, 1e-5)


# ---- compressors ----------------------------------------------------------------------------

def np_compress(h, p, m, dim, overlap, freqs, eps=1e-6):
    """Loop version of §2.5 (overlap=False) / §2.6 (overlap=True): rows [B, S // m, dim]."""
    B, S, _ = h.shape
    a = h @ p["wkv"].T
    z = h @ p["wgate"].T
    rows = np.zeros((B, S // m, dim))
    for b in range(B):
        for w in range(S // m):
            slots = []
            if overlap:
                if w > 0:      # A-halves of the previous window, bias by slot in their own window
                    slots += [(a[b, t, :dim], z[b, t, :dim] + p["ape"][t - (w - 1) * m, :dim])
                              for t in range((w - 1) * m, w * m)]
                slots += [(a[b, t, dim:], z[b, t, dim:] + p["ape"][t - w * m, dim:])
                          for t in range(w * m, (w + 1) * m)]
            else:
                slots += [(a[b, t], z[b, t] + p["ape"][t - w * m]) for t in range(w * m, (w + 1) * m)]
            A = np.stack([s[0] for s in slots])
            Z = np.stack([s[1] for s in slots])
            W = np.exp(Z - Z.max(axis=0))
            W = W / W.sum(axis=0)
            row = (W * A).sum(axis=0)
            rows[b, w] = np_rope_vec(np_rms(row, p["norm"], eps), w * m, freqs)
    return rows


def _comp_params(r_, D, dim, m, overlap):
    cd = 2 * dim if overlap else dim
    return {"wkv": r_.normal(size=(cd, D)) / math.sqrt(D), "wgate": r_.normal(size=(cd, D)) * 2 / math.sqrt(D),
            "ape": r_.normal(size=(m, cd)) * 2, "norm": 1 + 0.1 * r_.normal(size=(dim,))}


@pytest.mark.parametrize("m,overlap,S", [(4, True, 19), (4, True, 8), (8, False, 27), (2, False, 7), (3, True, 12)])
def test_compressor_pooling(m, overlap, S):
    r_ = rng(5)
    D, dim, B = 24, 16, 2
    freqs = np_yarn_freqs(8, 160000.0, 16.0, 16, 32, 1).astype(np.float32)
    p = _comp_params(r_, D, dim, m, overlap)
    h = r_.normal(size=(B, S, D))
    got = np.asarray(jit(compressor.compress_sequence, ratio=m, dim=dim, overlap=overlap, freqs=freqs,
                                         eps=1e-6)(f32(h), {k: f32(v) for k, v in p.items()}))
    assert got.shape == (B, S // m, dim)
    close(got, np_compress(h, p, m, dim, overlap, freqs), 2e-5)
    if overlap:   # the A-slots matter: dropping them changes every row after the first
        pb = dict(p)
        pb["ape"] = p["ape"].copy()
        pb["ape"][:, :dim] = -1e9          # A-halves weightless: rows w>0 change, row 0 does not
        alt = np.asarray(jit(compressor.compress_sequence, ratio=m, dim=dim, overlap=True, freqs=freqs,
                                             eps=1e-6)(f32(h), {k: f32(v) for k, v in pb.items()}))
        close(alt[:, 0], got[:, 0], 1e-5)
        assert np.abs(alt[:, 1:] - got[:, 1:]).max() > 1e-2


def test_compressor_short_sequence_has_no_rows():
    r_ = rng(6)
    p = _comp_params(r_, 24, 16, 8, False)
    out = compressor.compress_sequence(f32(r_.normal(size=(1, 7, 24))), {k: f32(v) for k, v in p.items()}, 8, 16,
                                       False, np.ones(4, np.float32), 1e-6)
    assert out.shape == (1, 0, 16)


def test_compressed_visibility_rule():
    m, S, T = 4, 23, 5
    pos = np.tile(np.arange(S), (2, 1))
    got = np.asarray(attention.compressed_visible(jnp.asarray(pos, jnp.int32), T, m))
    want = np.array([[[w < (p + 1) // m for w in range(T)] for p in row] for row in pos])
    np.testing.assert_array_equal(got, want)
    assert not got[0, 2, 0] and got[0, 3, 0] and not got[0, 6, 1] and got[0, 7, 1]   # row w visible from p = wm+m−1


# ---- indexer --------------------------------------------------------------------------------

def test_index_queries_and_scores():
    r_ = rng(7)
    c = CFG
    B, S, T = 2, 6, 4
    nI, dI, D, ql = c.index_n_heads, c.index_head_dim, c.hidden_size, c.q_lora_rank
    freqs = np_yarn_freqs(c.rope_head_dim, c.compress_rope_theta, 16.0, 16, 32, 1).astype(np.float32)
    qr, h = r_.normal(size=(B, S, ql)), r_.normal(size=(B, S, D))
    keys = r_.normal(size=(B, T, dI))
    p = {"wq_b": r_.normal(size=(nI * dI, ql)) / math.sqrt(ql), "weights_proj": r_.normal(size=(nI, D)) / math.sqrt(D)}
    pj = {k: f32(v) for k, v in p.items()}
    pos = np.tile(np.arange(S), (B, 1))
    q = jit(indexer.index_queries, config=c, freqs=freqs)(f32(qr), pj, positions=jnp.asarray(pos, jnp.int32))
    q = np.asarray(q)
    want_q = (qr @ p["wq_b"].T).reshape(B, S, nI, dI)
    want_q = np.array([[[np_rope_vec(want_q[b, s, hh], s, freqs) for hh in range(nI)] for s in range(S)]
                       for b in range(B)])
    close(q, want_q, 1e-4)
    scores = lambda q, k, h, p: ops_indexer.scores(q, k, ops_indexer.omega(h, p["weights_proj"], nI))
    sc = np.asarray(jax.jit(scores)(f32(want_q), f32(keys), f32(h), pj))
    want = np.zeros((B, S, T))
    for b in range(B):
        for s in range(S):
            om = (p["weights_proj"] @ h[b, s]) * nI ** -0.5
            for w in range(T):
                want[b, s, w] = sum(om[hh] * max(want_q[b, s, hh] @ keys[b, w], 0.0) * dI ** -0.5
                                    for hh in range(nI))
    close(sc, want, 1e-4)


def np_select(scores, valid, k):
    out = np.zeros(scores.shape, bool)
    for idx in np.ndindex(scores.shape[:-1]):
        cand = [w for w in range(scores.shape[-1]) if valid[idx + (w,)]]
        for w in sorted(cand, key=lambda w: (-scores[idx + (w,)], w))[:k]:
            out[idx + (w,)] = True
    return out


@pytest.mark.parametrize("k", [1, 3, 6, 20])
def test_select_topk_validity_and_ties(k):
    r_ = rng(8 + k)
    B, S, T, m = 2, 24, 6, 4
    scores = r_.integers(0, 3, size=(B, S, T)).astype(np.float32)      # many exact ties
    pos = np.tile(np.arange(S), (B, 1))
    valid = np.array([[[w < (p + 1) // m for w in range(T)] for p in row] for row in pos])
    got = np.asarray(jit(ops_indexer.select_topk, k=k)(jnp.asarray(scores), jnp.asarray(valid)))
    want = np_select(scores, valid, k)
    np.testing.assert_array_equal(got, want)
    assert not (got & ~valid).any()
    np.testing.assert_array_equal(got.sum(-1), np.minimum(valid.sum(-1), k))


def test_select_topk_prefers_lower_index_on_ties():
    scores = jnp.zeros((1, 1, 5))
    got = np.asarray(jit(ops_indexer.select_topk, k=2)(scores, jnp.array([[[False, True, True, True, True]]])))
    np.testing.assert_array_equal(got[0, 0], [False, True, True, False, False])
    got = np.asarray(jit(ops_indexer.select_topk, k=3)(jnp.array([[[0.0, 1.0, 0.0, 1.0, 0.0]]]), jnp.ones((1, 1, 5), bool)))
    np.testing.assert_array_equal(got[0, 0], [True, True, False, True, False])


# ---- MoE ------------------------------------------------------------------------------------

def np_route(x, tokens, p, c, hashed):
    s = np.sqrt(np_softplus(x @ p["weight"].T))
    out = []
    for t in range(x.shape[0]):
        if hashed:
            idx = list(p["tid2eid"][tokens[t]])
        else:
            sel = s[t] + p["bias"]
            idx = sorted(range(c.n_routed_experts), key=lambda e: (-sel[e], e))[: c.num_experts_per_tok]
        w = np.array([s[t, e] for e in idx])
        w = w / (w.sum() + 1e-20) * c.routed_scaling_factor
        out.append(dict(zip(idx, w)))
    return out


def _moe_params(r_, c, amp=1.0):
    E, I, D = c.n_routed_experts, c.moe_intermediate_size, c.hidden_size
    tid = np.stack([r_.permutation(E)[: c.num_experts_per_tok] for _ in range(c.vocab_size)])
    return {"gate": {"weight": r_.normal(size=(E, D)) * 2 / math.sqrt(D), "bias": r_.normal(size=(E,)),
                     "tid2eid": tid},
            "experts": {"w1": r_.normal(size=(E, I, D)) * amp / math.sqrt(D),
                        "w2": r_.normal(size=(E, D, I)) / math.sqrt(I),
                        "w3": r_.normal(size=(E, I, D)) * amp / math.sqrt(D)},
            "shared_experts": {"w1": r_.normal(size=(I, D)) * amp / math.sqrt(D),
                               "w2": r_.normal(size=(D, I)) / math.sqrt(I),
                               "w3": r_.normal(size=(I, D)) * amp / math.sqrt(D)}}


def _jtree(p):
    return {k: _jtree(v) if isinstance(v, dict) else
            (jnp.asarray(v, jnp.int32) if v.dtype.kind == "i" else f32(v)) for k, v in p.items()}


def _as_dicts(idx, w):
    return [dict(zip(map(int, i), map(float, ww))) for i, ww in zip(np.asarray(idx), np.asarray(w))]


@pytest.mark.parametrize("mlp_type", [MOE, HASH_MOE])
def test_routing(mlp_type):
    r_ = rng(9)
    c = CFG
    p = _moe_params(r_, c)
    T = 40
    x, tokens = r_.normal(size=(T, c.hidden_size)), r_.integers(0, c.vocab_size, size=T)
    idx, w = jit(moe.route, config=c, mlp_type=mlp_type)(f32(x), jnp.asarray(tokens, jnp.int32), _jtree(p)["gate"])
    assert idx.dtype == jnp.int32 and w.dtype == jnp.float32
    got, want = _as_dicts(idx, w), np_route(x, tokens, p["gate"], c, mlp_type == HASH_MOE)
    for g, wt in zip(got, want):
        assert sorted(g) == sorted(wt)
        for e in g:
            assert abs(g[e] - wt[e]) < 1e-5
        assert abs(sum(g.values()) - c.routed_scaling_factor) < 1e-5
    if mlp_type == MOE:   # the bias really changed some selections (else "selection only" is untested)
        no_bias = np_route(x, tokens, {**p["gate"], "bias": np.zeros(c.n_routed_experts)}, c, False)
        assert any(sorted(a) != sorted(b) for a, b in zip(no_bias, want))
    else:
        np.testing.assert_array_equal(np.asarray(idx), p["gate"]["tid2eid"][tokens])


def test_swiglu_clamps():
    g = np.linspace(-30, 30, 61)
    u = np.linspace(25, -25, 61)
    got = np.asarray(ops_moe.swiglu(f32(g), f32(u), 10.0))
    close(got, np_swiglu(g, u, 10.0), 1e-4, 1e-6)
    # the gate has no lower clamp: silu(-30)·10 ≈ -3e-12, whereas a clamp at -10 would give silu(-10)·10 ≈ -4.5e-3
    assert abs(got[0]) < 1e-6
    close(got[-1], np_silu(10.0) * -10, 1e-4)      # g = 30 -> 10 and u = -25 -> -10


def np_experts(x, routes, p, lim):
    y = np.zeros_like(x)
    for t, r in enumerate(routes):
        for e, w in r.items():
            h = np_swiglu(p["w1"][e] @ x[t], p["w3"][e] @ x[t], lim)
            y[t] += w * (p["w2"][e] @ h)
    return y


@pytest.mark.parametrize("T", [3, 37])
def test_expert_paths(T):
    r_ = rng(10 + T)
    c = CFG
    p = _moe_params(r_, c, amp=6.0)         # large enough that the ±10 clamps are active
    x = r_.normal(size=(T, c.hidden_size))
    g_all = np.einsum("eid,td->tei", p["experts"]["w1"], x)
    u_all = np.einsum("eid,td->tei", p["experts"]["w3"], x)
    assert (g_all > 10).any() and (np.abs(u_all) > 10).any()
    routes = np_route(x, np.zeros(T, int), p["gate"], c, False)
    idx = np.array([list(r.keys()) for r in routes], np.int32)
    w = np.array([list(r.values()) for r in routes])
    want = np_experts(x, routes, p["experts"], c.swiglu_limit)
    pe = _jtree(p)["experts"]
    # experts_sorted is experts_tiled when compiled for CPU; experts_ragged keeps the ragged_dot path checked
    for fn in (ops_moe.experts_gather, ops_moe.experts_sorted, ops_moe.experts_ragged, ops_moe.experts_tiled):
        got = np.asarray(jit(fn, limit=c.swiglu_limit)(f32(x), jnp.asarray(idx), f32(w), pe["w1"], pe["w2"], pe["w3"]))
        close(got, want, 1e-4, 1e-5)
    if T == 3:
        assert len(set(idx.ravel())) < c.n_routed_experts     # some experts get no token (empty groups)


@pytest.mark.parametrize("mlp_type,B,S", [(MOE, 1, 3), (MOE, 2, 9), (HASH_MOE, 1, 2), (HASH_MOE, 2, 9)])
def test_moe_layer(mlp_type, B, S):
    r_ = rng(20 + S)
    c = CFG
    p = _moe_params(r_, c, amp=4.0)
    h, tokens = r_.normal(size=(B, S, c.hidden_size)), r_.integers(0, c.vocab_size, size=(B, S))
    layer = jit(moe.moe, config=c, mlp_type=mlp_type)
    got = np.asarray(layer(f32(h), jnp.asarray(tokens, jnp.int32), _jtree(p)))
    x = h.reshape(B * S, -1)
    routes = np_route(x, tokens.reshape(-1), p["gate"], c, mlp_type == HASH_MOE)
    sh = p["shared_experts"]
    want = np_experts(x, routes, p["experts"], c.swiglu_limit)
    want += np.stack([sh["w2"] @ np_swiglu(sh["w1"] @ xt, sh["w3"] @ xt, c.swiglu_limit) for xt in x])
    close(got, want.reshape(B, S, -1), 1e-4, 1e-5)


# ---- attention ------------------------------------------------------------------------------

def test_attend_with_sinks():
    r_ = rng(11)
    B, S, H, d, T = 2, 4, 3, 16, 7
    q, keys = r_.normal(size=(B, S, H, d)) * 3, r_.normal(size=(B, T, d)) * 3
    mask = r_.random((B, S, T)) < 0.6
    mask[0, 0] = False                                   # a query that sees nothing: all mass on the sink
    sinks = r_.normal(size=(H,)) * 2
    got = np.asarray(jax.jit(attention.attend)(f32(q), f32(keys), jnp.asarray(mask), f32(sinks)))
    want = np.zeros((B, S, H, d))
    for b in range(B):
        for s in range(S):
            J = [j for j in range(T) if mask[b, s, j]]
            for h in range(H):
                lg = np.array([q[b, s, h] @ keys[b, j] / math.sqrt(d) for j in J])
                den = np.exp(lg).sum() + math.exp(sinks[h])
                want[b, s, h] = sum(np.exp(lg[i]) / den * keys[b, j] for i, j in enumerate(J)) if J else 0
    close(got, want, 1e-4, 1e-5)
    assert np.all(got[0, 0] == 0)
    # the sink matters: without it the result differs
    no_sink = np.asarray(jax.jit(attention.attend)(f32(q), f32(keys), jnp.asarray(mask), f32(np.full(H, -1e9))))
    assert np.abs(no_sink[0, 1:] - got[0, 1:]).max() > 1e-2


def test_attend_with_per_query_keys():
    """The CSA form: shared window keys plus each query's own selected rows, one softmax with the sink."""
    r_ = rng(13)
    B, S, H, d, T, K = 2, 3, 2, 8, 4, 3
    q, keys, qk = r_.normal(size=(B, S, H, d)) * 2, r_.normal(size=(B, T, d)) * 2, r_.normal(size=(B, S, K, d)) * 2
    mask, qmask = r_.random((B, S, T)) < 0.7, r_.random((B, S, K)) < 0.6
    sinks = r_.normal(size=(H,))
    got = np.asarray(jax.jit(attention.attend)(f32(q), f32(keys), jnp.asarray(mask), f32(sinks), f32(qk),
                                               jnp.asarray(qmask)))
    want = np.zeros((B, S, H, d))
    for b in range(B):
        for s in range(S):
            J = [keys[b, j] for j in range(T) if mask[b, s, j]] + [qk[b, s, j] for j in range(K) if qmask[b, s, j]]
            for h in range(H):
                e = np.array([math.exp(q[b, s, h] @ k / math.sqrt(d)) for k in J])
                den = e.sum() + math.exp(sinks[h])
                want[b, s, h] = sum(e[i] / den * k for i, k in enumerate(J)) if J else 0
    close(got, want, 1e-4, 1e-5)


def test_window_mask_includes_current_token():
    W, S = 5, 12
    pos = jnp.asarray(np.tile(np.arange(S), (2, 1)), jnp.int32)
    got = np.asarray(attention.window_mask(pos, pos, W))
    want = np.array([[[p - W < t <= p for t in range(S)] for p in range(S)]] * 2)
    np.testing.assert_array_equal(got, want)
    assert got[0, 7, 7] and got[0, 7, 3] and not got[0, 7, 2] and not got[0, 7, 8]
    np.testing.assert_array_equal(got[0].sum(-1), np.minimum(np.arange(S) + 1, W))


def test_grouped_output_and_projections():
    r_ = rng(12)
    c = CFG
    B, S, H, d, G, R, D = 2, 3, c.num_heads, c.head_dim, c.o_groups, c.o_lora_rank, c.hidden_size
    o = r_.normal(size=(B, S, H, d))
    p = {"wo_a": r_.normal(size=(G * R, H * d // G)), "wo_b": r_.normal(size=(D, G * R)),
         "wq_a": r_.normal(size=(c.q_lora_rank, D)), "q_norm": 1 + 0.1 * r_.normal(size=(c.q_lora_rank,)),
         "wq_b": r_.normal(size=(H * d, c.q_lora_rank)), "wkv": r_.normal(size=(d, D)),
         "kv_norm": 1 + 0.1 * r_.normal(size=(d,))}
    pj = {k: f32(v) for k, v in p.items()}
    got = np.asarray(jit(attention.grouped_output, config=c)(f32(o), pj))
    want = np.zeros((B, S, D))
    for b in range(B):
        for s in range(S):
            u = [p["wo_a"][g * R:(g + 1) * R] @ np.concatenate([o[b, s, hh] for hh in range(g * H // G,
                                                                                             (g + 1) * H // G)])
                 for g in range(G)]
            want[b, s] = p["wo_b"] @ np.concatenate(u)
    close(got, want, 1e-3, 1e-5)

    h = r_.normal(size=(B, S, D))
    freqs = np_rope_freqs(c.rope_head_dim, c.rope_theta).astype(np.float32)
    pos = np.tile(np.arange(S) + 5, (B, 1))
    qr, q = jit(attention.project_q, config=c, freqs=freqs)(f32(h), pj, positions=jnp.asarray(pos, jnp.int32))
    kv = jit(attention.project_kv, config=c, freqs=freqs)(f32(h), pj, positions=jnp.asarray(pos, jnp.int32))
    for b in range(B):
        for s in range(S):
            cq = np_rms(p["wq_a"] @ h[b, s], p["q_norm"])
            close(qr[b, s], cq, 1e-4, 1e-5)
            qh = (p["wq_b"] @ cq).reshape(H, d)
            for hh in range(H):
                close(q[b, s, hh], np_rope_vec(np_rms(qh[hh]), pos[b, s], freqs), 1e-4)   # unweighted per-head norm
            close(kv[b, s], np_rope_vec(np_rms(p["wkv"] @ h[b, s], p["kv_norm"]), pos[b, s], freqs), 1e-4)
