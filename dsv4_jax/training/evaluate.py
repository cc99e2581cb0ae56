"""Held-out evaluation of the tiny demo bundle: acceptance per position, mean accepted length,
greedy losslessness and the wall-clock speed-up of speculative decoding, all in one run."""
from __future__ import annotations

import time

import numpy as np

import dsv4_jax as d
from dsv4_jax.demo import ByteTokenizer, tiny_demo

from . import data


def heldout_prompts(n: int, prompt_len: int = 64, seed: int = 0) -> list[list[int]]:
    """n prompts: windows of held-out stdlib files starting at a line boundary, BOS-prefixed."""
    stream = data.corpus("heldout", ByteTokenizer.BOS)
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        s = int(rng.integers(0, len(stream) - prompt_len - 1))
        nl = np.nonzero(stream[s:s + 200] == 10)[0]
        if nl.size == 0:
            continue
        s += int(nl[0]) + 1
        out.append([ByteTokenizer.BOS] + stream[s:s + prompt_len - 1].tolist())
    return out


def _timed(params, config, prompts, max_new, max_len, **kw):
    d.generate(params, config, prompts, max_new, eos_token_id=-1, max_len=max_len, **kw)   # compile / warm up
    t0 = time.perf_counter()
    toks, stats = d.generate(params, config, prompts, max_new, eos_token_id=-1, max_len=max_len, **kw)
    return toks, stats, time.perf_counter() - t0


def evaluate_bundle(path: str | None = None, n_prompts: int = 16, max_new: int = 128, batch: int = 1,
                    ks=(1, 2, 3, 4, 5)) -> dict:
    """Greedy runs on held-out prompts (batch `batch`): plain, MTP and DSpark at each draft_n_max."""
    demo = tiny_demo(path)
    config, params = demo.config, demo.params
    prompts = heldout_prompts(n_prompts)
    max_len = max(len(p) for p in prompts) + max_new + 8
    runs, plain_toks, plain_s = [], [], 0.0
    groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    for g in groups:
        t, _, s = _timed(params, config, g, max_new, max_len)
        plain_toks += t
        plain_s += s
    n_tokens = sum(len(t) for t in plain_toks)
    runs.append({"drafter": "none", "k": 0, "wall_s": plain_s, "tokens_per_s": n_tokens / plain_s, "speedup": 1.0})
    for drafter in ("mtp", "dspark"):
        for k in ks:
            toks, agg, wall = [], None, 0.0
            for g in groups:
                t, st, s = _timed(params, config, g, max_new, max_len, drafter=drafter, draft_n_max=k,
                                  dspark_meta=demo.dspark)
                toks += t
                wall += s
                agg = st if agg is None else _add(agg, st)
            runs.append({"drafter": drafter, "k": k, "lossless": toks == plain_toks, "wall_s": wall,
                         "tokens_per_s": n_tokens / wall, "speedup": plain_s / wall,
                         "mean_accepted_length": (agg["accepted"] + agg["rounds"]) / agg["rounds"],
                         "draft_acceptance_rate": agg["accepted"] / max(agg["drafted"], 1),
                         "per_position_accept_rate": [a / p if p else 0.0 for a, p in
                                                      zip(agg["per_position_accepted"], agg["per_position_proposed"])],
                         "rounds": agg["rounds"], "drafted": agg["drafted"], "accepted": agg["accepted"]})
    best = max((r for r in runs if r["drafter"] == "dspark"), key=lambda r: r["speedup"])
    m5 = next(r for r in runs if r["drafter"] == "mtp" and r["k"] == max(ks))
    s5 = next(r for r in runs if r["drafter"] == "dspark" and r["k"] == max(ks))
    summary = {"all_lossless": all(r.get("lossless", True) for r in runs),
               "mtp_mean_accepted_length_k5": m5["mean_accepted_length"],
               "dspark_mean_accepted_length_k5": s5["mean_accepted_length"],
               "best_dspark": {"k": best["k"], "speedup": best["speedup"]},
               "n_prompts": n_prompts, "max_new_tokens": max_new, "batch": batch}
    return {"summary": summary, "runs": runs}


def _add(a: dict, b: dict) -> dict:
    out = dict(a)
    for key in ("rounds", "drafted", "accepted"):
        out[key] = a[key] + b[key]
    for key in ("per_position_accepted", "per_position_proposed"):
        out[key] = [x + y for x, y in zip(a[key], b[key])]
    return out
