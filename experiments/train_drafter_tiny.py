#!/usr/bin/env python
"""dsv4-train-drafter on the bundled tiny target: the acceptance run and the measurements behind its defaults.

    python experiments/train_drafter_tiny.py --out runs/train_drafter [--steps 300] [--only NAME,...]
        [--results experiments/results/train_drafter_<date>]

Training text: this interpreter's standard library, split like the tiny target's own training
(`dsv4_jax.training.data`: files with sha1(path) % 20 == 0 held out), written once as OUT/{train,heldout}.jsonl
(one document per file). Each variant is one `dsv4-train-drafter` run in OUT/<name> (a finished variant is
skipped, an interrupted one resumed), run one after another in this process:

    dspark-scratch, dspark-target-layers, mtp-scratch, mtp-target-layers   (steps, evaluation every 100 steps)
    dspark-scratch-seed1, dspark-target-layers-seed1                       (the DSpark pair again, seed 1)
    timing-fly, timing-cache, timing-bf16        (60 steps, no speculative evaluation: DSpark step time computed
                                                  on the fly vs read from a --cache-targets cache, f32 vs bf16)

Writes RESULTS.json (every summary) and RESULTS.md (tables).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

from dsv4_jax.training import data, drafter_cli

COMMON = ["--model", "tiny-demo", "--batch", "8", "--seq-len", "128", "--dtype", "float32", "--quiet",
          "--eval-prompts", "16", "--eval-prompt-len", "64", "--eval-new-tokens", "128", "--eval-k", "5"]


def variants(steps: int) -> dict[str, list[str]]:
    full = ["--steps", str(steps), "--eval-every", "100"]
    timing = ["--steps", "60", "--no-eval", "--no-export", "--no-plots", "--drafter", "dspark"]
    return {"dspark-scratch": ["--drafter", "dspark", "--init", "scratch"] + full,
            "dspark-target-layers": ["--drafter", "dspark", "--init", "target-layers"] + full,
            "mtp-scratch": ["--drafter", "mtp", "--init", "scratch"] + full,
            "mtp-target-layers": ["--drafter", "mtp", "--init", "target-layers"] + full,
            "dspark-scratch-seed1": ["--drafter", "dspark", "--init", "scratch", "--seed", "1"] + full,
            "dspark-target-layers-seed1": ["--drafter", "dspark", "--init", "target-layers", "--seed", "1"] + full,
            "timing-fly": timing,
            "timing-cache": timing + ["--cache-targets"],
            "timing-bf16": timing + ["--dtype", "bfloat16"]}


def write_corpus(out: str) -> tuple[str, str]:
    paths = {s: os.path.join(out, f"{s}.jsonl") for s in ("train", "heldout")}
    if all(os.path.exists(p) for p in paths.values()):
        return paths["train"], paths["heldout"]
    files = {s: [] for s in paths}
    for f in data.stdlib_files():
        files["heldout" if data.is_heldout(f) else "train"].append(f)
    for s, p in paths.items():
        with open(p + ".tmp", "w") as fh:
            for f in files[s]:
                with open(f, "rb") as src:
                    fh.write(json.dumps({"text": src.read().decode("utf-8", "replace"), "path": f}) + "\n")
        os.replace(p + ".tmp", p)
    return paths["train"], paths["heldout"]


def run_variant(name: str, argv: list[str], out: str, train: str, heldout: str) -> dict:
    d = os.path.join(out, name)
    summary = os.path.join(d, "summary.json")
    if not os.path.exists(summary):
        args = COMMON + argv + ["--data", train, "--heldout-data", heldout, "--out", d]
        if os.path.exists(os.path.join(d, "run.json")):
            args.append("--resume")
        t0 = time.perf_counter()
        rc = drafter_cli.main(args)
        if rc != 0:
            raise SystemExit(f"{name}: dsv4-train-drafter exited with {rc}")
        with open(summary) as f:
            s = json.load(f)
        s["wall_s"] = time.perf_counter() - t0
        s["load_average_at_end"] = os.getloadavg()
        with open(summary, "w") as f:
            json.dump(s, f, indent=1)
    with open(summary) as f:
        return json.load(f)


def _mal(e: dict | None) -> str:
    return f"{e['spec']['mean_accepted_length']:.2f}" if e and "spec" in e else "–"


def _rates(e: dict | None) -> str:
    return " ".join(f"{r:.2f}" for r in e["spec"]["per_position_accept_rate"]) if e and "spec" in e else "–"


def markdown(res: dict) -> str:
    lines = [f"# dsv4-train-drafter on the bundled tiny target ({res['date']})", "",
             f"Command: `{res['command']}`  ", f"Machine: {res['machine']}", "",
             "| variant | steps | mean acc. len k=5: initial → final | model's own drafter | gain | accept rate "
             "per position (final) | lossless | held-out loss | step s (median) | first step s | wall min |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in res["runs"].items():
        if name.startswith("timing"):
            continue
        t, own = s["timings"], s["eval_baseline_model_drafter"]
        lines.append(f"| {name} | {t['steps_run']} | {_mal(s['eval_initial'])} → {_mal(s['eval_final'])} | "
                     f"{_mal(own)} | {s.get('mean_accepted_length_gain', 0):+.2f} | {_rates(s['eval_final'])} | "
                     f"{s['eval_final']['spec']['lossless']} | {s['eval_final']['heldout']['loss']:.3f} | "
                     f"{t.get('step_s_median', 0):.2f} | {t.get('first_step_s', 0):.0f} | {s['wall_s'] / 60:.1f} |")
    lines += ["", "| timing variant | steps | step s (median) | first step s | cache pass s | cache MB | "
              "target-state bytes / token |", "|---|---|---|---|---|---|---|"]
    for name, s in res["runs"].items():
        if not name.startswith("timing"):
            continue
        t = s["timings"]
        mb = f"{t['cache_bytes'] / 1e6:.1f}" if t.get("cache_bytes") else "–"
        lines.append(f"| {name} | {t['steps_run']} | {t.get('step_s_median', 0):.3f} | "
                     f"{t.get('first_step_s', 0):.0f} | "
                     f"{t.get('cache_s', 0):.0f} | {mb} | {s['bytes_per_token_target_states']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/train_drafter")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--only", help="comma-separated variant names")
    ap.add_argument("--results", help="write RESULTS.json / RESULTS.md (default OUT/results)")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    train, heldout = write_corpus(a.out)
    chosen = variants(a.steps)
    if a.only:
        chosen = {k: v for k, v in chosen.items() if k in a.only.split(",")}
    runs = {name: run_variant(name, args, a.out, train, heldout) for name, args in chosen.items()}
    res = {"date": datetime.date.today().isoformat(), "command": " ".join(["python"] + sys.argv),
           "machine": f"{platform.platform()}, {os.cpu_count()} CPUs (shared with other jobs; see load)",
           "load_average_at_end": os.getloadavg(), "runs": runs}
    base = a.results or os.path.join(a.out, "results")
    with open(base + ".json", "w") as f:
        json.dump(res, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
