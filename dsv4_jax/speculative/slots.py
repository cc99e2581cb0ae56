"""Decode slots for continuous batching: the device programs that the host scheduler (`speculative.scheduler`) drives.

B slots share one loop `Carry` (`speculative.program`: output buffer, budgets, done flags, target and drafter
state, statistics — every leaf has its batch axis somewhere, `batch_axes`). Between decode chunks the
host refills freed slots, in the JetStream / MaxText manner (prefill → insert → generate):

    init_rows     P empty prefill rows (`Rows`: a P-row target state, drafter state, first tokens)
    prefill_chunk one prompt chunk [P, C] into the rows (chunked prefill at one fixed shape; rows
                  whose prompt has ended get n_valid = 0 and keep their state); the chunk that holds
                  a prompt's last token samples its first generated token; the drafter is primed on
                  every chunk — both `speculative.prefill`'s, the programs `generate` runs too
    insert        the rows' decode state written into slots [P] of the carry (donated; a slot index
                  B drops the row), with fresh outputs, statistics and per-request budgets: the slot's
                  previous target *and drafter* state are replaced, so nothing of the old request leaks
    run_chunk     the speculative loop (`loop.rounds_loop`) for at most `max_rounds` rounds, or until
                  `min_finished` sequences that were running at the start of the chunk have finished
                  (or none is left running)

Shapes are fixed by (config, B, max_len, program): the chunk program compiles once per run, whatever
the prompts, budgets, refills or chunk length (`max_rounds`, `min_finished` are traced scalars);
init_rows, prefill and insert compile once per prefill width P.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..model.state import init_state
from ..config import ModelConfig
from ..drafters.base import Knobs
from .loop import rounds_loop
from .program import Carry, Program, initial_carry
from .prefill import Rows, init_rows, prefill_chunk

__all__ = ["Rows", "batch_axes", "carry_axes", "empty_carry", "init_rows", "insert", "prefill_chunk", "run_chunk",
           "rows_axes"]


def batch_axes(make) -> tuple[int | None, ...]:
    """The batch axis of every leaf (in `jax.tree.leaves` order) of the pytree make(batch) builds (None: a
    leaf without one), from abstract shapes at batch 2 and 3 (`jax.eval_shape`; nothing is allocated).
    A tuple, so that it can be a static jit argument."""
    a, b = jax.eval_shape(lambda: make(2)), jax.eval_shape(lambda: make(3))

    def axis(x, y):
        diff = [i for i, (m, n) in enumerate(zip(x.shape, y.shape)) if m != n]
        return diff[0] if diff else None

    return tuple(axis(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _dtype(params: dict):
    return params["embed"].dtype


def _init_parts(params: dict, config: ModelConfig, batch: int, max_len: int, program: Program):
    state = init_state(config, batch, max_len, program.k + 1, _dtype(params))
    dstate = program.drafter.init(program.bind(params, config), batch, max_len, _dtype(params))
    return state, dstate


def rows_axes(params: dict, config: ModelConfig, max_len: int, program: Program) -> tuple[int | None, ...]:
    """`batch_axes` of `Rows`."""
    return batch_axes(lambda n: Rows(*_init_parts(params, config, n, max_len, program), jnp.zeros((n,), jnp.int32)))


def carry_axes(params: dict, config: ModelConfig, max_len: int, program: Program) -> tuple[int | None, ...]:
    """`batch_axes` of the loop `Carry`."""
    def make(n):
        state, dstate = _init_parts(params, config, n, max_len, program)
        return initial_carry(jnp.zeros((n,), jnp.int32), state, dstate, jax.random.PRNGKey(0), program)
    return batch_axes(make)


def _leafwise(fn, axes: tuple, a, b):
    """fn(axis, leaf of a, leaf of b) over two pytrees of the same structure whose leaves' batch axes are axes."""
    leaves_a, tree = jax.tree.flatten(a)
    return jax.tree.unflatten(tree, [fn(ax, x, y) for ax, x, y in zip(axes, leaves_a, jax.tree.leaves(b))])


def _scatter_rows(big, rows, slots: jax.Array, axes: tuple):
    """big with rows[P] written at slots[P] along each leaf's batch axis; a slot index out of range
    (= B) drops its row; leaves without a batch axis keep big's value."""
    def one(ax, b, r):
        if ax is None:
            return b
        return b.at[(slice(None),) * ax + (slots,)].set(r, mode="drop")
    return _leafwise(one, axes, big, rows)


@functools.partial(jax.jit, static_argnames=("config", "batch", "max_len", "program"))
def empty_carry(params: dict, config: ModelConfig, *, batch: int, max_len: int, program: Program, key) -> Carry:
    """B idle slots (done, budget 0): the carry before the first insert."""
    state, dstate = _init_parts(params, config, batch, max_len, program)
    c = initial_carry(jnp.zeros((batch,), jnp.int32), state, dstate, key, program, jnp.zeros((batch,), jnp.int32))
    return c.replace(done=jnp.ones((batch,), bool))


@functools.partial(jax.jit, static_argnames=("program", "axes"), donate_argnames=("carry",))
def insert(carry: Carry, rows: Rows, slots: jax.Array, limits: jax.Array, *, program: Program, axes: tuple) -> Carry:
    """Write P prefilled rows into slots [P] (index B: skip the row) with budgets limits [P]: fresh
    outputs (the first token emitted), statistics and done flags. axes: `carry_axes` (static)."""
    fresh = initial_carry(rows.first, rows.target, rows.drafter, carry.key, program, limits)
    return _scatter_rows(carry, fresh, slots, axes)


@functools.partial(jax.jit, static_argnames=("config", "program"), donate_argnames=("carry",))
def run_chunk(params: dict, config: ModelConfig, carry: Carry, knobs: Knobs, max_rounds: jax.Array,
              min_finished: jax.Array, *, program: Program) -> Carry:
    """Speculative rounds (one on-device while loop) until max_rounds have run, min_finished of the
    sequences running at the start have finished, or every slot is done. carry.round counts rounds
    over the whole run."""
    running = ~carry.done
    r0 = carry.round

    def cond(c: Carry):
        finished = jnp.sum(c.done & running)
        return jnp.any(~c.done) & (finished < min_finished) & (c.round - r0 < max_rounds)

    return rounds_loop(params, config, carry, knobs, program, cond)
