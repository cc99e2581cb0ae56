"""Block vs token-wise verification on the bundled tiny model and the tiny prompt suite (docs/verification.md).

For each drafter (MTP, DSpark), temperature and seed, all suite prompts run in one batch under both verify
rules, so the two see the same prompts, shapes and compiled prefill; the table gives the mean accepted length
(bonus token included) of each rule, the gain of block over token-wise, and the analytic expectation logged
beside each. Temperature is a run-time knob: one loop program per (drafter, rule).

    PYTHONPATH=. python experiments/verification_rules.py --out experiments/results/block_verification_2026-12-04.json
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np

import dsv4_jax as d
from dsv4_jax.research.calibration import markdown as calib_md, merge, metrics
from dsv4_jax.research.prompts import load_suite, tokenize


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafters", default="mtp,dspark")
    ap.add_argument("--temperatures", default="0.8,1.0")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=96, help="each suite prompt's first N tokens (default 96)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    m = d.tiny_demo()
    prompts = [p["tokens"][:a.prompt_len]
               for p in tokenize(load_suite("tiny")["prompts"], m.tokenizer.encode, m.config.vocab_size)]
    pad = max(len(p) for p in prompts)
    rows = []
    for drafter in a.drafters.split(","):
        for temp in [float(t) for t in a.temperatures.split(",")]:
            for seed in range(a.seeds):
                row = {"drafter": drafter, "temperature": temp, "seed": seed}
                for rule in ("token", "block"):
                    t0 = time.perf_counter()
                    _, st = d.generate(m.params, m.config, prompts, a.max_new, temperature=temp, drafter=drafter,
                                       draft_n_max=a.k, verify=rule, dspark_meta=m.dspark, eos_token_id=-1,
                                       seed=seed, pad_to=pad, max_len=pad + a.max_new + a.k + 1)
                    row[rule] = {key: st[key] for key in ("mean_accepted_length", "expected_mean_accepted_length",
                                                          "per_position_accept_rate",
                                                          "per_position_expected_accept_rate", "rounds",
                                                          "acceptance_histogram")}
                    row[rule]["call_s"] = time.perf_counter() - t0
                    row[rule]["calibration"] = st.get("calibration")      # DSpark's confidence bins
                row["gain"] = row["block"]["mean_accepted_length"] / row["token"]["mean_accepted_length"] - 1
                rows.append(row)
                print(f"{drafter:6s} T={temp:g} seed={seed}: token {row['token']['mean_accepted_length']:.3f} "
                      f"(analytic {row['token']['expected_mean_accepted_length']:.3f})  block "
                      f"{row['block']['mean_accepted_length']:.3f} (analytic "
                      f"{row['block']['expected_mean_accepted_length']:.3f})  gain {100 * row['gain']:+.1f}%",
                      flush=True)
    summary = []
    for drafter in a.drafters.split(","):
        for temp in [float(t) for t in a.temperatures.split(",")]:
            rs = [r for r in rows if r["drafter"] == drafter and r["temperature"] == temp]
            mean = lambda rule, key: float(np.mean([r[rule][key] for r in rs]))
            summary.append({"drafter": drafter, "temperature": temp, "seeds": len(rs),
                            **{f"{rule}_{key}": mean(rule, key) for rule in ("token", "block")
                               for key in ("mean_accepted_length", "expected_mean_accepted_length")},
                            "gain_measured": mean("block", "mean_accepted_length") / mean("token", "mean_accepted_length") - 1,
                            "gain_analytic": mean("block", "expected_mean_accepted_length")
                            / mean("token", "expected_mean_accepted_length") - 1})
    print("| drafter | T | token: measured (analytic) | block: measured (analytic) | gain measured | gain analytic |")
    print("|---|---|---|---|---|---|")
    for s in summary:
        print(f"| {s['drafter']} | {s['temperature']:g} | {s['token_mean_accepted_length']:.3f} "
              f"({s['token_expected_mean_accepted_length']:.3f}) | {s['block_mean_accepted_length']:.3f} "
              f"({s['block_expected_mean_accepted_length']:.3f}) | {100 * s['gain_measured']:+.1f}% | "
              f"{100 * s['gain_analytic']:+.1f}% |")
    for drafter in a.drafters.split(","):
        calib = merge([r[rule]["calibration"] for r in rows if r["drafter"] == drafter for rule in ("token", "block")])
        if calib:
            print(calib_md(metrics(calib), f"{drafter}: confidence calibration over every sampled run above"))
            summary.append({"drafter": drafter, "calibration": calib, "calibration_metrics": metrics(calib)})
    with open(a.out, "w") as f:
        json.dump({"machine": platform.platform(), "k": a.k, "max_new_tokens": a.max_new, "n_prompts": len(prompts),
                   "summary": summary, "runs": rows}, f, indent=1)


if __name__ == "__main__":
    main()
