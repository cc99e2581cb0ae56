"""The decode loop: rounds (`speculative.round`) in one jitted `lax.while_loop` (docs/design.md property 5).

    `run_rounds`         every round on the device, no host round-trips; with the width scheduler it stops
                         at the switch to plain decoding (its first while loop)
    `decode`             a run's rounds from its first carry: `run_rounds`, and after a switch the rest of
                         the run in the `none` program's compiled loop (`plain_program`: the executable a
                         drafter=None run of the same shapes uses), the state handed over (`hand_over`,
                         `hand_back`)
    `rounds_loop`        the traced loop under any stop condition (the slot engine's chunks: the plain
                         rounds after a switch in a second while loop of the same program)
    `round_jit`, `run_rounds_python`   one round per jitted call, driven from the host (debugging twin;
                         identical results)
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..config import ModelConfig
from ..drafters import registry
from ..drafters.base import Knobs
from ..ops.host import to_host
from . import stats as S
from .program import Carry, Program
from .round import plain_step, round_step, speculative_round
from .width_policy import plain_now


def cond(c: Carry, program: Program):
    """Whether any sequence is still running and rounds remain."""
    return jnp.any(~c.done) & (c.round < program.max_new_tokens)


def rounds_loop(params: dict, config: ModelConfig, carry: Carry, knobs: Knobs, program: Program, until,
                plain_tail: bool = True) -> Carry:
    """Rounds while until(carry), on the device. With the width scheduler: drafting rounds
    (`round.speculative_round`) until the switch to plain decoding (`width_policy.plain_now`), then, if
    plain_tail, plain rounds in a second while loop whose body is `round.plain_step` alone and whose carry
    holds neither the drafter state nor the statistics (both wait outside it; `stats.add_plain` after)."""
    if not program.adaptive:
        return jax.lax.while_loop(until, lambda c: round_step(params, config, c, knobs, program), carry)
    carry = jax.lax.while_loop(lambda c: until(c) & ~plain_now(c.stats, c.round, knobs),
                               lambda c: speculative_round(params, config, c, knobs, program), carry)
    if not plain_tail:
        return carry
    lean = jax.lax.while_loop(until, lambda c: plain_step(params, config, c, knobs, program),
                              carry.replace(drafter=None, stats=None))
    return lean.replace(drafter=carry.drafter,
                        stats=S.add_plain(carry.stats, lean.out_len - carry.out_len, knobs.plain_cost))


@functools.partial(jax.jit, static_argnames=("config", "program"), donate_argnames=("carry",))
def run_rounds(params: dict, config: ModelConfig, carry: Carry, knobs: Knobs, program: Program) -> Carry:
    """All rounds in one on-device program (`rounds_loop`); with the width scheduler, up to the switch."""
    return rounds_loop(params, config, carry, knobs, program, lambda c: cond(c, program), plain_tail=False)


@functools.partial(jax.jit, static_argnames=("config", "program"), donate_argnames=("carry",))
def round_jit(params: dict, config: ModelConfig, carry: Carry, knobs: Knobs, program: Program) -> Carry:
    """One round as its own jitted call (the host loop; benchmarks dispatch it back to back)."""
    return round_step(params, config, carry, knobs, program)


def run_rounds_python(params: dict, config: ModelConfig, carry: Carry, knobs: Knobs, program: Program) -> Carry:
    """The Python-loop twin of `decode`: the same jitted round, driven from the host."""
    while bool(cond(carry, program)):
        carry = round_jit(params, config, carry, knobs, program)
    return carry


def plain_program(program: Program) -> Program:
    """The program of a drafter=None run with the same options (`generate.prepare`'s)."""
    none = registry.get(None)
    return program.replace(drafter=none, setup=none.configure({}, None, 0), adaptive=False,
                           stats=S.StatsSpec(verification=program.stats.verification, trace=program.stats.trace))


def plain_knobs(knobs: Knobs) -> Knobs:
    """The knobs of a drafter=None run with the same sampling."""
    none = registry.get(None)
    return Knobs(temperature=knobs.temperature, top_p=knobs.top_p, drafter=none.knobs(none.options()))


@functools.partial(jax.jit, static_argnames=("spec", "batch", "bound", "max_new_tokens"))
def _fresh_stats(*, spec: S.StatsSpec, batch: int, bound: int, max_new_tokens: int) -> S.Stats:
    return S.zeros(spec, batch, bound, max_new_tokens)


def hand_over(carry: Carry, plain: Program) -> Carry:
    """The carry of the `none` program continuing carry (its target state, outputs, next tokens, done flags,
    budgets, key and round; no drafter state, fresh statistics): what a drafter=None run's loop takes."""
    B, K = carry.stats.core.per_position.shape
    return carry.replace(drafter=(), stats=_fresh_stats(spec=plain.stats, batch=B, bound=K,
                                                        max_new_tokens=plain.max_new_tokens))


_add_plain = jax.jit(S.add_plain)


def hand_back(drafter, stats: S.Stats, lean: Carry, knobs: Knobs) -> Carry:
    """lean (the `none` program's carry after the rest of the run) with the drafter state and statistics held
    at the switch, plus the plain rounds since (the `none` program's own count of them). Only the statistics
    go through a program: a jitted replace of the whole carry copied the decode state (0.75 ms a run on
    XLA:CPU for the bundled model, 1.6 % of its 64-token decode)."""
    return lean.replace(drafter=drafter, stats=_add_plain(stats, lean.stats.core.rounds, knobs.plain_cost))


def running(carry: Carry, program: Program) -> bool:
    """`cond` on the host: one read of the done flags and the round counter (no program launched)."""
    done, rounds = to_host((carry.done, carry.round))
    return bool((~done).any()) and int(rounds) < program.max_new_tokens


def decode(params: dict, config: ModelConfig, carry: Carry, knobs: Knobs, program: Program,
           host_loop: bool = False) -> Carry:
    """Every round of a run from its first carry (module docstring); host_loop: `run_rounds_python`."""
    if host_loop:
        return run_rounds_python(params, config, carry, knobs, program)
    carry = run_rounds(params, config, carry, knobs, program)
    if not program.adaptive or not running(carry, program):
        return carry
    plain = plain_program(program)
    lean = run_rounds(params, config, hand_over(carry, plain), plain_knobs(knobs), plain)   # donates the rest
    return hand_back(carry.drafter, carry.stats, lean, knobs)
