"""Kernel selection: `impl` is "auto" (Pallas on GPU, reference elsewhere), "pallas" or "reference".

`impl=None` in the model hooks means `default_impl()`: the environment variable DSV4_KERNELS
("reference" unless set). It is read at trace time, so set it before the first jit call.
"""
from __future__ import annotations

import os

import jax

IMPLS = ("auto", "pallas", "reference")


def default_impl() -> str:
    impl = os.environ.get("DSV4_KERNELS", "reference")
    if impl not in IMPLS:
        raise ValueError(f"DSV4_KERNELS must be one of {IMPLS}, got {impl!r}")
    return impl


def resolve(impl: str | None) -> str:
    """Map impl (None, "auto", "pallas", "reference") to "pallas" or "reference"."""
    impl = default_impl() if impl is None else impl
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        # The kernels use the Triton lowering (dynamic expert indexing inside the kernel); TPU would need
        # a PrefetchScalarGridSpec variant, so TPU and CPU take the references under "auto".
        return "pallas" if jax.default_backend() == "gpu" else "reference"
    return impl


def use_interpret(interpret: bool | None) -> bool:
    """Interpret mode unless on GPU (pallas_call only compiles for GPU/TPU)."""
    return jax.default_backend() != "gpu" if interpret is None else interpret


def compiler_params(num_warps: int = 4, num_stages: int = 2):
    """Triton compiler params: in jax 0.10 a bare pallas_call on GPU lowers to Mosaic GPU instead."""
    from jax.experimental.pallas import triton as pltr
    return pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def block(n: int, cap: int) -> int:
    """Largest power of two ≤ cap that divides n (1 if n is odd): tile sizes that need no masking."""
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b
