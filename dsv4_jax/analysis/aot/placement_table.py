"""`dsv4-aot placements`: per-chip traffic of Flash decode / verify under each placement of the expert-parallel
study, side by side.

For each placement variant of `analysis.placements.VARIANTS` (GSPMD meshes with the reference MoE, the sharding
presets with the expert-parallel MoE, a preset with rules changed) it compiles decode at B = 1 and B = 8 and the
verify block of `--verify-tokens` tokens at B = 8, ahead of time for `--topology` (`runner.run`, the report's own
code path), and lays the reports' numbers out in one table: HLO-op bytes per chip with and without XLA's VMEM
prefetching, XLA's bytes (every layer counted as `--count` says), the bounds under uniform and balanced routing,
collectives and the peak (docs/aot.md says what each column is).

    dsv4-aot placements --topology v5p:2x2x2 --weights release --out experiments/results/NAME

writes NAME.md (the table) and NAME/ (one report JSON per variant and batch; `--resume` keeps the ones
already there, so a long run can be stopped and continued).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from .. import libtpu
from ..placements import VARIANTS
from . import inputs as I, runner

GB = 1e9
GIB = 1024 ** 3
HEAD = ["variant", "program", "B", "mesh", "HLO-op GB", "/ bound", "/ balanced", "no-prefetch HLO-op GB",
        "/ bound", "XLA GB", "bound GB", "balanced GB", "collective operand MB", "peak GiB", "fits"]
BATCHES = ((1, ("decode",)), (8, ("decode", "verify")))    # batch size: the programs compiled at it


@dataclasses.dataclass(frozen=True)
class PlacementStudy:
    """What every variant is compiled for: the topology, weight format, committed context, verify block
    (tokens per sequence), Flash's repeated pairs kept (None: all 20), how layers are counted (`runner.counting`),
    the VMEM-prefetch compiles (`runner.VMEM_PREFETCH`) and the command recorded in each report's meta."""

    topology: str = "v5p:2x2x2"
    weights: str = "bf16"
    context: int = 32768
    verify_tokens: int = 6
    pairs: int | None = None
    count: str = "extrapolate"
    vmem_prefetch: str = "both"
    command: str = ""


def request(variant: str, batch: int, programs: tuple[str, ...], study: PlacementStudy) -> runner.AotRequest:
    """The dsv4-aot request of one variant at one batch size."""
    shape, rules, moe = VARIANTS[variant]
    config = runner.model_config("flash", pairs=study.pairs, platform="tpu", unroll=study.count != "scan")
    placement = {"sharding": shape, "rules": rules} if isinstance(shape, str) else {"mesh": shape}
    if moe == "ep" and not isinstance(shape, str):
        raise ValueError(f"variant {variant!r}: the expert-parallel MoE runs on a sharding preset's mesh")
    return runner.AotRequest((study.topology,), (study.weights,),
                             I.Shapes(batch, study.context, study.verify_tokens - 1, 256), config, programs=programs,
                             kernels=False, count=study.count, vmem_prefetch=study.vmem_prefetch,
                             command=study.command, **placement)


def table_rows(variant: str, report: dict) -> list[list]:
    """One row per program of the report (HEAD's columns)."""
    rows = []
    for run_ in report["runs"]:
        for r in run_["programs"]:
            if not r.get("compiled"):
                rows.append([variant, r["program"], report["shapes"]["batch"], run_["mesh_text"],
                             f"not compiled: {r.get('reason', '')[:80]}"] + [""] * (len(HEAD) - 5))
                continue
            e, b, chips = r["estimate"], r["bound"], run_["chips"]
            q = r.get("no_prefetch") or {}
            f = lambda x, s=GB, fmt=".3g": "—" if x is None else format(x / s, fmt)
            rt = lambda k: f"{e[k]:.2f}" if k in e else "—"
            name = r["program"] + (f" {r['tokens_per_sequence']}" if r["program"] == "verify" else "")
            rows.append([variant, name, report["shapes"]["batch"], run_["mesh_text"],
                         f(r["hlo"]["top_ops"]["total_bytes"] or None), rt("hlo_op_bytes_over_bound"),
                         rt("hlo_op_bytes_over_bound_bal"), f(q.get("hlo_op_bytes")),
                         rt("hlo_op_bytes_no_prefetch_over_bound"), f(r["cost"].get("bytes_accessed")),
                         f(b["total"] / chips), f(b["balanced"] / chips),
                         f(r["hlo"]["collectives"]["total_operand_bytes"], 1e6, ".1f"),
                         f(r["memory"].get("peak"), GIB, ".2f"), "yes" if r["fits"] else "no"])
    return rows


def markdown(study: PlacementStudy, reports: list[tuple[str, dict]]) -> str:
    """The table of (variant, report)s with its header lines."""
    meta = reports[0][1]["meta"] if reports else {}
    pairs = "" if study.pairs is None else f" {study.pairs} pairs"
    lines = [f"# Per-chip traffic by placement ({study.topology}, Flash{pairs}, {study.weights} weights, "
             f"context {study.context})", "",
             f"{meta.get('date', '')}, {meta.get('machine', '')}, jax {meta.get('jax')}, libtpu {meta.get('libtpu')}; "
             f"`{meta.get('command', '')}`", "",
             "Per chip. HLO-op GB: HBM operands + results of the compiled program as run (loop bodies × trip "
             "counts); no-prefetch: the same program compiled with XLA's VMEM prefetching off; XLA GB: "
             f"`cost_analysis` bytes, layers counted by `--count {study.count}`; bound: what the step must read split "
             "over the chips (uniform routing), balanced: with min(E, T·k) experts per layer.", "",
             "| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    for variant, rep in reports:
        lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in table_rows(variant, rep)]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dsv4-aot placements", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--topology", default="v5p:2x2x2")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {','.join(VARIANTS)}")
    ap.add_argument("--weights", choices=I.WEIGHTS, default="bf16")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--verify-tokens", type=int, default=6, help="tokens of the verify block at B = 8 (default 6)")
    ap.add_argument("--pairs", type=int, default=None, help="Flash with 3 + 2·PAIRS layers (default all 43)")
    ap.add_argument("--count", choices=runner.COUNT_METHODS, default="extrapolate")
    ap.add_argument("--vmem-prefetch", choices=runner.VMEM_PREFETCH, default="both")
    ap.add_argument("--out", required=True, help="output prefix: PREFIX.md and the reports in PREFIX/")
    ap.add_argument("--resume", action="store_true", help="keep the reports already in PREFIX/")
    return ap


def _report(path: str, variant: str, batch: int, programs: tuple[str, ...], study: PlacementStudy,
            resume: bool) -> dict:
    """One variant's report at one batch: read back from `path` (resume), else compiled and written there."""
    if resume and os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    rep = runner.run(request(variant, batch, programs, study))
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(rep, f, indent=1, default=str)
    os.replace(tmp, path)
    return rep


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[2:] if argv is None else list(argv)
    ap = build_parser()
    a = ap.parse_args(argv)
    variants = a.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    if not libtpu.available():
        ap.error(libtpu.HELP)
    libtpu.set_env()
    study = PlacementStudy(a.topology, a.weights, a.context, a.verify_tokens, a.pairs, a.count, a.vmem_prefetch,
                           command="dsv4-aot placements " + " ".join(argv))
    os.makedirs(a.out, exist_ok=True)
    reports = [(variant, _report(os.path.join(a.out, f"{variant}_b{batch}.json"), variant, batch, programs, study,
                                 a.resume))
               for variant in variants for batch, programs in BATCHES]
    text = markdown(study, reports)
    with open(a.out + ".md", "w") as f:
        f.write(text)
    print(text)
    return 0
