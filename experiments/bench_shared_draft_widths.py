"""What `dsv4-sweep --shared-draft-widths` (its default) costs: decode ms per round of MTP / DSpark at draft_n_max
k with its own loop program vs the loop program shared by k = 1..3 (`RunShape.dynamic_draft_n`, max_block 4:
the drafting compiled once, the verify a switch over the widths 2..4), on the bundled tiny model, the two
interleaved in one process (5 repeats of 3 prompts × 64 tokens each, medians and minima); greedy tokens must
be equal. Prints a line per setting, writes JSON.

    python experiments/bench_shared_draft_widths.py OUT.json
"""
import json, statistics, sys
from dsv4_jax.demo import tiny_demo
from dsv4_jax import generate
from dsv4_jax.research import prompts as P
d = tiny_demo()
suite = P.load_suite("tiny")["prompts"]
prompts = [d.tokenizer.encode(p["text"]) for p in P.select(suite, None, 1)][:4]
prompts = [p for p in prompts if len(p) < 140][:3]
common = dict(max_block=4, drafter_pool=("mtp", "dspark"), eos_token_id=-1, max_len=144 + 64 + 4, pad_to=144)
rows = []
for drafter in ("mtp", "dspark"):
    for k in (1, 2, 3):
        res = {}
        for variant in ("own", "shared"):
            kw = dict(common, dynamic_draft_n=(variant == "shared"))
            for p in prompts:
                generate(d.params, d.config, [p], 64, drafter=drafter, draft_n_max=k, **kw)   # warm
            res[variant] = []
        toks = {}
        for rep in range(5):
            for variant in ("own", "shared"):
                kw = dict(common, dynamic_draft_n=(variant == "shared"))
                tot, rounds = 0.0, 0
                out = []
                for p in prompts:
                    t, s = generate(d.params, d.config, [p], 64, drafter=drafter, draft_n_max=k, **kw)
                    tot += s["decode_s"]; rounds += s["rounds"]; out.append(t)
                res[variant].append(tot / rounds * 1e3)
                toks[variant] = out
        own, shared = statistics.median(res["own"]), statistics.median(res["shared"])
        ratio_min = min(res["shared"]) / min(res["own"])
        row = {"drafter": drafter, "k": k, "own_ms_per_round": own, "shared_ms_per_round": shared,
               "ratio": shared / own, "ratio_of_minima": ratio_min, "tokens_equal": toks["own"] == toks["shared"],
               "rounds": rounds, "own_all": res["own"], "shared_all": res["shared"]}
        rows.append(row)
        print(f"{drafter} k={k}: own {own:.2f} ms/round, shared {shared:.2f} ms/round, x{shared/own:.2f} "
              f"(minima x{ratio_min:.2f}), tokens equal {row['tokens_equal']}", flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
