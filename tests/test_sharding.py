"""Sharding rules, sharded runs on 8 forced host devices, restore into shardings, and the memory plan.

The sharded runs need `--xla_force_host_platform_device_count=8` before jax initialises, and this
pytest process already has jax with one device, so they run in a subprocess
(`tests/sharding_checks.py`) whose JSON result is asserted here.
"""
import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as PS

from dsv4_jax.model import state as cache, params as P
from dsv4_jax import config as C, parallel as S
from dsv4_jax.analysis import memplan as M, memplan_cli

from .eight_devices import run_checks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-5
GIB = 1024 ** 3


# ---- rules -----------------------------------------------------------------------------------------

def test_partition_spec_greedy_with_fallback():
    sizes = {"data": 2, "expert": 4, "model": 2}
    ps = S.partition_spec
    assert ps((16, 8, 64), ("experts", "mlp", "embed"), sizes) == PS(("expert", "model"))
    assert ps((4, 8, 64), ("experts", "mlp", "embed"), sizes) == PS("expert", "model")   # 4 % 8: model left for mlp
    assert ps((6, 8), ("experts", "mlp"), sizes) == PS("model")                         # 6 % 4: expert skipped
    assert ps((5, 8), ("experts", "mlp"), sizes) == PS(None, "model")                   # 5: experts replicated
    assert ps((97, 64), ("vocab", "embed"), sizes) == PS()                              # odd vocab: replicated
    assert ps((3, 4, 5), ("layers", "batch", None), sizes) == PS(None, "data")          # 4 % (2·4): data only
    assert ps((8,), ("batch",), {"data": 1, "expert": 8, "model": 1}) == PS("expert")   # size-1 axes skipped
    assert ps((8, 8), ("experts", "mlp"), sizes, rules={"mlp": ("model",)}) == PS(None, "model")
    with pytest.raises(ValueError):
        ps((8,), ("experts", "mlp"), sizes)


def _all_divide(specs_tree, shapes_tree, sizes):
    for spec, shape in zip(jax.tree.leaves(specs_tree, is_leaf=lambda x: isinstance(x, PS)),
                           jax.tree.leaves(shapes_tree)):
        for dim, entry in zip(shape.shape, tuple(spec)):
            axes = entry if isinstance(entry, tuple) else (entry,)
            n = math.prod(sizes[a] for a in axes if a is not None)
            assert dim % n == 0, (shape, spec)


@pytest.mark.parametrize("shape", [(1, 8, 1), (1, 1, 8), (2, 2, 4), (1, 16, 1), (2, 4, 2)])
def test_flash_rules(shape):
    config = C.flash()
    sizes = dict(zip(S.MESH_AXES, shape))
    specs = S.param_partition_specs(config, sizes)
    assert jax.tree.structure(specs, is_leaf=lambda x: isinstance(x, PS)) == \
        jax.tree.structure(P.abstract_params(config))
    _all_divide(specs, P.abstract_params(config), sizes)
    flat = P.flatten(specs)
    e, m = sizes["expert"], sizes["model"]
    ep = tuple(a for a, n in (("expert", e), ("model", m)) if n > 1)
    want_experts = PS(None, ep[0] if len(ep) == 1 else ep) if ep else PS()
    for k, v in flat.items():
        if ".ffn.experts." in k:
            assert v == want_experts, (k, v)                               # expert parallel, stacked axis whole
        elif k.endswith((".ffn.gate.weight", ".ffn.gate.bias")) or k.endswith("norm") or ".hc_" in k:
            assert v == PS(), (k, v)                                       # router and small leaves replicated
    tp = PS(None, "model") if m > 1 else PS()
    assert flat["segments.1.0.attn.wq_b"] == tp                            # heads
    assert flat["segments.1.0.attn.wo_a"] == tp                            # O-LoRA groups
    assert flat["segments.1.0.attn.indexer.wq_b"] == tp                    # indexer heads
    assert flat["embed"] == flat["head"] == (PS("model") if m > 1 else PS())   # vocabulary
    assert flat["segments.1.0.attn.wkv"] == PS()                           # the one K=V head: replicated


def test_state_specs_batch_split_pos_replicated():
    config = C.tiny_flash_like()
    shapes = cache.state_shapes(config, 4, 32, 4)
    specs = S.state_partition_specs(shapes, {"data": 2, "expert": 2, "model": 2})
    assert specs.pos == PS()
    for sp in jax.tree.leaves(specs.layers, is_leaf=lambda x: isinstance(x, PS)):
        assert sp == PS(None, ("data", "expert"))
    specs = S.state_partition_specs(cache.state_shapes(config, 3, 32, 4), {"data": 2, "expert": 1, "model": 4})
    assert all(sp == PS() for sp in jax.tree.leaves(specs.layers, is_leaf=lambda x: isinstance(x, PS)))


def test_one_device_mesh_and_shardings():
    config = C.tiny()
    mesh = S.make_mesh()
    assert mesh.axis_names == S.MESH_AXES and mesh.devices.size == jax.device_count()
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    sh = S.param_shardings(config, mesh)
    params = P.init_params(config, 0)
    assert jax.tree.structure(sh) == jax.tree.structure(params)
    placed = S.shard_params(params, config, mesh)
    for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(params)):
        assert a.sharding.mesh == mesh and (a == b).all()
    st = S.init_sharded_state(config, mesh, 2, 16, 4)
    ref = cache.init_state(config, 2, 16, 4)
    assert all((a == b).all() for a, b in zip(jax.tree.leaves(st), jax.tree.leaves(ref)))
    with pytest.raises(ValueError):
        S.make_mesh((2, 2, 2))
    assert S.make_mesh((1, -1, 1)).shape["expert"] == jax.device_count()


def test_initialize_distributed_single_process_is_noop(monkeypatch):
    for k in ("DSV4_COORDINATOR", "DSV4_NUM_PROCESSES", "DSV4_PROCESS_ID", "DSV4_LOCAL_DEVICE_IDS",
              "TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS", "OMPI_COMM_WORLD_SIZE", "SLURM_JOB_ID"):
        monkeypatch.delenv(k, raising=False)
    assert S.initialize_distributed() is False
    monkeypatch.setenv("DSV4_NUM_PROCESSES", "1")
    assert S.initialize_distributed() is False
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    monkeypatch.setenv("DSV4_COORDINATOR", "10.0.0.1:1234")
    monkeypatch.setenv("DSV4_NUM_PROCESSES", "2")
    monkeypatch.setenv("DSV4_PROCESS_ID", "1")
    assert S.initialize_distributed() is True
    assert calls == [{"coordinator_address": "10.0.0.1:1234", "num_processes": 2, "process_id": 1,
                      "local_device_ids": None}]


# ---- sharded runs (subprocess with 8 host devices) ----------------------------------------------------

def _run_checks(args, fast_compile: bool, timeout: int):
    return run_checks("sharding_checks.py", args, timeout, fast_compile)


def _assert_runs(runs, decode_meshes):
    for name, r in runs.items():
        assert r["split_param_leaves"] > 0, name
        assert r["forward"] <= TOL, (name, r)
        if name in decode_meshes:
            assert r["decode"] <= TOL and r["hidden"] <= TOL and r["state"] <= TOL, (name, r)
            assert r["pos_equal"] and r["state_sharding_kept"], (name, r)
            assert r.get("prefill_unplaced_state", 0.0) <= TOL, (name, r)
            if name.startswith("2x"):          # batch 2 splits over data = 2 (not over expert = 8)
                assert r["split_state_leaves"] > 0, (name, r)
    assert runs["1x8x1"]["split_param_leaves"] < runs["1x1x8"]["split_param_leaves"]   # EP only vs TP + EP


def _assert_restore(restore):
    for name, r in restore.items():
        assert r["bad"] == [], (name, r)
        assert r["split_leaves"] > 0 and r["shards_checked"] >= 8 * r["leaves"], (name, r)
        if "forward" in r:
            assert r["forward"] <= TOL, (name, r)
        q = r["quantized"]                       # keep_quantized=True: QArrays sharded like their dense twins
        assert q["bad"] == [] and q["split_codes"] > 0, (name, q)
        assert q["formats"] == ["fp4_e2m1_b32", "fp8_e4m3_b128"] and q["quantized_leaves"] >= 10, (name, q)
        if "forward" in q:
            assert q["forward"] <= TOL, (name, q)


@pytest.fixture(scope="module")
def fast_checks():
    """One 8-device process for the fast checks (the sharded runs, the restore and the FP4 word layout)."""
    return _run_checks(["--fast", "--only", "forward,decode,restore,expert_words"], fast_compile=True, timeout=1200)


def test_sharded_matches_single_device(fast_checks):
    """EP (1x8x1), TP (1x1x8) and mixed (2x2x2) meshes: forward logits; prefill + decode + verify + commit
    logits, hidden and state on 2x2x2; a keep-quantized checkpoint restored into the 2x2x2 shardings
    (every leaf's spec, every shard's shape and values)."""
    res = fast_checks
    _assert_runs(res["runs"], {"2x2x2"})
    assert set(res["runs"]) == {"1x8x1", "1x1x8", "2x2x2"}
    _assert_restore(res["restore"])


@pytest.mark.slow
def test_sharded_matches_single_device_full():
    """Every check on every mesh with default compiler flags, plus greedy speculative decoding (MTP)."""
    res = _run_checks(["--meshes", "1x8x1,1x1x8,2x2x2,2x1x4"], fast_compile=False, timeout=1800)
    _assert_runs(res["runs"], set(res["runs"]))
    _assert_restore(res["restore"])
    assert set(res["restore"]) == set(res["runs"])
    gen = res["generate"]
    assert gen["available"], gen          # the speculative loop (dsv4_jax.generate) must be importable
    for name in res["runs"]:
        assert gen[name]["same_tokens"] and gen[name]["same_accepted"], (name, gen)


def test_expert_words_follow_the_ep_local_matmul():
    """The loader converts routed FP4 experts to words for the XLA local matmul a TPU preset resolves to
    ("dense"), not for the Pallas kernels (uint8 codes) nor without expert parallelism; a leaf's word group is
    its shard of the contraction dim (0 when not split)."""
    from dsv4_jax.backends import REFERENCE, ExpertParallel
    from dsv4_jax.ops import quant
    from dsv4_jax.parallel.expert_words import shard_group
    mesh = S.make_mesh((1, 1, 1))
    ep = lambda local: REFERENCE.replace(moe="ep", ep=ExpertParallel(mesh=mesh, local=local))
    assert [S.wants_words(b) for b in (ep("dense"), ep("pallas"), ep("pallas_tpu"), ep("reference"), REFERENCE,
                                       None)] == [True, False, False, False, False, False]
    q = quant.quantize(jnp.ones((2, 8, 512), jnp.float32), quant.FP4)
    assert shard_group(q) == 0


def test_k_major_experts_keep_their_layout_into_jit_and_compute_the_same():
    """`expert_words.for_run` on TPU's rule (forced here on the CPU, which also takes custom layouts): the routed
    FP4 stack becomes words with codes and scales stored contraction-dim major, the same values; a jitted
    matmul compiles for that input layout (jit takes a committed array's layout) and equals the default-layout
    words' and the uint8 codes' results."""
    import numpy as np
    from dsv4_jax.ops import quant
    from dsv4_jax.parallel import expert_words
    w = jax.random.normal(jax.random.PRNGKey(0), (3, 16, 512), jnp.float32)
    codes = {"ffn": {"experts": {"w1": jax.device_put(quant.quantize(w, quant.FP4))}},
             "shared": jax.device_put(quant.quantize(w[0], quant.FP4))}
    held = expert_words.for_run(codes, None, "tpu", words=True)
    plain = expert_words.for_run(codes, None, "cpu", words=True)
    q, p = held["ffn"]["experts"]["w1"], plain["ffn"]["experts"]["w1"]
    assert q.fmt == p.fmt == quant.FP4_WORDS and held["shared"] is codes["shared"]
    for a in (q.codes, q.scale):
        assert a.format.layout.major_to_minor == (0, 2, 1)
    assert p.codes.format.layout.major_to_minor == (0, 1, 2)                     # row-major
    np.testing.assert_array_equal(np.asarray(q.codes), np.asarray(p.codes))
    x = jax.random.normal(jax.random.PRNGKey(1), (4, 512), jnp.float32)
    f = jax.jit(lambda t, x: quant.matmul_codes(x, quant.take(t, 1)))
    assert f.lower(q, x).compile().input_formats[0][0].codes.layout.major_to_minor == (0, 2, 1)
    got, want = np.asarray(f(q, x)), np.asarray(f(p, x))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got, np.asarray(f(codes["ffn"]["experts"]["w1"], x)), rtol=1e-5, atol=1e-5)


def test_release_experts_load_as_words_on_the_presets(fast_checks):
    """load_checkpoint(keep_quantized=True, sharding=preset, expert_words=True) on 8 devices: routed FP4 experts
    (target and MTP) whose contraction dim holds whole 256-column groups per shard come back in the uint32 word
    layout with the uint8 codes' partition specs and the same values (exact), and the forward logits equal the
    codes' (≤ 1e-6; measured 0) and the single-device dense model's (≤ 5e-5 relative to the largest logit: the
    presets' f32 sums run in another order at hidden 256, measured 9e-7 (latency) and 6e-7 (throughput) relative
    on `sharding_checks.words_config`'s one layer, 1.8e-5 and 0 on the three layers it had before); placed by
    TPU's rule (`expert_words.for_run`, forced on the CPU: words stored contraction-dim major) the logits equal
    the default-layout words' (≤ 1e-6)."""
    res = fast_checks["expert_words"]
    assert set(res) == {"latency", "throughput"}
    for name, r in res.items():
        assert r["bad"] == [] and r["converted"] >= 3 and r["converted_mtp"] >= 1, (name, r)
        assert r["words_vs_codes"] <= 1e-6, (name, r)
        assert r["held_k_major"] and r["held_vs_words"] <= 1e-6, (name, r)    # TPU's layout: same logits
        assert r["words_vs_single"] <= 5e-5 * r["logit_scale"], (name, r)


# ---- memory plan ----------------------------------------------------------------------------------------

def test_memplan_flash_bf16_one_device():
    config = C.flash()
    p = M.plan(config, devices=1, weights="bf16", drafter="none", batch=1, context=4096)
    n = P.count_params(config)
    assert abs(n - 284.33e9) < 0.01e9
    specs = P.flatten(P.param_specs(config))
    f32 = sum(math.prod(s.shape) for s in specs.values() if s.kind != "weight")
    assert p["weights_total"] == 2 * (n - f32) + 4 * f32
    assert abs(p["weights_total"] / GIB - 529.7) < 0.1                      # docs/checkpoint_formats.md §6
    assert p["parts"]["decode state"]["total"] == cache.state_bytes(config, 1, 4096, 8, jnp.bfloat16)["total"]
    assert p["per_device"] == p["total"]


def test_memplan_flash_quantized_and_per_device():
    config = C.flash()
    q1 = M.plan(config, devices=1, weights="quantized", drafter="mtp")
    assert abs((q1["weights_total"] - q1["parts"]["drafter (mtp)"]["total"]) / GIB - 145.3) < 0.1   # docs/checkpoint_formats.md §0 / §6
    assert abs(q1["parts"]["drafter (mtp)"]["total"] / GIB - 3.3) < 0.1
    experts = q1["parts"]["routed experts"]["total"]
    assert experts == pytest.approx(43 * 3 * 256 * 2048 * 4096 * (0.5 + 1 / 32), rel=1e-12)
    for n in (8, 16):
        qn = M.plan(config, devices=n, weights="quantized", drafter="mtp")
        assert qn["parts"]["routed experts"]["per_device"] == pytest.approx(experts / n, rel=1e-12)
        attn = "attention + shared expert"
        assert qn["parts"][attn]["per_device"] == q1["parts"][attn]["total"]
        assert qn["total"] == pytest.approx(q1["total"], rel=1e-12)
    q8 = M.plan(config, devices=8, weights="quantized", drafter="none")
    assert abs((q8["per_device"] - q8["parts"]["decode state"]["per_device"]) / GIB - 25.4) < 0.1   # §6 "per chip on 8"
    b8 = M.plan(config, devices=8, weights="bf16", drafter="none")
    assert abs((b8["per_device"] - b8["parts"]["decode state"]["per_device"]) / GIB - 78.2) < 0.1
    # tensor parallel on top of EP: attention splits too, per-device total shrinks
    tp = M.plan(config, devices=8, mesh_shape=(1, 1, 8), weights="quantized", drafter="none")
    attn = "attention + shared expert"
    assert tp["parts"][attn]["per_device"] < q8["parts"][attn]["per_device"]
    assert tp["parts"]["routed experts"]["per_device"] == q8["parts"]["routed experts"]["per_device"]
    # the decode state splits over the batch on data x expert
    big = M.plan(config, devices=8, weights="bf16", batch=8, context=32768)
    assert big["parts"]["decode state"]["per_device"] * 8 == pytest.approx(big["parts"]["decode state"]["total"])


def test_memplan_cli(capsys):
    with pytest.raises(SystemExit) as e:
        memplan_cli.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for opt in ("--devices", "--batch", "--context", "--dtype", "--json", "--mesh"):
        assert opt in text
    assert memplan_cli.main(["--devices", "1,8,16", "--dtype", "bf16,quantized", "--batch", "2", "--context", "8192"]) == 0
    text = capsys.readouterr().out
    assert "routed experts" in text and "16 dev (1x16x1)" in text and "fits 139 GiB" in text
    assert memplan_cli.main(["--json", "--devices", "8", "--dtype", "quantized", "--mesh", "1x2x4"]) == 0
    out = json.loads(capsys.readouterr().out)
    (plan,) = out["quantized"]
    assert plan["mesh"] == {"data": 1, "expert": 2, "model": 4} and plan["devices"] == 8
    with pytest.raises(SystemExit):
        memplan_cli.main(["--dtype", "int3"])
    proc = subprocess.run([sys.executable, "-m", "dsv4_jax.analysis.memplan_cli", "--help"], capture_output=True, text=True,
                          cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=120)
    assert proc.returncode == 0 and "dsv4-memplan" in proc.stdout


def test_memplan_notes_an_unsplittable_batch(capsys):
    """Batch 8 on 16 expert devices cannot split: the state is replicated, and the plan says why."""
    config = C.tiny()
    p16 = M.plan(config, devices=16, weights="bf16", batch=8, context=256)
    state = p16["parts"]["decode state"]
    assert state["per_device"] == state["total"]
    (note,) = p16["notes"]
    assert "batch 8" in note and "'expert' (16)" in note and "replication" in note and "instead of 16" in note
    p8 = M.plan(config, devices=8, weights="bf16", batch=8, context=256)
    assert p8["notes"] == []
    assert p8["parts"]["decode state"]["per_device"] * 8 == pytest.approx(p8["parts"]["decode state"]["total"])
    half = M.plan(config, devices=16, mesh_shape=(2, 8, 1), weights="bf16", batch=6, context=256)
    (note,) = half["notes"]          # 6 splits over data (2), not over expert (8)
    assert "'expert' (8)" in note and "split 2 ways instead of 16" in note
    assert half["parts"]["decode state"]["per_device"] * 2 == pytest.approx(half["parts"]["decode state"]["total"])
    assert memplan_cli.main(["--preset", "tiny", "--devices", "8,16", "--dtype", "bf16", "--batch", "8",
                   "--context", "256"]) == 0
    out = capsys.readouterr().out
    assert "note: 16 dev (1x16x1): decode state: batch 8" in out and "note: 8 dev" not in out
