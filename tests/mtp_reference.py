"""An independent full-recompute MTP drafter in PyTorch (float64), written from docs/drafter_math.md §0–§1.

Shares no code with dsv4_jax: it reads the parameter dicts by key and recomputes every row from
scratch (no cache), with the sliding window i − W < j ≤ i, sinks, the interleaved main RoPE,
mHC with Sinkhorn, and the score-routed MoE with clamped SwiGLU.
"""
from __future__ import annotations

import math

import numpy as np
import torch

T = lambda a: torch.as_tensor(np.asarray(a, dtype=np.float64))


def rms(x, w=None, eps=1e-6):
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y if w is None else y * T(w)


def rope(x, pos, theta, r, inverse=False):
    """Interleaved pairs on the trailing r channels; x [L, ..., d], pos [L]."""
    f = 1.0 / theta ** (torch.arange(0, r, 2, dtype=torch.float64) / r)
    ang = pos.double()[:, None] * f[None, :]
    ang = ang.reshape((ang.shape[0],) + (1,) * (x.dim() - 2) + (r // 2,))
    c, s = ang.cos(), ang.sin() * (-1 if inverse else 1)
    a, b = x[..., -r::2], x[..., -r + 1::2]
    rot = torch.stack([a * c - b * s, a * s + b * c], -1).flatten(-2)
    return torch.cat([x[..., :-r], rot], -1)


def hc(X, p, cfg):
    n = cfg.hc_mult
    mu = rms(X.flatten(-2)) @ T(p["fn"]).T
    sc, base = T(p["scale"]), T(p["base"])
    pre = torch.sigmoid(mu[..., :n] * sc[0] + base[:n]) + cfg.hc_eps
    post = 2 * torch.sigmoid(mu[..., n:2 * n] * sc[1] + base[n:2 * n])
    C = torch.softmax((mu[..., 2 * n:] * sc[2] + base[2 * n:]).reshape(-1, n, n), -1) + cfg.hc_eps
    C = C / (C.sum(-2, keepdim=True) + cfg.hc_eps)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        C = C / (C.sum(-1, keepdim=True) + cfg.hc_eps)
        C = C / (C.sum(-2, keepdim=True) + cfg.hc_eps)
    return pre, post, C


def swiglu(x, w1, w3, w2, lim):
    g = (x @ T(w1).T).clamp(max=lim)
    u = (x @ T(w3).T).clamp(-lim, lim)
    return (torch.nn.functional.silu(g) * u) @ T(w2).T


def swa_attention(h, p, cfg, pos):
    L, H, d, r = h.shape[0], cfg.num_heads, cfg.head_dim, cfg.rope_head_dim
    qr = rms(h @ T(p["wq_a"]).T, p["q_norm"])
    q = rope(rms((qr @ T(p["wq_b"]).T).reshape(L, H, d)), pos, cfg.rope_theta, r)
    kv = rope(rms(h @ T(p["wkv"]).T, p["kv_norm"]), pos, cfg.rope_theta, r)
    lg = torch.einsum("ihd,jd->ihj", q, kv) / math.sqrt(d)
    i, j = pos[:, None], pos[None, :]
    ok = (j <= i) & (j > i - cfg.sliding_window)
    lg = lg.masked_fill(~ok[:, None, :], float("-inf"))
    sink = T(p["attn_sink"])[None, :, None].expand(L, H, 1)
    pr = torch.softmax(torch.cat([lg, sink], -1), -1)[..., :-1]
    o = rope(torch.einsum("ihj,jd->ihd", pr, kv), pos, cfg.rope_theta, r, inverse=True)
    G, R = cfg.o_groups, cfg.o_lora_rank
    wa = T(p["wo_a"]).reshape(G, R, -1)
    u = torch.einsum("lgi,gri->lgr", o.reshape(L, G, -1), wa).reshape(L, -1)
    return u @ T(p["wo_b"]).T


def moe(h, p, cfg):
    s = torch.sqrt(torch.nn.functional.softplus(h @ T(p["gate"]["weight"]).T))
    idx = (s + T(p["gate"]["bias"])).topk(cfg.num_experts_per_tok, -1).indices
    w = s.gather(1, idx)
    w = w / w.sum(-1, keepdim=True) * cfg.routed_scaling_factor
    e = p["experts"]
    y = torch.zeros_like(h)
    for t in range(h.shape[0]):
        for a in range(idx.shape[1]):
            ex = int(idx[t, a])
            y[t] += w[t, a] * swiglu(h[t], e["w1"][ex], e["w3"][ex], e["w2"][ex], cfg.swiglu_limit)
    sh = p["shared_experts"]
    return y + swiglu(h, sh["w1"], sh["w3"], sh["w2"], cfg.swiglu_limit)


def swa_block(X, p, cfg, pos):
    pre, post, C = hc(X, p["hc_attn"], cfg)
    h = rms((pre[..., None] * X).sum(1), p["attn_norm"])
    X = post[..., None] * swa_attention(h, p["attn"], cfg, pos)[:, None] + torch.einsum("ljk,ljd->lkd", C, X)
    pre, post, C = hc(X, p["hc_ffn"], cfg)
    h = rms((pre[..., None] * X).sum(1), p["ffn_norm"])
    return post[..., None] * moe(h, p["ffn"], cfg)[:, None] + torch.einsum("ljk,ljd->lkd", C, X)


def mtp_rows(m, embed, head, cfg, S, nxt):
    """All rows from scratch: S [L,n,D] (target streams), nxt [L] (token after each) -> (X1, logits)."""
    S = T(S)
    e = rms(T(embed)[torch.as_tensor(nxt)], m["enorm"]) @ T(m["e_proj"]).T
    h = rms(S, m["hnorm"]) @ T(m["h_proj"]).T
    X1 = swa_block(h + e[:, None], m, cfg, torch.arange(S.shape[0]))
    pre = torch.sigmoid((rms(X1.flatten(-2)) @ T(m["hc_head"]["fn"]).T) * T(m["hc_head"]["scale"])[0]
                        + T(m["hc_head"]["base"])) + cfg.hc_eps
    y = rms((pre[..., None] * X1).sum(1), m["norm"])
    return X1, y @ T(head).T


def greedy_chain(m, embed, head, cfg, S, nxt, k):
    """Drafts d_1..d_k after the committed rows (S_i, x_{i+1}), i < L, by recomputing every row each step."""
    S, nxt = list(np.asarray(S, np.float64)), list(nxt)
    drafts, logits_out = [], []
    for _ in range(k):
        X1, lg = mtp_rows(m, embed, head, cfg, np.stack(S), nxt)
        d = int(lg[-1].argmax())
        drafts.append(d), logits_out.append(lg[-1].numpy())
        S.append(X1[-1].numpy())          # the chain row takes the previous row's output streams
        nxt.append(d)
    return drafts, np.stack(logits_out)
