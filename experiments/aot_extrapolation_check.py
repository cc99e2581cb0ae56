"""How linear are XLA's costs in Flash's repeated HCA/CSA pairs? Compile the leading layers + 1..4 pairs
unrolled for a TPU topology (libtpu, small context: cheap) and compare each 2-point extrapolation
cost(n) = cost(a) + (n − a)·(cost(a+1) − cost(a)) with the compile of n pairs.

    flock /tmp/aot_heavy.lock nice -n 10 python experiments/aot_extrapolation_check.py \
        --topology v5p:2x2x2 --context 4096 --programs decode,verify --json out.json

Prints a table (program, points a / a+1, predicted n, relative error of flops / bytes accessed /
transcendentals / optimal_seconds) and writes the raw costs to --json.
"""
from __future__ import annotations

import argparse
import json
import time

from dsv4_jax import parallel
from dsv4_jax.analysis import libtpu
from dsv4_jax.analysis.aot import chips, compile as AC, extrapolate as X, inputs as I, programs as PR, runner

KEYS = ("flops", "bytes_accessed", "transcendentals", "optimal_seconds")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--topology", default="v5p:2x2x2")
    p.add_argument("--weights", default="bf16", choices=I.WEIGHTS)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--programs", default="decode,verify")
    p.add_argument("--pairs", default="1,2,3,4", help="pair counts to compile (unrolled)")
    p.add_argument("--small", action="store_true")
    p.add_argument("--json", required=True)
    a = p.parse_args()
    libtpu.set_env()
    topo = chips.parse(a.topology)
    devs = chips.devices(topo)
    mesh = parallel.make_mesh(runner.mesh_shape(len(devs)), devs)
    opts = chips.TPU_COMPILE_OPTIONS if topo.is_tpu else None
    shapes = I.Shapes(a.batch, a.context, 3, 256)
    pairs = [int(x) for x in a.pairs.split(",")]
    out = {"command": vars(a), "costs": {}, "compile_s": {}}
    t0 = time.perf_counter()
    for name in a.programs.split(","):
        out["costs"][name], out["compile_s"][name] = {}, {}
        for n in pairs:
            cfg = runner.model_config("flash", pairs=n, small=a.small, platform="tpu" if topo.is_tpu else "cpu")
            t = time.perf_counter()
            row = AC.compile_program(PR.build(name, cfg, mesh, a.weights, shapes), topo.chip, len(devs),
                                     1e15, options=opts, force=True)
            out["costs"][name][n] = row.get("cost", {})
            out["compile_s"][name][n] = time.perf_counter() - t
            print(f"[{time.perf_counter() - t0:6.0f}s] {name} pairs {n}: {row.get('cost')} "
                  f"({out['compile_s'][name][n]:.0f} s)", flush=True)
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1)
    print("\n| program | points | predicts | " + " | ".join(f"{k} rel. error" for k in KEYS) + " |")
    print("|---|---|---|" + "---|" * len(KEYS))
    rows = []
    for name, by in out["costs"].items():
        for lo in pairs:
            if lo + 1 not in by:
                continue
            for n in pairs:
                if n <= lo + 1:
                    continue
                pred = X.linear(by[lo], by[lo + 1], lo, n)
                err = {k: pred[k] / by[n][k] - 1 for k in KEYS if by[n].get(k)}
                rows.append({"program": name, "points": [lo, lo + 1], "n": n, "rel_error": err})
                print(f"| {name} | {lo}, {lo + 1} | {n} | " + " | ".join(
                    f"{err[k]:+.2e}" if k in err else "—" for k in KEYS) + " |")
    out["predictions"] = rows
    out["wall_s"] = time.perf_counter() - t0
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
