"""One speculative round over a fixed carry: draft → verify → accept → commit (docs/design.md property 5).

    `round_step`         the drafter (`Program.drafter`, the object itself) proposes k drafts; the target
                         verifies [last, d_1..d_w] in one pass (`model.decode.process_block`); greedy prefix
                         match or lossless rejection sampling (`ops.verification`) accepts a of them plus
                         the correction / bonus token; `commit` emits, advances the decode state and feeds
                         the committed positions to the drafter
    `speculative_round`  the width scheduler's drafting round: w chosen per round (`ops.width.choose`)
    `plain_step`         a round without the drafter (one token; the scheduler's plain rounds)
    `scheduled_round`    the scheduler's round: `plain_round` once `width_policy.plain_now`, else drafting

The width w a round verifies is static in each copy of `commit`; a run-time bound (`Knobs.draft_n`) or the
scheduler's choice picks the copy with `ops.branch.switch_in_place` (the decode state updated in place).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..config import ModelConfig
from ..drafters.base import MODE_AUTO, Knobs
from ..model.decode import advance, process_block
from ..ops import branch, verification, width
from . import stats as S
from .program import Carry, Program, emit
from .width_policy import plain_now


class RoundInput(NamedTuple):
    """What `commit` verifies: drafts [B,w], their distributions q [B,w,V], n_draft [B] <= w to verify; conf
    [B,w] the drafter's confidences (None / −1: none); with the width scheduler est / raw [B,w] calibrated /
    raw acceptance estimates and offered [B] (the drafter proposed any); key: the carry's next key, k_acc:
    the verify's; plain: a round without the drafter (w = 0, nothing observed or counted)."""

    key: jax.Array
    k_acc: jax.Array
    drafts: jax.Array
    q: jax.Array
    n_draft: jax.Array
    conf: jax.Array | None = None
    est: jax.Array | None = None
    raw: jax.Array | None = None
    offered: jax.Array | None = None
    plain: bool = False

    def first(self, w: int) -> "RoundInput":
        """The round verifying only the first w drafts."""
        cut = lambda x: None if x is None else x[:, :w]
        return self._replace(drafts=self.drafts[:, :w], q=self.q[:, :w], conf=cut(self.conf), est=cut(self.est),
                             raw=cut(self.raw))


def commit(params: dict, config: ModelConfig, c: Carry, knobs: Knobs, program: Program, r: RoundInput) -> Carry:
    """Verify [last, drafts], accept, emit, commit, observe, count (`stats.add_round`)."""
    pos = c.target.pos
    B, w = r.drafts.shape
    n_draft = jnp.where(c.done, 0, r.n_draft)
    block = jnp.concatenate([c.last[:, None], r.drafts], axis=1)                     # [B,w+1]
    logits, tstate, aux = process_block(params, config, c.target, block, jnp.full((B,), w + 1, jnp.int32),
                                        program.taps)
    o = verification.verify(r.k_acc, logits, r.drafts, r.q, n_draft, knobs.temperature, knobs.top_p,
                            greedy=program.greedy, rule=program.verify, synthetic=program.synthetic_accept,
                            forced=program.forced_acceptance)
    a, nxt = o.n_accept, o.next
    # emitted this round: the a accepted drafts, then the correction / bonus token
    j = jnp.arange(w + 1)[None, :]
    emitted = jnp.where(j < a[:, None], jnp.pad(r.drafts, ((0, 0), (0, 1))), nxt[:, None])
    active = ~c.done
    out, out_len, done, _ = emit(c, emitted, a + 1, program)
    n_commit = jnp.where(active, a + 1, 0)
    tstate = advance(tstate, n_commit)
    dstate, stats = c.drafter, c.stats
    if not r.plain:             # plain rounds are counted by the caller (`stats.add_plain`)
        dstate = program.drafter.observe(program.bind(params, config), c.drafter, aux, emitted, pos,
                                         jnp.maximum(n_commit, 1))
        cost = None if knobs.width_cost is None else knobs.width_cost[w]
        stats = S.add_round(c.stats, S.Observed(active, n_draft, a, o, r.conf, r.est, r.raw, r.offered, cost, w,
                                                c.stats.core.rounds))
    return Carry(out=out, out_len=out_len, limit=c.limit, last=jnp.where(active, nxt, c.last), done=done,
                 target=tstate, drafter=dstate, key=r.key, stats=stats, round=c.round + 1)


def round_step(params: dict, config: ModelConfig, c: Carry, knobs: Knobs, program: Program) -> Carry:
    """One draft → verify → accept → commit round for every active sequence.

    With a run-time bound (`Knobs.draft_n`, RunShape.dynamic_draft_n) the verify and everything after it
    run at the run's own width, draft_n + 1: a switch over the widths 2..k + 1 the program holds
    (`ops.branch.switch_in_place`: the decode state updated in place, never copied through a conditional), so
    a run costs per round what a program compiled for its draft_n_max costs (only the drafting is shared).
    With the width scheduler (`Program.adaptive`): `scheduled_round`."""
    if program.adaptive:
        return scheduled_round(params, config, c, knobs, program)
    key, k_draft, k_acc = jax.random.split(c.key, 3)
    drafts, q, n_draft, conf = program.drafter.propose_scored(program.bind(params, config), c.drafter, c.target.pos,
                                                              c.last, k_draft, knobs, program.greedy)
    if knobs.draft_n is not None:
        n_draft = jnp.minimum(n_draft, knobs.draft_n)
    r = RoundInput(key, k_acc, drafts, q, n_draft, conf)
    if knobs.draft_n is None or program.k <= 1:
        return commit(params, config, c, knobs, program, r)
    widths = [lambda c, w=w: commit(params, config, c, knobs, program, r.first(w)) for w in range(1, program.k + 1)]
    return branch.switch_in_place(jnp.clip(knobs.draft_n, 1, program.k) - 1, widths, c)


def speculative_round(params: dict, config: ModelConfig, c: Carry, knobs: Knobs, program: Program) -> Carry:
    """A drafting round of the scheduler's program: the drafter proposes (its knobs carry the calibration
    factors, so a sequential drafter can stop early), and the round verifies w drafts, w = knobs.draft_n
    (MODE_FIXED) or the width with the most expected tokens per cost-table second (MODE_AUTO;
    `ops.width.choose`) — one switch over the widths 0..k whose branches update the decode state in place
    (`ops.branch.switch_in_place`; a `lax.switch` copied the whole state each round: docs/width_scheduler.md §1)."""
    factors = width.scale(c.stats.core.per_position, c.stats.group(S.Width).raw_sum)
    knobs = knobs.replace(accept_scale=factors)
    key, k_draft, k_acc = jax.random.split(c.key, 3)
    drafts, q, n_draft, conf = program.drafter.propose_scored(program.bind(params, config), c.drafter, c.target.pos,
                                                              c.last, k_draft, knobs, program.greedy)
    # conf −1 (no confidence head) is never binned (ops.verification.calibration_counts)
    conf = jnp.full(drafts.shape, -1.0, jnp.float32) if conf is None else conf
    # the raw estimate: a confidence head's (conf >= 0), else the draft's own probability (docs §2)
    raw = jnp.where(conf >= 0, conf, width.draft_probability(drafts, q))
    est = width.calibrated(raw, factors)
    n_draft = jnp.minimum(n_draft, knobs.draft_n)
    offered = n_draft > 0
    chosen = width.choose(est, n_draft, ~c.done, knobs.width_cost, knobs.draft_n)
    w_round = jnp.where(knobs.width_mode == MODE_AUTO, chosen, jnp.clip(knobs.draft_n, 0, program.k))
    r = RoundInput(key, k_acc, drafts, q, jnp.minimum(n_draft, w_round), conf, est, raw, offered)
    branches = [lambda c, w=w: commit(params, config, c, knobs, program, r.first(w)) for w in range(program.k + 1)]
    return branch.switch_in_place(w_round, branches, c)


def plain_step(params: dict, config: ModelConfig, c: Carry, knobs: Knobs, program: Program) -> Carry:
    """A round without the drafter: one token decoded, as in plain decoding; the drafter state is no longer
    fed and nothing is counted (an active sequence emits exactly one token: its plain rounds are the growth
    of out_len, `stats.add_plain`)."""
    key, _, k_acc = jax.random.split(c.key, 3)
    B, V = c.last.shape[0], config.vocab_size
    r = RoundInput(key, k_acc, jnp.zeros((B, 0), jnp.int32), jnp.zeros((B, 0, V), jnp.float32),
                   jnp.zeros((B,), jnp.int32), plain=True)
    return commit(params, config, c, knobs, program, r)


def plain_round(params: dict, config: ModelConfig, c: Carry, knobs: Knobs, program: Program) -> Carry:
    """`plain_step` with its statistics (the width histogram's plain column counts it)."""
    after = plain_step(params, config, c, knobs, program)
    return after.replace(stats=S.add_plain(c.stats, after.out_len - c.out_len, knobs.plain_cost))


def scheduled_round(params: dict, config: ModelConfig, c: Carry, knobs: Knobs, program: Program) -> Carry:
    """A round of a program with the width scheduler (docs/width_scheduler.md): `plain_round` once
    `width_policy.plain_now` holds, else `speculative_round` (`ops.branch.switch_in_place`: the carry updated in
    place). The device loops (`speculative.loop`) do not go through this conditional: they run the drafting
    rounds until the switch and the plain rounds after it apart, so that a plain round costs what plain
    decoding's costs."""
    return branch.switch_in_place(plain_now(c.stats, c.round, knobs).astype(jnp.int32),
                                  [lambda c: speculative_round(params, config, c, knobs, program),
                                   lambda c: plain_round(params, config, c, knobs, program)], c)
