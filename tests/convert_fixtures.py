"""Test fixtures for the converters: a tiny random HF model, written as an official FP8/FP4 release,
as llama.cpp / ds4 GGUF files, plus random MTP and DSpark tensors.

Tensor names here are spelled out independently of `dsv4_jax.model.names` (from docs/checkpoint_formats.md §1.2 /
§3 and docs/drafter_math.md §1.1 / §2.2), so the tests check the name table rather than reuse it. Each writer
returns the HF state dict of the values it actually stored (dequantized), which the tests load back
into the HF model to get reference logits.
"""
from __future__ import annotations

import json
import math
import struct

import gguf
import ml_dtypes
import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from . import hf_reference as ref

# hidden 256 and expert width 256 so K-quants (256-blocks) fit; every input dim a multiple of 32
HF_CONFIG = dict(ref.BASE, hidden_size=256, moe_intermediate_size=256, q_lora_rank=32, num_hidden_layers=3,
                 compress_ratios=[0, 4, 128], num_hash_layers=1,
                 compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8})
RATIOS = [0, 4, 8]
E, V, D, I, HC = 8, 97, 256, 256, 4
FP4_VALUES = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def build_model(seed: int = 0):
    cfg = DeepseekV4Config(**HF_CONFIG)
    cfg._attn_implementation = "eager"
    model = DeepseekV4ForCausalLM(cfg).eval()
    ref.randomize(model, seed)
    return model


def state(model) -> dict[str, np.ndarray]:
    sd = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    return sd


def load_state(model, sd: dict[str, np.ndarray]) -> None:
    model.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in sd.items()}, strict=True)


# ---- quantizers (as the official release: ue8m0 scales rounded up to powers of two) ----------------

def e8m0(x: np.ndarray) -> np.ndarray:
    return np.ldexp(np.float32(1), x.astype(np.int32) - 127).astype(np.float32)


def quant_fp8(w: np.ndarray):
    """[out, in] -> (codes uint8, scale uint8 [⌈out/128⌉, ⌈in/128⌉], dequantized f32)."""
    out, inn = w.shape
    bo, bi = -(-out // 128), -(-inn // 128)
    pad = np.zeros((bo * 128, bi * 128), np.float32)
    pad[:out, :inn] = w
    blocks = pad.reshape(bo, 128, bi, 128)
    amax = np.abs(blocks).max(axis=(1, 3))
    exp = np.ceil(np.log2(np.maximum(amax, 1e-30) / 448.0)).astype(np.int32)
    scale = (exp + 127).astype(np.uint8)
    s = e8m0(scale)[:, None, :, None]
    codes = (blocks / s).astype(ml_dtypes.float8_e4m3fn)
    deq = (codes.astype(np.float32) * s).reshape(bo * 128, bi * 128)[:out, :inn]
    return codes.view(np.uint8).reshape(bo * 128, bi * 128)[:out, :inn].copy(), scale, deq


def quant_fp4(w: np.ndarray):
    """[out, in] -> (codes uint8 [out, in/2] low nibble = element 2k, scale uint8 [out, in/32], dequantized)."""
    out, inn = w.shape
    b = w.reshape(out, inn // 32, 32)
    amax = np.abs(b).max(-1)
    scale = (np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)).astype(np.int32) + 127).astype(np.uint8)
    q = (b / e8m0(scale)[..., None]).astype(ml_dtypes.float4_e2m1fn)
    nib = q.view(np.uint8).reshape(out, inn) & 0xF
    codes = (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8)
    deq = (FP4_VALUES[nib].reshape(out, inn // 32, 32) * e8m0(scale)[..., None]).reshape(out, inn)
    return codes, scale, deq


def bf16(x: np.ndarray):
    y = np.asarray(x, np.float32).astype(ml_dtypes.bfloat16)
    return y, y.astype(np.float32)


# ---- the HF model as the official release -----------------------------------------------------------

def _layer_pairs(i: int, ratio: int, hash_layer: bool):
    """(official name, hf name, kind) of one decoder layer; kind: fp8 | bf16 | f32 | i64."""
    o, h = f"layers.{i}.", f"model.layers.{i}."
    p = [(o + "attn_norm.weight", h + "input_layernorm.weight", "bf16"),
         (o + "ffn_norm.weight", h + "post_attention_layernorm.weight", "bf16")]
    for a, b in (("attn", "attn_hc"), ("ffn", "ffn_hc")):
        p += [(f"{o}hc_{a}_{x}", f"{h}{b}.{x}", "f32") for x in ("fn", "base", "scale")]
    p += [(o + "attn.wq_a.weight", h + "self_attn.q_a_proj.weight", "fp8"),
          (o + "attn.q_norm.weight", h + "self_attn.q_a_norm.weight", "bf16"),
          (o + "attn.wq_b.weight", h + "self_attn.q_b_proj.weight", "fp8"),
          (o + "attn.wkv.weight", h + "self_attn.kv_proj.weight", "fp8"),
          (o + "attn.kv_norm.weight", h + "self_attn.kv_norm.weight", "bf16"),
          (o + "attn.wo_a.weight", h + "self_attn.o_a_proj.weight", "fp8"),
          (o + "attn.wo_b.weight", h + "self_attn.o_b_proj.weight", "fp8"),
          (o + "attn.attn_sink", h + "self_attn.sinks", "f32")]
    if ratio:
        c, hc = o + "attn.compressor.", h + "self_attn.compressor."
        p += [(c + "wkv.weight", hc + "kv_proj.weight", "bf16"), (c + "wgate.weight", hc + "gate_proj.weight", "bf16"),
              (c + "ape", hc + "position_bias", "f32"), (c + "norm.weight", hc + "kv_norm.weight", "bf16")]
    if ratio == 4:
        x, hx = o + "attn.indexer.", h + "self_attn.compressor.indexer."
        p += [(x + "wq_b.weight", hx + "q_b_proj.weight", "fp8"),
              (x + "weights_proj.weight", hx + "scorer.weights_proj.weight", "bf16"),
              (x + "compressor.wkv.weight", hx + "kv_proj.weight", "bf16"),
              (x + "compressor.wgate.weight", hx + "gate_proj.weight", "bf16"),
              (x + "compressor.ape", hx + "position_bias", "f32"),
              (x + "compressor.norm.weight", hx + "kv_norm.weight", "bf16")]
    p += [(o + "ffn.gate.weight", h + "mlp.gate.weight", "bf16")]
    p += [(o + "ffn.gate.tid2eid", h + "mlp.gate.tid2eid", "i64")] if hash_layer else \
         [(o + "ffn.gate.bias", h + "mlp.gate.e_score_correction_bias", "f32")]
    for w, hw in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")):
        p.append((f"{o}ffn.shared_experts.{w}.weight", f"{h}mlp.shared_experts.{hw}.weight", "fp8"))
    return p


def _store(kind: str, x: np.ndarray, name: str, out: dict):
    """Write tensor `name` of `kind` into out {name: (dtype, array)}; return the dequantized value."""
    if kind == "fp8":
        c, s, deq = quant_fp8(x)
        out[name] = ("F8_E4M3", c)
        out[name[: -len(".weight")] + ".scale"] = ("F8_E8M0", s)
        return deq
    if kind == "bf16":
        y, deq = bf16(x)
        out[name] = ("BF16", y)
        return deq
    if kind == "i64":
        out[name] = ("I64", x.astype(np.int64))
        return x
    out[name] = ("F32", x.astype(np.float32))
    return x.astype(np.float32)


def _store_experts(prefix: str, gate_up: np.ndarray, down: np.ndarray, out: dict):
    """Per-expert FP4 tensors; returns dequantized (gate_up [E, 2I, D], down [E, D, I])."""
    gu, dn = np.empty_like(gate_up), np.empty_like(down)
    n_i = gate_up.shape[1] // 2
    for e in range(gate_up.shape[0]):
        for w, mat, dst in (("w1", gate_up[e, :n_i], gu[e, :n_i]), ("w3", gate_up[e, n_i:], gu[e, n_i:]),
                            ("w2", down[e], dn[e])):
            c, s, deq = quant_fp4(mat)
            out[f"{prefix}ffn.experts.{e}.{w}.weight"] = ("I8", c.view(np.int8))
            out[f"{prefix}ffn.experts.{e}.{w}.scale"] = ("F8_E8M0", s)
            dst[...] = deq
    return gu, dn


def official_tensors(sd: dict[str, np.ndarray]):
    """(tensors {name: (dtype, array)}, dequantized HF state dict)."""
    out, deq = {}, dict(sd)
    for o, h, k in (("embed.weight", "model.embed_tokens.weight", "bf16"), ("head.weight", "lm_head.weight", "bf16"),
                    ("norm.weight", "model.norm.weight", "bf16"), ("hc_head_fn", "model.hc_head.hc_fn", "f32"),
                    ("hc_head_base", "model.hc_head.hc_base", "f32"), ("hc_head_scale", "model.hc_head.hc_scale", "f32")):
        deq[h] = _store(k, sd[h], o, out)
    for i, r in enumerate(RATIOS):
        for o, h, k in _layer_pairs(i, r, i < HF_CONFIG["num_hash_layers"]):
            deq[h] = _store(k, sd[h], o, out)
        h = f"model.layers.{i}.mlp.experts."
        deq[h + "gate_up_proj"], deq[h + "down_proj"] = _store_experts(f"layers.{i}.", sd[h + "gate_up_proj"],
                                                                        sd[h + "down_proj"], out)
    return out, deq


def random_block(rng, prefix: str, out: dict, deq_out: dict | None = None):
    """A random drafter block (ratio 0, non-hash) in official names; records dequantized values by name."""
    def rnd(shape, s=None):
        return (rng.standard_normal(shape) / math.sqrt(shape[-1]) if s is None else s * rng.standard_normal(shape)
                ).astype(np.float32)
    nh, hd, ql, og, ol = HF_CONFIG["num_attention_heads"], HF_CONFIG["head_dim"], HF_CONFIG["q_lora_rank"], \
        HF_CONFIG["o_groups"], HF_CONFIG["o_lora_rank"]
    shapes = {"attn.wq_a.weight": ((ql, D), "fp8"), "attn.q_norm.weight": ((ql,), "bf16"),
              "attn.wq_b.weight": ((nh * hd, ql), "fp8"), "attn.wkv.weight": ((hd, D), "fp8"),
              "attn.kv_norm.weight": ((hd,), "bf16"), "attn.wo_a.weight": ((og * ol, nh * hd // og), "fp8"),
              "attn.wo_b.weight": ((D, og * ol), "fp8"), "attn.attn_sink": ((nh,), "f32"),
              "attn_norm.weight": ((D,), "bf16"), "ffn_norm.weight": ((D,), "bf16"),
              "ffn.gate.weight": ((E, D), "bf16"), "ffn.gate.bias": ((E,), "f32")}
    for a in ("attn", "ffn"):
        shapes.update({f"hc_{a}_fn": (((2 + HC) * HC, HC * D), "f32"), f"hc_{a}_base": (((2 + HC) * HC,), "f32"),
                       f"hc_{a}_scale": ((3,), "f32")})
    for w, s in (("w1", (I, D)), ("w2", (D, I)), ("w3", (I, D))):
        shapes[f"ffn.shared_experts.{w}.weight"] = (s, "fp8")
    deq = {}
    for n, (s, k) in shapes.items():
        deq[prefix + n] = _store(k, rnd(s, 0.5 if len(s) == 1 else None), prefix + n, out)
    gu, dn = _store_experts(prefix, rnd((E, 2 * I, D)), rnd((E, D, I)), out)
    for e in range(E):
        deq[f"{prefix}ffn.experts.{e}.w1.weight"] = gu[e, :I]
        deq[f"{prefix}ffn.experts.{e}.w3.weight"] = gu[e, I:]
        deq[f"{prefix}ffn.experts.{e}.w2.weight"] = dn[e]
    if deq_out is not None:
        deq_out.update(deq)
    return deq


def official_mtp(rng, out: dict) -> dict:
    """mtp.0.* (docs/drafter_math.md §1.1): returns {official name: dequantized value}."""
    deq = {}
    random_block(rng, "mtp.0.", out, deq)
    for n in ("e_proj", "h_proj"):
        deq[f"mtp.0.{n}.weight"] = _store("fp8", rng.standard_normal((D, D)).astype(np.float32) / 16,
                                          f"mtp.0.{n}.weight", out)
    for n in ("enorm", "hnorm", "norm"):
        deq[f"mtp.0.{n}.weight"] = _store("bf16", 1 + 0.1 * rng.standard_normal(D), f"mtp.0.{n}.weight", out)
    for n, s in (("fn", (HC, HC * D)), ("base", (HC,)), ("scale", (1,))):
        deq[f"mtp.0.hc_head_{n}"] = _store("f32", rng.standard_normal(s), f"mtp.0.hc_head_{n}", out)
    return deq


def official_dspark(rng, out: dict, rank: int = 16, stages: int = 3, bias: bool = True) -> dict:
    """mtp.{0..2}.* of the DSpark release (docs/drafter_math.md §2.2); returns {official name: dequantized value}."""
    deq = {}
    for s in range(stages):
        random_block(rng, f"mtp.{s}.", out, deq)
    last = f"mtp.{stages - 1}."
    deq["mtp.0.main_proj.weight"] = _store("fp8", rng.standard_normal((D, 3 * D)).astype(np.float32) / 28,
                                           "mtp.0.main_proj.weight", out)
    deq["mtp.0.main_norm.weight"] = _store("bf16", 1 + 0.1 * rng.standard_normal(D), "mtp.0.main_norm.weight", out)
    deq[last + "norm.weight"] = _store("bf16", 1 + 0.1 * rng.standard_normal(D), last + "norm.weight", out)
    for n, s in (("fn", (HC, HC * D)), ("base", (HC,)), ("scale", (1,))):
        deq[f"{last}hc_head_{n}"] = _store("f32", rng.standard_normal(s), f"{last}hc_head_{n}", out)
    for w in ("markov_w1", "markov_w2"):
        n = f"{last}markov_head.{w}.weight"
        deq[n] = _store("bf16", rng.standard_normal((V, rank)), n, out)
    n = f"{last}confidence_head.proj.weight"
    deq[n] = _store("bf16", rng.standard_normal((1, D + rank)) / 16, n, out)
    if bias:
        deq[f"{last}confidence_head.proj.bias"] = _store("f32", rng.standard_normal(1), f"{last}confidence_head.proj.bias", out)
    return deq


def save_safetensors(path, tensors: dict) -> None:
    """Raw safetensors writer (the safetensors package cannot write F8_E8M0 from numpy)."""
    hdr, off, blobs = {}, 0, []
    for k in sorted(tensors):
        dt, a = tensors[k]
        b = np.ascontiguousarray(a).tobytes()
        hdr[k] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        off += len(b)
        blobs.append(b)
    h = json.dumps(hdr).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def official_config(extra: dict | None = None) -> dict:
    cfg = dict(HF_CONFIG, architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", expert_dtype="fp4",
               quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                    "scale_fmt": "ue8m0", "weight_block_size": [128, 128]})
    cfg["compress_ratios"] = list(HF_CONFIG["compress_ratios"]) + [0]      # + the MTP layer
    cfg.update(extra or {})
    return cfg


def write_official(d, tensors: dict, config: dict | None) -> None:
    d.mkdir(parents=True, exist_ok=True)
    save_safetensors(d / "model-00001-of-00001.safetensors", tensors)
    if config is not None:
        (d / "config.json").write_text(json.dumps(config))


# ---- GGUF ------------------------------------------------------------------------------------------

# GGUF suffix of each official block suffix (docs/checkpoint_formats.md §1.2 table)
GGUF_SUFFIX = {
    "attn_norm.weight": "attn_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
    "hc_attn_fn": "hc_attn_fn.weight", "hc_attn_base": "hc_attn_base.weight", "hc_attn_scale": "hc_attn_scale.weight",
    "hc_ffn_fn": "hc_ffn_fn.weight", "hc_ffn_base": "hc_ffn_base.weight", "hc_ffn_scale": "hc_ffn_scale.weight",
    "attn.wq_a.weight": "attn_q_a.weight", "attn.q_norm.weight": "attn_q_a_norm.weight",
    "attn.wq_b.weight": "attn_q_b.weight", "attn.wkv.weight": "attn_kv.weight",
    "attn.kv_norm.weight": "attn_kv_a_norm.weight", "attn.wo_a.weight": "attn_output_a.weight",
    "attn.wo_b.weight": "attn_output_b.weight", "attn.attn_sink": "attn_sinks.weight",
    "attn.compressor.wkv.weight": "attn_compressor_kv.weight", "attn.compressor.wgate.weight": "attn_compressor_gate.weight",
    "attn.compressor.ape": "attn_compressor_ape.weight", "attn.compressor.norm.weight": "attn_compressor_norm.weight",
    "attn.indexer.wq_b.weight": "indexer.attn_q_b.weight", "attn.indexer.weights_proj.weight": "indexer.proj.weight",
    "attn.indexer.compressor.wkv.weight": "indexer_compressor_kv.weight",
    "attn.indexer.compressor.wgate.weight": "indexer_compressor_gate.weight",
    "attn.indexer.compressor.ape": "indexer_compressor_ape.weight",
    "attn.indexer.compressor.norm.weight": "indexer_compressor_norm.weight",
    "ffn.gate.weight": "ffn_gate_inp.weight", "ffn.gate.bias": "exp_probs_b.bias",
    "ffn.gate.tid2eid": "ffn_gate_tid2eid.weight",
    "ffn.shared_experts.w1.weight": "ffn_gate_shexp.weight", "ffn.shared_experts.w3.weight": "ffn_up_shexp.weight",
    "ffn.shared_experts.w2.weight": "ffn_down_shexp.weight",
}
# f16 scale fields (byte offsets) of the K/IQ blocks used here; values are linear in them
_SCALE_FIELDS = {T.Q2_K: (80, 82), T.Q4_K: (0, 2), T.Q6_K: (208,), T.IQ2_XXS: (0,), T.Q3_K: (108,)}


def random_kquant(rng, shape, qtype: T, std: float = 0.05):
    """Random K/IQ blocks for a [..., in] tensor, scale fields set for ~`std` values; returns (raw, dequantized)."""
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    *lead, inn = shape
    nb = int(np.prod(lead)) * inn // bs
    raw = rng.integers(0, 256, (nb, ts), dtype=np.uint8)

    def set_scale(v):
        for off in _SCALE_FIELDS[qtype]:
            raw[:, off:off + 2] = np.full((nb, 1), v, np.float16).view(np.uint8)
    set_scale(1.0)
    y = gguf.quants.dequantize(raw.reshape(*lead, inn // bs * ts), qtype)
    set_scale(np.float16(std / max(float(np.std(y)), 1e-12)))
    raw = raw.reshape(*lead, inn // bs * ts)
    return raw, np.asarray(gguf.quants.dequantize(raw, qtype), np.float32).reshape(shape)


def gguf_tensor(rng, x: np.ndarray, qtype: T):
    """(data to write, raw_dtype or None, dequantized value) of `x` stored as `qtype`."""
    x = np.asarray(x, np.float32)
    if qtype == T.F32:
        return x, None, x
    if qtype == T.F16:
        y = x.astype(np.float16)
        return y, None, y.astype(np.float32)
    if qtype in (T.BF16, T.Q8_0, T.MXFP4):
        q = gguf.quants.quantize(x, qtype)
        return q, qtype, np.asarray(gguf.quants.dequantize(q, qtype), np.float32).reshape(x.shape)
    raw, deq = random_kquant(rng, x.shape, qtype, std=float(np.std(x)) or 0.05)
    return raw, qtype, deq


def write_gguf_keys(w: gguf.GGUFWriter, arch: str = "deepseek4", n_blocks: int = 3, nextn: int = 0) -> None:
    c, a = HF_CONFIG, arch + "."
    w.add_uint32(a + "block_count", n_blocks)
    w.add_uint32(a + "context_length", c["max_position_embeddings"])
    w.add_uint32(a + "embedding_length", D)
    w.add_uint32(a + "vocab_size", V)
    w.add_uint32(a + "attention.head_count", c["num_attention_heads"])
    w.add_uint32(a + "attention.head_count_kv", 1)
    w.add_uint32(a + "attention.key_length", c["head_dim"])
    w.add_uint32(a + "attention.value_length", c["head_dim"])
    w.add_float32(a + "attention.layer_norm_rms_epsilon", c["rms_norm_eps"])
    w.add_uint32(a + "attention.q_lora_rank", c["q_lora_rank"])
    w.add_uint32(a + "attention.sliding_window", c["sliding_window"])
    w.add_uint32(a + "attention.output_group_count", c["o_groups"])
    w.add_uint32(a + "attention.output_lora_rank", c["o_lora_rank"])
    w.add_array(a + "attention.compress_ratios", RATIOS + [0] * nextn)
    w.add_float32(a + "attention.compress_rope_freq_base", c["compress_rope_theta"])
    w.add_uint32(a + "attention.indexer.head_count", c["index_n_heads"])
    w.add_uint32(a + "attention.indexer.key_length", c["index_head_dim"])
    w.add_uint32(a + "attention.indexer.top_k", c["index_topk"])
    w.add_uint32(a + "rope.dimension_count", c["qk_rope_head_dim"])
    w.add_float32(a + "rope.freq_base", c["rope_theta"])
    rs = c["rope_scaling"]
    w.add_string(a + "rope.scaling.type", "yarn")
    w.add_float32(a + "rope.scaling.factor", rs["factor"])
    w.add_uint32(a + "rope.scaling.original_context_length", rs["original_max_position_embeddings"])
    w.add_float32(a + "rope.scaling.yarn_beta_fast", rs["beta_fast"])
    w.add_float32(a + "rope.scaling.yarn_beta_slow", rs["beta_slow"])
    w.add_uint32(a + "expert_count", E)
    w.add_uint32(a + "expert_used_count", c["num_experts_per_tok"])
    w.add_uint32(a + "expert_shared_count", 1)
    w.add_uint32(a + "expert_feed_forward_length", I)
    w.add_float32(a + "expert_weights_scale", c["routed_scaling_factor"])
    w.add_bool(a + "expert_weights_norm", True)
    w.add_uint32(a + "expert_gating_func", 4)
    w.add_array(a + "swiglu_clamp_exp", [float(c["swiglu_limit"])] * (n_blocks))
    w.add_uint32(a + "hash_layer_count", c["num_hash_layers"])
    w.add_uint32(a + "hyper_connection.count", HC)
    w.add_uint32(a + "hyper_connection.sinkhorn_iterations", c["hc_sinkhorn_iters"])
    w.add_float32(a + "hyper_connection.epsilon", c["hc_eps"])
    if nextn:
        w.add_uint32(a + "nextn_predict_layers", nextn)
    w.add_uint32("tokenizer.ggml.bos_token_id", 0)
    w.add_uint32("tokenizer.ggml.eos_token_id", 1)


# GGUF types per tensor role (docs/checkpoint_formats.md §1.2): llama.cpp converter defaults plus K-quants, and ds4
LLAMACPP_TYPES = {"fp8": T.Q8_0, "bf16": T.BF16, "f32": T.F32, "embed": T.BF16, "exps_gate_up": T.MXFP4,
                  "exps_down": T.Q6_K, "shexp_gate_up": T.Q4_K}
DS4_TYPES = {"fp8": T.Q8_0, "bf16": T.F16, "f32": T.F32, "embed": T.F16, "exps_gate_up": T.IQ2_XXS,
             "exps_down": T.Q2_K, "shexp_gate_up": T.Q8_0}


def gguf_tensors(rng, sd: dict[str, np.ndarray], types: dict) -> tuple[dict, dict]:
    """({gguf name: (data, raw_dtype)}, dequantized HF state dict) of the target model."""
    out, deq = {}, dict(sd)

    def put(gname, hname, role, x=None):
        kind = role
        x = sd[hname] if x is None else x
        if role == "bf16" and x.ndim == 1:
            kind = "f32"                           # 1-D bf16 -> F32 (LCPP tensor_force_quant)
        data, raw, d = gguf_tensor(rng, x, types.get(kind, T.F32))
        out[gname] = (data, raw)
        return d

    for g, h, role in (("token_embd.weight", "model.embed_tokens.weight", "embed"),
                       ("output.weight", "lm_head.weight", "embed"), ("output_norm.weight", "model.norm.weight", "f32"),
                       ("output_hc_fn.weight", "model.hc_head.hc_fn", "f32"),
                       ("output_hc_base.weight", "model.hc_head.hc_base", "f32"),
                       ("output_hc_scale.weight", "model.hc_head.hc_scale", "f32")):
        deq[h] = put(g, h, role)
    for i, r in enumerate(RATIOS):
        for o, h, kind in _layer_pairs(i, r, i < HF_CONFIG["num_hash_layers"]):
            g = f"blk.{i}." + GGUF_SUFFIX[o[len(f"layers.{i}."):]]
            if kind == "i64":
                out[g] = (sd[h].astype(np.int32), None)
                continue
            role = "shexp_gate_up" if ("shared_experts.gate_proj" in h or "shared_experts.up_proj" in h) else kind
            deq[h] = put(g, h, role)
        h = f"model.layers.{i}.mlp.experts."
        gu = sd[h + "gate_up_proj"]
        d1 = put(f"blk.{i}.ffn_gate_exps.weight", None, "exps_gate_up", gu[:, :I])
        d3 = put(f"blk.{i}.ffn_up_exps.weight", None, "exps_gate_up", gu[:, I:])
        deq[h + "gate_up_proj"] = np.concatenate([d1, d3], axis=1)
        deq[h + "down_proj"] = put(f"blk.{i}.ffn_down_exps.weight", None, "exps_down", sd[h + "down_proj"])
    return out, deq


def write_gguf(path, tensors: dict, arch: str = "deepseek4", n_blocks: int = 3, nextn: int = 0,
               extra_keys=None, split_max_tensors: int = 0) -> None:
    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    if arch == "deepseek4" or arch == "dflash":
        write_gguf_keys(w, arch, n_blocks, nextn)
    for fn in extra_keys or ():
        fn(w)
    for name, (data, raw) in tensors.items():
        if raw is None:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gguf_block_from_official(rng, official: dict, prefix_in: str, prefix_out: str, types: dict,
                             out: dict) -> dict:
    """Re-store an official-named drafter block (dequantized values) under GGUF names; returns {gguf name: deq}."""
    deq = {}
    for suffix, g in GGUF_SUFFIX.items():
        n = prefix_in + suffix
        if n not in official:
            continue
        x = official[n]
        kind = "f32" if x.ndim == 1 or suffix.startswith("hc_") or suffix.endswith(("ape", "attn_sink")) else \
            ("fp8" if suffix.startswith(("attn.w", "ffn.shared")) else "bf16")
        data, raw, d = gguf_tensor(rng, x, types[kind] if kind != "fp8" else T.Q8_0)
        out[prefix_out + g] = (data, raw)
        deq[prefix_out + g] = d
    for w, g in (("w1", "ffn_gate_exps"), ("w3", "ffn_up_exps"), ("w2", "ffn_down_exps")):
        x = np.stack([official[f"{prefix_in}ffn.experts.{e}.{w}.weight"] for e in range(E)])
        data, raw, d = gguf_tensor(rng, x, T.MXFP4)
        out[f"{prefix_out}{g}.weight"] = (data, raw)
        deq[f"{prefix_out}{g}.weight"] = d
    return deq
