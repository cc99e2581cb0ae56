"""The speculative decoding loop: one jitted `lax.while_loop` over rounds (docs/design.md property 5).

A round: draft k tokens (the drafter registered under `Options.drafter`, `dsv4_jax.drafters.registry`) →
verify [last, d_1..d_k] in one target pass → accept (greedy prefix match or lossless rejection sampling)
plus the bonus token → emit, commit, and feed the newly committed positions to the drafter. The carry (`Carry`) holds everything: output buffer,
positions, done flags, target and drafter state, RNG key and statistics. `run_rounds_python`
drives the same jitted round from Python (debugging twin; identical results).
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from ..model.state import DecodeState
from ..config import ModelConfig
from ..model.decode import advance, process_block
from ..drafters import registry
from ..drafters.base import MODE_AUTO, MODE_PLAIN, Bound, DraftSetup, Knobs
from ..ops import branch, verification, width

__all__ = ["Carry", "Knobs", "Options", "Stats", "emit", "initial_carry", "round_jit", "round_step", "rounds_loop",
           "run_rounds", "run_rounds_python"]


@struct.dataclass
class Options:
    """Static choices of a run (part of the compilation key)."""

    drafter: str = struct.field(pytree_node=False, default="none")   # a name in drafters.registry
    k: int = struct.field(pytree_node=False, default=0)              # drafts per round (draft_n_max)
    greedy: bool = struct.field(pytree_node=False, default=True)
    max_new_tokens: int = struct.field(pytree_node=False, default=16)
    eos_token_id: int = struct.field(pytree_node=False, default=-1)  # -1: none
    taps: tuple = struct.field(pytree_node=False, default=())        # target layers the drafter reads
    settings: Any = struct.field(pytree_node=False, default=None)    # the drafter's static settings
    # cost benchmarks only: accept every proposed draft (ops.sampling.verify_forced; greedy runs; not lossless)
    forced_acceptance: bool = struct.field(pytree_node=False, default=False)
    # sampled runs' verify rule: "token" (rejection sampling) | "block" (docs/verification.md §2; greedy: same)
    verify: str = struct.field(pytree_node=False, default="token")
    # cost studies (docs/verification.md §5): each draft accepted with probability r_j (tuple of rates, the
    # last repeating), independently; None: real verification
    synthetic_accept: tuple | None = struct.field(pytree_node=False, default=None)
    # the width scheduler is in the program (docs/width_scheduler.md; needs Knobs.draft_n and the width_*
    # knobs): the verify width chosen per round (Knobs.width_mode MODE_AUTO), a fixed one, or plain decoding
    adaptive: bool = struct.field(pytree_node=False, default=False)

    @property
    def setup(self) -> DraftSetup:
        """What the drafter's methods take (drafters.base)."""
        return DraftSetup(k=self.k, taps=self.taps, settings=self.settings)

    def bind(self, params: dict, config: ModelConfig) -> Bound:
        """The first argument of the drafter's traced methods."""
        return Bound(params, config, self.setup)


@struct.dataclass
class Stats:
    rounds: jax.Array          # [B] rounds in which the sequence was active
    drafted: jax.Array         # [B] drafts proposed
    accepted: jax.Array        # [B] drafts accepted
    per_position: jax.Array    # [B,K] rounds whose draft j was accepted (K >= k: the run's bound, max_block - 1)
    proposed_at: jax.Array     # [B,K] rounds that proposed a draft at position j
    length_hist: jax.Array     # [B,K+1] rounds that proposed exactly L drafts (after p_min / confidence)
    # docs/verification.md (None in carries built without them)
    expected_at: jax.Array = None   # [B,K] Σ over rounds of the analytic P(draft j accepted) (ops.verification)
    alpha_at: jax.Array = None      # [B,K] Σ over rounds of Σ_v min(p, q) at position j
    accept_hist: jax.Array = None   # [B,K+1] rounds that accepted exactly n drafts
    calib: jax.Array = None         # [B,K,NB,3] confidence bins: count, accepted, Σ confidence (scored drafters)
    brier_at: jax.Array = None      # [B,K] Σ (confidence − accepted)²
    # the width scheduler (Options.adaptive; docs/width_scheduler.md)
    width_hist: jax.Array = None    # [B,K+2] rounds that verified w = 0..K drafts; column K+1: plain rounds
    predicted: jax.Array = None     # [B] Σ over rounds of the expected tokens T_w of the verified width
    raw_sum: jax.Array = None       # [B,K] Σ raw acceptance estimates of drafts verified with their prefix accepted
    cost_sum: jax.Array = None      # [B] Σ over active rounds of the round's cost (cost table seconds)
    offered: jax.Array = None       # [B] drafting rounds in which the drafter proposed at least one draft


@struct.dataclass
class Carry:
    out: jax.Array             # [B, max_new + K + 1] generated tokens (−1 = none)
    out_len: jax.Array         # [B]
    limit: jax.Array           # [B] each sequence's token budget (<= opts.max_new_tokens, the buffer's)
    last: jax.Array            # [B] the next token to feed the target (sampled, not yet processed)
    done: jax.Array            # [B] bool
    target: DecodeState
    drafter: Any
    key: jax.Array
    stats: Stats
    round: jax.Array           # scalar int32


def emit(c: Carry, tokens: jax.Array, n_new: jax.Array, opts: Options):
    """Append up to n_new[b] of tokens [B,m] to each output; stop at EOS or the budget. -> (out, out_len, done, n)."""
    m = tokens.shape[1]
    j = jnp.arange(m)[None, :]
    n = jnp.where(c.done, 0, jnp.minimum(n_new, c.limit - c.out_len))
    hit_eos = jnp.zeros_like(c.done)
    if opts.eos_token_id >= 0:
        is_eos = (tokens == opts.eos_token_id) & (j < n[:, None])
        first = jnp.argmax(is_eos, axis=1)
        hit_eos = jnp.any(is_eos, axis=1)
        n = jnp.where(hit_eos, first + 1, n)
    idx = jnp.where(j < n[:, None], c.out_len[:, None] + j, c.out.shape[1])
    out = c.out.at[jnp.arange(c.out.shape[0])[:, None], idx].set(tokens, mode="drop")
    out_len = c.out_len + n
    done = c.done | hit_eos | (out_len >= c.limit)
    return out, out_len, done, n


def initial_carry(first: jax.Array, target: DecodeState, drafter, key, opts: Options, limit=None) -> Carry:
    """The carry of freshly prefilled sequences: first [B] (the token sampled from the prompt) already
    emitted, empty statistics; limit [B] per-sequence budgets (default opts.max_new_tokens)."""
    B, k = first.shape[0], opts.k
    fresh = lambda *shape: jnp.zeros(shape, jnp.int32)   # distinct buffers: the carry is donated
    limit = jnp.full((B,), opts.max_new_tokens, jnp.int32) if limit is None else jnp.asarray(limit, jnp.int32)
    c = Carry(out=jnp.full((B, opts.max_new_tokens + k + 1), -1, jnp.int32), out_len=fresh(B), limit=limit,
              last=first, done=jnp.zeros((B,), bool), target=target, drafter=drafter, key=key,
              stats=Stats(rounds=fresh(B), drafted=fresh(B), accepted=fresh(B), per_position=fresh(B, k),
                          proposed_at=fresh(B, k), length_hist=fresh(B, k + 1), **_fresh_extra(B, k),
                          **(_fresh_width(B, k) if opts.adaptive else {})),
              round=fresh())
    # the first token is already generated: emit it (it may be EOS, or the whole budget)
    out, out_len, done, _ = emit(c, first[:, None], jnp.ones((B,), jnp.int32), opts)
    return c.replace(out=out, out_len=out_len, done=done)


def _fresh_extra(B: int, k: int) -> dict:
    """Zeroed verification statistics (Stats.expected_at ... brier_at)."""
    z = lambda *shape, dt=jnp.float32: jnp.zeros(shape, dt)
    return dict(expected_at=z(B, k), alpha_at=z(B, k), accept_hist=z(B, k + 1, dt=jnp.int32),
                calib=z(B, k, verification.CALIBRATION_BINS, 3), brier_at=z(B, k))


def _fresh_width(B: int, k: int) -> dict:
    """Zeroed width-scheduler statistics (Stats.width_hist ... offered)."""
    return dict(width_hist=jnp.zeros((B, k + 2), jnp.int32), predicted=jnp.zeros((B,), jnp.float32),
                raw_sum=jnp.zeros((B, k), jnp.float32), cost_sum=jnp.zeros((B,), jnp.float32),
                offered=jnp.zeros((B,), jnp.int32))


def _verify(key, logits, drafts, q, n_draft, knobs: Knobs, opts: Options) -> verification.Outcome:
    """The verify decision of a block's logits [B,k+1,V] and its analytic acceptance (ops.verification)."""
    return verification.verify(key, logits, drafts, q, n_draft, knobs.temperature, knobs.top_p, greedy=opts.greedy,
                               rule=opts.verify, synthetic=opts.synthetic_accept, forced=opts.forced_acceptance)


def _extra_stats(s: Stats, o: verification.Outcome, conf, n_draft, active) -> dict:
    """The verification statistics of a round (docs/verification.md), for carries that hold them."""
    if s.expected_at is None:
        return {}
    K, w = s.expected_at.shape[1], o.expected.shape[1]
    widen = lambda x: jnp.pad(x, ((0, 0), (0, K - w)) + ((0, 0),) * (x.ndim - 2))   # width w -> the carry's K
    on = active[:, None]
    out = dict(expected_at=s.expected_at + widen(jnp.where(on, o.expected, 0.0)),
               alpha_at=s.alpha_at + widen(jnp.where(on, o.alpha, 0.0)),
               accept_hist=s.accept_hist + ((jnp.arange(K + 1)[None, :] == o.n_accept[:, None]) & on),
               calib=s.calib, brier_at=s.brier_at)
    if conf is not None:
        bins, brier = verification.calibration_counts(conf, o.n_accept, n_draft, active, s.calib.shape[2])
        out.update(calib=s.calib + widen(bins), brier_at=s.brier_at + widen(brier))
    return out


def round_step(params: dict, config: ModelConfig, c: Carry, knobs: Knobs, opts: Options) -> Carry:
    """One draft → verify → accept → commit round for every active sequence.

    With a run-time bound (`Knobs.draft_n`, RunShape.dynamic_draft_n) the verify and everything after it
    run at the run's own width, draft_n + 1: a switch over the widths 2..k + 1 the program holds
    (`ops.branch.switch_in_place`: the decode state updated in place, never copied through a conditional), so
    a run costs per round what a program compiled for its draft_n_max costs (only the drafting is shared).
    With the width scheduler (`Options.adaptive`) the switch also holds width 1 (no drafts) and the width
    is the run's fixed one or chosen per round (`_scheduled_round`)."""
    if opts.adaptive:
        return _scheduled_round(params, config, c, knobs, opts)
    drafter = registry.get(opts.drafter)
    key, k_draft, k_acc = jax.random.split(c.key, 3)
    drafts, q, n_draft, conf = drafter.propose_scored(opts.bind(params, config), c.drafter, c.target.pos, c.last,
                                                      k_draft, knobs, opts.greedy)
    if knobs.draft_n is not None:
        n_draft = jnp.minimum(n_draft, knobs.draft_n)
    if knobs.draft_n is None or opts.k <= 1:
        return _verify_and_commit(params, config, c, knobs, opts, key, k_acc, drafts, q, n_draft, conf)
    widths = [lambda c, w=w: _verify_and_commit(params, config, c, knobs, opts, key, k_acc, drafts[:, :w], q[:, :w],
                                                n_draft, conf=None if conf is None else conf[:, :w])
              for w in range(1, opts.k + 1)]
    return branch.switch_in_place(jnp.clip(knobs.draft_n, 1, opts.k) - 1, widths, c)


def _realised_rate_below_plain(s: Stats, knobs: Knobs, rounds: jax.Array) -> jax.Array:
    """MODE_AUTO's switch to plain decoding (docs/width_scheduler.md §3), bool []: at once when no width can pay
    even with every draft accepted (`_no_width_can_pay`); else once the run's committed tokens per cost-table
    second so far are not above plain decoding's 1 / plain_cost (a tie goes to plain: its rounds skip the
    drafter's work) — after one round if the scheduler's own forecast for the rounds so far (Σ expected tokens,
    drafts offered every round) agrees, else after WARMUP_ROUNDS rounds (realised evidence against a forecast
    that said drafting pays)."""
    cost = jnp.sum(s.cost_sum)
    realised_low = jnp.sum(s.rounds + s.accepted).astype(jnp.float32) * knobs.plain_cost <= cost
    # the forecast counts only where the drafter offered drafts every round (an n-gram without a match yet
    # offers none: no judgement of drafting to agree with)
    drafting_rounds = jnp.sum(s.rounds) - jnp.sum(s.width_hist[:, -1])
    forecast_low = (jnp.sum(s.predicted) * knobs.plain_cost <= cost) & (jnp.sum(s.offered) >= drafting_rounds)
    return _no_width_can_pay(knobs) | (realised_low & (rounds >= jnp.where(forecast_low, 1, WARMUP_ROUNDS)))


def _no_width_can_pay(knobs: Knobs) -> jax.Array:
    """Whether every width w <= the run's bound costs at least w + 1 plain rounds (its most tokens per round):
    then no acceptance makes drafting pay and the run decodes plainly from its first round. bool []."""
    w = jnp.arange(knobs.width_cost.shape[0])
    bound = knobs.width_cost.shape[0] - 1 if knobs.draft_n is None else knobs.draft_n
    pays = (w <= bound) & (knobs.width_cost < (w + 1) * knobs.plain_cost)
    return ~jnp.any(pays)


WARMUP_ROUNDS = 4


def _plain_now(c: Carry, knobs: Knobs) -> jax.Array:
    """Whether the scheduler's rounds from here on are plain decode steps: MODE_PLAIN, or MODE_AUTO once
    speculation has not paid (`_realised_rate_below_plain`; final for the run). bool []."""
    return (knobs.width_mode == MODE_PLAIN) | ((knobs.width_mode == MODE_AUTO)
                                               & _realised_rate_below_plain(c.stats, knobs, c.round))


def _plain_round(params: dict, config: ModelConfig, c: Carry, knobs: Knobs, opts: Options) -> Carry:
    """A round of the scheduler's program without the drafter: one token decoded, as in plain decoding (the
    drafter state is no longer fed; the width histogram's plain column counts the round)."""
    after = _plain_step(params, config, c, knobs, opts)
    return after.replace(stats=_fold_plain(after.stats, after.stats.rounds - c.stats.rounds, knobs))


def _plain_step(params: dict, config: ModelConfig, c: Carry, knobs: Knobs, opts: Options) -> Carry:
    """`_plain_round` with only `Stats.rounds` counted: the body of the plain loop (`rounds_loop`), whose other
    statistics are folded in once after it (`_fold_plain`) — per-round updates of [B,K] statistics that a
    plain round does not change cost a plain decode step several per cent on CPU."""
    key, _, k_acc = jax.random.split(c.key, 3)
    B, V = c.last.shape[0], config.vocab_size
    return _verify_and_commit(params, config, c, knobs, opts, key, k_acc, jnp.zeros((B, 0), jnp.int32),
                              jnp.zeros((B, 0, V), jnp.float32), jnp.zeros((B,), jnp.int32), plain=True)


def _fold_plain(s: Stats, n: jax.Array, knobs: Knobs) -> Stats:
    """The statistics of n [B] plain rounds per sequence besides their `rounds`: no drafts proposed or
    accepted (length and acceptance histograms' column 0), the width histogram's plain column, the plain
    rounds' cost and expected tokens (one each)."""
    first = lambda h: h.at[:, 0].add(n)
    out = dict(length_hist=first(s.length_hist))
    if s.accept_hist is not None:
        out.update(accept_hist=first(s.accept_hist))
    if s.width_hist is not None:
        out.update(width_hist=s.width_hist.at[:, -1].add(n), cost_sum=s.cost_sum + n * knobs.plain_cost,
                   predicted=s.predicted + n)
    return s.replace(**out)


def _scheduled_round(params: dict, config: ModelConfig, c: Carry, knobs: Knobs, opts: Options) -> Carry:
    """A round of a program with the width scheduler (docs/width_scheduler.md): a plain round once
    `_plain_now` holds, else `_speculative_round`. The loops (`rounds_loop`) do not go through this
    conditional: they run the speculative rounds until the switch and then the plain rounds in a second
    while loop whose body is the plain round alone, so that a plain round costs what plain decoding's costs.
    The conditional is `ops.branch.switch_in_place` (the carry updated in place)."""
    return branch.switch_in_place(_plain_now(c, knobs).astype(jnp.int32),
                                  [lambda c: _speculative_round(params, config, c, knobs, opts),
                                   lambda c: _plain_round(params, config, c, knobs, opts)], c)


def _speculative_round(params: dict, config: ModelConfig, c: Carry, knobs: Knobs, opts: Options) -> Carry:
    """A drafting round of the scheduler's program: the drafter proposes (its knobs carry the calibration
    factors, so a sequential drafter can stop early), and the round verifies w drafts, w = knobs.draft_n
    (MODE_FIXED) or the width with the most expected tokens per cost-table second (MODE_AUTO;
    `ops.width.choose`) — one switch over the widths 0..k whose branches update the decode state in place
    (`ops.branch.switch_in_place`; a `lax.switch` copied the whole state each round: docs/width_scheduler.md §1)."""
    s = c.stats
    factors = width.scale(s.per_position, s.raw_sum)
    knobs = knobs.replace(accept_scale=factors)
    drafter = registry.get(opts.drafter)
    key, k_draft, k_acc = jax.random.split(c.key, 3)
    K = opts.k
    drafts, q, n_draft, conf = drafter.propose_scored(opts.bind(params, config), c.drafter, c.target.pos, c.last,
                                                      k_draft, knobs, opts.greedy)
    conf = jnp.full(drafts.shape, -1.0, jnp.float32) if conf is None else conf
    # the raw estimate: a confidence head's (conf >= 0), else the draft's own probability (docs §2)
    raw = jnp.where(conf >= 0, conf, width.draft_probability(drafts, q))
    est = width.calibrated(raw, factors)
    n_draft = jnp.minimum(n_draft, knobs.draft_n)
    offered = n_draft > 0
    chosen = width.choose(est, n_draft, ~c.done, knobs.width_cost, knobs.draft_n)
    w_round = jnp.where(knobs.width_mode == MODE_AUTO, chosen, jnp.clip(knobs.draft_n, 0, K))
    n_draft = jnp.minimum(n_draft, w_round)
    # conf −1 (no confidence head) is never binned (ops.verification.calibration_counts)
    branches = [lambda c, w=w: _verify_and_commit(params, config, c, knobs, opts, key, k_acc, drafts[:, :w],
                                                  q[:, :w], n_draft, conf=conf[:, :w], est=est[:, :w],
                                                  raw=raw[:, :w], offered=offered)
                for w in range(K + 1)]
    return branch.switch_in_place(w_round, branches, c)


def _verify_and_commit(params: dict, config: ModelConfig, c: Carry, knobs: Knobs, opts: Options, key, k_acc,
                       drafts: jax.Array, q: jax.Array, n_draft: jax.Array, conf: jax.Array | None = None,
                       est: jax.Array | None = None, raw: jax.Array | None = None, plain: bool = False,
                       offered: jax.Array | None = None) -> Carry:
    """Verify [last, drafts] (drafts [B,w], q [B,w,V], n_draft [B] <= w; conf [B,w] the drafter's confidences
    or None), accept, emit, commit, observe. Width scheduler (Options.adaptive): est / raw [B,w] the drafts'
    calibrated / raw acceptance estimates, offered [B] whether the drafter proposed any draft; plain: a round
    without the drafter (w = 0, no observe)."""
    drafter = registry.get(opts.drafter)
    pos = c.target.pos
    B, w = drafts.shape
    n_draft = jnp.where(c.done, 0, n_draft)
    block = jnp.concatenate([c.last[:, None], drafts], axis=1)                       # [B,w+1]
    logits, tstate, aux = process_block(params, config, c.target, block, jnp.full((B,), w + 1, jnp.int32),
                                        opts.taps)
    outcome = _verify(k_acc, logits, drafts, q, n_draft, knobs, opts)
    a, nxt = outcome.n_accept, outcome.next
    # emitted this round: the a accepted drafts, then the correction / bonus token
    j = jnp.arange(w + 1)[None, :]
    emitted = jnp.where(j < a[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), nxt[:, None])
    active = ~c.done
    out, out_len, done, _ = emit(c, emitted, a + 1, opts)
    n_commit = jnp.where(active, a + 1, 0)
    tstate = advance(tstate, n_commit)
    dstate = c.drafter if plain else drafter.observe(opts.bind(params, config), c.drafter, aux, emitted, pos,
                                                     jnp.maximum(n_commit, 1))
    s = c.stats
    if plain:                   # the other statistics of plain rounds: `_fold_plain`
        stats = s.replace(rounds=s.rounds + active)
    else:
        kk = jnp.arange(s.per_position.shape[1])[None, :]   # the carry may be sized for a wider bound than w
        stats = Stats(rounds=s.rounds + active, drafted=s.drafted + n_draft,
                      accepted=s.accepted + jnp.where(active, a, 0),
                      per_position=s.per_position + ((kk < a[:, None]) & active[:, None]),
                      proposed_at=s.proposed_at + ((kk < n_draft[:, None]) & active[:, None]),
                      length_hist=s.length_hist + ((jnp.arange(s.length_hist.shape[1])[None, :]
                                                    == n_draft[:, None]) & active[:, None]),
                      **_extra_stats(s, outcome, conf, n_draft, active),
                      **_width_stats(s, knobs, est, raw, n_draft, a, active, w, offered))
    return Carry(out=out, out_len=out_len, limit=c.limit, last=jnp.where(active, nxt, c.last), done=done,
                 target=tstate,
                 drafter=dstate, key=key, stats=stats, round=c.round + 1)


def _width_stats(s: Stats, knobs: Knobs, est, raw, n_draft, a, active, w: int, offered) -> dict:
    """The width scheduler's statistics of a drafting round of width w (docs/width_scheduler.md; plain rounds:
    `_fold_plain`), for carries that hold them."""
    if s.width_hist is None:
        return {}
    K = s.raw_sum.shape[1]
    hist = s.width_hist.at[:, w].add(active.astype(jnp.int32))
    out = dict(width_hist=hist, cost_sum=s.cost_sum + jnp.where(active, knobs.width_cost[w], 0.0),
               offered=s.offered + (active & offered))
    if w == 0:
        return dict(out, predicted=s.predicted + active, raw_sum=s.raw_sum)
    j = jnp.arange(w)[None, :]
    reached = (j < n_draft[:, None]) & (j <= a[:, None]) & active[:, None]
    tokens = 1.0 + jnp.sum(jnp.cumprod(jnp.where(j < n_draft[:, None], est, 0.0), axis=1), axis=1)
    raw_sum = s.raw_sum + jnp.pad(jnp.where(reached, raw, 0.0), ((0, 0), (0, K - w)))
    return dict(out, predicted=s.predicted + jnp.where(active, tokens, 0.0), raw_sum=raw_sum)


def _cond(c: Carry, opts: Options):
    return jnp.any(~c.done) & (c.round < opts.max_new_tokens)


def rounds_loop(params: dict, config: ModelConfig, carry: Carry, knobs: Knobs, opts: Options, cond) -> Carry:
    """Rounds while cond(carry), on the device. With the width scheduler: two while loops — drafting rounds
    (`_speculative_round`) until the switch to plain decoding (`_plain_now`), then plain rounds
    (`_plain_round`), each loop's body free of the other's branch; the same rounds as `round_step` each time."""
    if not opts.adaptive:
        return jax.lax.while_loop(cond, lambda c: round_step(params, config, c, knobs, opts), carry)
    carry = jax.lax.while_loop(lambda c: cond(c) & ~_plain_now(c, knobs),
                               lambda c: _speculative_round(params, config, c, knobs, opts), carry)
    # the plain loop carries what a plain step reads and writes: the drafter state (no longer fed) and the
    # statistics other than `rounds` wait outside it, so its body's state is plain decoding's
    held = carry.stats
    lean = carry.replace(drafter=None, stats=Stats(rounds=held.rounds, drafted=None, accepted=None,
                                                   per_position=None, proposed_at=None, length_hist=None))
    lean = jax.lax.while_loop(cond, lambda c: _plain_step(params, config, c, knobs, opts), lean)
    stats = _fold_plain(held.replace(rounds=lean.stats.rounds), lean.stats.rounds - held.rounds, knobs)
    return lean.replace(drafter=carry.drafter, stats=stats)


@functools.partial(jax.jit, static_argnames=("config", "opts"), donate_argnames=("carry",))
def run_rounds(params: dict, config: ModelConfig, carry: Carry, knobs: Knobs, opts: Options) -> Carry:
    """All rounds in one on-device program (no host round-trips): `rounds_loop`."""
    return rounds_loop(params, config, carry, knobs, opts, lambda c: _cond(c, opts))


@functools.partial(jax.jit, static_argnames=("config", "opts"), donate_argnames=("carry",))
def round_jit(params: dict, config: ModelConfig, carry: Carry, knobs: Knobs, opts: Options) -> Carry:
    """One round as its own jitted call (the host loop; benchmarks dispatch it back to back)."""
    return round_step(params, config, carry, knobs, opts)


def run_rounds_python(params: dict, config: ModelConfig, carry: Carry, knobs: Knobs, opts: Options) -> Carry:
    """The Python-loop twin of `run_rounds`: the same jitted round, driven from the host."""
    while bool(_cond(carry, opts)):
        carry = round_jit(params, config, carry, knobs, opts)
    return carry
