"""Bytes a decode or verify step must read from memory (docs/model_math.md §6): the bound decode time is
compared with (time ≥ bytes read / read bandwidth). Sizes only, from the parameter specs and the
config; nothing is allocated. `memplan` answers the other question (what is held per device).

bound = weights + batch · cache, with (§6, "weight bytes read per decoded token" and "KV read per
decode step"):
  weights = Σ over parameter leaves of elements × bytes/element(format), except routed experts × a/E,
            a = E·(1 − (1 − k/E)^T) distinct experts for T = batch·tokens tokens under uniform routing
            (= k for one token), embedding and tid2eid × T rows / V; the head [V, D] is read whole;
            float32 / int32 leaves count 4 bytes. Formats: "bf16" 2 bytes; "fp8-experts" (what the MoE
            kernels read, `random_init` expert_format="fp8") 1 + 4/128² for routed experts (float32
            scale per 128×128 block; smaller dimensions use smaller blocks, whose extra scale bytes are
            not counted), 2 otherwise; "release" (`memplan`'s "quantized" storage) FP4 experts
            0.5 + 1/32, FP8 attention / shared expert 1 + 1/128², the rest 2.
  cache   = per layer W·d (window) + CSA: ⌊C/4⌋·d_I + min(topk, ⌊C/4⌋)·d + HCA: ⌊C/128⌋·d, × the cache
            itemsize (bf16 state: 2); a block's own new rows are not counted.
For flash() at batch 1 this gives 26.6 GB of bf16 weights per token (§6: 26.5 GB = 13.27 B active
parameters × 2; the rest is the float32 HC / norm leaves), 20.1 GB with fp8-experts, and 11.2 GB in the
release format (§6 quotes ≈10.2 GB counting every non-expert weight at 1 byte; memplan's storage keeps
the head, compressors and router in bf16: +1.0 GB); the cache term is 21.75 MiB at 4K, 62.9 MiB at 32K
and 204 MiB at 128K (§6 table: 22 / 63 / 204 MiB).
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from . import memplan
from ..model import params as P
from ..ops import quant
from ..config import CSA, HCA, ModelConfig

FORMATS = ("bf16", "fp8-experts", "release")
ROUTED = "routed experts"       # memplan.part_of's name for the routed-expert leaves


def expected_active_experts(n_experts: int, top_k: int, n_tokens: int) -> float:
    """Distinct experts a layer reads for n_tokens tokens under uniform routing: E·(1 − (1 − k/E)^T).

    Exactly k for one token (the k choices of a token are distinct)."""
    if n_tokens <= 1:
        return float(min(top_k, n_experts)) * n_tokens
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** n_tokens)


def element_bytes(path: str, spec: P.ParamSpec, fmt: str) -> float:
    """Bytes per element of a parameter leaf stored in format `fmt` (scales amortised per element)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; choose from {FORMATS}")
    if fmt == "fp8-experts" and spec.kind == "weight" and memplan.part_of(path, spec) == ROUTED:
        return 1.0 + 4.0 / (128 * 128)
    stored_as = P.release_format(path, spec) if fmt == "release" else None
    leaf = P.abstract_leaf(dataclasses.replace(spec, quant=stored_as), jnp.bfloat16)
    arrays = (leaf.codes, leaf.scale) if isinstance(leaf, quant.QArray) else (leaf,)
    return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in arrays) / math.prod(spec.shape)


def stored_bytes(specs, fmt: str) -> float:
    """Bytes of a ParamSpec tree stored in fmt (all leaves, no activity fraction)."""
    return sum(math.prod(s.shape) * element_bytes(p, s, fmt) for p, s in P.flatten(specs).items())


def weight_bytes_read(config: ModelConfig, fmt: str, n_tokens: int) -> dict:
    """Bytes of weights one step over n_tokens tokens (batch × block) must read, by part."""
    E, k, V = config.n_routed_experts, config.num_experts_per_tok, config.vocab_size
    active = expected_active_experts(E, k, n_tokens)
    out = {"routed_experts": 0.0, "embedding_rows": 0.0, "head": 0.0, "other": 0.0}
    for path, spec in P.flatten(P.param_specs(config)).items():
        b = math.prod(spec.shape) * element_bytes(path, spec, fmt)
        if memplan.part_of(path, spec) == ROUTED:
            out["routed_experts"] += b * active / E
        elif path == "embed":
            out["embedding_rows"] += b * min(n_tokens, V) / V
        elif path.endswith("gate.tid2eid"):
            out["other"] += b * min(n_tokens, V) / V
        elif path == "head":
            out["head"] += b
        else:
            out["other"] += b
    out["active_experts_per_layer"] = active
    out["total"] = out["routed_experts"] + out["embedding_rows"] + out["head"] + out["other"]
    return out


def cache_bytes_read(config: ModelConfig, context: int, cache_itemsize: int = 2) -> dict:
    """Cache bytes one sequence's decode step at `context` committed tokens must read (docs/model_math.md §6).

    Every layer: its W window rows (W·d); a CSA layer: all ⌊C/m⌋ indexer keys (d_I each) plus the
    min(index_topk, ⌊C/m⌋) selected rows (d each); an HCA layer: all ⌊C/m⌋ rows (d each).
    """
    d, dI, W = config.head_dim, config.index_head_dim, config.sliding_window
    out = {"window": 0, "indexer_keys": 0, "csa_selected_rows": 0, "hca_rows": 0}
    for lt, m in zip(config.layer_types, config.compress_ratios):
        out["window"] += min(W, context) * d * cache_itemsize
        if lt == CSA:
            rows = context // m
            out["indexer_keys"] += rows * dI * cache_itemsize
            out["csa_selected_rows"] += min(config.index_topk, rows) * d * cache_itemsize
        elif lt == HCA:
            out["hca_rows"] += context // m * d * cache_itemsize
    out["total"] = sum(out.values())
    return out


def bytes_bound(config: ModelConfig, fmt: str, batch: int, context: int, tokens: int = 1,
                cache_itemsize: int = 2) -> dict:
    """Bytes a step of `tokens` tokens per sequence (1 = decode, k+1 = verify) must read (module docstring).

    Returns {"weights", "cache", "total", "active_experts_per_layer", "weight_parts", "cache_parts_per_sequence"}.
    """
    w = weight_bytes_read(config, fmt, batch * tokens)
    c = cache_bytes_read(config, context, cache_itemsize)
    return {"weights": w["total"], "cache": batch * c["total"], "total": w["total"] + batch * c["total"],
            "active_experts_per_layer": w["active_experts_per_layer"],
            "weight_parts": {k: v for k, v in w.items() if k not in ("total", "active_experts_per_layer")},
            "cache_parts_per_sequence": c}


def balanced_experts(config: ModelConfig, n_tokens: int) -> int:
    """Active routed experts per layer when `n_tokens` tokens' top-k picks are spread evenly: min(E, T·k)."""
    return min(config.n_routed_experts, n_tokens * config.num_experts_per_tok)


def balanced_total(config: ModelConfig, bound: dict, n_tokens: int) -> float:
    """`bytes_bound`'s total with balanced routing (`balanced_experts` active experts per layer instead of the
    uniform expectation): the most a static dropless program can be asked to skip."""
    experts = bound["weight_parts"]["routed_experts"]
    return bound["total"] - experts + experts * balanced_experts(config, n_tokens) / bound["active_experts_per_layer"]


def per_chip_bounds(config: ModelConfig, fmt: str, batch: int, block: int, context: int, chips: int) -> dict:
    """The bound of a step split evenly over `chips` (the ideal placement), in bytes per chip: "bound" (uniform
    routing, `bytes_bound`), "bound_bal" (min(E, T·k) active experts per layer, balanced routing: the most a
    static dropless program can be asked to skip; equal to the bound at T = 1), "bound_weights",
    "bound_cache", and the active experts per layer of each ("active_experts", "active_experts_bal")."""
    b = bytes_bound(config, fmt, batch, context, block)
    bal = balanced_experts(config, batch * block)
    balanced = balanced_total(config, b, batch * block)
    return {"bound": b["total"] / chips, "bound_bal": balanced / chips, "active_experts": b["active_experts_per_layer"],
            "active_experts_bal": bal, "bound_weights": b["weights"] / chips, "bound_cache": b["cache"] / chips}
