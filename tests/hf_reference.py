"""Test helper: tiny random Hugging Face `DeepseekV4ForCausalLM` models (PyTorch, CPU, float32).

HF's own init is degenerate (zero sinks / biases / HC bases, tid2eid all 0), so every weight is
re-drawn: norms ~ 1 ± 0.1, embedding ~ N(0,1), matrices ~ N(0, 1/fan_in), vectors ~ N(0, 0.5),
HC scales ~ U(0.5, 1.5), router bias ~ N(0, 0.1), tid2eid distinct random experts per token.
"""
from __future__ import annotations

import math

import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

BASE = dict(
    vocab_size=97, hidden_size=64, moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=1,
    head_dim=32, qk_rope_head_dim=8, q_lora_rank=24, o_groups=2, o_lora_rank=16, num_experts_per_tok=2,
    n_routed_experts=8, n_shared_experts=1, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5,
    norm_topk_prob=True, sliding_window=6, index_n_heads=8, index_head_dim=16, index_topk=3, hc_mult=4,
    hc_sinkhorn_iters=20, hc_eps=1e-6, swiglu_limit=10.0, rms_norm_eps=1e-6, rope_theta=10000.0,
    compress_rope_theta=160000.0,
    rope_scaling=dict(type="yarn", factor=16, beta_fast=32, beta_slow=1, original_max_position_embeddings=16),
    max_position_embeddings=4096, num_nextn_predict_layers=1, tie_word_embeddings=False, bos_token_id=0,
    eos_token_id=1,
)

FLASH_RATIOS = [0, 0] + [4, 128] * 20 + [4]

# DeepSeek-V4-Flash config.json in DeepSeek's legacy form (values of docs/model_math.md §1).
FLASH_LEGACY = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
    "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64,
    "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8,
    "o_lora_rank": 1024, "sliding_window": 128, "compress_ratios": FLASH_RATIOS + [0], "index_n_heads": 64,
    "index_head_dim": 128, "index_topk": 512, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "n_routed_experts": 256, "num_experts_per_tok": 6, "n_shared_experts": 1, "moe_intermediate_size": 2048,
    "num_hash_layers": 3, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
    "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "rope_theta": 10000, "compress_rope_theta": 160000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                     "beta_slow": 1},
    "max_position_embeddings": 1048576, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
    "attention_bias": False, "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1,
    "num_nextn_predict_layers": 1,
}

# Configs that between them cover: sliding-only layers, CSA with a selecting indexer, HCA, hash
# layers, hc_mult 4 and 2, top-1 routing, sequences much longer than the window spanning many
# compression windows.
CONFIGS = {
    # the shape of the spec's verified recipe (docs/model_math.md §5): SWA, SWA, CSA, HCA(8), CSA
    "swa_csa_hca": dict(BASE, num_hidden_layers=5, compress_ratios=[0, 0, 4, 128, 4], num_hash_layers=2,
                        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}),
    # Flash's schedule in miniature (3 hash layers, repeated HCA/CSA pairs -> a scanned segment)
    "flash_like": dict(BASE, num_hidden_layers=9, compress_ratios=[0, 0, 4] + [128, 4] * 3, num_hash_layers=3,
                       compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
                       sliding_window=8, index_topk=4),
    # transformers form (layer_types), other widths: HCA first, more experts/heads, bigger indexer
    "wide_hca_first": dict(
        {k: v for k, v in BASE.items() if k != "rope_scaling"},
        num_hidden_layers=4, hidden_size=96, num_attention_heads=8, head_dim=64, qk_rope_head_dim=16,
        q_lora_rank=40, o_groups=4, o_lora_rank=24, n_routed_experts=16, num_experts_per_tok=3,
        moe_intermediate_size=24, index_n_heads=12, index_head_dim=32, index_topk=5, sliding_window=10,
        layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention",
                     "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        rope_parameters={"main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
                         "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 8.0, "beta_fast": 32,
                                      "beta_slow": 1, "original_max_position_embeddings": 32,
                                      "partial_rotary_factor": 0.25, "attention_factor": 1.0}},
        routed_scaling_factor=2.5),
    # Flash's attention regime exactly at a tiny width (`dsv4_jax.config.tiny_long`): window 128, CSA 4 with
    # index_topk 512, HCA 128, RoPE dim 64 with Flash's thetas and YaRN (long-context parity, 4K+ tokens)
    "tiny_long": dict(
        {k: v for k, v in BASE.items() if k != "rope_scaling"},
        num_hidden_layers=7, compress_ratios=[0, 0, 4, 128, 4, 128, 4], num_hash_layers=3,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        head_dim=96, qk_rope_head_dim=64, sliding_window=128, index_n_heads=16, index_head_dim=96, index_topk=512,
        max_position_embeddings=1048576,
        rope_scaling=dict(type="yarn", factor=16, beta_fast=32, beta_slow=1, original_max_position_embeddings=65536)),
    # off Flash's values: 2 HC streams, fewer Sinkhorn iterations, top-1 of 4 experts, index_topk 1
    "two_streams_top1": dict(BASE, num_hidden_layers=4, compress_ratios=[0, 4, 128, 4], num_hash_layers=1,
                             compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
                             hc_mult=2, hc_sinkhorn_iters=7, n_routed_experts=4, num_experts_per_tok=1,
                             index_topk=1, sliding_window=5),
}


def randomize(model, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith(".scale") or name.endswith("hc_scale"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            elif p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
            else:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                rows = [torch.randperm(cfg.n_routed_experts, generator=g)[: cfg.num_experts_per_tok]
                        for _ in range(b.shape[0])]
                b.copy_(torch.stack(rows))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def build(name: str, seed: int = 0):
    cfg = DeepseekV4Config(**CONFIGS[name])
    cfg._attn_implementation = "eager"
    model = DeepseekV4ForCausalLM(cfg).eval()
    randomize(model, seed)
    return model


def logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(ids), use_cache=False).logits


def topk_boundary_gaps(model, ids) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's logits and, per CSA layer, query and batch row, the gap between the indexer's index_topk-th and
    next-best valid scores relative to the best one: (logits [B,S,V], gaps float64 [n_csa, B, S]; inf where a
    query sees ≤ index_topk rows). A gap of 0 is a tie (order undefined); a small one a near-tie, whose order
    ulp-level differences decide."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as M
    seen = []
    orig = M.DeepseekV4IndexerScorer.forward

    def hook(self, q, ckv, h):
        r = orig(self, q, ckv, h)
        seen.append(r.detach())
        return r

    M.DeepseekV4IndexerScorer.forward = hook
    try:
        out = logits(model, ids)
    finally:
        M.DeepseekV4IndexerScorer.forward = orig
    k, m = model.config.index_topk, model.config.compress_rates["compressed_sparse_attention"]
    gaps = []
    for sc in seen:                                      # [B, S, T]
        sc = sc.double()
        B, S, T = sc.shape
        n_valid = torch.clamp((torch.arange(S) + 1) // m, max=T)                  # [S]
        valid = torch.arange(T)[None, :] < n_valid[:, None]                        # [S, T]
        if T <= k:
            gaps.append(torch.full((B, S), math.inf, dtype=torch.float64))
            continue
        top = sc.masked_fill(~valid[None], -math.inf).topk(k + 1, dim=-1).values  # [B, S, k+1]
        g = (top[..., k - 1] - top[..., k]) / top[..., 0].abs().clamp_min(1e-30)
        gaps.append(torch.where((n_valid > k)[None, :], g, torch.full_like(g, math.inf)))
    return out, torch.stack(gaps)


def count_topk_boundary_ties(model, ids) -> int:
    """Queries whose k-th and (k+1)-th best valid indexer scores are exactly equal (tie order is undefined)."""
    return int((topk_boundary_gaps(model, ids)[1] == 0).sum())


def save(model, path) -> None:
    # transformers 5.23's default save rewrites names (model. prefix, attn.kv_norm -> attn.norm)
    model.save_pretrained(path, save_original_format=False)
