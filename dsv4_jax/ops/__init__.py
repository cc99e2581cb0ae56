"""Pure math shared by the model and the kernels (DESIGN property 8): a leaf layer.

Modules here import only jax, numpy and ml_dtypes (never `ModelConfig`, the model or the kernels) and take
plain arrays and scalars, so the model (`dsv4_jax.model`) and every kernel family (`dsv4_jax.kernels`)
compute the same formulas from one source:

- `moe`       routing from router logits (sqrt-softplus, bias top-k / hash ids, normalised weights), SwiGLU
              with clamps, the gather (few tokens) and sorted / grouped (many tokens) expert paths
- `indexer`   lightning-indexer scores, validity, exact top-k selection (lower index first on ties)
- `quant`     on-device dequantization of the stored weight formats
- `sampling`  temperature / top-p distributions, greedy and lossless rejection-sampling verification
"""
