"""Which implementation runs each hot op: a static, hashable choice carried by the config (DESIGN property 8).

`Backends` is a field of `ModelConfig` (`config.backends`), so it is part of every jit cache key: two runs
with different kernels compile two programs, side by side in one process. Ops and their implementations:

    moe       routed-expert matmuls: "reference" (gather / sorted `ragged_dot`, `ops.moe`), "pallas" (the GPU
              Triton kernels `kernels.moe_decode` / `kernels.moe_prefill`), "pallas_tpu" (the Mosaic TPU
              kernels `kernels.tpu_moe`)
    routing   sqrt-softplus + top-k routing: "reference" (`ops.moe`), "pallas" (`kernels.routing`)
    indexer   lightning-indexer scores: "reference" (`ops.indexer`), "pallas" (`kernels.lightning_indexer`),
              "pallas_tpu" (`kernels.tpu_indexer`); the exact top-k selection is `ops.indexer.topk` on all

`interpret` runs the Pallas kernels in interpret mode (CPU tests; TPU interpret mode for "pallas_tpu"). "auto"
is not an implementation: it is resolved per platform by `resolve` at the API boundary (`forward`,
`generate`, the decode entry points, the CLIs), never inside traced code: "pallas" on GPU, "pallas_tpu" on
TPU (ops without a TPU kernel, routing, keep the reference), the references elsewhere.
`unroll_layers` unrolls the scans over repeated layers (`model.target.run_segments`): the same program with every
layer written out, for XLA's cost analysis, which counts a `while` body once (ahead-of-time traffic reports);
slower to compile, same numbers.
"""
from __future__ import annotations

import dataclasses

import jax

OPS = ("moe", "routing", "indexer")
IMPLS: dict[str, tuple[str, ...]] = {
    "moe": ("reference", "pallas", "pallas_tpu"),
    "routing": ("reference", "pallas"),
    "indexer": ("reference", "pallas", "pallas_tpu"),
}
CHOICES = ("auto", "reference", "pallas", "pallas_tpu")   # what `--kernels` and `named` accept
# what "auto" means per platform (jax.default_backend() names); an op without that implementation keeps
# the reference
AUTO = {"gpu": "pallas", "cuda": "pallas", "rocm": "pallas", "tpu": "pallas_tpu"}
# the platforms whose compiler each kernel family targets; elsewhere it runs in interpret mode
KERNEL_PLATFORMS = {"pallas": ("gpu", "cuda", "rocm"), "pallas_tpu": ("tpu",)}


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


def _available(op: str, impl: str) -> str:
    """impl if op has it ("auto" included), else the reference."""
    return impl if impl == "auto" or impl in IMPLS[op] else "reference"


def named(choice: str | Backends | None) -> Backends:
    """A Backends from a CLI-style name ("auto", "reference", "pallas", "pallas_tpu") applied to every op
    that has it (the others keep the reference), or itself."""
    if choice is None:
        return REFERENCE
    if isinstance(choice, Backends):
        return choice
    if choice not in CHOICES:
        raise BackendError(f"unknown kernels choice {choice!r}; choose from {CHOICES}")
    return Backends(**{op: _available(op, choice) for op in OPS})


def resolve(backends: str | Backends | None, platform: str | None = None) -> Backends:
    """Concrete implementations for `platform` (default: jax.default_backend()), "auto" replaced.

    Pallas kernels off their platform need interpret mode: it is switched on here when a "pallas" or
    "pallas_tpu" op would run on a platform without the kernel's compiler (CPU, or the other accelerator).
    Called at the API boundary, outside traced code.
    """
    b = named(backends)
    platform = platform or jax.default_backend()
    auto = AUTO.get(platform, "reference")
    b = dataclasses.replace(b, **{op: _available(op, auto) for op in OPS if getattr(b, op) == "auto"})
    if any(platform not in KERNEL_PLATFORMS.get(getattr(b, op), (platform,)) for op in OPS):
        b = dataclasses.replace(b, interpret=True)
    return b


def require(impl: str, op: str) -> str:
    """Inside traced code: the implementation must be concrete (resolved at the API boundary)."""
    if impl == "auto":
        raise BackendError(f"{op} backend 'auto' reached traced code; resolve it first (dsv4_jax.backends.resolve "
                           f"or the public entry points do)")
    return impl
