"""Expert-parallel MoE backend (moe="ep"): static set-up, the local grouped matmuls against a numpy
formulation, the layer-unroll switch, sharding presets, and sharded runs on 8 forced host devices
(a subprocess, `tests/ep_checks.py`, like tests/test_sharding.py)."""

import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as PS

import dsv4_jax
from dsv4_jax import backends as B, config as C, parallel as S
from dsv4_jax.model import decode as D, params as P
from dsv4_jax.analysis import memplan as M, memplan_cli
from dsv4_jax.model.layers import experts as EX, moe_ep
from dsv4_jax.model.target import forward_jit
from dsv4_jax.ops import quant

from .eight_devices import run_checks

TOL = 1e-5


# ---- static set-up -------------------------------------------------------------------------------------

def test_backends_ep_validation_and_jit_key():
    mesh = S.make_mesh()
    with pytest.raises(B.BackendError, match="needs ep="):
        B.Backends(moe="ep")
    with pytest.raises(B.BackendError, match="local"):
        B.ExpertParallel(mesh, local="fastest")
    with pytest.raises(B.BackendError, match="Mesh"):
        B.ExpertParallel({"expert": 8})
    ep = B.ExpertParallel(mesh, B.ExpertParallel.freeze_rules({"experts": ["expert"]}))
    assert ep.rules_dict == {"experts": ("expert",)}
    a = B.Backends(moe="ep", ep=ep)
    b = B.Backends(moe="ep", ep=B.ExpertParallel(mesh, local="dense"))
    assert hash(a) != hash(b) and a != b and a == B.Backends(moe="ep", ep=ep)
    assert "ep(mesh" in a.describe() and "local=reference" in a.describe()
    assert "unroll_layers" in B.Backends(unroll_layers=True).describe()


def test_resolve_ep_local_per_platform():
    auto = B.Backends(moe="ep", ep=B.ExpertParallel(S.make_mesh(), local="auto"))
    assert not auto.resolved
    assert B.resolve(auto, "cpu").ep.local == "reference" and B.resolve(auto, "cpu").resolved
    assert B.resolve(auto, "tpu").ep.local == "dense"
    assert B.resolve(auto, "gpu").ep.local == "pallas" and not B.resolve(auto, "gpu").interpret
    pallas = auto.replace(ep=B.ExpertParallel(S.make_mesh(), local="pallas"))
    assert B.resolve(pallas, "cpu").interpret                     # Pallas on CPU runs interpreted
    mosaic = auto.replace(ep=B.ExpertParallel(S.make_mesh(), local="pallas_tpu"))
    assert B.resolve(mosaic, "cpu").interpret and not B.resolve(mosaic, "tpu").interpret


def test_resolve_ep_local_per_chip():
    """On TPU, "auto" follows the chip of the EP mesh's devices (`backends.EP_LOCAL_AUTO_BY_KIND`): the Mosaic
    kernels on v5p ("TPU v5": XLA there leaves the FP4 word decode unfused), XLA's dense matmul on v6e / v5e;
    the chip is not read off TPU."""
    chip = lambda kind: types.SimpleNamespace(devices=np.array([types.SimpleNamespace(device_kind=kind)]))
    assert B.ep_local_auto("tpu", chip("TPU v5")) == "pallas_tpu"
    assert B.ep_local_auto("tpu", chip("TPU v6 lite")) == "dense" == B.ep_local_auto("tpu", chip("TPU v5 lite"))
    assert B.ep_local_auto("gpu", chip("TPU v5")) == "pallas" and B.ep_local_auto("cpu", chip("cpu")) == "reference"


def test_presets():
    lat, thr = S.preset("latency"), S.preset("throughput")
    assert lat.mesh_shape(8) == (1, 1, 8) and thr.mesh_shape(8) == (1, 8, 1)
    assert S.preset(lat) is lat
    with pytest.raises(ValueError, match="unknown sharding preset"):
        S.preset("fast")
    flash = C.flash()
    spec = lambda pre: P.flatten(S.param_partition_specs(flash, dict(zip(S.MESH_AXES, pre.mesh_shape(8))),
                                                         pre.rules_dict))
    ls, ts = spec(lat), spec(thr)
    k = "segments.2.0.ffn.experts.w1"                              # [reps, E, I, D]
    assert ls[k] == PS(None, None, "model")                        # latency: each expert split along mlp
    assert ts[k] == PS(None, "expert")                             # throughput: whole experts split 8 ways
    assert ls["segments.2.0.attn.wq_b"] == PS(None, "model") and ts["segments.2.0.attn.wq_b"] == PS()
    assert ls["head"] == PS("model") and ts["head"] == PS()
    cfg = lat.apply(C.tiny(), S.make_mesh((1, 1, 1)))
    assert cfg.backends.moe == "ep" and cfg.backends.ep.rules == lat.rules and cfg.backends.resolved



def test_latency_preset_splits_every_large_matrix():
    """No device reads a whole non-expert matrix in the latency preset: every parameter of Flash with ≥ 2 dims
    (besides the stacking axis) and ≥ 64 Ki elements per layer is split over 'model' (the router, 1 Mi
    elements per layer, stays replicated: see sharding.LATENCY_SPLIT), and no preset splits the router."""
    flash, lat = C.flash(), S.preset("latency")
    sizes = dict(zip(S.MESH_AXES, lat.mesh_shape(8)))
    specs = P.flatten(S.param_partition_specs(flash, sizes, lat.rules_dict))
    whole = []
    for path, spec in P.flatten(P.param_specs(flash)).items():
        dims = spec.shape[1:] if spec.axes[0] == "layers" else spec.shape
        split = {a for e in specs[path] for a in (e if isinstance(e, tuple) else (e,))}
        if len(dims) >= 2 and np.prod(dims) >= 65536 and "model" not in split and ".gate." not in path:
            whole.append(path)
    assert not whole, whole
    wo_b = [k for k in specs if k.endswith("attn.wo_b")]           # [reps, D, G·R]: by output row, K whole
    assert wo_b and all(specs[k] == PS(None, "model") for k in wo_b), {k: specs[k] for k in wo_b}
    thr_sizes = dict(zip(S.MESH_AXES, S.preset("throughput").mesh_shape(8)))
    assert all(P.flatten(S.param_partition_specs(flash, thr_sizes, S.preset("throughput").rules_dict))[k] == PS()
               for k in wo_b)
    router = "segments.2.0.ffn.gate.weight"                        # [reps, E, D]
    assert specs[router] == PS()
    thr = S.preset("throughput")
    assert P.flatten(S.param_partition_specs(flash, dict(zip(S.MESH_AXES, thr.mesh_shape(8))),
                                             thr.rules_dict))[router] == PS()
    assert P.flatten(S.param_partition_specs(flash, {"expert": 8}))[router] == PS()


# ---- local grouped matmuls ---------------------------------------------------------------------------------

def _numpy_local(x, idx, w, local, w1, w2, w3, limit):
    """Σ over local assignments of w · W2[e] swiglu(W1[e] x, W3[e] x) (docs/model_math.md §2.8), float64 loops."""
    x, w1, w2, w3 = (np.asarray(a, np.float64) for a in (x, w1, w2, w3))
    out = np.zeros((x.shape[0], w2.shape[1]))
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            if not local[t, j]:
                continue
            e = idx[t, j]
            g, u = w1[e] @ x[t], w3[e] @ x[t]
            h = np.minimum(g, limit) / (1 + np.exp(-np.minimum(g, limit))) * np.clip(u, -limit, limit)
            out[t] += w[t, j] * (w2[e] @ h)
    return out


@pytest.fixture(scope="module")
def local_case():
    rng = np.random.default_rng(0)
    T, k, E, I, D = 5, 3, 4, 16, 8
    x = rng.standard_normal((T, D)).astype(np.float32)
    w1, w3 = (rng.standard_normal((E, I, D)).astype(np.float32) * 0.5 for _ in range(2))
    w2 = rng.standard_normal((E, D, I)).astype(np.float32) * 0.5
    idx = rng.integers(0, E, (T, k)).astype(np.int32)
    local = rng.random((T, k)) < 0.6
    w = (rng.random((T, k)) * local).astype(np.float32)
    return x, np.where(local, idx, 0), w, local, w1, w2, w3


@pytest.mark.parametrize("impl", ["sliced", "sorted", "dense", "pallas"])
def test_local_experts_match_numpy(local_case, impl):
    x, idx, w, local, w1, w2, w3 = local_case
    want = _numpy_local(x, idx, w, local, w1, w2, w3, 2.0)
    e = {"w1": jnp.asarray(w1), "w2": jnp.asarray(w2), "w3": jnp.asarray(w3)}
    if impl == "sliced":
        got = EX.experts_sliced(x, idx, w, w1, w2, w3, 2.0)
    elif impl == "sorted":
        got = EX.experts_sorted_local(EX.Assignments(x, idx, w, local), {"w1": w1, "w2": w2, "w3": w3}, 2.0)
    elif impl == "dense":
        got = EX.experts_dense(x, idx, w, w1, w2, w3, 2.0)
    else:
        got = moe_ep.local_experts(EX.Assignments(x, idx, w, local), e, EX.ExpertCall("pallas", 2.0, True))
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("impl", ["sliced", "tiled", "dense", "pallas"])
def test_local_experts_quantized_match_numpy(local_case, impl):
    """QArray experts (int8 codes, a float32 scale per output channel): every local path equals the numpy
    formulation on the dequantized weights codes · scale (dequantized here in numpy)."""
    x, idx, w, local, *dense = local_case
    qs = [quant.quantize(jnp.asarray(m), quant.INT8) for m in dense]
    deq = [np.asarray(q.codes, np.float64) * np.asarray(q.scale, np.float64) for q in qs]   # scale [E, N, 1]
    want = _numpy_local(x, idx, w, local, *deq, 2.0)
    e = dict(zip(("w1", "w2", "w3"), qs))
    n = {"sliced": 1, "tiled": 5, "dense": 5, "pallas": 5}[impl]      # 3 assignments <= E: slices; 15: many
    local_impl = {"sliced": "reference", "tiled": "reference"}.get(impl, impl)
    got = moe_ep.local_experts(EX.Assignments(x[:n], idx[:n], w[:n], local[:n]), e,
                               EX.ExpertCall(local_impl, 2.0, True))
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want[:n], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("group", [0, 256])
def test_local_experts_fp4_words_match_numpy(group):
    """FP4 experts in the uint32 word layout (`quant.to_words`, what the TPU AOT programs place under EP):
    the sliced (1 token), tiled and dense (5 tokens) local paths equal the numpy formulation on the
    numpy-decoded FP4 weights; with column groups, the w2 shard holding the second half of I (what a
    K-split shard holds) on the second half of the hidden units too."""
    rng = np.random.default_rng(2)
    T, k, E, I, D = 5, 3, 4, 512, 256                     # K (D for w1/w3, I for w2) a multiple of 256
    x = rng.standard_normal((T, D)).astype(np.float32) * 0.2
    ms = [rng.standard_normal(s).astype(np.float32) * 0.1 for s in ((E, I, D), (E, D, I), (E, I, D))]
    local = rng.random((T, k)) < 0.6
    idx = np.where(local, rng.integers(0, E, (T, k)), 0).astype(np.int32)
    w = (rng.random((T, k)) * local).astype(np.float32)
    qs = [quant.quantize(jnp.asarray(m), quant.FP4) for m in ms]
    deq = []
    for q in qs:                                          # numpy FP4 decode (ml_dtypes tables)
        c, sc = np.asarray(q.codes), np.asarray(q.scale)
        nib = np.stack([c & 0xF, c >> 4], -1).reshape(*c.shape[:-1], -1).astype(np.uint8)
        vals = nib.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
        deq.append(vals * np.repeat(sc.view(ml_dtypes.float8_e8m0fnu).astype(np.float64), 32, axis=-1))
    e = {n: quant.to_words(q, group if n == "w2" else 0) for n, q in zip(("w1", "w2", "w3"), qs)}
    for n_tok, impl in ((1, "reference"), (5, "reference"), (5, "dense")):
        got = moe_ep.local_experts(EX.Assignments(x[:n_tok], idx[:n_tok], w[:n_tok], local[:n_tok]), e,
                                   EX.ExpertCall(impl, 2.0, False))
        want = _numpy_local(x[:n_tok], idx[:n_tok], w[:n_tok], local[:n_tok], *deq, 2.0)
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
    if group:                                             # w2's second column group alone, as on its shard
        h = rng.standard_normal((1, I // 2)).astype(np.float32)
        shard = quant.QArray(e["w2"].codes[1, :, group // 8:], e["w2"].scale[1, :, group // 128:], quant.FP4_WORDS)
        np.testing.assert_allclose(np.asarray(quant.matmul_codes(jnp.asarray(h), shard)),
                                   h @ deq[1][1][:, I // 2:].T, rtol=2e-5, atol=2e-5)


def test_experts_each_matches_dense_formulation():
    """The all-experts path on FP4 word stacks (`experts_dense` -> `experts_each`: one expert slice at a
    time) equals the all-experts formulation on the dequantized stacks (float32, 1e-6), routing weights
    summed per (token, expert) when a token routes twice to one expert, and unrouted experts adding 0."""
    rng = np.random.default_rng(3)
    T, k, E, I, D = 6, 3, 5, 256, 256
    x = jnp.asarray(rng.standard_normal((T, D)).astype(np.float32) * 0.2)
    ms = [rng.standard_normal(s).astype(np.float32) * 0.1 for s in ((E, I, D), (E, D, I), (E, I, D))]
    qs = [quant.to_words(quant.quantize(jnp.asarray(m), quant.FP4)) for m in ms]
    idx = jnp.asarray(np.array([[0, 0, 1], [2, 3, 0], [1, 1, 1], [0, 2, 3], [3, 2, 1], [0, 1, 2]], np.int32))
    w = jnp.asarray(rng.random((T, k)).astype(np.float32))              # expert 4: never routed
    want = EX.experts_dense(x, idx, w, *(quant.dequantize(q, jnp.float32) for q in qs), 2.0)
    got = EX.experts_dense(x, idx, w, *qs, 2.0)
    assert got.dtype == jnp.float32 and float(jnp.max(jnp.abs(want))) > 0
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    cw = jnp.zeros((T, E), jnp.float32).at[jnp.arange(T)[:, None], idx].add(w)
    np.testing.assert_array_equal(np.asarray(EX.experts_each(x, cw, *qs, 2.0)), np.asarray(got))


def test_local_experts_pallas_tpu_interpreted():
    """The Mosaic kernels as the EP local matmul (TPU interpret mode): decode (1 token) and grouped (5 tokens)
    against the numpy formulation, foreign assignments as expert 0 with weight 0."""
    rng = np.random.default_rng(1)
    T, k, E, I, D = 5, 3, 4, 128, 128                    # kernel tiles want 128-wide matrices
    x = rng.standard_normal((T, D)).astype(np.float32)
    w1, w3 = (rng.standard_normal((E, I, D)).astype(np.float32) * 0.1 for _ in range(2))
    w2 = rng.standard_normal((E, D, I)).astype(np.float32) * 0.1
    local = rng.random((T, k)) < 0.6
    idx = np.where(local, rng.integers(0, E, (T, k)), 0).astype(np.int32)
    w = (rng.random((T, k)) * local).astype(np.float32)
    e = {"w1": jnp.asarray(w1), "w2": jnp.asarray(w2), "w3": jnp.asarray(w3)}
    for n in (1, T):
        got = moe_ep.local_experts(EX.Assignments(x[:n], idx[:n], w[:n], local[:n]), e,
                                   EX.ExpertCall("pallas_tpu", 2.0, True))
        np.testing.assert_allclose(np.asarray(got), _numpy_local(x[:n], idx[:n], w[:n], local[:n], w1, w2, w3, 2.0),
                                   rtol=2e-5, atol=2e-5)


def test_local_experts_read_a_layer_stack_in_place():
    """A segment's expert stack handed to the Mosaic kernels with the layer's index (`StackedExperts`, TPU
    interpret mode): decode (3 tokens) and grouped (17 tokens, T·k ≤ E_loc) read the stack in place through
    offset ids, a prefill-sized call (T·k ≫ E_loc) and the reference take the layer's slice; all equal the
    numpy formulation on layer `rep`."""
    from dsv4_jax.model.layers.stacked_experts import StackedExperts
    rng = np.random.default_rng(2)
    reps, T, k, E, I, D = 3, 40, 2, 40, 128, 128
    x = rng.standard_normal((T, D)).astype(np.float32)
    w1, w3 = (rng.standard_normal((reps, E, I, D)).astype(np.float32) * 0.1 for _ in range(2))
    w2 = rng.standard_normal((reps, E, D, I)).astype(np.float32) * 0.1
    local = rng.random((T, k)) < 0.7
    idx = np.where(local, rng.integers(0, E, (T, k)), 0).astype(np.int32)
    w = (rng.random((T, k)) * local).astype(np.float32)
    stack = StackedExperts({"w1": jnp.asarray(w1), "w2": jnp.asarray(w2), "w3": jnp.asarray(w3)}, jnp.int32(1))
    for n, in_place in ((3, True), (17, True), (T, False)):
        assert moe_ep.reads_stack_in_place("pallas_tpu", n, n * k, stack) == in_place
        want = _numpy_local(x[:n], idx[:n], w[:n], local[:n], w1[1], w2[1], w3[1], 2.0)
        for impl in ("pallas_tpu", "reference"):
            got = moe_ep.local_experts(EX.Assignments(x[:n], idx[:n], w[:n], local[:n]), stack,
                                       EX.ExpertCall(impl, 2.0, True))
            np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
    assert not moe_ep.reads_stack_in_place("reference", 3, 6, stack)


def test_one_dispatch_table_for_both_moe_paths():
    """The single-device MoE's implementations (`Backends.moe` but "ep") and the expert-parallel local matmuls
    (`ExpertParallel.local`) are the rows of one table, `experts.TABLE`."""
    from dsv4_jax import backends as B
    assert set(B.IMPLS["moe"]) - {"ep"} <= set(EX.TABLE) and set(B.EP_LOCAL) == set(EX.TABLE)


def test_local_experts_picks_slices_for_few_assignments(local_case):
    """`local_experts` (reference) equals the numpy formulation on both sides of the sliced / sorted switch."""
    x, idx, w, local, w1, w2, w3 = local_case
    e = {"w1": w1, "w2": w2, "w3": w3}
    for n in (1, 5):                                 # 3 ≤ E = 4 assignments: slices; 15: sorted
        got = moe_ep.local_experts(EX.Assignments(x[:n], idx[:n], w[:n], local[:n]), e,
                                   EX.ExpertCall("reference", 2.0, False))
        np.testing.assert_allclose(np.asarray(got), _numpy_local(x[:n], idx[:n], w[:n], local[:n], w1, w2, w3, 2.0),
                                   rtol=2e-5, atol=2e-5)


# ---- unrolled layer scans ------------------------------------------------------------------------------------

def _pairs(n: int):
    """tiny_flash_like with n HCA/CSA pairs (a scan of n reps for n >= 2)."""
    c = C.tiny_flash_like()
    L = 3 + 2 * n
    return c.replace(num_layers=L, layer_types=c.layer_types[:L], compress_ratios=c.compress_ratios[:L],
                     mlp_layer_types=c.mlp_layer_types[:L], name=f"pairs{n}")


def _flops(config, unroll: bool) -> float:
    config = config.with_backends(B.Backends(unroll_layers=unroll))
    params = jax.eval_shape(lambda: P.init_params(config, 0))
    cost = forward_jit.lower(params, config, jnp.zeros((1, 4), jnp.int32)).cost_analysis()   # no compile
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])


def test_unroll_layers_counts_every_layer_and_keeps_logits():
    """XLA's cost analysis counts a scan body once; with unroll_layers every rep of the pair scan counts."""
    config = _pairs(2)
    params = P.init_params(config, 0)
    tokens = jax.random.randint(jax.random.PRNGKey(0), (1, 6), 0, config.vocab_size)
    unrolled = config.with_backends(B.Backends(unroll_layers=True))
    np.testing.assert_allclose(np.asarray(dsv4_jax.forward(params, unrolled, tokens)),
                               np.asarray(dsv4_jax.forward(params, config, tokens)), rtol=TOL, atol=TOL)
    lg_u, st_u, _ = D.prefill(params, unrolled, tokens, max_len=16, max_block=4)   # state written back in place
    lg_s, st_s, _ = D.prefill(params, config, tokens, max_len=16, max_block=4)
    np.testing.assert_allclose(np.asarray(lg_u), np.asarray(lg_s), rtol=TOL, atol=TOL)
    for a, b in zip(jax.tree.leaves(st_u.layers), jax.tree.leaves(st_s.layers)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=TOL, atol=TOL)
    u1, u2, u3 = (_flops(_pairs(n), True) for n in (1, 2, 3))
    assert u3 - u2 == pytest.approx(u2 - u1, rel=1e-3) and u3 > u2 > u1      # unrolled: every pair counts once
    assert _flops(_pairs(3), False) == pytest.approx(_flops(_pairs(2), False), rel=1e-9)   # scanned: body once


# ---- memory plan ---------------------------------------------------------------------------------------------

def test_memplan_shows_presets(capsys):
    assert memplan_cli.main(["--sharding", "latency,throughput", "--devices", "8", "--dtype", "bf16"]) == 0
    text = capsys.readouterr().out
    assert "8 dev latency (1x1x8)" in text and "8 dev throughput (1x8x1)" in text
    config = C.flash()
    lat = M.plan(config, devices=8, mesh_shape=(1, 1, 8), rules=S.preset("latency").rules_dict, drafter="none")
    thr = M.plan(config, devices=8, mesh_shape=(1, 8, 1), rules=S.preset("throughput").rules_dict, drafter="none")
    experts = "routed experts"
    assert lat["parts"][experts]["per_device"] == pytest.approx(thr["parts"][experts]["per_device"])   # 1/8 each
    attn = "attention + shared expert"
    assert lat["parts"][attn]["per_device"] < thr["parts"][attn]["per_device"] / 4


# ---- sharded runs (subprocess with 8 host devices) ---------------------------------------------------------

def _run_checks(args, timeout):
    return run_checks("ep_checks.py", args, timeout)


def _assert_cases(res):
    lay = res["layouts"]
    assert lay["ep-1x8x1"] == {"tokens": str(PS("expert")), "w1": str(PS("expert")),
                               "gather": ["expert"], "reduce": [], "shared": [], "fold": True}
    assert lay["ep-1x2x4"]["w1"] == str(PS(("expert", "model")))
    assert lay["ep-1x2x4"]["gather"] == ["expert"] and lay["ep-1x2x4"]["reduce"] == ["model"]
    assert lay["ep-1x2x4"]["fold"]                              # shared expert's psum over model joins the routed one
    assert lay["ep-2x4x1"]["tokens"] == str(PS(("data", "expert"))) and lay["ep-2x4x1"]["gather"] == ["expert"]
    assert lay["latency"]["w1"] == str(PS(None, "model")) and lay["latency"]["gather"] == []
    assert lay["latency"]["reduce"] == ["model"] and lay["latency"]["fold"]
    assert lay["odd-1x2x4"]["w1"] == str(PS("expert", "model"))   # 6 experts: 2-way EP + mlp TP
    assert "embed" in lay["errors"]["embed-split"] and "shared expert" in lay["errors"]["shared-over-tokens"]
    for name, r in res.get("checkpoint", {}).items():              # load_checkpoint(path, sharding=name)
        assert r["bad"] == [] and r["split"] > 0 and r["moe"] == "ep", (name, r)
    for name, r in res["cases"].items():
        assert r["shard_map_in_program"], (name, r)
        # 6 experts on 1x8x1 fall back to replicated experts (pure data parallelism); the rest split weights
        assert (r["split_param_leaves"] == 0) if name == "odd-1x8x1" else (r["split_param_leaves"] > 0), (name, r)
        assert r["forward"] <= TOL, (name, r)
        assert r["forward_expert_all_gathers"] == 0, (name, r)        # tokens move, expert weights never do
        ctl = r["detector_control"]                                   # ... and the check sees a deliberate one
        assert (ctl is None) if name == "odd-1x8x1" or r["quantized"] else (ctl >= 1), (name, r)
        assert (r["qarray_leaves"] > 0) == bool(r["quantized"]), (name, r)
        if "decode" in r:
            # the state's rows reach |4| after a few layers: float32 parity relative to their magnitude
            assert r["decode"] <= TOL and r["state"] <= TOL * max(1.0, r["state_scale"]) and r["pos_equal"], (name, r)
            if name == "latency":                                     # the state split by sequence (B = 8)
                assert r["state_split_leaves"] > 0, r
            assert r["decode_expert_all_gathers"] == 0, (name, r)
        for key in ("gen-oracle", "gen-mtp"):
            if key in r:
                g = r[key]
                assert g["same_tokens"] and g["same_accepted"] and g["same_rounds"], (name, key, g)
                assert g["single_device_equals_plain"], (name, key, g)     # greedy speculative: lossless
                assert min(g["lengths"]) < max(g["lengths"]), g          # a sequence finished early (EOS)
                assert 0 < g["accepted"] < g["drafted"], g               # drafts accepted and rejected


def test_ep_matches_single_device():
    """Forward logits on EP x TP 1x2x4 (dense local matmul), the latency preset and an expert count that does
    not split (replicated fallback), with no expert weights
    all-gathered; greedy speculative generation (oracle drafter: verify blocks of k+1 = 4, a sequence
    finished by EOS in the batch) with the latency preset; prefill, decode, verify and commit with the latency
    preset at B = 8 (its decode state split by sequence). The other cases, decode steps, MTP and the
    checkpoint restore: the slow test."""
    res = _run_checks([], timeout=900)
    _assert_cases(res)
    assert set(res["cases"]) == {"ep-1x2x4", "latency", "odd-1x8x1"}   # the rest: --full
    assert "gen-oracle" in res["cases"]["latency"] and "decode" in res["cases"]["latency"]


@pytest.mark.slow
def test_ep_matches_single_device_full():
    """Every check on every case (also EP 1x8x1 / 2x4x1, the throughput preset with interpreted Pallas local
    matmuls, odd experts on 1x2x4, int8 on 1x2x4), greedy speculative generation with the MTP drafter (its
    MoE runs EP too), and a converted checkpoint restored with load_checkpoint(path, sharding=preset) for
    both presets."""
    res = _run_checks(["--full"], timeout=3600)
    _assert_cases(res)
    assert res["checkpoint"]["latency"]["mesh"] == [1, 1, 8] and res["checkpoint"]["throughput"]["mesh"] == [1, 8, 1]
    assert "int8-1x2x4" in res["cases"] and all("gen-mtp" in r and "decode" in r for r in res["cases"].values())


def test_research_cli_sharding_option():
    """--sharding places the model with the preset (one device here) and the EP backend gives the same logits."""
    import argparse
    from dsv4_jax.research import models
    p = argparse.ArgumentParser()
    models.add_model_args(p)
    a = p.parse_args(["--random-tiny", "--sharding", "latency"])
    m = models.load_model(a)
    plain = models.load_model(p.parse_args(["--random-tiny"]))
    assert m.sharding == "latency" and m.describe()["sharding"] == "latency" and plain.sharding is None
    assert m.config.backends.moe == "ep" and plain.config.backends.moe == "reference"
    tokens = jnp.asarray([[1, 5, 9, 200, 7, 3]], jnp.int32)
    target = lambda params: {k: v for k, v in params.items() if k not in ("mtp", "dspark")}
    np.testing.assert_allclose(np.asarray(dsv4_jax.forward(target(m.params), m.config, tokens)),
                               np.asarray(dsv4_jax.forward(target(plain.params), plain.config, tokens)),
                               rtol=TOL, atol=TOL)
    with pytest.raises(SystemExit):
        p.parse_args(["--random-tiny", "--sharding", "fastest"])
