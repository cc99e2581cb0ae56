"""Per-round cost of the slot engine's decode chunk (`slots.run_chunk`) with and without the width scheduler
(issue #38), alternating the variants in one process (ratios; this VM is noisy):

  none            plain decoding's engine
  mtp k=1         the MTP engine compiled for one draft per round
  k=1, blocks 8   --ring: the same with its decode state sized for verify blocks of 8 (as the auto engine's is:
                  window rings 6 rows longer)
  auto, fixed 1   the MTP engine with draft_n_max="auto" (bound 7), MODE_FIXED at width 1
  auto -> 1       the same engine, MODE_AUTO priced by a table under which width 1 pays best (the B = 8 engine's
                  measured table of the third run, widths >= 2 priced out), so it chooses width 1
  auto<=K, fixed 1 --bounds K,..: the scheduler engine holding widths 0..K only (what the bound costs)
  (lax.switch)    --switch: the last two again, the round's width selected by `lax.switch` as before the fourth
                  run (`ops.branch.switch_in_place` replaced while those programs trace and run; their engine is
                  built with one more token of budget so that its program is a separate compilation)

B = 8 slots filled once (8 prompts of 64 tokens, budgets longer than the chunk), then one chunk of --rounds
rounds timed per repeat on a copy of that carry (no finishes, no refills): ms per round and per committed token.

    PYTHONPATH=. python experiments/engine_round_cost.py --out OUT.json [--repeats 7] [--rounds 32] [--switch] [--ring] [--bounds 1,3]
Prints a table (median [min-max] over repeats after one untimed warm-up; ratios: median over repeats of the
per-repeat ratio to `none` and to `mtp k=1`) and writes JSON (with every repeat's ms per round).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp

from dsv4_jax.demo import tiny_demo
from dsv4_jax.drafters.base import MODE_FIXED
from dsv4_jax.ops import branch
from dsv4_jax.speculative import slots as S
from dsv4_jax.speculative.cost_table import CostTable
from dsv4_jax.speculative.scheduler import SlotEngine
from dsv4_jax.training.evaluate import heldout_prompts

B = 8
# the B = 8 MTP engine's measured table (third run, ms): plain 4.31, widths 0..1 4.77, 6.98; widths >= 2 priced out
TABLE = CostTable(seconds=(4.77e-3, 6.98e-3) + (1.0,) * 6, plain_seconds=4.31e-3, drafter="mtp", batch=B)


@contextlib.contextmanager
def lax_switch():
    """The width selected by a plain `lax.switch` (the structure before the fourth run) while tracing / running."""
    saved = branch.switch_in_place
    branch.switch_in_place = lambda index, branches, state: jax.lax.switch(index, branches, state)
    try:
        yield
    finally:
        branch.switch_in_place = saved


def engines(demo, switch: bool, ring: bool, bounds=()) -> dict:
    """name -> (engine, knobs, context the chunk runs in)."""
    prompts = heldout_prompts(B, prompt_len=64, seed=4)
    kw = dict(batch=B, eos_token_id=-1)
    none = SlotEngine.build(demo.params, demo.config, prompts, max_new_tokens=400, **kw)
    k1 = SlotEngine.build(demo.params, demo.config, prompts, max_new_tokens=400, drafter="mtp", draft_n_max=1, **kw)
    out = {"none": (none, none.knobs, contextlib.nullcontext), "mtp k=1": (k1, k1.knobs, contextlib.nullcontext)}
    if ring:
        k1r = SlotEngine.build(demo.params, demo.config, prompts, max_new_tokens=400, drafter="mtp", draft_n_max=1,
                               max_block=8, **kw)
        out["k=1, blocks 8"] = (k1r, k1r.knobs, contextlib.nullcontext)
    for budget, ctx, tag in ((400, contextlib.nullcontext, ""), (401, lax_switch, " (lax.switch)"))[:1 + switch]:
        auto = SlotEngine.build(demo.params, demo.config, prompts, max_new_tokens=budget, drafter="mtp",
                                draft_n_max="auto", draft_n_max_bound=7, **kw)
        auto.priced(TABLE)
        fixed = auto.knobs.replace(width_mode=jnp.int32(MODE_FIXED), draft_n=jnp.int32(1))
        out.update({f"auto, fixed 1{tag}": (auto, fixed, ctx), f"auto -> 1{tag}": (auto, auto.knobs, ctx)})
    for bound in bounds:          # the same scheduler program holding fewer widths (0..bound): what K costs
        small = SlotEngine.build(demo.params, demo.config, prompts, max_new_tokens=400, drafter="mtp",
                                 draft_n_max="auto", draft_n_max_bound=bound, **kw)
        small.priced(TABLE)
        fixed = small.knobs.replace(width_mode=jnp.int32(MODE_FIXED), draft_n=jnp.int32(1))
        out[f"auto<={bound}, fixed 1"] = (small, fixed, contextlib.nullcontext)
    return out


def filled(engine: SlotEngine):
    carry = S.empty_carry(engine.params, engine.config, batch=B, max_len=engine.max_len, opts=engine.opts,
                          key=jax.random.PRNGKey(1))
    carry, _ = engine.admit(carry, [(i, i) for i in range(B)], jax.random.PRNGKey(2))
    return jax.block_until_ready(carry)


def timed_chunk(engine: SlotEngine, knobs, base, rounds: int) -> tuple[float, float, int, int, object]:
    """(wall seconds, process CPU seconds, rounds run, tokens committed, final carry) of one chunk from a copy of
    base. CPU time (all of the process's threads) is the steadier measure on a host shared with other work."""
    c = jax.block_until_ready(jax.tree.map(jnp.copy, base))
    t0, p0 = time.perf_counter(), time.process_time()
    c = jax.block_until_ready(S.run_chunk(engine.params, engine.config, c, knobs, jnp.int32(rounds),
                                          jnp.int32(B + 1), opts=engine.opts))
    dt, cpu = time.perf_counter() - t0, time.process_time() - p0
    return dt, cpu, int(c.round - base.round), int(jnp.sum(c.out_len - base.out_len)), c


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--rounds", type=int, default=32)
    p.add_argument("--switch", action="store_true", help="also the auto variants with the width in a lax.switch")
    p.add_argument("--ring", action="store_true", help="also the k=1 engine with its state sized for blocks of 8")
    p.add_argument("--bounds", default="", help="comma list: also auto engines of these bounds (fixed at width 1)")
    a = p.parse_args(argv)
    load0 = os.getloadavg()
    demo = tiny_demo()
    variants = engines(demo, a.switch, a.ring, tuple(int(b) for b in a.bounds.split(",") if b))
    bases = {name: filled(e) for name, (e, _, _) in variants.items()}
    ms, cpu_ms, per_tok = ({n: [] for n in variants} for _ in range(3))
    info = {}
    for rep in range(a.repeats + 1):
        for name, (e, knobs, ctx) in variants.items():
            with ctx():
                dt, cpu, rounds, toks, c = timed_chunk(e, knobs, bases[name], a.rounds)
            if rep:
                ms[name].append(dt * 1e3 / rounds)
                cpu_ms[name].append(cpu * 1e3 / rounds)
                per_tok[name].append(dt * 1e3 / toks)
            hist = None if c.stats.width_hist is None else jnp.sum(c.stats.width_hist, 0).tolist()
            info[name] = {"rounds": rounds, "tokens": toks, "width_hist": hist}
    first = next(iter(variants))
    ratio = lambda name, to, t=ms: statistics.median(x / y for x, y in zip(t[name], t[to]))
    rows = {}
    for name in variants:
        rows[name] = {"ms_per_round": statistics.median(ms[name]), "min": min(ms[name]), "max": max(ms[name]),
                      "ms_per_token": statistics.median(per_tok[name]), "round_vs_first": ratio(name, first),
                      "round_vs_k1": ratio(name, "mtp k=1"), "ms_per_round_repeats": ms[name],
                      "cpu_ms_per_round": statistics.median(cpu_ms[name]), "cpu_vs_k1": ratio(name, "mtp k=1", cpu_ms),
                      "cpu_ms_per_round_repeats": cpu_ms[name], **info[name]}
    print(f"{'variant':28s} {'ms/round':>9s} {'[min-max]':>16s} {'vs none':>8s} {'vs k=1':>7s} {'cpu ms':>7s} "
          f"{'vs k=1':>7s} {'ms/token':>9s}  tokens/round")
    for name, r in rows.items():
        print(f"{name:28s} {r['ms_per_round']:9.3f} [{r['min']:6.3f}-{r['max']:6.3f}] {r['round_vs_first']:7.2f}x "
              f"{r['round_vs_k1']:6.3f}x {r['cpu_ms_per_round']:7.3f} {r['cpu_vs_k1']:6.3f}x {r['ms_per_token']:9.3f}  "
              f"{r['tokens'] / r['rounds']:.2f}  widths {r['width_hist']}")
    with open(a.out, "w") as f:
        json.dump({"rows": rows, "repeats": a.repeats, "rounds": a.rounds, "switch": a.switch, "ring": a.ring,
                   "loadavg_start": load0, "loadavg_end": os.getloadavg()}, f, indent=1)
    print("load average at start", load0, "at end", os.getloadavg())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
