"""Pallas TPU (Mosaic) kernels in TPU interpret mode on CPU vs numpy formulations of the spec.

MoE experts (decode over the active experts, grouped prefill) in every weight format, dequantized here with
ml_dtypes from the stored bytes; the lightning indexer's scores and exact top-k (ties to the lower row);
the BlockSpec traffic counts; the lowering to Mosaic (no libtpu needed); the backend wiring. The ahead-of-
time compiles for v5p / v6e at Flash shapes need libtpu and are `slow`.
"""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv4_jax import backends
from dsv4_jax.analysis import libtpu
from dsv4_jax.backends import Backends
from dsv4_jax.config import tiny
from dsv4_jax.kernels import moe_prefill, tpu_common, tpu_indexer, tpu_moe
from dsv4_jax.analysis import kernels_aot as tpu_aot
from dsv4_jax.model.layers import indexer as model_indexer
from dsv4_jax.model.layers import moe as moe_mod
from dsv4_jax.ops import indexer as ops_indexer
from dsv4_jax.ops import quant



# ---- numpy references (the spec, docs/model_math.md §2.8; docs/checkpoint_formats.md) ----


def np_dequant(fmt, codes, scale):
    codes = np.asarray(codes)
    if fmt == "dense":
        return codes.astype(np.float32)
    if fmt == "fp4_e2m1_b32":
        nib = np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(*codes.shape[:-1], -1)   # low nibble first
        vals = nib.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
        s = np.asarray(scale).view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
        return vals * np.repeat(s, 32, axis=-1)
    if fmt == "fp8_e4m3_b128":
        vals = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        s = np.asarray(scale).view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
        return vals * np.repeat(np.repeat(s, 128, axis=-2), 128, axis=-1)
    s = np.asarray(scale, np.float32)
    br, bc = codes.shape[-2] // s.shape[-2], codes.shape[-1] // s.shape[-1]
    return codes.astype(np.float32) * np.repeat(np.repeat(s, br, axis=-2), bc, axis=-1)


def np_experts(x, idx, w, W1, W2, W3, limit):
    """y[t] = Σ_j w[t,j] · W2[e] (silu(min(W1[e] x, L)) ⊙ clip(W3[e] x, −L, L)), e = idx[t,j] (float64)."""
    x = np.asarray(x, np.float64)
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(np.asarray(idx)[t]):
            g = np.minimum(W1[e] @ x[t], limit)
            u = np.clip(W3[e] @ x[t], -limit, limit)
            y[t] += float(w[t, j]) * (W2[e] @ (g / (1 + np.exp(-g)) * u))
    return y


def make_experts(fmt, E, D, I, seed=0):
    """Stored arrays (w1, w2, w3, w1_scale, w2_scale, w3_scale) of format fmt."""
    rng = np.random.default_rng(seed)
    shapes = {"w1": (E, I, D), "w2": (E, D, I), "w3": (E, I, D)}
    codes, scales = [], []
    for n in ("w1", "w2", "w3"):
        N, K = shapes[n][1:]
        if fmt in ("dense", "dense_bf16"):
            c = rng.normal(0, 0.15, shapes[n]).astype(np.float32)
            codes.append(jnp.asarray(c, jnp.bfloat16 if fmt == "dense_bf16" else jnp.float32))
            scales.append(None)
        elif fmt == "fp4_e2m1_b32":
            codes.append(jnp.asarray(rng.integers(0, 256, (E, N, K // 2)), jnp.uint8))
            scales.append(jnp.asarray(rng.integers(121, 126, (E, N, K // 32)), jnp.uint8))
        elif fmt == "fp8_e4m3_b128":
            vals = rng.normal(0, 2.0, shapes[n]).astype(ml_dtypes.float8_e4m3fn)
            codes.append(jnp.asarray(vals.view(np.uint8)))
            scales.append(jnp.asarray(rng.integers(121, 126, (E, N // 128, K // 128)), jnp.uint8))
        else:                                  # kernel formats: int8 per-channel, fp8 128-blocks
            qf = quant.QFormat("int8", (1, 0), "f32") if fmt == "int8" else quant.QFormat("e4m3", (128, 128), "f32")
            q = quant.quantize(jnp.asarray(rng.normal(0, 0.15, shapes[n]), jnp.float32), qf)
            codes.append(q.codes)
            scales.append(q.scale)
    return codes + scales


def routing(T, E, k, seed=0):
    rng = np.random.default_rng(seed + 100)
    idx = np.argsort(rng.random((T, E)), axis=-1)[:, :k].astype(np.int32)
    return idx, rng.uniform(0.1, 1.0, (T, k)).astype(np.float32)


def check_moe(fn, fmt, T, E, k, D, I, idx=None, seed=0, **kw):
    """fn (experts_decode / experts_prefill) on format fmt vs np_experts on the numpy-dequantized weights."""
    arrays = make_experts(fmt, E, D, I, seed)
    base = "dense" if fmt == "dense_bf16" else fmt
    W1, W2, W3 = (np_dequant(base, c, s) for c, s in zip(arrays[:3], arrays[3:]))
    rng = np.random.default_rng(seed + 7)
    bf16 = fmt != "dense"
    x = jnp.asarray(rng.normal(0, 1.0, (T, D)), jnp.bfloat16 if bf16 else jnp.float32)
    if idx is None:
        idx, w = routing(T, E, k, seed)
    else:
        w = rng.uniform(0.1, 1.0, idx.shape).astype(np.float32)
    x64 = np.asarray(x, np.float64)
    limit = float(np.quantile(np.abs(np.einsum("tkid,td->tki", W1[idx], x64)), 0.7))   # clamps active
    out = fn(x, jnp.asarray(idx), jnp.asarray(w), tuple(arrays[:3]), tuple(arrays[3:]),
             tpu_moe.Spec(limit, base, interpret=True, **kw))
    ref = np_experts(x64, idx, w, W1, W2, W3, limit=limit)
    tol = 3e-2 if bf16 else 1e-4          # bf16: activations and dequantized weights rounded for the MXU
    err = np.abs(np.asarray(out, np.float64) - ref).max() / np.abs(ref).max()
    assert out.shape == (T, D) and out.dtype == x.dtype
    assert err < tol, (fmt, err)


E, K = 6, 2


@pytest.mark.parametrize("fmt", ["dense", "int8", "fp8_e4m3_b128", "fp4_e2m1_b32",
                                 pytest.param("dense_bf16", marks=pytest.mark.slow),
                                 pytest.param("fp8", marks=pytest.mark.slow)])
def test_decode_matches_numpy(fmt):
    check_moe(tpu_moe.experts_decode, fmt, T=3, E=E, k=K, D=128, I=256, block_i=128)


@pytest.mark.parametrize("fmt", ["dense_bf16", "fp4_e2m1_b32",        # block scales: decode fp8_e4m3_b128
                                 pytest.param("fp8", marks=pytest.mark.slow),
                                 pytest.param("int8", marks=pytest.mark.slow),
                                 pytest.param("fp8_e4m3_b128", marks=pytest.mark.slow)])
def test_prefill_matches_numpy(fmt):
    check_moe(tpu_moe.experts_prefill, fmt, T=5, E=E, k=K, D=128, I=256, block_m=8, block_n=(128, 128))


def test_prefill_empty_groups_many_row_tiles_odd_tail():
    # 21 tokens on experts {0, 1, 2} only: 3 of 6 experts get no rows, each used expert spans 3 row tiles of 8
    # and its last tile is partly padding
    idx = np.stack([np.arange(21) % 3, (np.arange(21) + 1) % 3], axis=1).astype(np.int32)
    check_moe(tpu_moe.experts_prefill, "dense", T=21, E=E, k=K, D=64, I=128, idx=idx, block_m=8,
              block_n=(64, 32))


def test_decode_repeated_expert_and_fp4_row_major_scales():
    # K = 4096 for w1/w3: 128 scale groups, read as stored [E, I, 128] (w2's 2 groups are read transposed);
    # both tokens route to the same experts (one slot each, several tokens per slot)
    idx = np.array([[1, 0], [0, 1]], np.int32)
    check_moe(tpu_moe.experts_decode, "fp4_e2m1_b32", T=2, E=3, k=2, D=4096, I=64, idx=idx, block_i=64)


# ---- traffic: only the active experts' bytes, once ----


def _plan_decode(fmt, T, E, D, I, k):
    arrays = tpu_aot.expert_arrays(fmt, tpu_aot.Shapes(n_experts=E, top_k=k, hidden=D, moe_inter=I), None)
    ex = tpu_moe.abstract_experts(*arrays[:3], arrays[3:], fmt)
    return tpu_moe.decode_plan((T, D), jnp.bfloat16, (T, k), ex, block_i=128), arrays


@pytest.mark.parametrize("fmt", ["dense", "fp4_e2m1_b32"])
def test_decode_traffic_is_the_active_experts_once(fmt):
    E, D, I, k = 8, 256, 512, 2
    plan, arrays = _plan_decode(fmt, 4, E, D, I, k)
    splits = plan[0][0]                 # each TensorCore of the split reads the blocks that span all of I
    assert splits == 2
    for idx, active in (([[3, 5], [5, 3], [3, 5], [5, 3]], 2), ([[0, 1], [2, 3], [4, 5], [6, 7]], 8)):
        t = tpu_moe.decode_traffic(plan, np.array(idx, np.int32))
        for name, a in zip(("w1", "w2", "w3", "w1_scale", "w2_scale", "w3_scale"), arrays):
            if a is not None:
                copies = splits if name == "w2_scale" else 1
                assert t[name] == copies * active * int(np.prod(a.shape)) // E * a.dtype.itemsize, (name, active)


def test_prefill_traffic_reads_each_used_expert_once_per_column_tile():
    E, D, I, k, T = 8, 256, 512, 2, 40
    arrays = tpu_aot.expert_arrays("dense", tpu_aot.Shapes(n_experts=E, top_k=k, hidden=D, moe_inter=I), None)
    ex = tpu_moe.abstract_experts(*arrays[:3], arrays[3:], "dense")
    idx = np.stack([np.arange(T) % 3, 3 + np.arange(T) % 2], 1).astype(np.int32)     # experts 0..4 used
    M = moe_prefill.padded_rows(T * k, E, 8)
    plans = tpu_moe.prefill_plans(M, jnp.bfloat16, ex, block_m=8, block_n=(128, 128))
    t = tpu_moe.prefill_traffic(plans, idx, E, 8)
    per_expert = I * D * 2
    assert t["gate_up.w1"] == t["gate_up.w3"] == t["down.w2"] == 5 * per_expert


def test_indexer_traffic_stops_at_the_visible_rows():
    B, S, T, H, dI = 2, 1, 4096, 8, 128
    t = tpu_indexer.traffic(jax.ShapeDtypeStruct((B, S, H, dI), jnp.bfloat16),
                            jax.ShapeDtypeStruct((B, T, dI), jnp.bfloat16), None, np.array([300, 1500]),
                            blocks=(1, 512))
    assert t["keys"] == (512 + 1536) * dI * 2          # ⌈300/512⌉ and ⌈1500/512⌉ tiles, nothing past them
    assert t["scores"] == B * S * T * 4


# ---- indexer ----


def _np_scores(q, keys, om, lim):
    q, keys, om = (np.asarray(a, np.float64) for a in (q, keys, om))
    dots = np.maximum(np.einsum("bshd,btd->bsht", q, keys), 0) * q.shape[-1] ** -0.5
    sc = np.einsum("bsht,bsh->bst", dots, om)
    return np.where(np.arange(keys.shape[1])[None, None] < lim[..., None], sc, -np.inf)


def _indexer_case(B, S, T, H, dI, seed, ties=False):
    rng = np.random.default_rng(seed)
    if ties:     # small integers: exact float sums, many equal scores; some rows have all heads ReLU-dead
        q = rng.integers(-1, 2, (B, S, H, dI)).astype(np.float32)
        keys = rng.integers(-1, 2, (B, T, dI)).astype(np.float32)
        keys[:, 5] = -np.sign(q[:, 0].sum(1))
        om = rng.integers(1, 3, (B, S, H)).astype(np.float32) * dI ** 0.5 / 4
    else:
        q = rng.normal(size=(B, S, H, dI)).astype(np.float32)
        keys = rng.normal(size=(B, T, dI)).astype(np.float32)
        om = rng.normal(size=(B, S, H)).astype(np.float32)
    pos = rng.integers(0, 4 * T + 8, (B, S)).astype(np.int32)
    n_rows = np.array([T - 3, T // 2][:B], np.int32)
    lim = np.minimum(np.minimum((pos + 1) // 4, n_rows[:, None]), T)
    return q, keys, om, pos, n_rows, lim


@pytest.mark.parametrize("B,S,T,blocks", [(1, 1, 300, (1, 128)), (2, 19, 200, (8, 128))])
def test_indexer_scores_match_numpy(B, S, T, blocks):
    # partial last key tile, queries padded to the block, n_rows < T and per-query limits
    q, keys, om, pos, n_rows, lim = _indexer_case(B, S, T, 8, 32, seed=S)
    out = tpu_indexer.scores(jnp.asarray(q), jnp.asarray(keys), jnp.asarray(om), jnp.asarray(pos),
                             jnp.asarray(n_rows), ratio=4, interpret=True, blocks=blocks)
    ref = _np_scores(q, keys, om, lim)
    np.testing.assert_array_equal(np.isfinite(out), np.isfinite(ref))
    fin = np.isfinite(ref)
    np.testing.assert_allclose(np.where(fin, out, 0), np.where(fin, ref, 0), rtol=1e-5, atol=1e-5)


def test_indexer_select_exact_topk_with_ties():
    B, S, T, k = 2, 3, 256, 24
    q, keys, om, pos, n_rows, lim = _indexer_case(B, S, T, 4, 16, seed=3, ties=True)
    sc = tpu_indexer.scores(jnp.asarray(q), jnp.asarray(keys), jnp.asarray(om), jnp.asarray(pos),
                            jnp.asarray(n_rows), ratio=4, interpret=True, blocks=(8, 128))
    idx, found = ops_indexer.topk(sc, k, chunk=64)                       # two-stage: T > chunk
    ref = _np_scores(q, keys, om, lim)
    for b in range(B):
        for s in range(S):
            order = sorted(range(T), key=lambda t: (-ref[b, s, t], t))[:k]   # value desc, lower row first
            want = [t for t in order if np.isfinite(ref[b, s, t])]
            got = [int(t) for t, f in zip(idx[b, s], found[b, s]) if f]
            assert got == want, (b, s)
    assert np.sum(ref == 0) > 0 and len(np.unique(ref[np.isfinite(ref)])) < ref[np.isfinite(ref)].size / 4


# ---- wiring ----


def test_backends_tpu_resolution():
    b = backends.resolve("auto", platform="tpu")
    assert (b.moe, b.routing, b.indexer, b.interpret) == ("pallas_tpu", "reference", "pallas_tpu", False)
    b = backends.resolve("pallas_tpu", platform="cpu")
    assert (b.moe, b.routing, b.indexer, b.interpret) == ("pallas_tpu", "reference", "pallas_tpu", True)
    assert backends.resolve("pallas_tpu", platform="gpu").interpret
    assert not backends.resolve(Backends(moe="pallas_tpu"), platform="tpu").interpret
    assert backends.resolve("auto", platform="gpu") == Backends("pallas", "pallas", "pallas", unroll_sinkhorn=True)
    with pytest.raises(backends.BackendError, match="routing"):
        Backends(routing="pallas_tpu")


@pytest.mark.parametrize("S", [1, pytest.param(20, marks=pytest.mark.slow)])    # decode kernel / grouped matmul
def test_model_moe_pallas_tpu_equals_reference(S):
    cfg = tiny()
    from tests.test_kernels_moe import _moe_layer_params
    layer = _moe_layer_params(cfg)
    h = jax.random.normal(jax.random.key(1), (1, S, cfg.hidden_size))
    tokens = jnp.arange(S)[None] % cfg.vocab_size
    run = {impl: jax.jit(lambda h, impl=impl: moe_mod.moe(h, tokens, layer, cfg.with_backends(
        Backends(moe=impl, interpret=True)), "moe"))(h) for impl in ("pallas_tpu", "reference")}
    np.testing.assert_allclose(run["pallas_tpu"], run["reference"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["fp4_e2m1_b32", "q8_0"])   # QArray experts: the FP4 kernel / Q8_0 fallback
def test_model_moe_pallas_tpu_takes_qarray_experts(name):
    cfg = tiny().replace(moe_intermediate_size=64)             # FP4 tiles need K multiples of 64
    from tests.test_kernels_moe import _moe_layer_params
    layer = _moe_layer_params(cfg)
    layer["experts"] = {n: quant.quantize(w, quant.qformat(name)) for n, w in layer["experts"].items()}
    assert tpu_moe.supports(layer["experts"]) == (name != "q8_0")
    h = jax.random.normal(jax.random.key(1), (1, 1, cfg.hidden_size))
    tokens = jnp.zeros((1, 1), jnp.int32)
    run = {impl: jax.jit(lambda h, impl=impl: moe_mod.moe(h, tokens, layer, cfg.with_backends(
        Backends(moe=impl, interpret=True)), "moe"))(h) for impl in ("pallas_tpu", "reference")}
    np.testing.assert_allclose(run["pallas_tpu"], run["reference"], rtol=1e-4, atol=1e-4)


def test_model_indexer_pallas_tpu_equals_reference():
    cfg = tiny().replace(index_topk=5)
    H, d = cfg.index_n_heads, cfg.index_head_dim
    p = {"weights_proj": jax.random.normal(jax.random.key(5), (H, cfg.hidden_size)) * 0.3}
    ks = jax.random.split(jax.random.key(6), 3)
    q = jax.random.normal(ks[0], (2, 3, H, d))
    keys = jax.random.normal(ks[1], (2, 40, d))
    h = jax.random.normal(ks[2], (2, 3, cfg.hidden_size))
    pos = jnp.array([[40, 80, 159], [3, 100, 150]])
    out = {impl: jax.jit(lambda q, keys, h, c=cfg.with_backends(Backends(indexer=impl, interpret=True)):
                         model_indexer.select(q, keys, h, p, c, pos, 4, jnp.array([40, 30])))(q, keys, h)
           for impl in ("pallas_tpu", "reference")}
    for a, b in zip(out["pallas_tpu"], out["reference"]):
        np.testing.assert_array_equal(a, b)


def test_bad_weight_formats_are_named():
    E, D, I = 2, 128, 128
    w = jnp.zeros((E, I, D), jnp.uint8)
    with pytest.raises(tpu_common.FormatError, match="w1: unknown weight format"):
        tpu_moe.prepare_experts(w, w, w, (None,) * 3, "fp5")
    with pytest.raises(tpu_common.FormatError, match="w2: fp4_e2m1_b32 scale"):
        ok = jnp.zeros((E, I, D // 32), jnp.uint8)
        tpu_moe.prepare_experts(w[..., :D // 2], w[..., :D // 2], w[..., :D // 2], (ok, ok[..., :1], ok),
                                "fp4_e2m1_b32")
    with pytest.raises(tpu_common.FormatError, match="w1: format int8 codes must be int8"):
        tpu_moe.prepare_experts(w, w, w, (jnp.ones((E, I, 1)),) * 3, "int8")
    with pytest.raises(tpu_common.FormatError, match="not supported by the TPU kernels"):
        c = jnp.zeros((E, I, D), jnp.int8)
        tpu_moe.prepare_experts(c, c, c, (jnp.ones((E, I // 8, D // 32)),) * 3, "int8")


# ---- Mosaic: lowering here (no libtpu), compiling with libtpu (slow) ----


@pytest.mark.parametrize("chip", [("TPU v5", 2), ("TPU v6 lite", 1)])
@pytest.mark.parametrize("fmt", tpu_aot.MOE_FORMATS + ("fp8",))
def test_kernels_lower_to_mosaic(fmt, chip):
    """Pallas -> Mosaic lowering for v5p / v6e chips: catches ops without a TPU lowering (Mosaic's own
    layout / tiling checks run in libtpu's compiler: the slow AOT test below)."""
    s = tpu_aot.Shapes(n_experts=4, top_k=2, hidden=256, moe_inter=256)
    dev = jax.sharding.AbstractDevice(device_kind=chip[0], num_cores=chip[1], platform="tpu")
    mesh = jax.sharding.AbstractMesh((1,), ("chip",), abstract_device=dev)
    for T, fn in ((3, tpu_moe.experts_decode), (40, tpu_moe.experts_prefill)):
        args = [jax.ShapeDtypeStruct((T, s.hidden), jnp.bfloat16), jax.ShapeDtypeStruct((T, 2), jnp.int32),
                jax.ShapeDtypeStruct((T, 2), jnp.float32)] + tpu_aot.expert_arrays(fmt, s, None)
        with jax.sharding.use_abstract_mesh(mesh):
            text = jax.jit(lambda x, i, w, *e: fn(x, i, w, e[:3], e[3:], tpu_moe.Spec(10.0, fmt))).trace(*args).lower(
                lowering_platforms=("tpu",)).as_text()
        assert text.count("tpu_custom_call") >= (1 if T == 3 else 2)
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(lambda q, k, om, p, n: tpu_indexer.scores(q, k, om, p, n, ratio=4)).trace(
            jax.ShapeDtypeStruct((2, 3, 64, 128), jnp.bfloat16), jax.ShapeDtypeStruct((2, 4096, 128), jnp.bfloat16),
            jax.ShapeDtypeStruct((2, 3, 64), jnp.float32), jax.ShapeDtypeStruct((2, 3), jnp.int32),
            jax.ShapeDtypeStruct((2,), jnp.int32)).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text


needs_libtpu = pytest.mark.skipif(not libtpu.available(), reason="libtpu is not installed")


@pytest.mark.slow
@needs_libtpu
@pytest.mark.parametrize("topology", ["v5p:2x2x1", "v6e:2x2"])
@pytest.mark.parametrize("case", tpu_aot.default_cases(), ids=lambda c: c.name.replace(" ", "_"))
def test_aot_compiles_at_flash_shapes(topology, case):
    rec = tpu_aot.compile_case(case, topology, reference=False)
    assert rec["compile_ok"], rec.get("error")
    mem = rec["compiled"]                                       # no copy of the weights or the cache
    assert mem["temp_bytes"] < max(64 * 2 ** 20, 0.5 * mem["argument_bytes"])
    for scenario in rec["blockspec_bytes"].values():
        assert scenario["total"] >= scenario["ideal"] * 0.99
        if case.kernel == "moe_decode" or (case.kernel.startswith("indexer") and case.queries == 1):
            assert scenario["total"] <= scenario["ideal"] * 1.05     # decode: the active experts / rows once
