"""The width scheduler's policy (docs/width_scheduler.md): its knobs, and when a run stops drafting for good.

    `width_knobs`                 host side: the knobs of a run with the scheduler (MODE_AUTO priced by a
                                  cost table, or MODE_FIXED)
    `plain_now`                   traced: whether the rounds from here on are plain decode steps
    `realised_rate_below_plain`   MODE_AUTO's switch: committed tokens per cost-table second not above
                                  plain decoding's 1 / plain_cost (§3)
    `no_width_can_pay`            every width costs at least its most tokens per round in plain rounds

The per-round choice of a width is `ops.width.choose`; the rounds are `speculative.round`'s.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..drafters.base import MODE_AUTO, MODE_FIXED, MODE_PLAIN, Knobs
from .stats import Stats, Width

WARMUP_ROUNDS = 4


def width_knobs(knobs: Knobs, table, k: int, auto: bool) -> Knobs:
    """The width scheduler's knobs: MODE_AUTO priced by the table (a `cost_table.CostTable`; None: unit costs,
    to be replaced by a calibration before the run) or MODE_FIXED (the table unused); k: the program's bound."""
    n = int(knobs.draft_n)
    cost, plain = table.costs(n) if table is not None else (np.ones((n + 1,), np.float32), np.float32(1.0))
    cost = np.pad(cost, (0, k - n), constant_values=np.float32(1e9))   # widths beyond the run's bound: never
    return knobs.replace(width_mode=jnp.int32(MODE_AUTO if auto else MODE_FIXED), width_cost=jnp.asarray(cost),
                         plain_cost=jnp.asarray(plain))


def no_width_can_pay(knobs: Knobs) -> jax.Array:
    """Whether every width w <= the run's bound costs at least w + 1 plain rounds (its most tokens per round):
    then no acceptance makes drafting pay and the run decodes plainly from its first round. bool []."""
    w = jnp.arange(knobs.width_cost.shape[0])
    bound = knobs.width_cost.shape[0] - 1 if knobs.draft_n is None else knobs.draft_n
    pays = (w <= bound) & (knobs.width_cost < (w + 1) * knobs.plain_cost)
    return ~jnp.any(pays)


def realised_rate_below_plain(s: Stats, knobs: Knobs, rounds: jax.Array) -> jax.Array:
    """MODE_AUTO's switch to plain decoding (docs/width_scheduler.md §3), bool []: at once when no width can pay
    even with every draft accepted (`no_width_can_pay`); else once the run's committed tokens per cost-table
    second so far are not above plain decoding's 1 / plain_cost (a tie goes to plain: its rounds skip the
    drafter's work) — after one round if the scheduler's own forecast for the rounds so far (Σ expected tokens,
    drafts offered every round) agrees, else after WARMUP_ROUNDS rounds (realised evidence against a forecast
    that said drafting pays)."""
    w = s.group(Width)
    cost = jnp.sum(w.cost_sum)
    realised_low = jnp.sum(s.core.rounds + s.core.accepted).astype(jnp.float32) * knobs.plain_cost <= cost
    # the forecast counts only where the drafter offered drafts every round (an n-gram without a match yet
    # offers none: no judgement of drafting to agree with)
    drafting_rounds = jnp.sum(s.core.rounds) - jnp.sum(w.width_hist[:, -1])
    forecast_low = (jnp.sum(w.predicted) * knobs.plain_cost <= cost) & (jnp.sum(w.offered) >= drafting_rounds)
    return no_width_can_pay(knobs) | (realised_low & (rounds >= jnp.where(forecast_low, 1, WARMUP_ROUNDS)))


def plain_now(s: Stats, rounds: jax.Array, knobs: Knobs) -> jax.Array:
    """Whether the scheduler's rounds from here on are plain decode steps: MODE_PLAIN, or MODE_AUTO once
    speculation has not paid (`realised_rate_below_plain`; final for the run). rounds: the loop's round
    counter. bool []."""
    return (knobs.width_mode == MODE_PLAIN) | ((knobs.width_mode == MODE_AUTO)
                                               & realised_rate_below_plain(s, knobs, rounds))
