"""The DeepSeek-V4 target model: `target` (forward), `decode` (prefill / decode / verify / commit),
`state` (the position-indexed decode state), `params` (parameter specs), `layers/` (one block's math)."""
