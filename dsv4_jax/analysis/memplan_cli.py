"""`dsv4-memplan`: the command line of `analysis.memplan` (memory plan per device for a mesh)."""
from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Iterable


from .. import cli
from ..config import preset
from ..parallel import PRESETS as SHARDING_PRESETS, default_mesh_shape
from ..model import params as P
from .memplan import FORMATS, GIB, H200_GIB, checkpoint_table, checkpoint_unit, measure_checkpoint, plan


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dsv4-memplan",
        description="Memory plan (GiB) of a DeepSeek-V4 model from abstract shapes: weights, drafter and decode "
                    "state, in total and per device on a (data, expert, model) mesh. Nothing is allocated.",
        epilog="Example: dsv4-memplan --devices 1,8,16 --dtype bf16,quantized --batch 8 --context 32768")
    cli.add_preset(p)
    p.add_argument("--devices", type=cli.positive_ints, default=[1, 8, 16],
                   help="comma-separated device counts, one column each (default 1,8,16)")
    cli.add_mesh(p, action="append", default=None,
                 help="explicit mesh DATAxEXPERTxMODEL, e.g. 1x1x8 (repeatable; replaces --devices); default "
                      "for n devices: 1xnx1 (experts split n ways, attention data-parallel)")
    p.add_argument("--sharding", type=cli.names(SHARDING_PRESETS, "sharding preset"), default=None, metavar="PRESETS",
                   help=f"sharding presets, comma-separated from {','.join(SHARDING_PRESETS)} (dsv4_jax.parallel.PRESETS): "
                        "one column per preset and --devices count, with the preset's mesh and rules "
                        "(replaces --mesh)")
    p.add_argument("--dtype", type=cli.names(FORMATS, "weight format"), default=["bf16", "quantized"],
                   help="weight storage, comma-separated from f32,bf16,quantized (default bf16,quantized); "
                        "quantized = release FP4 experts + FP8 projections with e8m0 scales")
    p.add_argument("--batch", type=cli.positive_int, default=1, help="sequences in the decode state (default 1)")
    p.add_argument("--context", type=cli.positive_int, default=4096, help="decode-state capacity in tokens (default 4096)")
    p.add_argument("--max-block", type=cli.positive_int, default=8, help="widest verify block, k + 1 (default 8)")
    p.add_argument("--drafter", default="mtp", choices=("none", "mtp", "dspark"),
                   help="drafter weights and state to add (default mtp: one block)")
    p.add_argument("--hbm-gib", type=float, default=H200_GIB,
                   help=f"per-device memory for the fits line (default {H200_GIB}, one H200)")
    p.add_argument("--json", action="store_true", help="print the plans as JSON (bytes) instead of tables")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="a converted checkpoint: load it with keep_quantized=True (on the first --mesh, default one "
                        "device) and print the plan of its stored formats next to the bytes measured on the "
                        "device(s); --preset and --dtype are then not used")
    return p


def table(plans: list[dict], hbm_gib: float) -> str:
    """Text table of plans of one weight format: rows = parts, columns = total and per device per mesh."""
    head = ["part", "total"] + [f"{p['devices']} dev {p['sharding'] + ' ' if p.get('sharding') else ''}"
                                f"({'x'.join(str(v) for v in p['mesh'].values())})" for p in plans]
    rows = [head]
    for part in plans[0]["parts"]:
        rows.append([part, f"{plans[0]['parts'][part]['total'] / GIB:.2f}"]
                    + [f"{p['parts'][part]['per_device'] / GIB:.2f}" for p in plans])
    rows.append(["total", f"{plans[0]['total'] / GIB:.2f}"] + [f"{p['per_device'] / GIB:.2f}" for p in plans])
    rows.append([f"fits {hbm_gib:g} GiB", ""] + ["yes" if p["per_device"] / GIB <= hbm_gib else "NO" for p in plans])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    lines = [fmt(rows[0]), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows[1:]]
    return "\n".join(lines)


def main(argv: Iterable[str] | None = None) -> int:
    a = build_parser().parse_args(None if argv is None else list(argv))
    if a.checkpoint:
        m = measure_checkpoint(a.checkpoint, a.mesh[0] if a.mesh else None)
        if a.json:
            print(json.dumps(m, indent=1))
            return 0
        print(f"{m['checkpoint']}: {m['model']}, weights kept quantized ({', '.join(m['formats']) or 'none'}), "
              f"compute dtype {m['dtype']}, mesh {'x'.join(str(v) for v in m['mesh'].values())}; "
              f"{checkpoint_unit(m)[0]}")
        print(checkpoint_table(m))
        return 0
    config = preset(a.preset)
    if a.sharding:
        columns = [(n, None, name) for name in a.sharding for n in a.devices]
    else:
        columns = [(math.prod(m), m, None) for m in (a.mesh or [default_mesh_shape(n) for n in a.devices])]
    out = []
    for fmt in a.dtype:
        plans = [plan(config, devices=n, mesh_shape=m, weights=fmt, batch=a.batch, context=a.context,
                      max_block=a.max_block, drafter=a.drafter, sharding=name) for n, m, name in columns]
        out.append((fmt, plans))
    if a.json:
        print(json.dumps({fmt: plans for fmt, plans in out}, indent=1))
        return 0
    print(f"{config.name}: {P.count_params(config) / 1e9:.2f} B parameters (target); decode state for batch "
          f"{a.batch} x {a.context} tokens (max block {a.max_block}); GiB; mesh = data x expert x model")
    for fmt, plans in out:
        print(f"\nweights: {fmt}")
        print(table(plans, a.hbm_gib))
    notes = {f"{p['devices']} dev ({'x'.join(str(v) for v in p['mesh'].values())}): {n}": None
             for p in out[0][1] for n in p["notes"]}
    for n in notes:
        print(f"\nnote: {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
