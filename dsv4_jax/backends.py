"""Which implementation runs each hot op: a static, hashable choice carried by the config (DESIGN property 8).

`Backends` is a field of `ModelConfig` (`config.backends`), so it is part of every jit cache key: two runs
with different kernels compile two programs, side by side in one process. Ops and their implementations:

    moe       routed-expert matmuls: "reference" (gather / sorted `ragged_dot`, `ops.moe`), "pallas" (the GPU
              Triton kernels `kernels.moe_decode` / `kernels.moe_prefill`)
    routing   sqrt-softplus + top-k routing: "reference" (`ops.moe`), "pallas" (`kernels.routing`)
    indexer   lightning-indexer scores: "reference" (`ops.indexer`), "pallas" (`kernels.lightning_indexer`);
              the exact top-k selection is `ops.indexer.topk` on both

`interpret` runs the Pallas kernels in interpret mode (CPU tests). `unroll_layers` unrolls the scans over repeated
layers (`model.target.run_segments`): the same program with every layer written out, for XLA's cost analysis,
which counts a `while` body once (ahead-of-time traffic reports); slower to compile, same numbers. "auto" is not an implementation: it is
resolved per platform by `resolve` at the API boundary (`forward`, `generate`, the decode entry points, the
CLIs), never inside traced code: Pallas on GPU, the references elsewhere.
"""
from __future__ import annotations

import dataclasses

import jax

OPS = ("moe", "routing", "indexer")
IMPLS: dict[str, tuple[str, ...]] = {
    "moe": ("reference", "pallas"),
    "routing": ("reference", "pallas"),
    "indexer": ("reference", "pallas"),
}
CHOICES = ("auto", "reference", "pallas")   # what `--kernels` and `named` accept
# what "auto" means per platform (jax.default_backend() names)
AUTO = {"gpu": "pallas", "cuda": "pallas", "rocm": "pallas"}


class BackendError(ValueError):
    """An unknown op or implementation name."""


@dataclasses.dataclass(frozen=True)
class Backends:
    """Implementation per hot op (see the module docstring); hashable, a static part of the config."""

    moe: str = "reference"
    routing: str = "reference"
    indexer: str = "reference"
    interpret: bool = False
    unroll_layers: bool = False

    def __post_init__(self):
        for op in OPS:
            impl = getattr(self, op)
            if impl != "auto" and impl not in IMPLS[op]:
                raise BackendError(f"unknown {op} implementation {impl!r}; choose from {('auto',) + IMPLS[op]}")

    @property
    def resolved(self) -> bool:
        return all(getattr(self, op) != "auto" for op in OPS)

    def replace(self, **changes) -> "Backends":
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        parts = [f"{op}={getattr(self, op)}" for op in OPS]
        flags = [f for f in ("interpret", "unroll_layers") if getattr(self, f)]
        return ", ".join(parts + flags)


REFERENCE = Backends()


def named(choice: str | Backends | None) -> Backends:
    """A Backends from a CLI-style name ("auto", "reference", "pallas") applied to every op, or itself."""
    if choice is None:
        return REFERENCE
    if isinstance(choice, Backends):
        return choice
    if choice not in CHOICES:
        raise BackendError(f"unknown kernels choice {choice!r}; choose from {CHOICES}")
    return Backends(**{op: choice for op in OPS})


def resolve(backends: str | Backends | None, platform: str | None = None) -> Backends:
    """Concrete implementations for `platform` (default: jax.default_backend()), "auto" replaced.

    Pallas kernels off GPU/TPU need interpret mode: it is switched on here when a "pallas" op would run on
    a platform without the kernel's compiler (CPU). Called at the API boundary, outside traced code.
    """
    b = named(backends)
    platform = platform or jax.default_backend()
    b = dataclasses.replace(b, **{op: AUTO.get(platform, "reference") for op in OPS if getattr(b, op) == "auto"})
    if platform not in AUTO and any(getattr(b, op) == "pallas" for op in OPS):
        b = dataclasses.replace(b, interpret=True)
    return b


def require(impl: str, op: str) -> str:
    """Inside traced code: the implementation must be concrete (resolved at the API boundary)."""
    if impl == "auto":
        raise BackendError(f"{op} backend 'auto' reached traced code; resolve it first (dsv4_jax.backends.resolve "
                           f"or the public entry points do)")
    return impl
