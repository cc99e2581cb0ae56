"""The reference routed-expert paths on the CPU backend, at the bundled model's expert shapes: why
`ops.moe.experts_sorted` runs expert-pure row tiles (`experts_tiled`) when compiled for CPU.

XLA:CPU has no grouped matmul: JAX lowers `lax.ragged_dot` there densely (every row against every
group's matrix, `lax._ragged_dot_general_impl`), E× the assigned work. Variants, interleaved per
repeat, one jit each (median ms over --repeats calls, compile seconds of the first call; every output
checked against `ragged`):

    ragged     `ops.moe.experts_ragged`: sort + one ragged_dot per matrix (what TPU / GPU programs run)
    tiled      `ops.moe.experts_tiled`: the assignments sorted into expert-pure tiles, one expert per tile
    gather     `ops.moe.experts_gather`: each assignment's expert weights gathered (the few-token path)
    all        every expert on every token, weighted by the gates (no sort; E/k× the assigned work)

T = tokens of one call: 32 = a decode round at B = 32, 128 = an MTP k = 3 verify at B = 32, 2048 = a
[32, 64] prefill chunk (the batch evaluation's admission).

    JAX_PLATFORMS=cpu python experiments/bench_moe_cpu.py --json OUT.json
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import jax
import jax.numpy as jnp

from dsv4_jax.demo import tiny_demo
from dsv4_jax.ops import moe as M


def all_experts(x, idx, w, w1, w2, w3, limit):
    """Every expert on every token, gate-weighted: x [T,D] -> [T,D]."""
    T, E = x.shape[0], w1.shape[0]
    gate = jnp.zeros((T, E), jnp.float32).at[jnp.arange(T)[:, None], idx].add(w.astype(jnp.float32))
    g, u = jnp.einsum("td,eid->tei", x, w1), jnp.einsum("td,eid->tei", x, w3)
    y = jnp.einsum("tei,edi->ted", M.swiglu(g, u, limit), w2)
    return jnp.einsum("ted,te->td", y.astype(jnp.float32), gate).astype(x.dtype)


VARIANTS = {"ragged": M.experts_ragged, "tiled": M.experts_tiled, "gather": M.experts_gather, "all": all_experts}
GATHER_MAX_T = 128          # gathering T·k expert matrices beyond this is pointless


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="32,128,2048", help="comma-separated T values (default 32,128,2048)")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--json", default=None, help="write the rows here")
    a = ap.parse_args(argv)
    demo = tiny_demo()
    cfg = demo.config
    e = demo.params["segments"][1][0]["ffn"]["experts"]      # a stacked CSA layer's experts, its first rep
    w1, w2, w3 = (jnp.asarray(e[n][0], jnp.float32) for n in ("w1", "w2", "w3"))
    E, k, D = w1.shape[0], cfg.num_experts_per_tok, w1.shape[2]
    rows = []
    for T in (int(t) for t in a.tokens.split(",")):
        ks = jax.random.split(jax.random.PRNGKey(T), 3)
        x = jax.random.normal(ks[0], (T, D))
        idx = jnp.argsort(jax.random.uniform(ks[1], (T, E)), -1)[:, :k].astype(jnp.int32)
        w = jax.random.uniform(ks[2], (T, k), minval=0.1)
        names = [n for n in VARIANTS if n != "gather" or T <= GATHER_MAX_T]
        fns, compile_s, outs = {}, {}, {}
        for n in names:
            fns[n] = jax.jit(lambda x, idx, w, f=VARIANTS[n]: f(x, idx, w, w1, w2, w3, cfg.swiglu_limit))
            t = time.perf_counter()
            outs[n] = jax.block_until_ready(fns[n](x, idx, w))
            compile_s[n] = time.perf_counter() - t
        times = {n: [] for n in names}
        for _ in range(a.repeats):
            for n in names:
                t = time.perf_counter()
                jax.block_until_ready(fns[n](x, idx, w))
                times[n].append(1e3 * (time.perf_counter() - t))
        base = statistics.median(times["ragged"])
        for n in names:
            ms = statistics.median(times[n])
            rows.append({"T": T, "variant": n, "ms": ms, "vs_ragged": ms / base, "compile_s": compile_s[n],
                         "max_abs_diff": float(jnp.abs(outs[n] - outs["ragged"]).max()), "all_ms": times[n]})
    print(f"{'T':>5} {'variant':8} {'ms':>9} {'vs ragged':>9} {'compile s':>9} {'max |diff|':>10}")
    for r in rows:
        print(f"{r['T']:>5} {r['variant']:8} {r['ms']:9.3f} {r['vs_ragged']:9.2f} {r['compile_s']:9.2f} "
              f"{r['max_abs_diff']:10.1e}")
    if a.json:
        meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": platform.processor() or platform.machine(),
                "jax": jax.__version__, "backend": jax.default_backend(), "E": E, "k": k, "D": D,
                "I": int(w1.shape[1]), "repeats": a.repeats}
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
