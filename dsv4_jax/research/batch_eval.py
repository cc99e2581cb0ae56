"""`dsv4-batch-eval`: throughput and per-request latency of batched generation under static and continuous
batching, with and without speculation.

The prompts (a suite, cycled to --num-prompts, or a prompts file) are all queued at time 0 and decoded in
B slots by `dsv4_jax.speculative.scheduler.SlotEngine`, under each --schedule in the same run on the same
prompts: `static` refills the slots only when the whole batch has finished (each batch runs until its
longest sequence ends), `continuous` refills every freed slot between decode chunks. Output lengths
spread by EOS or, with --output-lengths LO-HI, by per-request budgets drawn uniformly (seeded). For each
spec type × draft_n_max × knob × temperature × batch size: one engine (compiled once, warmed up untimed),
then every schedule timed, the schedules interleaved (the median run over --repeats). --draft-n-max auto:
the width scheduler chooses each round's verify width (docs/width_scheduler.md) under both schedules,
priced by --cost-table or by a cost table measured per drafter, batch size and greedy/sampled on the
setting's own engine (`SlotEngine.calibrate`: its first 2·B prompts under the continuous schedule, cached).

Throughput = generated tokens / wall time of the whole run; a request's latency = the time from the start
(its arrival) to its last token, TTFT = to its first token (sampled by its prefill); mean / p50 / p90.

Output (--out DIR, written atomically): batch_eval.json ({"meta", "settings"}: a row per setting ×
schedule), batch_eval.md, results.jsonl (one line per request × setting × schedule), throughput.png,
latency.png.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

import jax
import numpy as np

from .. import cli, parallel
from ..speculative.options import Sampling, Speculation
from ..speculative.scheduler import SCHEDULES, RunResult, SlotEngine
from . import common, report
from .common import OptionError
from .models import add_model_args
from .runner import BASELINE, Setting, effective_draft_n_max, grid_settings
from .sweep import prepare_run

EXAMPLES = """examples:
  dsv4-batch-eval --out results/batch                      # bundled tiny model, 16 prompts, B=4, static vs continuous
  dsv4-batch-eval --out results/cb --spec none --batch-size 4 --num-prompts 32 --output-lengths 16-256 --ignore-eos
  dsv4-batch-eval --out results/cb-spec --spec none,mtp,dspark --draft-n-max 3 --output-lengths 16-128
  dsv4-batch-eval --out results/ckpt --model /ckpt/dsv4-flash --prompts-file prompts.jsonl --mesh 1x8x1
  dsv4-batch-eval --out results/auto --spec none,mtp --draft-n-max 3,auto --draft-n-max-bound 4
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dsv4-batch-eval", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES,
        description="Batch evaluation: decode many prompts in B slots under static and continuous batching and "
                    "report throughput (generated tokens/s), per-request latency and time to first token, with "
                    "and without speculative decoding.")
    add_model_args(p)
    g = p.add_argument_group("settings (comma-separated lists; integer ranges like 1-4 allowed)")
    g.add_argument("--spec", default="none,mtp,dspark", help="spec types (default none,mtp,dspark)")
    g.add_argument("--draft-n-max", default="3", metavar="K",
                   help="drafts per round for mtp/dspark (default 3); 'auto' as an item: the width scheduler "
                        "chooses each round (docs/width_scheduler.md), 'auto' alone = 1-K,auto with K = "
                        "--draft-n-max-bound")
    g.add_argument("--p-min", default="0", metavar="P", help="MTP p_min values (default 0)")
    g.add_argument("--confidence", default="0", metavar="C", help="DSpark confidence thresholds (default 0)")
    g.add_argument("--temperature", default="0", metavar="T", help="temperatures (default 0 = greedy)")
    g.add_argument("--batch-size", default="4", metavar="B", help="decode slots (default 4)")
    g.add_argument("--num-prompts", type=int, default=16, metavar="N",
                   help="prompts to decode per setting: the selected prompts cycled or cut to N (default 16)")
    common.add_width_args(p.add_argument_group("width scheduler (--draft-n-max auto; docs/width_scheduler.md)"))
    s = p.add_argument_group("scheduling")
    s.add_argument("--schedule", default="static,continuous",
                   help="schedules to compare, in the same run on the same prompts (default static,continuous)")
    s.add_argument("--output-lengths", metavar="LO-HI",
                   help="per-request max_new_tokens drawn uniformly from LO..HI (seeded by --seed); default: "
                        "every request gets --max-new-tokens and lengths spread by EOS only")
    s.add_argument("--chunk-rounds", type=int, default=32, metavar="N",
                   help="a decode chunk runs at most N speculative rounds before the host looks at the slots "
                        "(it also ends when sequences finish, see --refill-min; default 32)")
    s.add_argument("--refill-min", type=int, default=1, metavar="M",
                   help="continuous: a decode chunk ends once M sequences have finished (fewer if fewer requests "
                        "are queued), and their slots are refilled together; 1 refills every freed slot at once, "
                        "larger values batch the prefills but leave slots idle meanwhile (default 1)")
    s.add_argument("--prefill-ahead", type=int, metavar="N",
                   help="a prefill takes at least N queued requests at a time (default: the batch size); the "
                        "prefilled ones wait for freed slots, so that refills of one or two slots still make "
                        "wide prefill calls (costs up to N rows of decode state); 1 prefills only what a "
                        "refill needs")
    s.add_argument("--prefill-len", type=int, default=64, metavar="C",
                   help="prompts are prefilled in chunks of C tokens, the requests of a refill with as many chunks "
                        "together as the rows of one call (one compiled shape per row count 1, 2, 4, .. B; "
                        "default 64)")
    cli.add_mesh(s, help="shard the model over a data x expert x model device mesh, e.g. 1x8x1 (default: one "
                         "device)")
    common.add_prompt_args(p, default_per_category=None)
    common.add_run_args(p)
    common.add_verify_args(p)
    return p


def schedule_list(text: str) -> list[str]:
    out = [s.strip().lower() for s in text.split(",") if s.strip()]
    bad = [s for s in out if s not in SCHEDULES]
    if bad or not out:
        raise OptionError(f"--schedule: unknown schedule(s) {bad or [text]}; choose from {', '.join(SCHEDULES)}")
    return list(dict.fromkeys(out))


def parse_settings(a: argparse.Namespace) -> tuple[list[Setting], list[int]]:
    common.verify_options(a)          # --synthetic-accept's rates, checked before any model work
    specs = common.spec_list(a.spec)
    ks, a.auto_bound, a.cost_table_obj = common.width_options(a)
    p_mins = common.float_list(a.p_min, "--p-min", 0.0, 1.0)
    confs = common.float_list(a.confidence, "--confidence", 0.0, 1.0)
    temps = common.float_list(a.temperature, "--temperature", 0.0)
    sizes = common.int_list(a.batch_size, "--batch-size", 1)
    if a.num_prompts < 1:
        raise OptionError(f"--num-prompts must be >= 1, got {a.num_prompts}")
    for name in ("chunk_rounds", "prefill_len", "refill_min", "prefill_ahead"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            raise OptionError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    a.schedules = schedule_list(a.schedule)
    a.length_range = output_range(a.output_lengths)
    if a.length_range and a.max_new_tokens:
        raise OptionError("give --max-new-tokens or --output-lengths, not both")
    a.mesh_obj = cli.device_mesh(a.mesh)
    settings = grid_settings(specs, ks, {"p_min": p_mins, "confidence_threshold": confs}, temps, sizes, a.auto_bound)
    return settings, ks + ([a.auto_bound] if a.auto_bound else [])


def output_range(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    values = common.int_list(text, "--output-lengths", 1)
    if "-" not in text and ".." not in text or len(values) < 2:
        raise OptionError(f"--output-lengths: give a range LO-HI with LO < HI, got {text!r}")
    return values[0], values[-1]


def budgets_for(n: int, max_new: int, length_range: tuple[int, int] | None, seed: int) -> list[int]:
    """Per-request max_new_tokens: uniform in the range (seeded), or max_new for all."""
    if length_range is None:
        return [max_new] * n
    lo, hi = length_range
    return np.random.default_rng(seed).integers(lo, hi + 1, n).tolist()


def cycle_to(prompts: list[dict], n: int) -> list[dict]:
    """The prompts repeated (ids suffixed #r) or cut to exactly n."""
    out = []
    for i in range(n):
        p = prompts[i % len(prompts)]
        r = i // len(prompts)
        out.append(p if r == 0 else {**p, "id": f"{p['id']}#{r}"})
    return out


def speculation(setting: Setting, a, table=None) -> Speculation:
    """The setting's Speculation group (draft_n_max="auto" with its bound and cost table for auto settings)."""
    width = {"draft_n_max": "auto", "draft_n_max_bound": setting.draft_n_max, "cost_table": table} if setting.auto \
        else {"draft_n_max": max(setting.draft_n_max, 1)}
    return Speculation(drafter=setting.drafter, options=setting.drafter_options(), verify=a.verify,
                       synthetic_accept=common.verify_options(a)[1], **width)


def price(engine: SlotEngine, setting: Setting, a, tables: dict, log, roofline=None) -> dict:
    """Price an auto setting's engine, once per `Setting.table_key`: --cost-table's table, --roofline's
    (roofline(setting) -> CostTable), or the cached / measured calibration of this engine's own rounds
    (`SlotEngine.calibrate`, under the continuous schedule when it is run, else static); printed when
    obtained. tables: {key: {"table", "how"}}, filled in."""
    key = setting.table_key
    if key not in tables:
        if a.cost_table_obj is not None:
            tables[key] = {"table": a.cost_table_obj, "how": "given"}
        elif roofline is not None:
            tables[key] = {"table": roofline(setting), "how": "roofline"}
        else:
            schedule = "continuous" if "continuous" in a.schedules else a.schedules[0]
            table, how = engine.calibrate(schedule, refresh=a.recalibrate, drafter=setting.spec,
                                          progress=None if a.quiet else log)
            tables[key] = {"table": table, "how": how}
        log("\n".join([f"== cost table ({tables[key]['how']}) for {setting.spec} B={setting.batch_size} "
                       f"{'greedy' if setting.temperature == 0 else 'sampled'}:", *tables[key]["table"].lines()]))
    engine.priced(tables[key]["table"])
    return tables[key]


def build_engine(model, prompts: list[dict], budgets: list[int], setting: Setting, a, table=None) -> SlotEngine:
    """The setting's engine (an auto setting's rounds priced by table; None: unit costs until `price`)."""
    return SlotEngine.build(
        model.params, model.bundle, [p["tokens"] for p in prompts], budgets, batch=setting.batch_size,
        chunk_rounds=a.chunk_rounds, prefill_len=a.prefill_len, refill_min=a.refill_min,
        prefill_ahead=a.prefill_ahead,
        sampling=Sampling(temperature=setting.temperature, top_p=a.top_p, seed=a.seed),
        speculation=speculation(setting, a, table), eos_token_id=common.eos_for(a))


def schedule_row(setting: Setting, run: RunResult, walls: list[float], model) -> dict:
    """The aggregate row of one setting under one schedule (the median run)."""
    res = run.results
    drafted, accepted, rounds = (sum(getattr(r, f) for r in res) for f in ("drafted", "accepted", "rounds"))
    pos_acc = np.sum([r.per_position_accepted for r in res], axis=0).tolist() if setting.draft_n_max else []
    pos_prop = np.sum([r.per_position_proposed for r in res], axis=0).tolist() if setting.draft_n_max else []
    lat = report.percentiles([r.finished_s for r in res])
    ttft = report.percentiles([r.first_token_s for r in res])
    return {**setting.as_dict(), "schedule": run.schedule, "label_no_batch": setting.label.rsplit(" B=", 1)[0],
            "effective_draft_n_max": effective_draft_n_max(setting, model), "n_requests": len(res),
            "total_predicted": run.generated, "total_draft": drafted, "total_draft_accepted": accepted,
            "rounds": rounds, "aggregate_accept_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_length": (accepted + rounds) / rounds if rounds else 0.0,
            "per_position_accept_rate": [x / y if y else 0.0 for x, y in zip(pos_acc, pos_prop)],
            "wall_s": run.wall_s, "walls": walls, "tokens_per_s": run.tokens_per_s, "prefill_s": run.prefill_s,
            "decode_s": run.decode_s, "decode_tokens_per_s": run.generated / run.decode_s if run.decode_s > 0 else 0.0,
            "ms_per_round": 1e3 * run.decode_s / run.rounds if run.rounds else 0.0, "refills": run.refills,
            "prefill_calls": run.prefill_calls,
            "chunks": run.chunks, "loop_rounds": run.rounds, "slot_utilization": run.slot_utilization,
            "latency_mean_s": lat["mean"], "latency_p50_s": lat["p50"], "latency_p90_s": lat["p90"],
            "latency_max_s": lat["max"], "ttft_mean_s": ttft["mean"], "ttft_p50_s": ttft["p50"],
            "ttft_p90_s": ttft["p90"],
            **report.aggregate_verification([{**r.spec_decode, "rounds": r.rounds,
                                              "per_position_proposed": r.per_position_proposed}
                                             for r in res if r.spec_decode and setting.draft_n_max]),
            **report.aggregate_width([{**r.width, "rounds": r.rounds} for r in res if r.width])}


def add_ratios(rows: list[dict]) -> list[dict]:
    """vs_static: tokens/s over the static row of the same setting (decode_vs_static: the decode phases',
    rounds_ratio: the static row's loop rounds over this one's); speedup: over the 'none' row with the
    same schedule, temperature and batch size (None without one)."""
    static_rows = {r["label"]: r for r in rows if r["schedule"] == "static"}
    static = {label: r["tokens_per_s"] for label, r in static_rows.items()}
    base = {(r["schedule"], r["temperature"], r["batch_size"]): r["tokens_per_s"] for r in rows
            if r["spec_type"] == BASELINE}
    for r in rows:
        s, b = static.get(r["label"]), base.get((r["schedule"], r["temperature"], r["batch_size"]))
        r["vs_static"] = r["tokens_per_s"] / s if s else None
        st = static_rows.get(r["label"])
        r["decode_vs_static"] = r["decode_tokens_per_s"] / st["decode_tokens_per_s"] \
            if st and st["decode_tokens_per_s"] else None
        r["rounds_ratio"] = st["loop_rounds"] / r["loop_rounds"] if st and r["loop_rounds"] else None
        r["speedup"] = r["tokens_per_s"] / b if b else None
    return rows


def evaluate(engine: SlotEngine, model, prompts: list[dict], setting: Setting, a, bar) -> tuple[list, list]:
    """(rows, per-request records) of one setting's engine (built by `build_engine`; an auto setting's
    priced, `price`) under every schedule."""
    warm = engine.warm_up()
    bar.update(1)
    runs: dict[str, list[RunResult]] = {s: [] for s in a.schedules}
    for _ in range(a.repeats):              # schedules interleaved: a change of machine load hits both
        for schedule in a.schedules:
            runs[schedule].append(engine.run(schedule))
            bar.update(1)
    rows, records, outputs = [], [], {}
    for schedule in a.schedules:
        walls = [r.wall_s for r in runs[schedule]]
        run = sorted(runs[schedule], key=lambda r: r.wall_s)[(len(walls) - 1) // 2]
        row = {**schedule_row(setting, run, walls, model), "warmup_s": warm, "max_len": engine.max_len}
        outputs[schedule] = [r.tokens for r in run.results]
        if setting.temperature == 0 and schedule != a.schedules[0]:
            # greedy: every schedule must give every request the same tokens
            row["outputs_match_" + a.schedules[0]] = outputs[schedule] == outputs[a.schedules[0]]
        rows.append(row)
        for p, r in zip(prompts, run.results):
            rec = {**setting.as_dict(), "schedule": schedule, "id": p["id"], "category": p.get("category"),
                   "prompt_tokens": len(p["tokens"]), **r.as_dict()}
            rec["output_tokens"] = rec.pop("tokens")
            records.append(rec)
    return rows, records


MD_HEADER = ("spec", "k", "knob", "T", "B", "schedule", "requests", "generated", "tok/s", "vs static", "speed-up",
             "slot use", "accept_rate", "mean_acc_len", "latency mean (s)", "p50 (s)", "p90 (s)", "TTFT p50 (s)",
             "TTFT p90 (s)")
PHASE_HEADER = ("spec", "k", "knob", "T", "B", "schedule", "wall (s)", "admission (s)", "refills", "prefill calls",
                "loop rounds", "ms / round", "decode-phase tok/s", "rounds static / this", "decode-phase vs static")


def _k(s: dict):
    """The k column: '–' (none), 'auto≤K' or the width."""
    if s["spec_type"] == BASELINE:
        return "–"
    return f"auto≤{s['effective_draft_n_max']}" if report.is_auto(s) else s["draft_n_max"]


def markdown(summary: dict) -> str:
    m = summary["meta"]
    rows = [(s["spec_type"], _k(s), report.knob_text(s),
             f"{s['temperature']:g}", s["batch_size"], s["schedule"], s["n_requests"], s["total_predicted"],
             f"{s['tokens_per_s']:.1f}", _times(s["vs_static"]), _times(s["speedup"]), s["slot_utilization"],
             s["aggregate_accept_rate"], s["mean_accepted_length"], s["latency_mean_s"], s["latency_p50_s"],
             s["latency_p90_s"], s["ttft_p50_s"], s["ttft_p90_s"]) for s in summary["settings"]]
    phases = [(s["spec_type"], _k(s), report.knob_text(s),
               f"{s['temperature']:g}", s["batch_size"], s["schedule"], f"{s['wall_s']:.1f}", f"{s['prefill_s']:.1f}",
               s["refills"], s["prefill_calls"], s["loop_rounds"], f"{s['ms_per_round']:.1f}",
               f"{s['decode_tokens_per_s']:.1f}", _ratio(s["rounds_ratio"]), _times(s["decode_vs_static"]))
              for s in summary["settings"]]
    lengths = m["output_lengths"] or f"max_new_tokens {m['max_new_tokens']} (EOS spreads them)"
    return "\n".join([
        f"# Batch evaluation — {m['model']['name']}", "",
        f"- model: `{m['model']['source']}`; {m['n_prompts']} prompts from `{m['suite']}`, output lengths: "
        f"{lengths}; ignore_eos {m['ignore_eos']}, repeats {m['repeats']}, seed {m['seed']}",
        f"- slots: chunk of at most {m['chunk_rounds']} rounds, refill after {m.get('refill_min', 1)} finish(es), "
        f"prefill chunks of {m['prefill_len']} tokens, at least {m.get('prefill_ahead') or 'B'} requests per "
        f"prefill; "
        f"mesh {m['mesh'] or 'none'}",
        f"- {m['env']['backend']} ({', '.join(sorted(set(m['env']['devices'])))}), jax {m['env']['jax_version']}, "
        f"{m['env']['date']}", f"- command: `{m['env']['command']}`", "",
        "tok/s = all generated tokens / wall time of the run; every request arrives at 0, latency = time to its "
        "last token, TTFT = to its first; vs static = tok/s over the static schedule of the same setting; "
        "speed-up = over `none` with the same schedule, T and B; slot use = rounds a slot held a running "
        "request / (B × rounds).", "",
        report.markdown_table(MD_HEADER, rows), "",
        "Admission (prefill + insert, synchronised) and the decode phase (the rest of the wall time: decode "
        "chunks and the host's look at the slots) apart; ms / round = decode phase / loop rounds.", "",
        report.markdown_table(PHASE_HEADER, phases), ""]) + _width(summary) + _verification(summary)


def _width(summary: dict) -> str:
    """The width scheduler's sections (cost tables, auto rows, predicted vs measured; `report.width_markdown`)."""
    body = report.width_markdown(summary["settings"], summary["meta"])
    return "\n" + body if body else ""


def _verification(summary: dict) -> str:
    """Measured vs analytic acceptance per position and confidence calibration, per setting and schedule."""
    rows = [{**s, "label": f"{s['label']} {s['schedule']}"} for s in summary["settings"]]
    body = report.verification_markdown(rows)
    rates = summary["meta"].get("synthetic_accept")
    head = (f"**SYNTHETIC ACCEPTANCE {rates}**: the figures measure cost at forced acceptance rates, not the "
            "drafters' quality." if rates else f"verify rule (sampled runs): {summary['meta'].get('verify', 'token')}")
    return "\n" + head + "\n\n" + body if body else ""


def _times(v) -> str:
    return "–" if v is None else f"{v:.2f}×"


def _ratio(v) -> str:
    return "–" if v is None else f"{v:.2f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    (settings, ks), model, notes, suite, prompts, suite_max_new = prepare_run(
        parser, a, parse_settings, lambda g: (sorted({s.spec for s in g[0]}), g[1]))
    for n in notes:
        print(n, file=sys.stderr)
    if a.mesh_obj is not None:
        model.params = parallel.shard_params(model.params, model.config, a.mesh_obj)
    prompts = cycle_to(prompts, a.num_prompts)
    max_new = a.max_new_tokens or suite_max_new
    budgets = budgets_for(len(prompts), max_new, a.length_range, a.seed)
    total = len(settings) * (1 + a.repeats * len(a.schedules))
    print(f"dsv4-batch-eval: {model.name}, {len(prompts)} prompts ({suite}), {len(settings)} settings × "
          f"{'/'.join(a.schedules)}, output lengths {a.output_lengths or max_new} -> {a.out}", file=sys.stderr)
    context = common.run_context([len(p["tokens"]) for p in prompts], budgets)
    roof = None if a.roofline is None else lambda s: common.roofline_table(model, s, a.roofline, context)
    with report.atomic_dir(a.out) as tmp, common.progress(total, a.quiet, "batch-eval") as bar:
        rows, records, tables = [], [], {}
        for s in settings:
            engine = build_engine(model, prompts, budgets, s, a)
            if s.auto:
                price(engine, s, a, tables, bar.write, roof)
            new_rows, recs = evaluate(engine, model, prompts, s, a, bar)
            # one setting's programs at a time: a process holding every setting's compiled programs runs out
            # of memory maps on XLA:CPU (vm.max_map_count) in wide sweeps
            del engine
            jax.clear_caches()
            rows += new_rows
            records += recs
            add_ratios(rows)
            if not a.quiet:
                for r in new_rows:
                    bar.write(f"{s.label:<30} {r['schedule']:<10} tok/s={r['tokens_per_s']:8.1f} "
                              f"latency p50={r['latency_p50_s']:.2f}s p90={r['latency_p90_s']:.2f}s "
                              f"TTFT p50={r['ttft_p50_s']:.2f}s slot use={r['slot_utilization']:.2f} "
                              f"(warm-up {r['warmup_s']:.1f} s)")
        summary = {"meta": {"tool": "dsv4-batch-eval", "env": report.environment("dsv4-batch-eval", argv),
                            "model": model.describe(), "suite": suite, "n_prompts": len(prompts),
                            "schedules": a.schedules, "max_new_tokens": max(budgets),
                            "output_lengths": a.output_lengths, "budgets": budgets, "repeats": a.repeats,
                            "seed": a.seed, "top_p": a.top_p, "ignore_eos": a.ignore_eos,
                            "chunk_rounds": a.chunk_rounds, "prefill_len": a.prefill_len,
                            "refill_min": a.refill_min, "prefill_ahead": a.prefill_ahead,
                            "mesh": None if a.mesh_obj is None else dict(parallel.mesh_sizes(a.mesh_obj)),
                            "verify": a.verify, "synthetic_accept": common.verify_options(a)[1],
                            "draft_n_max_bound": a.auto_bound, "cost_table_file": a.cost_table,
                            "roofline": None if a.roofline is None else a.roofline.name,
                            "cost_tables": [report.cost_table_meta(key, t["table"], t["how"])
                                            for key, t in tables.items()],
                            "timing": "per schedule: wall time of SlotEngine.run (prefills, inserts and decode "
                                      "chunks, host synchronised after each), median over repeats, after one "
                                      "untimed warm-up per setting that compiles every program"},
                   "settings": report.add_width_predictions(
                       rows, {key: t["table"] for key, t in tables.items()}, a.cost_table_obj)}
        if not a.no_plots:
            summary["meta"]["plots"] = report.plot_batch_eval(rows, tmp, model.name) + report.verification_plots(
                [{**r, "label": f"{r['label']} {r['schedule']}"} for r in rows], tmp, model.name)
        report.write_outputs(tmp, records, summary, markdown(summary),
                             ("results.jsonl", "batch_eval.json", "batch_eval.md"))
    if not a.quiet:
        print(markdown(summary))
    print(f"dsv4-batch-eval: wrote {a.out}/batch_eval.json, batch_eval.md, results.jsonl", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
