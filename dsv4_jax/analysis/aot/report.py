"""The report: JSON (everything), Markdown (tables) and a plot (bytes and estimated time per program).

`fit_table` is the compact "will it fit, and how fast could it be" view (one row per topology × weight
format) that README.md shows; the speculation payoff forecast (`report["forecast"]`, `forecast.report_forecast`)
gets its own section and plot. Files are written next to each other (`x.json`, `x.md`, `x.png`,
`x.forecast.png`), each to a temporary name first and renamed when complete.
"""
from __future__ import annotations

import json
import os
import tempfile

from . import forecast as F
from .chips import GIB
from .kernel_hook import COLUMNS

GB = 1e9


def _g(x, scale=GIB, fmt=".2f") -> str:
    return "—" if x is None else format(x / scale, fmt)


def _ms(x) -> str:
    return "—" if x is None else (f"{x * 1e3:.3g}" if x * 1e3 < 100 else f"{x * 1e3:.0f}")


def _fits(row: dict) -> str:
    f = row.get("fits")
    return "yes" if f else "**NO**" if f is False else "?"


def table(head: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def _peak(row: dict) -> float | None:
    return row.get("memory", {}).get("peak")


def program_rows(run: dict) -> list[list]:
    rows = []
    for r in run["programs"]:
        m, c, e = r.get("memory", {}), r.get("cost", {}), r.get("estimate", {})
        ops = r.get("hlo", {}).get("top_ops", {}).get("total_bytes")
        bound = (r.get("bound") or {}).get("total")
        bpc = bound / run["chips"] if bound else None
        secs = "+".join(f"{r[k]:.0f}" for k in ("as_run_compile_s", "compile_s", "count_compile_s") if k in r) or "—"
        if r.get("fit_source") and "count_compile_s" in r:      # the program as run compiled in an earlier run
            secs = f"(saved {r.get('compile_s', 0):.0f})+{r['count_compile_s']:.0f}"
        rows.append([r["program"], cost_method(r), _fits(r), _g(r.get("argument_bytes_per_device")), _g(m.get("temp")),
                     _g(m.get("output")), _g(_peak(r)), _g(r.get("memory_unrolled", {}).get("peak")), secs,
                     _g(c.get("flops"), 1e12, ".3g"), _g(c.get("bytes_accessed"), GB, ".3g"), _g(ops, GB, ".3g"),
                     _g(bpc, GB, ".3g"), f"{e['xla_bytes_over_bound']:.2f}" if "xla_bytes_over_bound" in e else "—",
                     _ms(e.get("xla_bytes_s")), _ms(e.get("flops_s")), _ms(e.get("roofline_s") if r.get("compiled") else None),
                     _ms(e.get("latency_roofline_s") if r.get("compiled") else None), _latency_counts(e),
                     _ms(e.get("bound_s") or (bpc / run["chip"]["hbm_gbps"] / GB if bpc else None)),
                     _ms(c.get("optimal_seconds"))])
    return rows


PROGRAM_HEAD = ["program", "costs", "fits", "args GiB", "temp GiB", "out GiB", "peak GiB", "peak unrolled GiB",
                "compile s", "TFLOP",
                "XLA GB", "HLO-op GB", "bound GB", "XLA / bound", "ms @HBM (XLA bytes)", "ms @peak flops",
                "ms roofline", "ms latency roofline", "collectives / ops", "ms bound", "ms XLA optimal"]


def _latency_counts(e: dict) -> str:
    """"collectives / launched ops" behind a row's latency roofline (loop-scaled), or —."""
    n = e.get("latency_counts")
    return f"{n['collectives']:.0f} / {n['ops']:.0f}" if n else "—"


def _latency_line(run: dict) -> str:
    """The latencies a run's latency roofline used (µs), from its chip (reports before them: none)."""
    c = run["chip"]
    if "collective_latency_us" not in c:
        return ""
    return (f" Latency roofline: {c['collective_latency_us']:g} µs per collective, {c['op_overhead_us']:g} µs per "
            f"launched op.")


BOUND_HEAD = ["program", "bound GB (uniform)", "bound GB (balanced)", "HLO-op GB", "/ uniform", "/ balanced",
              "prefetches", "no-prefetch HLO-op GB", "/ uniform", "/ balanced", "prefetches left",
              "XLA GB as run", "no-prefetch XLA GB as run"]

PREFETCH_NOTE = (
    "Bytes per chip against the bound under uniform routing (E(1 − (1 − k/E)^T) active experts per layer) and "
    "balanced routing (min(E, T·k): the most a static dropless program can be asked to skip; the two agree at "
    "one token), for the default compile and the same program compiled with XLA's VMEM prefetching off "
    "(`--vmem-prefetch both`). prefetches = copy-start instructions (weights staged into VMEM ahead of use). "
    "XLA GB as run = `cost_analysis` bytes of each program as run (each repeated layer once: compare the two "
    "columns with each other, not with the bound). Which figure is HBM traffic: XLA's cost analysis counts a "
    "prefetched operand three times (its HBM read, the VMEM write, the consumer's VMEM read) although HBM is "
    "read once, so XLA's bytes of the default compile overstate HBM traffic by the prefetched bytes ×2; "
    "without prefetching every operand is read from HBM where it is used and XLA's bytes are HBM bytes — the "
    "closer of XLA's two figures. The HLO-op bytes count arrays in on-chip memory spaces as 0, so they are HBM "
    "bytes in both compiles (the default one: what the program as run reads; the two differ by what XLA "
    "re-reads or re-lays out when it cannot stage through VMEM). ³ the Mosaic MoE kernels' calls counted as "
    "their BlockSpecs declare (the table below) instead of their operands whole.")


def bound_rows(run: dict) -> list[list]:
    """Per compiled program: bytes vs the uniform and balanced bounds, with and without VMEM prefetching."""
    rows = []
    for r in run["programs"]:
        if not r.get("compiled"):
            continue
        e, b, q = r.get("estimate", {}), r.get("bound") or {}, r.get("no_prefetch") or {}
        ratio = lambda k: f"{e[k]:.2f}" if k in e else "—"
        per_chip = lambda x: x / run["chips"] if x else None
        declared = e.get("hlo_op_bytes_kernels_declared")
        ops = declared or r.get("hlo", {}).get("top_ops", {}).get("total_bytes") or None
        rows.append([r["program"], _g(per_chip(b.get("total")), GB, ".3g"), _g(per_chip(b.get("balanced")), GB, ".3g"),
                     _g(ops, GB, ".3g") + (" ³" if declared else ""),
                     ratio("hlo_op_bytes_over_bound"), ratio("hlo_op_bytes_over_bound_bal"),
                     r.get("hlo", {}).get("vmem_prefetches", "—"),
                     _g(q.get("hlo_op_bytes"), GB, ".3g") if q and "error" not in q else
                     ("error" if q else "—"),
                     ratio("hlo_op_bytes_no_prefetch_over_bound"), ratio("hlo_op_bytes_no_prefetch_over_bound_bal"),
                     q.get("vmem_prefetches", "—") if q else "—",
                     _g((r.get("cost_as_run") or (r.get("cost", {}) if r.get("cost_method") == "scan" else {}))
                        .get("bytes_accessed"), GB, ".3g"),
                     _g(q.get("cost_as_run", {}).get("bytes_accessed"), GB, ".3g") if q else "—"])
    return rows


EP_KERNEL_HEAD = ["program", "kernel", "format", "tokens/chip", "local experts E×I×D", "layers",
                  "declared GB/chip", "ideal GB/chip", "XLA GB/chip", "HLO-op GB/chip",
                  "HLO-op GB/chip, kernels as declared"]


def ep_kernel_rows(run: dict) -> list[list]:
    """One row per program that holds the Mosaic MoE kernels as its EP local matmul (`row["ep_kernel"]`)."""
    rows = []
    for r in run["programs"]:
        k = r.get("ep_kernel")
        if not k:
            continue
        ops = r.get("hlo", {}).get("top_ops", {}).get("total_bytes")
        rows.append([r["program"] + (" ²" if k.get("scope") or k.get("calls") else ""), k["kernel"], k["fmt"], k["tokens"],
                     "×".join(map(str, k["dims"])), k["layers"], _g(k["declared_bytes"], GB, ".3g"),
                     _g(k["ideal_bytes"], GB, ".3g"), _g(r.get("cost", {}).get("bytes_accessed"), GB, ".3g"),
                     _g(ops or None, GB, ".3g"),
                     _g(r.get("estimate", {}).get("hlo_op_bytes_kernels_declared"), GB, ".3g")])
    return rows


def cost_method(row: dict) -> str:
    """How the row's XLA costs count the layers: "extrapolated (7, 9 L)", "unrolled", "scan ¹" (older rows
    without cost_method: from cost_counts_every_layer)."""
    if not row.get("compiled"):
        return "—"
    method = row.get("cost_method") or ("unrolled" if row.get("cost_counts_every_layer", True) else "scan")
    if method == "extrapolated":
        return f"extrapolated ({', '.join(str(p['layers']) for p in row['cost_points'])} L)"
    return "scan ¹" if method == "scan" else method


def counting_method(report: dict) -> str:
    """The report's way of counting layers (`runner.Counting`); older reports: from model.unroll_layers."""
    c = report.get("counting")
    if c:
        return c["method"]
    return "unrolled" if report["model"].get("unroll_layers", True) else "scan"


def collective_rows(run: dict) -> list[list]:
    rows = []
    for r in run["programs"]:
        col = r.get("hlo", {}).get("collectives")
        if not col:
            continue
        if not col["by_opcode"]:
            rows.append([r["program"], "none", 0, "0", ""])
        for op, v in sorted(col["by_opcode"].items(), key=lambda kv: -kv[1]["operand_bytes"]):
            biggest = next((o for o in col["ops"] if o["opcode"] == op), {})
            rows.append([r["program"], op, v["count"], _g(v["operand_bytes"], GB, ".3g"),
                         f"{biggest.get('shape', '')} {biggest.get('replica_groups', '')}"[:90]])
    return rows


def top_rows(run: dict, n: int = 6) -> list[list]:
    rows = []
    for r in run["programs"]:
        for g in r.get("hlo", {}).get("top_ops", {}).get("groups", [])[:n]:
            rows.append([r["program"], f"`{g['group'][-90:]}`", g["count"], _g(g["bytes"], GB, ".3g"),
                         f"{g['share']:.0%}"])
    return rows


def kernel_section(k: dict | None) -> list[str]:
    if not k:
        return []
    L = ["### Mosaic TPU kernels", ""]
    if not k.get("available"):
        return L + [f"not available: {k.get('reason', '')}", ""]
    if k.get("error"):
        L += [f"kernel AOT helper failed: {k['error']}", ""]
    rows = k.get("rows", [])
    cols = [c for c in COLUMNS if any(c in r for r in rows)]
    fmt = lambda c, v: _g(v, GB, ".4g") if c.endswith("bytes") and isinstance(v, (int, float)) else \
        (f"{v:.3g}" if isinstance(v, float) else str(v))
    head = [c.replace("_bytes", " GB") if c.endswith("_bytes") else c for c in cols]
    if rows:
        L += ["One chip per kernel program (`dsv4_jax.analysis.kernels_aot`): XLA's numbers for the compiled kernel, "
              "the bytes its BlockSpecs move, the ideal bytes, and the XLA reference path's.", "",
              table(head, [[fmt(c, r.get(c, "")) for c in cols] for r in rows]), ""]
    return L


def fit_rows(report: dict) -> list[list]:
    """One row per run: the README "will it fit, and how fast could it be" table."""
    rows = []
    for run in report["runs"]:
        by = {r["program"]: r for r in run["programs"]}
        peaks = [_peak(r) for r in run["programs"] if _peak(r) is not None]
        fits = [r.get("fits") for r in run["programs"]]
        fit = "yes" if fits and all(f is True for f in fits) else "**NO**" if any(f is False for f in fits) else "?"
        args = max((r.get("argument_bytes_per_device", 0) for r in run["programs"]), default=None)

        def est(name):
            r = by.get(name)
            if r is None:
                return "—"
            if not r.get("compiled"):
                return "—"
            return f"{_ms(r['estimate']['roofline_s'])} ({_ms(r['estimate'].get('bound_s'))})"

        pre = by.get("prefill")
        tps = "—"
        if pre and pre.get("compiled") and pre["estimate"]["roofline_s"]:
            tps = f"{report['shapes']['batch'] * pre['tokens_per_sequence'] / pre['estimate']['roofline_s']:.3g}"
        rolled = any(r.get("cost_counts_every_layer") is False for r in run["programs"])
        weights = run["weights"] + (" ¹" if rolled else "")
        rows.append([f"`{run['topology']}`", f"{run['chips']} ({run['hosts']})", run["mesh_text"], weights,
                     _g(args), _g(max(peaks)) if peaks else "—", f"{run['hbm_bytes'] / GIB:.2f}", fit,
                     est("decode"), est("verify"), est("spec-mtp"), est("spec-dspark"), tps])
    return rows


FIT_HEAD = ["topology", "chips (hosts)", "mesh d×e×m", "weights", "args GiB/chip (max)", "peak GiB/chip (max)",
            "HBM GiB", "fits", "decode ms", "verify ms", "MTP round ms", "DSpark round ms", "prefill tok/s"]


def fit_table(report: dict) -> str:
    return table(FIT_HEAD, fit_rows(report))


def _run_key(run: dict) -> tuple:
    return run["topology"], run["weights"], run["mesh_text"]


def merge(reports: list[dict], paths: list[str]) -> dict:
    """One report from several of the same model and shapes: a run (topology × weights × mesh) seen again
    gains the programs (and kernels section) it lacks; other runs are appended. meta["sources"] lists each
    report's date, command and whether its layers were unrolled. ValueError on a different model or shapes."""
    merged = json.loads(json.dumps(reports[0]))
    merged["meta"]["sources"] = []
    for path, r in zip(paths, reports):
        if r["shapes"] != merged["shapes"] or r["model"]["name"] != merged["model"]["name"]:
            raise ValueError(f"{path}: different model or shapes ({r['model']['name']}, {r['shapes']}) than the "
                             f"first ({merged['model']['name']}, {merged['shapes']})")
        merged["meta"]["sources"].append({"path": path, "date": r["meta"].get("date"),
                                          "command": r["meta"].get("command"),
                                          "unroll_layers": r["model"].get("unroll_layers"),
                                          "counting": counting_method(r)})
        if r is reports[0]:
            continue
        for run in r["runs"]:
            same = next((m for m in merged["runs"] if _run_key(m) == _run_key(run)), None)
            if same is None:
                merged["runs"].append(run)
                continue
            have = {p["program"] for p in same["programs"]}
            same["programs"] += [p for p in run["programs"] if p["program"] not in have]
            if run.get("kernels") and not same.get("kernels"):
                same["kernels"] = run["kernels"]
    merged["meta"]["rendered_from"] = list(paths)
    return merged


_METHOD_TEXT = {"extrapolated": "every layer counted, extrapolated from two small unrolled compiles",
                "unrolled": "every layer unrolled", "scan": "layer scans kept: repeated layers counted once"}


def _source_method(src: dict) -> str:
    method = src.get("counting") or ("unrolled" if src.get("unroll_layers", True) else "scan")
    return _METHOD_TEXT[method]


def _counting_line(report: dict) -> str:
    c = report.get("counting") or {"method": counting_method(report)}
    if c["method"] == "extrapolated":
        (a, b), (la, lb) = c["reps"], c["layers"]
        return (f"- XLA's costs (TFLOP, XLA GB): **extrapolated** from the program compiled unrolled with {a} and "
                f"{b} of the {c['extrapolated_to']} repeated layer-pattern repetitions ({la} and {lb} layers): "
                f"cost({c['extrapolated_to']}) = cost({a}) + ({c['extrapolated_to']} − {a})·(cost({b}) − cost({a})) "
                f"(`dsv4_jax.analysis.aot.extrapolate`); fit, HLO-op bytes, top ops and collectives from the full program as "
                f"run (layer scans, loop bodies × trip counts)")
    if c["method"] == "unrolled":
        return "- XLA's costs: the full program compiled with every layer unrolled; fit from the program as run"
    return "- XLA's costs: the program as run (layer scans kept): each repeated layer counted once ¹"


def _latency_meta_text(m: dict) -> str:
    lat = m.get("latency")
    if not lat:
        return "per run below"
    src = set(lat["source"].values())
    return (f"{lat['collective_latency_us']:g} µs per collective, {lat['op_overhead_us']:g} µs per op "
            f"({'; '.join(sorted(src))})")


def markdown(report: dict) -> str:
    m, sh = report["meta"], report["shapes"]
    L = ["# dsv4-aot: ahead-of-time compile, fit and traffic report", "",
         f"- date: {m['date']}; machine: {m['machine']}; jax {m['jax']}, libtpu {m.get('libtpu') or 'absent'}",
         f"- command: `{m['command']}`" if not m.get("sources") else "- merged from (`dsv4-aot --render`):",
         *[f"  - {src['date']}: `{src['command']}` (costs: {_source_method(src)})" for src in m.get("sources", [])],
         f"- model: {report['model']['name']} ({report['model']['layers']} layers, {report['model']['params_b']:.1f} B "
         f"parameters), backends: {report['backends']}",
         f"- batch {sh['batch']}, context {sh['context']}, draft_n_max {sh['draft_n_max']} (verify block "
         f"{sh['draft_n_max'] + 1}), prefill chunk {sh['prefill_chunk']} tokens per sequence",
         _counting_line(report) if not m.get("sources") else "- costs per program: column \"costs\"",
         f"- compile wall time: {m.get('wall_s', 0):.0f} s", "",
         "Per chip unless marked. peak = argument + output − alias + temp (`memory_analysis`) of the program as a "
         "run executes it (layer scans; fits = peak ≤ HBM), peak unrolled = the same of the program compiled with "
         "every layer written out (costs \"unrolled\" only); compile s = as run + unrolled, or as run + the two "
         "small unrolled compiles (costs \"extrapolated\"); TFLOP and XLA GB = `cost_analysis` flops and bytes "
         "accessed counting every layer as the column \"costs\" says: extrapolated linearly from two unrolled "
         "compiles of the leading layers + a and a + 1 repetitions of the repeated layers (`dsv4_jax.analysis.aot.extrapolate`), "
         "or of the whole unrolled program (XLA's bytes include on-chip traffic and the unrolled program's copies "
         "of the stacked layer weights), or ¹ of the program as run (each repeated layer once: an under-count); "
         "HLO-op GB = HBM operands + results of the "
         "top-level HLO instructions of the program as run, loop bodies × trip counts (`dsv4_jax.analysis.aot.hlo`; top ops "
         "and collectives likewise); bound = what the step must read (active weights under uniform routing + cache "
         "rows, `dsv4_jax.analysis.aot.bounds`) split evenly over the chips. Times at the chip's HBM bandwidth and peak "
         "bf16 rate; roofline = max(HLO-op bytes / bandwidth, flops / peak); latency roofline = roofline + "
         "collectives × the per-collective latency + launched ops (fusions, custom calls and other top-level ops, "
         "loop bodies × trip counts; `dsv4_jax.analysis.aot.hlo.launches`) × the per-op overhead (column \"collectives / ops\"; "
         f"latencies: {_latency_meta_text(m)}); ms XLA optimal = the TPU compiler's own `optimal_seconds`.",
         ""]
    if counting_method(report) == "scan":
        L += ["**Compiled with the layer scans kept (`--no-unroll`)**: one compile per program, the program as a "
              "run executes it. Fit, HLO-op GB, top ops and collectives count every layer (loop bodies × trip "
              "counts); TFLOP and XLA GB are XLA's `cost_analysis`, which counts each repeated layer once (an "
              "under-count), and there is no unrolled peak.", ""]
    L += ["## Will it fit, and how fast could it be", "",
         "Maxima over the programs (the DSpark round holds the most: target + drafter weights); ms: roofline "
         "estimate per call (the bound at HBM bandwidth in parentheses); prefill tok/s = batch × chunk / roofline; "
         "¹ compiled with the layer scans kept (`--no-unroll`: XLA's flops count each repeated layer once; the "
         "HLO-op bytes behind the estimates count every layer).",
         "",
         fit_table(report), ""]
    L += F.section(report.get("forecast"))
    for run in report["runs"]:
        L += [f"## {run['topology']}, {run['weights']} weights", "",
              f"{run['chips']} chips on {run['hosts']} host(s), {run['chip']['device_kind']}; mesh (data, expert, "
              f"model) = {run['mesh_text']}; HBM per chip {run['hbm_bytes'] / GIB:.2f} GiB ({run['hbm_source']}); "
              f"{run['chip']['hbm_gbps']:g} GB/s, {run['chip']['bf16_tflops']:g} bf16 TFLOP/s.{_latency_line(run)}"
              + (f" Backends: {run['backends']}." if run.get("backends") else ""),
              "",
              table(PROGRAM_HEAD, program_rows(run)), ""]
        notes = [f"- {r['program']}: {r['reason'][:300]}" for r in run["programs"] if r.get("reason")]
        notes += [f"- {r['program']}: {r['notes']}" for r in run["programs"] if r.get("notes")]
        notes += [f"- {r['program']}: the program as run (fit, HLO-op bytes, top ops, collectives) from "
                  f"{r['fit_source']}" for r in run["programs"] if r.get("fit_source")]
        notes += [f"- {r['program']}: the small unrolled compiles failed, costs from the program as run: "
                  f"{r['count_error'][:300]}" for r in run["programs"] if r.get("count_error")]
        if notes:
            L += notes + [""]
        br = bound_rows(run)
        if br:
            L += ["### Bytes vs the bound, with and without VMEM prefetching", "", PREFETCH_NOTE, "",
                  table(BOUND_HEAD, br), ""]
            L += [f"- {r['program']}: the no-prefetch compile failed: {r['no_prefetch']['error'][:300]}"
                  for r in run["programs"] if "error" in (r.get("no_prefetch") or {})]
        ek = ep_kernel_rows(run)
        if ek:
            L += ["### Mosaic MoE kernels inside the programs (EP local matmul)", "",
                  "Declared = the bytes the kernels' BlockSpecs move per chip (uniform routing), every routed "
                  "layer; next to XLA's bytes accessed and the HLO-op bytes of the whole program (which count a "
                  "kernel call's operands whole: with the layer stacks handed to the kernel in place, every "
                  "call's operands are the whole stack), and the HLO-op bytes with the kernel calls replaced by "
                  "the declared bytes (the HBM estimate the roofline uses). ² a round: kernel, tokens and layers "
                  "of its target verify block; declared and ideal bytes also hold its drafter's MoE calls (JSON "
                  "`ep_kernel.calls`; reports before 2026-12-08: the verify block only, no replacement).", "",
                  table(EP_KERNEL_HEAD, ek), ""]
        col = collective_rows(run)
        if col:
            L += ["### Collectives", "", table(["program", "collective", "count", "operand GB/chip", "largest"], col), ""]
        top = top_rows(run)
        if top:
            L += ["### Top HLO ops by bytes (grouped by JAX operation)", "",
                  table(["program", "operation", "instructions", "GB/chip", "share"], top), ""]
        L += kernel_section(run.get("kernels"))
    return "\n".join(L)


def plot(report: dict, path: str) -> None:
    """Bytes per chip (XLA, HLO ops, bound) and estimated ms per program, one group per run."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels, xla, ops, bound, roof, bnd = [], [], [], [], [], []
    for run in report["runs"]:
        for r in run["programs"]:
            if not r.get("compiled"):
                continue
            labels.append(f"{run['topology']} {run['weights']}\n{r['program']}")
            xla.append(r["cost"].get("bytes_accessed", 0) / GB)
            ops.append(r["hlo"]["top_ops"]["total_bytes"] / GB)
            bound.append(r["estimate"].get("bound_per_chip_bytes", 0) / GB)
            roof.append(r["estimate"]["roofline_s"] * 1e3)
            bnd.append(r["estimate"].get("bound_s", 0) * 1e3)
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.1 * len(labels) + 2), 8), sharex=True)
    x = range(len(labels))
    w = 0.27
    ax = axes[0]
    ax.bar([i - w for i in x], xla, w, label="XLA bytes accessed")
    ax.bar(list(x), ops, w, label="HLO ops' HBM bytes")
    ax.bar([i + w for i in x], bound, w, label="bound (ideal split)")
    ax.set_ylabel("GB per chip")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title("dsv4-aot: bytes per chip and estimated time per program")
    ax = axes[1]
    ax.bar([i - w / 2 for i in x], roof, w, label="roofline estimate")
    ax.bar([i + w / 2 for i in x], bnd, w, label="bound at HBM bandwidth")
    ax.set_ylabel("ms per call")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _atomic_write(path: str, write) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp_", suffix=os.path.splitext(path)[1])
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write(report: dict, json_path: str, plot_too: bool = True) -> list[str]:
    """Write x.json, x.md (and x.png, x.forecast.png): all rendered first, then each renamed into place."""
    stem = os.path.splitext(json_path)[0]
    text = markdown(report)
    paths = [json_path, stem + ".md"]

    def dump_json(p):
        with open(p, "w") as f:
            json.dump(report, f, indent=1, default=str)

    def dump_md(p):
        with open(p, "w") as f:
            f.write(text + "\n")

    _atomic_write(json_path, dump_json)
    _atomic_write(stem + ".md", dump_md)
    if plot_too and any(r.get("compiled") for run in report["runs"] for r in run["programs"]):
        _atomic_write(stem + ".png", lambda p: plot(report, p))
        paths.append(stem + ".png")
    if plot_too and report.get("forecast"):
        _atomic_write(stem + ".forecast.png", lambda p: F.plot_report(report["forecast"], p))
        paths.append(stem + ".forecast.png")
    return paths
