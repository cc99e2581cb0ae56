"""`dsv4-sweep`: speculative-decoding sweeps over a prompt suite, with tables and plots.

Grid: spec type {none, mtp, dspark} × draft_n_max × p_min (MTP) / confidence threshold (DSpark) ×
temperature × batch size. Every setting runs one untimed warm-up per batch shape (compilation, when its
programs are new) and then every batch of prompts `--repeats` times (default 5) with the same seed, in
passes (each pass every setting once in turn, `--order interleaved`, the default): speed-ups are against the
no-speculation baseline measured in the same run with the same temperature and batch size, pass by pass. The headline figures are decode-only (tokens of the decode loop / its time); end to
end and the prefill are reported beside them; rates are medians over the repeats with min and max.

--draft-n-max auto adds, per drafter, a run whose verify width is chosen each round on the device by the
width scheduler (docs/width_scheduler.md) up to --draft-n-max-bound, priced by a cost table (--cost-table,
--roofline MACHINE's bandwidth roofline, or measured per drafter, batch size and greedy/sampled by a short
cached calibration on the run's own program); the fixed widths then run in the same program
(`RunShape.adaptive_widths`), and the report sets the cost table's predicted speed-up of each width beside the
measured one.

Settings share compiled programs (runner.py): prompts padded to at most --prompt-buckets lengths and
prefilled in chunks of the shortest (one prefill program for every bucket), one max_len and one
verify-block bound for every run, MTP and DSpark in one loop program for every draft width (the verify
of each run at its own width, `RunShape.dynamic_draft_n`).

Output (--out DIR, written to a temporary directory and renamed when complete):
    results.jsonl     one line per prompt × setting (pred, draft, acc, rate, tok/s, output tokens)
    summary.json      {"meta": run facts, "settings": [aggregate per setting]} (see report.py)
    summary.md        the same as a markdown table
    tokens_per_s.png, acceptance.png, per_position.png
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Sequence

from ..io.outdir import OutDirError
from ..speculative.options import LONG_PROMPT_CHUNK
from ..drafters import registry
from . import common, report, whatif_cli
from .common import OptionError
from .models import ModelError, add_model_args, check_model_dir, load_model
from . import prompts as prompts_mod
from .prompts import PromptError
from .runner import (BASELINE, SPEC_TYPES, SweepPlan, Setting, batches, effective_draft_n_max,
                     grid_settings, merge_runs, per_sequence, plan_shapes, pool_for, precompile, run_batch, shapes,
                     warm_up)

# one program at a time: XLA:CPU already compiles one program on both cores of the 2-core VM, two at once
# were no faster (experiments/results/sweep_speed_2026-12-02_v6.md)
COMPILE_THREADS = 1
# timed repeats per batch: on the shared 2-core VMs a setting's tokens/s moves ±10 % between repeats, so the
# median of 5 (experiments/results/sweep_speed_2026-12-02_v8.md)
REPEATS = 5

EXAMPLES = """examples:
  dsv4-sweep --out results/tiny                      # bundled tiny model: none/mtp/dspark × k=1..3, 18 prompts,
                                                     # 5 repeats (about 2 min on 2 idle cores, cold cache)
  dsv4-sweep --out results/tiny-quick --prompts-per-category 1 --draft-n-max 1-5 --repeats 3
  dsv4-sweep --out results/pmin --spec mtp --draft-n-max 2,4 --p-min 0,0.3,0.6
  dsv4-sweep --out results/conf --spec none,dspark --confidence 0,0.5,0.8 --temperature 0,1
  dsv4-sweep --out results/batch --batch-size 1,4 --categories code_python,stepwise_math
  dsv4-sweep --out results/ckpt --model /ckpt/dsv4-flash --prompt-template '<｜User｜>{prompt}<｜Assistant｜>'
  dsv4-sweep --out results/smoke --random-tiny --max-new-tokens 16 --draft-n-max 1,2
  dsv4-sweep --out results/auto --spec none,mtp --draft-n-max auto --draft-n-max-bound 4   # k=1..4 and auto
  dsv4-sweep --out results/auto-file --spec none,mtp --draft-n-max 2,auto --draft-n-max-bound 3 --cost-table costs.json
  dsv4-sweep --out results/auto-h100 --spec none,mtp --draft-n-max auto --roofline h100   # priced as on an H100
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dsv4-sweep", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES,
        description="Sweep speculative decoding (none / MTP / DSpark) over draft_n_max, p_min, confidence "
                    "threshold, temperature and batch size on a prompt suite; prints llama.cpp-MTP-bench-style "
                    "per-prompt lines and writes results.jsonl, summary.json, summary.md and plots.")
    add_model_args(p)
    g = p.add_argument_group("sweep grid (comma-separated lists; integer ranges like 1-5 allowed)")
    g.add_argument("--spec", default="none,mtp,dspark", help="spec types (default none,mtp,dspark)")
    g.add_argument("--draft-n-max", default="1,2,3,auto", metavar="K",
                   help="drafts per round for mtp/dspark (default 1,2,3,auto; DSpark truncates values above its block "
                        "size); 'auto' as an item: the width scheduler chooses each round (docs/width_scheduler.md), "
                        "'auto' alone = 1-K,auto with K = --draft-n-max-bound")
    g.add_argument("--p-min", default="0", metavar="P", help="MTP: stop the draft chain below this top-1 probability "
                                                             "(default 0)")
    g.add_argument("--confidence", default="0", metavar="C", help="DSpark confidence thresholds (default 0)")
    g.add_argument("--temperature", default="0", metavar="T", help="0 = greedy; > 0 = lossless rejection sampling "
                                                                   "(default 0)")
    g.add_argument("--batch-size", default="1", metavar="B", help="prompts decoded together (default 1)")
    common.add_width_args(p.add_argument_group("width scheduler (--draft-n-max auto; docs/width_scheduler.md)"))
    common.add_prompt_args(p, default_per_category=2)
    common.add_run_args(p, default_repeats=REPEATS)
    p.add_argument("--order", choices=("interleaved", "grouped"), default="interleaved",
                   help="interleaved (default): the repeats in passes, each pass running every setting once, so "
                        "that a drift of the machine's speed hits every setting alike and speed-ups pair each "
                        "pass with the baseline's same pass; grouped: each setting's repeats back to back")
    g = p.add_argument_group("compilation")
    g.add_argument("--compile-threads", type=int, default=COMPILE_THREADS, metavar="N",
                   help=f"compile the sweep's distinct programs before the first run, N at a time (default "
                        f"{COMPILE_THREADS}: XLA already compiles one program on every core; one-device runs); "
                        "0 = compile each on first use")
    g.add_argument("--shared-draft-widths", action=argparse.BooleanOptionalAction, default=True,
                   help="one loop program for every draft_n_max: the drafters compiled once, draft_n_max a run-time "
                        "bound, the verify block of each run still draft_n_max + 1 wide (a switch over the widths; "
                        "the same tokens and per-round cost, about 30%% less compiling; default); "
                        "--no-shared-draft-widths: one loop program per draft_n_max")
    common.add_verify_args(p)
    whatif_cli.add_args(p)
    p.add_argument("--by-output-position", type=int, nargs="?", const=report.OUTPUT_BUCKET, default=None, metavar="N",
                   help="record every round (RunShape.round_trace) and report acceptance against the output "
                        f"position, in buckets of N tokens (default {report.OUTPUT_BUCKET}): per setting and "
                        "category in summary.json, each prompt's rounds in results.jsonl (round_trace)")
    return p


def parse_grid(a: argparse.Namespace) -> dict:
    """The grid lists from the options (raises OptionError)."""
    if a.compile_threads < 0:
        raise OptionError(f"--compile-threads must be >= 0, got {a.compile_threads}")
    if a.by_output_position is not None and a.by_output_position < 1:
        raise OptionError(f"--by-output-position must be >= 1 tokens, got {a.by_output_position}")
    common.verify_options(a)          # --synthetic-accept's rates, checked before any model work
    whatif_cli.check(a)
    ks, a.auto_bound, a.cost_table_obj = common.width_options(a)
    return {"specs": common.spec_list(a.spec), "ks": ks, "auto_bound": a.auto_bound,
            "p_mins": common.float_list(a.p_min, "--p-min", 0.0, 1.0),
            "confs": common.float_list(a.confidence, "--confidence", 0.0, 1.0),
            "temps": common.float_list(a.temperature, "--temperature", 0.0),
            "batch_sizes": common.int_list(a.batch_size, "--batch-size", 1)}


def build_settings(specs, ks, p_mins, confs, temps, batch_sizes, auto_bound=None) -> list[Setting]:
    """The grid as a list: per (temperature, batch size) the baseline first, then MTP, then DSpark (each
    drafter's fixed widths, then its auto setting when auto_bound is given)."""
    return grid_settings(specs, ks, {"p_min": p_mins, "confidence_threshold": confs}, temps, batch_sizes,
                         auto_bound)


def check_model_support(model, specs: Sequence[str], ks: Sequence[int]) -> list[str]:
    """Errors for drafters the model lacks or cannot run; returns notes (drafters that cap draft_n_max)."""
    notes = []
    for spec in specs:
        if spec == BASELINE:
            continue
        drafter = registry.get(spec)
        if drafter.weights and not model.params.get(drafter.weights):
            raise OptionError(f"--spec {spec}: model {model.name} has no {drafter.weights_help}")
        try:
            cap = model.draft_setup(spec, max(ks)).k
        except ValueError as e:
            raise OptionError(f"--spec {spec}: {e}") from None
        if cap < max(ks):
            notes.append(f"note: {spec} proposes at most {cap} drafts per round: draft_n_max "
                         f"{[k for k in ks if k > cap]} run with {cap}")
    return notes


def prompt_line(p: dict, seq: dict, wall_s: float, decode_s: float) -> str:
    """One llama.cpp-MTP-bench-style line (tok/s end to end; decode= the decode loop alone)."""
    rate = seq["accepted"] / seq["draft"] if seq["draft"] else 0.0
    tps = seq["predicted"] / wall_s if wall_s > 0 else 0.0
    dps = (seq["predicted"] - 1) / decode_s if decode_s > 0 else 0.0
    return (f"  {p['id'][:32]:<32} pred={seq['predicted']:4d} draft={seq['draft']:4d} acc={seq['accepted']:4d} "
            f"rate={rate:.3f} tok/s={tps:8.1f} decode={dps:8.1f}")


def aggregate_line(s: dict) -> str:
    sp = (f" decode-speed-up={s['decode_speedup']:.2f}x (end to end {s['speedup']:.2f}x)"
          if s.get("decode_speedup") is not None and s.get("speedup") is not None else "")
    return (f"  {'TOTAL':<32} pred={s['total_predicted']:4d} draft={s['total_draft']:4d} "
            f"acc={s['total_draft_accepted']:4d} rate={s['aggregate_accept_rate']:.3f} "
            f"decode={s['decode_tokens_per_s']:8.1f} [{s['decode_tokens_per_s_min']:.1f}-"
            f"{s['decode_tokens_per_s_max']:.1f}] tok/s={s['tokens_per_s']:8.1f} prefill={s['prefill_s_total']:.3f}s "
            f"mean_acc_len={s['mean_accepted_length']:.2f}{sp}")


def time_settings(model, prompts: list[dict], settings: Sequence[Setting], plan: SweepPlan, repeats: int, bar,
                  tables: dict, interleaved: bool = True) -> tuple[list, list]:
    """Warm up every setting's batch shapes, then time every batch `repeats` times. interleaved (default): in
    passes, each pass running every setting once in turn, so that a change of the machine's speed during the
    sweep hits every setting alike (pass r of two settings are neighbours in time: `report.add_speedups`
    pairs them); else each setting's repeats back to back.
    -> (runs [setting][batch] = one `run_batch` result per repeat, warm-up seconds per setting)."""
    table = lambda s: tables[s.table_key]["table"] if s.auto else None
    warm = []
    for s in settings:
        seconds = 0.0
        for g in shapes(prompts, s.batch_size, plan):
            seconds += warm_up(model, g, s, plan, table(s))
            bar.update(1)
        warm.append(seconds)
    runs = [[[] for _ in batches(prompts, s.batch_size)] for s in settings]
    order = [(r, i) for r in range(repeats) for i in range(len(settings))] if interleaved else \
        [(r, i) for i in range(len(settings)) for r in range(repeats)]
    for _, i in order:
        s = settings[i]
        for g, group in enumerate(batches(prompts, s.batch_size)):
            runs[i][g].append(run_batch(model, group, s, plan, 1, table(s)))
            bar.update(1)
    return runs, warm


def setting_records(model, prompts: list[dict], setting: Setting, runs: list[list[dict]], log) -> tuple:
    """The per-prompt and per-batch records of a setting's timed runs (runs [batch] = one `run_batch` result
    per repeat, `time_settings`). -> (per-prompt records, batch records)."""
    records, batch_records = [], []
    for group, reps in zip(batches(prompts, setting.batch_size), runs):
        r = merge_runs(reps)
        st = r["stats"]
        batch_records.append({"n": len(group), "predicted": st["generated"], "draft": st["drafted"],
                              "accepted": st["accepted"], "rounds": st["rounds"], "wall_s": r["wall_s"],
                              "decode_s": r["decode_s"], "prefill_s": r["prefill_s"], "walls": r["walls"],
                              "decodes": r["decodes"], "prefills": r["prefills"],
                              "prompt_tokens": sum(len(p["tokens"]) for p in group),
                              "padded_tokens": len(group) * r["pad_to"],
                              "per_position_accepted": st["per_position_accepted"],
                              "per_position_proposed": st["per_position_proposed"],
                              **report.verification_record(st), **report.width_record(st)})
        for b, p in enumerate(group):
            seq = per_sequence(st, b)
            log(prompt_line(p, seq, r["wall_s"], r["decode_s"]))
            records.append(prompt_record(model, p, setting, seq, r, b))
    return records, batch_records


def prompt_record(model, p: dict, setting: Setting, seq: dict, r: dict, b: int) -> dict:
    """One results.jsonl line."""
    rec = {**setting.as_dict(), "id": p["id"], "category": p["category"], "prompt_tokens": len(p["tokens"]),
           "pred": seq["predicted"], "draft": seq["draft"], "acc": seq["accepted"], "rounds": seq["rounds"],
           "rate": seq["accepted"] / seq["draft"] if seq["draft"] else 0.0,
           "mean_accepted_length": (seq["accepted"] + seq["rounds"]) / seq["rounds"] if seq["rounds"] else 0.0,
           "batch_wall_s": r["wall_s"], "batch_walls": r["walls"], "batch_decode_s": r["decode_s"],
           "batch_decodes": r["decodes"], "batch_prefill_s": r["prefill_s"], "padded_to": r["pad_to"],
           "tok_s": seq["predicted"] / r["wall_s"] if r["wall_s"] > 0 else 0.0,
           "decode_tok_s": (seq["predicted"] - 1) / r["decode_s"] if r["decode_s"] > 0 else 0.0,
           "output_tokens": r["tokens"][b]}
    if "per_round_accepted" in r["stats"]:     # RunShape.round_trace: [drafted, accepted] per round
        rec["round_trace"] = [[d, n] for d, n in zip(r["stats"]["per_round_drafted"][b],
                                                     r["stats"]["per_round_accepted"][b])]
    if "per_request" in r["stats"]:        # vLLM's per-request spec-decode counters and acceptance histogram
        rec["spec_decode"] = r["stats"]["per_request"][b]
    if model.decode is not None:
        rec["output_text"] = model.decode(r["tokens"][b])
    return rec


def add_by_output_position(row: dict, records: list[dict], bucket: int) -> None:
    """The setting's acceptance against the output position (`report.by_output_position`), overall and per
    category, from its prompts' round traces."""
    row["by_output_position"] = report.by_output_position((r["round_trace"] for r in records), bucket)
    for cat, c in row["per_category"].items():
        c["by_output_position"] = report.by_output_position(
            (r["round_trace"] for r in records if r["category"] == cat), bucket)


def match_baseline(records: list[dict], baseline: list[dict] | None) -> float | None:
    """Greedy runs only: fraction of prompts whose output equals the baseline's (speculation is lossless: 1.0)."""
    if baseline is None or not records or records[0]["temperature"] != 0:
        return None
    want = {r["id"]: r["output_tokens"] for r in baseline}
    return sum(r["output_tokens"] == want.get(r["id"]) for r in records) / len(records)


def prepare_run(parser: argparse.ArgumentParser, a: argparse.Namespace, parse_fn, specs_and_ks):
    """Every check that needs no model first (exit 2, nothing written), then the model and the prompts.

    parse_fn(a) -> the command's parsed grid; specs_and_ks(grid) -> (spec types, draft_n_max values).
    Returns (grid, model, notes, suite, prompts, suite_max_new_tokens).
    """
    try:
        common.check_common(a)
        grid = parse_fn(a)
        report.check_out_dir(a.out, a.overwrite)
        if a.model:
            check_model_dir(a.model)
        file_prompts = common.read_prompt_source(a)
    except (OptionError, PromptError, ModelError, OutDirError, FileNotFoundError) as e:
        parser.error(str(e))
    common.enable_compile_cache(a)
    try:
        model = load_model(a)
        notes = check_model_support(model, *specs_and_ks(grid))
        suite, prompts, suite_max_new = common.resolve_prompts(a, model, file_prompts)
    except (OptionError, PromptError, ModelError) as e:
        parser.error(str(e))
    return grid, model, notes, suite, prompts, suite_max_new


def plan_run(a: argparse.Namespace, model, prompts, settings, suite_max_new: int, notes):
    """Shared shapes of every run (length buckets, one max_len and max_block, the drafter pool), the
    progress total; prints the notes.

    Returns (max_new_tokens, SweepPlan, progress-bar total).
    """
    max_new = a.max_new_tokens or suite_max_new
    max_draft = max(effective_draft_n_max(s, model) for s in settings)
    buckets, max_len = plan_shapes([len(p["tokens"]) for p in prompts], max_new, max_draft, a.prompt_buckets)
    specs = [t for t in SPEC_TYPES if any(s.spec == t for s in settings)]
    pool = None if a.no_shared_programs else pool_for(model, specs, max(s.draft_n_max for s in settings))
    dynamic = a.shared_draft_widths and not a.no_shared_programs
    plan = SweepPlan(max_new_tokens=max_new, buckets=buckets, max_len=max_len,
                   max_block=None if a.no_shared_programs else max_draft + 1, drafter_pool=pool,
                   dynamic_draft_n=dynamic, adaptive_widths=dynamic and any(s.auto for s in settings),
                   seed=a.seed, top_p=a.top_p, eos_token_id=common.eos_for(a),
                   prefill_chunk=None if a.no_shared_programs or len(buckets) < 2 else min(min(buckets), LONG_PROMPT_CHUNK),
                   verify=a.verify, synthetic_accept=common.verify_options(a)[1],
                   round_trace=a.by_output_position is not None)
    for n in notes:
        print(n, file=sys.stderr)
    total = sum(len(shapes(prompts, s.batch_size, plan)) + a.repeats * len(batches(prompts, s.batch_size))
                for s in settings)
    return max_new, plan, total


def programs(settings: Sequence[Setting], prompts: list[dict], plan: SweepPlan, model) -> dict:
    """How many large programs the run compiles: prefills (one per bucket and batch size, or per batch size
    with the chunked prefill), loops (one per drafter or pool, draft width, temperature kind and batch size;
    one for every width with `plan.dynamic_draft_n`) and, in those shared loops, the verify widths beyond
    the first (each its own copy of the target step)."""
    prefill, loops, shared_widths = set(), set(), set()     # shared_widths: (shared loop, verify width − 1)
    for s in settings:
        for g in shapes(prompts, s.batch_size, plan):
            width = plan.prefill_chunk or plan.pad_for([len(p["tokens"]) for p in g])
            prefill.add((len(g), width, s.spec if plan.max_block is None else None))
        kind = "none" if s.spec == BASELINE else ("pool" if plan.drafter_pool else s.spec)
        shared = plan.dynamic_draft_n and kind != "none"
        width = plan.max_block - 1 if shared else effective_draft_n_max(s, model)
        loop = (kind, width, s.temperature == 0, s.batch_size)
        loops.add(loop)
        if shared:
            shared_widths.add((loop, effective_draft_n_max(s, model)))
        if shared and plan.adaptive_widths:      # the width scheduler's program holds every width 0..bound
            shared_widths.update((loop, w) for w in range(width + 1))
    extra = len(shared_widths) - len({loop for loop, _ in shared_widths})
    return {"prefill": len(prefill), "loop": len(loops), "extra_width": extra}


# seconds per layer of the model, measured on the 2-core VM (experiments/results/sweep_speed_2026-12-02_v8.md:
# the default run, idle cores, one program at a time: 42 s compiling 8 programs, 71 s running; the shared pool
# loop of k = 1..3 took 25 s against 10.5 s for a k = 1 loop alone); a prefill includes its drafter primings;
# an earlier VM of the same kind was ≈ 1.3× slower at both (v6)
COMPILE_S_PER_LAYER = {"prefill": 1.3, "loop": 1.15, "extra_width": 1.1}
RUN_S_PER_LAYER_TOKEN = 0.25e-3


def estimate_s(settings, prompts, plan: SweepPlan, model, repeats: int) -> tuple[float, float]:
    """(compile seconds, run seconds): a rough forecast from the program and run counts, scaled by the
    model's layers (calibrated on the bundled model on 2 idle cores; a converted checkpoint takes far
    longer)."""
    n = programs(settings, prompts, plan, model)
    layers = model.config.num_layers
    compile_s = layers * sum(COMPILE_S_PER_LAYER[k] * v for k, v in n.items())
    runs = sum(repeats * len(batches(prompts, s.batch_size)) + len(shapes(prompts, s.batch_size, plan))
               for s in settings)
    return compile_s, runs * plan.max_new_tokens * layers * RUN_S_PER_LAYER_TOKEN


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    grid, model, notes, suite, prompts, suite_max_new = prepare_run(
        parser, a, parse_grid, lambda g: (g["specs"], g["ks"] + ([g["auto_bound"]] if g["auto_bound"] else [])))
    settings = build_settings(**grid)
    max_new, plan, total = plan_run(a, model, prompts, settings, suite_max_new, notes)
    if a.what_if:
        return whatif_cli.run(a, argv, model, suite, prompts, settings, plan)
    n_prog = programs(settings, prompts, plan, model)
    est_c, est_r = estimate_s(settings, prompts, plan, model, a.repeats)
    print(f"dsv4-sweep: {model.name}, {len(prompts)} prompts ({suite}), {len(settings)} settings, "
          f"max_new_tokens {max_new}, repeats {a.repeats} -> {a.out}\n"
          f"dsv4-sweep: {n_prog['prefill']} prefill + {n_prog['loop']} loop programs to compile, prompt buckets "
          f"{list(plan.buckets)}; expect about {(est_c + est_r) / 60:.1f} min on 2 idle CPU cores "
          f"(~{est_c:.0f} s compiling, {max(a.compile_threads, 1)} program(s) at a time; seconds with a warm "
          f"--compile-cache; longer on busy cores)", file=sys.stderr)
    t_start, load_start = time.perf_counter(), list(os.getloadavg())
    with report.atomic_dir(a.out) as tmp, common.progress(total, a.quiet, "sweep") as bar:
        log = (lambda s: None) if a.quiet else bar.write
        # one device only: abstract arguments carry no mesh shardings, a sharded run would compile again
        pre = precompile(model, prompts, settings, plan, a.compile_threads) \
            if a.compile_threads and model.sharding is None else None
        if pre:
            log(f"== compiled {pre['programs']} programs in {pre['wall_s']:.1f} s ({a.compile_threads} at a time)")
        tables = common.cost_tables(model, prompts, settings, plan, given=a.cost_table_obj, machine=a.roofline,
                                    recalibrate=a.recalibrate, log=lambda s: bar.write(s, file=sys.stderr),
                                    progress=None if a.quiet else bar.write)
        runs, warms = time_settings(model, prompts, settings, plan, a.repeats, bar, tables, a.order == "interleaved")
        all_records, rows, baselines = [], [], {}
        for setting, setting_runs, warm in zip(settings, runs, warms):
            log(f"== {setting.label}  (warm-up/compile {warm:.1f} s)")
            records, batch_records = setting_records(model, prompts, setting, setting_runs, log)
            if setting.spec == BASELINE:
                baselines[setting.group] = records
            row = {**setting.as_dict(), "effective_draft_n_max": effective_draft_n_max(setting, model),
                   **report.aggregate(batch_records), "warmup_s": warm, "per_category": report.per_category(records),
                   "outputs_match_baseline": match_baseline(records, baselines.get(setting.group))}
            if a.by_output_position is not None:
                add_by_output_position(row, records, a.by_output_position)
            rows.append(row)
            report.add_speedups(rows, a.order == "interleaved")
            log(aggregate_line(row))
            all_records += records
        report.add_width_predictions(rows, {key: t["table"] for key, t in tables.items()}, a.cost_table_obj)
        summary = {"meta": run_meta(a, argv, model, suite, prompts, plan),
                   "settings": report.add_speedups(rows, a.order == "interleaved")}
        summary["meta"]["cost_tables"] = [report.cost_table_meta(key, t["table"], t["how"])
                                          for key, t in tables.items()]
        summary["meta"]["env"].update(load_average=load_start, load_average_end=list(os.getloadavg()))
        summary["meta"]["sweep_wall_s"] = time.perf_counter() - t_start
        summary["meta"]["warmup_s_total"] = sum(r["warmup_s"] for r in rows)
        summary["meta"]["precompile"] = None if pre is None else {**pre, "threads": a.compile_threads}
        report.write_jsonl(f"{tmp}/results.jsonl", all_records)
        report.write_json(f"{tmp}/summary.json", summary)
        with open(f"{tmp}/summary.md", "w", encoding="utf-8") as f:
            f.write(report.sweep_markdown(summary))
        if not a.no_plots:
            summary["meta"]["plots"] = report.plot_sweep(rows, tmp, model.name)
            report.write_json(f"{tmp}/summary.json", summary)
    if not a.quiet:
        print(report.sweep_markdown(summary))
    print(f"dsv4-sweep: wrote {a.out}/summary.json, summary.md, results.jsonl"
          + ("" if a.no_plots else ", " + ", ".join(summary["meta"]["plots"])), file=sys.stderr)
    return 0


def run_meta(a, argv, model, suite: str, prompts: list[dict], plan: SweepPlan) -> dict:
    return {"tool": "dsv4-sweep", "env": report.environment("dsv4-sweep", argv), "model": model.describe(),
            "suite": suite,
            "categories": sorted({p["category"] for p in prompts}), "n_prompts": len(prompts),
            "prompt_ids": [p["id"] for p in prompts], "max_new_tokens": plan.max_new_tokens,
            "repeats": a.repeats, "order": a.order, "seed": plan.seed, "top_p": plan.top_p, "ignore_eos": a.ignore_eos,
            "pad_to": plan.pad_to, "max_len": plan.max_len, "max_block": plan.max_block,
            "drafter_pool": list(plan.drafter_pool) if plan.drafter_pool else None,
            "dynamic_draft_n": plan.dynamic_draft_n, "verify": plan.verify,
            "draft_n_max_bound": a.auto_bound, "adaptive_widths": plan.adaptive_widths,
            "cost_table_file": a.cost_table, "roofline": None if a.roofline is None else a.roofline.name,
            "synthetic_accept": list(plan.synthetic_accept) if plan.synthetic_accept else None,
            "verify_width": "draft_n_max + 1 (one loop program for every draft_n_max, a switch over the widths)"
            if plan.dynamic_draft_n else "draft_n_max + 1 (one loop program per width)",
            "padding": {"buckets": list(plan.buckets), "prompt_tokens": sum(len(p["tokens"]) for p in prompts),
                        "padded_tokens": sum(plan.pad_for([len(p["tokens"])]) for p in prompts),
                        "prefill_chunk": plan.prefill_chunk},
            "prompt_template": a.prompt_template,
            "context": None if not a.context else {"tokens": a.context, "source": prompts_mod.context_source_note()},
            "timing": "decode_s: the decode loop alone (primary figure); prefill_s: prompt processing, first token "
                      "and drafter priming; wall = prefill + decode, each ended with jax.block_until_ready; one "
                      "untimed warm-up per setting and batch shape; rates are medians over repeats of the repeat's "
                      "total, with min and max",
            "speedup_baseline": "decode_tokens_per_s (tokens_per_s) / the same of spec 'none' with the same "
                                "temperature and batch size; _lo/_hi pair the slowest and fastest repeats"}


def what_if_main(argv: Sequence[str] | None = None) -> int:
    """dsv4-whatif: `dsv4-sweep --what-if` (docs/whatif.md)."""
    return main(["--what-if", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
