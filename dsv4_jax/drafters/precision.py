"""A drafter's weights at another storage precision, the target's untouched: `drafter_at_precision`.

The question it answers (llama.cpp#27383: a Q8_0 drafter ran 20.8 % slower than no drafter where the F16 one
was 17.7 % faster): does a drafter stored at a lower precision keep its acceptance? Speculative decoding is
lossless whatever the drafter computes, so only acceptance (and the drafter's cost) can move; the target's
leaves are returned as the same objects, so its output cannot.

    drafter_at_precision(params, drafter, precision) -> params'
    params'[k] is params[k] for every key but the drafter's (the target, the other drafter);
    params'[drafter] has the same tree with these leaves replaced (paths relative to the drafter's root:
    params["mtp"][i] / params["dspark"]; the classes are the spec kinds of `model.params`):

    class            leaves                                               as-loaded f32/bf16     fp8 / int8
    kept float32     HC (hc_attn, hc_ffn, hc_head: fn, base, scale),     as is     as is         as is
                     norms (attn_norm, ffn_norm, q_norm, kv_norm, enorm,
                     hnorm, norm, main_norm), attn_sink, ape, gate.bias,
                     conf_proj (weight, bias)
    integer          tid2eid (absent in drafter blocks: score-routed)     as is     as is         as is
    projections      attn.wq_a, wq_b, wkv, wo_a, wo_b; ffn.shared_experts as is     cast          quantized
                     .w1/w2/w3; ffn.experts.w1/w2/w3 [E, ., .];
                     e_proj, h_proj (MTP); main_proj (DSpark)
    other matrices   ffn.gate.weight (router); markov_w1, markov_w2       as is     cast          as is

Formats:
  * "f32" / "bf16": the "weight"-kind leaves cast (a QArray leaf dequantized to that dtype, exact); the
    kept-float32 leaves stay float32 as in the bf16 storage of `analysis.memplan` (HF `_keep_in_fp32_modules`).
    A bf16 weight cast to f32 keeps its values; f32 -> bf16 rounds to nearest: |ŵ − w| ≤ 2^-8 |w|.
    A cast wider than the target's compute dtype (the embedding's: "f32" on a bf16 model) is a ValueError:
    the drafter's layers would then compute in float32 on the target's bfloat16 activations, and the
    model's code takes one activation dtype (its MoE tile branches, the drafters' loop carries). A narrower
    cast (bf16 weights in a float32 model) computes in float32 on the rounded values.
  * "fp8": `ops.quant.FP8` (fp8_e4m3_b128), the release's format of the drafters' projections, here also
    for the routed experts (the release stores those FP4): e4m3 codes, one e8m0 scale 2^⌈log2(amax/448)⌉ per
    128×128 block (partial blocks at the edges). Per element |ŵ − w| ≤ 2^-4 |w| + 2^-10 s (half an e4m3
    ulp: 3 mantissa bits; the subnormal spacing 2^-9 s below 2^-6 s), s ≤ 2 amax/448 the block's scale.
  * "int8": `ops.quant.Q8_0` (q8_0), the project's GGML Q8_0, the format of the issue: int8 codes, one
    float16 scale s = amax/127 per 32 columns of a row, |ŵ − w| ≤ s/2 (+ amax·2^-11 from the float16
    scale) ≤ amax_row/127. (`ops.quant.INT8`, int8 per output row with a float32 scale, is the project's
    other int8 format; Q8_0 is finer and is what llama.cpp ran.)
  The quantized leaves are `ops.quant.QArray`s dequantizing to the leaf's own dtype (compute dtype unchanged):
  the drafter's code reads them through `ops.linear.linear` / `grouped_linear` (FP8 blocks multiplied per
  block when few tokens fit `quant.blocks_fit`, else dequantized inside the jit) and the routed experts
  through `model.layers.experts` (active experts' codes gathered, then dequantized). So the drafter runs
  on the codes: its values are exactly the quantized ones. A leaf already in the wanted format is kept (the
  same object); one in another format (a release FP4 expert) is dequantized and quantized again.

Why these leaves: the quantized set is the release's quantized set (`params.RELEASE_FP8`, `params.RELEASE_FP4`),
the matrices that dominate the drafter's bytes. The router stays as loaded (the release keeps it bf16;
llama.cpp's quantizer skips ffn_gate_inp too: a small matrix that decides the expert choice);
the Markov tables [V, R] stay as loaded (release bf16; markov_w1 is a row lookup, `ops.linear.embed`);
conf_proj and every vector are float32 leaves. The embedding and head the drafters read are the target's
and stay as loaded.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp

from ..model import params as P
from ..ops import quant

AS_LOADED = "as-loaded"
PRECISIONS = (AS_LOADED, "f32", "bf16", "fp8", "int8")
DRAFTERS = ("mtp", "dspark")                  # each is its params key
CASTS = {"f32": jnp.float32, "bf16": jnp.bfloat16}
QUANTIZED = {"fp8": quant.FP8, "int8": quant.Q8_0}

# leaves kept float32 whatever the storage (ParamSpec kind "f32"; tests check this against the spec trees)
KEPT_F32 = re.compile(r"(^|\.)(hc_\w+\.(fn|base|scale)|\w*norm|attn_sink|ape|gate\.bias|conf_proj\.(weight|bias))$")


def _flat(path) -> str:
    """A jax key path as a flat dot path ("stages.0.attn.wq_a"), as `model.params.flatten` spells it."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def leaf_class(path: str, leaf) -> str:
    """The class of a drafter leaf (flat dot path relative to the drafter's root; module docstring):
    "f32" (kept float32), "index" (integer), "projection" (quantized by fp8 / int8) or "matrix" (cast only)."""
    if not isinstance(leaf, quant.QArray) and not jnp.issubdtype(leaf.dtype, jnp.floating):
        return "index"
    if KEPT_F32.search(path):
        return "f32"
    if leaf.ndim >= 2 and (P.RELEASE_FP8.search(path) or P.RELEASE_FP4.search(path)):
        return "projection"
    return "matrix"


def _cast(leaf, dtype):
    if isinstance(leaf, quant.QArray):
        return quant.dequantize(leaf, dtype)
    return leaf if leaf.dtype == dtype else leaf.astype(dtype)


def _quantize(leaf, fmt: quant.QFormat):
    if isinstance(leaf, quant.QArray):
        if leaf.fmt == fmt:
            return leaf
        return quant.quantize(quant.dequantize(leaf, jnp.float32), fmt, leaf.dtype)
    return quant.quantize(leaf, fmt, leaf.dtype)


def converted_leaves(tree, precision: str) -> dict[str, str]:
    """{flat path: what `drafter_at_precision` makes of it} for a drafter tree: "kept", "cast <dtype>" or the
    format name; for reports and tests."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree, is_leaf=quant.is_qarray):
        flat = _flat(path)
        cls = leaf_class(flat, leaf)
        if precision in CASTS and cls in ("projection", "matrix"):
            out[flat] = f"cast {jnp.dtype(CASTS[precision]).name}"
        elif precision in QUANTIZED and cls == "projection":
            out[flat] = QUANTIZED[precision].name
        else:
            out[flat] = "kept"
    return out


def drafter_at_precision(params: dict, drafter: str, precision: str) -> dict:
    """params with only params[drafter] ("mtp": the list of MTP blocks, or "dspark") stored at `precision`
    (PRECISIONS; module docstring: which leaves, which format); every other entry the same object.
    "as-loaded" returns params itself. ValueError for an unknown drafter or precision, or a params without
    that drafter's weights."""
    if drafter not in DRAFTERS:
        raise ValueError(f"unknown drafter {drafter!r}; drafters with weights: {', '.join(DRAFTERS)}")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown drafter precision {precision!r}; choose from {', '.join(PRECISIONS)}")
    if not params.get(drafter):
        raise ValueError(f"params hold no {drafter} weights (params[{drafter!r}]); keys: {sorted(params)}")
    if precision == AS_LOADED:
        return params
    compute = params["embed"].dtype if "embed" in params else None
    if precision in CASTS and compute is not None and jnp.promote_types(CASTS[precision], compute) != compute:
        raise ValueError(f"drafter precision {precision!r} needs a target computing in {precision} or wider; this one computes "
                         f"in {jnp.dtype(compute).name} and its layers take one activation dtype. Load the model "
                         f"in float32 (a drafter loaded at {jnp.dtype(compute).name} keeps its values in f32)")

    def one(path, leaf):
        cls = leaf_class(_flat(path), leaf)
        if precision in CASTS and cls in ("projection", "matrix"):
            return _cast(leaf, CASTS[precision])
        if precision in QUANTIZED and cls == "projection":
            return _quantize(leaf, QUANTIZED[precision])
        return leaf

    out = dict(params)
    out[drafter] = jax.tree_util.tree_map_with_path(one, params[drafter], is_leaf=quant.is_qarray)
    return out
