"""dsv4-sweep / dsv4-batch-eval with --draft-n-max auto (the width scheduler, docs/width_scheduler.md) on a tiny
random 2-layer model: the option checks, the report's width columns (by hand), and short runs whose greedy tokens
must equal the no-speculation baseline's.

The runs use a hand-written cost table in which wider rounds are *cheaper*: every width then expects one
token per round from the random drafter, so the scheduler picks the widest (tokens / cost is largest there)
and the auto runs verify real drafts each round — a table of realistic costs would choose width 0 and make
the lossless check vacuous.
"""
import json
import os

import jax.numpy as jnp
import pytest

import dsv4_jax as d
from dsv4_jax.config import HASH_MOE, MOE, _schedule
from dsv4_jax.io.demo_io import save_bundle
from dsv4_jax.model.params import init_mtp
from dsv4_jax.research import batch_eval, common, report, sweep
from dsv4_jax.research.common import OptionError
from dsv4_jax.research.runner import grid_settings
from dsv4_jax.speculative import cost_table, loop
from dsv4_jax.speculative.cost_table import CostTable

from .test_research_cli import _assert_rejected

CHEAP_WIDE = {"format": cost_table.FORMAT, "seconds": [1.0, 0.5, 0.4], "plain_seconds": 1.0}
RUN = ["--limit", "1", "--max-new-tokens", "6", "--repeats", "1", "--no-compile-cache", "--quiet", "--no-plots"]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """A random 2-layer target with MTP, saved like the demo bundle."""
    types, ratios = _schedule([0, 0])
    config = d.tiny().replace(name="test_width_cli", vocab_size=260, bos_token_id=256, eos_token_id=257,
                              num_layers=2, layer_types=types, compress_ratios=ratios,
                              mlp_layer_types=(HASH_MOE, MOE))
    params = d.init_params(config, 0)
    params["mtp"] = init_mtp(config, 1)
    path = str(tmp_path_factory.mktemp("model") / "bundle")
    save_bundle(path, config, params, {}, dtype=jnp.float32)
    return path


@pytest.fixture(scope="module")
def table_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("costs") / "costs.json"
    path.write_text(json.dumps(CHEAP_WIDE))
    return str(path)


@pytest.fixture(scope="module")
def sweep_out(bundle, table_file, tmp_path_factory):
    """none, mtp k=1 and mtp auto (bound 2); the loop programs compiled: none's and one shared by k=1 and auto."""
    out = str(tmp_path_factory.mktemp("sweep") / "res")
    before = loop.run_rounds._cache_size()
    assert sweep.main(["--model", bundle, "--out", out, "--spec", "none,mtp", "--draft-n-max", "1,auto",
                       "--draft-n-max-bound", "2", "--cost-table", table_file,
                       *[x for x in RUN if x != "--no-plots"]]) == 0
    return out, loop.run_rounds._cache_size() - before


def _records(path):
    with open(os.path.join(path, "results.jsonl")) as f:
        return [json.loads(line) for line in f]


# ---- options (no model work) --------------------------------------------------------------------

def test_draft_n_max_lists():
    assert common.draft_n_max_list("auto", 3) == ([1, 2, 3], True)        # auto alone: beside 1..K
    assert common.draft_n_max_list("2,auto", 7) == ([2], True)
    assert common.draft_n_max_list("1-3", 7) == ([1, 2, 3], False)
    with pytest.raises(OptionError, match="'fast' is not an integer"):
        common.draft_n_max_list("1,fast", 3)
    settings = grid_settings(["none", "mtp"], [1], {"p_min": [0.0]}, [0.0], [1], auto_bound=4)
    assert [s.label for s in settings] == ["none T=0 B=1", "mtp k=1 p_min=0 T=0 B=1", "mtp k=auto p_min=0 T=0 B=1"]
    auto = settings[-1]
    assert auto.as_dict()["draft_n_max"] == "auto" and auto.as_dict()["draft_n_max_bound"] == 4
    assert auto.table_key == ("mtp", 1, True)


def _bad_tables(tmp_path):
    not_json = tmp_path / "not_json.json"
    not_json.write_text("{seconds: 1")
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"seconds": [1.0]}))
    negative = tmp_path / "negative.json"
    negative.write_text(json.dumps({**CHEAP_WIDE, "seconds": [1.0, -0.5, 0.4]}))
    narrow = tmp_path / "narrow.json"
    narrow.write_text(json.dumps({**CHEAP_WIDE, "seconds": [1.0, 0.5]}))
    return [
        (["--draft-n-max", "fast"], "--draft-n-max: 'fast' is not an integer"),
        (["--draft-n-max", "auto", "--draft-n-max-bound", "0"], "--draft-n-max-bound must be >= 1"),
        (["--draft-n-max", "2", "--cost-table", str(wrong)], "need 'auto' in --draft-n-max"),
        (["--draft-n-max", "auto", "--cost-table", str(tmp_path / "missing.json")], "missing.json"),
        (["--draft-n-max", "auto", "--cost-table", str(not_json)], f"{not_json}: not JSON"),
        (["--draft-n-max", "auto", "--cost-table", str(wrong)], "not a cost table"),
        (["--draft-n-max", "auto", "--cost-table", str(negative)], "positive seconds"),
        (["--draft-n-max", "auto", "--draft-n-max-bound", "2", "--cost-table", str(narrow)],
         "prices up to 1 drafts per round, --draft-n-max-bound is 2"),
        (["--draft-n-max", "auto", "--cost-table", str(wrong), "--recalibrate"], "not both"),
    ]


@pytest.mark.parametrize("main", [sweep.main, batch_eval.main], ids=["sweep", "batch_eval"])
def test_bad_width_options_exit_2(main, tmp_path, capsys):
    for args, message in _bad_tables(tmp_path):
        _assert_rejected(main, args, message, tmp_path, capsys)


def test_predictions_and_why_by_hand():
    """Break-even = seconds[w] / plain; predicted = mal × plain / seconds[w]; auto: tokens × plain / modelled cost."""
    t = CostTable(seconds=(1.0, 1.25, 1.6), plain_seconds=1.0)
    base = {"temperature": 0.0, "batch_size": 1, "knob_name": None}
    rows = [{**base, "spec_type": "none", "draft_n_max": 0, "label": "none", "decode_speedup": 1.0},
            {**base, "spec_type": "mtp", "draft_n_max": 1, "effective_draft_n_max": 1, "label": "mtp k=1",
             "mean_accepted_length": 1.5, "decode_speedup": 1.1},
            {**base, "spec_type": "mtp", "draft_n_max": 2, "effective_draft_n_max": 2, "label": "mtp k=2",
             "mean_accepted_length": 1.6, "decode_speedup": 0.9},
            {**base, "spec_type": "mtp", "draft_n_max": "auto", "effective_draft_n_max": 2, "label": "mtp k=auto",
             "mean_accepted_length": 1.5, "total_draft_accepted": 10, "rounds": 20, "modelled_cost_s": 25.0,
             "width_histogram": {"0": 0, "1": 20, "2": 0, "plain": 0}, "expected_tokens_per_round": 1.4,
             "decode_speedup": 1.05, "decode_tokens_per_s": 50.0}]
    report.add_width_predictions(rows, {("mtp", 1, True): t})
    assert "predicted_speedup" not in rows[0]
    assert rows[1]["break_even_tokens_per_round"] == pytest.approx(1.25)
    assert rows[1]["predicted_speedup"] == pytest.approx(1.5 / 1.25)
    assert rows[2]["predicted_speedup"] == pytest.approx(1.6 / 1.6)
    assert rows[3]["predicted_speedup"] == pytest.approx(30 * 1.0 / 25.0)
    why = report.width_why(rows)
    assert len(why) == 1 and "k=1 needs 1.25 tokens/round, measured 1.50 (pays)" in why[0]
    assert "k=2 needs 1.60 tokens/round, measured 1.60 (loses)" in why[0]
    assert "Cost table ranks k=1 best (1.20×), measured best k=1 (1.10×)" in why[0]
    assert "auto chose widths 1:20" in why[0]
    md = report.width_markdown(rows, {})
    assert "| mtp k=auto | 50.0 | 1.05× | 1.20× | 1:20 | 1.400 | 1.500 |" in md
    assert "| mtp k=1 | 1 | 1.250 | 1.500 | 1.20× | 1.10× |" in md


# ---- runs ---------------------------------------------------------------------------------------

def test_sweep_auto_is_lossless_and_reported(sweep_out):
    out, loops = sweep_out
    # the fixed width runs in the auto program: one loop for mtp (k=1 and auto), one for none
    assert loops == 2
    recs = _records(out)
    by = {r["label"]: r for r in recs}
    none, auto = by["none T=0 B=1"], by["mtp k=auto p_min=0 T=0 B=1"]
    assert auto["draft_n_max"] == "auto" and auto["draft_n_max_bound"] == 2
    assert auto["output_tokens"] == none["output_tokens"] and len(none["output_tokens"]) == 6
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    rows = {r["label"]: r for r in summary["settings"]}
    a, k1 = rows["mtp k=auto p_min=0 T=0 B=1"], rows["mtp k=1 p_min=0 T=0 B=1"]
    # wider is cheaper in the table: every round verified both drafts
    assert a["width_histogram"] == {"0": 0, "1": 0, "2": a["rounds"], "plain": 0} and a["rounds"] > 0
    assert a["outputs_match_baseline"] == 1.0 and a["expected_tokens_per_round"] >= 1.0
    assert a["predicted_speedup"] == pytest.approx((a["total_draft_accepted"] + a["rounds"]) / (0.4 * a["rounds"]),
                                                   rel=1e-5)
    assert k1["break_even_tokens_per_round"] == pytest.approx(0.5)
    assert k1["predicted_speedup"] == pytest.approx(k1["mean_accepted_length"] / 0.5)
    meta = summary["meta"]
    assert "tokens_per_s.png" in meta["plots"] and os.path.exists(os.path.join(out, "tokens_per_s.png"))
    assert meta["draft_n_max_bound"] == 2 and meta["adaptive_widths"]
    assert [(t["spec_type"], t["batch_size"], t["greedy"], t["how"]) for t in meta["cost_tables"]] == \
        [("mtp", 1, True, "given")]
    assert meta["cost_tables"][0]["table"]["seconds"] == CHEAP_WIDE["seconds"]
    with open(os.path.join(out, "summary.md")) as f:
        md = f.read()
    for text in ("| mtp | auto≤2 |", "chosen widths", "expected tokens/round", "break-even tokens/round",
                 "predicted speed-up", "measured speed-up", "Why:", "2:"):
        assert text in md, text


def test_sweep_calibrates_and_caches(bundle, sweep_out, tmp_path, monkeypatch, capsys):
    """Without --cost-table the sweep measures the table on its own program (the fixture's, compiled) and
    caches it: a second run reads it back, --recalibrate measures again."""
    monkeypatch.setattr(cost_table, "DEFAULT_CACHE", str(tmp_path / "cache" / "dsv4_jax" / "cost_tables"))
    args = ["--model", bundle, "--spec", "mtp", "--draft-n-max", "2,auto", "--draft-n-max-bound", "2", *RUN]
    hows = []
    for i, extra in enumerate([[], [], ["--recalibrate"]]):
        out = str(tmp_path / f"run{i}")
        assert sweep.main([*args, "--out", out, *extra]) == 0
        with open(os.path.join(out, "summary.json")) as f:
            tables = json.load(f)["meta"]["cost_tables"]
        assert len(tables) == 1 and tables[0]["table"]["drafter"] == "mtp"
        assert len(tables[0]["table"]["seconds"]) == 3 and all(s > 0 for s in tables[0]["table"]["seconds"])
        hows.append(tables[0]["how"])
    assert hows == ["measured", "cached", "measured"]
    assert len(os.listdir(tmp_path / "cache" / "dsv4_jax" / "cost_tables")) == 1
    assert "cost table (measured; drafter mtp, batch 1)" in capsys.readouterr().err


def test_batch_eval_auto_is_lossless(bundle, table_file, tmp_path):
    """Static and continuous schedules (the same slot programs), auto alone = k=1 and auto."""
    out = str(tmp_path / "be")
    assert batch_eval.main(["--model", bundle, "--out", out, "--spec", "none,mtp", "--draft-n-max", "auto",
                            "--draft-n-max-bound", "1", "--cost-table", table_file, "--schedule", "static,continuous",
                            "--num-prompts", "1", "--batch-size", "1", *RUN]) == 0
    recs = {(r["label"], r["schedule"]): r for r in _records(out)}
    labels = ["none T=0 B=1", "mtp k=1 p_min=0 T=0 B=1", "mtp k=auto p_min=0 T=0 B=1"]
    assert set(recs) == {(label, s) for label in labels for s in ("static", "continuous")}
    want = recs[("none T=0 B=1", "static")]["output_tokens"]
    assert len(want) == 6
    for s in ("static", "continuous"):
        assert recs[("mtp k=auto p_min=0 T=0 B=1", s)]["output_tokens"] == want, s
    with open(os.path.join(out, "batch_eval.json")) as f:
        summary = json.load(f)
    rows = {(r["label"], r["schedule"]): r for r in summary["settings"]}
    for s in ("static", "continuous"):
        a = rows[("mtp k=auto p_min=0 T=0 B=1", s)]
        assert a["width_histogram"] == {"0": 0, "1": a["rounds"], "plain": 0} and a["rounds"] > 0
        assert a["predicted_speedup"] == pytest.approx((a["total_draft_accepted"] + a["rounds"]) / (0.5 * a["rounds"]),
                                                       rel=1e-5)
        assert rows[("mtp k=1 p_min=0 T=0 B=1", s)]["break_even_tokens_per_round"] == pytest.approx(0.5)
    assert [t["how"] for t in summary["meta"]["cost_tables"]] == ["given"]
    with open(os.path.join(out, "batch_eval.md")) as f:
        md = f.read()
    assert "auto≤1" in md and "chosen widths" in md and "predicted speed-up" in md


def test_batch_eval_calibrates_on_its_engine_and_caches(bundle, tmp_path, monkeypatch):
    """Without --cost-table an auto setting's table is measured on the setting's own slot engine (its rounds
    under the continuous schedule, B = 2), cached with the engine's shapes, read back by the next run."""
    monkeypatch.setattr(cost_table, "DEFAULT_CACHE", str(tmp_path / "cache"))
    args = ["--model", bundle, "--spec", "mtp", "--draft-n-max", "auto", "--draft-n-max-bound", "1",
            "--schedule", "continuous", "--num-prompts", "2", "--batch-size", "2", *RUN]
    hows = []
    for i in range(2):
        out = str(tmp_path / f"be{i}")
        assert batch_eval.main([*args, "--out", out]) == 0
        with open(os.path.join(out, "batch_eval.json")) as f:
            tables = json.load(f)["meta"]["cost_tables"]
        (meta,) = [t for t in tables]
        table = meta["table"]
        assert table["batch"] == 2 and len(table["seconds"]) == 2 and table["plain_seconds"] > 0
        assert table["key"]["shapes"]["engine"]["schedule"] == "continuous"
        hows.append(meta["how"])
    assert hows == ["measured", "cached"]
    (name,) = os.listdir(tmp_path / "cache")
    assert name.startswith("mtp-b2-")
