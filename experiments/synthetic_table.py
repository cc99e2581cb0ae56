"""The table of experiments/synthetic_acceptance.sh: decode speed-up over no speculation vs synthetic rate x
draft_n_max, with the measured and expected mean accepted length (1 + Σ_j Π_{i<=j} r_i)."""
import json
import sys

from dsv4_jax.ops.verification import expected_accepted


def main(paths: list[str]) -> None:
    rows = []
    for path in paths:
        s = json.load(open(f"{path}/summary.json"))
        rates = s["meta"]["synthetic_accept"]
        for r in s["settings"]:
            if r["spec_type"] == "none":
                continue
            k = r["effective_draft_n_max"]
            rows.append((rates[0], k, r["mean_accepted_length"], 1 + expected_accepted(rates, k), r["decode_speedup"],
                         r.get("decode_speedup_lo"), r.get("decode_speedup_hi"), r["decode_tokens_per_s"]))
    print("| synthetic rate | draft_n_max | mean accepted length measured | expected | decode speed-up [range] | decode tok/s |")
    print("|---|---|---|---|---|---|")
    for rate, k, mal, exp, sp, lo, hi, tps in sorted(rows):
        print(f"| {rate:g} | {k} | {mal:.3f} | {exp:.3f} | {sp:.2f}× [{lo:.2f}–{hi:.2f}] | {tps:.1f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
