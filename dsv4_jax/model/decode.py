"""Prefill, chunked prefill, single-token decode, multi-token verify and commit over a DecodeState.

All entry points share one jitted block step (`process_block`): it runs a block of S tokens at
positions pos..pos+S−1 (a `state.Span`) through every layer against the state (a `state.LayerCache` per
layer) and writes their rows; only `pos` decides what is committed (see state.py). The wrappers differ in
how far `pos` moves:

    prefill / extend   pos += lengths   (right-padded ragged batches; any chunk size)
    decode_step        pos += 1
    verify             pos unchanged; then commit(state, n_accept): pos += n_accept + 1
                       (the block's first token and its n_accept accepted drafts are kept)

The entry points take a `ModelConfig` or the bundle `load_checkpoint` returns, and `backends=` (a
`Backends`, or "auto" | "reference" | "pallas"; default: the config's), resolved before tracing;
`process_block` itself takes a plain ModelConfig with concrete backends (its static jit key).

Every step also returns what the drafters read: `hidden` = the last layer's HC streams before
hc_head [B,S,n,D] (MTP) and `taps` = the mean over HC streams of the output of each tap layer
[B,S,len(taps),D] (DSpark).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..backends import Backends
from ..bundle import CheckpointConfig, target_config
from .state import CapacityError, DecodeState, Span, init_state
from ..config import ModelConfig
from .layers.block import layer_step
from .target import embed, head, run_segments


@functools.partial(jax.jit, static_argnames=("config", "taps"), donate_argnames=("state",))
def process_block(params: dict, config: ModelConfig, state: DecodeState, tokens: jax.Array, n_valid: jax.Array,
                  taps: tuple[int, ...] = ()):
    """Run tokens [B,S] at positions state.pos + [0, S) with n_valid[B] real tokens; pos is not advanced.

    Returns (logits [B,S,V], state with the block's rows written, {"hidden", "taps"}).
    """
    B, S = tokens.shape
    span = Span.of(state.pos, S, n_valid)
    X = embed(params, config, tokens)
    D = X.shape[-1]
    tap_vals = jnp.zeros((B, S, len(taps), D), X.dtype)

    def fn(carry, p, cache, kind, layer):
        X, tv = carry
        X, cache = layer_step(X, p, cache, config, kind, tokens, span)
        for i, t in enumerate(taps):
            tv = tv.at[:, :, i].set(jnp.where(layer == t, jnp.mean(X, axis=2), tv[:, :, i]))
        return (X, tv), cache

    (X, tap_vals), layers = run_segments(params, config, (X, tap_vals), fn, state.layers)
    logits = head(params, config, X)
    return logits, state.replace(layers=layers), {"hidden": X, "taps": tap_vals}


def advance(state: DecodeState, n: jax.Array) -> DecodeState:
    """Commit n[B] more tokens per sequence."""
    return state.replace(pos=state.pos + jnp.asarray(n, jnp.int32))


def _check_taps(config: ModelConfig, taps) -> tuple[int, ...]:
    taps = tuple(int(t) for t in taps)
    bad = [t for t in taps if not 0 <= t < config.num_layers]
    if bad:
        raise ValueError(f"tap layers {bad} outside 0..{config.num_layers - 1}")
    return taps


def _check_room(state: DecodeState, need_after: np.ndarray, what: str):
    """need_after [B]: positions each sequence reaches. Raises CapacityError naming the sequence."""
    over = np.nonzero(need_after > state.max_len)[0]
    if over.size:
        b = int(over[0])
        raise CapacityError(f"{what}: sequence {b} would reach {int(need_after[b])} tokens, beyond the cache "
                            f"capacity max_len={state.max_len}")


def _lengths(tokens, lengths) -> np.ndarray:
    B, S = tokens.shape
    if lengths is None:
        return np.full((B,), S, np.int32)
    lengths = np.asarray(lengths, np.int32).reshape(-1)
    if lengths.shape != (B,) or (lengths < 0).any() or (lengths > S).any():
        raise ValueError(f"lengths must be {B} ints in 0..{S}, got {lengths.tolist()}")
    return lengths


def extend(params: dict, config: ModelConfig | CheckpointConfig, state: DecodeState, tokens, lengths=None, *,
           taps=(), backends: Backends | str | None = None):
    """Chunked prefill: append right-padded tokens [B,S] (lengths[B] real ones) to every sequence.

    Returns (logits [B,S,V], state, aux); logits at padded positions are meaningless.
    """
    config = target_config(config, backends)
    tokens = jnp.asarray(tokens, jnp.int32)
    lengths = _lengths(tokens, lengths)
    _check_room(state, np.asarray(state.pos) + lengths, "extend")
    logits, state, aux = process_block(params, config, state, tokens, jnp.asarray(lengths),
                                       _check_taps(config, taps))
    return logits, advance(state, lengths), aux


def prefill(params: dict, config: ModelConfig | CheckpointConfig, tokens, lengths=None, *, max_len: int,
            max_block: int = 8, taps=(), dtype=None, backends: Backends | str | None = None):
    """Start a batch: tokens [B,S] right-padded, lengths [B] (default S). Returns (logits, state, aux).

    Each sequence's results equal its unpadded single-sequence results. `max_block` is the widest
    decode/verify block used later (k + 1 for k drafts).
    """
    config = target_config(config, backends)
    tokens = jnp.asarray(tokens, jnp.int32)
    dtype = dtype or params["embed"].dtype
    state = init_state(config, tokens.shape[0], max_len, max_block, dtype)
    return extend(params, config, state, tokens, lengths, taps=taps)


def decode_step(params: dict, config: ModelConfig | CheckpointConfig, state: DecodeState, tokens, *, taps=(),
                check: bool = True, backends: Backends | str | None = None):
    """One token per sequence: tokens [B] -> (logits [B,V], state with pos + 1, aux)."""
    config = target_config(config, backends)
    tokens = jnp.asarray(tokens, jnp.int32).reshape(-1, 1)
    if check:
        _check_room(state, np.asarray(state.pos) + 1, "decode_step")
    n = jnp.ones((tokens.shape[0],), jnp.int32)
    logits, state, aux = process_block(params, config, state, tokens, n, _check_taps(config, taps))
    return logits[:, 0], advance(state, n), aux


def verify(params: dict, config: ModelConfig | CheckpointConfig, state: DecodeState, tokens, *, taps=(),
           check: bool = True, backends: Backends | str | None = None):
    """Score a block tokens [B, k+1] (last committed-next token + k drafts) without committing it.

    Returns (logits [B,k+1,V], state with the block's rows written but pos unchanged, aux).
    Follow with commit(state, n_accept).
    """
    config = target_config(config, backends)
    tokens = jnp.asarray(tokens, jnp.int32)
    B, S = tokens.shape
    if S > state.max_block:
        raise CapacityError(f"verify block of {S} tokens is wider than the state's max_block={state.max_block}")
    if check:
        _check_room(state, np.asarray(state.pos) + S, "verify")
    n = jnp.full((B,), S, jnp.int32)
    return process_block(params, config, state, tokens, n, _check_taps(config, taps))


def commit(state: DecodeState, n_accept) -> DecodeState:
    """After verify: keep the block's first token and n_accept[B] drafts (pos += n_accept + 1)."""
    return advance(state, jnp.asarray(n_accept, jnp.int32) + 1)
