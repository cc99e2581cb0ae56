"""dsv4-sweep / dsv4-batch-eval on a tiny random model bundle: documented outputs, bad options, shared programs.

The sweep runs once (module fixture) and the padded-generation check reuses its compilations; within the
sweep the settings share programs (one prefill per prompt bucket, one loop per draft width for MTP and DSpark
together); the batch evaluation compiles its slot programs for the baseline only; a 2-layer SWA model keeps
each compilation short.
"""
import json
import os
import types

import jax.numpy as jnp
from jax import monitoring
import numpy as np

import pytest

import dsv4_jax as d
from dsv4_jax.config import HASH_MOE, MOE, _schedule
from dsv4_jax.io.demo_io import save_bundle
from dsv4_jax.model.params import init_dspark, init_mtp
from dsv4_jax.research import batch_eval, common, prompts as P, report, sweep
from dsv4_jax.research.runner import (SweepPlan, Setting, bucket_of, generate_padded, length_buckets, plan_options,
                                      plan_shapes)
from dsv4_jax.speculative import generate as spec_generate, loop, scheduler

RUN = ["--limit", "1", "--max-new-tokens", "8", "--draft-n-max", "1,2", "--repeats", "2", "--no-compile-cache",
       "--quiet"]
COMPILED = {}       # programs the sweep fixture compiled, by jitted function
XLA_COMPILES = []   # names of the functions XLA compiled while the sweep fixture ran
RECORDING = [False]
FETCHES = []          # generate's to_host calls while the sweep fixture ran


def _on_event(event, duration, fun_name=None, **_):
    if RECORDING[0] and event == "/jax/core/compile/backend_compile_duration":
        XLA_COMPILES.append(fun_name)


monitoring.register_event_duration_secs_listener(_on_event)


def _config():
    types, ratios = _schedule([0, 0])
    return d.tiny().replace(name="test_tiny2", vocab_size=260, bos_token_id=256, eos_token_id=257, num_layers=2,
                            layer_types=types, compress_ratios=ratios, mlp_layer_types=(HASH_MOE, MOE))


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """A random 2-layer target with MTP and DSpark, saved like the demo bundle (DSpark settings in info)."""
    config = _config()
    params = d.init_params(config, 0)
    params["mtp"] = init_mtp(config, 1)
    params["dspark"] = init_dspark(config, 2, n_stages=1, n_taps=2, markov_rank=4)
    path = str(tmp_path_factory.mktemp("model") / "bundle")
    save_bundle(path, config, params, {"dspark": {"block_size": 3, "noise_token_id": 259,
                                                  "target_layer_ids": [0, 1]}}, dtype=jnp.float32)
    return path


@pytest.fixture(scope="module")
def sweep_out(bundle, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("sweep") / "new" / "res")      # its parent does not exist yet
    fns = {"loop": loop.run_rounds, "prefill": spec_generate.prefill_target, "prime": spec_generate.prime}
    before = {k: f._cache_size() for k, f in fns.items()}
    RECORDING[0] = True
    to_host = spec_generate.to_host
    spec_generate.to_host = lambda tree: FETCHES.append(1) or to_host(tree)
    try:
        assert sweep.main(["--model", bundle, "--out", out, "--spec", "none,mtp,dspark", "--by-output-position", "4",
                           *RUN]) == 0
    finally:
        RECORDING[0] = False
        spec_generate.to_host = to_host
    COMPILED.update({k: f._cache_size() - before[k] for k, f in fns.items()})
    return out


def test_sweep_shares_compiled_programs(sweep_out):
    """5 settings (none, mtp k=1,2, dspark k=1,2), one prompt bucket: one prefill, two primings (none and the
    drafter pool), two loops (none, and one for k = 1, 2 shared by MTP and DSpark) — not 5 + 5."""
    assert COMPILED == {"loop": 2, "prefill": 1, "prime": 2}
    # compiled once each before the first run (`speculative.precompile`): the warm-ups and timed
    # runs call exactly the compiled programs, nothing compiles twice
    big = {n: XLA_COMPILES.count(f"jit({n})") for n in ("run_rounds", "prefill_target", "prime")}
    assert big == {"run_rounds": 2, "prefill_target": 1, "prime": 2}, XLA_COMPILES
    meta = json.load(open(os.path.join(sweep_out, "summary.json")))["meta"]
    assert meta["drafter_pool"] == ["mtp", "dspark"] and meta["max_block"] == 3 and meta["dynamic_draft_n"]


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def test_outputs_have_normal_permissions(sweep_out):
    """Directories (the created parent included) 0777 and files 0666 less the umask, not mkdtemp's 0700."""
    for d in (os.path.dirname(sweep_out), sweep_out):
        assert os.stat(d).st_mode & 0o777 == 0o777 & ~_umask()
    for f in os.listdir(sweep_out):
        assert os.stat(os.path.join(sweep_out, f)).st_mode & 0o777 == 0o666 & ~_umask(), f
    assert os.listdir(os.path.dirname(sweep_out)) == ["res"]          # no temporary directory left


def test_sweep_writes_documented_outputs(sweep_out):
    assert sorted(os.listdir(sweep_out)) == ["acceptance.png", "expected_vs_realised.png", "per_position.png",
                                             "reliability_dspark_k_1_conf_0_T_0_B_1.png",
                                             "reliability_dspark_k_2_conf_0_T_0_B_1.png",
                                             "results.jsonl", "summary.json", "summary.md", "tokens_per_s.png"]
    for png in ("acceptance.png", "per_position.png", "tokens_per_s.png"):
        with open(os.path.join(sweep_out, png), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        assert os.path.getsize(os.path.join(sweep_out, png)) > 5000
    summary = json.load(open(os.path.join(sweep_out, "summary.json")))
    meta = summary["meta"]
    for key in ("env", "model", "suite", "n_prompts", "max_new_tokens", "repeats", "seed", "pad_to", "max_len"):
        assert key in meta
    for key in ("date", "command", "jax_version", "backend", "devices", "platform"):
        assert key in meta["env"]
    assert meta["env"]["command"].startswith("dsv4-sweep --model")
    assert meta["suite"] == "tiny" and meta["n_prompts"] == 1
    assert meta["model"]["drafters"] == ["mtp", "dspark"]
    assert meta["model"]["backends"] == "moe=reference, routing=reference, indexer=reference"   # --kernels default
    rows = summary["settings"]
    assert [(r["spec_type"], r["draft_n_max"]) for r in rows] == [("none", 0), ("mtp", 1), ("mtp", 2), ("dspark", 1),
                                                                  ("dspark", 2)]
    for r in rows:
        for key in report.AGGREGATE_FIELDS + ("per_position_accepted", "per_position_proposed", "per_category",
                                              "draft_n_max", "temperature", "batch_size"):
            assert key in r, key
        assert r["n_requests"] == 1 and 1 <= r["total_predicted"] <= 8
        assert r["wall_s_total"] > 0 and r["tokens_per_s"] > 0 and r["repeats"] == 2
        assert r["decode_tokens_per_s_min"] <= r["decode_tokens_per_s"] <= r["decode_tokens_per_s_max"]
        assert r["decode_speedup_lo"] <= r["decode_speedup"] <= r["decode_speedup_hi"]
        assert r["prompt_tokens"] == r["padded_prompt_tokens"] - 6 == 26 and r["prefill_s_total"] > 0   # 1 x 32
    none, mtp, mtp2, dspark, dspark2 = rows
    assert none["speedup"] == pytest.approx(1.0) and none["decode_speedup"] == pytest.approx(1.0)
    assert none["total_draft"] == 0
    assert len(mtp["per_position_accept_rate"]) == 1 and mtp["total_draft"] > 0
    assert len(mtp2["per_position_accept_rate"]) == 2 and len(dspark2["per_position_accept_rate"]) == 2
    for r in rows[1:]:
        assert r["outputs_match_baseline"] == 1.0                   # greedy is lossless, through the pool too
        # greedy: the analytic acceptance of a round is its indicator, so analytic == measured exactly
        assert r["per_position_expected_accept_rate"] == pytest.approx(r["per_position_accept_rate"], abs=1e-6)
        assert r["acceptance"] == "real" and sum(r["acceptance_histogram"]) == r["rounds"]
        assert (r["calibration_metrics"] is not None) == (r["spec_type"] == "dspark")   # DSpark's confidence head
    for m in dspark2["calibration_metrics"]:
        assert m["n"] == 0 or (0 <= m["ece"] <= 1 and 0 <= m["brier"] <= 1)
    assert meta["padding"] == {"buckets": [32], "prompt_tokens": 26, "padded_tokens": 32, "prefill_chunk": None}
    lines = [json.loads(x) for x in open(os.path.join(sweep_out, "results.jsonl"))]
    assert len(lines) == 5
    for rec in lines:
        for key in ("id", "category", "spec_type", "draft_n_max", "pred", "draft", "acc", "rate", "tok_s",
                    "output_tokens"):
            assert key in rec
    md = open(os.path.join(sweep_out, "summary.md")).read()
    assert "| spec | k | knob | T | B | n_requests | total_predicted | total_draft | total_draft_accepted |" in md
    assert "Acceptance per position: measured vs analytic" in md and "Confidence calibration — dspark k=2" in md
    assert all("spec_decode" in rec and "num_accepted_tokens_per_pos" in rec["spec_decode"]
               for rec in lines if rec["spec_type"] != "none")
    assert "median over 2 timed repeats" in md and "length buckets [32]" in md and "load average" in md
    assert f"{os.cpu_count()} cores" in md


def test_round_traces_add_up_to_each_prompts_totals(sweep_out):
    """--by-output-position: each prompt's rounds in order (RunShape.round_trace), summing to its counters; the
    per-setting buckets hold every round once, each round at the output position its first token takes."""
    records = [json.loads(line) for line in open(os.path.join(sweep_out, "results.jsonl"))]
    for r in records:
        trace = r["round_trace"]
        assert len(trace) == r["rounds"] and sum(d for d, _ in trace) == r["draft"]
        assert sum(n for _, n in trace) == r["acc"] and all(0 <= n <= d for d, n in trace)
        assert 1 + sum(n + 1 for _, n in trace) >= r["pred"]    # the last round may pass the budget
    rows = json.load(open(os.path.join(sweep_out, "summary.json")))["settings"]
    for row in rows:
        buckets = row["by_output_position"]
        assert sum(b["rounds"] for b in buckets) == row["rounds"] and all(b["start"] % 4 == 0 for b in buckets)
        assert sum(b["accepted"] for b in buckets) == row["total_draft_accepted"]
    assert "Acceptance vs output position" in open(os.path.join(sweep_out, "summary.md")).read()


def test_acceptance_by_output_position_buckets_rounds_by_their_first_token():
    from dsv4_jax.research import report
    trace = [[3, 2], [3, 0], [3, 3], [2, 1]]            # rounds start at output positions 1, 4, 5, 9
    assert report.round_starts(trace) == [1, 4, 5, 9]
    rows = report.by_output_position([trace, [[1, 1]]], bucket=4)
    assert [(b["start"], b["rounds"], b["drafted"], b["accepted"]) for b in rows] == \
        [(0, 2, 4, 3), (4, 2, 6, 3), (8, 1, 2, 1)]
    assert rows[1]["accept_rate"] == 0.5 and rows[1]["mean_accepted_length"] == 2.5


def test_sweep_fetches_results_through_to_host(sweep_out):
    """The CLIs bring results to the host with dsv4_jax.to_host (docs/sharding.md: also across hosts)."""
    assert len(FETCHES) >= 2


def test_batch_eval_writes_documented_outputs(bundle, tmp_path, monkeypatch):
    """Static and continuous batching of 3 prompts in 2 slots with per-request budgets: the documented files
    and fields, the same tokens under both schedules (greedy), one record per request and schedule; the
    slot engine's results come through to_host."""
    fetches, to_host = [], scheduler.to_host
    monkeypatch.setattr(scheduler, "to_host", lambda tree: fetches.append(1) or to_host(tree))
    out = str(tmp_path / "batch")
    os.mkdir(out)                      # an existing empty --out is accepted (the rule of dsv4_jax.io.outdir)
    assert batch_eval.main(["--model", bundle, "--out", out, "--spec", "none", "--batch-size", "2", "--num-prompts",
                            "3", "--limit", "1", "--output-lengths", "2-7", "--ignore-eos", "--prefill-len", "16",
                            "--no-compile-cache", "--quiet"]) == 0
    assert sorted(os.listdir(out)) == ["batch_eval.json", "batch_eval.md", "latency.png", "results.jsonl",
                                       "throughput.png"]
    summary = json.load(open(os.path.join(out, "batch_eval.json")))
    meta = summary["meta"]
    assert meta["n_prompts"] == 3 and meta["schedules"] == ["static", "continuous"]
    assert len(meta["budgets"]) == 3 and all(2 <= b <= 7 for b in meta["budgets"])
    rows = summary["settings"]
    assert [(r["spec_type"], r["schedule"]) for r in rows] == [("none", "static"), ("none", "continuous")]
    for r in rows:
        for key in ("n_requests", "total_predicted", "tokens_per_s", "vs_static", "speedup", "slot_utilization",
                    "latency_mean_s", "latency_p50_s", "latency_p90_s", "ttft_p50_s", "ttft_p90_s",
                    "aggregate_accept_rate", "mean_accepted_length", "chunks", "warmup_s", "decode_tokens_per_s",
                    "decode_vs_static", "rounds_ratio", "ms_per_round"):
            assert key in r, key
        assert r["n_requests"] == 3 and r["total_predicted"] == sum(meta["budgets"])
        assert abs(r["prefill_s"] + r["decode_s"] - r["wall_s"]) < 1e-9 and 1 <= r["refills"] <= r["prefill_calls"]
        assert r["latency_p90_s"] >= r["latency_p50_s"] >= r["ttft_p50_s"] > 0
    assert rows[0]["vs_static"] == 1.0 and rows[1]["outputs_match_static"] is True
    records = [json.loads(line) for line in open(os.path.join(out, "results.jsonl"))]
    assert len(records) == 6 and [len(r["output_tokens"]) for r in records[:3]] == meta["budgets"]
    md = open(os.path.join(out, "batch_eval.md")).read()
    assert "| spec | k | knob | T | B | schedule | requests |" in md and "| admission (s) | refills |" in md
    assert len(fetches) >= 2


def test_padded_generation_equals_generate(bundle, sweep_out):
    """Right-padding to the run's bucket and the shared programs (max_block, drafter pool) change nothing: the
    sweep's runs (cached programs) equal plain `generate`, tokens and statistics."""
    from dsv4_jax.research.models import load_dir
    m = load_dir(bundle)
    meta = json.load(open(os.path.join(sweep_out, "summary.json")))["meta"]
    prompt = m.encode("def f(x):")
    assert len(prompt) < meta["pad_to"]
    for setting in (Setting("dspark", 1), Setting("mtp", 2)):
        want, ws = d.generate(m.params, m.bundle, [prompt], 8, drafter=setting.drafter,
                              draft_n_max=max(setting.draft_n_max, 1))
        got, stats = generate_padded(m.params, m.bundle, [prompt], setting,
                                     SweepPlan(8, (meta["pad_to"],), meta["max_len"], max_block=meta["max_block"],
                                               drafter_pool=tuple(meta["drafter_pool"])))
        assert got == want and stats["generated"] == len(got[0])
        for key in ("rounds", "drafted", "accepted", "per_position_accepted", "per_position_proposed",
                    "draft_length_histogram"):
            assert stats[key] == ws[key], key


def test_buckets_and_plan():
    """At most N padded lengths (multiples of 16) minimising the padded tokens; max_len holds the longest."""
    lengths = [26, 115, 87, 76, 69, 133, 70, 83, 699]           # the default suite's prompts
    assert length_buckets(lengths, 2) == (144, 704)             # 8 x 144 + 704 tokens, the fewest for 2 lengths
    assert length_buckets(lengths, 1) == (704,) and length_buckets([5, 5], 3) == (16,)
    assert length_buckets(lengths, 3) == (96, 144, 704)         # 6 x 96 + 2 x 144 + 704 = 1568 < 32 + 7 x 144 + 704
    buckets, max_len = plan_shapes(lengths, 64, 3)
    assert buckets == (144, 704) and max_len == 704 + 64 + 3 + 1
    plan = SweepPlan(max_new_tokens=64, buckets=buckets, max_len=max_len, max_block=4)
    assert plan.pad_to == 704 and plan.pad_for([26, 115]) == 144 and plan.pad_for([26, 699]) == 704
    assert bucket_of(144, buckets) == 144
    with pytest.raises(ValueError, match="longer than every bucket"):
        bucket_of(705, buckets)


def test_repeat_spread_and_speedup_ranges():
    """Rates are medians over repeats of the repeat totals, min / max beside them; speed-up ranges pair the
    slowest and fastest repeats."""
    rec = lambda decodes, pred: {"n": 1, "predicted": pred, "draft": 0, "accepted": 0, "rounds": pred - 1,
                                 "wall_s": 0, "decode_s": 0, "prefill_s": 0.5, "walls": [d + 0.5 for d in decodes],
                                 "decodes": decodes, "prefills": [0.5] * len(decodes), "prompt_tokens": 10,
                                 "padded_tokens": 128, "per_position_accepted": [], "per_position_proposed": []}
    base = report.aggregate([rec([1.0, 2.0, 4.0], 9), rec([1.0, 1.0, 1.0], 9)])      # totals 2, 3, 5 s; 16 tokens
    assert base["decode_tokens_per_s"] == pytest.approx(16 / 3) and base["decode_s_total"] == pytest.approx(3)
    assert (base["decode_tokens_per_s_min"], base["decode_tokens_per_s_max"]) == (pytest.approx(16 / 5), 8.0)
    assert base["prefill_s_total"] == 1.0 and base["prefill_tokens_per_s"] == 20.0 and base["repeats"] == 3
    assert base["padded_prompt_tokens"] == 256
    spec = report.aggregate([rec([0.5, 1.0, 2.0], 17)])                                  # 16 tokens in 0.5, 1, 2 s
    rows = report.add_speedups([{"spec_type": "none", "temperature": 0, "batch_size": 1, **base},
                                {"spec_type": "mtp", "temperature": 0, "batch_size": 1, **spec}])
    assert rows[1]["decode_speedup"] == pytest.approx(16 / (16 / 3))
    assert rows[1]["decode_speedup_lo"] == pytest.approx(8 / 8) and rows[1]["decode_speedup_hi"] == pytest.approx(32 / 3.2)


def test_paired_speedups_take_the_ratio_within_each_pass():
    """Interleaved repeats (`--order interleaved`): the speed-up is the median [min–max] over the passes of the
    rate in pass r over the baseline's in pass r — a pass where the machine ran 2× slower for both counts 1×."""
    rec = lambda decodes: {"n": 1, "predicted": 17, "draft": 0, "accepted": 0, "rounds": 16, "wall_s": 0,
                           "decode_s": 0, "prefill_s": 0.0, "decodes": decodes, "walls": decodes,
                           "per_position_accepted": [], "per_position_proposed": []}
    base = report.aggregate([rec([1.0, 2.0, 1.0])])            # 16, 8, 16 tokens/s
    spec = report.aggregate([rec([0.8, 1.6, 0.5])])            # 20, 10, 32 tokens/s: ratios 1.25, 1.25, 2.0
    row = lambda spec_type, agg: {"spec_type": spec_type, "temperature": 0, "batch_size": 1, **agg}
    paired = report.add_speedups([row("none", base), row("mtp", spec)], paired=True)[1]
    assert (paired["decode_speedup"], paired["decode_speedup_lo"], paired["decode_speedup_hi"]) == \
        (pytest.approx(1.25), pytest.approx(1.25), pytest.approx(2.0))
    unpaired = report.add_speedups([row("none", base), row("mtp", spec)])[1]
    assert unpaired["decode_speedup"] == pytest.approx(20 / 16)
    assert (unpaired["decode_speedup_lo"], unpaired["decode_speedup_hi"]) == (pytest.approx(10 / 16), pytest.approx(4.0))


@pytest.mark.parametrize("interleaved", [True, False])
def test_sweep_times_settings_in_passes(interleaved, monkeypatch):
    """time_settings warms every setting up first, then (interleaved) runs pass by pass, every setting once
    per pass — or (grouped) each setting's repeats back to back; each batch gets one result per repeat."""
    from dsv4_jax.research import sweep
    calls = []
    monkeypatch.setattr(sweep, "warm_up", lambda model, g, s, plan, table: calls.append(("warm", s)) or 0.5)
    monkeypatch.setattr(sweep, "run_batch", lambda model, g, s, plan, n, table: calls.append(("run", s)) or {"s": s})
    monkeypatch.setattr(sweep, "shapes", lambda prompts, size, plan: [prompts[:size]])
    settings = [types.SimpleNamespace(name=n, batch_size=1, auto=False) for n in ("none", "mtp")]

    class Bar:
        update = staticmethod(lambda n: None)
    runs, warm = sweep.time_settings(None, [{"id": 0}, {"id": 1}], settings, None, 2, Bar(), {}, interleaved)
    names = [(kind, s.name) for kind, s in calls]
    assert names[:2] == [("warm", "none"), ("warm", "mtp")] and warm == [0.5, 0.5]
    timed = [n for kind, n in names[2:]]
    assert timed == ((["none"] * 2 + ["mtp"] * 2) * 2 if interleaved else ["none"] * 4 + ["mtp"] * 4)
    assert [[len(reps) for reps in per_setting] for per_setting in runs] == [[2, 2], [2, 2]]


@pytest.mark.parametrize("args, message", [
    (["--spec", "none,eagle"], "unknown spec type"),
    (["--draft-n-max", "-1"], "must be >= 1"),
    (["--draft-n-max", "0"], "must be >= 1"),
    (["--p-min", "1.5"], "--p-min: values must be in [0, 1]"),
    (["--temperature", "-0.5"], "--temperature: values must be >= 0, got -0.5"),
    (["--batch-size", "0"], "--batch-size: values must be >= 1"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--compile-threads", "-1"], "--compile-threads must be >= 0"),
    (["--by-output-position", "0"], "--by-output-position must be >= 1"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--draft-n-max", "x"], "not an integer"),
    (["--categories", "poetry"], "unknown category"),
    (["--prompt-template", "no placeholder"], "{prompt}"),
    (["--kernels", "triton"], "invalid choice: 'triton'"),
    (["--synthetic-accept", "0.5,1.5"], "--synthetic-accept: values must be"),
    (["--verify", "tree"], "invalid choice: 'tree'"),
    (["--context", "0"], "--context must be >= 1"),
    (["--context", "5000"], "new tokens is past the 4096 positions the model supports"),
])
def test_sweep_rejects_bad_options(args, message, tmp_path, capsys):
    _assert_rejected(sweep.main, args, message, tmp_path, capsys)


def _assert_rejected(main, args, message, tmp_path, capsys):
    """main exits 2 before any work with `message` on stderr, and writes no output directory."""
    out = tmp_path / "never"
    with pytest.raises(SystemExit) as e:
        main(["--random-tiny", "--out", str(out), "--no-compile-cache", *args])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("args, message", [
    (["--schedule", "static,fifo"], "--schedule: unknown schedule(s) ['fifo']"),
    (["--output-lengths", "16"], "--output-lengths: give a range LO-HI"),
    (["--output-lengths", "16-256", "--max-new-tokens", "8"], "--max-new-tokens or --output-lengths"),
    (["--chunk-rounds", "0"], "--chunk-rounds must be >= 1"),
    (["--refill-min", "0"], "--refill-min must be >= 1"),
    (["--prefill-ahead", "0"], "--prefill-ahead must be >= 1"),
    (["--mesh", "2x2"], "expected DATAxEXPERTxMODEL"),
    (["--mesh", "1x3x1"], "needs 3 devices"),
])
def test_batch_eval_rejects_bad_options(args, message, tmp_path, capsys):
    _assert_rejected(batch_eval.main, args, message, tmp_path, capsys)


def test_bad_prompt_files_and_dirs(tmp_path, capsys):
    out = tmp_path / "never"
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"id": "a", "tokens": [1, 2]}\n{"id": "b", "tokens": [1,\n')
    neither = tmp_path / "neither.jsonl"
    neither.write_text('{"id": "a"}\n')
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("keep me")
    cases = [(["--prompts-file", str(empty)], "holds no prompts"),
             (["--prompts-file", str(broken)], "broken.jsonl:2: not valid JSON"),
             (["--prompts-file", str(neither)], "exactly one of 'tokens'"),
             (["--prompts-file", str(tmp_path / "missing.jsonl")], "does not exist"),
             (["--model", str(tmp_path)], "neither a bundle"),
             (["--model", str(tmp_path / "nope")], "is not a directory")]
    for args, message in cases:
        for main in (sweep.main, batch_eval.main):
            with pytest.raises(SystemExit):
                main((["--random-tiny"] if "--model" not in args else []) + ["--out", str(out), *args])
            assert message in capsys.readouterr().err
            assert not out.exists()
    with pytest.raises(SystemExit):
        sweep.main(["--random-tiny", "--out", str(full)])
    assert "not empty" in capsys.readouterr().err
    assert os.listdir(full) == ["x"]
    afile = tmp_path / "afile"
    afile.write_text("x")
    for target, message in ((afile, "exists and is not a directory"), (afile / "sub" / "out", "is a file")):
        with pytest.raises(SystemExit):
            sweep.main(["--random-tiny", "--out", str(target), "--no-compile-cache"])
        assert message in capsys.readouterr().err
    assert afile.read_text() == "x"


def test_model_without_a_drafter_and_missing_default_model(tmp_path, capsys, monkeypatch):
    config = _config()
    path = str(tmp_path / "target_only")
    save_bundle(path, config, d.init_params(config, 3), {}, dtype=jnp.float32)
    with pytest.raises(SystemExit):
        sweep.main(["--model", path, "--out", str(tmp_path / "o"), "--spec", "none,mtp", "--no-compile-cache"])
    assert "has no MTP weights" in capsys.readouterr().err
    import dsv4_jax.demo
    monkeypatch.setattr(dsv4_jax.demo, "ASSET_DIR", str(tmp_path / "no_assets"))
    with pytest.raises(SystemExit):
        batch_eval.main(["--out", str(tmp_path / "o"), "--no-compile-cache"])
    assert "bundled tiny model is not installed" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_lists_suites_and_prompt_files(tmp_path):
    assert common.int_list("1-3,5", "k") == [1, 2, 3, 5] and common.int_list("2..4", "k") == [2, 3, 4]
    assert common.float_list("0.5,0,0.5", "p", 0, 1) == [0.0, 0.5]
    for name in P.SUITE_FILES:
        suite = P.load_suite(name)
        assert {p["category"] for p in suite["prompts"]} == set(P.CATEGORIES)
    assert len(P.select(P.load_suite("tiny")["prompts"], per_category=1)) == len(P.CATEGORIES)
    f = tmp_path / "p.jsonl"
    f.write_text('{"id": "t", "category": "c", "tokens": [256, 65]}\n{"id": "x", "text": "hi"}\n')
    recs = P.read_prompts_file(str(f))
    assert recs[1]["category"] == "default"
    from dsv4_jax.demo import ByteTokenizer
    toks = P.tokenize(recs, ByteTokenizer().encode, 260, "<{prompt}>")
    assert toks[0]["tokens"] == [256, 65] and toks[1]["tokens"] == [256, *b"<hi>"]
    with pytest.raises(P.PromptError, match="no tokenizer"):
        P.tokenize(recs, None, 260)
    with pytest.raises(P.PromptError, match="outside"):
        P.tokenize(recs, ByteTokenizer().encode, 100)
    rows = report.add_speedups([{"spec_type": "none", "temperature": 0, "batch_size": 1, "tokens_per_s": 10.0},
                                {"spec_type": "mtp", "temperature": 0, "batch_size": 1, "tokens_per_s": 15.0},
                                {"spec_type": "mtp", "temperature": 0, "batch_size": 2, "tokens_per_s": 15.0}])
    assert [r["speedup"] for r in rows] == [1.0, 1.5, None]
    assert report.percentiles([1, 2, 3, 4])["p50"] == pytest.approx(2.5)
    agg = report.aggregate([{"n": 1, "predicted": 8, "draft": 4, "accepted": 2, "rounds": 5, "wall_s": 2.0,
                             "decode_s": 1.75, "per_position_accepted": [2, 0], "per_position_proposed": [3, 1]}])
    assert agg["aggregate_accept_rate"] == 0.5 and agg["mean_accepted_length"] == pytest.approx(7 / 5)
    assert agg["per_position_accept_rate"] == [pytest.approx(2 / 3), 0.0] and agg["tokens_per_s"] == 4.0
    assert agg["decode_tokens_per_s"] == 4.0      # 7 tokens from the loop (the prefill sampled the first)
    np.testing.assert_equal(agg["n_requests"], 1)


def test_shared_draft_widths_plans_one_loop(bundle):
    """--shared-draft-widths (default): one loop program for MTP and DSpark at every draft_n_max
    (RunShape.dynamic_draft_n; verify widths 2 and 3 in it); --no-shared-draft-widths: one per width."""
    loops = {}
    for extra in (["--no-shared-draft-widths"], []):
        parser = sweep.build_parser()
        a = parser.parse_args(["--model", bundle, "--out", "unused", "--draft-n-max", "1,2", "--limit", "1", *extra])
        grid, model, notes, _, prompts, suite_max_new = sweep.prepare_run(
            parser, a, sweep.parse_grid, lambda g: (g["specs"], g["ks"]))
        settings = sweep.build_settings(**grid)
        _, plan, _ = sweep.plan_run(a, model, prompts, settings, suite_max_new, notes)
        n = sweep.programs(settings, prompts, plan, model)
        loops[not extra] = (plan.dynamic_draft_n, n["loop"], n["extra_width"])
        opts = plan_options(prompts, settings[1], plan)["run"]
        assert opts.dynamic_draft_n == (not extra) and opts.max_block == 3
    assert loops == {False: (False, 3, 0), True: (True, 2, 1)}
