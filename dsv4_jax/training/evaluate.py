"""Held-out evaluation of the tiny demo bundle: acceptance per position, mean accepted length,
greedy losslessness and the wall-clock speed-up of speculative decoding, all in one run.

Besides the end-to-end speed-up, each run reports where it is bounded (docs/drafter_math.md §4.1 terms):
a round costs `round_cost_in_decode_steps` = (decode time / rounds) / (plain decode time / token)
and emits mean_accepted_length tokens, so speed-up = mean_accepted_length / round cost; with every
draft accepted it could reach at most (k + 1) / round cost (`speedup_bound_full_acceptance`).
`block_costs` times the target's verify block alone (S = 1..k+1 tokens, min of several chains) and
`drafter_costs` a drafter's propose / observe calls; `round_parts` splits a round into them.
"""
from __future__ import annotations

import functools
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import dsv4_jax as d
from ..bundle import CheckpointConfig, target_config
from ..model.decode import prefill, process_block
from ..demo import ByteTokenizer, tiny_demo
from ..drafters import registry
from ..drafters.base import Bound
from ..research.report import markdown_table

from . import data

DRAFTERS = ("mtp", "dspark")   # evaluated in this order (names in dsv4_jax.drafters.registry)


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


def _timed(params, config, prompts, max_new, max_len, repeats: int = 1, **kw):
    """Warm-up call, then the fastest of `repeats` timed calls: (tokens, stats, wall s)."""
    d.generate(params, config, prompts, max_new, eos_token_id=-1, max_len=max_len, **kw)   # compile / warm up
    best = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        toks, stats = d.generate(params, config, prompts, max_new, eos_token_id=-1, max_len=max_len, **kw)
        wall = time.perf_counter() - t0
        if best is None or wall < best[2]:
            best = (toks, stats, wall)
    return best


def _fastest(calls: dict, chain: int, repeats: int) -> dict:
    """Seconds per call of each calls[name]() (which returns arrays to wait on): one warm-up call each,
    then the fastest of `repeats` chains of `chain` back-to-back calls, the names taking turns (so
    that a slow stretch of a shared machine does not fall on one of them only)."""
    for call in calls.values():
        jax.block_until_ready(call())
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(repeats):
        for name, call in calls.items():
            t0 = time.perf_counter()
            for _ in range(chain):
                out = call()
            jax.block_until_ready(out)
            best[name] = min(best[name], (time.perf_counter() - t0) / chain)
    return best


def _prompt(prompt_len: int) -> jax.Array:
    """The random byte prompt [1, prompt_len] the cost timings start from."""
    return jnp.asarray(np.random.default_rng(0).integers(0, 256, (1, prompt_len)), jnp.int32)


def _primed(params, config, prompt_len: int, max_block: int, taps=()):
    """`_prompt(prompt_len)` prefilled at batch 1: (state, aux) with room for a max_block block."""
    _, state, aux = prefill(params, config, _prompt(prompt_len), max_len=prompt_len + max_block + 1,
                            max_block=max_block, taps=taps)
    return state, aux


def block_costs(params, config, sizes, taps=(), prompt_len: int = 64, chain: int = 20, repeats: int = 7) -> dict:
    """Seconds per target block of S tokens (S in `sizes`) after a prompt_len-token prefill, batch 1.

    Each timing is the fastest of `repeats` chains of `chain` back-to-back `process_block` calls, the
    sizes taking turns (the state is threaded through, pos is not advanced: every call re-scores the
    same positions). Each call includes one host dispatch, which the on-device loop does not pay.
    """
    state = [_primed(params, config, prompt_len, max(sizes))[0]]     # process_block donates its state
    rng = np.random.default_rng(1)

    def block_call(S):
        block, n = jnp.asarray(rng.integers(0, 256, (1, S)), jnp.int32), jnp.full((1,), S, jnp.int32)

        def call():
            state[0] = process_block(params, config, state[0], block, n, taps)[1]
            return state[0]
        return call
    return _fastest({S: block_call(S) for S in sizes}, chain, repeats)


class _Drafting(NamedTuple):
    """The static part of a timed drafter call: the model config, the drafter (its `drafters.base` object) and
    its setup at one width."""

    config: object
    drafter: object
    setup: object


@functools.partial(jax.jit, static_argnames=("static",))
def _propose(params, static: _Drafting, state, pos, last, key, knobs):
    return static.drafter.propose(Bound(params, static.config, static.setup), state, pos, last, key, knobs, True)[0]


@functools.partial(jax.jit, static_argnames=("static",))
def _observe(params, static: _Drafting, state, aux, block):
    tokens, start, n_valid = block
    return static.drafter.observe(Bound(params, static.config, static.setup), state, aux, tokens, start, n_valid)


COST_PROMPT_LEN = 64     # context tokens before the timed propose / observe calls of `drafter_costs`


def drafter_costs(params, config, name: str, meta, ks, chain: int = 20, repeats: int = 7) -> dict:
    """Seconds per call of a drafter's propose / observe at batch 1, greedy (its `drafters.base` interface):
    {"propose": {k: s}, "observe": {k: s}} for k in ks.

    propose drafts k tokens after a COST_PROMPT_LEN-token context; observe stores a (k+1)-row verify block
    (what a round feeds the drafter). Like `block_costs`, each includes one host dispatch, which the
    on-device loop does not pay. The calls get the drafter's weights and the target's embedding and head
    only (what MTP and DSpark read of the target), so that the dispatch does not carry the whole tree."""
    drafter = registry.get(name)
    setups = {k: drafter.configure(params, config, k, None, {} if meta is None else {name: meta}) for k in ks}
    widest = setups[max(ks)]
    state, aux = _primed(params, config, COST_PROMPT_LEN, widest.k + 1, widest.taps)
    prompt = _prompt(COST_PROMPT_LEN)
    zero, n = jnp.zeros((1,), jnp.int32), jnp.full((1,), COST_PROMPT_LEN, jnp.int32)
    view = {key: params[key] for key in ("embed", "head", drafter.weights)}
    knobs = drafter.default_knobs()
    calls = {}
    for k, setup in setups.items():
        dstate = drafter.init(Bound(view, config, setup), 1, COST_PROMPT_LEN + setup.k + 2, jnp.float32)
        dstate = drafter.observe(Bound(view, config, setup), dstate, aux, jnp.roll(prompt, -1, axis=1), zero, n)
        block = jax.tree.map(lambda a, S=setup.k + 1: a[:, :S], aux)
        tokens, n_block = prompt[:, :setup.k + 1], jnp.full((1,), setup.k + 1, jnp.int32)
        key, last = jax.random.PRNGKey(0), prompt[:, -1]
        static = _Drafting(config, drafter, setup)
        calls["propose", k] = lambda st=dstate, sa=static: _propose(view, sa, st, n, last, key, knobs)
        calls["observe", k] = lambda st=dstate, sa=static, b=block, t=tokens, nb=n_block: _observe(
            view, sa, st, b, (t, n, nb))
    out = {"propose": {}, "observe": {}}
    for (part, k), t in _fastest(calls, chain, repeats).items():
        out[part][k] = t
    return out


def round_parts(run: dict, block_s: dict, dspark_s: dict) -> dict:
    """Split a batch-1 DSpark run's round (ms): verify block, propose, observe and the rest of the loop.

    Also the speed-up its acceptance would give with a free drafter and free bookkeeping (only the
    k+1-token verify block paid): mean_accepted_length × block(1) / block(k+1), both blocks timed the
    same way (a generous bound: the one host dispatch in each timing narrows their ratio).
    block_s needs sizes 1 and k+1."""
    k = run["k"]
    verify, propose, observe = block_s[k + 1], dspark_s["propose"][k], dspark_s["observe"][k]
    per_round = run["decode_s"] / run["rounds"]
    return {"round_ms": {"verify": 1e3 * verify, "propose": 1e3 * propose, "observe": 1e3 * observe,
                         "rest": 1e3 * (per_round - verify - propose - observe)},
            "speedup_bound_free_drafter": run["mean_accepted_length"] * block_s[1] / verify}


def round_accounting(run: dict, s_per_token_plain: float, batch: int = 1) -> dict:
    """Round cost in plain decode steps and the speed-up bound at full acceptance of one speculative run.

    run: {"decode_s", "rounds" (summed over the batch's sequences), "k"}; s_per_token_plain: plain
    decode seconds per token (per loop step). Exact for batch 1; for larger batches rounds/batch
    approximates the loop's trip count.
    """
    per_round = run["decode_s"] / (run["rounds"] / batch)
    steps = per_round / s_per_token_plain
    return {"ms_per_round": 1e3 * per_round, "round_cost_in_decode_steps": steps,
            "speedup_bound_full_acceptance": (run["k"] + 1) / steps}


def evaluate_bundle(path: str | None = None, n_prompts: int = 16, max_new: int = 128, batch: int = 1,
                    ks=(1, 2, 3, 4, 5), repeats: int = 1, backends=None, chain: int = 20,
                    chain_repeats: int = 7) -> dict:
    """Greedy runs on held-out prompts (batch `batch`): plain, MTP and DSpark at each draft_n_max.

    repeats: timed calls per prompt group (the fastest counts). Also times the verify block alone
    (`block_costs`, S = 1..max(ks)+1) and each drafter's propose / observe (`drafter_costs`) in the same
    process, each the fastest of `chain_repeats` chains of `chain` calls. backends: the kernels
    (`dsv4_jax.backends`; default: the references).
    """
    demo = tiny_demo(path)
    config, params = target_config(demo.config, backends), demo.params
    bundle = CheckpointConfig(config, mtp_layers=len(params["mtp"]), dspark=demo.dspark)   # what generate takes
    prompts = heldout_prompts(n_prompts)
    max_len = max(len(p) for p in prompts) + max_new + 8
    runs, plain_toks, plain_s, plain_decode_s = [], [], 0.0, 0.0
    groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    for g in groups:
        t, st, s = _timed(params, bundle, g, max_new, max_len, repeats)
        plain_toks += t
        plain_s += s
        plain_decode_s += st["decode_s"]
    n_tokens = sum(len(t) for t in plain_toks)
    # the first token of each sequence comes from the prefill; the loop makes the rest
    s_per_token = plain_decode_s / ((n_tokens - len(plain_toks)) / batch)
    runs.append({"drafter": "none", "k": 0, "wall_s": plain_s, "decode_s": plain_decode_s,
                 "tokens_per_s": n_tokens / plain_s, "speedup": 1.0, "ms_per_decode_step": 1e3 * s_per_token})
    for drafter in DRAFTERS:
        for k in ks:
            toks, agg, wall, dec_s = [], None, 0.0, 0.0
            for g in groups:
                t, st, s = _timed(params, bundle, g, max_new, max_len, repeats, drafter=drafter, draft_n_max=k)
                toks += t
                wall += s
                dec_s += st["decode_s"]
                agg = st if agg is None else _add(agg, st)
            runs.append({"drafter": drafter, "k": k, "lossless": toks == plain_toks, "wall_s": wall,
                         "decode_s": dec_s, "tokens_per_s": n_tokens / wall, "speedup": plain_s / wall,
                         "mean_accepted_length": (agg["accepted"] + agg["rounds"]) / agg["rounds"],
                         "draft_acceptance_rate": agg["accepted"] / max(agg["drafted"], 1),
                         "per_position_accept_rate": [a / p if p else 0.0 for a, p in
                                                      zip(agg["per_position_accepted"], agg["per_position_proposed"])],
                         "rounds": agg["rounds"], "drafted": agg["drafted"], "accepted": agg["accepted"]})
            runs[-1].update(round_accounting(runs[-1], s_per_token, batch))
    blocks = block_costs(params, config, range(1, max(ks) + 2), taps=demo.dspark.target_layer_ids, chain=chain,
                         repeats=chain_repeats)
    drafter_s = {name: drafter_costs(params, config, name, bundle.drafter_meta().get(name), ks, chain=chain,
                                     repeats=chain_repeats) for name in DRAFTERS}
    if batch == 1:
        for r in runs[1:]:
            r.update(round_parts(r, blocks, drafter_s[r["drafter"]]))
    best = max((r for r in runs if r["drafter"] == "dspark"), key=lambda r: r["speedup"])
    m5 = next(r for r in runs if r["drafter"] == "mtp" and r["k"] == max(ks))
    s5 = next(r for r in runs if r["drafter"] == "dspark" and r["k"] == max(ks))
    summary = {"all_lossless": all(r.get("lossless", True) for r in runs),
               "mtp_mean_accepted_length_k5": m5["mean_accepted_length"],
               "dspark_mean_accepted_length_k5": s5["mean_accepted_length"],
               "best_dspark": {"k": best["k"], "speedup": best["speedup"],
                               "round_cost_in_decode_steps": best["round_cost_in_decode_steps"],
                               "speedup_bound_full_acceptance": best["speedup_bound_full_acceptance"],
                               "speedup_bound_free_drafter": best.get("speedup_bound_free_drafter")},
               "verify_block_cost_in_decode_steps": {str(S): t / blocks[1] for S, t in blocks.items()},
               "n_prompts": n_prompts, "max_new_tokens": max_new, "batch": batch, "repeats": repeats}
    return {"summary": summary, "runs": runs,
            "block_ms": {str(S): 1e3 * t for S, t in blocks.items()},
            "drafter_ms": {name: {part: {str(k): 1e3 * t for k, t in v.items()} for part, v in costs.items()}
                           for name, costs in drafter_s.items()}}


def format_table(res: dict) -> str:
    """The runs of `evaluate_bundle` as a markdown table (ms columns: a round split by `round_parts`, batch 1)."""
    head = ["drafter", "k", "mean acc. len", "speed-up", "round (steps)", "bound full acc.",
            "verify ms", "propose ms", "observe ms", "rest ms", "bound free drafter"]
    ratios = ("mean_accepted_length", "speedup", "round_cost_in_decode_steps", "speedup_bound_full_acceptance")
    rows = []
    for r in res["runs"]:
        parts = r.get("round_ms", {})
        rows.append([r["drafter"], r["k"]] + [f"{r.get(key, 1.0):.2f}" for key in ratios]
                    + [f"{parts[p]:.2f}" if p in parts else "" for p in ("verify", "propose", "observe", "rest")]
                    + [f"{r['speedup_bound_free_drafter']:.2f}" if "speedup_bound_free_drafter" in r else ""])
    return markdown_table(head, rows)


def _add(a: dict, b: dict) -> dict:
    out = dict(a)
    for key in ("rounds", "drafted", "accepted"):
        out[key] = a[key] + b[key]
    for key in ("per_position_accepted", "per_position_proposed"):
        out[key] = [x + y for x, y in zip(a[key], b[key])]
    return out
