"""Decode-path benchmark of a Flash-shaped model (issue 11): prefill, decode, verify, speculative rounds.

Model: `flash()` layer dimensions (D 4096, 64 heads × 512, q_lora 1024, 8 O-LoRA groups, 256 experts of
2048, top-6, 129 280 vocabulary) with the layer count reduced to fit one GPU: Flash's 3 leading layers
(SWA, SWA, CSA — all hash-routed) plus `--pairs` HCA/CSA pairs (default 1: 5 layers, ≈68 GB of bf16
weights), so every layer type runs. Random weights are made on the device (`dsv4_jax.model.random_init`), in
bf16 and in the quantized storage the model executes ("fp8-experts": routed experts as FP8 e4m3 codes + a
float32 scale per 128×128 block, read in-tile by the MoE kernels; everything else bf16). Decode states
are synthetic: caches filled with random rows and `pos` set to the context length (a 64K prefill is not
needed to measure what a step at 64K reads).

Measured in one run, each against its bytes bound (`dsv4_jax.analysis.traffic.bytes_bound`) and the device's
measured read bandwidth (a large `jnp.sum`):
  prefill   a chunk of B·chunk = --prefill-tokens tokens appended at the end of a context of C tokens:
            tokens/s;
  decode    one token per sequence (`decode.process_block`, S = 1, the jitted call `decode_step` makes):
            ms/token, achieved bytes/s = bound / time, and its share of the measured bandwidth;
  verify    a block of S = k+1 = 2..6 tokens (the call `verify` makes), relative to one decode step;
  spec      one round of the on-device loop (`speculative.loop.run_rounds`: draft + verify + accept + commit +
            drafter observe) with the MTP and DSpark drafters at draft_n_max k, under forced
            acceptance (below): µs/round, µs/token and the speed-up it allows at full acceptance;
  loop      the same round run three ways: the on-device `lax.while_loop` (`run_rounds`), the host
            loop (`run_rounds_python`, one sync per round) and back-to-back async dispatch of the
            jitted round (≈ the round's device time); overhead = loop time − async time per round;
  profile   a jax.profiler trace of decode steps (top ops by device time, when the trace can be read)
            and per-component timing (embedding, attention per layer type, MoE per routing type, head);
  goals     the issue's H200 goals at batch 1, with the measured value and met / missed by how much.
Every case runs with kernels off ("reference": the jnp paths) and on ("pallas"), chosen by the config's
static `Backends` (`--kernels`, `dsv4_jax.backends`), so the two variants are two jit cache entries side
by side; on CPU the Pallas kernels run in interpret mode, so kernel timings there are meaningless.

Forced acceptance: the rounds run with `program.Program(forced_acceptance=True)` (`ops.sampling.verify_forced`):
every proposed draft is accepted (n_accept = max(real n_accept, n_draft) = n_draft) and the bonus token is
the target's argmax after the last draft. The real drafter runs (its cost is paid: MTP chain, DSpark
stages, Markov and confidence heads), the real verification is still computed, and every round commits
k+1 tokens (target and drafter states advance exactly as at full acceptance); only the accept decision is
overridden, so the cost side is measured independently of the random weights' acceptance. The MTP block
and the 3 DSpark stages share one set of routed-expert arrays (same buffers passed several times) to fit
memory; a round reads them once per block as it would distinct weights (far larger than any cache).

  dsv4-bench-decode --small --quick                  # CPU smoke test, < 1 min (2 cores)
  dsv4-bench-decode --small --out decode_cpu.json     # CPU, every variant, ~6 min (2 cores)
  dsv4-bench-decode --out $OUT/decode_h200.json       # H200: the issue's sizes, ~8 min
  dsv4-bench-decode --quick --out $OUT/quick.json     # GPU smoke test, Flash dims, 3 layers
  dsv4-bench-decode --plan-only                       # memory plan and the ordered cases
  dsv4-bench-decode --only decode,verify --batches 1 --contexts 4096 --dtypes bf16
(`python -m dsv4_jax.research.bench_decode` without installing; experiments/gpu_suite.sh runs it on the GPU.)

The cases run in priority order (goal cases first) and each has a deadline within --budget-s (default
400 s, compiles included; --format-reserve-s keeps time for the fp8 cases): what does not fit is listed
under "skipped" in the JSON instead of overrunning the device's time.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import gc
import glob
import json
import os
import platform
import statistics
import tempfile
import sys
import time
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from .. import backends, cli
from ..model import params as P
from ..model.state import EMPTY, Span, init_state, state_bytes
from ..config import CSA, HCA, SLIDING, ModelConfig, flash, small, with_pairs
from ..model.decode import process_block
from ..drafters import registry
from ..model.layers import hyper
from ..model.layers.attention import attention_step
from ..model.layers.block import ffn_sublayer
from ..model.layers.norms import rms_norm
from ..model.inplace import hoist_stacked_experts, with_stacked_experts
from ..model.target import embed, head
from ..ops.sampling import verify_forced
from ..model.random_init import random_experts, random_tree
from ..model.schedule import segments
from ..speculative import loop
from ..speculative import stats as spec_stats
from ..speculative.program import Carry, Program
from ..analysis import traffic
from ..analysis.traffic import bytes_bound, stored_bytes

RUNNABLE_FORMATS = ("bf16", "fp8-experts")      # traffic.FORMATS also has "release": bytes only
EXPERT_FORMAT = {"bf16": "dense", "fp8-experts": "fp8"}   # random_init expert storage of each weight format
IMPLS = ("reference", "pallas")                  # the default --kernels variants (backends.CHOICES)
SECTIONS = ("prefill", "decode", "verify", "spec", "loop", "profile")
GOALS = {"decode_bw_fraction": 0.75, "verify6_over_decode": 1.3, "loop_overhead_us": 20.0}
DSPARK_MARKOV_RANK = 256                         # docs/drafter_math.md §2.1 (Flash)


# ---- the model ------------------------------------------------------------------------------------

def small_flash(pairs: int = 1) -> ModelConfig:
    """The same layer schedule in miniature for CPU (HCA ratio 8 so short contexts have HCA rows)."""
    c = small(with_pairs(flash(), pairs))
    return c.replace(name=f"small-{c.num_layers}L", max_position_embeddings=1 << 16,
                     compress_ratios=tuple({HCA: 8, CSA: 4, SLIDING: 0}[t] for t in c.layer_types))


# ---- weights on the device -----------------------------------------------------------------------

def drafter_specs(config: ModelConfig, drafters) -> dict:
    """ParamSpec trees of the benchmarked drafters: one MTP block, a 3-stage DSpark (markov rank 256)."""
    rank = DSPARK_MARKOV_RANK if config.hidden_size >= 1024 else 8
    specs = {"mtp": [P.mtp_specs(config)], "dspark": P.dspark_specs(config, 3, 3, rank, False)}
    return {name: specs[name] for name in drafters}


def build_params(config: ModelConfig, fmt: str, drafters: tuple[str, ...], seed: int = 0) -> dict:
    """Target (+ drafter_specs) weights in format fmt, on the device (`dsv4_jax.model.random_init`); the drafter
    blocks share one set of routed experts."""
    key, ex = jax.random.key(seed), EXPERT_FORMAT[fmt]
    params = random_tree(P.param_specs(config), config, jax.random.fold_in(key, 0), jnp.bfloat16, ex)
    if drafters:
        shared = random_experts(jax.random.fold_in(key, 1), P.drafter_block_specs(config)["ffn"]["experts"],
                                jnp.bfloat16, ex)
        for i, (name, specs) in enumerate(drafter_specs(config, drafters).items()):
            params[name] = random_tree(specs, config, jax.random.fold_in(key, 2 + i), jnp.bfloat16, ex, shared)
    return jax.block_until_ready(params)


def tree_bytes(tree) -> int:
    """Bytes of the distinct device buffers of a tree (shared arrays counted once)."""
    seen, total = set(), 0
    for x in jax.tree.leaves(tree):
        if id(x) not in seen:
            seen.add(id(x))
            total += x.size * x.dtype.itemsize
    return total


def memory_plan(config: ModelConfig, fmt: str, drafters, batches, contexts, margin: int, max_block: int) -> dict:
    """Bytes of what the run holds at once: weights, drafters (one shared expert set), largest decode state."""
    GB = 1e9
    target = stored_bytes(P.param_specs(config), fmt)
    drafter = 0.0
    if drafters:
        experts = stored_bytes({"ffn": {"experts": P.drafter_block_specs(config)["ffn"]["experts"]}}, fmt)
        for specs in drafter_specs(config, drafters).values():
            n_blocks = sum(1 for p in P.flatten(specs) if p.endswith("ffn.experts.w1"))
            drafter += stored_bytes(specs, fmt) - n_blocks * experts
        drafter += experts
    state = state_bytes(config, max(batches), max(contexts) + margin, max_block, jnp.bfloat16)["total"]
    return {"format": fmt, "target_weights_GB": target / GB, "drafter_weights_GB": drafter / GB,
            "largest_decode_state_GB": state / GB, "total_GB": (target + drafter + state) / GB}


# ---- decode states --------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("config", "batch", "max_len", "max_block"))
def synthetic_state(config: ModelConfig, batch: int, max_len: int, max_block: int, context, key):
    """A bf16 DecodeState as if `context` (int32 scalar) tokens had been committed: random rows, ring
    slots tagged with the last positions, pos = context. A step's cost depends on shapes and positions."""
    st = init_state(config, batch, max_len, max_block, jnp.bfloat16)
    leaves, treedef = jax.tree_util.tree_flatten(st.layers)
    rand = [jax.random.normal(jax.random.fold_in(key, i), x.shape, jnp.float32).astype(x.dtype)
            for i, x in enumerate(leaves)]

    def tagged(ring):                                # latest position < context in slot t mod R
        R = ring.pos.shape[-1]
        t = context - 1 - jnp.mod(context - 1 - jnp.arange(R), R)
        return ring.replace(pos=jnp.broadcast_to(jnp.where(t >= 0, t, EMPTY), ring.pos.shape).astype(ring.pos.dtype))

    layers = [[c.replace(window=tagged(c.window)) for c in slots]
              for slots in jax.tree_util.tree_unflatten(treedef, rand)]
    return st.replace(pos=jnp.full((batch,), context, jnp.int32), layers=layers)


def random_tokens(key, shape, vocab: int):
    return jax.random.randint(key, shape, 2, vocab, jnp.int32)


# ---- variants: kernels on/off --------------------------------------------------------------------

def variant(config: ModelConfig, impl: str) -> ModelConfig:
    """The config with kernels `impl` ("auto" | "reference" | "pallas") in its static backends field:
    part of every jit key, so the variants compile side by side."""
    return config.with_backends(backends.resolve(impl))


# ---- timing -------------------------------------------------------------------------------------

def timed_chain(step, x, iters: int):
    """Run x = step(x) (compile + warm-up, then iters timed calls, each waited for).

    Returns (median µs, all µs, first-call s, x)."""
    t = time.perf_counter()
    x = jax.block_until_ready(step(x))
    first = time.perf_counter() - t
    x = jax.block_until_ready(step(x))
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        x = jax.block_until_ready(step(x))
        ts.append((time.perf_counter() - t) * 1e6)
    return statistics.median(ts), ts, first, x


def measure_bandwidth(nbytes: int, iters: int) -> dict:
    """Achieved bytes/s of a read (sum of a float32 buffer) and of a copy (x + 1: read + write)."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    out = {}
    for name, f, moved in (("read", jax.jit(jnp.sum), nbytes), ("copy", jax.jit(lambda v: v + 1.0), 2 * nbytes)):
        f(x).block_until_ready()
        ts = []
        for _ in range(iters):
            t = time.perf_counter()
            f(x).block_until_ready()
            ts.append(time.perf_counter() - t)
        out[f"{name}_GBps"] = moved / statistics.median(ts) / 1e9
    del x
    return out


# ---- cases ----------------------------------------------------------------------------------------

class Bench:
    """Holds the run's settings, weights and results; one method per kind of case."""

    def __init__(self, a, config: ModelConfig, bw: dict):
        self.a, self.config, self.bw = a, config, bw
        self.params, self.fmt = None, None
        self.max_block = max(a.verify_k + a.draft_n + [1]) + 1
        self.margin = a.loop_rounds * self.max_block + self.max_block + 2
        self.results = {s: [] for s in SECTIONS}
        self.results["profile"] = {"traces": [], "components": []}
        self.key = jax.random.key(a.seed)

    # states and inputs
    def state(self, batch: int, context: int, at: int | None = None):
        """State of capacity context + margin (one shape per (batch, context)) holding `at` (default
        context) committed tokens."""
        at = context if at is None else at
        return synthetic_state(self.config, batch, context + self.margin, self.max_block, jnp.int32(at),
                               jax.random.fold_in(self.key, batch * 7919 + context))

    def tokens(self, batch: int, S: int):
        return random_tokens(jax.random.fold_in(self.key, 17 * S + batch), (batch, S), self.config.vocab_size)

    def bw_read(self) -> float:
        return self.bw["read_GBps"] * 1e9

    def block_case(self, section: str, impl: str, batch: int, context: int, S: int) -> dict:
        """Time process_block on S tokens per sequence at `context` (decode: S = 1; verify; prefill)."""
        cfg = variant(self.config, impl)
        toks, n = self.tokens(batch, S), jnp.full((batch,), S, jnp.int32)
        st = self.state(batch, context, context - S if section == "prefill" else context)

        def step(st):
            return process_block(self.params, cfg, st, toks, n)[1]

        us, all_us, first, st = timed_chain(step, st, self.a.iters)
        finite = None
        if section != "prefill":   # random weights must still give finite logits (a NaN stops every MTP chain)
            logits = process_block(self.params, cfg, st, toks, n)[0]
            finite = float(jnp.mean(jnp.isfinite(logits).astype(jnp.float32)))
        del st
        bound = bytes_bound(self.config, self.fmt, batch, context, S)
        row = {"dtype": self.fmt, "kernels": impl, "backends": cfg.backends.describe(), "batch": batch, "context": context, "tokens": S,
               "us": us, "us_all": all_us, "first_call_s": first, "bound_bytes": bound["total"],
               "bound_weight_bytes": bound["weights"], "bound_cache_bytes": bound["cache"],
               "active_experts_per_layer": bound["active_experts_per_layer"],
               "achieved_GBps": bound["total"] / (us * 1e-6) / 1e9,
               "bw_fraction": bound["total"] / (us * 1e-6) / self.bw_read(),
               "bound_us": bound["total"] / self.bw_read() * 1e6, "logits_finite_fraction": finite}
        if section == "decode":
            row["ms_per_step"], row["ms_per_token"] = us / 1e3, us / 1e3 / batch
        if section == "prefill":
            row["tokens_per_s"] = batch * S / (us * 1e-6)
        if section == "verify":
            dec = self.find("decode", dtype=self.fmt, kernels=impl, batch=batch, context=context)
            row["over_decode"] = us / dec["us"] if dec else None
        return row

    def find(self, section, **kw):
        for r in self.results[section]:
            if all(r.get(k) == v for k, v in kw.items()) and "us" in r:
                return r
        return None

    # speculative rounds
    def carry(self, cfg, opts: Program, batch: int, context: int):
        B, k = batch, opts.k
        st = self.state(batch, context)
        dstate = opts.drafter.init(opts.bind(self.params, cfg), B, st.max_len, jnp.bfloat16)
        last = self.tokens(B, 1)[:, 0]
        out = jnp.full((B, opts.max_new_tokens + k + 1), -1, jnp.int32).at[:, 0].set(last)
        return Carry(out=out, out_len=jnp.ones((B,), jnp.int32), limit=jnp.full((B,), opts.max_new_tokens, jnp.int32),
                     last=last, done=jnp.zeros((B,), bool), target=st, drafter=dstate, key=jax.random.PRNGKey(0),
                     stats=spec_stats.zeros(opts.stats, B, k, opts.max_new_tokens), round=jnp.zeros((), jnp.int32))

    def options(self, drafter: str, k: int) -> Program:
        """Greedy rounds with forced acceptance (every proposed draft accepted; module docstring)."""
        d = registry.get(drafter)
        setup = d.configure(self.params, self.config, k)
        return Program(drafter=d, setup=setup, greedy=True, max_new_tokens=1 + self.a.loop_rounds * (setup.k + 1),
                       eos_token_id=-1, forced_acceptance=True, stats=spec_stats.StatsSpec(verification=False))

    def rounds(self, impl: str, drafter: str, k: int, batch: int, context: int, modes=("device",)) -> dict:
        """Time R forced-acceptance rounds in each mode: device (while_loop), host (Python loop, sync per
        round), async (the jitted round dispatched back to back, one wait at the end)."""
        cfg = variant(self.config, impl)
        opts = self.options(drafter, k)
        knobs = registry.get(drafter).default_knobs(temperature=1e-6)
        runs = {"device": lambda c: loop.run_rounds(self.params, cfg, c, knobs, opts),
                "host": lambda c: loop.run_rounds_python(self.params, cfg, c, knobs, opts),
                "async": lambda c: _async_rounds(self.params, cfg, c, knobs, opts, self.a.loop_rounds)}
        row = {"dtype": self.fmt, "kernels": impl, "drafter": drafter, "k": opts.k, "batch": batch,
               "context": context, "rounds": None}
        for mode in modes:
            ts, first = [], None
            for rep in range(self.a.loop_reps + 1):
                c = jax.block_until_ready(self.carry(cfg, opts, batch, context))
                t = time.perf_counter()
                c = jax.block_until_ready(runs[mode](c))
                dt = time.perf_counter() - t
                if rep == 0:
                    first = dt
                else:
                    ts.append(dt)
            n_rounds = int(c.round) if mode != "async" else self.a.loop_rounds
            accepted = int(np.asarray(c.stats.accepted).sum())
            drafted = int(np.asarray(c.stats.drafted).sum())
            row["rounds"] = n_rounds
            row[f"{mode}_us_per_round"] = statistics.median(ts) / n_rounds * 1e6
            row[f"{mode}_first_call_s"] = first
            if mode == "device":
                seq_rounds = int(np.asarray(c.stats.rounds).sum())          # summed over the batch
                row["tokens_per_round"] = (accepted + seq_rounds) / max(1, seq_rounds)   # per sequence
                row["acceptance"] = accepted / drafted if drafted else None
                row["drafts_per_round"] = drafted / max(1, seq_rounds)
                # forced acceptance commits k + 1 tokens a round unless the drafter stopped early (a NaN
                # top-1 probability fails MTP's p_min rule): flag it, the round then is not the k-draft cost
                row["forced_acceptance_full"] = row["tokens_per_round"] >= opts.k + 1 - 1e-6
            del c
        return row

    def spec_case(self, impl, drafter, k, batch, context) -> dict:
        row = self.rounds(impl, drafter, k, batch, context)
        us = row["device_us_per_round"]
        row["us_per_round"] = us
        row["us_per_token"] = us / row["tokens_per_round"]
        dec = self.find("decode", dtype=self.fmt, kernels=impl, batch=batch, context=context)
        ver = self.find("verify", dtype=self.fmt, kernels=impl, batch=batch, context=context, tokens=row["k"] + 1)
        if dec:
            row["round_over_decode"] = us / dec["us"]
            row["speedup_bound_at_full_acceptance"] = row["tokens_per_round"] * dec["us"] / us
        if ver:
            row["verify_us"] = ver["us"]
            row["draft_accept_observe_us"] = us - ver["us"]
        return row

    def loop_case(self, impl, drafter, k, batch, context) -> dict:
        row = self.rounds(impl, drafter, k, batch, context, modes=("device", "host", "async"))
        base = row["async_us_per_round"]
        row["device_loop_overhead_us"] = row["device_us_per_round"] - base
        row["host_loop_overhead_us"] = row["host_us_per_round"] - base
        row["host_over_device"] = row["host_us_per_round"] / row["device_us_per_round"]
        return row

    # profile
    def trace_case(self, impl: str, batch: int, context: int, trace_dir: str | None) -> dict:
        """jax.profiler trace of n decode steps; top ops by summed duration (when the trace is readable)."""
        cfg = variant(self.config, impl)
        toks, n = self.tokens(batch, 1), jnp.ones((batch,), jnp.int32)
        st = self.state(batch, context)
        steps = self.a.trace_steps
        out = {"dtype": self.fmt, "kernels": impl, "batch": batch, "context": context, "steps": steps}
        st = jax.block_until_ready(process_block(self.params, cfg, st, toks, n)[1])
        if trace_dir is None:
            trace_dir = tempfile.mkdtemp(prefix="bench_decode_trace_")
        d = os.path.join(trace_dir, f"{self.fmt}_{impl}_B{batch}_C{context}")
        try:
            with jax.profiler.trace(d):
                for _ in range(steps):
                    st = jax.block_until_ready(process_block(self.params, cfg, st, toks, n)[1])
        except Exception as e:  # noqa: BLE001 - a missing profiler must not stop the run
            out["error"] = f"profiler unavailable: {type(e).__name__}: {str(e)[:200]}"
            return out
        out["trace_dir"] = d
        out.update(summarize_trace(d, steps, self.a.top))
        return out

    def components_case(self, impl: str, batch: int, context: int) -> dict:
        """Per-component timing of one decode step: embedding, attention sublayer per layer type, MoE
        sublayer per routing type, head. Each component runs --component-reps times in one jitted
        fori_loop (its output feeds the next repetition, so nothing is hoisted) and the time is divided
        by the repetitions: dispatch overhead is left out. Step estimate = Σ count × time."""
        c, cfg = self.config, variant(self.config, impl)
        st = self.state(batch, context)
        X = jax.random.normal(self.key, (batch, 1, c.hc_mult, c.hidden_size), jnp.float32).astype(jnp.bfloat16)
        rows = []
        for name, fn, args, count in component_fns(self.params, cfg, st, self.tokens(batch, 1), X,
                                                   self.a.component_reps):
            try:
                us, _, first, _ = timed_chain(lambda _x: fn(*args), 0, self.a.iters)
                us /= self.a.component_reps
                rows.append({"component": name, "count": count, "us_each": us, "us_total": us * count,
                             "first_call_s": first})
            except Exception as e:  # noqa: BLE001
                rows.append({"component": name, "count": count, "error": f"{type(e).__name__}: {str(e)[:200]}"})
        total = sum(r.get("us_total", 0.0) for r in rows)
        for r in rows:
            if "us_total" in r:
                r["share_of_sum"] = r["us_total"] / total if total else None
        out = {"dtype": self.fmt, "kernels": impl, "batch": batch, "context": context,
               "reps_per_call": self.a.component_reps,
               "components": sorted(rows, key=lambda r: -r.get("us_total", 0.0)), "sum_us": total}
        dec = self.find("decode", dtype=self.fmt, kernels=impl, batch=batch, context=context)
        if dec:
            out["step_us"] = dec["us"]
            out["unaccounted_us"] = dec["us"] - total
        return out


def component_fns(params: dict, cfg: ModelConfig, st, toks, X, reps: int):
    """(name, jitted fn, args, layers of this kind) for each component of a decode step; fn(*args) runs the
    component `reps` times in a fori_loop. X [B,1,n,D] bf16 streams, toks [B,1], st a DecodeState."""
    span = Span.of(st.pos, 1, jnp.ones_like(st.pos))
    where = {}
    for s, seg in enumerate(segments(cfg)):
        for j in range(seg.pattern):
            for r in range(seg.reps):
                where.setdefault(seg.layer_index(j, r), (s, j, r))

    def repeat(body, init):
        return jax.lax.fori_loop(0, reps, lambda i, x: body(x), init)

    @functools.partial(jax.jit, static_argnames=("L",))
    def attn(p_slot, c_slot, X, L, r):
        p = jax.tree.map(lambda a: a[r], p_slot)
        lt, ratio, _ = cfg.layer_kind(L)

        def body(xc):
            X, cache = xc
            pre, post, comb = hyper.hc_weights(X, p["hc_attn"], cfg)
            h = rms_norm(hyper.collapse(X, pre), p["attn_norm"], cfg.rms_norm_eps)
            y, cache = attention_step(h, p["attn"], cfg, lt, ratio, span, cache)
            return hyper.expand(X, y, post, comb).astype(X.dtype), cache

        return repeat(body, (X, jax.tree.map(lambda a: a[r], c_slot)))

    @functools.partial(jax.jit, static_argnames=("L",))
    def ffn(p_slot, X, L, r):
        (rest,), (stacked,) = hoist_stacked_experts([p_slot], cfg)      # as run_segments: no expert copy
        p = with_stacked_experts(jax.tree.map(lambda a: a[r], rest), stacked, r)
        return repeat(lambda X: ffn_sublayer(X, p, cfg, cfg.layer_kind(L)[2], toks).astype(X.dtype), X)

    @jax.jit
    def emb(prm, X):
        return repeat(lambda X: embed(prm, cfg, toks + (X[:, :, 0, 0] > 1e30).astype(jnp.int32)).astype(X.dtype), X)

    @jax.jit
    def hd(prm, X):
        return repeat(lambda X: X + (jnp.max(head(prm, cfg, X)) * 0).astype(X.dtype), X)

    kinds_attn, kinds_ffn = {}, {}
    for L in range(cfg.num_layers):
        lt, _, mt = cfg.layer_kind(L)
        kinds_attn.setdefault(lt, []).append(L)
        kinds_ffn.setdefault(mt, []).append(L)
    yield "embedding", emb, ({"embed": params["embed"]}, X), 1
    for lt, layers in kinds_attn.items():
        s, j, r = where[layers[0]]
        yield (f"attention {lt} (hc + attn)", attn, (params["segments"][s][j], st.layers[s][j], X, layers[0], r),
               len(layers))
    for mt, layers in kinds_ffn.items():
        s, j, r = where[layers[0]]
        yield f"ffn {mt} (hc + router + experts + shared)", ffn, (params["segments"][s][j], X, layers[0], r), len(layers)
    top = {"hc_head": params["hc_head"], "norm": params["norm"], "head": params["head"]}
    yield "head (hc_head + norm + vocab matmul)", hd, (top, X), 1


def _async_rounds(params, cfg, c, knobs, opts, n: int):
    """n jitted rounds dispatched back to back (no host sync in between)."""
    for _ in range(n):
        c = loop.round_jit(params, cfg, c, knobs, opts)
    return c


# ---- trace reading ----------------------------------------------------------------------------------

_HOST_NOISE = ("ThreadpoolListener", "ThunkExecutor", "SlinkyThreadPool", "end: ", "$", "PjitFunction",
               "ParallelLoopRunner", "Wait")


def summarize_trace(trace_dir: str, steps: int, top: int) -> dict:
    """Top ops by summed duration per step from an .xplane.pb (jax.profiler.ProfileData); GPU: the device
    planes' "XLA Ops" lines (or kernel streams); CPU: the XLA thunk events of the host threads."""
    try:
        from jax.profiler import ProfileData
        files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
        if not files:
            return {"top_ops_error": "no .xplane.pb written"}
        pd = ProfileData.from_file(files[-1])
        totals: dict[str, float] = {}
        source = None
        dev = [pl for pl in pd.planes if pl.name.startswith("/device:")]
        if dev:
            for pl in dev:
                lines = list(pl.lines)
                ops = [ln for ln in lines if ln.name == "XLA Ops"]
                chosen = ops or [ln for ln in lines if ln.name.startswith("Stream")] or lines
                for ln in chosen:
                    for ev in ln.events:
                        totals[ev.name] = totals.get(ev.name, 0.0) + ev.duration_ns
                source = f"{pl.name}: " + ("XLA Ops" if ops else "streams")
        else:
            for pl in pd.planes:
                if not pl.name.startswith("/host:CPU"):
                    continue
                for ln in pl.lines:
                    if not ln.name.startswith("tf_XLA"):
                        continue
                    for ev in ln.events:
                        if ev.name.startswith(_HOST_NOISE) or ev.duration_ns <= 0:
                            continue
                        totals[ev.name] = totals.get(ev.name, 0.0) + ev.duration_ns
            source = "/host:CPU XLA thunks (summed over threads)"
        total = sum(totals.values())
        items = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
        return {"top_ops_source": source, "op_time_per_step_us": total / steps / 1e3,
                "top_ops": [{"op": k[:120], "us_per_step": v / steps / 1e3, "share": v / total if total else None}
                            for k, v in items]}
    except Exception as e:  # noqa: BLE001 - report, do not crash
        return {"top_ops_error": f"{type(e).__name__}: {str(e)[:200]}"}


# ---- plan -----------------------------------------------------------------------------------------

def build_plan(a) -> list[dict]:
    """Cases in priority order, each with a deadline (seconds since start) after which it is skipped.

    First format (bf16): the goal cases at (B0, C0) = (first batch, first context) — decode and verify
    of k+1 = max tokens for every kernel variant, the profile, the loop overhead, the other verify widths
    and the spec rounds (k = --loop-k, 1, max first) with the "kernels on" variant — then one corner
    (largest batch and context) and a prefill, then the rest of the matrix. Its deadline leaves
    --format-reserve-s for each other format, which gets decode at (B0, C0) and (largest batch, C0) and
    verify of the widest block, kernels on and off."""
    B0, C0 = a.batches[0], a.contexts[0]
    Bm, Cm = max(a.batches), max(a.contexts)
    impls, best = a.kernels, a.kernels[-1]
    only = set(a.only)
    vs = sorted(k + 1 for k in a.verify_k)
    Smax = vs[-1]
    n_other = len(a.dtypes) - 1
    plan = []

    def add(deadline, section, **kw):
        if section in only:
            case = dict(section=section, **kw)
            if case not in [{k: v for k, v in c.items() if k != "deadline_s"} for c in plan]:
                plan.append(dict(case, deadline_s=deadline))

    fmt = a.dtypes[0]
    dl = a.budget_s - n_other * a.format_reserve_s
    for impl in impls:
        add(dl, "decode", fmt=fmt, impl=impl, batch=B0, context=C0)
    for impl in impls:
        add(dl, "verify", fmt=fmt, impl=impl, batch=B0, context=C0, tokens=Smax)
    for impl in impls:
        add(dl, "profile", fmt=fmt, impl=impl, batch=B0, context=C0, what="trace")
    add(dl, "profile", fmt=fmt, impl=best, batch=B0, context=C0, what="components")
    if "mtp" in a.drafters:
        add(dl, "loop", fmt=fmt, impl=best, batch=B0, context=C0, drafter="mtp", k=a.loop_k)
    for S in vs[:-1]:
        add(dl, "verify", fmt=fmt, impl=best, batch=B0, context=C0, tokens=S)
    first_ks = [k for k in (a.loop_k, min(a.draft_n), max(a.draft_n)) if k in a.draft_n]
    ks = list(dict.fromkeys(first_ks + sorted(a.draft_n)))
    for k in ks:
        for drafter in a.drafters:
            add(dl, "spec", fmt=fmt, impl=best, batch=B0, context=C0, drafter=drafter, k=k)
    for impl in impls:
        add(dl, "decode", fmt=fmt, impl=impl, batch=Bm, context=Cm)
    prefill = [(B, C, max(1, a.prefill_tokens // B)) for C in a.contexts for B in a.prefill_batches]
    prefill = [(B, C, chunk) for B, C, chunk in prefill if chunk < C]
    for B, C, chunk in prefill[:1]:
        for impl in impls:
            add(dl, "prefill", fmt=fmt, impl=impl, batch=B, context=C, tokens=chunk)
    for C in a.contexts:
        for B in a.batches:
            for impl in impls:
                add(dl, "decode", fmt=fmt, impl=impl, batch=B, context=C)
    for C in a.contexts[1:]:
        for impl in impls:
            add(dl, "verify", fmt=fmt, impl=impl, batch=B0, context=C, tokens=Smax)
    for B in a.batches[1:]:
        add(dl, "verify", fmt=fmt, impl=best, batch=B, context=C0, tokens=Smax)
    for B, C, chunk in prefill[1:]:
        for impl in impls:
            add(dl, "prefill", fmt=fmt, impl=impl, batch=B, context=C, tokens=chunk)
    for i, fmt in enumerate(a.dtypes[1:]):
        dl = a.budget_s - (n_other - 1 - i) * a.format_reserve_s
        for impl in impls:
            add(dl, "decode", fmt=fmt, impl=impl, batch=B0, context=C0)
        for impl in impls:
            add(dl, "verify", fmt=fmt, impl=impl, batch=B0, context=C0, tokens=Smax)
        for impl in impls:
            add(dl, "decode", fmt=fmt, impl=impl, batch=Bm, context=C0)
    return plan


def run_case(bench: Bench, case: dict, trace_dir) -> dict:
    s = case["section"]
    if s in ("decode", "verify", "prefill"):
        S = case.get("tokens", 1)
        return bench.block_case(s, case["impl"], case["batch"], case["context"], S)
    if s == "spec":
        return bench.spec_case(case["impl"], case["drafter"], case["k"], case["batch"], case["context"])
    if s == "loop":
        return bench.loop_case(case["impl"], case["drafter"], case["k"], case["batch"], case["context"])
    if s == "profile" and case["what"] == "trace":
        return bench.trace_case(case["impl"], case["batch"], case["context"], trace_dir)
    if s == "profile":
        return bench.components_case(case["impl"], case["batch"], case["context"])
    raise ValueError(s)


# ---- goals and report -----------------------------------------------------------------------------

def goals(results: dict, a) -> list[dict]:
    """The issue's goals at batch 1, bf16, the first of --contexts; each with the measured value, met or
    missed by how much, and what limits it (top costs of the decode-step profile)."""
    B, C = 1, a.contexts[0]
    out = []
    dec = [r for r in results["decode"] if r.get("dtype") == "bf16" and r.get("batch") == B
           and r.get("context") == C and "us" in r]
    g = {"goal": "decode step >= 75% of measured read bandwidth (bf16, batch 1)", "target": GOALS["decode_bw_fraction"],
         "context": C}
    if dec:
        best = max(dec, key=lambda r: r["bw_fraction"])
        g.update(measured=best["bw_fraction"], kernels=best["kernels"],
                 per_kernels={r["kernels"]: r["bw_fraction"] for r in dec},
                 ms_per_token=best["ms_per_token"], bound_ms=best["bound_us"] / 1e3,
                 met=best["bw_fraction"] >= GOALS["decode_bw_fraction"])
        if not g["met"]:
            g["missed_by"] = (f"{GOALS['decode_bw_fraction'] - best['bw_fraction']:.1%} of bandwidth short: the step "
                              f"takes {best['ms_per_token']:.3f} ms, {best['us'] / best['bound_us']:.2f}x the "
                              f"bound {best['bound_us'] / 1e3:.3f} ms (goal: <= "
                              f"{1 / GOALS['decode_bw_fraction']:.2f}x)")
            g["limits"] = _limits(results, best)
    else:
        g.update(measured=None, met=None, missed_by="not measured")
    out.append(g)

    ver = [r for r in results["verify"] if r.get("dtype") == "bf16" and r.get("batch") == B and r.get("context") == C
           and r.get("over_decode") is not None]
    S = max([r["tokens"] for r in ver], default=None)
    g = {"goal": "verify of 6 tokens <= 1.3x one decode step (bf16, batch 1)", "target": GOALS["verify6_over_decode"],
         "context": C, "tokens": S}
    ver = [r for r in ver if r["tokens"] == S]
    if ver:
        best = min(ver, key=lambda r: r["over_decode"])
        g.update(measured=best["over_decode"], kernels=best["kernels"],
                 per_kernels={r["kernels"]: r["over_decode"] for r in ver}, met=best["over_decode"] <= 1.3)
        if S != 6:
            g["note"] = f"measured with {S} tokens (--verify-k), not 6"
        if not g["met"]:
            g["missed_by"] = f"{best['over_decode'] / 1.3 - 1:.1%} over (ratio {best['over_decode']:.2f})"
            dec = next((r for r in results["decode"] if r.get("kernels") == best["kernels"] and r.get("batch") == B
                        and r.get("context") == C and r.get("dtype") == "bf16" and "us" in r), None)
            g["limits"] = (f"active experts read grow from {dec['active_experts_per_layer'] if dec else '?'} to "
                           f"{best['active_experts_per_layer']:.1f} per layer (bound {best['bound_bytes'] / 1e9:.3g} "
                           f"GB vs {dec['bound_bytes'] / 1e9 if dec else float('nan'):.3g} GB, "
                           f"x{best['bound_bytes'] / dec['bound_bytes'] if dec else float('nan'):.2f}); the rest is "
                           "compute that grows with the block (attention over window + selected rows, the S×V head)")
    else:
        g.update(measured=None, met=None, missed_by="not measured")
    out.append(g)

    lp = [r for r in results["loop"] if "device_loop_overhead_us" in r]
    g = {"goal": "on-device loop overhead <= 20 us per round", "target": GOALS["loop_overhead_us"]}
    if lp:
        r = lp[0]
        g.update(measured=r["device_loop_overhead_us"], kernels=r["kernels"], drafter=r["drafter"], k=r["k"],
                 host_loop_overhead_us=r["host_loop_overhead_us"], met=r["device_loop_overhead_us"] <= 20.0)
        if r["device_loop_overhead_us"] < 0:
            g["note"] = ("negative: the while_loop ran faster than back-to-back dispatch of the same round, i.e. "
                         "the overhead is below this measurement's resolution (or the async baseline was "
                         "dispatch-bound / disturbed)")
        if not g["met"]:
            g["missed_by"] = f"{r['device_loop_overhead_us'] - 20.0:.1f} us per round over"
            g["limits"] = ("while_loop per-iteration cost (condition read back / carry copies) measured against "
                           "back-to-back async dispatch of the same jitted round")
    else:
        g.update(measured=None, met=None, missed_by="not measured")
    out.append(g)
    return out


def _limits(results, dec_row) -> str:
    """What the decode step's time goes to: the bound's parts, then the top components (same kernels if
    measured, else another variant) or the top traced ops."""
    parts = (f"bound {dec_row['bound_bytes'] / 1e9:.3g} GB = weights {dec_row['bound_weight_bytes'] / 1e9:.3g} GB "
             f"+ cache {dec_row['bound_cache_bytes'] / 1e6:.3g} MB; ")
    comp = [c for c in results["profile"]["components"] if c.get("context") == dec_row["context"]
            and c.get("batch") == dec_row["batch"] and c.get("components")]
    comp.sort(key=lambda c: c.get("kernels") != dec_row["kernels"])
    if comp:
        top = [r for r in comp[0]["components"] if "us_total" in r][:3]
        return parts + f"top components (kernels {comp[0]['kernels']}): " + "; ".join(
            f"{r['component']} x{r['count']} {r['us_total']:.0f} us ({r['share_of_sum']:.0%})" for r in top)
    tr = [t for t in results["profile"]["traces"] if t.get("kernels") == dec_row["kernels"] and t.get("top_ops")]
    if tr:
        return parts + "top ops: " + "; ".join(f"{o['op']} {o['us_per_step']:.0f} us" for o in tr[0]["top_ops"][:3])
    return parts + "no profile measured"


def _f(x, fmt=".2f"):
    return "-" if x is None else format(x, fmt)


def _sorted(rows, *keys):
    order = {f: i for i, f in enumerate(RUNNABLE_FORMATS)}
    return sorted((r for r in rows if "us" in r or "us_per_round" in r),
                  key=lambda r: (order.get(r.get("dtype"), 9),) + tuple(str(r.get(k)).zfill(8) for k in keys))


def report_tables(out: dict) -> str:
    """Markdown tables of every section, the goals and the summary."""
    L = []
    m = out["meta"]
    L.append(f"# bench_decode {m['date']} — {m['device']} ({m['backend']}), jax {m['jax']}, "
             f"{m['config']['name']}{' (--small: CPU sizes, not the GPU acceptance)' if m['small'] else ''}")
    L.append(f"command: `{m['command']}`; measured read bandwidth {m['bandwidth']['read_GBps']:.1f} GB/s, "
             f"copy {m['bandwidth']['copy_GBps']:.1f} GB/s")
    L.append("\n## decode (one token per sequence)\n")
    L.append("| dtype | kernels | B | context | ms/step | ms/token | bound MB | bound ms | achieved GB/s | % read BW |")
    L.append("|---|---|---|---|---|---|---|---|---|---|")
    for r in _sorted(out["decode"], "context", "batch", "kernels"):
        if "us" in r:
            L.append(f"| {r['dtype']} | {r['kernels']} | {r['batch']} | {r['context']} | {r['us'] / 1e3:.3f} | "
                     f"{r['us'] / 1e3 / r['batch']:.3f} | {r['bound_bytes'] / 1e6:.1f} | {r['bound_us'] / 1e3:.3f} | "
                     f"{r['achieved_GBps']:.1f} | {r['bw_fraction']:.1%} |")
    L.append("\n## verify (k+1 tokens per sequence) vs one decode step\n")
    L.append("| dtype | kernels | B | context | tokens | ms | x decode |")
    L.append("|---|---|---|---|---|---|---|")
    for r in _sorted(out["verify"], "context", "batch", "tokens", "kernels"):
        if "us" in r:
            L.append(f"| {r['dtype']} | {r['kernels']} | {r['batch']} | {r['context']} | {r['tokens']} | "
                     f"{r['us'] / 1e3:.3f} | {_f(r.get('over_decode'))} |")
    L.append("\n## speculative round (on-device loop, forced acceptance)\n")
    L.append("| drafter | k | kernels | B | context | us/round | tokens/round | us/token | x decode | verify us | "
             "draft+accept+observe us | speed-up bound |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in _sorted(out["spec"], "drafter", "k"):
        if "us_per_round" in r:
            L.append(f"| {r['drafter']} | {r['k']} | {r['kernels']} | {r['batch']} | {r['context']} | "
                     f"{r['us_per_round']:.0f} | {r['tokens_per_round']:.1f} | {r['us_per_token']:.0f} | "
                     f"{_f(r.get('round_over_decode'))} | {_f(r.get('verify_us'), '.0f')} | "
                     f"{_f(r.get('draft_accept_observe_us'), '.0f')} | {_f(r.get('speedup_bound_at_full_acceptance'))} |")
    L.append("\n## loop overhead per round (same jitted round)\n")
    L.append("| drafter | k | kernels | device while_loop us | host loop us | async dispatch us | device overhead us | "
             "host overhead us |")
    L.append("|---|---|---|---|---|---|---|---|")
    for r in out["loop"]:
        if "device_loop_overhead_us" in r:
            L.append(f"| {r['drafter']} | {r['k']} | {r['kernels']} | {r['device_us_per_round']:.1f} | "
                     f"{r['host_us_per_round']:.1f} | {r['async_us_per_round']:.1f} | "
                     f"{r['device_loop_overhead_us']:.1f} | {r['host_loop_overhead_us']:.1f} |")
    L.append("\n## prefill (a chunk at the end of the context)\n")
    L.append("| dtype | kernels | B | context | chunk | ms | tokens/s |")
    L.append("|---|---|---|---|---|---|---|")
    for r in _sorted(out["prefill"], "context", "batch", "kernels"):
        if "us" in r:
            L.append(f"| {r['dtype']} | {r['kernels']} | {r['batch']} | {r['context']} | {r['tokens']} | "
                     f"{r['us'] / 1e3:.2f} | {r['tokens_per_s']:.0f} |")
    L.append("\n## decode step: top costs\n")
    for c in out["profile"]["components"]:
        L.append(f"components ({c['dtype']}, kernels {c['kernels']}, B {c['batch']}, context {c['context']}): "
                 f"sum {c['sum_us']:.0f} us vs step {_f(c.get('step_us'), '.0f')} us\n")
        L.append("| component | count | us each | us total | share |")
        L.append("|---|---|---|---|---|")
        for r in c["components"]:
            if "us_total" in r:
                L.append(f"| {r['component']} | {r['count']} | {r['us_each']:.1f} | {r['us_total']:.1f} | "
                         f"{r['share_of_sum']:.0%} |")
            else:
                L.append(f"| {r['component']} | {r['count']} | error: {r['error'][:60]} | | |")
    for t in out["profile"]["traces"]:
        head_ = f"\ntrace ({t['dtype']}, kernels {t['kernels']}, B {t['batch']}, context {t['context']}): "
        if t.get("top_ops"):
            L.append(head_ + f"{t['top_ops_source']}, {t['op_time_per_step_us']:.0f} us of ops per step\n")
            L.append("| op | us/step | share |")
            L.append("|---|---|---|")
            L.extend(f"| `{o['op'][:70]}` | {o['us_per_step']:.1f} | {o['share']:.0%} |" for o in t["top_ops"])
        else:
            L.append(head_ + str(t.get("top_ops_error") or t.get("error")))
    L.append("\n## goals (batch 1)\n")
    L.append("| goal | target | measured | met | missed by | limits |")
    L.append("|---|---|---|---|---|---|")
    for g in out["goals"]:
        L.append(f"| {g['goal']} | {g['target']} | {_f(g.get('measured'), '.3f')} ({g.get('kernels', '-')}) | "
                 f"{g.get('met')} | {g.get('missed_by', '')} | {g.get('limits', '')} {g.get('note', '')} |")
    L.append("\n## summary\n")
    L.append(summary_table(out))
    if out["skipped"]:
        L.append(f"\nskipped (time budget): {len(out['skipped'])} cases")
    if out["errors"]:
        L.append(f"\nerrors: {len(out['errors'])} cases (see JSON)")
    return "\n".join(L)


def summary_rows(out: dict) -> list[tuple[str, str, str]]:
    """(metric, goal, value) rows for the README table."""
    rows = []
    for x in out["goals"]:
        if x.get("measured") is not None:
            val = f"{x['measured']:.3g} ({x['kernels']})" + (" ✓" if x["met"] else " ✗")
            rows.append((x["goal"], str(x["target"]), val))
    for r in _sorted(out["decode"], "context", "batch", "kernels"):
        if "us" in r:
            rows.append((f"decode ms/step (ms/token), {r['dtype']}, B={r['batch']}, ctx {r['context']}, "
                         f"kernels {r['kernels']}", "",
                         f"{r['us'] / 1e3:.3f} ({r['us'] / 1e3 / r['batch']:.3f}), {r['bw_fraction']:.0%} of read BW"))
    for r in _sorted(out["verify"], "context", "batch", "kernels"):
        if r.get("over_decode") is not None and r["tokens"] == max(v["tokens"] for v in out["verify"] if "us" in v):
            rows.append((f"verify {r['tokens']} tokens / decode step, {r['dtype']}, B={r['batch']}, ctx {r['context']}, "
                         f"kernels {r['kernels']}", "", f"{r['over_decode']:.2f}"))
    for r in _sorted(out["spec"], "drafter", "k"):
        if "us_per_round" in r:
            rows.append((f"{r['drafter']} k={r['k']} round / decode step (forced accept)", "",
                         f"{_f(r.get('round_over_decode'))}, speed-up bound {_f(r.get('speedup_bound_at_full_acceptance'))}"))
    for r in _sorted(out["prefill"], "context", "batch", "kernels"):
        if "us" in r:
            rows.append((f"prefill tokens/s, B={r['batch']}, ctx {r['context']}, kernels {r['kernels']}", "",
                         f"{r['tokens_per_s']:.0f}"))
    return rows


def summary_table(out: dict) -> str:
    L = ["| metric | goal | value |", "|---|---|---|"]
    L.extend(f"| {a} | {b} | {c} |" for a, b, c in summary_rows(out))
    return "\n".join(L)


# ---- main -----------------------------------------------------------------------------------------

def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _names(choices):
    def parse(s):
        out = [x.strip() for x in s.split(",") if x.strip()]
        bad = [x for x in out if x not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {choices}")
        return out
    return parse


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="CPU sizes: tiny dims, contexts 64,256, batches 1,2")
    ap.add_argument("--quick", action="store_true",
                    help="one variant per section (3-layer model, reference kernels, bf16, batch 1, MTP k=1): a "
                         "smoke test of the report; with --small it runs in < 1 min on 2 CPU cores")
    ap.add_argument("--pairs", type=int, default=None, help="HCA/CSA pairs after the 3 leading layers (default 1: 5 layers)")
    ap.add_argument("--dtypes", type=_names(RUNNABLE_FORMATS), default=None,
                    help="weight storage, comma list (default bf16,fp8-experts)")
    ap.add_argument("--kernels", type=_names(backends.CHOICES), default=None,
                    help="kernel variants, comma list of auto | reference | pallas (dsv4_jax.backends; each fills the "
                         "config's static backends field); the last is the 'kernels on' one (default reference,pallas)")
    ap.add_argument("--batches", type=_ints, default=None, help="default 1,8,32 (--small: 1,2); the first is the goal batch")
    ap.add_argument("--contexts", type=_ints, default=None,
                    help="default 4096,65536 (--small: 64,256); the first is the goal context")
    ap.add_argument("--verify-k", type=_ints, default=None, help="drafts k of the verify block k+1 (default 1..5; --small 1,5)")
    ap.add_argument("--draft-n", type=_ints, default=None, help="draft_n_max of the spec rounds (default 1..5; --small 1,5)")
    ap.add_argument("--drafters", type=_names(("mtp", "dspark")), default=None, help="default mtp,dspark")
    ap.add_argument("--loop-k", type=int, default=None, help="draft_n_max of the loop-overhead round (MTP; default 3)")
    ap.add_argument("--loop-rounds", type=int, default=None, help="rounds per timed loop (default 32, --small 4)")
    ap.add_argument("--loop-reps", type=int, default=None, help="timed repetitions of each loop (default 3)")
    ap.add_argument("--prefill-tokens", type=int, default=None, help="tokens per prefill call, B·chunk (default 2048; --small 6)")
    ap.add_argument("--prefill-batches", type=_ints, default=None, help="default 1")
    ap.add_argument("--only", type=_names(SECTIONS), default=list(SECTIONS), help=f"sections, comma list of {SECTIONS}")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per case (default 10, --small 3)")
    ap.add_argument("--trace-steps", type=int, default=None, help="decode steps in the trace (default 3)")
    ap.add_argument("--component-reps", type=int, default=None, help="repetitions per component call (default 10)")
    ap.add_argument("--top", type=int, default=12, help="top ops listed from the trace")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="skip cases once this many seconds have passed (default 400; --small 900)")
    ap.add_argument("--format-reserve-s", type=float, default=None,
                    help="seconds of the budget kept for each weight format after the first (default 75)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace-dir", default=None, help="keep the profiler traces here (default: a temp dir)")
    ap.add_argument("--out", default=None, help="write the JSON here (and the tables to the same name .md)")
    ap.add_argument("--plan-only", action="store_true", help="print the memory plan and the cases, run nothing")
    ap.add_argument("--render", metavar="JSON", default=None,
                    help="measure nothing: recompute goals / summary of a saved result and rewrite its .md")
    a = ap.parse_args(argv)
    if a.quick:      # one variant per section: a smoke test of the whole report (the CPU test uses it)
        defaults = dict(pairs=0, dtypes=["bf16"], kernels=["reference"], batches=[1], contexts=[64 if a.small else 4096],
                        verify_k=[1], draft_n=[1], drafters=["mtp"], loop_k=1, loop_rounds=2, loop_reps=1,
                        prefill_tokens=2, prefill_batches=[1], iters=2, trace_steps=2, component_reps=2,
                        budget_s=600.0)
    elif a.small:
        defaults = dict(batches=[1, 2], contexts=[64, 256], verify_k=[1, 5], draft_n=[1, 5], loop_k=1,
                        loop_rounds=4, loop_reps=2, prefill_tokens=6, prefill_batches=[1], iters=3,
                        component_reps=4, budget_s=900.0)
    else:
        defaults = {}
    defaults = {**dict(pairs=1, dtypes=list(RUNNABLE_FORMATS), kernels=list(IMPLS), batches=[1, 8, 32],
                       contexts=[4096, 65536], verify_k=[1, 2, 3, 4, 5], draft_n=[1, 2, 3, 4, 5],
                       drafters=["mtp", "dspark"], loop_k=3, loop_rounds=32, loop_reps=3, prefill_tokens=2048,
                       prefill_batches=[1], iters=10, trace_steps=3, component_reps=10, budget_s=400.0,
                       format_reserve_s=75.0), **defaults}
    for k, v in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    return a


def render(path: str) -> dict:
    """Recompute the derived parts (goals, summary, tables) of a saved result; the measurements are unchanged."""
    import types
    with open(path) as f:
        out = json.load(f)
    out["goals"] = goals(out, types.SimpleNamespace(contexts=out["meta"]["plan"]["contexts"]))
    out["summary"] = [{"metric": m, "goal": g, "value": v} for m, g, v in summary_rows(out)]
    out["meta"]["rendered"] = datetime.datetime.now().isoformat(timespec="seconds")
    text = report_tables(out)
    with open(path, "w") as f:
        json.dump(out, f, indent=1, default=str)
    with open(os.path.splitext(path)[0] + ".md", "w") as f:
        f.write(text + "\n")
    print(text)
    return out


def run(argv=None) -> dict:
    """Parse the command line, measure (or --render a saved result), write --out; returns the report."""
    t_start = time.perf_counter()
    a = parse_args(argv)
    if a.render:
        return render(a.render)
    # the 5-layer model needs ~83 GB of weights plus temporaries: before JAX starts its GPU client, let XLA
    # take most of the GPU's memory (it selects no code path)
    cli.claim_device_memory(0.94)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    command = "dsv4-bench-decode " + " ".join(sys.argv[1:] if argv is None else argv)
    config = small_flash(a.pairs) if a.small else with_pairs(flash(), a.pairs)
    dev = jax.devices()[0]
    bw = measure_bandwidth((1 << 26) if a.small else (1 << 32), max(3, a.iters))
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "device": str(dev.device_kind),
            "backend": jax.default_backend(), "jax": jax.__version__, "host": platform.node(),
            "python": platform.python_version(), "command": command, "small": a.small,
            "pallas_interpret_mode": variant(config, "pallas").backends.interpret, "bandwidth": bw,
            "backends": {impl: variant(config, impl).backends.describe() for impl in a.kernels},
            "config": {k: v for k, v in config.to_dict().items() if k != "yarn"},
            "plan": {k: v for k, v in vars(a).items() if k not in ("out", "trace_dir")},
            "bytes_bound_formula": traffic.__doc__.strip(),
            "forced_acceptance": verify_forced.__doc__,
            "notes": ["decode states are synthetic (random rows, pos = context); the bound counts what a step at "
                      "that context must read", "CPU runs use Pallas interpret mode: 'pallas' timings there are "
                      "not kernel speed", "the MTP block and DSpark stages share one routed-expert set"]}
    print(json.dumps({k: v for k, v in meta.items() if k not in ("config", "bytes_bound_formula")}), flush=True)
    bench_max_block = max(a.verify_k + a.draft_n + [1]) + 1
    margin = a.loop_rounds * bench_max_block + bench_max_block + 2
    need_drafters = tuple(a.drafters) if {"spec", "loop"} & set(a.only) else ()
    meta["memory_plan"] = [memory_plan(config, f, need_drafters if i == 0 else (), a.batches, a.contexts, margin,
                                       bench_max_block) for i, f in enumerate(a.dtypes)]
    for mp in meta["memory_plan"]:
        print(f"memory plan {mp['format']}: target {mp['target_weights_GB']:.4g} GB + drafters "
              f"{mp['drafter_weights_GB']:.4g} GB + largest state {mp['largest_decode_state_GB']:.4g} GB = "
              f"{mp['total_GB']:.4g} GB (one format resident at a time; drafters with the first only)", flush=True)
    plan = build_plan(a)
    print(f"plan: {len(plan)} cases, budget {a.budget_s:.0f} s", flush=True)
    if a.plan_only:
        for c in plan:
            print("  " + _line(c, {}), flush=True)
        return {"meta": meta, "plan": plan}
    trace_dir = a.trace_dir
    bench = Bench(a, config, bw)
    skipped, errors = [], []
    fmt_now = None
    for case in plan:
        if time.perf_counter() - t_start > case["deadline_s"]:
            skipped.append(dict(case, reason=f"past its deadline ({case['deadline_s']:.0f} s of --budget-s "
                                             f"{a.budget_s:.0f})"))
            continue
        if case["fmt"] != fmt_now:
            bench.params = None
            gc.collect()
            t = time.perf_counter()
            bench.params = build_params(config, case["fmt"], need_drafters if case["fmt"] == a.dtypes[0] else (),
                                        a.seed)
            bench.fmt = fmt_now = case["fmt"]
            print(f"weights {fmt_now}: {tree_bytes(bench.params) / 1e9:.2f} GB on device in "
                  f"{time.perf_counter() - t:.1f} s", flush=True)
        t = time.perf_counter()
        try:
            row = run_case(bench, case, trace_dir)
        except Exception as e:  # noqa: BLE001 - one failing case must not stop the run
            row = dict({k: v for k, v in case.items() if k != "deadline_s"}, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
            errors.append(row)
            traceback.print_exc(limit=3)
        row["case_s"] = time.perf_counter() - t
        s = case["section"]
        if s == "profile":
            bench.results["profile"]["traces" if case["what"] == "trace" else "components"].append(row)
        else:
            bench.results[s].append(row)
        print(f"[{time.perf_counter() - t_start:6.1f}s] {_line(case, row)}", flush=True)
    bench.params = None
    out = {"meta": meta, **bench.results, "skipped": skipped, "errors": errors}
    out["goals"] = goals(out, a)
    out["meta"]["wall_s"] = time.perf_counter() - t_start
    out["summary"] = [{"metric": m, "goal": g, "value": v} for m, g, v in summary_rows(out)]
    text = report_tables(out)
    print(text, flush=True)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1, default=str)
        with open(os.path.splitext(a.out)[0] + ".md", "w") as f:
            f.write(text + "\n")
    print("\nH200 command (one call, ~8 min including compiles):\n  " + H200_COMMAND, flush=True)
    return out


H200_COMMAND = ("pip install -q -e . --no-deps --no-build-isolation; PYTHONPATH=$PWD python -m "
                "dsv4_jax.research.bench_decode --out $OUT/decode_h200.json --trace-dir $OUT/trace")


def main(argv=None) -> int:
    """The `dsv4-bench-decode` console script: `run`, exit status 0."""
    run(argv)
    return 0


def _line(case, row) -> str:
    desc = " ".join(f"{k}={v}" for k, v in case.items() if k not in ("section", "deadline_s"))
    if not row:
        return f"{case['section']:8s} {desc} (deadline {case.get('deadline_s', 0):.0f} s)"
    if "error" in row:
        return f"{case['section']:8s} {desc}: ERROR {row['error'][:160]}"
    for key, unit in (("us", "us"), ("us_per_round", "us/round"), ("device_loop_overhead_us", "us overhead"),
                      ("sum_us", "us (components)"), ("op_time_per_step_us", "us of ops/step")):
        if row.get(key) is not None:
            extra = f" first call {row['first_call_s']:.1f}s" if "first_call_s" in row else ""
            return f"{case['section']:8s} {desc}: {row[key]:.1f} {unit}{extra} ({row['case_s']:.1f}s)"
    return f"{case['section']:8s} {desc}: done ({row['case_s']:.1f}s) {row.get('top_ops_error', '')}"


if __name__ == "__main__":
    sys.exit(main())
