"""Pallas kernels for the decode hot spots; their math and references are `dsv4_jax.ops`.

Plain arrays and static scalars in, never `ModelConfig`; the model selects a family through the static
`config.backends` (dsv4_jax.backends: "pallas" = GPU, "pallas_tpu" = TPU) and passes `interpret` explicitly.

GPU (Triton lowering: `pallas_call` + `triton.CompilerParams`; `common`):
- `routing`            sqrt-softplus scores, bias top-k / hash routing, normalised weights (== ops.moe.route_from_logits)
- `moe_decode`         few tokens: read only the active experts' weights; SwiGLU + clamps + weighted combine fused
- `moe_prefill`        many tokens: align assignments into expert-pure row tiles, grouped matmul, combine
- `lightning_indexer`  Σ_h ω_h·ReLU(q_h·K_w)·dI^-0.5 with validity masking (the top-k is ops.indexer.topk)

TPU (Mosaic: `PrefetchScalarGridSpec`, BlockSpecs obeying the (8, 128) tiling; `tpu_common`):
- `tpu_moe`            experts_decode (fused gate/up/SwiGLU/down over the active experts, ids scalar-prefetched),
                       experts_prefill (dropless grouped matmul); weights bf16 / int8 / fp8 / FP8-e4m3-b128 /
                       FP4-e2m1-b32 dequantized per tile (`tpu_common.FORMATS`)
- `tpu_indexer`        the same scores as `lightning_indexer`, key tiles past the visible rows neither read nor
                       computed (the top-k is ops.indexer.topk)

Their ahead-of-time compile for a TPU topology with libtpu (no TPU), memory / cost analysis and the bytes the
BlockSpecs move, next to the XLA reference, is `dsv4_jax.analysis.kernels_aot`.

On CPU every kernel runs in interpret mode (TPU interpret mode for the Mosaic kernels), which the tests use.
"""
