"""Prefill and drafter priming: the programs `generate` and the slot engine (`speculative.slots`) share.

A prompt is prefilled by the target and the drafter is primed on it (fed the target's hidden states /
taps at every prompt position and the token after each; the token after a prompt's last position is the
first generated token, sampled from the prefill's last logits). Two ways:

    whole prompt    `prefill_target` (the target alone: shared by every drafter and setting with the
                    same shapes and taps) then `prime` (first token, drafter priming, the loop's carry)
    chunked         `init_rows` (P empty rows: target state, the drafter's start state, first tokens),
                    then per chunk of C tokens `prefill_chunk` = `prefill_piece` (the target on [P, C],
                    drafter-free) + `prime_piece` (the drafter primed on the chunk; a row whose prompt
                    ends in the chunk samples its first token there); `start_carry` turns the rows into
                    the loop's carry. One program each for every prompt length; the slot engine runs
                    the same calls and inserts the rows into slots instead.

Rows given no tokens in a chunk (n_valid = 0: their prompt ended earlier) keep their state: the target's
`process_block` / `advance` write nothing for them and a drafter's `observe` keeps its state on
n_valid = 0 (docs/drafters.md).
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ..config import ModelConfig
from ..model.decode import advance, process_block
from ..model.state import DecodeState, init_state
from ..ops.sampling import sample_first
from ..drafters.base import Knobs
from .program import Carry, Program, initial_carry


@struct.dataclass
class Rows:
    """P prompts being prefilled (or prefilled): the input of the loop's carry or of a slot."""

    target: DecodeState        # P-row target state
    drafter: Any               # P-row drafter state (its `begin` + `observe` of the prompt)
    first: jax.Array           # [P] the first generated token (valid once the prompt's last chunk ran)


def _drafter_aux(aux: dict, prefill_taps: tuple[int, ...], program: Program) -> dict:
    """The drafter's view of a prefill's aux: its own tap layers (program.taps) among the prefill's."""
    return {"hidden": aux["hidden"], "taps": aux["taps"][:, :, [prefill_taps.index(t) for t in program.taps]]}


def _prime(params: dict, config: ModelConfig, dstate, first: jax.Array, aux: dict, last_logits: jax.Array,
           nxt: jax.Array, start: jax.Array, n_valid: jax.Array, final: jax.Array, key, knobs: Knobs, *,
           program: Program, prefill_taps: tuple[int, ...]):
    """Prime the drafter on positions start + [0, C) (n_valid [B] real ones) and sample the first token of
    the rows whose prompt ends there (final [B]) from last_logits [B,V] (each row's logits at its last
    real position). nxt [B,C]: the token after each position; at a final row's last position the sampled
    first token. -> (drafter state, first [B])."""
    sampled = sample_first(key, last_logits, knobs.temperature, knobs.top_p, program.greedy)
    first = jnp.where(final, sampled, first)
    C = nxt.shape[1]
    at_last = final[:, None] & (jnp.arange(C)[None, :] == jnp.maximum(n_valid - 1, 0)[:, None])
    nxt = jnp.where(at_last, first[:, None], nxt)
    dstate = program.drafter.observe(program.bind(params, config), dstate, _drafter_aux(aux, prefill_taps, program),
                                     nxt, start, n_valid)
    return dstate, first


# ---- whole prompt ------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("config", "max_len", "max_block", "taps"))
def prefill_target(params: dict, config: ModelConfig, tokens: jax.Array, lengths: jax.Array, *, max_len: int,
                   max_block: int, taps: tuple[int, ...]):
    """The target's prefill of right-padded prompts tokens [B,S] (lengths [B] real ones), one jit.

    Returns (state advanced by lengths, logits at each prompt's last position [B,V], aux {"hidden"
    [B,S,n,D], "taps" [B,S,len(taps),D]}). Nothing here depends on the drafter or on k, so runs with
    the same shapes and taps share this program (`RunShape.max_block`, `RunShape.drafter_pool`)."""
    state = init_state(config, tokens.shape[0], max_len, max_block, params["embed"].dtype)
    n = jnp.asarray(lengths)
    logits, state, aux = process_block(params, config, state, jnp.asarray(tokens), n, taps)
    last_logits = jnp.take_along_axis(logits, (n - 1)[:, None, None], axis=1)[:, 0]
    return advance(state, n), last_logits, aux


@functools.partial(jax.jit, static_argnames=("config", "max_len", "program", "prefill_taps"),
                   donate_argnames=("state",))
def prime(params: dict, config: ModelConfig, state, last_logits: jax.Array, aux: dict, tokens: jax.Array,
          lengths: jax.Array, *, max_len: int, program: Program, prefill_taps: tuple[int, ...], knobs: Knobs,
          key) -> Carry:
    """Sample the first token, prime the drafter on the whole prompt tokens [B,S] and build the loop's
    initial carry (one jit).

    program.k sizes the carry (statistics [B,k], output room, the drafter's state): `start` passes the run's
    bound (max_block − 1), so every draft_n_max up to it shares this program. aux["taps"] holds
    prefill_taps; the drafter reads its own program.taps among them."""
    B = tokens.shape[0]
    tokens = jnp.asarray(tokens)
    key, k_first = jax.random.split(key)
    dstate = program.drafter.begin(program.bind(params, config), B, max_len, params["embed"].dtype, knobs)
    n = jnp.asarray(lengths)
    dstate, first = _prime(params, config, dstate, jnp.zeros((B,), jnp.int32), aux, last_logits,
                           jnp.concatenate([tokens[:, 1:], jnp.zeros((B, 1), jnp.int32)], axis=1).astype(jnp.int32),
                           jnp.zeros((B,), jnp.int32), n,
                           jnp.ones((B,), bool), k_first, knobs, program=program, prefill_taps=prefill_taps)
    return initial_carry(first, state, dstate, key, program)


# ---- chunked -----------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("config", "batch", "max_len", "program"))
def init_rows(params: dict, config: ModelConfig, knobs: Knobs, *, batch: int, max_len: int, program: Program) -> Rows:
    """P = batch empty rows (pos 0) to prefill into: the target state for verify blocks of program.k + 1, the
    drafter's start state (`begin`)."""
    dtype = params["embed"].dtype
    return Rows(target=init_state(config, batch, max_len, program.k + 1, dtype),
                drafter=program.drafter.begin(program.bind(params, config), batch, max_len, dtype, knobs),
                first=jnp.zeros((batch,), jnp.int32))


@functools.partial(jax.jit, static_argnames=("config", "taps"), donate_argnames=("state",))
def prefill_piece(params: dict, config: ModelConfig, state, tokens: jax.Array, n_valid: jax.Array, *,
                  taps: tuple[int, ...]):
    """The target on one chunk tokens [B,C] at state.pos (n_valid [B] real ones; 0: nothing), drafter-free.
    -> (state advanced by n_valid, logits at each row's last real token [B,V], aux {"hidden" [B,C,n,D],
    "taps" [B,C,len(taps),D]})."""
    logits, state, aux = process_block(params, config, state, tokens, n_valid, taps)
    last = jnp.take_along_axis(logits, jnp.maximum(n_valid - 1, 0)[:, None, None], axis=1)[:, 0]
    return advance(state, n_valid), last, aux


@functools.partial(jax.jit, static_argnames=("config", "program", "prefill_taps"), donate_argnames=("dstate",))
def prime_piece(params: dict, config: ModelConfig, dstate, first: jax.Array, aux: dict, last_logits: jax.Array,
                nxt: jax.Array, start: jax.Array, n_valid: jax.Array, final: jax.Array, key, knobs: Knobs, *,
                program: Program, prefill_taps: tuple[int, ...]):
    """The drafter primed on one chunk (`_prime`), the first token sampled where the prompt ends. -> (drafter
    state, first [B])."""
    return _prime(params, config, dstate, first, aux, last_logits, nxt, start, n_valid, final, key, knobs,
                  program=program, prefill_taps=prefill_taps)


def prefill_chunk(params: dict, config: ModelConfig, rows: Rows, tokens: jax.Array, n_valid: jax.Array, nxt,
                  final: jax.Array, start: int, key, knobs: Knobs, *, program: Program,
                  taps: tuple[int, ...]) -> Rows:
    """One prompt chunk tokens [P,C] (n_valid [P] real ones, right-padded; 0: the row's prompt ended before)
    into the rows at positions start + [0, C): `prefill_piece` then `prime_piece`. nxt [P,C]: the token
    after each position (the prompt shifted left); final [P]: the prompt's last token is in this chunk;
    taps: the tap layers the target computes (containing program.taps). key: for the first token."""
    state, last, aux = prefill_piece(params, config, rows.target, tokens, n_valid, taps=taps)
    dstate, first = prime_piece(params, config, rows.drafter, rows.first, aux, last, jnp.asarray(nxt),
                                jnp.full(n_valid.shape, start, jnp.int32), n_valid, final, key, knobs,
                                program=program, prefill_taps=taps)
    return Rows(target=state, drafter=dstate, first=first)


@functools.partial(jax.jit, static_argnames=("program",), donate_argnames=("rows",))
def start_carry(rows: Rows, key, *, program: Program) -> Carry:
    """The loop's initial carry of prefilled rows (their first token emitted)."""
    return initial_carry(rows.first, rows.target, rows.drafter, key, program)


def chunk_plan(lengths: np.ndarray, chunk: int, width: int) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """The chunks of a prefill of prompts lengths [B] padded to width: [(start, n_valid [B], final [B])]."""
    return [(lo, np.clip(lengths - lo, 0, chunk).astype(np.int32), (lengths > lo) & (lengths <= lo + chunk))
            for lo in range(0, max(width, 1), chunk)]


def next_tokens(tokens: np.ndarray, width: int) -> np.ndarray:
    """The token after each prompt position, [B,S] -> [B,width] (the prompt shifted left, zero-padded); the
    position of each prompt's last token gets the first generated token (`_prime`)."""
    out = np.zeros((tokens.shape[0], width), np.int32)
    n = min(tokens.shape[1] - 1, width)
    out[:, :n] = tokens[:, 1:n + 1]
    return out


def start(params: dict, config: ModelConfig, tokens: jax.Array, lengths: jax.Array, *, max_len: int,
          program: Program, knobs: Knobs, key, max_block: int | None = None, prefill_taps: tuple | None = None,
          prefill_chunk: int | None = None) -> Carry:
    """Prefill the prompts, sample the first token, and prime the drafter: the loop's initial carry.

    max_block (default program.k + 1) sizes the decode state and the carry for verify blocks up to that
    width; prefill_taps (default program.taps, must contain them) are the tap layers the prefill computes;
    prefill_chunk: the chunked programs (module docstring), chunks of that many tokens."""
    max_block = program.k + 1 if max_block is None else max_block
    prefill_taps = tuple(program.taps) if prefill_taps is None else tuple(prefill_taps)
    if max_block < program.k + 1 or not set(program.taps) <= set(prefill_taps):
        raise ValueError(f"max_block {max_block} / prefill taps {prefill_taps} do not cover k={program.k}, "
                         f"taps {program.taps}")
    program = program.at_bound(max_block - 1)
    if prefill_chunk is None:
        state, last_logits, aux = prefill_target(params, config, tokens, lengths, max_len=max_len,
                                                 max_block=max_block, taps=prefill_taps)
        return prime(params, config, state, last_logits, aux, tokens, lengths, max_len=max_len, program=program,
                     prefill_taps=prefill_taps, knobs=knobs, key=key)
    tokens, lengths = np.asarray(tokens, np.int32), np.asarray(lengths, np.int32)
    B, S = tokens.shape
    width = -(-S // prefill_chunk) * prefill_chunk
    padded = np.zeros((B, width), np.int32)
    padded[:, :S] = tokens
    nxt = next_tokens(padded, width)
    key, k_first = jax.random.split(key)          # as `prime`: the same first tokens
    rows = init_rows(params, config, knobs, batch=B, max_len=max_len, program=program)
    for lo, n_valid, final in chunk_plan(lengths, prefill_chunk, S):
        hi = lo + prefill_chunk
        rows = _chunk_step(params, config, rows, jnp.asarray(padded[:, lo:hi]), jnp.asarray(n_valid),
                           nxt[:, lo:hi], jnp.asarray(final), lo, k_first, knobs, program=program,
                           taps=prefill_taps)
    return start_carry(rows, key, program=program)


_chunk_step = prefill_chunk    # within `start`, its argument prefill_chunk (a size) shadows the function
