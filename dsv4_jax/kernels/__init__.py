"""Pallas kernels for the two decode hot spots; their math and references are `dsv4_jax.ops`.

Modules (one kernel family each; plain arrays in, never `ModelConfig`):
- `routing`            sqrt-softplus scores, bias top-k / hash routing, normalised weights (== ops.moe.route_from_logits)
- `moe_decode`         few tokens: read only the active experts' weights; SwiGLU + clamps + weighted combine fused
- `moe_prefill`        many tokens: align assignments into expert-pure row tiles, grouped matmul, combine
- `lightning_indexer`  Σ_h ω_h·ReLU(q_h·K_w)·dI^-0.5 with validity masking (the top-k is ops.indexer.topk)

The kernels are written for the GPU Triton lowering (`pallas_call` + `triton.CompilerParams`); on CPU they
run with `interpret=True`, which is what the tests use. The model selects them through the static
`config.backends` (dsv4_jax.backends).
"""
