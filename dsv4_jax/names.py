"""The one name table: parameter-tree leaves <-> checkpoint tensor names.

Canonical leaf paths are those of `params.layer_specs` (dot-separated, inside one layer) and of the
top-level tree. Each entry gives the official DeepSeek name (inference/model.py module tree, as in
the safetensors release) and the transformers name (`DeepseekV4ForCausalLM.state_dict()`);
target_model.md §2.10 and weight_formats.md §3 list them. Converters add their formats here.

Routed experts differ in layout: official files hold one tensor per expert
(`ffn.experts.{e}.w1.weight`), transformers fuses them (`mlp.experts.gate_up_proj` [E, 2I, D] =
cat(w1, w3) and `down_proj` [E, D, I]). Such leaves carry an `ExpertSource` instead of a name.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class FusedPart:
    """Leaf = one part of a fused tensor: `tensor[:, part*n : (part+1)*n]` along axis 1 (n = size/parts)."""

    tensor: str
    part: int
    parts: int


# canonical leaf (inside a layer) -> (official suffix, transformers suffix)
LAYER_NAMES: dict[str, tuple[str, str | FusedPart]] = {
    "attn_norm": ("attn_norm.weight", "input_layernorm.weight"),
    "ffn_norm": ("ffn_norm.weight", "post_attention_layernorm.weight"),
    "hc_attn.fn": ("hc_attn_fn", "attn_hc.fn"),
    "hc_attn.base": ("hc_attn_base", "attn_hc.base"),
    "hc_attn.scale": ("hc_attn_scale", "attn_hc.scale"),
    "hc_ffn.fn": ("hc_ffn_fn", "ffn_hc.fn"),
    "hc_ffn.base": ("hc_ffn_base", "ffn_hc.base"),
    "hc_ffn.scale": ("hc_ffn_scale", "ffn_hc.scale"),
    "attn.wq_a": ("attn.wq_a.weight", "self_attn.q_a_proj.weight"),
    "attn.q_norm": ("attn.q_norm.weight", "self_attn.q_a_norm.weight"),
    "attn.wq_b": ("attn.wq_b.weight", "self_attn.q_b_proj.weight"),
    "attn.wkv": ("attn.wkv.weight", "self_attn.kv_proj.weight"),
    "attn.kv_norm": ("attn.kv_norm.weight", "self_attn.kv_norm.weight"),
    "attn.wo_a": ("attn.wo_a.weight", "self_attn.o_a_proj.weight"),
    "attn.wo_b": ("attn.wo_b.weight", "self_attn.o_b_proj.weight"),
    "attn.attn_sink": ("attn.attn_sink", "self_attn.sinks"),
    "attn.compressor.wkv": ("attn.compressor.wkv.weight", "self_attn.compressor.kv_proj.weight"),
    "attn.compressor.wgate": ("attn.compressor.wgate.weight", "self_attn.compressor.gate_proj.weight"),
    "attn.compressor.ape": ("attn.compressor.ape", "self_attn.compressor.position_bias"),
    "attn.compressor.norm": ("attn.compressor.norm.weight", "self_attn.compressor.kv_norm.weight"),
    "attn.indexer.wq_b": ("attn.indexer.wq_b.weight", "self_attn.compressor.indexer.q_b_proj.weight"),
    "attn.indexer.weights_proj": ("attn.indexer.weights_proj.weight",
                                  "self_attn.compressor.indexer.scorer.weights_proj.weight"),
    "attn.indexer.compressor.wkv": ("attn.indexer.compressor.wkv.weight", "self_attn.compressor.indexer.kv_proj.weight"),
    "attn.indexer.compressor.wgate": ("attn.indexer.compressor.wgate.weight",
                                      "self_attn.compressor.indexer.gate_proj.weight"),
    "attn.indexer.compressor.ape": ("attn.indexer.compressor.ape", "self_attn.compressor.indexer.position_bias"),
    "attn.indexer.compressor.norm": ("attn.indexer.compressor.norm.weight",
                                     "self_attn.compressor.indexer.kv_norm.weight"),
    "ffn.gate.weight": ("ffn.gate.weight", "mlp.gate.weight"),
    "ffn.gate.bias": ("ffn.gate.bias", "mlp.gate.e_score_correction_bias"),
    "ffn.gate.tid2eid": ("ffn.gate.tid2eid", "mlp.gate.tid2eid"),
    "ffn.experts.w1": ("ffn.experts.{e}.w1.weight", FusedPart("mlp.experts.gate_up_proj", 0, 2)),
    "ffn.experts.w3": ("ffn.experts.{e}.w3.weight", FusedPart("mlp.experts.gate_up_proj", 1, 2)),
    "ffn.experts.w2": ("ffn.experts.{e}.w2.weight", FusedPart("mlp.experts.down_proj", 0, 1)),
    "ffn.shared_experts.w1": ("ffn.shared_experts.w1.weight", "mlp.shared_experts.gate_proj.weight"),
    "ffn.shared_experts.w3": ("ffn.shared_experts.w3.weight", "mlp.shared_experts.up_proj.weight"),
    "ffn.shared_experts.w2": ("ffn.shared_experts.w2.weight", "mlp.shared_experts.down_proj.weight"),
}

TOP_NAMES: dict[str, tuple[str, str]] = {
    "embed": ("embed.weight", "model.embed_tokens.weight"),
    "norm": ("norm.weight", "model.norm.weight"),
    "head": ("head.weight", "lm_head.weight"),
    "hc_head.fn": ("hc_head_fn", "model.hc_head.hc_fn"),
    "hc_head.base": ("hc_head_base", "model.hc_head.hc_base"),
    "hc_head.scale": ("hc_head_scale", "model.hc_head.hc_scale"),
}

LAYER_PREFIX = {"official": "layers.{i}.", "hf": "model.layers.{i}."}
_COLUMN = {"official": 0, "hf": 1}

# Tensors a checkpoint may carry that the target model does not use (not an error).
IGNORED_HF = ("rotary_emb.", "mtp.")


def layer_name(fmt: str, layer: int, leaf: str):
    """Checkpoint name (or FusedPart) of leaf `leaf` of decoder layer `layer` in format 'official' | 'hf'."""
    entry = LAYER_NAMES[leaf][_COLUMN[fmt]]
    prefix = LAYER_PREFIX[fmt].format(i=layer)
    if isinstance(entry, FusedPart):
        return dataclasses.replace(entry, tensor=prefix + entry.tensor)
    return prefix + entry


def top_name(fmt: str, leaf: str) -> str:
    return TOP_NAMES[leaf][_COLUMN[fmt]]
