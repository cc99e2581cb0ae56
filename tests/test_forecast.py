"""The speculation payoff forecast's arithmetic on hand-computed cases (analysis/aot/forecast.py)."""
import json

import pytest

from dsv4_jax.analysis.aot import forecast as F


def test_expected_accepted_hand_computed():
    p = F.given([0.8, 0.5, 0.25])
    # 0.8 + 0.8·0.5 + 0.8·0.5·0.25 = 0.8 + 0.4 + 0.1
    assert F.expected_accepted(p, 1) == pytest.approx(0.8)
    assert F.expected_accepted(p, 3) == pytest.approx(1.3)
    # past the profile the last rate repeats: + 0.1·0.25
    assert F.expected_accepted(p, 4) == pytest.approx(1.325)


def test_forecast_row_hand_computed():
    p = F.given([0.8, 0.5, 0.25])
    # k = 2: tokens/round = 1 + 1.2 = 2.2; round = drafter 2 ms + verify 12 ms = 14 ms;
    # 2.2 / 0.014 = 157.142857 tokens/s; decode 10 ms -> 100 tokens/s; speed-up 1.571428...
    r = F.forecast_row(p, 2, decode_s=0.010, verify_s=0.012, drafter_s=0.002)
    assert r["tokens_per_round"] == pytest.approx(2.2)
    assert r["round_s"] == pytest.approx(0.014)
    assert r["tokens_per_s"] == pytest.approx(2.2 / 0.014)
    assert r["speedup"] == pytest.approx(1.5714285714)


def test_published_profile_is_geometric():
    p = F.profile("mtp-llamacpp-25784")
    assert F.expected_accepted(p, 3) == pytest.approx(0.65 + 0.65 ** 2 + 0.65 ** 3)


def test_sweep_profile_converts_cumulative_rates(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"settings": [
        {"drafter": "mtp", "draft_n_max": 3, "per_position_accept_rate": [0.8, 0.4, 0.1]},
        {"drafter": "dspark", "draft_n_max": 1, "per_position_accept_rate": [0.9]}]}))
    p = F.profile(str(path), drafter="mtp")
    assert p.rates == pytest.approx((0.8, 0.5, 0.25))
    # the cumulative rates summed are E[accepted] directly
    assert F.expected_accepted(p, 3) == pytest.approx(0.8 + 0.4 + 0.1)


def test_sweep_profile_picks_the_drafters_greedy_setting(tmp_path):
    """dsv4-sweep names the drafter spec_type; the greedy setting with the most positions is used, not a
    sampled one nor draft_n_max "auto"."""
    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"meta": {"model": {"name": "tiny_demo"}}, "settings": [
        {"spec_type": "mtp", "draft_n_max": 2, "temperature": 0.0, "per_position_accept_rate": [0.9, 0.45]},
        {"spec_type": "mtp", "draft_n_max": "auto", "temperature": 0.0, "per_position_accept_rate": [1, 1, 1]},
        {"spec_type": "mtp", "draft_n_max": 3, "temperature": 0.8, "per_position_accept_rate": [0.5, 0.2, 0.1]},
        {"spec_type": "dspark", "draft_n_max": 1, "temperature": 0.0, "per_position_accept_rate": [0.7]}]}))
    p = F.profile(str(path), drafter="mtp")
    assert p.rates == pytest.approx((0.9, 0.5)) and "tiny_demo" in p.source
    assert F.profile(str(path), drafter="dspark").rates == pytest.approx((0.7,))
    with pytest.raises(ValueError, match="no setting"):
        F.profile(str(path), drafter="ngram")


def test_bad_profile_is_named():
    with pytest.raises(ValueError, match="rates must be"):
        F.given([1.2])
    with pytest.raises(ValueError, match="unknown acceptance profile"):
        F.profile("no-such-profile")


# ---- the report wiring: a tiny fake dsv4-aot report, no compile -------------------------------------------

def _row(program: str, roofline_s: float, bound: float, by_k: dict | None = None, bound_s: float | None = None) -> dict:
    b = {"total": bound}
    if by_k:
        b["by_k"] = {str(k): v for k, v in by_k.items()}
    return {"program": program, "compiled": True, "fits": True, "cost_method": "unrolled",
            "argument_bytes_per_device": 1e9, "memory": {"peak": 2e9, "temp": 1e9, "output": 0},
            "cost": {"flops": 1e12, "bytes_accessed": 2 * bound}, "hlo": {"top_ops": {"total_bytes": bound}},
            "bound": b, "estimate": {"roofline_s": roofline_s, "bound_s": bound_s or roofline_s / 2,
                                     "roofline_limit": "memory", "hlo_op_bytes_s": roofline_s,
                                     "xla_bytes_s": 3 * roofline_s, "flops_s": 1e-6},
            "tokens_per_sequence": 1}


def _fake_report() -> dict:
    # seconds per bound byte: verify 0.020 s / 200 B = 1e-4; MTP round 0.025 / 250 = 1e-4; DSpark 0.03 / 200
    # at the bound (bound_s): decode 4 ms, the others half their roofline time
    programs = [_row("decode", 0.010, 100.0, bound_s=0.004),
                _row("verify", 0.020, 200.0, {1: 100.0, 2: 150.0, 3: 200.0}),
                _row("spec-mtp", 0.025, 250.0, {1: 120.0, 2: 170.0, 3: 250.0}),
                _row("spec-dspark", 0.030, 200.0, {1: 110.0, 2: 160.0})]        # block size 2 here
    run = {"topology": "v6e:2x4", "chips": 8, "hosts": 1, "chip": {"device_kind": "TPU v6e", "hbm_gbps": 1640,
                                                                   "bf16_tflops": 918},
           "hbm_bytes": 32 * 2 ** 30, "hbm_source": "table", "mesh_text": "1×1×8", "weights": "release",
           "sharding": "latency", "programs": programs}
    no_round = dict(run, topology="v5p:2x2x2", programs=programs[:2])       # no round compiled: no forecast
    return {"meta": {"date": "2026-12-05", "machine": "test", "jax": "0", "command": "dsv4-aot test"},
            "model": {"name": "flash", "layers": 43, "params_b": 284.0, "unroll_layers": True},
            "counting": {"method": "unrolled"}, "backends": "moe=ep", "runs": [run, no_round],
            "shapes": {"batch": 1, "context": 32768, "draft_n_max": 3, "prefill_chunk": 256,
                       "max_len": 32776, "max_block": 8}}


def test_round_times_scale_each_compiled_row_to_k():
    decode, verify, drafters = F.round_times({r["program"]: r for r in _fake_report()["runs"][0]["programs"]})
    assert decode == pytest.approx(0.010)
    assert verify(1) == pytest.approx(0.010) and verify(2) == pytest.approx(0.015)
    ks, mtp = drafters["mtp"]
    assert ks == [1, 2, 3]
    assert mtp(2) == pytest.approx(1e-4 * 170 - 0.015)           # round(2) − verify(2) = 0.002 s
    ks, dspark = drafters["dspark"]
    assert ks == [1, 2] and dspark(1) == pytest.approx(0.03 / 200 * 110 - 0.010)


def test_report_forecast_hand_computed_and_rendered(tmp_path):
    from dsv4_jax.analysis.aot import cli
    rep = _fake_report()
    fc = F.report_forecast(rep, "0.8,0.5")
    run, at_bound = fc["runs"]                               # the run without a round has no forecast
    assert (run["basis"], at_bound["basis"]) == ("roofline", "bound")
    assert run["steps"]["verify"]["from"] == "HLO-op bytes" and run["steps"]["decode"]["s"] == 0.010
    assert run["topology"] == "v6e:2x4" and set(run["drafters"]) == {"mtp", "dspark"}
    r2 = run["drafters"]["mtp"]["rows"][1]
    # k = 2: 1 + 0.8 + 0.8·0.5 = 2.2 tokens per round in 0.002 + 0.015 s: 129.41 tokens/s; decode 10 ms ->
    # 100 tokens/s, speed-up 1.2941
    assert r2["k"] == 2 and r2["tokens_per_round"] == pytest.approx(2.2)
    assert r2["round_s"] == pytest.approx(0.017)
    assert r2["tokens_per_s"] == pytest.approx(2.2 / 0.017)
    assert r2["speedup"] == pytest.approx(1.2941176)
    assert [r["k"] for r in run["drafters"]["dspark"]["rows"]] == [1, 2]
    # at the bound: verify(2) = 0.010 / 200 · 150 = 7.5 ms, round(2) = 0.0125 / 250 · 170 = 8.5 ms; decode 4 ms:
    # 2.2 / 0.0085 = 258.82 tokens/s, speed-up 258.82 · 0.004 = 1.0353
    b2 = at_bound["drafters"]["mtp"]["rows"][1]
    assert b2["verify_s"] == pytest.approx(0.0075) and b2["drafter_s"] == pytest.approx(0.001)
    assert b2["speedup"] == pytest.approx(2.2 / 0.0085 * 0.004)
    path = tmp_path / "r.json"
    path.write_text(json.dumps(rep))
    out = tmp_path / "fc.json"
    assert cli.main(["--render", str(path), "--acceptance", "0.8,0.5", "--out", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert saved["forecast"]["spec"] == "0.8,0.5"
    assert saved["forecast"]["runs"][0]["drafters"]["mtp"]["rows"][1]["speedup"] == pytest.approx(1.2941176)
    md = (tmp_path / "fc.md").read_text()
    assert "## Speculation payoff forecast" in md
    assert "| mtp | 2 | 1.20 | 2.20 | 15.00 | 2.00 | 17.00 | 129.4 | 100.0 | 1.29× |" in md
    assert (tmp_path / "fc.forecast.png").stat().st_size > 0
    # re-rendered without --acceptance: the saved report's profile is kept
    assert cli.main(["--render", str(out), "--out", str(tmp_path / "again.json"), "--no-plot"]) == 0
    assert json.loads((tmp_path / "again.json").read_text())["forecast"]["spec"] == "0.8,0.5"
    assert cli.main(["--render", str(path), "--acceptance", "1.5", "--out", str(out)]) == 2


def test_mixed_step_measures_add_the_xla_basis():
    """A verify whose HLO could not be read (roofline from XLA's bytes) next to a decode with HLO-op bytes:
    the forecast adds the one-measure "xla" basis."""
    rep = _fake_report()
    verify = rep["runs"][0]["programs"][1]
    del verify["estimate"]["hlo_op_bytes_s"]
    run = {r["basis"]: r for r in F.report_forecast(rep, "0.8,0.5")["runs"]}
    assert set(run) == {"roofline", "xla", "bound"}
    assert run["roofline"]["steps"]["verify"]["from"] == "XLA bytes"
    # every step 3× its roofline time: speed-ups as on the roofline basis
    assert run["xla"]["drafters"]["mtp"]["rows"][1]["speedup"] == pytest.approx(1.2941176)
    assert run["xla"]["decode_s"] == pytest.approx(0.030)


def test_report_without_bounds_per_k_is_named(tmp_path, capsys):
    """A report saved before the forecast (no bound per k): named; --render still writes it, without one."""
    from dsv4_jax.analysis.aot import cli
    rep = _fake_report()
    del rep["runs"][0]["programs"][1]["bound"]["by_k"]
    with pytest.raises(ValueError, match="no bound per k"):
        F.report_forecast(rep, F.DEFAULT_PROFILE)
    path = tmp_path / "old.json"
    path.write_text(json.dumps(rep))
    assert cli.main(["--render", str(path), "--out", str(tmp_path / "r.json"), "--no-plot"]) == 0
    assert "no bound per k" in capsys.readouterr().err
    assert "forecast" not in json.loads((tmp_path / "r.json").read_text())


def test_vllm_dspark_profile_reads_cumulative_rates():
    """vllm#46995's .82/.67/.55/.45/.37 read as cumulative P(draft j accepted): E[accepted](5) is their sum and
    the conditional rates are ≈ 0.82 each."""
    p = F.profile("dspark-vllm-46995")
    assert F.expected_accepted(p, 5) == pytest.approx(0.82 + 0.67 + 0.55 + 0.45 + 0.37, abs=2e-3)
    assert all(r == pytest.approx(0.82, abs=0.01) for r in p.rates) and len(p.rates) == 5


def test_latency_bases_add_fixed_terms_that_do_not_scale_with_k():
    """With the report's latency terms (collectives × latency + ops × overhead): the latency basis is the roofline
    plus them, the bytes part scaled to k's bound and the latency part not; bound+latency the same on the bound."""
    rep = _fake_report()
    lat = {"decode": 0.001, "verify": 0.002, "spec-mtp": 0.004, "spec-dspark": 0.003}
    for r in rep["runs"][0]["programs"]:
        e = r["estimate"]
        e.update(collective_latency_s=lat[r["program"]] / 2, op_overhead_s=lat[r["program"]] / 2,
                 latency_roofline_s=e["roofline_s"] + lat[r["program"]])
    rows = {r["program"]: r for r in rep["runs"][0]["programs"]}
    decode, verify, drafters = F.round_times(rows, "latency")
    assert decode == pytest.approx(0.011)
    # verify: 0.020 s roofline at bound 200 (1e-4 s per byte); k = 1: 1e-4 · 100 + 2 ms
    assert verify(1) == pytest.approx(0.012) and verify(3) == pytest.approx(0.022)
    # MTP round: 0.025 / 250 per byte; k = 2: 1e-4 · 170 + 4 ms − verify(2) (0.015 + 0.002)
    assert drafters["mtp"][1](2) == pytest.approx(0.017 + 0.004 - 0.017)
    d, v, _ = F.round_times(rows, "bound+latency")
    # bound: decode 4 ms + 1 ms; verify at its bound 0.010 / 200 per byte, k = 2: 7.5 ms + 2 ms
    assert d == pytest.approx(0.005) and v(2) == pytest.approx(0.0095)
    fc = F.report_forecast(rep, "0.8,0.5")
    assert [r["basis"] for r in fc["runs"]] == ["roofline", "bound", "latency", "bound+latency"]
    assert "latency roofline" in "\n".join(F.section(fc))
    del rows["verify"]["estimate"]["latency_roofline_s"]
    assert "latency" not in F.default_bases(rows)
    with pytest.raises(ValueError, match="no latency roofline"):
        F.round_times(rows, "latency")
