"""Routed FP4 experts in the uint32 word layout, per shard (`ops.quant.words_format`; docs/quantized_weights.md).

The release checkpoint stores the routed experts as FP4 codes, two per byte. XLA:TPU re-tiles such a uint8 stack in
every step it slices one expert from; the same values as uint32 words (eight codes per word, laid out within
column groups) are sliced and decoded inside the matmul fusion (experiments/results/aot_release_ep_2026-12-04.md).
`routed_experts_as_words` converts a loaded, placed parameter tree once: each routed-expert FP4 leaf whose
contraction dim fits whole groups per shard becomes a word-layout QArray with the same logical shape and the same
partition of its dims. `load_checkpoint(..., sharding=..., keep_quantized=True)` calls it when the expert-parallel
local matmul is an XLA one that reads words (`WORDS_LOCAL`; the Pallas kernels read the uint8 codes).
"""
from __future__ import annotations

import functools
import re

import jax

from ..backends import Backends
from ..ops import quant

ROUTED_EXPERTS = re.compile(r"(^|\.)ffn\.experts\.w[123]$")   # flat leaf paths of routed-expert stacks [E, N, K]
WORDS_LOCAL = ("dense",)     # EP local matmuls for which the loader converts (XLA:TPU's default, backends.EP_LOCAL_AUTO)


def wants_words(backends: Backends | None) -> bool:
    """Whether a run under these (resolved) backends reads routed FP4 experts as words: the expert-parallel MoE
    with an XLA local matmul in `WORDS_LOCAL`."""
    return backends is not None and backends.moe == "ep" and backends.ep is not None \
        and backends.ep.local in WORDS_LOCAL


def shard_group(q: quant.QArray) -> int:
    """The word layout's column group for q (concrete or abstract): the width of one shard of its contraction
    dim (0: K not split)."""
    k = q.shape[-1]
    sharding = getattr(q.codes, "sharding", None)
    k_local = sharding.shard_shape(q.codes.shape)[-1] * 2 if sharding is not None else k
    return 0 if k_local == k else k_local


def routed_experts_as_words(params):
    """params with every routed-expert FP4 QArray (path `...ffn.experts.w1|w2|w3`, drafters' included) that fits
    whole 256-column groups per shard (`quant.words_fit(q, shard_group(q))`) in the word layout, placed with its
    codes' and scales' partition specs on the same mesh; every other leaf unchanged. Exact: the same values."""
    def one(path, x):
        flat = ".".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)
        if not (isinstance(x, quant.QArray) and ROUTED_EXPERTS.search(flat)):
            return x
        group = shard_group(x)
        return _convert(x, group) if quant.words_fit(x, group) else x
    return jax.tree_util.tree_map_with_path(one, params, is_leaf=quant.is_qarray)


def _convert(q: quant.QArray, group: int) -> quant.QArray:
    """`quant.to_words(q, group)` on q's devices, codes and scales partitioned as q's."""
    out = quant.QArray(q.codes.sharding, q.scale.sharding, quant.words_format(group), q.dtype)
    return jax.jit(functools.partial(quant.to_words, group=group), out_shardings=out)(q)
