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
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..bundle import unbundle
from ..config import ModelConfig
from ..drafters import registry
from ..drafters.base import Knobs
from ..drafters.precision import AS_LOADED, drafter_at_precision
from ..model.decode import advance, process_block
from ..model.state import init_state
from ..ops import width
from ..ops.sampling import filtered_probs
from ..speculative.generate import generate
from ..speculative.options import LONG_PROMPT_CHUNK
from ..speculative import width_policy
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
    drafter; the walk stops at EOS itself). Every batch padded to the same shape: one compiled program."""
    width_ = max(len(p) for p in prompts)
    size = min(batch, len(prompts))
    out = []
    for lo in range(0, len(prompts), size):
        group = [list(p) for p in prompts[lo:lo + size]]
        filled = group + [group[0]] * (size - len(group))
        tokens, _ = generate(params, config, filled, n_tokens, eos_token_id=-1, pad_to=width_,
                             max_len=width_ + n_tokens + 1)
        out += [Path(np.asarray(p, np.int32), np.asarray(t, np.int32)) for p, t in zip(group, tokens)]
    return out


@functools.partial(jax.jit, static_argnames=("config", "taps", "tempered"), donate_argnames=("state",))
def _target_chunk(params: dict, config: ModelConfig, state, tokens: jax.Array, n_valid: jax.Array, *, taps: tuple,
                  tempered: tuple | None = None):
    """The target on one chunk tokens [B,C] (n_valid [B] real). -> (state advanced, aux {"hidden" [B,C,n,D],
    "taps" [B,C,len(taps),D]}, argmax [B,C], top-1 − top-2 probability [B,C], and with tempered = (T, top_p)
    the sampling distributions [B,C,V] (`ops.sampling.filtered_probs`), else None)."""
    logits, state, aux = process_block(params, config, state, tokens, n_valid, taps)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    dist = None if tempered is None else filtered_probs(logits, *tempered)
    return advance(state, n_valid), aux, jnp.argmax(logits, axis=-1).astype(jnp.int32), _margin(probs), dist


def _margin(probs: jax.Array) -> jax.Array:
    """top-1 − top-2 of probs [..., V] -> [...]."""
    top2 = jax.lax.top_k(probs, 2)[0]
    return top2[..., 0] - top2[..., 1]


def _state_at(params: dict, config: ModelConfig, aux: dict, seq: jax.Array, row: jax.Array, anchor: jax.Array,
              knobs: Knobs, program: Program, rows_needed: int, max_len: int):
    """The drafter's state at anchors anchor [A] of sequences seq [B,S] (row [A]: which): `observe` of the
    rows_needed committed positions before each anchor (aux: the target's, full sequences). -> (run, state)."""
    S = seq.shape[1]
    start = jnp.maximum(anchor - rows_needed, 0)
    idx = jnp.minimum(start[:, None] + jnp.arange(rows_needed)[None, :], S - 1)            # [A,L]
    window = {name: a[row[:, None], idx] for name, a in aux.items()}
    nxt = seq[row[:, None], jnp.minimum(idx + 1, S - 1)]
    run = program.bind(params, config)
    st = program.drafter.begin(run, anchor.shape[0], max_len, params["embed"].dtype, knobs)
    return run, program.drafter.observe(run, st, window, nxt, start, anchor - start)


@functools.partial(jax.jit, static_argnames=("config", "program", "rows_needed", "max_len"))
def _anchored(params: dict, config: ModelConfig, aux: dict, seq: jax.Array, row: jax.Array, anchor: jax.Array,
              knobs: Knobs, key, *, program: Program, rows_needed: int, max_len: int):
    """The drafter's greedy proposal at each anchor (`_state_at`). -> (drafts [A,K], n_draft [A], draft
    probability [A,K], top-1 − top-2 margin [A,K], conf [A,K] or −1)."""
    run, st = _state_at(params, config, aux, seq, row, anchor, knobs, program, rows_needed, max_len)
    drafts, q, n_draft, conf = program.drafter.propose_scored(run, st, anchor, seq[row, anchor], key, knobs, True)
    conf = jnp.full(drafts.shape, -1.0, jnp.float32) if conf is None else conf
    return drafts, n_draft, width.draft_probability(drafts, q), _margin(q), conf


@functools.partial(jax.jit, static_argnames=("config", "program", "rows_needed", "max_len"))
def _alpha_along(params: dict, config: ModelConfig, aux: dict, seq: jax.Array, probs: jax.Array, row: jax.Array,
                 anchor: jax.Array, knobs: Knobs, key, *, program: Program, rows_needed: int, max_len: int):
    """At each anchor [A] -> (α [A,K], log ratio [A,K]): α_j = Σ_v min(p_j(v), q_j(v)) and log q_j(y_j) − log p_j(y_j)
    at the sequence's own next token y_j, q_j the drafter's distribution of draft j with its chain fed the sequence's
    own next tokens (`Drafter.propose_along`), p_j the target's (probs [B,S,V], tempered as q) at the position
    before that token."""
    run, st = _state_at(params, config, aux, seq, row, anchor, knobs, program, rows_needed, max_len)
    K, S = program.k, seq.shape[1]
    at = jnp.minimum(anchor[:, None] + jnp.arange(K)[None, :], S - 1)                      # [A,K]
    nxt = seq[row[:, None], jnp.minimum(at + 1, S - 1)]                                    # [A,K] y_{i+1..i+K}
    q = program.drafter.propose_along(run, st, anchor, seq[row, anchor], nxt, key, knobs)
    p = probs[row[:, None], at]
    at_y = lambda x: jnp.take_along_axis(x, nxt[..., None], axis=-1)[..., 0]
    log_ratio = jnp.log(at_y(q)) - jnp.log(jnp.maximum(at_y(p), 1e-30))                  # −inf where q(y) = 0
    return jnp.sum(jnp.minimum(p, q), axis=-1), log_ratio


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
    probs: np.ndarray | None = None   # [B,S,V] its sampling distribution at tempered = (T, top_p)
    tempered: tuple | None = None


def target_pass(params: dict, config: ModelConfig, paths: Sequence[Path], taps: tuple,
                chunk: int = LONG_PROMPT_CHUNK, tempered: tuple | None = None) -> TargetPass:
    """The target along the paths with the tap layers taps (the union of the drafters'), in chunks of at most
    `chunk` tokens (one program for every chunk); tempered = (T, top_p): also its sampling distributions."""
    seqs = [p.sequence for p in paths]
    lengths = np.array([len(s) for s in seqs], np.int32)
    C = min(chunk, int(lengths.max()))
    S = -(-int(lengths.max()) // C) * C
    tokens = np.zeros((len(seqs), S), np.int32)
    for b, s in enumerate(seqs):
        tokens[b, :len(s)] = s
    state = init_state(config, len(seqs), S, C, params["embed"].dtype)
    parts = []
    for lo in range(0, S, C):
        state, *out = _target_chunk(params, config, state, jnp.asarray(tokens[:, lo:lo + C]),
                                    jnp.asarray(np.clip(lengths - lo, 0, C), jnp.int32), taps=tuple(taps),
                                    tempered=tempered)
        parts.append(jax.device_get(out))
    aux = {name: np.concatenate([p[0][name] for p in parts], axis=1) for name in parts[0][0]}
    return TargetPass(aux, tokens, tuple(taps), np.concatenate([p[1] for p in parts], axis=1),
                      np.concatenate([p[2] for p in parts], axis=1),
                      None if tempered is None else np.concatenate([p[3] for p in parts], axis=1), tempered)


@dataclasses.dataclass(frozen=True)
class _Anchors:
    """A drafter configured on the model and the target pass's inputs on the device: what `_anchored` and
    `_alpha_along` take besides the anchors."""

    config: ModelConfig
    program: Program
    aux: dict                 # {"hidden" [B,S,n,D], "taps" [B,S,len(program.setup.taps),D]}
    seq: jax.Array            # [B,S] the paths' sequences (`TargetPass.tokens`)
    rows_needed: int          # committed rows fed before each anchor (`Drafter.context_rows`, at most S)
    pairs: list               # (path, anchor position) of anchors 0..n_anchors−1 of every path, path-major

    @property
    def max_len(self) -> int:
        return self.seq.shape[1] + self.program.k + 2


def _anchors(params: dict, config, paths: Sequence[Path], drafter: str, k: int, n_anchors: int, options,
             target: TargetPass | None, greedy: bool) -> _Anchors:
    """Configure drafter (k drafts, options) and bind the target pass (None: run one with its taps) for passes
    over anchors 0..n_anchors−1 of every path."""
    config, bundle = unbundle(config)
    d = registry.get(drafter)
    setup = d.configure(params, config, k, d.options(options), dict(bundle))
    program = Program(drafter=d, setup=setup, greedy=greedy)
    if target is None:
        target = target_pass(params, config, paths, setup.taps)
    aux = {"hidden": jnp.asarray(target.aux["hidden"]),
           "taps": jnp.asarray(target.aux["taps"][:, :, [target.taps.index(t) for t in setup.taps]])}
    seq = jnp.asarray(target.tokens)
    S = seq.shape[1]
    need = d.context_rows(program.bind(params, config))
    pairs = [(b, len(p.prompt) + i) for b, p in enumerate(paths) for i in range(n_anchors)]
    return _Anchors(config, program, aux, seq, S if need is None else min(need, S), pairs)


def _chunks(pairs: list):
    """Yield (row [C], anchor [C]) int32 of each run of C = min(ANCHOR_CHUNK, len(pairs)) pairs, the last padded
    with copies of the last pair (one compiled program for every chunk)."""
    chunk = min(ANCHOR_CHUNK, len(pairs))
    for lo in range(0, len(pairs), chunk):
        part = pairs[lo:lo + chunk] + [pairs[-1]] * (chunk - len(pairs[lo:lo + chunk]))
        yield tuple(jnp.asarray(np.array(x, np.int32)) for x in zip(*part))


def _per_anchor(parts: list, n_paths: int, n_anchors: int) -> np.ndarray:
    """The chunks' outputs [C, ...] (`_chunks`) -> [n_paths, n_anchors, ...], the padding dropped."""
    return np.concatenate(parts)[:n_paths * n_anchors].reshape((n_paths, n_anchors) + parts[0].shape[1:])


def proposals(params: dict, config, paths: Sequence[Path], drafter: str, k: int, n_anchors: int,
              thresholds: Sequence[float] = (0.0,), options=None, target: TargetPass | None = None) -> Proposals:
    """The drafter's proposals (k drafts, greedy) at anchors 0..n_anchors−1 of every path, at each value of its
    stop knob. target: a `target_pass` to reuse (its taps must contain the drafter's)."""
    an = _anchors(params, config, paths, drafter, k, n_anchors, options, target, greedy=True)
    d = an.program.drafter
    knob = d.stop_knob
    values = tuple(thresholds) if knob else (0.0,)
    outs: list[list] = [[] for _ in values]
    key = jax.random.PRNGKey(0)
    for row, anchor in _chunks(an.pairs):
        for t, v in enumerate(values):
            opts = d.options(options, **({knob: v} if knob else {}))
            knobs = Knobs(temperature=jnp.float32(1e-6), top_p=jnp.float32(1.0), drafter=d.knobs(opts))
            outs[t].append([np.asarray(x) for x in _anchored(
                params, an.config, an.aux, an.seq, row, anchor, knobs, key, program=an.program,
                rows_needed=an.rows_needed, max_len=an.max_len)])
    cat = lambda t, j: _per_anchor([o[j] for o in outs[t]], len(paths), n_anchors)
    return Proposals(drafts=cat(0, 0), n_draft=np.stack([cat(t, 1) for t in range(len(values))]), thresholds=values,
                     probability=cat(0, 2), margin=cat(0, 3), conf=cat(0, 4))


@dataclasses.dataclass(frozen=True)
class Along:
    """A drafter along sampled paths (`along_path`), per path, anchor i and draft position j (drafts teacher-forced
    to the path's tokens y_{i+1..}): alpha [n_paths, A, K] Σ_v min(p_j, q_j); log_ratio [n_paths, A, K]
    log q_j(y_{i+j}) − log p_j(y_{i+j}) (−inf where the drafter gives the path's token probability 0)."""

    alpha: np.ndarray
    log_ratio: np.ndarray


def along_path(params: dict, config, paths: Sequence[Path], drafter: str, k: int, n_anchors: int,
               target: TargetPass, options=None) -> Along:
    """T > 0 (docs/whatif.md §5): the drafter's chain at every anchor i of sampled paths (each a plain sampling run's
    continuation) fed the path's own tokens (`Drafter.propose_along`), against the target's distribution there;
    target: `target_pass(tempered=(T, top_p))`."""
    if target.tempered is None:
        raise ValueError("along_path needs target_pass(..., tempered=(T, top_p))")
    an = _anchors(params, config, paths, drafter, k, n_anchors, options, target, greedy=False)
    d = an.program.drafter
    T, top_p = target.tempered
    probs = jnp.asarray(target.probs)
    knobs = Knobs(temperature=jnp.float32(T), top_p=jnp.float32(top_p), drafter=d.knobs(d.options(options)))
    out = [jax.device_get(_alpha_along(params, an.config, an.aux, an.seq, probs, row, anchor, knobs,
                                       jax.random.PRNGKey(0), program=an.program, rows_needed=an.rows_needed,
                                       max_len=an.max_len))
           for row, anchor in _chunks(an.pairs)]
    return Along(*(_per_anchor([o[j] for o in out], len(paths), n_anchors) for j in range(2)))


def round_survival(log_ratio: np.ndarray, w: int, rule: str = "token") -> np.ndarray:
    """P(a round from anchor i accepts at least a drafts | the path) for a = 0..w (docs/whatif.md §5): with
    g_m = Π_{j≤m} q_j(y_{i+j}) / p_j(y_{i+j}) (the drafts teacher-forced to the path's tokens),
    token-wise rejection sampling Π_{j≤a} min(1, q_j/p_j), block verification min(1, min_{m≤a} g_m) (Sun et al.
    2024, Algorithm 2). log_ratio [..., K] (`Along.log_ratio`) -> [..., w+1] (column 0: 1)."""
    if rule not in ("token", "block"):
        raise ValueError(f"rule must be 'token' or 'block', got {rule!r}")
    lr = np.asarray(log_ratio, np.float64)[..., :w]
    if rule == "token":
        log_s = np.cumsum(np.minimum(lr, 0.0), axis=-1)
    else:
        log_s = np.minimum(np.minimum.accumulate(np.cumsum(lr, axis=-1), axis=-1), 0.0)
    ones = np.ones(lr.shape[:-1] + (1,))
    return np.concatenate([ones, np.exp(log_s)], axis=-1)


def expected_walk(survival: np.ndarray, stop: np.ndarray | int) -> dict:
    """The rounds of a run along one path in expectation over the verify draws given the path: survival [A, w+1]
    (`round_survival`) at anchors i = 0..A−1, rounds at anchors i < stop (stop = max_new_tokens − 1, or the
    first EOS's index if earlier). Visit weights v(0) = 1, v(i + a + 1) += v(i)·P(τ = a | i).
    -> {"visits" [A] v(i) (0 from stop on), "rounds", "accepted", "per_position_accepted" [w]} (floats)."""
    A, w = survival.shape[0], survival.shape[1] - 1
    stop = min(int(stop), A)
    dist = survival - np.concatenate([survival[:, 1:], np.zeros((A, 1))], axis=1)        # P(τ = a | i), a = 0..w
    v = np.zeros(A + w + 2)
    v[0] = 1.0
    for i in range(stop):
        v[i + 1:i + w + 2] += v[i] * dist[i]
    visits = v[:A].copy()
    visits[stop:] = 0.0
    reach = visits @ survival[:, 1:]
    return {"visits": visits, "rounds": float(visits.sum()), "accepted": float(reach.sum()),
            "per_position_accepted": reach.tolist()}


def walk(path: Path, drafts: np.ndarray, n_rule: np.ndarray, w: int, max_new_tokens: int, eos: int = -1):
    """The rounds of a fixed-width greedy run along path: drafts [A,K] and n_rule [A] at each anchor, w drafts
    verified per round. -> (trace [[drafted, accepted] per round], tokens emitted)."""
    out, i, trace = 1, 0, []
    done = out >= max_new_tokens or path.tokens[0] == eos
    while not done:
        n = int(min(n_rule[i], w))
        a = _accepted(drafts[i, :n], path.tokens[i + 1:i + 1 + n])
        trace.append([n, a])
        out, done, i = _emit(path.tokens, i, a, out, max_new_tokens, eos)
    return trace, out


# ---- the width scheduler's auto, replayed -------------------------------------------------------------

def replay_auto(paths: Sequence[Path], p: Proposals, rows: Sequence[int], t: int, bound: int, table,
                max_new_tokens: int, eos: int = -1, sequential: bool = False):
    """The rounds of a draft_n_max="auto" run of one batch: the sequences along paths[b] = path rows[b] of p
    (threshold index t), priced by table (a `speculative.cost_table.CostTable`): per round the batch's calibration
    factors, for a sequential drafter (`Drafter.sequential`: MTP's chain) the chain's early stop
    (`ops.width.keep_drafting`, over every sequence of the batch, finished ones included), one width for the batch
    (`ops.width.choose` over the live sequences) and the switch to plain decoding (`speculative.width_policy`), in
    the order `speculative.round.speculative_round` runs them. A finished sequence proposes from its last anchor,
    as in the loop: exact when p covers max_new_tokens + k anchors (`evaluate`'s), else its last one.
    -> (traces [[drafted, accepted] per round of sequence b; plain rounds [0, 0]], tokens emitted [B],
    the batch's widths per round [w or −1: plain])."""
    B, A = len(rows), p.drafts.shape[1]
    k = min(bound, p.drafts.shape[2])
    cost_np, plain = table.costs(k)
    cost = jnp.asarray(cost_np)
    ys = [path.tokens for path in paths]
    drafts, n_rule = p.drafts[list(rows), :, :k], p.n_draft[t, list(rows)]
    conf, prob = p.conf[list(rows), :, :k], p.probability[list(rows), :, :k]
    raw_all = np.where(conf >= 0, conf, prob).astype(np.float32)                    # [B,A,k]
    per_pos, raw_sum = np.zeros((B, k), np.int32), np.zeros((B, k), np.float32)
    rounds, accepted, offered = np.zeros(B, np.int64), np.zeros(B, np.int64), np.zeros(B, np.int64)
    predicted, cost_sum = np.zeros(B, np.float32), np.zeros(B, np.float32)
    never = bool(width_policy.no_width_can_pay(_knobs(cost, jnp.asarray(plain), k)))
    out, at = np.ones(B, np.int64), np.zeros(B, np.int64)
    done = np.array([out[b] >= max_new_tokens or ys[b][0] == eos for b in range(B)])
    traces, widths, loop_round = [[] for _ in range(B)], [], 0
    while not done.all() and not _switched(never, loop_round, rounds, accepted, offered, predicted, cost_sum,
                                           plain):
        anchor = np.minimum(at, A - 1)
        w, est, raw, proposed = (np.asarray(x) for x in _auto_round(
            per_pos, raw_sum, raw_all[np.arange(B), anchor], n_rule[np.arange(B), anchor], jnp.asarray(~done), cost,
            sequential=sequential))
        w = int(w)
        widths.append(w)
        loop_round += 1
        for b in np.flatnonzero(~done):
            i, n = int(at[b]), int(min(proposed[b], w))
            a = _accepted(drafts[b, i, :n], ys[b][i + 1:i + 1 + n])
            traces[b].append([n, a])
            rounds[b], accepted[b], offered[b] = rounds[b] + 1, accepted[b] + a, offered[b] + (proposed[b] > 0)
            per_pos[b, :a] += 1
            cost_sum[b] = np.float32(cost_sum[b] + np.float32(cost_np[w]))
            on = np.arange(w) < n
            predicted[b] = np.float32(predicted[b] + np.float32(1.0 + np.sum(np.cumprod(np.where(on, est[b, :w],
                                                                                                 0.0)))))
            raw_sum[b, :w] += np.where(on & (np.arange(w) <= a), raw[b, :w], 0.0).astype(np.float32)
            out[b], done[b], at[b] = _emit(ys[b], i, a, int(out[b]), max_new_tokens, eos)
    while not done.all():                                  # plain decoding for the rest of the run
        widths.append(-1)
        for b in np.flatnonzero(~done):
            traces[b].append([0, 0])
            out[b], done[b], at[b] = _emit(ys[b], int(at[b]), 0, int(out[b]), max_new_tokens, eos)
    return traces, out.tolist(), widths


@functools.partial(jax.jit, static_argnames=("sequential",))
def _auto_round(per_pos: jax.Array, raw_sum: jax.Array, raw: jax.Array, n_rule: jax.Array, live: jax.Array,
                cost: jax.Array, *, sequential: bool):
    """A replayed round's width, as `speculative.round.speculative_round` chooses it: the calibration factors of
    the batch's counts so far (per_pos, raw_sum [B,k]), each sequence's calibrated estimates at its anchor (raw
    [B,k]), for a sequential drafter the chain's early stop (`ops.width.keep_drafting`), then `ops.width.choose`
    over the live [B] sequences' at most n_rule [B] drafts at costs cost [k+1].
    -> (w [], est [B,k], raw [B,k] (0 past the chain's stop), drafts proposed [B])."""
    k = raw.shape[1]
    factors = width.scale(per_pos, raw_sum)
    est = width.calibrated(raw, factors)
    steps = jnp.int32(k)
    if sequential:       # the chain stops before a draft no width could pay for (drafts beyond: probability 0)
        steps, going = jnp.int32(1), jnp.bool_(True)
        for j in range(1, k):
            going = going & width.keep_drafting(jnp.where(jnp.arange(k) < j, est, 0.0), j, cost, k)
            steps = steps + going
        raw = jnp.where(jnp.arange(k) < steps, raw, 0.0)
        est = width.calibrated(raw, factors)
    proposed = jnp.minimum(n_rule, steps)
    return width.choose(est, proposed, live, cost, jnp.int32(k)), est, raw, proposed


def _knobs(cost, plain, k):
    return Knobs(temperature=jnp.float32(1e-6), top_p=jnp.float32(1.0), draft_n=jnp.int32(k), width_cost=cost,
                 plain_cost=plain)


def _switched(never: bool, loop_round: int, rounds, accepted, offered, predicted, cost_sum, plain) -> bool:
    """`width_policy.realised_rate_below_plain` before a round: loop_round drafting rounds so far; per sequence
    [B] its rounds, accepted drafts, rounds it was offered drafts, expected tokens and cost-table seconds."""
    plain = np.float32(plain)
    cost = np.sum(cost_sum, dtype=np.float32)
    realised_low = np.float32(np.sum(rounds + accepted)) * plain <= cost
    forecast_low = (np.sum(predicted, dtype=np.float32) * plain <= cost) and np.sum(offered) >= np.sum(rounds)
    return never or (bool(realised_low) and loop_round >= (1 if forecast_low else width_policy.WARMUP_ROUNDS))


def _accepted(drafts: np.ndarray, target: np.ndarray) -> int:
    """Greedy verification: the longest prefix of drafts equal to the target's tokens."""
    match = drafts == target[:len(drafts)]
    return int(len(match) if match.all() else np.argmin(match))


def _emit(y: np.ndarray, i: int, a: int, out: int, max_new_tokens: int, eos: int):
    """Emit a round's a accepted drafts and the target's token after anchor i (`speculative.program.emit`).
    -> (tokens emitted so far, done, next anchor)."""
    emitted = y[i + 1:i + 1 + min(a + 1, max_new_tokens - out)]
    hit = np.flatnonzero(emitted == eos) if eos >= 0 else []
    out += int(hit[0]) + 1 if len(hit) else len(emitted)
    return out, len(hit) > 0 or out >= max_new_tokens, i + a + 1


# ---- a grid of settings ---------------------------------------------------------------------------------

def evaluate(model, prompts: Sequence[dict], settings: Sequence, max_new_tokens: int, eos: int = -1,
             tables: dict | None = None, progress=print, precisions: Sequence[str] = (AS_LOADED,),
             rules: Sequence[str] = ()) -> tuple[list[dict], dict]:
    """Every greedy setting (`research.runner.Setting`, spec != "none", temperature 0) on the prompts ({"id", "category",
    "tokens"}): one continuation per prompt, one target pass, one proposal pass per drafter and drafter precision
    (`drafters.precision.drafter_at_precision`: the drafter's weights stored so, the target as loaded) at its
    widest width and every value of its stop knob (anchors 0..max_new_tokens + k − 1: a finished sequence of
    an auto batch proposes from its last anchor), then a walk per setting, precision and prompt (auto: `replay_auto`
    per batch of consecutive prompts, with tables[`Setting.table_key`]; without one the setting is named in a
    progress line and left out). -> (records, one per prompt × setting ×
    precision, like dsv4-sweep's results.jsonl lines, "drafter_precision" and the label's " prec=…" naming
    the precision; rules: DSpark confidence rules (`drafters.dspark.RULES`) besides the model's own, each its own
    proposal pass, labelled " rule=…"; {"continuation_s", "target_pass_s", "proposals_s" {drafter[@precision]
    [/rule]: s}, "walk_s"})."""
    settings = [s for s in settings if s.drafter is not None and s.temperature == 0]
    unpriced = [s for s in settings if s.auto and (tables or {}).get(s.table_key) is None]
    if unpriced:
        progress(f"what-if: no cost table for {', '.join(s.label for s in unpriced)}: not replayed (auto needs one)")
        settings = [s for s in settings if s not in unpriced]
    if not settings:
        return [], {"continuation_s": 0.0, "target_pass_s": 0.0, "proposals_s": {}, "walk_s": 0.0}
    widest = {}
    for s in settings:
        widest[s.spec] = max(widest.get(s.spec, 0), s.draft_n_max)
    K = max(widest.values())
    t0 = time.perf_counter()
    paths = continuations(model.params, model.bundle, [p["tokens"] for p in prompts], max_new_tokens + K + 1)
    t1 = time.perf_counter()
    progress(f"what-if: {len(paths)} continuations of {max_new_tokens + K + 1} tokens in {t1 - t0:.1f} s")
    taps = sorted({t for spec in widest for t in model.draft_setup(spec, widest[spec]).taps})
    target = target_pass(model.params, model.config, paths, tuple(taps))
    t2 = time.perf_counter()
    progress(f"what-if: target pass in {t2 - t1:.1f} s")
    own_rule = model.draft_setup("dspark", 1).settings.confidence_rule if "dspark" in widest else None
    variants = [(prec, None) for prec in precisions] + [(prec, r) for prec in precisions for r in rules
                                                        if "dspark" in widest and r != own_rule]
    props, prop_s = {}, {}
    for spec, k in widest.items():
        for prec, rule in variants:
            if rule is not None and spec != "dspark":
                continue
            t = time.perf_counter()
            knob = registry.get(spec).stop_knob
            values = sorted({getattr(s, knob) for s in settings if s.spec == spec}) if knob else [0.0]
            params = model.params if prec == AS_LOADED else drafter_at_precision(model.params, spec, prec)
            options = None if rule is None else registry.get(spec).options(dspark_meta=dataclasses.replace(
                model.draft_setup(spec, k).settings, confidence_rule=rule))
            props[spec, prec, rule] = proposals(params, model.bundle, paths, spec, k, max_new_tokens + k, values,
                                                options, target=target)
            name = (spec if prec == AS_LOADED else f"{spec}@{prec}") + ("" if rule is None else f"/{rule}")
            prop_s[name] = time.perf_counter() - t
            progress(f"what-if: {name} proposals (k={k}, {len(values)} threshold(s)) in {prop_s[name]:.1f} s")
    t3 = time.perf_counter()
    records = []
    for s, (prec, rule) in ((s, v) for v in variants for s in settings):
        if (s.spec, prec, rule) not in props:
            continue
        p = props[s.spec, prec, rule]
        knob = registry.get(s.spec).stop_knob
        t_index = p.thresholds.index(getattr(s, knob)) if knob else 0
        if s.auto:
            table = tables[s.table_key]
            for lo in range(0, len(paths), s.batch_size):          # `runner.batches`: consecutive groups
                rows = range(lo, min(lo + s.batch_size, len(paths)))
                traces, outs, widths = replay_auto([paths[b] for b in rows], p, rows, t_index, s.draft_n_max, table,
                                                   max_new_tokens, eos, registry.get(s.spec).sequential)
                records += [record(s, prompts[b], paths[b], tr, out, widths, prec, rule)
                            for b, tr, out in zip(rows, traces, outs)]
            continue
        for b, (prompt, path) in enumerate(zip(prompts, paths)):
            trace, out = walk(path, p.drafts[b], p.n_draft[t_index, b], s.draft_n_max, max_new_tokens, eos)
            records.append(record(s, prompt, path, trace, out, None, prec, rule))
    walk_s = time.perf_counter() - t3
    return records, {"continuation_s": t1 - t0, "target_pass_s": t2 - t1, "proposals_s": prop_s, "walk_s": walk_s,
                     "paths": paths, "target": target, "proposals": props}


def label(setting, precision: str = AS_LOADED, rule: str | None = None) -> str:
    """A what-if setting's label: the sweep's, the drafter's precision unless as loaded, DSpark's confidence rule
    unless the model's own."""
    return setting.label + ("" if precision == AS_LOADED else f" prec={precision}") + \
        ("" if rule is None else f" rule={rule}")


def record(setting, prompt: dict, path: Path, trace: list, out: int, widths: list | None,
           precision: str = AS_LOADED, rule: str | None = None) -> dict:
    """One results.jsonl line of a what-if setting and prompt (dsv4-sweep's fields where they apply)."""
    draft, acc, rounds = sum(d for d, _ in trace), sum(a for _, a in trace), len(trace)
    K = max(setting.draft_n_max, 1)
    rec = {**setting.as_dict(), "label": label(setting, precision, rule), "drafter_precision": precision,
           "confidence_rule": rule,
           "id": prompt["id"], "category": prompt["category"],
           "prompt_tokens": len(prompt["tokens"]), "pred": out, "draft": draft, "acc": acc, "rounds": rounds,
           "rate": acc / draft if draft else 0.0,
           "mean_accepted_length": (acc + rounds) / rounds if rounds else 0.0,
           "per_position_accepted": [sum(a > j for _, a in trace) for j in range(K)],
           "per_position_proposed": [sum(d > j for d, _ in trace) for j in range(K)],
           "round_trace": trace, "output_tokens": path.tokens[:out].tolist()}
    if widths is not None:
        rec["widths"] = widths
    return rec


# ---- sampling (T > 0): the estimate of docs/whatif.md §5 ------------------------------------------------

APPROXIMATION = "expected rounds given one sampled path per prompt (docs/whatif.md §5)"


def evaluate_sampled(model, prompts: Sequence[dict], settings: Sequence, max_new_tokens: int, *, seed: int = 0,
                     top_p: float = 1.0, verify: str = "token", eos: int = -1, progress=print) -> list[dict]:
    """The fixed-width settings with temperature > 0 (stop knobs 0) under the verify rule ("token" | "block"): per
    prompt the estimate of docs/whatif.md §5 on one path sampled by plain decoding (seed) -> records with expected
    counts (floats) and "approximation"."""
    out = []
    for T in sorted({s.temperature for s in settings}):
        group = [s for s in settings if s.temperature == T]
        widest = {}
        for s in group:
            widest[s.spec] = max(widest.get(s.spec, 0), s.draft_n_max)
        n = max_new_tokens + max(widest.values()) + 1
        tokens = [list(p["tokens"]) for p in prompts]
        size = min(8, len(tokens))
        paths = []
        for lo in range(0, len(tokens), size):
            part = tokens[lo:lo + size]
            got, _ = generate(model.params, model.bundle, part + [part[0]] * (size - len(part)), n, eos_token_id=-1,
                              temperature=T, top_p=top_p, seed=seed, pad_to=max(map(len, tokens)),
                              max_len=max(map(len, tokens)) + n + 1)
            paths += [Path(np.asarray(p, np.int32), np.asarray(t, np.int32)) for p, t in zip(part, got)]
        taps = sorted({t for spec in widest for t in model.draft_setup(spec, widest[spec]).taps})
        target = target_pass(model.params, model.config, paths, tuple(taps), tempered=(T, top_p))
        for spec, k in widest.items():
            along = along_path(model.params, model.bundle, paths, spec, k, max_new_tokens, target)
            progress(f"what-if: {spec} at T={T:g}: the sampled estimate ({verify} verification) on {len(paths)} paths")
            for s in (s for s in group if s.spec == spec):
                out += [sampled_record(s, prompt, along.log_ratio[b], max_new_tokens, paths[b], verify, eos)
                        for b, prompt in enumerate(prompts)]
    return out


def sampled_record(setting, prompt: dict, log_ratio: np.ndarray, max_new_tokens: int, path: Path,
                   verify: str = "token", eos: int = -1) -> dict:
    """A prompt's expected counts at a fixed width along its sampled path: log_ratio [A,K] (`Along.log_ratio`),
    `round_survival` under the verify rule, `expected_walk` from anchor 0 to the budget (or the path's first EOS)."""
    w = min(setting.draft_n_max, log_ratio.shape[-1])
    hit = np.flatnonzero(path.tokens == eos) if eos >= 0 else []
    end = min(max_new_tokens, int(hit[0]) + 1) if len(hit) else max_new_tokens      # the run's output length
    e = expected_walk(round_survival(log_ratio, w, verify), end - 1)
    rounds, acc = e["rounds"], e["accepted"]
    return {**setting.as_dict(), "label": label(setting), "drafter_precision": AS_LOADED, "confidence_rule": None,
            "id": prompt["id"],
            "category": prompt["category"], "prompt_tokens": len(prompt["tokens"]), "pred": end,
            "draft": rounds * w, "acc": acc, "rounds": rounds, "verify": verify,
            "rate": acc / (rounds * w) if rounds else 0.0,
            "mean_accepted_length": (acc + rounds) / rounds if rounds else 0.0,
            "per_position_accepted": e["per_position_accepted"],
            "per_position_proposed": [rounds] * w, "approximation": APPROXIMATION,
            "output_tokens": path.tokens[:end].tolist()}
