"""Helpers shared by the Pallas GPU kernels: Triton compiler parameters and tile sizes.

Which kernel runs is not decided here: the model reads the static `config.backends` (dsv4_jax.backends)
and calls the kernel functions with plain arrays and an explicit `interpret` flag.
"""
from __future__ import annotations


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
