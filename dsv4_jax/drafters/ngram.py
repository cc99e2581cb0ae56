"""The n-gram (prompt-lookup) drafter: drafts continue the latest earlier match of the last tokens.

As llama.cpp's and vLLM's n-gram drafters do: take the last n tokens of the sequence (prompt + output,
ending with `last`, the token at position pos), find the latest earlier position where the same n
tokens occur, and propose the tokens that followed there (at most k, and at most up to pos). The
longest n in [n_min, n_max] with a match wins; no match proposes nothing (the round decodes one token).
Drafts are point masses (q = one-hot), so rejection sampling accepts draft d with probability p(d) and
otherwise samples the residual: the output law is the target's (docs/drafter_math.md §3; lossless like
the oracle). No weights; everything on device at fixed shapes.

State (`NgramState`): the sequence by position, [B, max_len] (−1 where not seen). It is filled by
`observe`, which sees the token after each committed position, so position 0 (the prompt's first token)
is never known and no match starts there.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from .base import DraftSetup, Drafter


@dataclasses.dataclass(frozen=True)
class NgramOptions:
    """n_min..n_max: the suffix lengths matched, longest first (static)."""

    n_min: int = 1
    n_max: int = 3


@struct.dataclass
class NgramState:
    tokens: jax.Array     # [B, L] token at each position (−1: not seen)


def init(batch: int, max_len: int) -> NgramState:
    return NgramState(tokens=jnp.full((batch, max_len), -1, jnp.int32))


def observe(st: NgramState, tokens: jax.Array, start: jax.Array, n_valid: jax.Array) -> NgramState:
    """Record tokens [B,S]: tokens[:, j] is the token at position start + 1 + j, for j < n_valid [B]."""
    B, S = tokens.shape
    j = jnp.arange(S)[None, :]
    idx = jnp.where(j < n_valid[:, None], start[:, None] + 1 + j, st.tokens.shape[1])   # out of range: dropped
    return NgramState(tokens=st.tokens.at[jnp.arange(B)[:, None], idx].set(tokens.astype(jnp.int32), mode="drop"))


def latest_match(seq: jax.Array, pos: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """The latest e < pos with seq[e−n+1..e] == seq[pos−n+1..pos] (all seen): (found [B], e [B]). seq [B,L]."""
    L = seq.shape[1]
    e = jnp.arange(L)[None, :]
    ok = (e < pos[:, None]) & (e >= n - 1) & (pos[:, None] >= n - 1)
    for i in range(n):
        want = jnp.take_along_axis(seq, jnp.maximum(pos - i, 0)[:, None], axis=1)              # [B,1]
        shifted = jnp.pad(seq, ((0, 0), (i, 0)), constant_values=-1)[:, :L]                   # seq[e − i]
        ok &= (shifted == want) & (want >= 0)
    return jnp.any(ok, axis=1), jnp.max(jnp.where(ok, e, -1), axis=1)


def propose(st: NgramState, pos: jax.Array, last: jax.Array, k: int, n_min: int, n_max: int, vocab_size: int):
    """Drafts after `last` (the token at position pos [B]): (drafts [B,k], q one-hot [B,k,V], n_draft [B])."""
    B, L = st.tokens.shape
    seq = st.tokens.at[jnp.arange(B), pos].set(last.astype(jnp.int32), mode="drop")
    found, at = jnp.zeros((B,), bool), jnp.zeros((B,), jnp.int32)
    for n in range(n_max, n_min - 1, -1):           # the longest suffix with a match wins
        f, e = latest_match(seq, pos, n)
        at = jnp.where(f & ~found, e, at)
        found = found | f
    n_draft = jnp.where(found, jnp.minimum(k, pos - at), 0).astype(jnp.int32)
    j = jnp.arange(k)[None, :]
    drafts = jnp.take_along_axis(seq, jnp.clip(at[:, None] + 1 + j, 0, L - 1), axis=1)
    drafts = jnp.where(j < n_draft[:, None], drafts, 0).astype(jnp.int32)
    return drafts, jax.nn.one_hot(drafts, vocab_size, dtype=jnp.float32), n_draft


class NgramDrafter(Drafter):
    """The n-gram drafter behind the loop's interface (`drafters.base`); settings: its NgramOptions."""

    name = "ngram"
    Options = NgramOptions

    def check_options(self, options: NgramOptions) -> None:
        if not 1 <= options.n_min <= options.n_max:
            raise ValueError(f"ngram needs 1 <= n_min <= n_max, got n_min={options.n_min}, n_max={options.n_max}")

    def configure(self, params, config, k, options=None, bundle=None) -> DraftSetup:
        return DraftSetup(k=k, settings=self.options(options))

    def init(self, run, batch, max_len, dtype):
        return init(batch, max_len)

    def observe(self, run, state, aux, tokens, start, n_valid):
        return observe(state, tokens, start, n_valid)

    def propose(self, run, state, pos, last, key, knobs, greedy):
        o = run.setup.settings
        return propose(state, pos, last, run.setup.k, o.n_min, o.n_max, run.config.vocab_size)


DRAFTER = NgramDrafter()
