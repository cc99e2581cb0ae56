"""The one name table: parameter-tree leaves <-> checkpoint tensor names.

Canonical leaf paths are those of `params.layer_specs` (dot-separated, inside one layer), of the
top-level tree and of the drafter trees (`params.mtp_specs`, `params.dspark_specs`). Each entry
gives the name in every checkpoint naming ("scheme"):

  official   DeepSeek's inference/model.py module tree, as in the safetensors release
             (docs/checkpoint_formats.md §3; docs/drafter_math.md §1.1, §2.2)
  hf         transformers' `DeepseekV4ForCausalLM.state_dict()` (docs/model_math.md §2.10); no drafters
  llamacpp   llama.cpp GGUF (`blk.N.*`; MTP as `blk.{n_layer}.*` + `nextn.*` in the `--mtp` file;
             DSpark as the `dflash` architecture) (docs/checkpoint_formats.md §1.2)
  ds4        antirez/ds4 GGUF: target as llama.cpp; MTP as `mtp.0.*`, DSpark as `dspark.*` (§1.2, docs/drafter_math.md §5.3)

Block leaves (a decoder layer, an MTP block or a DSpark stage) are suffixes appended to a block
prefix (`block_prefix`); llama.cpp and ds4 share the GGUF suffixes. Drafter head leaves are full
templates in which `{p}` is the block prefix (MTP) or `{first}` / `{last}` the prefix of the first /
last DSpark stage.

Routed experts differ in layout: official files hold one tensor per expert
(`ffn.experts.{e}.w1.weight`), transformers fuses them (`mlp.experts.gate_up_proj` [E, 2I, D] =
cat(w1, w3) and `down_proj` [E, D, I]), GGUF stacks them (`ffn_gate_exps` [E, I, D]). Fused
leaves carry a `FusedPart` instead of a name.
"""
from __future__ import annotations

import dataclasses

SCHEMES = ("official", "hf", "llamacpp", "ds4")


@dataclasses.dataclass(frozen=True)
class FusedPart:
    """Leaf = one part of a fused tensor: `tensor[:, part*n : (part+1)*n]` along axis 1 (n = size/parts)."""

    tensor: str
    part: int
    parts: int


# canonical leaf (inside a block) -> (official suffix, transformers suffix, GGUF suffix)
LAYER_NAMES: dict[str, tuple[str, str | FusedPart, str]] = {
    "attn_norm": ("attn_norm.weight", "input_layernorm.weight", "attn_norm.weight"),
    "ffn_norm": ("ffn_norm.weight", "post_attention_layernorm.weight", "ffn_norm.weight"),
    "hc_attn.fn": ("hc_attn_fn", "attn_hc.fn", "hc_attn_fn.weight"),
    "hc_attn.base": ("hc_attn_base", "attn_hc.base", "hc_attn_base.weight"),
    "hc_attn.scale": ("hc_attn_scale", "attn_hc.scale", "hc_attn_scale.weight"),
    "hc_ffn.fn": ("hc_ffn_fn", "ffn_hc.fn", "hc_ffn_fn.weight"),
    "hc_ffn.base": ("hc_ffn_base", "ffn_hc.base", "hc_ffn_base.weight"),
    "hc_ffn.scale": ("hc_ffn_scale", "ffn_hc.scale", "hc_ffn_scale.weight"),
    "attn.wq_a": ("attn.wq_a.weight", "self_attn.q_a_proj.weight", "attn_q_a.weight"),
    "attn.q_norm": ("attn.q_norm.weight", "self_attn.q_a_norm.weight", "attn_q_a_norm.weight"),
    "attn.wq_b": ("attn.wq_b.weight", "self_attn.q_b_proj.weight", "attn_q_b.weight"),
    "attn.wkv": ("attn.wkv.weight", "self_attn.kv_proj.weight", "attn_kv.weight"),
    "attn.kv_norm": ("attn.kv_norm.weight", "self_attn.kv_norm.weight", "attn_kv_a_norm.weight"),
    "attn.wo_a": ("attn.wo_a.weight", "self_attn.o_a_proj.weight", "attn_output_a.weight"),
    "attn.wo_b": ("attn.wo_b.weight", "self_attn.o_b_proj.weight", "attn_output_b.weight"),
    "attn.attn_sink": ("attn.attn_sink", "self_attn.sinks", "attn_sinks.weight"),
    "attn.compressor.wkv": ("attn.compressor.wkv.weight", "self_attn.compressor.kv_proj.weight",
                            "attn_compressor_kv.weight"),
    "attn.compressor.wgate": ("attn.compressor.wgate.weight", "self_attn.compressor.gate_proj.weight",
                              "attn_compressor_gate.weight"),
    "attn.compressor.ape": ("attn.compressor.ape", "self_attn.compressor.position_bias",
                            "attn_compressor_ape.weight"),
    "attn.compressor.norm": ("attn.compressor.norm.weight", "self_attn.compressor.kv_norm.weight",
                             "attn_compressor_norm.weight"),
    "attn.indexer.wq_b": ("attn.indexer.wq_b.weight", "self_attn.compressor.indexer.q_b_proj.weight",
                          "indexer.attn_q_b.weight"),
    "attn.indexer.weights_proj": ("attn.indexer.weights_proj.weight",
                                  "self_attn.compressor.indexer.scorer.weights_proj.weight", "indexer.proj.weight"),
    "attn.indexer.compressor.wkv": ("attn.indexer.compressor.wkv.weight", "self_attn.compressor.indexer.kv_proj.weight",
                                    "indexer_compressor_kv.weight"),
    "attn.indexer.compressor.wgate": ("attn.indexer.compressor.wgate.weight",
                                      "self_attn.compressor.indexer.gate_proj.weight", "indexer_compressor_gate.weight"),
    "attn.indexer.compressor.ape": ("attn.indexer.compressor.ape", "self_attn.compressor.indexer.position_bias",
                                    "indexer_compressor_ape.weight"),
    "attn.indexer.compressor.norm": ("attn.indexer.compressor.norm.weight",
                                     "self_attn.compressor.indexer.kv_norm.weight", "indexer_compressor_norm.weight"),
    "ffn.gate.weight": ("ffn.gate.weight", "mlp.gate.weight", "ffn_gate_inp.weight"),
    "ffn.gate.bias": ("ffn.gate.bias", "mlp.gate.e_score_correction_bias", "exp_probs_b.bias"),
    "ffn.gate.tid2eid": ("ffn.gate.tid2eid", "mlp.gate.tid2eid", "ffn_gate_tid2eid.weight"),
    "ffn.experts.w1": ("ffn.experts.{e}.w1.weight", FusedPart("mlp.experts.gate_up_proj", 0, 2),
                       "ffn_gate_exps.weight"),
    "ffn.experts.w3": ("ffn.experts.{e}.w3.weight", FusedPart("mlp.experts.gate_up_proj", 1, 2),
                       "ffn_up_exps.weight"),
    "ffn.experts.w2": ("ffn.experts.{e}.w2.weight", FusedPart("mlp.experts.down_proj", 0, 1),
                       "ffn_down_exps.weight"),
    "ffn.shared_experts.w1": ("ffn.shared_experts.w1.weight", "mlp.shared_experts.gate_proj.weight",
                              "ffn_gate_shexp.weight"),
    "ffn.shared_experts.w3": ("ffn.shared_experts.w3.weight", "mlp.shared_experts.up_proj.weight",
                              "ffn_up_shexp.weight"),
    "ffn.shared_experts.w2": ("ffn.shared_experts.w2.weight", "mlp.shared_experts.down_proj.weight",
                              "ffn_down_shexp.weight"),
}

TOP_NAMES: dict[str, tuple[str, str, str]] = {
    "embed": ("embed.weight", "model.embed_tokens.weight", "token_embd.weight"),
    "norm": ("norm.weight", "model.norm.weight", "output_norm.weight"),
    "head": ("head.weight", "lm_head.weight", "output.weight"),
    "hc_head.fn": ("hc_head_fn", "model.hc_head.hc_fn", "output_hc_fn.weight"),
    "hc_head.base": ("hc_head_base", "model.hc_head.hc_base", "output_hc_base.weight"),
    "hc_head.scale": ("hc_head_scale", "model.hc_head.hc_scale", "output_hc_scale.weight"),
}

# MTP head leaves (docs/drafter_math.md §1.1; docs/checkpoint_formats.md §1.2): leaf -> (official, llamacpp, ds4) templates.
# llama.cpp fuses e_proj/h_proj as eh_proj = cat([e_proj, h_proj], dim=1) (e first) and stores the
# MTP's own hc_head as the `--mtp` file's top-level output_hc_* (docs/drafter_math.md §9).
MTP_NAMES: dict[str, tuple[str, str | FusedPart, str]] = {
    "e_proj": ("{p}e_proj.weight", FusedPart("{p}nextn.eh_proj.weight", 0, 2), "{p}e_proj.weight"),
    "h_proj": ("{p}h_proj.weight", FusedPart("{p}nextn.eh_proj.weight", 1, 2), "{p}h_proj.weight"),
    "enorm": ("{p}enorm.weight", "{p}nextn.enorm.weight", "{p}enorm.weight"),
    "hnorm": ("{p}hnorm.weight", "{p}nextn.hnorm.weight", "{p}hnorm.weight"),
    "norm": ("{p}norm.weight", "{p}nextn.shared_head_norm.weight", "{p}norm.weight"),
    "hc_head.fn": ("{p}hc_head_fn", "output_hc_fn.weight", "{p}hc_head_fn.weight"),
    "hc_head.base": ("{p}hc_head_base", "output_hc_base.weight", "{p}hc_head_base.weight"),
    "hc_head.scale": ("{p}hc_head_scale", "output_hc_scale.weight", "{p}hc_head_scale.weight"),
}

# DSpark head leaves (docs/drafter_math.md §2.2, §5.2-5.3; docs/checkpoint_formats.md §1.2, §3): (official, llamacpp dflash, ds4).
DSPARK_NAMES: dict[str, tuple[str, str, str]] = {
    "main_proj": ("{first}main_proj.weight", "fc.weight", "dspark.main_proj.weight"),
    "main_norm": ("{first}main_norm.weight", "enc.output_norm.weight", "dspark.main_norm.weight"),
    "norm": ("{last}norm.weight", "output_norm.weight", "dspark.norm.weight"),
    "hc_head.fn": ("{last}hc_head_fn", "output_hc_fn.weight", "dspark.hc_head_fn.weight"),
    "hc_head.base": ("{last}hc_head_base", "output_hc_base.weight", "dspark.hc_head_base.weight"),
    "hc_head.scale": ("{last}hc_head_scale", "output_hc_scale.weight", "dspark.hc_head_scale.weight"),
    "markov_w1": ("{last}markov_head.markov_w1.weight", "markov_w1.weight", "dspark.markov_w1.weight"),
    "markov_w2": ("{last}markov_head.markov_w2.weight", "markov_w2.weight", "dspark.markov_w2.weight"),
    "conf_proj.weight": ("{last}confidence_head.proj.weight", "conf_proj.weight", "dspark.conf_proj.weight"),
    "conf_proj.bias": ("{last}confidence_head.proj.bias", "conf_proj.bias", "dspark.conf_proj.bias"),
}
# Leaves a drafter file may lack (docs/drafter_math.md §8 item 9: take bias presence from the checkpoint).
DSPARK_OPTIONAL = ("conf_proj.bias",)

# Block prefixes: scope -> scheme -> template ({i} the block index, {n} the target's num_layers).
BLOCK_PREFIX = {
    "layer": {"official": "layers.{i}.", "hf": "model.layers.{i}.", "llamacpp": "blk.{i}.", "ds4": "blk.{i}."},
    "mtp": {"official": "mtp.{i}.", "llamacpp": "blk.{n}.", "ds4": "mtp.{i}."},
    "dspark": {"official": "mtp.{i}.", "llamacpp": "blk.{i}.", "ds4": "dspark.{i}."},
}
LAYER_PREFIX = {"official": "layers.{i}.", "hf": "model.layers.{i}."}
_COLUMN = {"official": 0, "hf": 1, "llamacpp": 2, "ds4": 2, "gguf": 2}
_HEAD_COLUMN = {"official": 0, "llamacpp": 1, "ds4": 2}

# Tensors a checkpoint may carry that the target model does not use (not an error).
IGNORED_HF = ("rotary_emb.", "mtp.")
IGNORED = {
    "official": ("rotary_emb.",),
    "hf": ("rotary_emb.",),
    # exp_probs_b_vl: the Vision-Exp checkpoint's optional second bias (docs/checkpoint_formats.md §1.2)
    "llamacpp": ("rope_freqs.", "exp_probs_b_vl."),
    "ds4": ("rope_freqs.", "exp_probs_b_vl."),
}
# Optional tensors in an MTP block (docs/drafter_math.md §1.1 / §5.2): shared with the target when absent; never used.
MTP_IGNORED = {"official": ("{p}emb.tok_emb.weight", "{p}head.weight"),
               "llamacpp": ("{p}nextn.embed_tokens.weight", "{p}nextn.shared_head_head.weight",
                            "token_embd.weight", "output.weight", "output_norm.weight"),
               "ds4": ()}


def _prefixed(entry, prefix: str):
    if isinstance(entry, FusedPart):
        return dataclasses.replace(entry, tensor=prefix + entry.tensor)
    return prefix + entry


def block_prefix(scheme: str, scope: str, index: int, num_layers: int = 0) -> str:
    """Name prefix of block `index` of `scope` ('layer' | 'mtp' | 'dspark') in `scheme`."""
    try:
        tpl = BLOCK_PREFIX[scope][scheme]
    except KeyError:
        raise KeyError(f"scheme {scheme!r} has no {scope} blocks") from None
    return tpl.format(i=index, n=num_layers + index)


def block_tensor(scheme: str, prefix: str, leaf: str):
    """Name (or FusedPart; may contain `{e}` for per-expert tensors) of block leaf `leaf` under `prefix`."""
    return _prefixed(LAYER_NAMES[leaf][_COLUMN[scheme]], prefix)


def layer_name(fmt: str, layer: int, leaf: str):
    """Checkpoint name (or FusedPart) of leaf `leaf` of decoder layer `layer` in scheme `fmt`."""
    return block_tensor(fmt, block_prefix(fmt, "layer", layer), leaf)


def top_name(fmt: str, leaf: str) -> str:
    return TOP_NAMES[leaf][_COLUMN[fmt]]


def mtp_tensor(scheme: str, prefix: str, leaf: str):
    """Name (or FusedPart) of MTP head leaf `leaf` for the MTP block at `prefix`."""
    entry = MTP_NAMES[leaf][_HEAD_COLUMN[scheme]]
    if isinstance(entry, FusedPart):
        return dataclasses.replace(entry, tensor=entry.tensor.format(p=prefix))
    return entry.format(p=prefix)


def dspark_tensor(scheme: str, leaf: str, n_stages: int) -> str:
    """Name of DSpark head leaf `leaf` (stage prefixes from `block_prefix(scheme, 'dspark', s)`)."""
    first = block_prefix(scheme, "dspark", 0)
    last = block_prefix(scheme, "dspark", n_stages - 1)
    return DSPARK_NAMES[leaf][_HEAD_COLUMN[scheme]].format(first=first, last=last)
