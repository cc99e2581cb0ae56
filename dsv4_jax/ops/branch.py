"""A `lax.switch` whose operand is updated in place: one while loop of at most one trip per branch.

`lax.switch(index, branches, state)` with branches that update a large state (a decode cache written by
a verify block) lowers to an XLA conditional, and XLA does not alias a conditional's operand with its
result: every execution copies the state's buffers in and out of the branch (on XLA:CPU ~0.2 ms per MB
per round; docs/width_scheduler.md §1 "The program"). A while loop's carry is updated in place, so
`switch_in_place` runs branch i as the body of a while loop that runs once when index == i and not at
all otherwise: the same result as `lax.switch`, with the state's buffers never copied. Read-only
operands (weights, the drafts) are closed over as with `lax.switch`.
"""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp


def switch_in_place(index: jax.Array, branches: Sequence[Callable], state):
    """branches[index](state) for int32 [] index in [0, len(branches)) (out of range: state unchanged);
    every branch maps state to a pytree of the same structure, shapes and dtypes."""
    for i, branch in enumerate(branches):
        state, _ = jax.lax.while_loop(lambda s, i=i: ~s[1] & (index == i),
                                      lambda s, branch=branch: (branch(s[0]), jnp.bool_(True)),
                                      (state, jnp.bool_(False)))
    return state
