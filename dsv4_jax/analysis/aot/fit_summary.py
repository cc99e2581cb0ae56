"""`dsv4-aot fit-table`: the "will it fit" table of the README from saved `dsv4-aot` reports: one row per
topology × weights × program, peak HBM per chip (`memory_analysis` of the program as run) against what a chip
may use, with the command that reproduces the row (the report's own `meta["command"]`).

    dsv4-aot fit-table REPORT.json [...] [--reproduce] [--out table.json]

Prints a Markdown table; `--out` also writes the rows as JSON. A prefill row names the chunk that fit and
the chunks tried (`dsv4-aot` halves the chunk until it fits). Compiles nothing.
"""
from __future__ import annotations

import argparse
import json
import sys

GIB = 1024 ** 3
KEY_FLAGS = ("--topology", "--weights", "--batch", "--programs", "--prefill-chunk", "--draft-n-max", "--kernels")
ORDER = ("prefill", "decode", "verify", "spec-mtp", "spec-dspark")
NAMES = {"prefill": "prefill chunk", "decode": "decode", "verify": "verify", "spec-mtp": "MTP round",
         "spec-dspark": "DSpark round"}


def rows_of(report: dict, path: str) -> list[dict]:
    """Fit rows of one report: every compiled (or out-of-memory) program of every run."""
    out = []
    cmd = report.get("meta", {}).get("command", "")
    B = report.get("shapes", {}).get("batch")
    for run in report.get("runs", []):
        for r in run.get("programs", []):
            peak = (r.get("memory") or {}).get("peak") or r.get("required_bytes")
            row = {"topology": run["topology"], "weights": run["weights"], "sharding": run.get("sharding", "gspmd"),
                   "program": r["program"], "batch": B, "tokens_per_sequence": r.get("tokens_per_sequence"),
                   "peak_gib": None if peak is None else peak / GIB, "hbm_gib": run["hbm_bytes"] / GIB,
                   "fits": r.get("fits"), "compile_s": r.get("compile_s"), "command": cmd, "source": path}
            if r.get("attempts"):
                row["chunks_tried"] = {a["prefill_chunk"]: (a["fits"], (a.get("required_bytes") or 0) / GIB)
                                       for a in r["attempts"]}
            out.append(row)
    return out


def key_flags(command: str) -> str:
    """The flags of a `dsv4-aot` command that pick the row (topology, weights, batch, program, chunk, k)."""
    words, out = command.split(), []
    for i, w in enumerate(words[:-1]):
        if w in KEY_FLAGS:
            out.append(f"{w} {words[i + 1]}")
    return " ".join(out)


def table(rows: list[dict], reproduce: bool = False) -> str:
    """The Markdown table of fit rows (ordered by topology, weights, program); `reproduce` adds the flags."""
    head = "| topology | weights | program | batch | tokens / sequence | peak / HBM GiB per chip | fits |"
    lines = [head + (" reproduce |" if reproduce else ""), "|---|---|---|---|---|---|---|" + ("---|" if reproduce else "")]
    key = lambda r: (r["topology"], r["weights"], ORDER.index(r["program"]) if r["program"] in ORDER else 9)
    for r in sorted(rows, key=key):
        peak = "—" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        fits = "yes" if r["fits"] else "**no**" if r["fits"] is False else "?"
        lines.append(f"| {r['topology']} | {r['weights']} | {NAMES.get(r['program'], r['program'])} | {r['batch']} | "
                     f"{r['tokens_per_sequence']} | {peak} / {r['hbm_gib']:.2f} | {fits} |"
                     + (f" `{key_flags(r['command'])}` |" if reproduce else ""))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dsv4-aot fit-table", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", nargs="+")
    ap.add_argument("--out", default=None)
    ap.add_argument("--reproduce", action="store_true", help="add the flags that reproduce each row")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(sys.argv[2:] if argv is None else list(argv))
    rows = []
    for p in a.reports:
        with open(p) as f:
            rows += rows_of(json.load(f), p)
    print(table(rows, a.reproduce))
    for r in rows:
        if r.get("chunks_tried"):
            print(f"\n{r['topology']} {r['weights']} prefill chunks tried (tokens per sequence: fits, GiB): "
                  + ", ".join(f"{c}: {'fits' if f else 'no'} {g:.1f}" for c, (f, g) in r["chunks_tried"].items()))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0
