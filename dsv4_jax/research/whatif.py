"""What-if: every greedy speculative setting's accepted lengths from one teacher-forced pass (docs/whatif.md).

Greedy speculative decoding is lossless: whatever the drafter proposes, the output is the target's own greedy
continuation y_0, y_1, … of the prompt (y_0 at position P = the prompt's length, sampled by the prefill).
A round of the loop starts at an anchor, the position p = P + i of the last emitted token y_i, with the target
having processed positions < p and the drafter having observed them (the target's hidden states / taps at
positions j < p and the token after each, y-shifted). So at every anchor the drafter's state, and with it its
proposal d_1..d_k and its stop rule's n_draft, is a function of the continuation alone — not of the setting
nor of the rounds before. This module computes them for every anchor at once (teacher forcing), then walks
each setting's rounds:

    i = 0, out = 1                                  (y_0 came from the prefill)
    round at anchor i:  n = min(n_rule(i, τ), w),  a = #leading j ≤ n with d_j(i) = y_{i+j}
                        emit min(a + 1, budget) tokens (stop after EOS), i += a + 1

which is what `speculative.round.commit` does with greedy verification (`ops.verification`): accept the
longest matching prefix of the drafts, then the target's token. A drafter's state at an anchor depends on a
bounded window of committed positions (`Drafter.context_rows`: MTP and DSpark read the last `sliding_window`
rows; None: all, e.g. the n-gram drafter), so the pass feeds each anchor only those rows — through the
drafter's own `begin` / `observe` / `propose_scored`, the methods the loop calls.

    path = continuation(...)       the plain greedy continuation (N + K + 1 tokens, never stopping at EOS)
    props = proposals(...)         per anchor: drafts [A,K], n_draft per threshold [T,A], draft probabilities
                                   and top-1/top-2 margins [A,K], confidences (DSpark) [A,K]
    trace = walk(...)              a fixed-width setting's rounds: [[drafted, accepted], ...]

Exactness: the pass computes the same functions as the loop on the same inputs, in other batch shapes, so
floating-point sums may differ in the last bits; a draft whose top-1 and top-2 probabilities lie within such
an error of each other (a near-tie, `margin`) can flip. `compare` names each difference with its margins.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..bundle import unbundle
from ..config import ModelConfig
from ..drafters import registry
from ..drafters.base import Knobs
from ..model.decode import process_block
from ..model.state import init_state
from ..ops import width
from ..speculative.generate import generate
from ..speculative.program import Program

ANCHOR_CHUNK = 256       # anchors per call of the drafter pass (one compiled program for every chunk)


@dataclasses.dataclass(frozen=True)
class Path:
    """One prompt's plain greedy continuation."""

    prompt: np.ndarray       # [P] int32
    tokens: np.ndarray       # [M] int32 y_0..y_{M−1}, y_0 at position P

    @property
    def sequence(self) -> np.ndarray:
        """prompt ++ continuation: [P + M]."""
        return np.concatenate([self.prompt, self.tokens]).astype(np.int32)


def continuations(params: dict, config, prompts: Sequence[Sequence[int]], n_tokens: int, *,
                  batch: int = 8) -> list[Path]:
    """The target's greedy continuation of each prompt, n_tokens long, never stopping at EOS (`generate` with no
    drafter; the walk stops at EOS itself)."""
    out = []
    for lo in range(0, len(prompts), batch):
        group = [list(p) for p in prompts[lo:lo + batch]]
        tokens, _ = generate(params, config, group, n_tokens, eos_token_id=-1)
        out += [Path(np.asarray(p, np.int32), np.asarray(t, np.int32)) for p, t in zip(group, tokens)]
    return out


@functools.partial(jax.jit, static_argnames=("config", "taps"))
def _target_pass(params: dict, config: ModelConfig, tokens: jax.Array, lengths: jax.Array, *, taps: tuple):
    """The target on right-padded sequences tokens [B,S] in one block. -> (aux {"hidden" [B,S,n,D], "taps"
    [B,S,len(taps),D]}, argmax [B,S], top-1 − top-2 probability [B,S])."""
    state = init_state(config, tokens.shape[0], tokens.shape[1], 1, params["embed"].dtype)
    logits, _, aux = process_block(params, config, state, tokens, lengths, taps)
    return aux, jnp.argmax(logits, axis=-1).astype(jnp.int32), _margin(jax.nn.softmax(logits.astype(jnp.float32)))


def _margin(probs: jax.Array) -> jax.Array:
    """top-1 − top-2 of probs [..., V] -> [...]."""
    top2 = jax.lax.top_k(probs, 2)[0]
    return top2[..., 0] - top2[..., 1]


@functools.partial(jax.jit, static_argnames=("config", "program", "rows_needed", "max_len"))
def _anchored(params: dict, config: ModelConfig, aux: dict, seq: jax.Array, row: jax.Array, anchor: jax.Array,
              knobs: Knobs, key, *, program: Program, rows_needed: int, max_len: int):
    """The drafter's proposal at anchors anchor [A] of sequences seq [B,S] (row [A]: which), its state built by
    `observe` of the rows_needed committed positions before each anchor (aux: the target's, full sequences).
    -> (drafts [A,K], n_draft [A], draft probability [A,K], top-1 − top-2 margin [A,K], conf [A,K] or −1)."""
    S = seq.shape[1]
    start = jnp.maximum(anchor - rows_needed, 0)
    idx = jnp.minimum(start[:, None] + jnp.arange(rows_needed)[None, :], S - 1)            # [A,L]
    window = {name: a[row[:, None], idx] for name, a in aux.items()}
    nxt = seq[row[:, None], jnp.minimum(idx + 1, S - 1)]
    run = program.bind(params, config)
    dtype = params["embed"].dtype
    st = program.drafter.begin(run, anchor.shape[0], max_len, dtype, knobs)
    st = program.drafter.observe(run, st, window, nxt, start, anchor - start)
    drafts, q, n_draft, conf = program.drafter.propose_scored(run, st, anchor, seq[row, anchor], key, knobs, True)
    conf = jnp.full(drafts.shape, -1.0, jnp.float32) if conf is None else conf
    return drafts, n_draft, width.draft_probability(drafts, q), _margin(q), conf


@dataclasses.dataclass(frozen=True)
class Proposals:
    """A drafter's greedy proposals at every anchor i = 0..A−1 of each path (anchor position P + i)."""

    drafts: np.ndarray        # [n_paths, A, K]
    n_draft: np.ndarray       # [n_thresholds, n_paths, A] the drafter's stop rule at each threshold (<= K)
    thresholds: tuple         # the stop knob's values (Drafter.stop_knob; (0.0,) without one)
    probability: np.ndarray   # [n_paths, A, K] each draft's probability under the drafter
    margin: np.ndarray        # [n_paths, A, K] top-1 − top-2 draft probability (near-ties)
    conf: np.ndarray          # [n_paths, A, K] the drafter's confidences (−1: no confidence head)


@dataclasses.dataclass(frozen=True)
class TargetPass:
    """The target along the paths: one block per path, right-padded to the longest."""

    aux: dict                 # {"hidden" [B,S,n,D], "taps" [B,S,len(taps),D]}
    tokens: np.ndarray        # [B,S] the paths' sequences (prompt ++ continuation), zero-padded
    taps: tuple               # the tap layers in aux["taps"]
    argmax: np.ndarray        # [B,S] the target's greedy token after each position
    margin: np.ndarray        # [B,S] its top-1 − top-2 probability (near-ties of the target)


def target_pass(params: dict, config: ModelConfig, paths: Sequence[Path], taps: tuple) -> TargetPass:
    """The target along the paths with the tap layers taps (the union of the drafters')."""
    seqs = [p.sequence for p in paths]
    S = max(len(s) for s in seqs)
    tokens = np.zeros((len(seqs), S), np.int32)
    for b, s in enumerate(seqs):
        tokens[b, :len(s)] = s
    aux, argmax, margin = _target_pass(params, config, jnp.asarray(tokens),
                                       jnp.asarray([len(s) for s in seqs], jnp.int32), taps=tuple(taps))
    return TargetPass(aux, tokens, tuple(taps), np.asarray(argmax), np.asarray(margin))


def proposals(params: dict, config, paths: Sequence[Path], drafter: str, k: int, n_anchors: int,
              thresholds: Sequence[float] = (0.0,), options=None, target: TargetPass | None = None) -> Proposals:
    """The drafter's proposals (k drafts, greedy) at anchors 0..n_anchors−1 of every path, at each value of its
    stop knob. target: a `target_pass` to reuse (its taps must contain the drafter's)."""
    config, bundle = unbundle(config)
    d = registry.get(drafter)
    setup = d.configure(params, config, k, d.options(options), dict(bundle))
    program = Program(drafter=d, setup=setup, greedy=True)
    if target is None:
        target = target_pass(params, config, paths, setup.taps)
    full = {"hidden": target.aux["hidden"],
            "taps": target.aux["taps"][:, :, [target.taps.index(t) for t in setup.taps]]}
    seq = target.tokens
    S = seq.shape[1]
    need = d.context_rows(program.bind(params, config))
    rows_needed = S if need is None else min(need, S)
    pairs = [(b, len(p.prompt) + i) for b, p in enumerate(paths) for i in range(n_anchors)]
    knob = d.stop_knob
    values = tuple(thresholds) if knob else (0.0,)
    chunk = min(ANCHOR_CHUNK, len(pairs))
    outs: list[list] = [[] for _ in values]
    key = jax.random.PRNGKey(0)
    for lo in range(0, len(pairs), chunk):
        part = pairs[lo:lo + chunk] + [pairs[-1]] * (chunk - len(pairs[lo:lo + chunk]))
        row, anchor = (jnp.asarray(np.array(x, np.int32)) for x in zip(*part))
        for t, v in enumerate(values):
            opts = d.options(options, **({knob: v} if knob else {}))
            knobs = Knobs(temperature=jnp.float32(1e-6), top_p=jnp.float32(1.0), drafter=d.knobs(opts))
            outs[t].append([np.asarray(x) for x in _anchored(
                params, config, full, jnp.asarray(seq), row, anchor, knobs, key, program=program,
                rows_needed=rows_needed, max_len=S + setup.k + 2)])
    n = len(pairs)
    cat = lambda t, j: np.concatenate([o[j] for o in outs[t]])[:n].reshape((len(paths), n_anchors) + outs[t][0][j].shape[1:])
    return Proposals(drafts=cat(0, 0), n_draft=np.stack([cat(t, 1) for t in range(len(values))]), thresholds=values,
                     probability=cat(0, 2), margin=cat(0, 3), conf=cat(0, 4))


def walk(path: Path, drafts: np.ndarray, n_rule: np.ndarray, w: int, max_new_tokens: int, eos: int = -1):
    """The rounds of a fixed-width greedy run along path: drafts [A,K] and n_rule [A] at each anchor, w drafts
    verified per round. -> (trace [[drafted, accepted] per round], tokens emitted)."""
    y, out, i, trace = path.tokens, 1, 0, []
    done = out >= max_new_tokens or y[0] == eos
    while not done:
        n = int(min(n_rule[i], w))
        match = drafts[i, :n] == y[i + 1:i + 1 + n]
        a = int(np.argmin(match)) if not match.all() else n
        trace.append([n, a])
        emitted = y[i + 1:i + 1 + min(a + 1, max_new_tokens - out)]
        hit = np.flatnonzero(emitted == eos) if eos >= 0 else []
        out += int(hit[0]) + 1 if len(hit) else len(emitted)
        done = len(hit) > 0 or out >= max_new_tokens
        i += a + 1
    return trace, out
