"""`dsv4-batch-eval`: throughput and per-sequence latency of batched generation, with and without speculation.

The prompts (a suite, cycled to --num-prompts, or a prompts file) are decoded in consecutive batches
of B (ragged prompts: `generate` pads them and tracks each sequence's length). For each spec type ×
draft_n_max × temperature × batch size: one untimed warm-up per batch shape, then every batch timed
(median over --repeats). Throughput = generated tokens / total wall time; a sequence's latency is the
wall time of its batch (mean / p50 / p90 over sequences).

Output (--out DIR, written atomically): batch_eval.json ({"meta", "settings"}), batch_eval.md,
results.jsonl (one line per batch × setting), throughput.png, latency.png.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from . import common, report
from .common import OptionError
from .models import add_model_args
from .runner import (BASELINE, RunPlan, Setting, batches, effective_draft_n_max, grid_settings, run_batch, shapes,
                     warm_up)
from .sweep import plan_run, prepare_run

EXAMPLES = """examples:
  dsv4-batch-eval --out results/batch                      # bundled tiny model, 16 prompts, B=1,4, none/mtp/dspark k=3
  dsv4-batch-eval --out results/batch8 --batch-size 1,2,4,8 --num-prompts 32 --spec none,dspark
  dsv4-batch-eval --out results/batch-t1 --temperature 1 --draft-n-max 2,4 --repeats 3
  dsv4-batch-eval --out results/ckpt --model /ckpt/dsv4-flash --prompts-file prompts.jsonl
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dsv4-batch-eval", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES,
        description="Batch evaluation: decode many prompts in batches of B and report throughput (generated "
                    "tokens/s) and per-sequence latency (mean/p50/p90), with and without speculative decoding.")
    add_model_args(p)
    g = p.add_argument_group("settings (comma-separated lists; integer ranges like 1-4 allowed)")
    g.add_argument("--spec", default="none,mtp,dspark", help="spec types (default none,mtp,dspark)")
    g.add_argument("--draft-n-max", default="3", metavar="K", help="drafts per round for mtp/dspark (default 3)")
    g.add_argument("--p-min", default="0", metavar="P", help="MTP p_min values (default 0)")
    g.add_argument("--confidence", default="0", metavar="C", help="DSpark confidence thresholds (default 0)")
    g.add_argument("--temperature", default="0", metavar="T", help="temperatures (default 0 = greedy)")
    g.add_argument("--batch-size", default="1,4", metavar="B", help="batch sizes (default 1,4)")
    g.add_argument("--num-prompts", type=int, default=16, metavar="N",
                   help="prompts to decode per setting: the selected prompts cycled or cut to N (default 16)")
    common.add_prompt_args(p, default_per_category=None)
    common.add_run_args(p)
    return p


def parse_settings(a: argparse.Namespace) -> tuple[list[Setting], list[int]]:
    specs = common.spec_list(a.spec)
    ks = common.int_list(a.draft_n_max, "--draft-n-max", 1)
    p_mins = common.float_list(a.p_min, "--p-min", 0.0, 1.0)
    confs = common.float_list(a.confidence, "--confidence", 0.0, 1.0)
    temps = common.float_list(a.temperature, "--temperature", 0.0)
    sizes = common.int_list(a.batch_size, "--batch-size", 1)
    if a.num_prompts < 1:
        raise OptionError(f"--num-prompts must be >= 1, got {a.num_prompts}")
    return grid_settings(specs, ks, {"p_min": p_mins, "confidence_threshold": confs}, temps, sizes), ks


def cycle_to(prompts: list[dict], n: int) -> list[dict]:
    """The prompts repeated (ids suffixed #r) or cut to exactly n."""
    out = []
    for i in range(n):
        p = prompts[i % len(prompts)]
        r = i // len(prompts)
        out.append(p if r == 0 else {**p, "id": f"{p['id']}#{r}"})
    return out


def evaluate(model, prompts: list[dict], setting: Setting, plan: RunPlan, repeats: int, bar) -> tuple[dict, list]:
    """(aggregate row, per-batch records) of one setting."""
    groups = batches(prompts, setting.batch_size)
    warm = 0.0
    for g in shapes(prompts, setting.batch_size, plan):
        warm += warm_up(model, g, setting, plan)
        bar.update(1)
    batch_records, latencies = [], []
    for i, group in enumerate(groups):
        r = run_batch(model, group, setting, plan, repeats)
        st = r["stats"]
        batch_records.append({**setting.as_dict(), "batch_index": i, "n": len(group), "ids": [p["id"] for p in group],
                              "predicted": st["generated"], "draft": st["drafted"], "accepted": st["accepted"],
                              "rounds": st["rounds"], "wall_s": r["wall_s"], "walls": r["walls"],
                              "decode_s": r["decode_s"], "decodes": r["decodes"], "prefill_s": r["prefill_s"],
                              "prefills": r["prefills"], "prompt_tokens": sum(len(p["tokens"]) for p in group),
                              "padded_tokens": len(group) * r["pad_to"],
                              "tokens_per_s": st["generated"] / r["wall_s"] if r["wall_s"] > 0 else 0.0,
                              "per_sequence_generated": st["per_sequence_generated"],
                              "per_position_accepted": st["per_position_accepted"],
                              "per_position_proposed": st["per_position_proposed"]})
        latencies += [r["wall_s"]] * len(group)
        bar.update(repeats)
    agg = report.aggregate(batch_records)
    lat = report.percentiles(latencies)
    per_tok = [rec["wall_s"] / max(1, g) for rec in batch_records for g in rec["per_sequence_generated"]]
    row = {**setting.as_dict(), "label_no_batch": setting.label.rsplit(" B=", 1)[0],
           "effective_draft_n_max": effective_draft_n_max(setting, model), **agg,
           "n_batches": len(groups), "latency_mean_s": lat["mean"], "latency_p50_s": lat["p50"],
           "latency_p90_s": lat["p90"], "latency_max_s": lat["max"],
           "ms_per_token_p50": 1000 * report.percentiles(per_tok)["p50"], "warmup_s": warm}
    return row, batch_records


MD_HEADER = ("spec", "k", "knob", "T", "B", "sequences", "generated", "accept_rate", "mean_acc_len", "tok/s",
             "speed-up", "latency mean (s)", "p50 (s)", "p90 (s)", "ms/token p50")


def markdown(summary: dict) -> str:
    m = summary["meta"]
    rows = [(s["spec_type"], s["draft_n_max"] if s["spec_type"] != BASELINE else "–",
             report.knob_text(s),
             f"{s['temperature']:g}", s["batch_size"], s["n_requests"], s["total_predicted"],
             s["aggregate_accept_rate"], s["mean_accepted_length"], f"{s['tokens_per_s']:.1f}",
             f"{s['speedup']:.2f}×" if s["speedup"] is not None else "–", s["latency_mean_s"], s["latency_p50_s"],
             s["latency_p90_s"], f"{s['ms_per_token_p50']:.2f}") for s in summary["settings"]]
    return "\n".join([
        f"# Batch evaluation — {m['model']['name']}", "",
        f"- model: `{m['model']['source']}`; {m['n_prompts']} prompts from `{m['suite']}` "
        f"(max_new_tokens {m['max_new_tokens']}, repeats {m['repeats']}, seed {m['seed']}, padded to {m['pad_to']})",
        f"- {m['env']['backend']} ({', '.join(sorted(set(m['env']['devices'])))}), jax {m['env']['jax_version']}, "
        f"{m['env']['date']}", f"- command: `{m['env']['command']}`", "",
        "tok/s = all generated tokens / total wall time; a sequence's latency = the wall time of its batch; "
        "speed-up against `none` with the same T and B.", "",
        report.markdown_table(MD_HEADER, rows), ""])


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    (settings, ks), model, notes, suite, prompts, suite_max_new = prepare_run(
        parser, a, parse_settings, lambda g: (sorted({s.spec for s in g[0]}), g[1]))
    prompts = cycle_to(prompts, a.num_prompts)
    max_new, plan, total = plan_run(a, model, prompts, settings, suite_max_new, notes)
    print(f"dsv4-batch-eval: {model.name}, {len(prompts)} prompts ({suite}), {len(settings)} settings, "
          f"max_new_tokens {max_new} -> {a.out}", file=sys.stderr)
    with report.atomic_dir(a.out) as tmp, common.progress(total, a.quiet, "batch-eval") as bar:
        rows, records = [], []
        for s in settings:
            row, recs = evaluate(model, prompts, s, plan, a.repeats, bar)
            rows.append(row)
            records += recs
            report.add_speedups(rows)
            if not a.quiet:
                bar.write(f"{s.label:<36} tok/s={row['tokens_per_s']:8.1f} latency p50={row['latency_p50_s']:.3f}s "
                          f"p90={row['latency_p90_s']:.3f}s accept={row['aggregate_accept_rate']:.3f} "
                          f"(warm-up {row['warmup_s']:.1f} s)")
        summary = {"meta": {"tool": "dsv4-batch-eval", "env": report.environment("dsv4-batch-eval", argv),
                            "model": model.describe(), "suite": suite, "n_prompts": len(prompts),
                            "max_new_tokens": max_new, "repeats": a.repeats, "seed": a.seed, "top_p": a.top_p,
                            "ignore_eos": a.ignore_eos, "pad_to": plan.pad_to, "max_len": plan.max_len,
                            "timing": "per batch: wall time of generate (prefill + decode, jax.block_until_ready), "
                                      "median over repeats, one untimed warm-up per setting and batch shape"},
                   "settings": rows}
        report.write_jsonl(f"{tmp}/results.jsonl", records)
        if not a.no_plots:
            summary["meta"]["plots"] = report.plot_batch_eval(rows, tmp, model.name)
        report.write_json(f"{tmp}/batch_eval.json", summary)
        with open(f"{tmp}/batch_eval.md", "w", encoding="utf-8") as f:
            f.write(markdown(summary))
    if not a.quiet:
        print(markdown(summary))
    print(f"dsv4-batch-eval: wrote {a.out}/batch_eval.json, batch_eval.md, results.jsonl", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
