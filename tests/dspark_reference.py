"""An independent full-recompute DSpark proposal in PyTorch (float64), from docs/drafter_math.md §2.3.

Shares no code with dsv4_jax. Every call recomputes the context features and keys of all
committed positions from the target taps, then the block, the serial Markov head and the
confidence head. Context visibility is query-relative: key k visible to block row j iff
(a+j) − W < k < a; the block attends to itself bidirectionally.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .mtp_reference import T, hc, moe, rms, rope


def _attention(h, ctx_c, p, cfg, a, g):
    H, d, r, W = cfg.num_heads, cfg.head_dim, cfg.rope_head_dim, cfg.sliding_window
    pos = torch.arange(a, a + g)
    qr = rms(h @ T(p["wq_a"]).T, p["q_norm"])
    q = rope(rms((qr @ T(p["wq_b"]).T).reshape(g, H, d)), pos, cfg.rope_theta, r)
    blk = rope(rms(h @ T(p["wkv"]).T, p["kv_norm"]), pos, cfg.rope_theta, r)
    ctx = rope(rms(ctx_c @ T(p["wkv"]).T, p["kv_norm"]), torch.arange(a), cfg.rope_theta, r)   # no attn_norm
    keys = torch.cat([ctx, blk], 0)
    kpos = torch.arange(a)
    vis_ctx = kpos[None, :] > pos[:, None] - W                                  # [g, a]
    vis = torch.cat([vis_ctx, torch.ones(g, g, dtype=torch.bool)], 1)
    lg = torch.einsum("ihd,jd->ihj", q, keys) / math.sqrt(d)
    lg = lg.masked_fill(~vis[:, None, :], float("-inf"))
    sink = T(p["attn_sink"])[None, :, None].expand(g, H, 1)
    pr = torch.softmax(torch.cat([lg, sink], -1), -1)[..., :-1]
    o = rope(torch.einsum("ihj,jd->ihd", pr, keys), pos, cfg.rope_theta, r, inverse=True)
    G, R = cfg.o_groups, cfg.o_lora_rank
    u = torch.einsum("lgi,gri->lgr", o.reshape(g, G, -1), T(p["wo_a"]).reshape(G, R, -1)).reshape(g, -1)
    return u @ T(p["wo_b"]).T


def propose(dp, embed, head, cfg, taps, anchor_tok, block_size, noise_id, k, threshold, rule="per-position"):
    """taps [a, n_taps, D] of committed positions 0..a−1; the anchor sits at position a.

    Returns (greedy drafts [k], Markov-biased logits [k, V], confidences [k], drafts kept).
    """
    a = taps.shape[0]
    c = rms(T(taps).reshape(a, -1) @ T(dp["main_proj"]).T, dp["main_norm"])
    toks = [anchor_tok] + [noise_id] * (block_size - 1)
    X = T(embed)[torch.as_tensor(toks)][:, None, :].repeat(1, cfg.hc_mult, 1)
    for st in dp["stages"]:
        pre, post, C = hc(X, st["hc_attn"], cfg)
        h = rms((pre[..., None] * X).sum(1), st["attn_norm"])
        X = post[..., None] * _attention(h, c, st["attn"], cfg, a, block_size)[:, None] \
            + torch.einsum("ljk,ljd->lkd", C, X)
        pre, post, C = hc(X, st["hc_ffn"], cfg)
        h = rms((pre[..., None] * X).sum(1), st["ffn_norm"])
        X = post[..., None] * moe(h, st["ffn"], cfg)[:, None] + torch.einsum("ljk,ljd->lkd", C, X)
    hh = dp["hc_head"]
    pre = torch.sigmoid((rms(X.flatten(-2)) @ T(hh["fn"]).T) * T(hh["scale"])[0] + T(hh["base"])) + cfg.hc_eps
    y = (pre[..., None] * X).sum(1)
    U = rms(y, dp["norm"]) @ T(head).T
    w1, w2, w = T(dp["markov_w1"]), T(dp["markov_w2"]), T(dp["conf_proj"]["weight"])[0]
    prev, drafts, logits, conf = anchor_tok, [], [], []
    for j in range(k):
        e = w1[prev]
        lg = U[j] + w2 @ e
        z = torch.cat([y[j], e]) @ w
        if "bias" in dp["conf_proj"]:
            z = z + T(dp["conf_proj"]["bias"])[0]
        conf.append(float(torch.sigmoid(z)))
        prev = int(lg.argmax())
        drafts.append(prev), logits.append(lg.numpy())
    score = np.array(conf) if rule == "per-position" else np.cumprod(conf)
    kept = 0
    while kept < k and score[kept] >= threshold:
        kept += 1
    return drafts, np.stack(logits), np.array(conf), kept
