"""Lightning indexer of CSA layers (docs/model_math.md §2.7); the math is `dsv4_jax.ops.indexer`.

Scores of the compressed rows come from the config's indexer backend ("reference": `ops.indexer.scores`,
"pallas": `kernels.lightning_indexer.scores`, "pallas_tpu": `kernels.tpu_indexer.scores`, the validity mask
fused in both kernels); the top-k selection is the exact `ops.indexer.topk` on all (lower row index first
on ties).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ...backends import require
from ...config import ModelConfig
from ...kernels import lightning_indexer, tpu_indexer
from ...ops import indexer as ops
from ...ops.linear import linear
from .rope import apply_rope


def index_queries(qr: jax.Array, p: dict, config: ModelConfig, positions: jax.Array, freqs: np.ndarray):
    """q^I = RoPE_compress((W_qb^I c_q).view(nI, dI)); no norm. qr [B,S,q_lora] -> [B,S,nI,dI]."""
    B, S, _ = qr.shape
    q = linear(qr, p["wq_b"]).reshape(B, S, config.index_n_heads, config.index_head_dim)
    return apply_rope(q, positions, freqs)


def masked_scores(q: jax.Array, keys: jax.Array, h: jax.Array, p: dict, config: ModelConfig, positions: jax.Array,
                  ratio: int, n_rows: jax.Array | None = None) -> jax.Array:
    """Index scores f32 [B,S,T], −inf where row w is not visible (w ≥ ⌊(p+1)/m⌋ or w ≥ n_rows[b]).

    q [B,S,nI,dI], keys [B,T,dI], h [B,S,D] (the normed layer input), positions int [B,S].
    """
    om = ops.omega(h, p["weights_proj"], config.index_n_heads)
    impl = require(config.backends.indexer, "indexer")
    if impl in ("pallas", "pallas_tpu"):
        kernel = tpu_indexer.scores if impl == "pallas_tpu" else lightning_indexer.scores
        return kernel(q, keys, om, positions, n_rows, ratio=ratio, interpret=config.backends.interpret)
    sc = ops.scores(q, keys, om)
    return jnp.where(ops.validity(sc.shape, positions, n_rows, ratio), sc, -jnp.inf)


def select(q, keys, h, p: dict, config: ModelConfig, positions, ratio: int, n_rows=None):
    """The top-k visible rows per query: (row ids int32 [B,S,k'], found bool [B,S,k']), k' = min(topk, T)."""
    return ops.topk(masked_scores(q, keys, h, p, config, positions, ratio, n_rows), config.index_topk)


def select_mask(q, keys, h, p: dict, config: ModelConfig, positions, ratio: int, n_rows=None) -> jax.Array:
    """The same selection as a boolean mask [B,S,T]."""
    return ops.topk_mask(masked_scores(q, keys, h, p, config, positions, ratio, n_rows), config.index_topk)
