"""Where the default sweep's compile time goes, program by program, and what XLA compiler options change.

Builds the programs the README's main job (`dsv4-sweep --out DIR`, the bundled tiny model) compiles —
the two prefill buckets, the primings, the `none` loop and the drafter-pool loops k = 1..3 — and times
each stage apart (tracing, lowering to StableHLO, XLA compile) for every variant of compiler options
given, then runs each compiled loop (same inputs) and times it, so compile seconds and decode ms per
round are compared in the same run; tokens and statistics must be identical across variants.

    python experiments/bench_compile_programs.py --json out.json --variant default= \
        --variant noexp=xla_llvm_disable_expensive_passes:true

No persistent compile cache is used (every compile is a cold one). CPU seconds beside wall.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax.research import models, prompts as P, runner
from dsv4_jax.research.runner import BASELINE, Setting
from dsv4_jax.speculative import generate as G, prefill as F
from dsv4_jax.speculative import loop as L
from dsv4_jax.speculative import precompile as PC
from dsv4_jax.speculative.options import RunShape, Sampling, Speculation


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def timed(fn):
    t0, c0 = time.perf_counter(), cpu_s()
    out = fn()
    return out, time.perf_counter() - t0, cpu_s() - c0


def parse_variant(text: str) -> tuple[str, dict]:
    """'name=opt:val,opt:val' -> (name, {opt: val}) (values: true/false/int/float/str)."""
    name, _, rest = text.partition("=")
    opts = {}
    for part in filter(None, rest.split(",")):
        k, _, v = part.partition(":")
        low = v.lower()
        opts[k] = True if low == "true" else False if low == "false" else int(v) if v.lstrip("-").isdigit() else v
    return name, opts


def default_plan(model, whole_prefill: bool = False, shared_widths: bool = False):
    """The prompts and plan of the README's main job (the sweep's defaults; whole_prefill: one prefill
    program per bucket, as before `RunShape.prefill_chunk`; shared_widths: one pool loop for every
    draft_n_max, `RunShape.dynamic_draft_n`)."""
    data = P.load_suite(model.default_suite)
    chosen = P.select(data["prompts"], None, 1, None)
    prompts = P.tokenize(chosen, model.encode, model.config.vocab_size, "{prompt}")
    settings = runner.grid_settings(["none", "mtp", "dspark"], [1, 2, 3], {"p_min": [0.0], "confidence_threshold": [0.0]},
                                    [0.0], [1])
    max_draft = max(runner.effective_draft_n_max(s, model) for s in settings)
    buckets, max_len = runner.plan_shapes([len(p["tokens"]) for p in prompts], data["max_new_tokens"], max_draft, 2)
    pool = runner.pool_for(model, ["mtp", "dspark"], 3)
    plan = runner.RunPlan(max_new_tokens=data["max_new_tokens"], buckets=buckets, max_len=max_len,
                          max_block=max_draft + 1, drafter_pool=pool, seed=42, dynamic_draft_n=shared_widths,
                          prefill_chunk=min(buckets) if len(buckets) > 1 and not whole_prefill else None)
    return prompts, plan


def prepared(model, plan, batch, setting):
    pad_to = plan.pad_for([len(p["tokens"]) for p in batch])
    return G.prepare(model.params, model.bundle, [p["tokens"] for p in batch], plan.max_new_tokens,
                     sampling=Sampling(temperature=setting.temperature, seed=plan.seed),
                     speculation=Speculation(drafter=setting.drafter, draft_n_max=max(setting.draft_n_max, 1)),
                     run=RunShape(max_len=plan.max_len, pad_to=pad_to, max_block=plan.max_block,
                                  drafter_pool=plan.drafter_pool, prefill_chunk=plan.prefill_chunk,
                                  dynamic_draft_n=plan.dynamic_draft_n))


def stages(jitted, args, kwargs, options):
    """(compiled, {trace_s, lower_s, compile_s, compile_cpu_s})."""
    traced, t_trace, _ = timed(lambda: jitted.trace(*args, **kwargs))
    lowered, t_lower, _ = timed(traced.lower)
    compiled, t_comp, c_comp = timed(lambda: lowered.compile(compiler_options=options or None))
    return compiled, {"trace_s": round(t_trace, 2), "lower_s": round(t_lower, 2), "compile_s": round(t_comp, 2),
                      "compile_cpu_s": round(c_comp, 2)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", action="append", default=[], help="name=opt:val,... (XLA compiler options)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs of each compiled loop")
    p.add_argument("--only", default="", help="comma-separated program names to build (default all)")
    p.add_argument("--whole-prefill", action="store_true", help="one prefill program per bucket (no chunks)")
    p.add_argument("--shared-draft-widths", action="store_true",
                   help="one pool loop for k = 1..3 (RunShape.dynamic_draft_n), run at each k")
    p.add_argument("--json")
    a = p.parse_args(argv)
    variants = [parse_variant(v) for v in (a.variant or ["default="])]
    only = set(filter(None, a.only.split(",")))
    model = models.bundled()
    prompts, plan = default_plan(model, a.whole_prefill, a.shared_draft_widths)
    by_bucket = {}
    for q in prompts:
        by_bucket.setdefault(plan.pad_for([len(q["tokens"])]), [q])
    long_prompt = by_bucket[max(by_bucket)]
    params = model.params
    key = jax.random.PRNGKey(plan.seed)
    jobs = []   # (name, jitted, args, kwargs, is_loop, r)
    seen = set()
    for bucket, batch in sorted(by_bucket.items()):
        for spec in ("none", "mtp"):
            rr = prepared(model, plan, batch, Setting(spec, 0 if spec == BASELINE else 1))
            for prog in PC.programs(params, rr)[:-1]:            # the prefill's and priming's (the loops below)
                if prog.key() in seen:
                    continue
                seen.add(prog.key())
                width = {F.prefill_piece: 3, F.prime_piece: 6}.get(prog.fn)
                width = prog.args[width].shape[1] if width is not None else bucket
                drafter = 'none' if spec == BASELINE else 'pool'
                name = {F.prime: f"prime_{drafter}_{width}", F.start_carry: f"start_carry_{drafter}",
                        F.prime_piece: f"prime_piece_{drafter}_{width}", F.init_rows: f"init_rows_{drafter}",
                        F.prefill_piece: f"prefill_piece_{width}", F.prefill_target: f"prefill_{width}"}[prog.fn]
                jobs.append((name, prog.fn, prog.args, prog.kwargs, None))
    for spec, k in (("none", 0), ("mtp", 1), ("mtp", 2), ("mtp", 3)):
        r = prepared(model, plan, long_prompt, Setting(spec, k))
        carry = jax.eval_shape(lambda pa, t, n, kn, ky: G.start(pa, r.config, t, n, max_len=r.max_len, opts=r.opts,
                                                                knobs=kn, key=ky, max_block=r.max_block,
                                                                prefill_taps=r.prefill_taps),
                               params, jnp.asarray(r.tokens), jnp.asarray(r.lengths), r.knobs, key)
        name = "loop_none" if spec == BASELINE else f"loop_pool_k{k}"
        if plan.dynamic_draft_n and k > 1:        # the k = 1 loop program serves k = 2, 3: runs only
            name = f"loop_pool_shared_k{k}"
        jobs.append((name, L.run_rounds, (params, r.config, carry, r.knobs), dict(opts=r.opts), r))
    if only:
        jobs = [j for j in jobs if j[0] in only]
    rows = []
    for vname, options in variants:
        pool_loop = None      # the shared-widths pool loop, compiled once for k = 1..3
        for name, jitted, args, kwargs, r in jobs:
            if "shared" in name and pool_loop is not None:
                compiled, t = pool_loop, {}
            else:
                compiled, t = stages(jitted, args, kwargs, options)
            if plan.dynamic_draft_n and name.startswith("loop_pool"):
                pool_loop = compiled
            row = {"variant": vname, "program": name, **t}
            if r is not None:        # a loop: run it on fresh copies of the carry, time the rounds
                carry = G.start(params, r.config, jnp.asarray(r.tokens), jnp.asarray(r.lengths), max_len=r.max_len,
                                opts=r.opts, knobs=r.knobs, key=key, max_block=r.max_block,
                                prefill_taps=r.prefill_taps)
                walls, out = [], None
                for _ in range(a.repeats + 1):
                    fresh = jax.tree.map(jnp.copy, carry)
                    t0 = time.perf_counter()
                    res = jax.block_until_ready(compiled(args[0], fresh, r.knobs))
                    walls.append(time.perf_counter() - t0)
                    out = res
                rounds = int(out.round)
                row.update(rounds=rounds, ms_per_round=round(1e3 * statistics.median(walls[1:]) / rounds, 3),
                           ms_per_round_min=round(1e3 * min(walls[1:]) / rounds, 3),
                           tokens_digest=int(np.asarray(out.out).astype(np.int64).sum()),
                           accepted=int(np.asarray(out.stats.accepted).sum()))
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "loadavg": os.getloadavg(),
              "variants": dict(variants), "rows": rows}
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
