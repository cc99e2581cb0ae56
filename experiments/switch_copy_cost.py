"""What selecting a branch costs when the branches update a large state (issue #38, docs/width_scheduler.md §1):
a `while` loop of --iters iterations whose body writes one element of an f32 carry of --mb megabytes,

  no switch        the write alone
  lax.switch       the write inside a 3-branch `lax.switch` (an XLA conditional: the state is copied)
  switch, scalar   the switch returns a scalar, the write is outside it
  switch, read     the branches read the state, the write is outside
  switch_in_place  the write inside `ops.branch.switch_in_place` (one at-most-once while loop per branch)

Variants alternated over --repeats; prints µs per iteration (median [min-max]) and the number of state-sized
copies in each compiled program, and writes JSON.

    PYTHONPATH=. python experiments/switch_copy_cost.py --out OUT.json [--mb 2.5] [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp

from dsv4_jax.ops.branch import switch_in_place


def variants(n: int) -> dict:
    """name -> while-loop body over (state [n], i)."""
    write = lambda x, i, v: x.at[i % 1000].add(v)
    writers = lambda i: [lambda x, w=w: write(x, i, float(w + 1)) for w in range(3)]
    return {
        "no switch": lambda c: (write(c[0], c[1], 1.0), c[1] + 1),
        "lax.switch": lambda c: (jax.lax.switch(c[1] % 1, writers(c[1]), c[0]), c[1] + 1),
        "switch, scalar": lambda c: (write(c[0], c[1], jax.lax.switch(c[1] % 1, [lambda w=w: jnp.float32(w + 1)
                                                                                   for w in range(3)])), c[1] + 1),
        "switch, read": lambda c: (write(c[0], c[1], jax.lax.switch(c[1] % 1, [lambda x, w=w: x[c[1] % 1000] + w
                                                                              for w in range(3)], c[0])), c[1] + 1),
        "switch_in_place": lambda c: (switch_in_place(c[1] % 1, writers(c[1]), c[0]), c[1] + 1),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--mb", type=float, default=2.5)
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    n = int(a.mb * 1e6 / 4)
    x = jnp.zeros((n,), jnp.float32)
    progs, copies = {}, {}
    for name, body in variants(n).items():
        f = jax.jit(lambda x, body=body: jax.lax.while_loop(lambda c: c[1] < a.iters, body, (x, 0))[0])
        hlo = f.lower(x).compile().as_text()
        copies[name] = sum(f"f32[{n}]" in line and " copy(" in line for line in hlo.splitlines())
        progs[name] = f
        f(x).block_until_ready()
    times = {name: [] for name in progs}
    for _ in range(a.repeats):
        for name, f in progs.items():
            t0 = time.perf_counter()
            f(x).block_until_ready()
            times[name].append((time.perf_counter() - t0) / a.iters * 1e6)
    rows = {name: {"us_per_iter": statistics.median(v), "min": min(v), "max": max(v), "state_copies": copies[name]}
            for name, v in times.items()}
    print(f"{'variant':16s} {'µs/iter':>9s} {'[min-max]':>20s} {'copies':>6s}   (state {a.mb} MB)")
    for name, r in rows.items():
        print(f"{name:16s} {r['us_per_iter']:9.2f} [{r['min']:8.2f}-{r['max']:8.2f}] {r['state_copies']:6d}")
    with open(a.out, "w") as f:
        json.dump({"rows": rows, "mb": a.mb, "iters": a.iters, "repeats": a.repeats, "loadavg": os.getloadavg()},
                  f, indent=1)
    print("load average", os.getloadavg())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
