"""The bytes bound of each compiled program: what one call must read from memory, at the least.

Target steps (prefill chunk, decode, verify) use the project's bytes model (`bytes_bound`, docs/model_math.md §6):
every weight of the step once — routed experts only for the distinct experts the batch's tokens reach under
uniform routing, E·(1 − (1 − k/E)^T) per layer, embedding rows for the tokens, the head whole — plus each
sequence's cache rows (window, CSA indexer keys and selected rows, HCA rows). A speculative round adds the
drafter's passes, each reading the drafter weights it uses for that pass's tokens (same rules), the target's
head (and embedding rows) it shares, and its window rows:

    MTP     k − 1 chain passes of B tokens (the first draft comes from the last committed row's logits) and
            one observe pass of B·(k+1) tokens
    DSpark  one block pass of B·γ tokens through every stage (+ the Markov head: W2 whole, W1 rows) and one
            observe pass of B·(k+1) tokens through main_proj and each stage's `wkv`

"total" is the bound under uniform routing, "balanced" the same with min(E, T·k) active experts per layer
(balanced routing, `traffic.balanced_total`: the most a static dropless program can be asked to skip; equal
to "total" at one token; a round's drafter passes stay uniform). The bound is a whole-slice number; the
per-chip bound is its ideal split (bound / chips). Nothing here
allocates: sizes come from `params` specs. Bytes per element of each format are `dsv4_jax.analysis.traffic`'s, so the
report's bound, memplan's storage and the decode benchmark's bound are one model.
"""
from __future__ import annotations

import math
import re

from ...model import params as P
from .. import traffic
from ...config import ModelConfig

# the report's weight format names -> traffic's
MODEL_FORMAT = {"bf16": "bf16", "fp8": "fp8-experts", "release": "release"}
_EXPERT_LEAF = re.compile(r"(^|\.)ffn\.experts\.w[123]$")


def target_bound(config: ModelConfig, weights: str, batch: int, context: int, tokens: int) -> dict:
    """Bytes a target step over `tokens` tokens per sequence at `context` committed tokens must read."""
    b = traffic.bytes_bound(config, MODEL_FORMAT[weights], batch, context, tokens)
    return {"total": b["total"], "balanced": traffic.balanced_total(config, b, batch * tokens),
            "weights": b["weights"], "cache": b["cache"],
            "active_experts_per_layer": b["active_experts_per_layer"], "weight_parts": b["weight_parts"]}


def tree_read_bytes(specs, weights: str, n_tokens: int, top_k: int, keep=None) -> float:
    """Bytes a pass over n_tokens tokens reads of a ParamSpec tree (drafter weights): every leaf once,
    routed experts only for the active ones (top_k per token), Markov W1 rows for the tokens;
    keep(path) selects leaves."""
    fmt = MODEL_FORMAT[weights]
    total = 0.0
    for path, spec in P.flatten(specs).items():
        if keep is not None and not keep(path):
            continue
        b = math.prod(spec.shape) * traffic.element_bytes(path, spec, fmt)
        if _EXPERT_LEAF.search(path):
            E = spec.shape[-3]
            b *= traffic.expected_active_experts(E, top_k, n_tokens) / E
        elif path.endswith("markov_w1"):
            b *= min(n_tokens, spec.shape[0]) / spec.shape[0]
        total += b
    return total


def _shared_reads(config: ModelConfig, n_tokens: int, window_rows: int) -> float:
    """What a drafter pass reads besides its own weights: the target's head [V,D] (bf16 in every format),
    embedding rows for its tokens, and `window_rows` cache rows of head_dim (bf16)."""
    V, D, d = config.vocab_size, config.hidden_size, config.head_dim
    return 2 * V * D + 2 * min(n_tokens, V) * D + 2 * window_rows * d


def mtp_round_bound(config: ModelConfig, weights: str, batch: int, context: int, k: int) -> dict:
    """One MTP round: the verify step over k+1 tokens + k − 1 chain passes (B tokens) + one observe pass."""
    target = target_bound(config, weights, batch, context, k + 1)
    specs, top_k, W = P.mtp_specs(config), config.num_experts_per_tok, config.sliding_window
    chain = (k - 1) * (tree_read_bytes(specs, weights, batch, top_k) + _shared_reads(config, batch, batch * W))
    T = batch * (k + 1)
    observe = tree_read_bytes(specs, weights, T, top_k) + _shared_reads(config, T, batch * W)
    return _round(target, {"chain": chain, "observe": observe})


def dspark_round_bound(config: ModelConfig, weights: str, batch: int, context: int, k: int, block_size: int,
                       n_stages: int, n_taps: int, markov_rank: int) -> dict:
    """One DSpark round: the verify step over k+1 tokens + one block pass (B·γ tokens through every stage,
    hc_head, head, Markov head) + one observe pass (main_proj and each stage's wkv over B·(k+1) tokens)."""
    target = target_bound(config, weights, batch, context, k + 1)
    specs, top_k, W = P.dspark_specs(config, n_stages, n_taps, markov_rank, False), config.num_experts_per_tok, \
        config.sliding_window
    T = batch * block_size
    block = tree_read_bytes(specs, weights, T, top_k, keep=lambda p: not p.startswith("main_")) + \
        _shared_reads(config, T, batch * n_stages * W)
    observe = tree_read_bytes(specs, weights, batch * (k + 1), top_k,
                              keep=lambda p: p.startswith("main_") or bool(re.search(r"attn\.(wkv|kv_norm)$", p)))
    return _round(target, {"block": block, "observe": observe})


def _round(target: dict, passes: dict) -> dict:
    drafter = sum(passes.values())
    return {"total": target["total"] + drafter, "balanced": target["balanced"] + drafter,
            "target": target["total"], "drafter": drafter,
            "drafter_passes": passes, "weights": target["weights"], "cache": target["cache"],
            "active_experts_per_layer": target["active_experts_per_layer"]}
