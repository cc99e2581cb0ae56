"""Per-chip traffic of full Flash (43 layers) from `aot_ep_traffic.py` runs at reduced layer counts.

A full 43-layer unrolled Flash compile for v5p:2x2x2 takes too long on the shared 2-core machine, so
`aot_ep_traffic.py --pairs P` compiles Flash with 3 + 2·P layers (its 3 leading layers, then P of its 20
identical HCA/CSA pairs) at two (or more) pair counts, and this script extrapolates every per-chip count
linearly in the pairs:  m(43) = m(P2) + (20 − P2) · (m(P2) − m(P1)) / (P2 − P1)  (the leading layers,
embedding and head are in both runs; every further pair adds the same ops). A third pair count, where
present, checks the linearity (`linearity`: the relative difference of the two per-pair increments).
The bound is computed for the full model directly (`dsv4_jax.analysis.traffic.bytes_bound` / chips), not
extrapolated.

With a single measured layer count (no second compile) the 43-layer figure is an *estimate*: the
measured count scaled by a placement model's growth, m(43) ≈ m(L) · model(43) / model(L), where
model = the bytes each chip must read *given the variant's placement* (`placement_bytes`: every weight
leaf's per-device bytes as `memplan.leaf_bytes` places it — replicated leaves whole —, routed experts
at the slices the local matmul reads, embedding rows, the cache rows of every sequence the chip holds).
It assumes XLA's overhead over that model (measured at L layers) is the same per layer.

    python experiments/ep_traffic_report.py --out experiments/results/ep_traffic_DATE \\
        RUN.partial.jsonl [RUN.partial.jsonl ...]

Inputs are the rows `aot_ep_traffic.py` writes (PREFIX.partial.jsonl or PREFIX.json); rows are grouped by
(variant, weights, program). Writes OUT.json and OUT.md.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import math
import os
import platform
import sys

import jax.numpy as jnp

from dsv4_jax import parallel
from dsv4_jax.analysis import memplan
from dsv4_jax.analysis.placements import variant_placement
from dsv4_jax.analysis.traffic import bytes_bound, cache_bytes_read, per_chip_bounds
from dsv4_jax.config import flash, with_pairs
from dsv4_jax.model import params as P

GIB = 1024 ** 3
FLASH_PAIRS = 20
METRICS = ("xla_bytes", "xla_bytes_nomsa", "collective_bytes", "flops", "argument_bytes")


def read_rows(path: str) -> list[dict]:
    """Rows of one aot_ep_traffic.py output (.partial.jsonl or .json), without failed compiles."""
    if path.endswith(".jsonl"):
        rows = [json.loads(line) for line in open(path) if line.strip()]
    else:
        rows = json.load(open(path))["rows"]
    for r in rows:
        r.setdefault("weights", "bf16")                 # rows written before the --weights option: bf16
    return [r for r in rows if "error" not in r]


def pairs_of(row: dict) -> int:
    return (row["n_layers"] - 3) // 2


def extrapolate(by_pairs: dict[int, dict], metric: str) -> dict | None:
    """{value at 20 pairs, per pair, pairs used, linearity} of one metric, None when under two pair counts."""
    ps = sorted(p for p, r in by_pairs.items() if metric in r and r[metric] == r[metric])
    if len(ps) < 2:
        return None
    p1, p2 = ps[-2], ps[-1]
    m1, m2 = by_pairs[p1][metric], by_pairs[p2][metric]
    per_pair = (m2 - m1) / (p2 - p1)
    out = {"value": m2 + (FLASH_PAIRS - p2) * per_pair, "per_pair": per_pair, "pairs": [p1, p2]}
    if len(ps) >= 3:
        p0 = ps[-3]
        earlier = (m1 - by_pairs[p0][metric]) / (p1 - p0)
        out["linearity"] = abs(per_pair - earlier) / max(abs(per_pair), 1e-30)
        out["pairs"] = [p0, p1, p2]
    return out


def placement_bytes(config, sizes: dict, rules, batch: int, block: int, context: int) -> float:
    """Bytes one chip must read in a bf16 step given the placement (module docstring): replicated leaves
    whole, split leaves their shard; routed experts: T·k expert slices when T·k ≤ E (one per assignment,
    the sliced local path), else every local expert (the dense path); the decode state split as the
    `batch` rule splits it."""
    T, E, k = batch * block, config.n_routed_experts, config.num_experts_per_tok
    e_loc = E // _split(parallel.partition_spec((E,), ("experts",), sizes, rules), sizes)
    n_read = min(T * k, e_loc)                  # local slices a static dropless program reads per device
    total = 0.0
    for path, spec in P.flatten(P.param_specs(config)).items():
        whole, per = memplan.leaf_bytes(path, spec, jnp.bfloat16, sizes, rules)
        if memplan.part_of(path, spec) == "routed experts":
            total += per * n_read / e_loc
        elif path == "embed" or path.endswith("tid2eid"):
            total += whole * min(T, spec.shape[0]) / spec.shape[0]
        else:
            total += per
    n_state = _split(parallel.partition_spec((batch,), ("state_batch",), sizes, rules), sizes)
    return total + batch / n_state * cache_bytes_read(config, context)["total"]


def _split(spec, sizes: dict) -> int:
    """How many ways the first dim of a PartitionSpec is split."""
    entry = spec[0] if len(spec) else None
    return math.prod(sizes[a] for a in ((entry,) if isinstance(entry, str) else (entry or ())))


def model_table(chips: int, context: int) -> list[dict]:
    """The placement model of full Flash per EP variant and program (no compile): which preset when."""
    programs = {"decode_b1": (1, 1), "decode_b8": (8, 1), "verify6_b8": (8, 6), "decode_b64": (64, 1)}
    out = []
    for v in ("latency-v1", "latency", "latency-ep", "throughput"):
        sizes, rules = variant_placement(v, chips)
        for name, (b, t) in programs.items():
            bound = bytes_bound(flash(), "bf16", b, context, t)["total"] / chips
            out.append({"variant": v, "program": name, "model": placement_bytes(flash(), sizes, rules, b, t, context),
                        "bound": bound})
    return out


def combine(rows: list[dict], context: int, chips: int) -> list[dict]:
    groups = collections.defaultdict(dict)
    for r in rows:
        groups[(r["variant"], r["weights"], r["program"])][pairs_of(r)] = r
    out = []
    for (variant, weights, program), by_pairs in sorted(groups.items()):
        any_row = next(iter(by_pairs.values()))
        res = {"variant": variant, "weights": weights, "program": program, "batch": any_row["batch"],
               "block": any_row["block"], "mesh": any_row["mesh"], "measured_layers": sorted(
                   r["n_layers"] for r in by_pairs.values())}
        res.update(per_chip_bounds(flash(), weights, any_row["batch"], any_row["block"], context, chips))
        res["measured"] = {r["n_layers"]: {m: r.get(m) for m in METRICS + ("bound", "compile_s", "compile_nomsa_s")}
                           for r in by_pairs.values()}
        sizes, rules = variant_placement(variant, chips)
        model = {p: placement_bytes(with_pairs(flash(), p), sizes, rules, res["batch"], res["block"], context)
                 for p in by_pairs}
        model_full = placement_bytes(flash(), sizes, rules, res["batch"], res["block"], context)
        res["placement_model"] = {"full": model_full, "measured": {by_pairs[p]["n_layers"]: v for p, v in model.items()}}
        for m in METRICS:
            e = extrapolate(by_pairs, m)
            if e is None and weights == "bf16":       # one layer count: scale by the placement model
                ps = [p for p, r in by_pairs.items() if r.get(m) is not None and r[m] == r[m]]
                if ps:
                    p = max(ps)
                    e = {"value": by_pairs[p][m] * model_full / model[p], "pairs": [p], "estimate": True}
            if e is not None:
                res[m] = e
        top = by_pairs[max(by_pairs)]
        res["collectives_per_layer"] = top.get("per_layer", [])
        out.append(res)
    return out


def _gib(x) -> str:
    return "—" if x is None else f"{x / GIB:.2f}"


def markdown(report: dict) -> str:
    L = [f"# Per-chip traffic of full Flash (43 layers) on {report['topology']}, context {report['context']}", "",
         f"{report['date']}, {report['machine']}; `{report['command']}`", "",
         "Per-chip bytes are XLA's `cost_analysis()['bytes accessed']` of the compiled per-device program "
         "(every layer written out, `Backends(unroll_layers=True)`), measured at the reduced layer counts "
         "listed and extrapolated linearly over Flash's 20 identical HCA/CSA pairs (module docstring of "
         "`experiments/ep_traffic_report.py`). *default* = the default compile (VMEM prefetching on: the "
         "cost model counts a prefetched weight at its HBM read, VMEM write and VMEM read); *no-prefetch* = "
         "the same program with VMEM memory-space assignment off (`xla_vf_vmem_memory_space_assignment="
         "False`), each operand counted where it is read: the HBM-traffic figure. Bound = "
         "`dsv4_jax.analysis.traffic.bytes_bound(flash(), weights, batch, context, tokens)` / chips (active "
         "experts E·(1 − (1 − k/E)^T) under uniform routing, head, embedding rows, cache rows); bound_bal: "
         "min(E, T·k) active experts (what a static dropless program must be able to read).", "",
         "| variant | weights | program | mesh | layers measured | default GiB/chip | no-prefetch GiB/chip | "
         "bound GiB/chip | ratio default | ratio no-prefetch | bound_bal GiB/chip | ratio_bal no-prefetch | "
         "collectives MiB/chip | placement model GiB/chip | extrapolation |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        d, n = r.get("xla_bytes", {}).get("value"), r.get("xla_bytes_nomsa", {}).get("value")
        lin = r.get("xla_bytes_nomsa", r.get("xla_bytes", {})).get("linearity")
        coll = r.get("collective_bytes", {}).get("value")
        ratio = lambda x, key="bound": "—" if x is None else f"{x / r[key]:.2f}"
        layers = ",".join(str(x) for x in r["measured_layers"])
        coll_s = "—" if coll is None else f"{coll / 2 ** 20:.1f}"
        lin_s = "—" if lin is None else f"{100 * lin:.1f} %"
        if r.get("xla_bytes_nomsa", {}).get("estimate"):
            lin_s = "estimate (one layer count, scaled by the placement model)"
        L.append(f"| {r['variant']} | {r['weights']} | {r['program']} | {r['mesh']} | {layers} | {_gib(d)} | "
                 f"{_gib(n)} | {r['bound'] / GIB:.3f} | {ratio(d)} | {ratio(n)} | {r['bound_bal'] / GIB:.3f} | "
                 f"{ratio(n, 'bound_bal')} | {coll_s} | {r['placement_model']['full'] / GIB:.3f} | {lin_s} |")
    L += ["", "## Measured (reduced layer counts)", "",
          "| variant | weights | program | layers | default GiB/chip | no-prefetch GiB/chip | bound GiB/chip | "
          "ratio default | ratio no-prefetch | placement model GiB/chip | compile s |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        for n, m in sorted(r["measured"].items(), key=lambda kv: int(kv[0])):
            secs = str(m["compile_s"]) + ("" if m.get("compile_nomsa_s") is None else f" + {m['compile_nomsa_s']}")
            rt = lambda x: "—" if x is None or x != x else f"{x / m['bound']:.2f}"
            pm = r["placement_model"]["measured"].get(n, r["placement_model"]["measured"].get(str(n)))
            L.append(f"| {r['variant']} | {r['weights']} | {r['program']} | {n} | {_gib(m['xla_bytes'])} | "
                     f"{_gib(m['xla_bytes_nomsa'])} | {m['bound'] / GIB:.3f} | {rt(m['xla_bytes'])} | "
                     f"{rt(m['xla_bytes_nomsa'])} | {_gib(pm)} | {secs} |")
    L += ["", "## Placement model of full Flash per variant (no compile)", "",
          "GiB per chip a step must read given the placement (`placement_bytes`), against the bound; "
          "`latency-split` = the latency preset with q latent, compressor, K=V projection and mHC input "
          "split over `model` too (a rules change, not a preset yet).", "",
          "| variant | " + " | ".join(p for p in dict.fromkeys(m["program"] for m in report["model_table"])) + " |",
          "|---|" + "---|" * len(dict.fromkeys(m["program"] for m in report["model_table"]))]
    for v in dict.fromkeys(m["variant"] for m in report["model_table"]):
        cells = [f"{m['model'] / GIB:.2f} ({m['model'] / m['bound']:.2f}×)" for m in report["model_table"]
                 if m["variant"] == v]
        L.append(f"| {v} | " + " | ".join(cells) + " |")
    L += ["", "## Collectives per layer (largest measured layer count)", ""]
    for r in report["rows"]:
        parts = ", ".join(f"{c['op']} {c['shape']} {c['bytes'] / 1024:.1f} KiB ×{c['per_layer']:.2g}"
                          for c in r["collectives_per_layer"])
        L.append(f"- **{r['variant']} / {r['weights']} / {r['program']}**: {parts or 'none'}")
    return "\n".join(L)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("inputs", nargs="+", help="aot_ep_traffic.py outputs (PREFIX.partial.jsonl or PREFIX.json)")
    ap.add_argument("--out", required=True, help="output prefix (writes OUT.json, OUT.md)")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--chips", type=int, default=8)
    ap.add_argument("--topology", default="v5p:2x2x2")
    a = ap.parse_args(argv)
    rows = [r for p in a.inputs for r in read_rows(p)]
    report = {"date": datetime.date.today().isoformat(),
              "machine": f"{platform.node()} ({os.cpu_count()} CPUs), libtpu AOT (no TPU)",
              "command": " ".join(["python", "experiments/ep_traffic_report.py"]
                                  + (argv if argv is not None else sys.argv[1:])),
              "topology": a.topology, "context": a.context, "chips": a.chips, "rows": combine(rows, a.context, a.chips),
              "model_table": model_table(a.chips, a.context)}
    with open(a.out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    with open(a.out + ".md", "w") as f:
        f.write(markdown(report) + "\n")
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
