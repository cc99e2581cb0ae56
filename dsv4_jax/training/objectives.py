"""Training objectives: target LM, MTP and DSpark drafters against a frozen target."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from ..model.state import EMPTY, WindowRing, init_state
from ..config import ModelConfig
from ..model.decode import process_block
from ..drafters import dspark
from ..drafters.common import block_config
from ..model.layers import hyper
from ..model.layers.attention import project_kv
from ..model.layers.block import layer_sequence
from ..model.layers.norms import rms_norm
from ..model.layers.rope import inv_freq
from ..model.target import head, hidden_states


def target_loss(params: dict, config: ModelConfig, tokens: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy. tokens [B,L]."""
    logits = head(params, config, hidden_states(params, config, tokens[:, :-1]))
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens[:, 1:]).mean()


def frozen_target(params: dict, config: ModelConfig, tokens: jax.Array, taps: tuple[int, ...] = ()):
    """(last-layer streams [B,L,n,D], logits [B,L,V], taps [B,L,len(taps),D]) of the frozen target."""
    B, L = tokens.shape
    st = init_state(config, B, L, 1, params["embed"].dtype)
    logits, _, aux = process_block(params, config, st, tokens, jnp.full((B,), L, jnp.int32), taps)
    return jax.lax.stop_gradient((aux["hidden"], logits.astype(jnp.float32), aux["taps"]))


def mtp_logits(mtp: dict, target: dict, config: ModelConfig, S: jax.Array, nxt: jax.Array) -> jax.Array:
    """Full-sequence MTP rows (S_i, x_{i+1}) -> logits [B,L,V] for x_{i+2}."""
    eps = config.rms_norm_eps
    B, L = nxt.shape
    e = rms_norm(target["embed"][nxt], mtp["enorm"], eps) @ mtp["e_proj"].T
    X0 = rms_norm(S, mtp["hnorm"], eps) @ mtp["h_proj"].T + e[:, :, None, :]
    positions = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    X1 = layer_sequence(X0, mtp, block_config(config), 0, nxt, positions)
    y = rms_norm(hyper.hc_head(X1, mtp["hc_head"], config), mtp["norm"], eps)
    return (y @ target["head"].T).astype(jnp.float32)


def mtp_loss(mtp: dict, target: dict, config: ModelConfig, tokens: jax.Array, S, t_logits):
    """Cross-entropy of MTP row i to the target's greedy token at position i+1 (distillation). -> (loss, acc)."""
    lg = mtp_logits(mtp, target, config, S[:, :-1], tokens[:, 1:])          # rows 0..L-2
    label = jnp.argmax(t_logits[:, 1:], axis=-1)
    ce = optax.softmax_cross_entropy_with_integer_labels(lg, label).mean()
    return ce, jnp.mean(jnp.argmax(lg, -1) == label)


def position_weights(block: int, decay: float) -> jax.Array:
    """w_j = exp(−j / decay): early block positions matter most (a draft is only used if its prefix is)."""
    return jnp.exp(-jnp.arange(block, dtype=jnp.float32) / decay)


def block_rows(x: jax.Array, anchors: jax.Array, block: int) -> jax.Array:
    """Rows a..a+block−1 of every anchor a: x [B,L,...], anchors [B,A] -> [B·A, block, ...]."""
    B, A = anchors.shape
    rows = (anchors[..., None] + jnp.arange(block, dtype=jnp.int32)).reshape(B, A * block)
    return jax.vmap(lambda v, i: v[i])(x, rows).reshape((B * A, block) + x.shape[2:])


def dspark_loss(dp: dict, target: dict, config: ModelConfig, dcfg, tokens, taps, t_logits, anchors, *,
                decay: float = 4.0, w_tv: float = 1.0, w_conf: float = 0.2):
    """DSpark objective with the target's logits at every position, t_logits [B,L,V] (see dspark_block_loss)."""
    return dspark_block_loss(dp, target, config, dcfg, tokens, taps, block_rows(t_logits, anchors, dcfg.block_size),
                             anchors, decay=decay, w_tv=w_tv, w_conf=w_conf)


def dspark_block_loss(dp: dict, target: dict, config: ModelConfig, dcfg, tokens, taps, p_logits, anchors, *,
                      decay: float = 4.0, w_tv: float = 1.0, w_conf: float = 0.2):
    """DSpark objective on blocks anchored at `anchors` [B,A] (teacher-forced Markov inputs).

    tokens [B,L], taps [B,L,n_taps,D]; p_logits [B·A, g, V]: the target's logits at rows a..a+g−1 of
    each anchor (`block_rows`), so only the rows the loss reads need the target's head.
    Per block position j: CE of the Markov-biased logits ℓ_j to the target's greedy token at a+j,
    plus w_tv · TV(softmax ℓ_j, p_j), plus w_conf · BCE(c_j, 1[argmax ℓ_j == argmax p_j]) — the
    measured (greedy, conditional) acceptance — all weighted by exp(−j/decay).
    Returns (loss, metrics).
    """
    B, L = tokens.shape
    A = anchors.shape[1]
    g, W = dcfg.block_size, config.sliding_window
    c = dspark.context_features(dp, config, taps)                                       # [B,L,D]
    pos = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    win = anchors[..., None] - W + jnp.arange(W, dtype=jnp.int32)                       # [B,A,W] positions
    safe = jnp.clip(win, 0, L - 1)
    take = jax.vmap(lambda x, i: x[i])                                                  # per batch row
    kvs = []
    for stage in dp["stages"]:
        kv = project_kv(c, stage["attn"], config, pos, inv_freq(config, "main"))       # [B,L,d]
        kvs.append(take(kv, safe.reshape(B, -1)).reshape(B * A, W, -1))
    ctx_pos = jnp.where(win >= 0, win, EMPTY).reshape(B * A, W)
    st = dspark.DSparkState(ctx=WindowRing(kv=jnp.stack(kvs),
                                           pos=jnp.broadcast_to(ctx_pos, (len(kvs),) + ctx_pos.shape)))
    a = anchors.reshape(-1)
    y, U = dspark.block_outputs(dp, target, config, dcfg, st, a, take(tokens, anchors).reshape(-1))
    prev = block_rows(tokens, anchors, g)                                               # x_{a+j} [BA,g]
    p_logits = p_logits.astype(jnp.float32)
    e = dp["markov_w1"][prev]                                                           # [BA,g,R]
    ell = U + (e @ dp["markov_w2"].T).astype(jnp.float32)
    p = jax.nn.softmax(p_logits, -1)
    label = jnp.argmax(p_logits, -1)
    ce = optax.softmax_cross_entropy_with_integer_labels(ell, label)                    # [BA,g]
    tv = 0.5 * jnp.abs(jax.nn.softmax(ell, -1) - p).sum(-1)
    hit = (jnp.argmax(ell, -1) == label).astype(jnp.float32)
    wconf = dp["conf_proj"]["weight"].astype(jnp.float32)[0]
    z = jnp.concatenate([y.astype(jnp.float32), e.astype(jnp.float32)], -1) @ wconf
    if "bias" in dp["conf_proj"]:
        z = z + dp["conf_proj"]["bias"][0]
    bce = optax.sigmoid_binary_cross_entropy(z, jax.lax.stop_gradient(hit))
    w = position_weights(g, decay)
    loss = ((ce + w_tv * tv + w_conf * bce) * w).sum(-1).mean() / w.sum()
    return loss, {"acc": hit.mean(0), "tv": tv.mean(), "bce": bce.mean()}
