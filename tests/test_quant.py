"""The quantized leaf type (ops.quant.QArray): formats against independent numpy decodings, pytree behaviour
under jit / scan / eval_shape, the weight entries (ops.linear, ops.moe) on QArrays against the dense path on the
dequantized weights, abstract trees / shardings / memplan from one ParamSpec description, and the compiled
decode step of a kept-quantized model (no dequantized [E, I, D] expert stack)."""
import math
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv4_jax import config as C, parallel as S
from dsv4_jax.model import decode as D, params as P
from dsv4_jax.analysis import memplan as M
from dsv4_jax.model.state import init_state
from dsv4_jax.ops import linear as L, moe as ops_moe, quant as Q

rng = np.random.default_rng(0)
# two layers: SWA + hash-routed MoE, CSA (compressor + indexer) + score-routed MoE
SMALL = C.tiny().replace(num_layers=2, layer_types=(C.SLIDING, C.CSA), compress_ratios=(0, 4),
                         mlp_layer_types=(C.HASH_MOE, C.MOE), name="quant-small")
GENERIC = Q.QFormat("e4m3", (8, 16), "f32")
ALL = [Q.FP8, Q.FP4, Q.Q8_0, Q.INT8, GENERIC]


def _np_dequant(q: Q.QArray) -> np.ndarray:
    """Independent numpy decoding (ml_dtypes tables, spelled-out block broadcasting)."""
    codes, scale = np.asarray(q.codes), np.asarray(q.scale)
    if q.fmt.codes == "e2m1":
        nib = np.stack([codes & 0xF, codes >> 4], -1).reshape(*codes.shape[:-1], -1)
        vals = nib.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    else:
        vals = codes.astype(np.float32)
    s = scale.view(ml_dtypes.float8_e8m0fnu).astype(np.float32) if q.fmt.scale == "e8m0" else scale.astype(np.float32)
    *_, n, k = vals.shape
    br, bc = q.fmt.block[0] or n, q.fmt.block[1] or k
    rows, cols = np.arange(n) // br, np.arange(k) // bc
    return vals * s[..., rows[:, None], cols[None, :]]


def test_decoders_exact_on_every_code():
    b = jnp.arange(256, dtype=jnp.uint8)
    want = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    got = np.asarray(Q.decode_e8m0(b))
    np.testing.assert_array_equal(got[:255], want[:255])
    assert got[0] == np.float32(2.0 ** -127) and np.isnan(got[255])
    n = jnp.arange(16, dtype=jnp.uint8)
    np.testing.assert_array_equal(np.asarray(Q.decode_e2m1(n)),
                                  np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32))
    assert np.signbit(np.asarray(Q.decode_e2m1(jnp.uint8(8))))               # -0


def test_float_e2m1_decoder_and_matmul_codes():
    """The uint8-only e2m1 decoder matches the ml_dtypes table bit for bit (-0 included); x Wᵀ read as codes
    (even / odd columns against the nibble planes) equals x times the numpy-dequantized W in float32."""
    n = jnp.arange(16, dtype=jnp.uint8)
    want = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    got = np.asarray(Q.decode_e2m1_float(n))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
    for fmt in (Q.FP4, Q.FP8, GENERIC):
        w = jnp.asarray(rng.standard_normal((24, 64)), jnp.float32)
        q = Q.quantize(w, fmt)
        x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
        wd, xn = _np_dequant(q), np.asarray(x)
        # float32 sums of 64 products: the error scales with Σ|x·w| (before cancellation), not with the result
        # (a 1.3e-6 miss on a -0.175 entry whose terms sum to ~40 in magnitude, on an AVX-512 host)
        err = np.abs(np.asarray(Q.matmul_codes(x, q)) - xn @ wd.T)
        assert (err <= 1e-6 * (np.abs(xn) @ np.abs(wd).T) + 1e-6).all(), (fmt, err.max())


def _np_words(codes: np.ndarray, scale: np.ndarray, group: int):
    """The word layout spelled out in numpy (ops/quant.py docstring): in column group g, nibble i of code
    word j = column g·G + i·G/8 + j, byte b of scale word m = block g·G/32 + b·G/128 + m."""
    nib = np.stack([codes & 0xF, codes >> 4], -1).reshape(*codes.shape[:-1], -1).astype(np.uint64)
    K = nib.shape[-1]
    cw = np.zeros((*nib.shape[:-1], K // 8), np.uint64)
    sw = np.zeros((*nib.shape[:-1], K // 128), np.uint64)
    for g in range(K // group):
        for j in range(group // 8):
            for i in range(8):
                cw[..., g * group // 8 + j] |= nib[..., g * group + i * group // 8 + j] << (4 * i)
        for m in range(group // 128):
            for b in range(4):
                sw[..., g * group // 128 + m] |= scale[..., g * group // 32 + b * group // 128 + m].astype(np.uint64) << (8 * b)
    return cw.astype(np.uint32), sw.astype(np.uint32)


@pytest.mark.parametrize("group", [0, 256])
def test_fp4_words_layout_dequantize_and_matmul(group):
    """`to_words` (FP4 -> uint32 words in column groups): equal to the numpy-spelled layout; dequantizes to
    the numpy-dequantized FP4 weight exactly; `matmul_codes` on it (x [T, K]) equals x times it in float32
    (to 1e-6 of Σ|x||W|: the summation order); with groups, each group's columns alone are a whole-K word
    weight (what a shard of a K-split weight holds)."""
    K = 512
    q = Q.quantize(jnp.asarray(rng.standard_normal((2, 24, K)) * 3.0, jnp.float32), Q.FP4)
    wq = Q.to_words(q, group)
    want_c, want_s = _np_words(np.asarray(q.codes), np.asarray(q.scale), group or K)
    assert wq.fmt == Q.words_format(group) and wq.shape == q.shape and Q.check(wq) is wq
    np.testing.assert_array_equal(np.asarray(wq.codes), want_c)
    np.testing.assert_array_equal(np.asarray(wq.scale), want_s)
    dense = _np_dequant(q)
    np.testing.assert_array_equal(np.asarray(Q.dequantize(wq)), dense)
    x = jnp.asarray(rng.standard_normal((3, K)), jnp.float32)
    close = lambda got, xx, w: np.all(np.abs(np.asarray(got) - np.asarray(xx) @ w.T)
                                      <= 1e-6 * (np.abs(np.asarray(xx)) @ np.abs(w).T))
    for e in range(2):
        assert close(Q.matmul_codes(x, Q.take(wq, e)), x, dense[e])
        if group:                                   # the second group as a shard: local words, local columns
            shard = Q.QArray(wq.codes[e, :, group // 8:], wq.scale[e, :, group // 128:], Q.FP4_WORDS)
            assert close(Q.matmul_codes(x[:, group:], shard), x[:, group:], dense[e][:, group:])
    with pytest.raises(ValueError, match="multiple of 256 and divide"):
        Q.to_words(Q.quantize(jnp.ones((4, 128)), Q.FP4))
    with pytest.raises(ValueError, match="multiple of 256 and divide"):
        Q.to_words(Q.quantize(jnp.ones((4, 768)), Q.FP4), 512)
    with pytest.raises(ValueError, match="converts"):
        Q.to_words(Q.quantize(jnp.ones((4, 256)), Q.FP8))


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_quantize_dequantize_formats(fmt):
    w = jnp.asarray(rng.standard_normal((2, 136, 64)).astype(np.float32))      # partial 128-blocks both ways
    q = Q.quantize(w, fmt)
    Q.check(q)
    assert q.shape == w.shape and q.dtype == jnp.float32
    assert q.codes.dtype == Q.CODES[fmt.codes] and q.scale.dtype == Q.SCALES[fmt.scale]
    assert q.nbytes == q.codes.nbytes + q.scale.nbytes
    deq = np.asarray(Q.dequantize(q))
    np.testing.assert_array_equal(deq, _np_dequant(q))
    if fmt.scale == "e8m0":                             # power-of-two scales: exact in bf16 too
        np.testing.assert_array_equal(np.asarray(Q.dequantize(q, jnp.bfloat16), np.float32), deq)
    rel = np.abs(deq - np.asarray(w)).max() / np.abs(np.asarray(w)).max()
    assert rel < {"e2m1": 0.2, "e4m3": 0.07, "int8": 0.01}[fmt.codes], rel
    assert Q.qformat(fmt.name) == fmt


def test_fp4_packing_is_official_nibble_order():
    w = jnp.zeros((1, 32)).at[0, 0].set(0.5).at[0, 1].set(1.0)      # element 0 -> low nibble of byte 0
    q = Q.quantize(w, Q.FP4)                                         # scale 2^⌈log2(1/6)⌉ = 2^-2: codes 2.0, 4.0
    assert q.codes.shape == (1, 16) and q.scale.shape == (1, 1) and int(q.scale[0, 0]) == 127 - 2
    assert int(q.codes[0, 0]) == 0x64 and not np.asarray(q.codes[0, 1:]).any()   # e2m1 2.0 = 4, 4.0 = 6


def test_qarray_is_a_pytree_leaf_type():
    w = jnp.asarray(rng.standard_normal((4, 64, 32)).astype(np.float32))
    q = Q.quantize(w, Q.FP4, jnp.bfloat16)
    children, treedef = jax.tree.flatten(q)
    assert len(children) == 2 and jax.tree.unflatten(treedef, children).fmt == Q.FP4
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path({"w": q})]
    assert paths == ["['w'].codes", "['w'].scale"]
    # scan over the leading (stacked) axis: each slice is a QArray of the unstacked logical shape
    _, ys = jax.lax.scan(lambda c, x: (c, (Q.dequantize(x), x.shape)), 0, q)
    np.testing.assert_array_equal(np.asarray(ys[0]), np.asarray(Q.dequantize(q)))
    sliced = jax.tree.map(lambda a: a[1], q)
    assert sliced.shape == (64, 32) and sliced.dtype == jnp.bfloat16
    # astype only changes the dequantized dtype; jit traces through it; eval_shape gives the abstract leaf
    assert q.astype(jnp.float32).codes is q.codes
    assert jax.jit(lambda x: Q.dequantize(x))(q).dtype == jnp.bfloat16
    ab = jax.eval_shape(lambda x: Q.quantize(x, Q.FP8), jax.ShapeDtypeStruct((2, 256, 128), jnp.bfloat16))
    want = Q.abstract(Q.FP8, (2, 256, 128), jnp.bfloat16)
    assert (ab.codes.shape, ab.codes.dtype, ab.scale.shape, ab.scale.dtype) == \
        (want.codes.shape, want.codes.dtype, want.scale.shape, want.scale.dtype) == \
        ((2, 256, 128), jnp.float8_e4m3fn, (2, 2, 1), jnp.uint8)
    with pytest.raises(ValueError, match="needs codes"):
        Q.check(Q.QArray(q.codes, q.scale[:, :2], Q.FP4))


@pytest.mark.parametrize("fmt", [Q.FP8, pytest.param(Q.Q8_0, marks=pytest.mark.slow)], ids=lambda f: f.name)
def test_linear_embed_take_without_whole_dequant(fmt):
    w = jnp.asarray(rng.standard_normal((160, 64)).astype(np.float32))
    q = Q.quantize(w, fmt)
    dq = Q.dequantize(q)
    x = jnp.asarray(rng.standard_normal((2, 3, 64)).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(L.linear(x, q)), np.asarray(x @ dq.T))
    ids = jnp.array([[0, 129, 7], [159, 128, 3]])
    np.testing.assert_array_equal(np.asarray(L.embed(q, ids)), np.asarray(dq[ids]))
    g = jnp.asarray(rng.standard_normal((2, 3, 4, 16)).astype(np.float32))
    q2 = Q.quantize(jnp.asarray(rng.standard_normal((4 * 40, 16)).astype(np.float32)), fmt)
    np.testing.assert_allclose(np.asarray(L.grouped_linear(g, q2, 4)),
                               np.einsum("bsgi,gri->bsgr", g, np.asarray(Q.dequantize(q2)).reshape(4, 40, 16)),
                               rtol=1e-5, atol=1e-5)
    e = Q.quantize(jnp.asarray(rng.standard_normal((6, 32, 64)).astype(np.float32)), fmt)
    idx = jnp.array([[5, 0], [2, 2]])
    np.testing.assert_array_equal(np.asarray(ops_moe.gather_experts(e, idx)), np.asarray(Q.dequantize(e)[idx]))


def _blocky(n: int, k: int) -> jax.Array:
    """Random [n, k] weight whose 128×128 blocks span 2^-6..2^6 in magnitude (distinct e8m0 scales)."""
    mag = 2.0 ** rng.integers(-6, 7, size=(n // 128, k // 128))
    return jnp.asarray(rng.standard_normal((n, k)) * np.kron(mag, np.ones((128, 128))), jnp.float32)


@pytest.mark.parametrize("fmt", [Q.FP8, Q.QFormat("int8", (128, 128), "e8m0")], ids=lambda f: f.name)
def test_block_scaled_matmul_exact_and_per_block(fmt):
    """FP8 (and int8 with e8m0 128×128 blocks) at decode sizes: `matmul_blocks` equals x · numpy-dequantized
    Wᵀ in float32, never forms a per-element scale, and long inputs keep the dequantized path."""
    q = Q.quantize(_blocky(384, 256), fmt)
    w = _np_dequant(q).astype(np.float64)
    x = jnp.asarray(rng.standard_normal((2, 3, 256)), jnp.float32)
    assert Q.blocks_fit(q, 6) and Q.blocks_fit(q, 64) and not Q.blocks_fit(q, 65)
    y = L.linear(x, q)
    want = np.asarray(x, np.float64) @ w.T
    assert y.shape == (2, 3, 384) and y.dtype == jnp.float32
    assert np.max(np.abs(np.asarray(y) - want)) <= 1e-6 * np.max(np.abs(want))
    # no scale applied per element of W (the dequantized path's [N, K] product); x is scaled per row block
    muls = lambda xx: {tuple(v.aval.shape) for e in jax.make_jaxpr(L.linear)(xx, q).eqns
                       if e.primitive.name == "mul" for v in e.outvars}
    assert muls(x) == {(8, 1, 3, 2, 128)}             # [T' = 6 rows padded to 8, G, N/128, K/128, 128]
    x1 = x[:1, :1]                                                        # one token
    want1 = np.asarray(x1, np.float64) @ w.T
    assert np.max(np.abs(np.asarray(L.linear(x1, q)) - want1)) <= 1e-6 * np.max(np.abs(want1))
    long = jnp.asarray(rng.standard_normal((65, 256)), jnp.float32)       # prefill sizes: dequantized path
    assert (384, 256) in muls(long)
    np.testing.assert_allclose(np.asarray(L.linear(long, q)), np.asarray(long, np.float64) @ w.T, rtol=1e-5,
                               atol=1e-5 * np.max(np.abs(w)))
    # grouped O-LoRA: G = 3 groups of R = 128 rows
    g = jnp.asarray(rng.standard_normal((2, 3, 256)), jnp.float32)
    assert Q.blocks_fit(q, 2, 3) and not Q.blocks_fit(q, 2, 2)
    got = L.grouped_linear(g, q, 3)
    want = np.einsum("bgi,gri->bgr", np.asarray(g, np.float64), w.reshape(3, 128, 256))
    assert got.shape == (2, 3, 128) and np.max(np.abs(np.asarray(got) - want)) <= 1e-6 * np.max(np.abs(want))
    got1 = L.grouped_linear(g[:1], q, 3)
    assert got1.shape == (1, 3, 128) and np.max(np.abs(np.asarray(got1) - want[:1])) <= 1e-6 * np.max(np.abs(want))
    # bfloat16 compute: the same products as the dequantized bf16 path
    qb, xb = q.astype(jnp.bfloat16), x.astype(jnp.bfloat16)
    yb = L.linear(xb, qb)
    assert yb.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(yb, np.float32), np.asarray(xb @ Q.dequantize(qb).T, np.float32),
                               rtol=2e-2, atol=2e-2 * float(np.max(np.abs(want))))


@pytest.mark.parametrize("rows", [1, 6, 8, 9])
def test_block_scaled_matmul_row_padding(rows):
    """`matmul_blocks` pads x's rows (tokens) to a multiple of `row_tile` with zeros and drops them again: the
    padded path (1, 6, 9 rows -> 8, 8, 16; 8 rows unpadded) equals x · numpy-dequantized Wᵀ in float32, for
    plain and grouped weights, the same as row_tile 0 (no padding), and the matmul sees the padded rows."""
    q = Q.quantize(_blocky(256, 384), Q.FP8)
    w = _np_dequant(q).astype(np.float64)
    x = jnp.asarray(rng.standard_normal((rows, 384)), jnp.float32)
    want = np.asarray(x, np.float64) @ w.T
    padded = -(-rows // 8) * 8
    for tile in (8, 0):
        y = Q.matmul_blocks(x, q, row_tile=tile)
        assert y.shape == (rows, 256)
        assert np.max(np.abs(np.asarray(y) - want)) <= 1e-6 * np.max(np.abs(want))
        dots = [e for e in jax.make_jaxpr(lambda a: Q.matmul_blocks(a, q, row_tile=tile))(x).eqns
                if e.primitive.name == "dot_general"]
        assert [int(np.prod(d.outvars[0].aval.shape)) for d in dots] == [(padded if tile else rows) * 256]
    g = jnp.asarray(rng.standard_normal((rows, 2, 384)), jnp.float32)      # grouped: G = 2 groups of 128 rows
    got = Q.matmul_blocks(g, q, groups=2)
    want_g = np.einsum("bgi,gri->bgr", np.asarray(g, np.float64), w.reshape(2, 128, 384))
    assert got.shape == (rows, 2, 128) and np.max(np.abs(np.asarray(got) - want_g)) <= 1e-6 * np.max(np.abs(want_g))


@pytest.mark.parametrize("fmt", [Q.FP4, pytest.param(Q.INT8, marks=pytest.mark.slow)], ids=lambda f: f.name)
def test_expert_paths_on_qarrays(fmt):
    E, Dm, Im, T, k = 6, 64, 32, 9, 2
    ks = jax.random.split(jax.random.key(0), 4)
    p = {n: jax.random.normal(kk, s) * 0.3 for n, kk, s in
         (("w1", ks[0], (E, Im, Dm)), ("w3", ks[1], (E, Im, Dm)), ("w2", ks[2], (E, Dm, Im)))}
    q = {n: Q.quantize(m, fmt) for n, m in p.items()}
    d = {n: Q.dequantize(m) for n, m in q.items()}
    x = jax.random.normal(ks[3], (T, Dm))
    idx = jnp.argsort(jax.random.uniform(jax.random.key(1), (T, E)), -1)[:, :k].astype(jnp.int32)
    w = jax.random.uniform(jax.random.key(2), (T, k), minval=0.1)
    run = lambda path, **kw: jax.jit(lambda x, m: path(x, idx, w, m["w1"], m["w2"], m["w3"], 2.0, **kw))
    want = run(ops_moe.experts_ragged)(x, d)                     # dense ragged_dot (experts_sorted on CPU: tiles)
    for got in (run(ops_moe.experts_gather)(x, q), run(ops_moe.experts_sorted)(x, q),    # sorted: tiles (QArrays)
                run(ops_moe.experts_sorted)(x, d),
                run(ops_moe.experts_tiled, bM=4)(x, d)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def _quantized_model(config, formats=P.release_format):
    params = P.init_params(config, 0)
    specs = P.flatten(P.param_specs(config))
    return params, jax.jit(lambda p: Q.quantize_tree(p, lambda path, x: formats(path, specs[path])))(params)



@pytest.mark.parametrize("fmt", [Q.INT8, pytest.param(Q.Q8_0, marks=pytest.mark.slow)], ids=lambda f: f.name)
def test_forward_every_weight_quantized(fmt):
    """Every weight matrix (embedding and head included) as a QArray: logits equal the dequantized model's and
    so does every greedy next-token choice. (Q8_0, FP8, FP4 and the K-quant repack are checked on converted
    checkpoints in test_convert_parity; int8 per channel has no checkpoint source, it is made here.)"""
    config = SMALL
    rule = lambda path, s: fmt if s.kind == "weight" and len(s.shape) >= 2 else None
    _, q = _quantized_model(config, rule)
    dq = jax.tree.map(lambda x: Q.dense(x), q, is_leaf=Q.is_qarray)
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (2, 12)), jnp.int32)
    from dsv4_jax import forward
    got, want = np.asarray(forward(q, config, tokens)), np.asarray(forward(dq, config, tokens))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


def test_abstract_trees_shardings_and_memplan_share_one_description():
    config = C.flash()
    ab = P.abstract_params(config, jnp.bfloat16, P.release_format)
    flat = P.flatten(ab)
    assert flat["segments.1.0.ffn.experts.w1"].fmt == Q.FP4 and flat["segments.1.0.attn.wq_b"].fmt == Q.FP8
    assert isinstance(flat["embed"], jax.ShapeDtypeStruct) and flat["norm"].dtype == jnp.float32
    # the bytes of the tree the real quantizer produces (eval_shape) == memplan's quantized estimate
    specs = P.flatten(P.param_specs(config))
    made = jax.eval_shape(lambda p: Q.quantize_tree(p, lambda path, x: P.release_format(path, specs[path])),
                          P.abstract_params(config, jnp.bfloat16))
    nbytes = sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(made))
    plan = M.plan(config, devices=1, weights="quantized", drafter="none")
    assert plan["weights_total"] == pytest.approx(nbytes, rel=0.05)
    assert plan["weights_total"] == nbytes                       # one description: exactly equal
    assert abs(nbytes / 2 ** 30 - 145.3) < 0.1                    # docs/checkpoint_formats.md §6
    # shardings: codes split like the dense twin, scales with them when whole 128-blocks land on each shard
    sizes = {"data": 1, "expert": 8, "model": 8}
    dense = P.flatten(S.param_partition_specs(config, sizes))
    quant_ps = P.flatten(S.param_partition_specs(config, sizes, formats=P.release_format))
    for path in ("segments.1.0.attn.wq_b", "segments.1.0.attn.wo_a", "segments.1.0.ffn.experts.w1",
                 "segments.1.0.ffn.shared_experts.w1"):
        assert quant_ps[path].codes == quant_ps[path].scale == dense[path], path


def test_shard_params_places_qarrays():
    config = SMALL
    _, q = _quantized_model(config)
    q = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if isinstance(x, Q.QArray) else x, q, is_leaf=Q.is_qarray)
    placed = S.shard_params(q, config, S.make_mesh())
    w = placed["segments"][0][0]["ffn"]["experts"]["w2"]
    assert isinstance(w, Q.QArray) and w.dtype == jnp.bfloat16 and w.codes.sharding.mesh.shape == S.make_mesh().shape


def test_decode_step_never_holds_a_dequantized_expert_stack():
    """The compiled decode step of a kept-quantized model has no f32 / bf16 buffer of shape [E, I, D] (or [E, D, I],
    or stacked [reps, E, ...]): the active experts' codes are gathered, then dequantized."""
    config = SMALL.replace(n_routed_experts=16, name="quant-hlo")
    E, I, Dm = config.n_routed_experts, config.moe_intermediate_size, config.hidden_size
    _, q = _quantized_model(config)
    assert isinstance(q["segments"][0][0]["ffn"]["experts"]["w1"], Q.QArray)
    state = init_state(config, 1, 32, 2, jnp.float32)
    tokens = jnp.zeros((1, 1), jnp.int32)
    text = D.process_block.lower(q, config, state, tokens, jnp.ones((1,), jnp.int32)).compile().as_text()
    pattern = re.compile(r"\b(f32|bf16)\[(\d+,)?(%d,%d,%d|%d,%d,%d)\]" % (E, I, Dm, E, Dm, I))
    assert "u8[" in text and not pattern.search(text), pattern.search(text)
    # the pattern does find a dequantized stack where one exists
    w1 = q["segments"][0][0]["ffn"]["experts"]["w1"]
    assert pattern.search(jax.jit(Q.dequantize).lower(jax.tree.map(lambda a: a[0], w1)).compile().as_text())
