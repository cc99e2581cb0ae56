"""Drafters by name: what `generate(..., drafter=NAME)`, the speculative loop and the CLIs look up.

Adding a drafter is registering one `drafters.base.Drafter` object (`register(MyDrafter())`); the loop,
`generate` (which routes keywords it does not know to the drafter's `Options`) and the research CLIs then
accept its name (docs/drafters.md).
"""
from __future__ import annotations

from . import dspark, mtp, ngram, oracle, pool
from .base import Drafter

BUILT_IN = (Drafter(), mtp.DRAFTER, dspark.DRAFTER, ngram.DRAFTER, oracle.DRAFTER)   # none, mtp, dspark, ngram, oracle
_REGISTRY: dict[str, Drafter] = {d.name: d for d in BUILT_IN}


def register(drafter: Drafter) -> Drafter:
    """Make `drafter` available under `drafter.name` (replacing one of the same name)."""
    if not isinstance(drafter, Drafter) or not drafter.name:
        raise ValueError(f"a drafter must be a named drafters.base.Drafter, got {drafter!r}")
    _REGISTRY[drafter.name] = drafter
    return drafter


def unregister(name: str) -> None:
    """Remove a drafter added with `register` (the built-in ones stay)."""
    if name in {d.name for d in BUILT_IN} | {pool.NAME}:
        raise ValueError(f"drafter {name!r} is built in")
    _REGISTRY.pop(name, None)


def get(name: str | None) -> Drafter:
    """The drafter registered as `name` (None: "none"); ValueError naming the known drafters otherwise."""
    name = "none" if name is None else name
    if name not in _REGISTRY:
        raise ValueError(f"drafter must be one of {names()}, got {name!r}")
    return _REGISTRY[name]


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


register(pool.PoolDrafter(get))   # "pool": several drafters in one program (pool.PoolOptions)
