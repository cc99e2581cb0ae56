"""Pallas kernels for the two decode hot spots, each next to a plain-jnp reference.

Modules (one kernel family each):
- `routing`        sqrt-softplus scores, bias top-k / hash routing, normalised weights (== model.moe.route)
- `moe_decode`     few tokens: read only the active experts' weights; SwiGLU + clamps + weighted combine fused
- `moe_prefill`    many tokens: align assignments into expert-pure row tiles, grouped matmul, combine
- `lightning_indexer`  Σ_h ω_h·ReLU(q_h·K_w)·dI^-0.5 with validity masking, then exact two-stage top-k

Every public entry point takes `impl="auto" | "pallas" | "reference"` (see `dispatch.resolve`). The
Pallas kernels are written for the GPU Triton lowering (`pallas_call` + `triton.CompilerParams`); on CPU
they run in interpret mode, which is what the tests use.
"""
from . import quant  # noqa: F401
from .dispatch import default_impl, resolve, use_interpret  # noqa: F401
