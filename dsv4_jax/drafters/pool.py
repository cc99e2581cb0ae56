"""A pool of drafters compiled into one program, the member chosen at run time (research sweeps).

`generate(..., drafter="pool", options=PoolOptions(members=("mtp", "dspark"), active="mtp"))` (or the
shorthand `RunShape(drafter_pool=("mtp", "dspark"))` with drafter="mtp": `wrap`): the loop program of a
draft width holds every member (`lax.switch` on the dynamic member index in the pool's knobs), so
a sweep over drafters compiles one loop per width instead of one per (drafter, width), and the prefill
computes the union of the members' tap layers, so every run of the sweep shares it. Only the chosen
member's branch executes: the drafts, hence the tokens, are the member's own. The cost of sharing is
the tap means of the other members' layers in each verify block ([B, k+1, D] means; DSpark's three
layers) and carrying the idle members' (small) states.

Options: the members, the active one and each member's own options (static parts configure the member,
dynamic parts ride in the pool's knobs: (index, the members' knobs)). State: (the member index, a tuple
of the members' states in member order); `begin` takes the index from the run's knobs.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .base import Bound, DraftSetup, Drafter

NAME = "pool"


@dataclasses.dataclass(frozen=True)
class PoolOptions:
    """members: registered names; active: the member that drafts (dynamic: no recompilation);
    member_options: each member's options in member order (None or missing: its defaults)."""

    members: tuple[str, ...] = ()
    active: str | None = None
    member_options: tuple = ()


@dataclasses.dataclass(frozen=True)
class Member:
    """One drafter of a pool: its registered name, the Drafter object itself (the traced methods call it:
    no registry lookup under jit) and its static setup less k (k is the pool's)."""

    name: str
    taps: tuple[int, ...]
    settings: object = None
    drafter: Drafter | None = dataclasses.field(default=None, repr=False)   # named by `name`: keys stay stable

    def setup(self, k: int) -> DraftSetup:
        return DraftSetup(k=k, taps=self.taps, settings=self.settings)


def member_names(setup: DraftSetup) -> tuple[str, ...]:
    return tuple(m.name for m in setup.settings)


def _member_aux(aux: dict, pool_taps: tuple[int, ...], member: Member) -> dict:
    """The member's view of a step's aux: its own tap layers, in its order."""
    return {"hidden": aux["hidden"], "taps": aux["taps"][:, :, [pool_taps.index(t) for t in member.taps]]}


class PoolDrafter(Drafter):
    """Members behind one drafter; the member index in its knobs (dynamic) picks the one that drafts. State:
    (index int32 [], tuple of the members' states). lookup: name -> Drafter (`registry.get`), host side only
    (`configure`, the options): the traced methods call each `Member.drafter`."""

    name = NAME
    Options = PoolOptions

    def __init__(self, lookup):
        self.lookup = lookup

    def check_options(self, options: PoolOptions) -> None:
        names = tuple(dict.fromkeys(options.members))
        if not names:
            raise ValueError("the drafter pool needs members: PoolOptions(members=(names...), active=name) "
                             "or RunShape(drafter_pool=(names...))")
        for name in names:
            if self.lookup(name).name in ("none", NAME):
                raise ValueError(f"drafter_pool takes drafters that draft, not {name!r}")
        if options.active not in names:
            raise ValueError(f"drafter {options.active!r} is not in drafter_pool {names}")
        if len(options.member_options) > len(names):
            raise ValueError(f"{len(options.member_options)} member options for {len(names)} members")

    def _members(self, options: PoolOptions):
        """[(drafter, its options)] in member order."""
        names = tuple(dict.fromkeys(options.members))
        given = tuple(options.member_options) + (None,) * (len(names) - len(options.member_options))
        return [(self.lookup(n), self.lookup(n).options(o)) for n, o in zip(names, given)]

    def knobs(self, options: PoolOptions):
        names = tuple(dict.fromkeys(options.members))
        return (jnp.int32(names.index(options.active)), tuple(d.knobs(o) for d, o in self._members(options)))

    def configure(self, params, config, k, options=None, bundle=None) -> DraftSetup:
        """ValueError when a member caps k lower than another (one verify width per program)."""
        if options is None or not options.members:
            raise ValueError("the drafter pool is chosen with RunShape(drafter_pool=(names...)) or "
                             "options=PoolOptions(members=(names...), active=name)")
        members, ks = [], {}
        for drafter, opts in self._members(options):
            s = drafter.configure(params, config, k, opts, bundle)
            members.append(Member(drafter.name, tuple(s.taps), s.settings, drafter))
            ks[drafter.name] = s.k
        if len(set(ks.values())) > 1:
            raise ValueError(f"drafter_pool: the members propose different numbers of drafts at draft_n_max {k}: "
                             f"{ks}; pool drafters with the same cap")
        taps = tuple(sorted({t for m in members for t in m.taps}))
        return DraftSetup(k=next(iter(ks.values())), taps=taps, settings=tuple(members))

    def max_drafts(self, setup: DraftSetup) -> int | None:
        caps = [m.drafter.max_drafts(m.setup(setup.k)) for m in setup.settings]
        return min((c for c in caps if c is not None), default=None)

    def _run(self, run: Bound, m: Member) -> Bound:
        return Bound(run.params, run.config, m.setup(run.setup.k))

    def init(self, run, batch, max_len, dtype):
        return (jnp.zeros((), jnp.int32),
                tuple(m.drafter.init(self._run(run, m), batch, max_len, dtype) for m in run.setup.settings))

    def begin(self, run, batch, max_len, dtype, knobs):
        _, states = self.init(run, batch, max_len, dtype)
        return (jnp.asarray(knobs.drafter[0], jnp.int32), states)

    def observe(self, run, state, aux, tokens, start, n_valid):
        index, states = state

        def branch(i: int, m: Member):
            def go(states):
                new = m.drafter.observe(self._run(run, m), states[i], _member_aux(aux, run.setup.taps, m),
                                                  tokens, start, n_valid)
                return states[:i] + (new,) + states[i + 1:]
            return go

        return index, jax.lax.switch(index, [branch(i, m) for i, m in enumerate(run.setup.settings)], states)

    def propose(self, run, state, pos, last, key, knobs, greedy):
        index, states = state

        def branch(i: int, m: Member):
            mine = knobs.replace(drafter=knobs.drafter[1][i])
            return lambda: m.drafter.propose(self._run(run, m), states[i], pos, last, key, mine, greedy)

        return jax.lax.switch(index, [branch(i, m) for i, m in enumerate(run.setup.settings)])

    def propose_scored(self, run, state, pos, last, key, knobs, greedy):
        """Members' `propose_scored`; a member without confidences reports −1 (not recorded), and the pool
        None when no member has any."""
        if not any(m.drafter.scored for m in run.setup.settings):
            return self.propose(run, state, pos, last, key, knobs, greedy) + (None,)
        index, states = state

        def branch(i: int, m: Member):
            mine = knobs.replace(drafter=knobs.drafter[1][i])

            def go():
                d, q, n, conf = m.drafter.propose_scored(self._run(run, m), states[i], pos, last, key,
                                                                   mine, greedy)
                return d, q, n, jnp.full(d.shape, -1.0, jnp.float32) if conf is None else conf
            return go

        return jax.lax.switch(index, [branch(i, m) for i, m in enumerate(run.setup.settings)])


def wrap(name: str, options, members: tuple[str, ...]) -> PoolOptions:
    """`RunShape.drafter_pool`: the drafter `name` (with its options) as the active member of a pool of
    `members`, the other members at their default options."""
    names = tuple(dict.fromkeys(members))
    return PoolOptions(members=names, active=name, member_options=tuple(options if n == name else None
                                                                        for n in names))
