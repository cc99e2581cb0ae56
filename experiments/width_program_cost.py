"""What a round costs in the width scheduler's program vs the programs it replaces (issue #38), alternating
the variants in one process (ratios; this VM is noisy):

  plain     the scheduler program's plain round (MODE_PLAIN; after the switch it runs in its own loop) vs the
            `none` program (also with its state sized for verify blocks of 8, as the scheduler's is), B = 1,
            one 120-token prompt, max_len 776 (the sweep's shapes)
  width1    an MTP round verifying one draft, B = 8: in its own program, with the state sized for blocks of
            8, inside the dynamic_draft_n program (widths 1..7), inside the scheduler program (0..7 + plain)

    PYTHONPATH=. python experiments/width_program_cost.py --out OUT.json [--repeats 6] [--temperature 0.8]
Prints a table (ms per round, median [min–max] over repeats after one untimed warm-up) and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics

import jax.numpy as jnp

import dsv4_jax as d
from dsv4_jax.demo import tiny_demo
from dsv4_jax.drafters.base import MODE_PLAIN
from dsv4_jax.speculative import cost_table
from dsv4_jax.speculative.generate import prepare
from dsv4_jax.training.evaluate import heldout_prompts


def plain_variants(demo, temperature: float = 0.0) -> dict:
    """name -> callable() giving seconds per round (temperature > 0: sampled rounds)."""
    prompts = heldout_prompts(1, prompt_len=120, seed=4)
    kw = dict(eos_token_id=-1, max_len=776, pad_to=128, temperature=temperature)
    none = prepare(demo.params, demo.config, prompts, 64, **kw)
    none8 = prepare(demo.params, demo.config, prompts, 64, max_block=8, **kw)
    out = {"plain: none program": lambda: cost_table.seconds_per_round(demo.params, demo.config, none, none.knobs),
           "plain: none program, state for blocks of 8":
               lambda: cost_table.seconds_per_round(demo.params, demo.config, none8, none8.knobs)}
    for drafter in ("mtp", "dspark"):
        r = prepare(demo.params, demo.config, prompts, 64, drafter=drafter, draft_n_max="auto", draft_n_max_bound=7,
                    max_block=8, dspark_meta=demo.dspark, **kw)
        knobs = r.knobs.replace(width_mode=jnp.int32(MODE_PLAIN))
        out[f"plain: {drafter} scheduler program"] = (
            lambda r=r, knobs=knobs: cost_table.seconds_per_round(demo.params, demo.config, r, knobs))
    return out


def width1_variants(demo, temperature: float = 0.0) -> dict:
    prompts = heldout_prompts(8, prompt_len=64, seed=4)
    kw = dict(eos_token_id=-1, max_len=200, pad_to=64, drafter="mtp", draft_n_max=1, temperature=temperature)
    shapes = {"width 1: own program": {}, "width 1: state for blocks of 8": dict(max_block=8),
              "width 1: dynamic_draft_n program": dict(max_block=8, dynamic_draft_n=True),
              "width 1: scheduler program": dict(max_block=8, adaptive_widths=True)}

    def run(extra):
        _, st = d.generate(demo.params, demo.config, prompts, 64, **kw, **extra)
        return st["decode_s"] / max(1, max(st["per_sequence"]["rounds"]))   # the loop's rounds: the longest row's
    return {name: (lambda extra=extra: run(extra)) for name, extra in shapes.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--groups", default="plain,width1", help="comma-separated: plain, width1")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy rounds; > 0: sampled rounds")
    a = p.parse_args(argv)
    demo = tiny_demo()
    rows = {}
    groups = {"plain": plain_variants, "width1": width1_variants}
    for group in (groups[g](demo, a.temperature) for g in a.groups.split(",")):
        times = {name: [] for name in group}
        for rep in range(a.repeats + 1):
            for name, fn in group.items():
                t = fn()
                if rep:
                    times[name].append(t * 1e3)
        base = statistics.median(next(iter(times.values())))
        for name, v in times.items():
            rows[name] = {"ms_per_round": statistics.median(v), "min": min(v), "max": max(v),
                          "vs_first": statistics.median(v) / base}
    print(f"{'variant':40s} {'ms/round':>9s} {'[min-max]':>16s} {'vs first':>8s}")
    for name, r in rows.items():
        print(f"{name:40s} {r['ms_per_round']:9.3f} [{r['min']:6.3f}-{r['max']:6.3f}] {r['vs_first']:8.2f}x")
    with open(a.out, "w") as f:
        json.dump({"rows": rows, "repeats": a.repeats, "temperature": a.temperature}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
