"""What the decode loop is compiled for (`Program`, its jit key) and what it carries between rounds (`Carry`).

    Program   static, hashable: the Drafter object itself (compared by identity: a drafter registered
              anew under a name is a new program), its composed `drafters.base.DraftSetup` (k: the
              compiled bound on drafts per round, taps, settings), greedy, the output budget, EOS, the
              verify rule, synthetic / forced acceptance, the width scheduler, the statistics' groups
    Carry     the loop state: outputs [B, max_new_tokens + K + 1] (K: the carry's bound, >= Program.k),
              lengths, budgets, the next token, done flags, target and drafter state, key, `stats.Stats`,
              the round counter

`emit` appends a round's tokens (EOS and budgets); `initial_carry` is the carry of prefilled rows.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from ..config import ModelConfig
from ..drafters.base import Bound, Drafter, DraftSetup
from ..model.state import DecodeState
from . import stats as S
from .stats import StatsSpec


@dataclasses.dataclass(frozen=True)
class Program:
    """The static choices of a run: the loop's jit key (docs/design.md property 1)."""

    drafter: Drafter                     # the object (hash and == by identity), not its registered name
    setup: DraftSetup                    # k: drafts per round the loop is compiled for (the bound)
    greedy: bool = True
    max_new_tokens: int = 16             # the output buffer (every sequence's budget is at most this)
    eos_token_id: int = -1               # -1: none
    # sampled runs' verify rule: "token" (rejection sampling) | "block" (docs/verification.md §2; greedy: same)
    verify: str = "token"
    # cost studies (docs/verification.md §5): each draft accepted with probability r_j (a tuple of rates, the
    # last repeating), independently; None: real verification
    synthetic_accept: tuple | None = None
    # cost benchmarks only: accept every proposed draft (ops.sampling.verify_forced; greedy runs; not lossless)
    forced_acceptance: bool = False
    # the width scheduler is in the program (docs/width_scheduler.md; needs Knobs.draft_n and the width_*
    # knobs): the verify width chosen per round (Knobs.width_mode MODE_AUTO), a fixed one, or plain decoding
    adaptive: bool = False
    stats: StatsSpec = StatsSpec()

    @property
    def k(self) -> int:
        return self.setup.k

    @property
    def taps(self) -> tuple[int, ...]:
        return self.setup.taps

    def bind(self, params: dict, config: ModelConfig) -> Bound:
        """The first argument of the drafter's traced methods."""
        return Bound(params, config, self.setup)

    def replace(self, **changes) -> "Program":
        return dataclasses.replace(self, **changes)

    def at_bound(self, k: int) -> "Program":
        """The program with the drafter set up for k drafts (what sizes a carry for a wider bound)."""
        return self.replace(setup=dataclasses.replace(self.setup, k=k))


@struct.dataclass
class Carry:
    out: jax.Array             # [B, max_new + K + 1] generated tokens (−1 = none)
    out_len: jax.Array         # [B]
    limit: jax.Array           # [B] each sequence's token budget (<= program.max_new_tokens, the buffer's)
    last: jax.Array            # [B] the next token to feed the target (sampled, not yet processed)
    done: jax.Array            # [B] bool
    target: DecodeState
    drafter: Any
    key: jax.Array
    stats: S.Stats
    round: jax.Array           # scalar int32


def emit(c: Carry, tokens: jax.Array, n_new: jax.Array, program: Program):
    """Append up to n_new[b] of tokens [B,m] to each output; stop at EOS or the budget. -> (out, out_len, done, n)."""
    m = tokens.shape[1]
    j = jnp.arange(m)[None, :]
    n = jnp.where(c.done, 0, jnp.minimum(n_new, c.limit - c.out_len))
    hit_eos = jnp.zeros_like(c.done)
    if program.eos_token_id >= 0:
        is_eos = (tokens == program.eos_token_id) & (j < n[:, None])
        first = jnp.argmax(is_eos, axis=1)
        hit_eos = jnp.any(is_eos, axis=1)
        n = jnp.where(hit_eos, first + 1, n)
    idx = jnp.where(j < n[:, None], c.out_len[:, None] + j, c.out.shape[1])
    out = c.out.at[jnp.arange(c.out.shape[0])[:, None], idx].set(tokens, mode="drop")
    out_len = c.out_len + n
    done = c.done | hit_eos | (out_len >= c.limit)
    return out, out_len, done, n


def initial_carry(first: jax.Array, target: DecodeState, drafter, key, program: Program, limit=None) -> Carry:
    """The carry of freshly prefilled sequences: first [B] (the token sampled from the prompt) already
    emitted, empty statistics sized for program.k; limit [B] per-sequence budgets (default
    program.max_new_tokens)."""
    B, k, T = first.shape[0], program.k, program.max_new_tokens
    fresh = lambda *shape: jnp.zeros(shape, jnp.int32)   # distinct buffers: the carry is donated
    limit = jnp.full((B,), T, jnp.int32) if limit is None else jnp.asarray(limit, jnp.int32)
    c = Carry(out=jnp.full((B, T + k + 1), -1, jnp.int32), out_len=fresh(B), limit=limit, last=first,
              done=jnp.zeros((B,), bool), target=target, drafter=drafter, key=key,
              stats=S.zeros(program.stats, B, k, T), round=fresh())
    # the first token is already generated: emit it (it may be EOS, or the whole budget)
    out, out_len, done, _ = emit(c, first[:, None], jnp.ones((B,), jnp.int32), program)
    return c.replace(out=out, out_len=out_len, done=done)
