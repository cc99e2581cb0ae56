"""Where continuous batching's admission and round time go: the slot programs (`speculative.slots`) timed one by
one on the bundled model, interleaved so that a change of machine load hits every component alike.

Components (each synchronised with block_until_ready, median over --repeats interleaved passes):
    init_rows[P]        P empty prefill rows
    prefill[P]          one [P, prefill_len] prompt chunk into P rows
    insert[P]           P rows written into the B-slot carry (donated)
    admit_*             whole admissions of a refill as `SlotEngine.admit` does them (1, 2, 4, B requests
                        cycling over the suite's prompts: their mix of prompt-chunk counts)
    chunk[r]            `run_chunk` for exactly r rounds on a full carry (r = 1, 2, 8: the intercept is the
                        per-chunk cost beyond the rounds)
    chunk[8]_1_live per round  up to 8 rounds with one running slot, B - 1 finished (a static batch's
                        tail), per round run (how many: in the JSON)
    chunk[1]_after_prefill  one round right after a [B, C] prefill (caches cooled by the admission)
    refill_from_ready   a refill of one slot from a B-row buffer of prefilled requests (one insert)
    exit_fetch          what the host does at a chunk exit: the done flags, then the outputs + statistics

    JAX_PLATFORMS=cpu nice -n 5 .venv/bin/python experiments/bench_admission.py --out /tmp/unused --spec mtp \
        --draft-n-max 3 --batch-size 32 --limit 16 --ignore-eos --no-compile-cache --json /tmp/bench.json

(--out is required by the shared parser but nothing is written there; --ignore-eos keeps every chunk
running its rounds.)
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax.research import batch_eval as BE
from dsv4_jax.research.sweep import prepare_run
from dsv4_jax.speculative import slots as S


def timed(fn):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    return 1e3 * (time.perf_counter() - t)


def components(eng, prompts_n: int):
    """name -> a thunk returning what to block on; the carry is threaded through a one-element list."""
    p, cfg, opts, B = eng.params, eng.config, eng.opts, eng.batch
    C = eng.prefill_len
    box = [S.empty_carry(p, cfg, batch=B, max_len=eng.max_len, opts=opts, key=jax.random.PRNGKey(0))]
    # fill every slot once so the chunk runs on live rows
    box[0], _ = eng.admit(box[0], [(i % prompts_n, i) for i in range(B)], jax.random.PRNGKey(1))
    jax.block_until_ready(box[0])
    big = jax.tree.map(jnp.copy, box[0])       # a separate copy: insert donates box[0]
    out = {}
    toks = jnp.asarray(np.full((B, C), 5, np.int32))

    for w in eng.widths:
        def init(w=w):
            return S.init_rows(p, cfg, eng.knobs, batch=w, max_len=eng.max_len, opts=opts)

        def pre(w=w):
            rows = S.init_rows(p, cfg, eng.knobs, batch=w, max_len=eng.max_len, opts=opts)
            jax.block_until_ready(rows)
            t = time.perf_counter()
            rows = S.prefill_chunk(p, cfg, rows, toks[:w], jnp.full((w,), C, jnp.int32), toks[:w],
                                   jnp.zeros((w,), bool), 0, jax.random.PRNGKey(0), eng.knobs, opts=opts,
                                   taps=opts.taps)
            jax.block_until_ready(rows)
            return 1e3 * (time.perf_counter() - t)

        def ins(w=w):
            rows = S.init_rows(p, cfg, eng.knobs, batch=w, max_len=eng.max_len, opts=opts)
            jax.block_until_ready(rows)
            slots = jnp.full((w,), B, jnp.int32)        # dropped: the carry stays as it is
            t = time.perf_counter()
            box[0] = S.insert(box[0], rows, slots, jnp.zeros((w,), jnp.int32), opts=opts, axes=eng.carry_axes)
            jax.block_until_ready(box[0])
            return 1e3 * (time.perf_counter() - t)

        out[f"init_rows[{w}]"] = ("t", init)
        out[f"prefill[{w}]"] = ("m", pre)
        out[f"insert[{w}]"] = ("m", ins)
    for n in sorted({1, 2, 4, B}):
        def admit(n=n):
            group = [((j * 5) % prompts_n, B) for j in range(n)]      # slot B: dropped, carry unchanged
            t = time.perf_counter()
            box[0], calls = eng.admit(box[0], group, jax.random.PRNGKey(2))
            jax.block_until_ready(box[0])
            return 1e3 * (time.perf_counter() - t)
        out[f"admit_{n}req"] = ("m", admit)
    for r in (1, 2, 8):
        def chunk(r=r):
            c = jax.tree.map(jnp.copy, big)            # same live state each time (not donated away)
            jax.block_until_ready(c)
            t = time.perf_counter()
            c = S.run_chunk(p, cfg, c, eng.knobs, jnp.int32(r), jnp.int32(B + 1), opts=opts)
            jax.block_until_ready(c)
            dt = 1e3 * (time.perf_counter() - t)
            assert int(c.round) - int(big.round) == r, "a chunk ended early (run with --ignore-eos)"
            return dt
        out[f"chunk[{r}]"] = ("m", chunk)

    def chunk_one_live():
        """8 rounds with one running slot and B - 1 finished ones (a static batch's tail)."""
        c = jax.tree.map(jnp.copy, big)
        c = c.replace(done=jnp.arange(B) > 0)
        jax.block_until_ready(c)
        t = time.perf_counter()
        c = S.run_chunk(p, cfg, c, eng.knobs, jnp.int32(8), jnp.int32(B + 1), opts=opts)
        jax.block_until_ready(c)
        ran = int(c.round) - int(big.round)
        return 1e3 * (time.perf_counter() - t) / ran, ran
    out["chunk[8]_1_live per round"] = ("m", chunk_one_live)

    def chunk_after_prefill():
        """One round right after a [B, C] prefill call (the admission's memory traffic in between)."""
        c = jax.tree.map(jnp.copy, big)
        rows = S.init_rows(p, cfg, eng.knobs, batch=B, max_len=eng.max_len, opts=opts)
        rows = S.prefill_chunk(p, cfg, rows, toks, jnp.full((B,), C, jnp.int32), toks, jnp.zeros((B,), bool), 0,
                               jax.random.PRNGKey(0), eng.knobs, opts=opts, taps=opts.taps)
        jax.block_until_ready((c, rows))
        t = time.perf_counter()
        c = S.run_chunk(p, cfg, c, eng.knobs, jnp.int32(1), jnp.int32(B + 1), opts=opts)
        jax.block_until_ready(c)
        return 1e3 * (time.perf_counter() - t)
    out["chunk[1]_after_prefill"] = ("m", chunk_after_prefill)

    def refill_from_ready():
        """A continuous refill of one slot from a B-row ready buffer (prefill ahead): one insert."""
        rows = S.init_rows(p, cfg, eng.knobs, batch=B, max_len=eng.max_len, opts=opts)
        jax.block_until_ready(rows)
        slots = np.full((B,), B, np.int32)
        t = time.perf_counter()
        box[0] = S.insert(box[0], rows, jnp.asarray(slots), jnp.zeros((B,), jnp.int32), opts=opts,
                          axes=eng.carry_axes)
        jax.block_until_ready(box[0])
        return 1e3 * (time.perf_counter() - t)
    out["refill_from_ready"] = ("m", refill_from_ready)

    def fetch():
        c = box[0]
        t = time.perf_counter()
        np.asarray(c.done)
        jax.device_get((c.out, c.out_len, c.stats))
        return 1e3 * (time.perf_counter() - t)
    out["exit_fetch"] = ("m", fetch)
    return out


def main(argv=None) -> int:
    parser = BE.build_parser()
    parser.add_argument("--bench-repeats", type=int, default=5)
    parser.add_argument("--json", default=None, help="write the medians here")
    a = parser.parse_args(argv)
    (settings, ks), model, notes, suite, prompts, _ = prepare_run(
        parser, a, BE.parse_settings, lambda g: (sorted({s.spec for s in g[0]}), g[1]))
    prompts = BE.cycle_to(prompts, a.limit or len(prompts))
    budgets = [256] * len(prompts)
    report = {}
    for s in settings:
        eng = BE.build_engine(model, prompts, budgets, s, a)
        t = eng.warm_up()
        chunks = [-(-len(pr["tokens"]) // eng.prefill_len) for pr in prompts]
        print(f"{s.label}: warm-up {t:.1f} s, prompt chunks {chunks}", file=sys.stderr)
        comps = components(eng, len(prompts))
        samples = {k: [] for k in comps}
        for _ in range(a.bench_repeats):
            for name, (kind, fn) in comps.items():
                got = timed(fn) if kind == "t" else fn()
                if isinstance(got, tuple):
                    got, extra = got
                    samples.setdefault(name + " (rounds run)", []).append(extra)
                samples[name].append(got)
        med = {k: statistics.median(v) for k, v in samples.items()}
        report[s.label] = {"median_ms": med, "samples_ms": samples}
        print(f"\n{s.label} (median of {a.bench_repeats}, ms)")
        for k, v in med.items():
            print(f"  {k:<16} {v:9.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"argv": sys.argv, "report": report}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
