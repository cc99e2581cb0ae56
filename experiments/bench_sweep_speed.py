"""Wall time and compile share of one `dsv4-sweep` run (the README's main job by default).

Runs `dsv4_jax.research.sweep.main(ARGS)` in this process and listens to JAX's compile events
(tracing, lowering, XLA compile or persistent-cache retrieval). Nested traces overlap, so the compile
time is the union of the event intervals, not their sum. Prints one JSON object (and writes it with
--json): wall_s, compile_s, compile_share, CPU seconds, the per-event sums, programs compiled (those
over 1 s: the big ones), peak RSS, load average.

    python experiments/bench_sweep_speed.py --json before.json -- --out /tmp/s1 --compile-cache /tmp/cc1
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time

import jax
from jax import monitoring

EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
          "/jax/core/compile/backend_compile_duration")


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end] intervals."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + ((cur_e - cur_s) if cur_e is not None else 0.0)


def cpu_seconds() -> float:
    """User + system CPU time of this process (less sensitive than wall time to other load on shared cores)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="also write the result here")
    p.add_argument("sweep_args", nargs=argparse.REMAINDER, help="-- then dsv4-sweep's arguments")
    a = p.parse_args(argv)
    sweep_args = a.sweep_args[1:] if a.sweep_args[:1] == ["--"] else a.sweep_args
    intervals: list[tuple[float, float]] = []
    sums = {e: 0.0 for e in EVENTS}
    counts = {e: 0 for e in EVENTS}

    durations: list[tuple[str, float]] = []

    def listener(event, duration, **_):
        if event in sums:
            end = time.perf_counter()
            intervals.append((end - duration, end))
            durations.append((event, duration))
            sums[event] += duration
            counts[event] += 1

    monitoring.register_event_duration_secs_listener(listener)
    from dsv4_jax.research import sweep       # imported after the listener so nothing escapes it
    load_before = os.getloadavg()
    t0, cpu0 = time.perf_counter(), cpu_seconds()
    rc = sweep.main(sweep_args)
    wall, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    compile_s = union_seconds(intervals)
    out = {"command": "dsv4-sweep " + " ".join(sweep_args), "rc": rc, "wall_s": round(wall, 2),
           "compile_s": round(compile_s, 2), "compile_share": round(compile_s / wall, 3),
           "cpu_s": round(cpu, 1), "big_programs": sum(1 for e, d in durations if e == EVENTS[2] and d > 1.0),
           "big_program_compile_s": [round(d, 1) for e, d in durations if e == EVENTS[2] and d > 1.0],
           "event_sums_s": {e.rsplit("/", 1)[1]: round(v, 2) for e, v in sums.items()},
           "programs_compiled_or_loaded": counts[EVENTS[2]],
           "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
           "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
           "machine": f"{platform.machine()} {os.cpu_count()} CPUs, {platform.platform()}",
           "jax": jax.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
