"""Pure math shared by the model and the kernels (docs/design.md property 8): a leaf layer.

Modules here import only jax, numpy and ml_dtypes (never `ModelConfig`, the model or the kernels) and take
plain arrays and scalars, so the model (`dsv4_jax.model`) and every kernel family (`dsv4_jax.kernels`)
compute the same formulas from one source:

- `moe`       routing from router logits (sqrt-softplus, bias top-k / hash ids, normalised weights), SwiGLU
              with clamps, the gather (few tokens) and sorted / grouped (many tokens) expert paths
- `indexer`   lightning-indexer scores, validity, exact top-k selection (lower index first on ties)
- `quant`     the quantized weight leaf type `QArray` (codes + scales, static `QFormat`), its formats (FP8 e4m3
              128×128, FP4 e2m1 packed, Q8_0, int8 per channel), exact dequantization, quantization
- `linear`    the weight entry y = x Wᵀ (grouped, embedding gather) for dense or QArray weights
- `sampling`  temperature / top-p distributions, greedy and lossless rejection-sampling verification
- `host`      `to_host`: results as numpy, gathered across hosts when split (every CLI and `generate` use it)
"""
