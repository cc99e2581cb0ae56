"""A pool of drafters compiled into one program, the member chosen at run time (research sweeps).

`RunShape(drafter_pool=("mtp", "dspark"))` makes `generate` run its drafter through this one: the loop
program of a draft width then holds every member (`lax.switch` on the dynamic `Knobs.drafter_index`), so
a sweep over drafters compiles one loop per width instead of one per (drafter, width), and the prefill
computes the union of the members' tap layers, so every run of the sweep shares it. Only the chosen
member's branch executes: the drafts, hence the tokens, are the member's own. The cost of sharing is
the tap means of the other members' layers in each verify block ([B, k+1, D] means; DSpark's three
layers) and carrying the idle members' (small) states.

State: (the member index, a tuple of the members' states in member order); `begin` takes the index
from the run's knobs.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .base import DraftSetup, Drafter

NAME = "pool"


@dataclasses.dataclass(frozen=True)
class Member:
    """One drafter of a pool: its registered name and its static setup less k (k is the pool's)."""

    name: str
    taps: tuple[int, ...]
    settings: object = None

    def setup(self, k: int) -> DraftSetup:
        return DraftSetup(k=k, taps=self.taps, settings=self.settings)


def member_names(setup: DraftSetup) -> tuple[str, ...]:
    return tuple(m.name for m in setup.settings)


def _member_aux(aux: dict, pool_taps: tuple[int, ...], member: Member) -> dict:
    """The member's view of a step's aux: its own tap layers, in its order."""
    return {"hidden": aux["hidden"], "taps": aux["taps"][:, :, [pool_taps.index(t) for t in member.taps]]}


class PoolDrafter(Drafter):
    """Members behind one drafter; `Knobs.drafter_index` (dynamic) picks the one that drafts. State:
    (index int32 [], tuple of the members' states). lookup: name -> Drafter (`registry.get`)."""

    name = NAME

    def __init__(self, lookup):
        self.lookup = lookup

    def configure(self, params, config, k, meta=None) -> DraftSetup:
        """meta: {"members": names, and each member's metadata by name}; `generate` builds it from
        RunShape.drafter_pool. ValueError when a member caps k lower than another (one verify width
        per program) or a name is not a drafter that drafts."""
        meta = dict(meta or {})
        if not meta.get("members"):
            raise ValueError("the drafter pool is chosen with RunShape(drafter_pool=(names...)), not drafter='pool'")
        names = tuple(dict.fromkeys(meta.pop("members")))
        members, ks = [], {}
        for name in names:
            drafter = self.lookup(name)
            if drafter.name in ("none", NAME):
                raise ValueError(f"drafter_pool takes drafters that draft, not {name!r}")
            s = drafter.configure(params, config, k, meta.get(name))
            members.append(Member(name, tuple(s.taps), s.settings))
            ks[name] = s.k
        if len(set(ks.values())) > 1:
            raise ValueError(f"drafter_pool: the members propose different numbers of drafts at draft_n_max {k}: "
                             f"{ks}; pool drafters with the same cap")
        taps = tuple(sorted({t for m in members for t in m.taps}))
        return DraftSetup(k=next(iter(ks.values())), taps=taps, settings=tuple(members))

    def init(self, params, config, setup, batch, max_len, dtype):
        return (jnp.zeros((), jnp.int32), tuple(self.lookup(m.name).init(params, config, m.setup(setup.k), batch,
                                                                            max_len, dtype) for m in setup.settings))

    def begin(self, params, config, setup, batch, max_len, dtype, knobs):
        _, states = self.init(params, config, setup, batch, max_len, dtype)
        return (jnp.asarray(knobs.drafter_index, jnp.int32), states)

    def observe(self, params, config, setup, state, aux, tokens, start, n_valid):
        index, states = state

        def branch(i: int, m: Member):
            def run(states):
                new = self.lookup(m.name).observe(params, config, m.setup(setup.k), states[i],
                                                  _member_aux(aux, setup.taps, m), tokens, start, n_valid)
                return states[:i] + (new,) + states[i + 1:]
            return run

        return index, jax.lax.switch(index, [branch(i, m) for i, m in enumerate(setup.settings)], states)

    def propose(self, params, config, setup, state, pos, last, key, knobs, greedy):
        index, states = state

        def branch(i: int, m: Member):
            return lambda: self.lookup(m.name).propose(params, config, m.setup(setup.k), states[i], pos, last, key,
                                                       knobs, greedy)

        return jax.lax.switch(index, [branch(i, m) for i, m in enumerate(setup.settings)])

    def propose_scored(self, params, config, setup, state, pos, last, key, knobs, greedy):
        """Members' `propose_scored`; a member without confidences reports −1 (not recorded), and the pool
        None when no member has any."""
        if not any(self.lookup(m.name).scored for m in setup.settings):
            return self.propose(params, config, setup, state, pos, last, key, knobs, greedy) + (None,)
        index, states = state

        def branch(i: int, m: Member):
            def run():
                d, q, n, conf = self.lookup(m.name).propose_scored(params, config, m.setup(setup.k), states[i], pos,
                                                                   last, key, knobs, greedy)
                return d, q, n, jnp.full(d.shape, -1.0, jnp.float32) if conf is None else conf
            return run

        return jax.lax.switch(index, [branch(i, m) for i, m in enumerate(setup.settings)])
