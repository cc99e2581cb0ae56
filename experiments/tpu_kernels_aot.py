"""Compile the Pallas TPU (Mosaic) kernels ahead of time for TPU topologies, on this CPU machine (libtpu).

For each topology and case (`dsv4_jax.analysis.kernels_aot.default_cases`: MoE decode T=8 and prefill T=2048 in
bf16 / int8 per-channel / FP8 e4m3 128-block / FP4 e2m1 release formats, the indexer at 1M context and at a
prefill chunk): compile time, per-chip argument / temp bytes, the bytes the kernels' BlockSpecs move for a
concrete routing next to the ideal bytes, and XLA's cost-analysis bytes of the reference (ops.moe /
ops.indexer) compiled for the same chip. Prints a table, writes JSON (every operand) and markdown.

  python experiments/tpu_kernels_aot.py --topology v5p:2x2x1 --topology v6e:2x2 \\
      --out experiments/results/tpu_kernels_aot_<date>.json
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")       # no TPU here: compile only, for libtpu's abstract chips

import argparse  # noqa: E402
import datetime  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402

from dsv4_jax.analysis import libtpu  # noqa: E402
from dsv4_jax.analysis import kernels_aot as tpu_aot  # noqa: E402

MiB = 2 ** 20


def _scenario(rec: dict) -> tuple[str, dict]:
    bs = rec["blockspec_bytes"]
    key = "random" if "random" in bs else next(iter(bs))
    return key, bs[key]


def row(rec: dict) -> list[str]:
    kind, bs = _scenario(rec)
    k = rec.get("compiled", {})
    ref = rec.get("reference", {})
    return [rec["topology"], rec["case"], "ok" if rec["compile_ok"] else "FAIL",
            f"{rec.get('compile_s', float('nan')):.1f}", f"{k.get('argument_bytes', 0) / MiB:.0f}",
            f"{k.get('temp_bytes', 0) / MiB:.1f}", f"{bs['total'] / MiB:.1f}", f"{bs['ideal'] / MiB:.1f}",
            f"{k.get('xla_bytes_accessed', float('nan')) / MiB:.1f}",
            f"{ref.get('xla_bytes_accessed', float('nan')) / MiB:.1f}", f"{ref.get('temp_bytes', 0) / MiB:.1f}",
            kind]


HEADER = ["topology", "case", "compile", "compile s", "args MiB", "temp MiB", "BlockSpec MiB", "ideal MiB",
          "kernel prog. XLA MiB", "ref XLA MiB", "ref temp MiB", "routing / fill"]


def markdown(records: list[dict]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row(r)) + " |" for r in records]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--topology", action="append", help="libtpu topology name (repeatable); default v5p:2x2x1, "
                                                        "v6e:2x2")
    ap.add_argument("--case", action="append", help="only cases whose name contains this (repeatable)")
    ap.add_argument("--no-reference", action="store_true", help="skip the XLA reference compiles")
    ap.add_argument("--out", help="JSON path (a .md with the table is written next to it)")
    args = ap.parse_args(argv)
    if not libtpu.available():
        sys.exit("libtpu is not installed: pip install libtpu (the version matching jax) to compile for TPU")
    topologies = args.topology or ["v5p:2x2x1", "v6e:2x2"]
    cases = [c for c in tpu_aot.default_cases() if not args.case or any(s in c.name for s in args.case)]
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "host": platform.node(),
            "cpus": os.cpu_count(), "jax": jax.__version__, "libtpu": importlib.metadata.version("libtpu"),
            "command": "python " + " ".join(sys.argv), "shapes": tpu_aot.FLASH.__dict__}
    print(json.dumps(meta), flush=True)
    records = []
    for topo in topologies:
        def log(rec):
            print(" | ".join(row(rec)) + ("" if rec["compile_ok"] else "  " + rec["error"]), flush=True)
        records += tpu_aot.run(topo, cases, reference=not args.no_reference, log=log)
    table = markdown(records)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "records": records}, f, indent=1)
        with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
            f.write(f"# TPU kernels ahead-of-time compile — {meta['date'][:10]}\n\n"
                    f"- command: `{meta['command']}`\n- machine: {meta['host']}, {meta['cpus']} CPUs, no TPU; jax "
                    f"{meta['jax']}, libtpu {meta['libtpu']}\n\n{table}\n")
    return 0 if all(r["compile_ok"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
