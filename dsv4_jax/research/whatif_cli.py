"""`dsv4-whatif` (= `dsv4-sweep --what-if`, `research.sweep.what_if_main`): a sweep grid's greedy acceptance from one teacher-forced pass, its
predicted speed from cost tables, and (--compare) a check against a real sweep (docs/whatif.md).

The grid, prompts, model and shared shapes are dsv4-sweep's (same options); instead of timing every setting it
computes every setting's rounds exactly (`research.whatif.evaluate`) and prices them:

    predicted decode time of a batch = its rounds × seconds[k]   (fixed k; the batch's longest sequence's rounds)
                                       Σ chosen widths' seconds + plain rounds × plain_seconds   (auto: the batch's)
    predicted speed-up = the same tokens' plain decoding time (the longest sequence's tokens − 1 plain rounds per
                         batch) / that

with the cost table of the run (dsv4-sweep's: measured by a cached calibration of the sweep's own programs,
--cost-table, or --roofline) and every table of --price (files or roofline machines: "per machine").

Output (--out DIR): results.jsonl (one line per prompt × setting, with each round's [drafted, accepted]),
summary.json, summary.md, predicted_speedup.png.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Sequence

from ..analysis.roofline import machine as parse_machine
from ..drafters.dspark import RULES
from ..drafters.precision import AS_LOADED, PRECISIONS
from ..speculative.cost_table import CostTable, CostTableError, from_aot_report
from . import common, report
from .common import OptionError
from .runner import BASELINE, batches
from .whatif import evaluate, evaluate_sampled, label

TITLE = "What-if"


def add_args(p) -> None:
    g = p.add_argument_group("what-if (docs/whatif.md)")
    g.add_argument("--what-if", action="store_true",
                   help="compute every greedy setting's rounds from one teacher-forced pass instead of running it, "
                        "and predict its speed from cost tables (dsv4-whatif)")
    g.add_argument("--price", metavar="TABLES",
                   help="--what-if: more cost tables to predict with, comma-separated: cost table JSON files, "
                        "dsv4-aot JSON reports (their roofline seconds, `cost_table.from_aot_report`) or roofline "
                        "machines (h100, h200, v5e, v5p, v6e, NAME:GBPS[:FIXED_US])")
    g.add_argument("--drafter-precision", default=AS_LOADED, metavar="P",
                   help=f"--what-if: the drafter's weights stored at each of these precisions, the target as loaded "
                        f"(comma-separated of {', '.join(PRECISIONS)}; `drafters.precision`): acceptance per "
                        f"precision from the same target pass (default {AS_LOADED}); predictions use the run's cost "
                        "tables")
    g.add_argument("--confidence-rule", metavar="RULES",
                   help="--what-if: DSpark's confidence rules to compute besides the model's own, comma-separated "
                        f"({', '.join(RULES)}; each a proposal pass, its rows labelled rule=…)")
    g.add_argument("--compare", metavar="SWEEP_DIR",
                   help="--what-if: compare with a dsv4-sweep output directory of the same grid (its "
                        "results.jsonl; run it with --by-output-position to compare every round)")


def check(a) -> None:
    """What-if option checks before any model work (raises OptionError)."""
    a.precisions = [t.strip().lower() for t in a.drafter_precision.split(",") if t.strip()]
    a.rules = [t.strip().lower() for t in (a.confidence_rule or "").split(",") if t.strip()]
    if not a.what_if:
        if a.price or a.compare or a.precisions != [AS_LOADED] or a.rules:
            raise OptionError("--price, --compare, --drafter-precision and --confidence-rule need --what-if")
        return
    if any(r not in RULES for r in a.rules):
        raise OptionError(f"--confidence-rule: unknown {[r for r in a.rules if r not in RULES]}; choose from "
                          f"{', '.join(RULES)}")
    bad = [p for p in a.precisions if p not in PRECISIONS]
    if bad or not a.precisions:
        raise OptionError(f"--drafter-precision: unknown {bad or [a.drafter_precision]}; choose from "
                          f"{', '.join(PRECISIONS)}")
    if not [t for t in common.spec_list(a.spec) if t != BASELINE]:
        raise OptionError("--what-if needs a drafter in --spec (the rounds of 'none' need no what-if)")
    if any(t != 0 for t in common.float_list(a.temperature, "--temperature", 0.0)) and (
            any(v != 0 for v in common.float_list(a.p_min, "--p-min", 0.0, 1.0) +
                common.float_list(a.confidence, "--confidence", 0.0, 1.0))):
        raise OptionError("--what-if at --temperature > 0 (the sampled estimate, docs/whatif.md §5) takes stop "
                          "thresholds 0 only (--p-min 0 --confidence 0)")
    if a.compare and not os.path.isfile(os.path.join(a.compare, "results.jsonl")):
        raise OptionError(f"--compare: {a.compare} has no results.jsonl (a dsv4-sweep output directory)")
    for item in _price_items(a):
        if os.path.isfile(item):
            _file_table(item, "mtp")
        else:
            try:
                parse_machine(item)
            except CostTableError as e:
                raise OptionError(f"--price {item!r}: not a file, and {e}") from None


def _price_items(a) -> list[str]:
    return [t.strip() for t in (a.price or "").split(",") if t.strip()]


def price_tables(a, model, prompts, settings, plan) -> dict[str, dict]:
    """{name: {(spec, batch, greedy): CostTable}} of --price's files and machines."""
    out = {}
    for item in _price_items(a):
        if os.path.isfile(item):
            out[os.path.basename(item)] = {key: _file_table(item, key[0]) for key in _keys(settings)}
        else:
            tables = common.cost_tables(model, prompts, _auto(settings), plan, machine=parse_machine(item))
            out[item] = {key: v["table"] for key, v in tables.items()}
    return out


def _file_table(path: str, drafter: str) -> CostTable:
    """A cost table file, or a `dsv4-aot` JSON report's table for drafter (`cost_table.from_aot_report`)."""
    try:
        return CostTable.load(path)
    except CostTableError as e:
        try:
            return from_aot_report(path, drafter)
        except CostTableError as e2:
            raise OptionError(f"--price {path}: neither a cost table ({e}) nor a dsv4-aot report ({e2})") from None


def _keys(settings) -> set:
    return {s.table_key for s in settings if s.spec != BASELINE}


def _auto(settings) -> list:
    """One auto setting per (drafter, batch size) at the widest width of the grid: what a cost table is made for."""
    bound = {}
    for s in settings:
        if s.spec != BASELINE:
            bound[s.table_key] = max(bound.get(s.table_key, 1), s.draft_n_max)
    return [dataclasses.replace(s, auto=True, draft_n_max=bound[s.table_key]) for s in settings if s.spec != BASELINE]


# ---- predictions ----------------------------------------------------------------------------------------

def predicted_speedup(setting, records: Sequence[dict], table: CostTable) -> float | None:
    """The setting's predicted decode speed-up over plain decoding under table (module docstring); None when the
    table prices fewer widths or an auto record has no chosen widths."""
    spec_s = plain_s = 0.0
    for group in batches(list(records), setting.batch_size):
        plain_s += max(r["pred"] - 1 for r in group) * table.plain_seconds
        if setting.auto:
            ws = group[0].get("widths")
            if ws is None:
                return None
            spec_s += sum(table.plain_seconds if w < 0 else table.seconds[w] for w in ws)
        else:
            if setting.draft_n_max > table.bound:
                return None
            seconds = table.raw_seconds[setting.draft_n_max] if table.raw_seconds else table.seconds[setting.draft_n_max]
            spec_s += max(r["rounds"] for r in group) * seconds
    return plain_s / spec_s if spec_s > 0 else None


def rows_of(settings, records: list[dict], tables: dict[str, dict], bucket: int | None) -> list[dict]:
    """One summary row per setting: dsv4-sweep's acceptance fields, predicted speed-up per cost table."""
    rows = []
    variants = dict.fromkeys((r["drafter_precision"], r["confidence_rule"]) for r in records)
    for s, (prec, rule) in ((s, v) for v in variants for s in settings):
        rs = [r for r in records if r["label"] == label(s, prec, rule)]
        if not rs:
            continue
        K = max(len(r["per_position_accepted"]) for r in rs)
        acc = [sum(r["per_position_accepted"][j] for r in rs if j < len(r["per_position_accepted"])) for j in range(K)]
        prop = [sum(r["per_position_proposed"][j] for r in rs if j < len(r["per_position_proposed"])) for j in range(K)]
        draft, accepted, rounds = (sum(r[k] for r in rs) for k in ("draft", "acc", "rounds"))
        row = {**s.as_dict(), "label": label(s, prec, rule), "drafter_precision": prec, "confidence_rule": rule,
               "n_requests": len(rs), "total_predicted": sum(r["pred"] for r in rs),
               "total_draft": draft, "total_draft_accepted": accepted, "rounds": rounds,
               "aggregate_accept_rate": accepted / draft if draft else 0.0,
               "mean_accepted_length": (accepted + rounds) / rounds if rounds else 0.0,
               # tokens the rounds emitted (the first token comes from the prefill): what the cost table prices
               "emitted_per_round": sum(r["pred"] - 1 for r in rs) / rounds if rounds else 0.0,
               "per_position_accepted": acc, "per_position_proposed": prop,
               "per_position_accept_rate": [a / p if p else 0.0 for a, p in zip(acc, prop)],
               "per_category": report.per_category(rs),
               "predicted_speedup": {name: predicted_speedup(s, rs, t[s.table_key]) for name, t in tables.items()
                                     if s.table_key in t}}
        if s.auto:
            hist = {}
            for r in rs:
                for w in r.get("widths", []):
                    key = "plain" if w < 0 else str(w)
                    hist[key] = hist.get(key, 0) + 1
            row["width_histogram"] = hist
        if "approximation" in rs[0]:
            row["approximation"] = rs[0]["approximation"]
        elif bucket:
            row["by_output_position"] = report.by_output_position((r["round_trace"] for r in rs), bucket)
        rows.append(row)
    return rows


def best(rows: list[dict], tables: dict[str, dict]) -> list[dict]:
    """Per cost table, drafter-independent batch size: the setting with the highest predicted speed-up, or "none"
    when no setting beats plain decoding."""
    out = []
    for name in tables:
        for b in sorted({r["batch_size"] for r in rows}):
            cands = [r for r in rows if r["batch_size"] == b and r["predicted_speedup"].get(name) is not None]
            if not cands:
                continue
            top = max(cands, key=lambda r: r["predicted_speedup"][name])
            for spec in sorted({r["spec_type"] for r in cands}):
                mine = max((r for r in cands if r["spec_type"] == spec), key=lambda r: r["predicted_speedup"][name])
                out.append({"table": name, "batch_size": b, "spec_type": spec, "label": mine["label"],
                            "predicted_speedup": mine["predicted_speedup"][name]})
            out.append({"table": name, "batch_size": b, "spec_type": "best",
                        "label": top["label"] if top["predicted_speedup"][name] > 1 else "none (no speculation)",
                        "predicted_speedup": max(top["predicted_speedup"][name], 1.0)})
    return out


def why_lines(rows: list[dict], tables: dict[str, dict]) -> list[str]:
    """Per cost table, drafter, knob and batch size: each fixed width's break-even tokens per round (seconds[k] /
    plain_seconds) beside the tokens its rounds emit (the mean accepted length, less what EOS or the budget cut)."""
    out = []
    for name, ts in tables.items():
        groups: dict[tuple, list] = {}
        for r in rows:
            if not r["draft_n_max"] == "auto" and r["predicted_speedup"].get(name) is not None:
                groups.setdefault((r["spec_type"], report.knob_text(r), r["batch_size"], r["drafter_precision"],
                                   r.get("confidence_rule")), []).append(r)
        for (spec, knob, b, prec, rule), rs in groups.items():
            t = ts[(spec, b, True)]
            parts = [f"k={r['draft_n_max']} needs {t.break_even(r['draft_n_max']):.2f} tokens/round, emits "
                     f"{r['emitted_per_round']:.2f} ({'pays' if r['predicted_speedup'][name] > 1 else 'loses'})"
                     for r in sorted(rs, key=lambda r: r["draft_n_max"])]
            out.append(f"- {name}: **{spec}**{'' if prec == AS_LOADED else ' (' + prec + ')'}"
                       f"{'' if knob == '–' else ' ' + knob}{'' if rule is None else ' ' + rule} B={b}: "
                       + "; ".join(parts))
    return out


# ---- the comparison with a real sweep -----------------------------------------------------------------

def compare(sweep_dir: str, records: list[dict], evaluation: dict) -> dict:
    """Each prompt × setting of the sweep's results.jsonl that the what-if computed: equal when the tokens, drafts,
    accepted drafts and rounds (and every round, where the sweep kept its round trace) are; a difference is
    named with the first differing round's anchor and the drafter's and the target's top-1 − top-2 margins there."""
    with open(os.path.join(sweep_dir, "results.jsonl"), encoding="utf-8") as f:
        real = [json.loads(line) for line in f if line.strip()]
    mine = {(r["label"], r["id"]): r for r in records}
    ids = {i: b for b, i in enumerate(dict.fromkeys(r["id"] for r in records))}
    compared, equal, diffs, per_setting = 0, 0, [], {}
    for r in real:
        w = mine.get((r["label"], r["id"]))
        if w is None or r["spec_type"] == BASELINE or "approximation" in w:
            continue
        compared += 1
        same = all(r[k] == w[k] for k in ("pred", "draft", "acc", "rounds"))
        if "round_trace" in r:
            same = same and [list(x) for x in r["round_trace"]] == w["round_trace"]
        equal += same
        s = per_setting.setdefault(r["label"], [0, 0])
        s[0] += 1
        s[1] += same
        if not same:
            diffs.append(_difference(r, w, evaluation, ids[r["id"]]))
    return {"sweep_dir": sweep_dir, "compared": compared, "equal": equal, "per_setting": per_setting,
            "differences": diffs}


def _difference(real: dict, mine: dict, ev: dict, b: int) -> dict:
    out = {"label": real["label"], "id": real["id"], "sweep": {k: real[k] for k in ("pred", "draft", "acc", "rounds")},
           "what_if": {k: mine[k] for k in ("pred", "draft", "acc", "rounds")}}
    trace = real.get("round_trace")
    if trace is None:
        return out
    i = 0
    for r, (x, y) in enumerate(zip(trace, mine["round_trace"])):
        if list(x) != y:
            p, path = ev["proposals"][real["spec_type"], AS_LOADED, None], ev["paths"][b]
            P = len(path.prompt)
            out.update(round=r, anchor=i, sweep_round=list(x), what_if_round=y,
                       drafter_margin=[float(m) for m in p.margin[b, i]],
                       target_margin=[float(m) for m in ev["target"].margin[b, P + i - 1:P + i + len(y) + 1]])
            break
        i += x[1] + 1
    return out


# ---- report -------------------------------------------------------------------------------------------------

def markdown(summary: dict) -> str:
    meta, rows = summary["meta"], summary["settings"]
    names = list(meta["tables"])
    lines = [f"# {TITLE} — {meta['model']['name']}", "",
             f"- prompts: {meta['n_prompts']} from `{meta['suite']}`, max_new_tokens {meta['max_new_tokens']}",
             f"- {report.machine_line(meta['env'])}",
             f"- command: `{meta['env']['command']}`",
             f"- what-if wall {meta['wall_s']:.1f} s: continuations {meta['timing']['continuation_s']:.1f} s, target "
             f"pass {meta['timing']['target_pass_s']:.1f} s, proposals "
             + ", ".join(f"{k} {v:.1f} s" for k, v in meta['timing']['proposals_s'].items())
             + f", walks {meta['timing']['walk_s']:.2f} s, sampled estimates {meta['timing']['sampled_s']:.1f} s; "
             f"cost tables {meta['tables_s']:.1f} s",
             "", "Every greedy setting's accepted drafts are computed exactly from one teacher-forced pass "
             "(docs/whatif.md); settings with T > 0 are estimated (≈: the expected rounds given one sampled path per "
             f"prompt under the run's verify rule ({meta.get('verify', 'token')}), §5); "
             "speed-ups are predicted from the cost tables (rounds × seconds per round vs plain decoding).", ""]
    header = ["spec", "k", "knob", "drafter", "B", "n", "drafted", "accepted", "accept_rate", "mean_acc_len", "rounds",
              "per-position accept"] + [f"predicted ({n})" for n in names]
    num = lambda v: f"≈{v:.1f}" if isinstance(v, float) else v
    body = [[r["spec_type"], r["draft_n_max"] if r["draft_n_max"] != "auto" else f"auto≤{r['draft_n_max_bound']}",
             report.knob_text(r) + (f" T={r['temperature']:g}" if r["temperature"] else "")
             + (f" {r['confidence_rule']}" if r.get("confidence_rule") else ""), r["drafter_precision"],
             r["batch_size"], r["n_requests"], num(r["total_draft"]), num(r["total_draft_accepted"]),
             f"{r['aggregate_accept_rate']:.3f}", f"{r['mean_accepted_length']:.3f}", num(r["rounds"]),
             " ".join(f"{x:.2f}" for x in r["per_position_accept_rate"])]
            + [("–" if r["predicted_speedup"].get(n) is None else f"{r['predicted_speedup'][n]:.2f}×") for n in names]
            for r in rows]
    lines += [report.markdown_table(header, body), "", "## Best setting per cost table and batch size", ""]
    lines += [f"- {b['table']} B={b['batch_size']} {b['spec_type']}: {b['label']} ({b['predicted_speedup']:.2f}×)"
              for b in summary["best"]]
    lines += ["", "## Why a width pays or not (break-even = seconds[k] / plain seconds)", "", *summary["why"], ""]
    for name, t in meta["tables"].items():
        lines += [f"cost tables `{name}`:", "", "```", *[x for v in t for x in v["lines"]], "```", ""]
    cmp_ = summary.get("compare")
    if cmp_:
        lines += ["## Against the sweep", "", f"`{cmp_['sweep_dir']}`: {cmp_['equal']} of {cmp_['compared']} prompt × "
                  "setting records equal (tokens, drafts, accepted, rounds; every round where the sweep kept its "
                  "trace)" + ("" if cmp_["compared"] else ": the sweep shares no setting and prompt with this grid"), ""]
        lines += [f"- {d['label']} {d['id']}: sweep {d['sweep']} vs what-if {d['what_if']}"
                  + (f"; round {d['round']} at anchor {d['anchor']}: {d['sweep_round']} vs {d['what_if_round']}, "
                     f"drafter margins {[round(m, 5) for m in d['drafter_margin']]}, target margins "
                     f"{[round(m, 5) for m in d['target_margin']]}" if "round" in d else "")
                  for d in cmp_["differences"][:20]]
        if cmp_.get("sampled_acceptance"):
            lines += ["", "Sampled settings (the estimate, docs/whatif.md §5): mean accepted length", "",
                      report.markdown_table(["setting", "estimated", "measured (sweep)"],
                                            [[s["label"], f"{s['predicted']:.3f}", f"{s['measured']:.3f}"]
                                             for s in cmp_["sampled_acceptance"]])]
        if cmp_.get("speed"):
            lines += ["", report.markdown_table(["setting", "predicted", "measured (sweep)"],
                                                [[s["label"], f"{s['predicted']:.2f}×", f"{s['measured']:.2f}×"]
                                                 for s in cmp_["speed"]])]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], names: list[str], out_dir: str, title: str) -> list[str]:
    plt = report._pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in names:
        for key, rs in report._series([r for r in rows if r["draft_n_max"] != "auto"]).items():
            pts = [(r["draft_n_max"], r["predicted_speedup"].get(name)) for r in rs]
            pts = [(k, v) for k, v in pts if v is not None]
            if pts:
                ax.plot(*zip(*pts), label=f"{report._line_label(key, rs)} ({name})",
                        **report.STYLE.get(rs[0]["spec_type"], {}))
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("draft_n_max")
    ax.set_ylabel("predicted decode speed-up")
    ax.set_title(f"{title}: predicted speed-up (what-if)")
    ax.legend(fontsize=7)
    return [report._save(fig, out_dir, "predicted_speedup.png")]


def run(a, argv, model, suite: str, prompts: list[dict], settings, plan) -> int:
    """dsv4-sweep --what-if's body (sweep.main hands over after its checks and shared shapes)."""
    t0 = time.perf_counter()
    t_tables = time.perf_counter()
    own = {key: v["table"] for key, v in common.cost_tables(
        model, prompts, _auto(settings), plan, given=a.cost_table_obj, machine=a.roofline, recalibrate=a.recalibrate,
        log=lambda s: print(s, file=sys.stderr), progress=None if a.quiet else print).items()}
    name = "given" if a.cost_table_obj is not None else (f"roofline {a.roofline.name}" if a.roofline is not None
                                                         else "this machine")
    if a.compare:      # replay the sweep's auto settings with the tables its runs used
        own.update(_sweep_tables(a.compare))
    tables = {name: own, **price_tables(a, model, prompts, settings, plan)}
    tables_s = time.perf_counter() - t_tables
    log = (lambda s: None) if a.quiet else (lambda s: print(s, file=sys.stderr))
    eos = plan.eos_token_id if plan.eos_token_id is not None else model.config.eos_token_id
    records, timing = evaluate(model, prompts, settings, plan.max_new_tokens, eos, tables[name], log, a.precisions,
                               a.rules)
    t_sampled = time.perf_counter()
    records += evaluate_sampled(model, prompts, [s for s in settings if s.temperature > 0 and s.drafter and not s.auto],
                                plan.max_new_tokens, seed=plan.seed, top_p=plan.top_p, verify=plan.verify, eos=eos,
                                progress=log)
    timing["sampled_s"] = time.perf_counter() - t_sampled
    rows = rows_of(settings, records, tables, a.by_output_position)
    summary = {"meta": {"tool": "dsv4-whatif", "env": report.environment("dsv4-sweep", argv),
                        "model": model.describe(), "suite": suite, "n_prompts": len(prompts),
                        "prompt_ids": [p["id"] for p in prompts], "max_new_tokens": plan.max_new_tokens,
                        "verify": plan.verify,
                        "tables": {n: [report.cost_table_meta(k, t, n) for k, t in ts.items()] for n, ts in tables.items()},
                        "timing": {k: v for k, v in timing.items() if k.endswith("_s")}, "tables_s": tables_s},
               "settings": rows, "best": best(rows, tables), "why": why_lines(rows, tables)}
    if a.compare:
        summary["compare"] = compare(a.compare, records, timing)
        summary["compare"]["speed"] = _speed(a.compare, rows, name)
        summary["compare"]["sampled_acceptance"] = _acceptance(a.compare, rows)
    summary["meta"]["wall_s"] = time.perf_counter() - t0
    with report.atomic_dir(a.out) as tmp:
        if not a.no_plots:
            summary["meta"]["plots"] = plot(rows, list(tables), tmp, model.name)
        report.write_outputs(tmp, records, summary, markdown(summary))
    if not a.quiet:
        print(markdown(summary))
    print(f"dsv4-whatif: wrote {a.out}/summary.json, summary.md, results.jsonl", file=sys.stderr)
    return 0


def _sweep_tables(sweep_dir: str) -> dict:
    """The cost tables a dsv4-sweep's auto settings ran with (its summary.json's meta), by (spec, batch, greedy)."""
    with open(os.path.join(sweep_dir, "summary.json"), encoding="utf-8") as f:
        meta = json.load(f)["meta"]
    return {(t["spec_type"], t["batch_size"], t["greedy"]): CostTable.from_json(t["table"])
            for t in meta.get("cost_tables") or []}


def _speed(sweep_dir: str, rows: list[dict], name: str) -> list[dict]:
    """The sweep's measured decode speed-ups beside the what-if's predicted ones (same setting label)."""
    with open(os.path.join(sweep_dir, "summary.json"), encoding="utf-8") as f:
        measured = {r["label"]: r.get("decode_speedup") for r in json.load(f)["settings"]}
    return [{"label": r["label"], "predicted": r["predicted_speedup"][name], "measured": measured[r["label"]]}
            for r in rows if measured.get(r["label"]) is not None and r["predicted_speedup"].get(name) is not None]


def _acceptance(sweep_dir: str, rows: list[dict]) -> list[dict]:
    """The sampled estimate's mean accepted length beside the sweep's measured one (same setting label)."""
    with open(os.path.join(sweep_dir, "summary.json"), encoding="utf-8") as f:
        measured = {r["label"]: r.get("mean_accepted_length") for r in json.load(f)["settings"]}
    return [{"label": r["label"], "predicted": r["mean_accepted_length"], "measured": measured[r["label"]]}
            for r in rows if "approximation" in r and measured.get(r["label"])]
