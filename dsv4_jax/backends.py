"""Which implementation runs each hot op: a static, hashable choice carried by the config (docs/design.md property 8).

`Backends` is a field of `ModelConfig` (`config.backends`), so it is part of every jit cache key: two runs
with different kernels compile two programs, side by side in one process. Ops and their implementations:

    moe       routed-expert matmuls: "reference" (gather / sorted `ragged_dot`, `ops.moe`), "pallas" (the GPU
              Triton kernels `kernels.moe_decode` / `kernels.moe_prefill`), "pallas_tpu" (the Mosaic TPU
              kernels `kernels.tpu_moe`), "ep" (explicit expert parallelism under `shard_map`, `model.layers.moe_ep`;
              needs `ep`, an `ExpertParallel`: the mesh, the rules and the local grouped-matmul implementation)
    routing   sqrt-softplus + top-k routing: "reference" (`ops.moe`), "pallas" (`kernels.routing`)
    indexer   lightning-indexer scores: "reference" (`ops.indexer`), "pallas" (`kernels.lightning_indexer`),
              "pallas_tpu" (`kernels.tpu_indexer`); the exact top-k selection is `ops.indexer.topk` on all

`interpret` runs the Pallas kernels in interpret mode (CPU tests; TPU interpret mode for "pallas_tpu"). "auto"
is not an implementation: it is resolved per platform by `resolve` at the API boundary (`forward`,
`generate`, the decode entry points, the CLIs), never inside traced code: "pallas" on GPU, "pallas_tpu" on
TPU (ops without a TPU kernel, routing, keep the reference), the references elsewhere.
`unroll_layers` unrolls the scans over repeated layers (`model.target.run_segments`) and the MTP draft chain
(`drafters.mtp.propose`): the same program with every layer application written out, for XLA's cost analysis,
which counts a `while` body once (ahead-of-time traffic reports); slower to compile, same numbers.
"""
from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh

OPS = ("moe", "routing", "indexer")
IMPLS: dict[str, tuple[str, ...]] = {
    "moe": ("reference", "pallas", "pallas_tpu", "ep"),
    "routing": ("reference", "pallas"),
    "indexer": ("reference", "pallas", "pallas_tpu"),
}
CHOICES = ("auto", "reference", "pallas", "pallas_tpu")   # what `--kernels` and `named` accept
# what "auto" means per platform (jax.default_backend() names); an op without that implementation keeps
# the reference
AUTO = {"gpu": "pallas", "cuda": "pallas", "rocm": "pallas", "tpu": "pallas_tpu"}
# the platforms whose compiler each kernel family targets; elsewhere it runs in interpret mode
KERNEL_PLATFORMS = {"pallas": ("gpu", "cuda", "rocm"), "pallas_tpu": ("tpu",)}

# local grouped matmul of the expert-parallel MoE (ExpertParallel.local), per device on its own experts:
#   reference   few assignments: per-assignment expert slices; many: sorted `ragged_dot` over the local groups
#               (QArray experts: expert-pure row tiles, one expert dequantized at a time)
#   dense       few: the same slices; many: every local expert once over all tokens (XLA:TPU expands
#               `ragged_dot` densely anyway, after a relayout copy of the weights; this skips the copy)
#   pallas      the GPU kernels `kernels.moe_decode` / `kernels.moe_prefill` on the local experts
#   pallas_tpu  the Mosaic kernels `kernels.tpu_moe.routed` on the local experts (formats it does not take,
#               Q8_0: the reference)
EP_LOCAL = ("reference", "dense", "pallas", "pallas_tpu")
EP_LOCAL_AUTO = {"gpu": "pallas", "cuda": "pallas", "rocm": "pallas", "tpu": "dense"}
# per chip (`Device.device_kind` of the EP mesh's devices) where the platform's choice reads more: on TPU v5p XLA
# does not keep the FP4 word decode of "dense" fused into the dot (the decoded scale planes go through HBM), the
# Mosaic kernels read the uint8 codes once (experiments/results/aot_layout_2026-12-07.md, docs/aot.md)
EP_LOCAL_AUTO_BY_KIND = {"TPU v5": "pallas_tpu"}


class BackendError(ValueError):
    """An unknown op or implementation name."""


GPU_PLATFORMS = ("gpu", "cuda", "rocm")


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """Static set-up of the expert-parallel MoE (`Backends(moe="ep", ep=...)`, see `model.layers.moe_ep`).

    mesh: the device mesh the parameters and the decode state are placed on (hashable);
    rules: the logical-axis rules of that placement as ((logical axis, (mesh axes...)), ...) — None for
    `parallel.DEFAULT_RULES`; the shard_map in/out specs are derived from them, so they must be the
    rules the parameters were placed with; local: the per-device grouped matmul (EP_LOCAL or "auto").
    """

    mesh: Mesh
    rules: tuple[tuple[str, tuple[str, ...]], ...] | None = None
    local: str = "reference"

    def __post_init__(self):
        if not isinstance(self.mesh, Mesh):
            raise BackendError(f"ExpertParallel.mesh must be a jax.sharding.Mesh, got {type(self.mesh).__name__}")
        if self.local != "auto" and self.local not in EP_LOCAL:
            raise BackendError(f"unknown expert-parallel local implementation {self.local!r}; choose from "
                               f"{('auto',) + EP_LOCAL}")

    @staticmethod
    def freeze_rules(rules) -> tuple[tuple[str, tuple[str, ...]], ...] | None:
        """A rules mapping {logical axis: mesh axes} as the hashable tuple form (None stays None)."""
        return None if rules is None else tuple(sorted((str(k), tuple(v)) for k, v in dict(rules).items()))

    @property
    def rules_dict(self) -> dict[str, tuple[str, ...]] | None:
        return None if self.rules is None else dict(self.rules)

    def describe(self) -> str:
        shape = "x".join(str(n) for n in self.mesh.devices.shape)
        return f"ep(mesh {shape} {'/'.join(self.mesh.axis_names)}, local={self.local})"


@dataclasses.dataclass(frozen=True)
class Backends:
    """Implementation per hot op (see the module docstring); hashable, a static part of the config."""

    moe: str = "reference"
    routing: str = "reference"
    indexer: str = "reference"
    interpret: bool = False
    unroll_layers: bool = False
    ep: ExpertParallel | None = None
    # the mHC Sinkhorn iterations unrolled (set by `resolve` on GPUs: rolled, each of its ~20 iterations per
    # hyper-connection is a while-loop trip of tiny kernels there; unrolled, XLA:CPU compiles ~7x slower)
    unroll_sinkhorn: bool = False

    def __post_init__(self):
        for op in OPS:
            impl = getattr(self, op)
            if impl != "auto" and impl not in IMPLS[op]:
                raise BackendError(f"unknown {op} implementation {impl!r}; choose from {('auto',) + IMPLS[op]}")
        if self.moe == "ep" and self.ep is None:
            raise BackendError('moe="ep" needs ep=ExpertParallel(mesh, ...) (or a sharding preset: '
                               'dsv4_jax.parallel.preset(name).backends(mesh))')
        if self.ep is not None and not isinstance(self.ep, ExpertParallel):
            raise BackendError(f"Backends.ep must be an ExpertParallel, got {type(self.ep).__name__}")

    @property
    def resolved(self) -> bool:
        return all(getattr(self, op) != "auto" for op in OPS) and (self.ep is None or self.ep.local != "auto")

    def replace(self, **changes) -> "Backends":
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        parts = [f"{op}={getattr(self, op)}" for op in OPS]
        if self.moe == "ep":
            parts[0] = f"moe={self.ep.describe()}"
        flags = [f for f in ("interpret", "unroll_layers", "unroll_sinkhorn") if getattr(self, f)]
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
    "pallas_tpu" op (or expert-parallel local matmul) would run on a platform without the kernel's compiler
    (CPU, or the other accelerator).
    Called at the API boundary, outside traced code.
    """
    b = named(backends)
    platform = platform or jax.default_backend()
    auto = AUTO.get(platform, "reference")
    b = dataclasses.replace(b, **{op: _available(op, auto) for op in OPS if getattr(b, op) == "auto"})
    if b.ep is not None and b.ep.local == "auto":
        b = dataclasses.replace(b, ep=dataclasses.replace(b.ep, local=ep_local_auto(platform, b.ep.mesh)))
    impls = [getattr(b, op) for op in OPS] + ([b.ep.local] if b.moe == "ep" else [])
    if any(platform not in KERNEL_PLATFORMS.get(impl, (platform,)) for impl in impls):
        b = dataclasses.replace(b, interpret=True)
    if platform in GPU_PLATFORMS:
        b = dataclasses.replace(b, unroll_sinkhorn=True)
    return b


def ep_local_auto(platform: str, mesh: Mesh) -> str:
    """What "auto" means for the EP local matmul on the mesh's devices: `EP_LOCAL_AUTO_BY_KIND` of their chip,
    else `EP_LOCAL_AUTO` of the platform (the reference elsewhere)."""
    kind = getattr(mesh.devices.flat[0], "device_kind", None) if platform == "tpu" else None
    return EP_LOCAL_AUTO_BY_KIND.get(kind) or EP_LOCAL_AUTO.get(platform, "reference")


def require(impl: str, op: str) -> str:
    """Inside traced code: the implementation must be concrete (resolved at the API boundary)."""
    if impl == "auto":
        raise BackendError(f"{op} backend 'auto' reached traced code; resolve it first (dsv4_jax.backends.resolve "
                           f"or the public entry points do)")
    return impl
