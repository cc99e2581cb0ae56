"""dsv4-bench-decode (`dsv4_jax.research.bench_decode`) at reduced sizes: report format and shapes; the bytes
bound it reports (`dsv4_jax.analysis.traffic`) and the random weights it runs on (`dsv4_jax.model.random_init`).

The bound is recomputed here from the config's dimensions (docs/model_math.md §6), not with the
library's own functions. The run uses a 3-layer CPU model (SWA, SWA, CSA) and one variant per section
to stay fast; the bound test covers the 5-layer schedule with an HCA layer.
"""
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax as d
from dsv4_jax.model import params as P
from dsv4_jax.analysis import traffic
from dsv4_jax.ops import quant
from dsv4_jax.model.random_init import random_params_on_device
from dsv4_jax.model.schedule import segments
from dsv4_jax.research import bench_decode as bench


# --quick: one variant per section on a 3-layer model (SWA, SWA, CSA; hash-routed), bf16, reference kernels,
# batch 1, context 64, verify k+1 = 2, MTP k = 1 (spec and loop share the round), prefill of 2 tokens
ARGS = ["--small", "--quick"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "decode.json"
    result = bench.run(ARGS + ["--out", str(out)])
    with open(out) as f:
        saved = json.load(f)
    return result, saved, out


def _finite_pos(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


# ---- the bound, recomputed from the dimensions ----------------------------------------------------------

def _expected_weight_bytes(c, fmt, n_tokens):
    """Active weights of a step over n_tokens tokens, leaf by leaf from the dimensions."""
    D, H, d_, G, R, ql = c.hidden_size, c.num_heads, c.head_dim, c.o_groups, c.o_lora_rank, c.q_lora_rank
    E, k, I, V, n = c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.vocab_size, c.hc_mult
    nI, dI = c.index_n_heads, c.index_head_dim
    active = k if n_tokens == 1 else E * (1 - (1 - k / E) ** n_tokens)
    w = 2                                                       # bf16 weights (and fp8-experts' non-expert weights)
    expert_b = {"bf16": 2, "fp8-experts": 1 + 4 / 128 ** 2}[fmt]
    f32 = 4
    hc_rows = (2 + n) * n
    total = 0.0
    for lt, m, mt in zip(c.layer_types, c.compress_ratios, c.mlp_layer_types):
        attn = (ql * D + H * d_ * ql + d_ * D + G * R * (H * d_ // G) + D * G * R) * w + (ql + d_ + H) * f32
        if lt != "sliding_attention":
            cd = 2 * d_ if lt == "compressed_sparse_attention" else d_
            attn += 2 * cd * D * w + (m * cd + d_) * f32
        if lt == "compressed_sparse_attention":
            attn += (nI * dI * ql + nI * D) * w + 2 * (2 * dI) * D * w + (m * 2 * dI + dI) * f32
        hc = 2 * (hc_rows * n * D + hc_rows + 3) * f32
        norms = 2 * D * f32
        router = E * D * w + (min(n_tokens, V) * k * 4 if mt == "hash_moe" else E * f32)
        experts = 3 * I * D * expert_b * active
        shared = 3 * I * D * w
        total += attn + hc + norms + router + experts + shared
    total += n_tokens * D * w + V * D * w                      # embedding rows read, whole head
    total += (n * n * D + n + 1) * f32 + D * f32                # hc_head, final norm
    return total


def _expected_cache_bytes(c, context):
    d_, dI, W = c.head_dim, c.index_head_dim, c.sliding_window
    total = 0
    for lt, m in zip(c.layer_types, c.compress_ratios):
        total += min(W, context) * d_ * 2
        if lt == "compressed_sparse_attention":
            total += (context // m) * dI * 2 + min(c.index_topk, context // m) * d_ * 2
        elif lt == "heavily_compressed_attention":
            total += (context // m) * d_ * 2
    return total


@pytest.mark.parametrize("fmt", ["bf16", "fp8-experts"])
@pytest.mark.parametrize("batch,context,tokens", [(1, 64, 1), (2, 256, 1), (1, 256, 6), (3, 100, 2)])
def test_bytes_bound_matches_dimensions(fmt, batch, context, tokens):
    c = bench.small_flash(1)
    assert set(c.layer_types) == {"sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"}
    got = traffic.bytes_bound(c, fmt, batch, context, tokens)
    want_w = _expected_weight_bytes(c, fmt, batch * tokens)
    want_c = batch * _expected_cache_bytes(c, context)
    assert got["weights"] == pytest.approx(want_w, rel=1e-9)
    assert got["cache"] == want_c
    assert got["total"] == pytest.approx(want_w + want_c, rel=1e-9)


def test_bytes_bound_flash_anchors():
    """docs/model_math.md §6: 26.5 GB of bf16 weights per token; ≈10.2 GB at release precision counting every
    non-expert weight at 1 byte — memplan's storage keeps the head (1.06 GB), compressors and router in
    bf16, hence 11.2 GB; KV read 22 / 63 / 204 MiB at 4K / 32K / 128K."""
    c = d.flash()
    bf16 = traffic.bytes_bound(c, "bf16", 1, 4096)
    assert bf16["weights"] / 1e9 == pytest.approx(26.5, rel=0.01)
    release = traffic.bytes_bound(c, "release", 1, 4096)
    assert 10.2 < release["weights"] / 1e9 < 10.2 + 1.06 + 0.1
    assert release["weight_parts"]["routed_experts"] / 1e9 == pytest.approx(6.49 * (0.5 + 1 / 32), rel=0.01)
    assert bf16["cache"] / 2 ** 20 == pytest.approx(22, rel=0.02)
    assert traffic.bytes_bound(c, "bf16", 1, 32768)["cache"] / 2 ** 20 == pytest.approx(63, rel=0.01)
    assert traffic.bytes_bound(c, "bf16", 1, 131072)["cache"] / 2 ** 20 == pytest.approx(204, rel=0.01)
    with pytest.raises(ValueError, match="unknown weight format"):
        traffic.bytes_bound(c, "fp16", 1, 4096)


def test_reduced_flash_keeps_every_layer_type():
    c = d.config.with_pairs(d.flash(), 1)
    f = d.flash()
    assert c.num_layers == 5 and c.layer_types == f.layer_types[:5]
    assert set(c.layer_types) == {"sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"}
    assert c.mlp_layer_types == ("hash_moe",) * 3 + ("moe",) * 2
    assert (c.hidden_size, c.n_routed_experts, c.moe_intermediate_size) == (4096, 256, 2048)


# ---- random weights made on the device -------------------------------------------------------------------

@pytest.mark.parametrize("expert_format", ["dense", "fp8"])
def test_random_params_on_device_follow_the_specs(expert_format):
    c = bench.small_flash(0)
    params = random_params_on_device(c, jax.random.key(0), jnp.bfloat16, expert_format)
    specs, got = P.flatten(P.param_specs(c)), P.flatten(params)
    experts = {p for p in specs if p.endswith(("ffn.experts.w1", "ffn.experts.w2", "ffn.experts.w3"))}
    assert len(experts) == 3 * sum(seg.pattern for seg in segments(c))     # w1, w2, w3 per stacked layer slot
    assert set(got) == set(specs)
    for p, spec in specs.items():
        x = got[p]
        assert x.shape == spec.shape, p
        if p in experts and expert_format == "fp8":
            assert isinstance(x, quant.QArray) and x.codes.dtype == jnp.float8_e4m3fn and x.dtype == jnp.bfloat16
            N, K = spec.shape[-2:]
            assert x.fmt.block == (min(128, N), min(128, K))
            scale = x.scale
            assert scale.dtype == jnp.float32 and scale.shape == spec.shape[:-2] + (N // min(128, N), K // min(128, K))
            np.testing.assert_allclose(np.asarray(scale), 1 / math.sqrt(K))
        else:
            assert x.dtype == jnp.dtype(spec.dtype(jnp.bfloat16)), p
    # the distributions of params.init_params: norms 1 ± 0.1, matrices N(0, 1/fan_in), distinct expert ids
    norm = np.asarray(got["norm"], np.float32)
    assert abs(norm.mean() - 1) < 0.03 and 0.07 < norm.std() < 0.13
    w = np.asarray(got["segments.0.0.attn.wq_b"], np.float32)
    assert w.std() * math.sqrt(w.shape[-1]) == pytest.approx(1.0, rel=0.05)
    ids = np.asarray(got["segments.0.0.ffn.gate.tid2eid"])
    assert ids.dtype == np.int32 and ids.min() >= 0 and ids.max() < c.n_routed_experts
    assert all(len(set(row)) == c.num_experts_per_tok for row in ids.reshape(-1, ids.shape[-1])[:50])


# ---- the report ------------------------------------------------------------------------------------------

@pytest.mark.slow   # runs the benchmark end to end (~45 s of compiles)
def test_report_sections_and_meta(run):
    result, saved, out = run
    for key in ("meta", "prefill", "decode", "verify", "spec", "loop", "profile", "goals", "summary", "skipped",
                "errors"):
        assert key in saved, key
    m = saved["meta"]
    for key in ("date", "device", "backend", "jax", "command", "bandwidth", "config", "memory_plan",
                "bytes_bound_formula", "forced_acceptance"):
        assert key in m, key
    assert m["jax"] == __import__("jax").__version__
    assert m["command"].startswith("dsv4-bench-decode --small")
    assert _finite_pos(m["bandwidth"]["read_GBps"])
    assert saved["errors"] == [] and saved["skipped"] == []
    assert os.path.exists(os.path.splitext(str(out))[0] + ".md")


@pytest.mark.slow   # runs the benchmark end to end (~45 s of compiles)
def test_decode_verify_prefill_rows(run):
    _, saved, _ = run
    c = bench.small_flash(0)
    bw = saved["meta"]["bandwidth"]["read_GBps"] * 1e9
    for section, S in (("decode", 1), ("verify", 2), ("prefill", 2)):
        rows = saved[section]
        assert len(rows) == 1, section
        r = rows[0]
        assert (r["batch"], r["context"], r["tokens"], r["kernels"], r["dtype"]) == (1, 64, S, "reference", "bf16")
        for key in ("us", "bound_bytes", "achieved_GBps", "bw_fraction", "bound_us"):
            assert _finite_pos(r[key]), (section, key)
        assert len(r["us_all"]) == 2
        want = _expected_weight_bytes(c, "bf16", S) + _expected_cache_bytes(c, r["context"])
        assert r["bound_bytes"] == pytest.approx(want, rel=1e-9)
        assert r["achieved_GBps"] == pytest.approx(r["bound_bytes"] / (r["us"] * 1e-6) / 1e9, rel=1e-9)
        assert r["bw_fraction"] == pytest.approx(r["bound_bytes"] / (r["us"] * 1e-6) / bw, rel=1e-9)
    dec, ver = saved["decode"][0], saved["verify"][0]
    assert dec["ms_per_token"] == pytest.approx(dec["us"] / 1e3)
    assert ver["over_decode"] == pytest.approx(ver["us"] / dec["us"])
    assert saved["prefill"][0]["tokens_per_s"] == pytest.approx(2 / (saved["prefill"][0]["us"] * 1e-6))


@pytest.mark.slow   # runs the benchmark end to end (~45 s of compiles)
def test_spec_and_loop_rows(run):
    _, saved, _ = run
    dec = saved["decode"][0]
    (s,) = saved["spec"]
    assert (s["drafter"], s["k"], s["rounds"]) == ("mtp", 1, 2)
    assert s["tokens_per_round"] == 2.0 and s["acceptance"] == 1.0        # forced acceptance: all k drafts kept
    assert _finite_pos(s["us_per_round"])
    assert s["us_per_token"] == pytest.approx(s["us_per_round"] / 2)
    assert s["round_over_decode"] == pytest.approx(s["us_per_round"] / dec["us"])
    assert s["speedup_bound_at_full_acceptance"] == pytest.approx(2 * dec["us"] / s["us_per_round"])
    assert s["draft_accept_observe_us"] == pytest.approx(s["us_per_round"] - saved["verify"][0]["us"])
    (lp,) = saved["loop"]
    for mode in ("device", "host", "async"):
        assert _finite_pos(lp[f"{mode}_us_per_round"])
    assert lp["device_loop_overhead_us"] == pytest.approx(lp["device_us_per_round"] - lp["async_us_per_round"])
    assert lp["host_loop_overhead_us"] == pytest.approx(lp["host_us_per_round"] - lp["async_us_per_round"])


@pytest.mark.slow   # runs the benchmark end to end (~45 s of compiles)
def test_profile_rows(run):
    _, saved, _ = run
    (tr,) = saved["profile"]["traces"]
    assert "top_ops" in tr or "top_ops_error" in tr or "error" in tr       # reported, never a crash
    if "top_ops" in tr:
        assert tr["top_ops"] and all(o["us_per_step"] >= 0 for o in tr["top_ops"])
    (comp,) = saved["profile"]["components"]
    names = [r["component"] for r in comp["components"]]
    assert any(n.startswith("embedding") for n in names) and any(n.startswith("head") for n in names)
    assert sum(r["count"] for r in comp["components"] if r["component"].startswith("attention")) == 3
    assert sum(r["count"] for r in comp["components"] if r["component"].startswith("ffn")) == 3
    for r in comp["components"]:
        assert _finite_pos(r["us_each"]) and r["us_total"] == pytest.approx(r["us_each"] * r["count"])
    assert comp["sum_us"] == pytest.approx(sum(r["us_total"] for r in comp["components"]))


@pytest.mark.slow   # runs the benchmark end to end (~45 s of compiles)
def test_goals_and_tables(run):
    result, saved, out = run
    goals = saved["goals"]
    assert [g["target"] for g in goals] == [0.75, 1.3, 20.0]
    dec, ver, lp = saved["decode"][0], saved["verify"][0], saved["loop"][0]
    assert goals[0]["measured"] == pytest.approx(dec["bw_fraction"])
    assert goals[1]["measured"] == pytest.approx(ver["over_decode"]) and "not 6" in goals[1]["note"]
    assert goals[2]["measured"] == pytest.approx(lp["device_loop_overhead_us"])
    for g in goals:
        assert g["met"] == {0.75: g["measured"] >= 0.75, 1.3: g["measured"] <= 1.3,
                            20.0: g["measured"] <= 20.0}[g["target"]]
        if not g["met"]:
            assert g["missed_by"] and g["limits"]
    text = open(os.path.splitext(str(out))[0] + ".md").read()
    for title in ("## decode", "## verify", "## speculative round", "## loop overhead", "## prefill",
                  "## decode step: top costs", "## goals", "## summary"):
        assert title in text, title
    assert len(saved["summary"]) >= 3
    assert result["goals"] == goals


@pytest.mark.slow   # runs the benchmark end to end (~45 s of compiles)
def test_render_recomputes_the_same_report(run, tmp_path):
    """--render rebuilds goals, summary and tables from a saved JSON without measuring."""
    _, saved, out = run
    copy = tmp_path / "again.json"
    copy.write_text(out.read_text())
    again = bench.run(["--render", str(copy)])
    assert again["goals"] == saved["goals"] and again["summary"] == saved["summary"]
    assert (tmp_path / "again.md").read_text().split("\n", 2)[2] == \
        open(os.path.splitext(str(out))[0] + ".md").read().split("\n", 2)[2]
