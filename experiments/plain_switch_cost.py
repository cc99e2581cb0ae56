"""Plain-round cost of the MTP scheduler program (MODE_PLAIN, B = 1, the sweep's shapes) with its width switch as
`ops.branch.switch_in_place` vs `lax.switch`, beside the `none` program, alternating in one process (issue #38).
`none` and the switch_in_place program are each also compiled a second time ("again": 66 new tokens, a distinct
jit entry of the same code), so that a gap between two switches can be told from one between two compilations:

    PYTHONPATH=. python experiments/plain_switch_cost.py --out OUT.json
Prints ms per round (median of 7 after one untimed warm-up) and the paired median ratio to `none`; writes JSON.
"""
import argparse
import contextlib
import json
import statistics

import jax
import jax.numpy as jnp

from dsv4_jax.demo import tiny_demo
from dsv4_jax.drafters.base import MODE_PLAIN
from dsv4_jax.ops import branch
from dsv4_jax.speculative import cost_table
from dsv4_jax.speculative.generate import prepare
from dsv4_jax.training.evaluate import heldout_prompts
p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--out", required=True)
out = p.parse_args().out
demo = tiny_demo()
prompts = heldout_prompts(1, prompt_len=120, seed=4)
kw = dict(eos_token_id=-1, max_len=776, pad_to=128)
auto = dict(drafter="mtp", draft_n_max="auto", draft_n_max_bound=7, max_block=8, **kw)
# distinct jit entries by their new-token counts: the "again" runs compile the same code a second time
none, none2 = (prepare(demo.params, demo.config, prompts, n, **kw) for n in (64, 66))
mtp, mtp_switch, mtp2 = (prepare(demo.params, demo.config, prompts, n, **auto) for n in (64, 65, 66))
saved = branch.switch_in_place


@contextlib.contextmanager
def lax_switch():
    branch.switch_in_place = lambda index, branches, state: jax.lax.switch(index, branches, state)
    try:
        yield
    finally:
        branch.switch_in_place = saved


def timed(r, plain_mode: bool, patch=contextlib.nullcontext):
    knobs = r.knobs.replace(width_mode=jnp.int32(MODE_PLAIN)) if plain_mode else r.knobs
    def run():
        with patch():
            return cost_table.seconds_per_round(demo.params, demo.config, r, knobs)
    return run


V = {"none": timed(none, False), "none again": timed(none2, False), "mtp in_place": timed(mtp, True),
     "mtp in_place again": timed(mtp2, True), "mtp lax.switch": timed(mtp_switch, True, lax_switch)}
t = {k: [] for k in V}
for rep in range(8):
    for k, f in V.items():
        x = f()
        if rep: t[k].append(x * 1e3)
rows = {k: {"ms_per_round": statistics.median(v), "vs_none": statistics.median(a / b for a, b in zip(v, t["none"])),
            "ms": v} for k, v in t.items()}
for k, r in rows.items():
    print(f"{k:16s} {r['ms_per_round']:.3f} ms  ratio to none (paired median) {r['vs_none']:.3f}")
with open(out, "w") as f:
    json.dump(rows, f, indent=1)
