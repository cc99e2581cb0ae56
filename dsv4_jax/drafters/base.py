"""The interface every drafter implements for the speculative loop (docs/design.md property 5).

A drafter is one object, registered by name in `dsv4_jax.drafters.registry`; the loop (`dsv4_jax.speculative`)
only calls these methods, never compares names:

    configure(params, config, k, meta)   host side, before any tracing: check that the weights are
                                         there and build the static `DraftSetup` (drafts per round,
                                         target tap layers, hashable settings) — part of the jit key
    init(params, config, setup, batch, max_len, dtype)                    -> state (a pytree) for
                                         blocks of up to setup.k + 1 tokens (the run's bound)
    begin(..., knobs)                    the state a run starts from (default: init)
    observe(params, config, setup, state, aux, tokens, start, n_valid)   -> state
                                         feed newly committed target positions start..start+n_valid−1:
                                         aux = the target step's {"hidden" [B,S,n,D], "taps"
                                         [B,S,len(taps),D]}, tokens [B,S] = the token after each
    propose(params, config, setup, state, pos, last, key, knobs, greedy) -> (drafts [B,k], q [B,k,V],
                                         n_draft [B]): k = setup.k drafts after `last` (the token at
                                         position pos, not yet processed by the target), their draft
                                         distributions q (what rejection sampling needs) and how many
                                         to verify; the loop caps n_draft at knobs.draft_n (when set),
                                         and a drafter may skip the work for drafts beyond it
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from ..config import ModelConfig


@struct.dataclass
class Knobs:
    """Dynamic scalars of a run (no recompilation when they change): sampling and the drafters' stop rules."""

    temperature: jax.Array
    top_p: jax.Array
    p_min: jax.Array          # MTP: stop the chain before a draft whose top-1 probability is below it
    confidence: jax.Array     # DSpark: confidence threshold
    drafter_index: jax.Array | None = None   # `drafters.pool`: which member drafts (int32 scalar)
    # drafts per round when the loop is compiled for a wider bound (`RunShape.dynamic_draft_n`): int32
    # scalar <= DraftSetup.k, the run's verify width − 1; None: DraftSetup.k (the static case)
    draft_n: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class DraftSetup:
    """Static description of a run's drafter (hashable: it is part of the loop's jit key)."""

    k: int                              # drafts per round
    taps: tuple[int, ...] = ()          # target layers whose stream means the drafter reads (aux["taps"])
    settings: Any = None                # the drafter's own static settings (e.g. a DSparkConfig)


class Drafter:
    """Base class: the "none" drafter (no drafts; the loop then decodes one token per round)."""

    name = "none"
    weights: str | None = None          # params key of its weights (None: needs none)
    weights_help = ""                   # what its weights are called in messages ("MTP weights")
    stop_knob: str | None = None        # the `Knobs` / generate option that shortens its chain, if any
    scored = False                      # `propose_scored` returns confidences (a confidence head)

    def configure(self, params: dict, config: ModelConfig, k: int, meta=None) -> DraftSetup:
        return DraftSetup(k=0)

    def init(self, params: dict, config: ModelConfig, setup: DraftSetup, batch: int, max_len: int, dtype):
        return ()

    def begin(self, params: dict, config: ModelConfig, setup: DraftSetup, batch: int, max_len: int, dtype,
              knobs: Knobs):
        """The state a run starts from, given its dynamic knobs (default: `init`; `drafters.pool` keeps
        the member index)."""
        return self.init(params, config, setup, batch, max_len, dtype)

    def observe(self, params: dict, config: ModelConfig, setup: DraftSetup, state, aux: dict, tokens: jax.Array,
                start: jax.Array, n_valid: jax.Array):
        return state

    def propose(self, params: dict, config: ModelConfig, setup: DraftSetup, state, pos: jax.Array,
                last: jax.Array, key, knobs: Knobs, greedy: bool):
        B, k = pos.shape[0], setup.k
        return (jnp.zeros((B, k), jnp.int32), jnp.zeros((B, k, config.vocab_size), jnp.float32),
                jnp.zeros((B,), jnp.int32))

    def propose_scored(self, params: dict, config: ModelConfig, setup: DraftSetup, state, pos: jax.Array,
                       last: jax.Array, key, knobs: Knobs, greedy: bool):
        """`propose` plus the drafter's confidence in each draft: (drafts, q, n_draft, conf [B,k] float32 in
        [0,1], or None for a drafter without a confidence head). The loop records conf against realised
        acceptance (docs/verification.md §4)."""
        return self.propose(params, config, setup, state, pos, last, key, knobs, greedy) + (None,)

    def require_weights(self, params: dict) -> None:
        """ValueError naming the missing weights (host side)."""
        if self.weights is not None and not params.get(self.weights):
            raise ValueError(f"drafter={self.name!r} needs {self.weights_help} in params[{self.weights!r}]")
