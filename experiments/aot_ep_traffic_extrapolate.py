"""Per-chip traffic of all 43 Flash layers from two reduced-layer `aot_ep_traffic.py` runs (issue 19).

`aot_ep_traffic.py --pairs P` compiles Flash with 3 + 2·P layers, unrolled. XLA's bytes (and flops, collective
bytes) grow linearly with the number of repeated HCA/CSA pairs once the pairs are a stacked segment (P ≥ 2;
`dsv4_jax.analysis.aot.extrapolate`), so two runs at P = a and a + 1 give all 20 pairs:

    x(20) = x(a) + (20 − a) · (x(a + 1) − x(a))

compared with the bound of the full model (`dsv4_jax.analysis.traffic.per_chip_bounds` of `flash()`):

    python experiments/aot_ep_traffic_extrapolate.py RUN_a.json RUN_a+1.json --out experiments/results/NAME

(each RUN is `aot_ep_traffic.py --out RUN`'s JSON; a third run, e.g. P = 1, may be given with --check to show
how far its linear prediction from the other two is.) Writes NAME.json and NAME.md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from dsv4_jax.analysis.aot.extrapolate import linear
from dsv4_jax.analysis.traffic import per_chip_bounds
from dsv4_jax.config import flash

GIB = 1024 ** 3
KEYS = ("xla_bytes", "xla_bytes_nomsa", "flops", "collective_bytes", "optimal_seconds")


def pairs_of(run: dict) -> int:
    return (run["rows"][0]["n_layers"] - 3) // 2


def rows_by_key(run: dict) -> dict:
    return {(r["variant"], r["program"]): r for r in run["rows"] if "error" not in r}


def numbers(row: dict) -> dict:
    return {k: row[k] for k in KEYS if isinstance(row.get(k), (int, float)) and row[k] == row[k]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("lo", help="aot_ep_traffic JSON with P = a pairs")
    ap.add_argument("hi", help="aot_ep_traffic JSON with P = a + 1 pairs")
    ap.add_argument("--check", default=None, help="a third run (another P) to compare with the prediction")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    lo, hi = (json.load(open(p)) for p in (a.lo, a.hi))
    pa, pb = pairs_of(lo), pairs_of(hi)
    if pb != pa + 1:
        raise SystemExit(f"need runs at a and a + 1 pairs, got {pa} and {pb}")
    check = json.load(open(a.check)) if a.check else None
    full = flash()
    n = (full.num_layers - 3) // 2
    chips = lo.get("chips", 8)
    rows = []
    for key, rl in rows_by_key(lo).items():
        rh = rows_by_key(hi).get(key)
        if rh is None:
            continue
        at = lambda p: linear(numbers(rl), numbers(rh), pa, p)
        row = {"variant": key[0], "program": key[1], "batch": rl["batch"], "block": rl["block"], "mesh": rl["mesh"],
               "points": {pa: numbers(rl), pb: numbers(rh)}, "extrapolated": at(n),
               **per_chip_bounds(full, lo.get("weights", "bf16"), rl["batch"], rl["block"], lo["context"], chips)}
        if check:
            rc = rows_by_key(check).get(key)
            if rc is not None:
                pc = pairs_of(check)
                pred = at(pc)
                row["check"] = {"pairs": pc, "measured": numbers(rc), "predicted": pred,
                                "rel_error": {k: pred[k] / v - 1 for k, v in numbers(rc).items() if k in pred and v}}
        rows.append(row)
    out = {"model": full.name, "layers": full.num_layers, "pairs": n, "from_pairs": [pa, pb],
           "topology": lo["topology"], "context": lo["context"], "weights": lo.get("weights", "bf16"),
           "sources": [{"path": p, "command": r["command"], "date": r["date"]} for p, r in ((a.lo, lo), (a.hi, hi))]
           + ([{"path": a.check, "command": check["command"], "date": check["date"]}] if check else []),
           "rows": rows}
    L = [f"# Per-chip traffic of all {full.num_layers} Flash layers, extrapolated ({out['topology']}, "
         f"{out['weights']} weights, context {out['context']})", "",
         f"x({n}) = x({pa}) + ({n} − {pa})·(x({pb}) − x({pa})) over the repeated HCA/CSA pairs, from "
         f"`aot_ep_traffic.py` runs with 3 + 2·{pa} and 3 + 2·{pb} layers (unrolled):", "",
         *[f"- `{s['command']}` ({s['date']})" for s in out["sources"]], "",
         "bound = what the full model's step must read / chips (uniform routing); ratio = XLA bytes / bound "
         "(issue 19 asks ≤ 1.3); no-prefetch = compiled with VMEM prefetching off (each weight counted once where "
         "it is read, the closer HBM figure).", "",
         "| variant | program | mesh | XLA GiB/chip | no-prefetch GiB/chip | bound GiB | ratio | ratio no-prefetch | "
         f"collective MiB | TFLOP | per pair: no-prefetch GiB | check: P = {check and pairs_of(check)} rel. error |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    g = lambda d, k, s=GIB, f=".2f": format(d[k] / s, f) if k in d else "—"
    for r in rows:
        e, p = r["extrapolated"], r["points"]
        per_pair = {k: p[pb][k] - p[pa][k] for k in p[pa] if k in p[pb]}
        ratio = lambda k: f"{e[k] / r['bound']:.2f}" if k in e else "—"
        chk = ", ".join(f"{k} {v:+.1%}" for k, v in r.get("check", {}).get("rel_error", {}).items()
                        if k in ("xla_bytes", "xla_bytes_nomsa")) or "—"
        L.append(f"| {r['variant']} | {r['program']} | {r['mesh']} | {g(e, 'xla_bytes')} | {g(e, 'xla_bytes_nomsa')} | "
                 f"{r['bound'] / GIB:.3f} | {ratio('xla_bytes')} | {ratio('xla_bytes_nomsa')} | "
                 f"{g(e, 'collective_bytes', 2 ** 20, '.1f')} | {g(e, 'flops', 1e12, '.3f')} | "
                 f"{g(per_pair, 'xla_bytes_nomsa', GIB, '.3f')} | {chk} |")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out + ".json", "w") as f:
        json.dump(out, f, indent=1)
    with open(a.out + ".md", "w") as f:
        f.write("\n".join(L) + "\n")
    print("\n".join(L))
    return 0


if __name__ == "__main__":
    sys.exit(main())
