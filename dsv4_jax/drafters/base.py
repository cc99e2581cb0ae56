"""The interface every drafter implements for the speculative loop (docs/design.md property 5, docs/drafters.md).

A drafter is one object, registered by name in `dsv4_jax.drafters.registry`; the loop (`dsv4_jax.speculative`)
only calls these methods, never compares names, and passes the drafter's options through without
knowing their names:

    Options                              the drafter's options: a frozen dataclass whose fields made
                                         with `dynamic(...)` are per-run scalars (traced: changing
                                         them recompiles nothing), the others static (host side)
    configure(params, config, k, options, bundle)   host side, before any tracing: check that the
                                         weights are there and build the static `DraftSetup` (drafts
                                         per round, target tap layers, hashable settings) — part of
                                         the jit key; bundle: a checkpoint's drafter metadata by name
    max_drafts(setup)                    its cap on drafts per round (None: none), host side
    context_rows(run)                    how many committed positions before a round's anchor its proposal
                                         depends on (None: all); what-if's teacher-forced pass
                                         (`dsv4_jax.research.whatif`) feeds each anchor only those
    knobs(options)                       -> the dynamic part, a pytree of arrays the loop carries
                                         opaquely in `Knobs.drafter` (default: the dynamic fields)

The traced methods take `run = Bound(params, config, setup)`, bound once per program:

    init(run, batch, max_len, dtype)     -> state (a pytree) for blocks of up to setup.k + 1 tokens
    begin(run, batch, max_len, dtype, knobs)   the state a run starts from (default: init)
    observe(run, state, aux, tokens, start, n_valid)   -> state
                                         feed newly committed target positions start..start+n_valid−1:
                                         aux = the target step's {"hidden" [B,S,n,D], "taps"
                                         [B,S,len(taps),D]}, tokens [B,S] = the token after each
    propose_along(run, state, pos, last, path, key, knobs)  -> q [B,k,V] with the chain fed path [B,k]
                                         (teacher forcing; None where unsupported)
    propose(run, state, pos, last, key, knobs, greedy) -> (drafts [B,k], q [B,k,V], n_draft [B]):
                                         k = setup.k drafts after `last` (the token at position pos,
                                         not yet processed by the target), their draft distributions q
                                         (what rejection sampling needs) and how many to verify; the
                                         loop caps n_draft at knobs.draft_n (when set), and a drafter
                                         may skip the work for drafts beyond it; knobs.drafter is
                                         this drafter's `knobs(options)`
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from ..config import ModelConfig


@struct.dataclass
class Knobs:
    """Dynamic values of a run (no recompilation when they change): sampling, and the drafter's own
    dynamic options (`Drafter.knobs`: a pytree only the drafter reads)."""

    temperature: jax.Array
    top_p: jax.Array
    drafter: Any = None
    # drafts per round when the loop is compiled for a wider bound (`RunShape.dynamic_draft_n`): int32
    # scalar <= DraftSetup.k, the run's verify width − 1; None: DraftSetup.k (the static case)
    draft_n: jax.Array | None = None
    # the width scheduler (`Program.adaptive`, docs/width_scheduler.md): width_mode int32 [] (MODE_FIXED:
    # verify draft_n drafts; MODE_AUTO: choose each round; MODE_PLAIN: decode without the drafter),
    # width_cost [k+1] seconds per round verifying w = 0..k drafts, plain_cost [] seconds per plain round;
    # accept_scale [k]: the round's calibration factors (set by the loop, read by sequential drafters)
    width_mode: jax.Array | None = None
    width_cost: jax.Array | None = None
    plain_cost: jax.Array | None = None
    accept_scale: jax.Array | None = None


MODE_FIXED, MODE_AUTO, MODE_PLAIN = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class DraftSetup:
    """Static description of a run's drafter (hashable: it is part of the loop's jit key)."""

    k: int                              # drafts per round
    taps: tuple[int, ...] = ()          # target layers whose stream means the drafter reads (aux["taps"])
    settings: Any = None                # the drafter's own static settings (e.g. a DSparkConfig)


class Bound(NamedTuple):
    """What every traced drafter method shares, bound once per program."""

    params: dict
    config: ModelConfig
    setup: DraftSetup


def dynamic(default: float):
    """A dynamic option field: a per-run float32 scalar in `Knobs.drafter` (no recompilation)."""
    return dataclasses.field(default=default, metadata={"dynamic": True})


def dynamic_names(options) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(options) if f.metadata.get("dynamic"))


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """The options of a drafter that has none."""


class Drafter:
    """Base class: the "none" drafter (no drafts; the loop then decodes one token per round)."""

    name = "none"
    Options: type = NoOptions           # its options (a frozen dataclass; `dynamic` fields are per-run)
    weights: str | None = None          # params key of its weights (None: needs none)
    weights_help = ""                   # what its weights are called in messages ("MTP weights")
    stop_knob: str | None = None        # the dynamic option that shortens its chain, if any (research sweeps)
    scored = False                      # `propose_scored` returns confidences (a confidence head)
    # under the width scheduler's MODE_AUTO its chain stops before a draft `ops.width.keep_drafting` says no width
    # could pay for (MTP); what-if replays that stop (`dsv4_jax.research.whatif.replay_auto`)
    sequential = False

    # ---- options (host side) --------------------------------------------------------------------

    def options(self, given=None, **keywords):
        """The drafter's options: `given` (an instance of self.Options, or None for the defaults) with
        `keywords` replacing fields. TypeError naming the valid options for anything else; ValueError
        from `check_options` for bad values."""
        if given is not None and not isinstance(given, self.Options):
            raise TypeError(f"drafter {self.name!r} takes options={self.Options.__name__}(...), got "
                            f"{type(given).__name__}")
        valid = [f.name for f in dataclasses.fields(self.Options)]
        unknown = sorted(set(keywords) - set(valid))
        if unknown:
            raise TypeError(f"unknown option(s) {unknown} for drafter {self.name!r}; its options are "
                            f"{valid or 'none'}")
        out = dataclasses.replace(given if given is not None else self.Options(), **keywords)
        self.check_options(out)
        return out

    def check_options(self, options) -> None:
        """ValueError naming a bad option value (default: dynamic options must lie in [0, 1])."""
        for name in dynamic_names(options):
            v = getattr(options, name)
            if not 0 <= v <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {v}")

    def knobs(self, options):
        """The dynamic part of options: {name: float32 scalar} of its `dynamic` fields."""
        return {n: jnp.float32(getattr(options, n)) for n in dynamic_names(options)}

    def default_knobs(self, temperature: float = 1.0, top_p: float = 1.0, draft_n=None) -> Knobs:
        """Knobs for this drafter at its default options (benchmarks, tests)."""
        return Knobs(temperature=jnp.float32(temperature), top_p=jnp.float32(top_p),
                     drafter=self.knobs(self.options()), draft_n=draft_n)

    def configure(self, params: dict, config: ModelConfig, k: int, options=None, bundle=None) -> DraftSetup:
        return DraftSetup(k=0)

    def max_drafts(self, setup: DraftSetup) -> int | None:
        """The most drafts per round it proposes under setup, whatever k it was asked for (DSpark: its block
        size); None: as many as asked."""
        return None

    def context_rows(self, run: Bound) -> int | None:
        """The committed positions before an anchor that its state at the anchor depends on: observing only
        the last context_rows of them gives the same proposal as observing all (None: all are needed)."""
        return None

    # ---- traced ---------------------------------------------------------------------------------

    def init(self, run: Bound, batch: int, max_len: int, dtype):
        return ()

    def begin(self, run: Bound, batch: int, max_len: int, dtype, knobs: Knobs):
        """The state a run starts from, given its dynamic knobs (default: `init`)."""
        return self.init(run, batch, max_len, dtype)

    def observe(self, run: Bound, state, aux: dict, tokens: jax.Array, start: jax.Array, n_valid: jax.Array):
        return state

    def propose(self, run: Bound, state, pos: jax.Array, last: jax.Array, key, knobs: Knobs, greedy: bool):
        B, k = pos.shape[0], run.setup.k
        return (jnp.zeros((B, k), jnp.int32), jnp.zeros((B, k, run.config.vocab_size), jnp.float32),
                jnp.zeros((B,), jnp.int32))

    def propose_scored(self, run: Bound, state, pos: jax.Array, last: jax.Array, key, knobs: Knobs, greedy: bool):
        """`propose` plus the drafter's confidence in each draft: (drafts, q, n_draft, conf [B,k] float32 in
        [0,1], or None for a drafter without a confidence head). The loop records conf against realised
        acceptance (docs/verification.md §4)."""
        return self.propose(run, state, pos, last, key, knobs, greedy) + (None,)

    def propose_along(self, run: Bound, state, pos: jax.Array, last: jax.Array, path: jax.Array, key, knobs: Knobs):
        """Teacher forcing (what-if's sampled estimate, `dsv4_jax.research.whatif.along_path`): the draft
        distributions q [B,k,V] at temperature knobs.temperature when the chain after `last` is fed path [B,k]
        (the tokens that followed) instead of its own drafts. None: not supported by this drafter."""
        return None

    def require_weights(self, params: dict) -> None:
        """ValueError naming the missing weights (host side)."""
        if self.weights is not None and not params.get(self.weights):
            raise ValueError(f"drafter={self.name!r} needs {self.weights_help} in params[{self.weights!r}]")
