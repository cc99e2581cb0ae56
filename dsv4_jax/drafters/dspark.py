"""The DSpark block drafter (docs/drafter_math.md §2), as released for DeepSeek-V4-Flash.

Per committed target position p: taps T_p = concat over tap layers of the mean over HC streams of
the layer's output; c_p = RMSNorm_main_norm(main_proj · T_p); each stage s keeps context keys
K_s(p) = RoPE_p(RMSNorm_kv_s(W_kv_s · c_p)) (no attn_norm, no hc_pre) in a position-indexed window
ring. A round: the block [anchor, noise × (γ−1)] at positions a..a+γ−1 runs through the stages
(full V4 blocks: mHC, attention with sinks, MoE), attending bidirectionally inside the block and
to the context window; the DSpark hc_head gives y_j, base logits U_j = head(RMSNorm(y_j)). A serial
Markov head adds W2·W1[prev] to U_j (prev_0 = anchor, then the previous draft) and a confidence
head c_j = sigmoid(w·[y_j; W1[prev_j]] (+ b)) decides how many drafts are verified.

Decisions on docs/drafter_math.md §8 (documented in docs/drafters.md):
  * context visibility: query-relative by default (key k visible to block row j iff
    (a+j) − W < k < a, as llama.cpp and vLLM serve it); `context="anchor"` gives NeMo's training
    mask a − W ≤ k < a.
  * confidence input: the pre-norm hc_head output y_j (released checkpoints); a bias only when the
    checkpoint has one.
  * threshold rule: "per-position" (DeepSpec: stop at the first c_j < τ) or "cumulative"
    (stop when Π_{i≤j} c_i < τ); τ = 0 proposes the whole block (up to draft_n_max).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from ..model.state import EMPTY, Span, WindowRing
from ..config import ModelConfig
from ..model.layers import hyper
from ..model.layers.attention import attend, grouped_output, project_kv, project_q, push_window
from ..model.layers.block import ffn_sublayer
from ..model.layers.norms import rms_norm
from ..model.layers.rope import apply_rope, inv_freq
from ..ops.linear import embed, linear
from .base import Bound, DraftSetup, Drafter, Knobs, dynamic
from .common import block_config, draw

RULES = ("per-position", "cumulative")
CONTEXTS = ("query", "anchor")


@dataclasses.dataclass(frozen=True)
class DSparkConfig:
    """Static DSpark settings (docs/drafter_math.md §2.1)."""

    block_size: int = 5
    noise_token_id: int = 128799
    target_layer_ids: tuple[int, ...] = (40, 41, 42)
    confidence_rule: str = "per-position"
    context: str = "query"

    def __post_init__(self):
        if self.block_size < 1:
            raise ValueError(f"DSpark block_size must be >= 1, got {self.block_size}")
        if self.confidence_rule not in RULES:
            raise ValueError(f"confidence_rule must be one of {RULES}, got {self.confidence_rule!r}")
        if self.context not in CONTEXTS:
            raise ValueError(f"context must be one of {CONTEXTS}, got {self.context!r}")


def resolve(config: ModelConfig, dparams: dict, meta=None) -> DSparkConfig:
    """A DSparkConfig from a DSparkConfig, a checkpoint's DSparkMeta, or defaults fitted to the weights."""
    if isinstance(meta, DSparkConfig):
        out = meta
    else:
        n_taps = dparams["main_proj"].shape[1] // config.hidden_size
        block = getattr(meta, "block_size", None) or 5
        noise = getattr(meta, "noise_token_id", None)
        taps = getattr(meta, "target_layer_ids", None) or tuple(range(config.num_layers - n_taps, config.num_layers))
        out = DSparkConfig(block_size=block, noise_token_id=config.vocab_size - 1 if noise is None else noise,
                           target_layer_ids=tuple(taps))
    n_taps = dparams["main_proj"].shape[1] // config.hidden_size
    if len(out.target_layer_ids) != n_taps:
        raise ValueError(f"DSpark main_proj reads {n_taps} taps but target_layer_ids = {out.target_layer_ids}")
    if not 0 <= out.noise_token_id < config.vocab_size:
        raise ValueError(f"DSpark noise_token_id {out.noise_token_id} outside the vocabulary")
    return out


@struct.dataclass
class DSparkState:
    """The stages' context rings: `model.state.WindowRing`s stacked on a leading stage axis."""

    ctx: WindowRing       # kv [n_stages, B, W, d] context keys, ring slot p mod W; pos [n_stages, B, W] (EMPTY)

    def stage(self, s: int) -> WindowRing:
        """Stage s's ring: kv [B, W, d], pos [B, W]."""
        return WindowRing(kv=self.ctx.kv[s], pos=self.ctx.pos[s])


def init(dparams: dict, config: ModelConfig, batch: int, dtype) -> DSparkState:
    S, W = len(dparams["stages"]), config.sliding_window
    return DSparkState(ctx=WindowRing(kv=jnp.zeros((S, batch, W, config.head_dim), dtype),
                                      pos=jnp.full((S, batch, W), EMPTY, jnp.int32)))


def context_features(dparams: dict, config: ModelConfig, taps: jax.Array) -> jax.Array:
    """c_p = RMSNorm(main_proj · concat_l taps_l): taps [B,S,n_taps,D] -> [B,S,D]."""
    B, S = taps.shape[:2]
    flat = taps.reshape(B, S, -1)
    return rms_norm(linear(flat, dparams["main_proj"]), dparams["main_norm"], config.rms_norm_eps)


def observe(dparams: dict, target: dict, config: ModelConfig, st: DSparkState, taps: jax.Array, start: jax.Array,
            n_valid: jax.Array) -> DSparkState:
    """Store context keys of newly committed positions start..start+n_valid−1 (taps [B,S,n_taps,D])."""
    span = Span.of(start, taps.shape[1], n_valid)
    c = context_features(dparams, config, taps)
    freqs = inv_freq(config, "main")
    rings = [push_window(st.stage(s), project_kv(c, stage["attn"], config, span.positions, freqs), span)
             for s, stage in enumerate(dparams["stages"])]
    return DSparkState(ctx=jax.tree.map(lambda *x: jnp.stack(x), *rings))


def _stage(X, p, ring: WindowRing, config: ModelConfig, tokens, positions, context: str):
    """One draft stage on the block X [B,γ,n,D] (tokens, positions [B,γ] from the anchor a) against the
    stage's context ring."""
    ctx_kv, ctx_pos, anchor = ring.kv, ring.pos, positions[:, 0]
    eps = config.rms_norm_eps
    freqs = inv_freq(config, "main")
    pre, post, comb = hyper.hc_weights(X, p["hc_attn"], config)
    h = rms_norm(hyper.collapse(X, pre), p["attn_norm"], eps)
    pa = p["attn"]
    _, q = project_q(h, pa, config, positions, freqs)
    kv = project_kv(h, pa, config, positions, freqs)
    committed = ctx_pos < anchor[:, None]                                          # [B,W]
    if context == "query":
        near = ctx_pos[:, None, :] > positions[:, :, None] - config.sliding_window  # [B,γ,W]
    else:
        near = jnp.broadcast_to((ctx_pos >= anchor[:, None] - config.sliding_window)[:, None, :],
                                positions.shape + ctx_pos.shape[-1:])
    mask = jnp.concatenate([committed[:, None, :] & near, jnp.ones(positions.shape + positions.shape[-1:], bool)],
                           axis=2)
    o = attend(q, jnp.concatenate([ctx_kv, kv], axis=1), mask, pa["attn_sink"])
    o = apply_rope(o, positions, freqs, inverse=True)
    X = hyper.expand(X, grouped_output(o, pa, config), post, comb)
    return ffn_sublayer(X, p, block_config(config), "moe", tokens)


def block_outputs(dparams: dict, target: dict, config: ModelConfig, dcfg: DSparkConfig, st: DSparkState,
                  anchor_pos: jax.Array, anchor_tok: jax.Array):
    """Run the stages on [anchor, noise…]: (y pre-norm [B,γ,D], base logits U [B,γ,V] float32)."""
    B, g = anchor_tok.shape[0], dcfg.block_size
    tokens = jnp.concatenate([anchor_tok[:, None], jnp.full((B, g - 1), dcfg.noise_token_id, jnp.int32)], axis=1)
    positions = anchor_pos[:, None] + jnp.arange(g, dtype=jnp.int32)[None, :]
    e = embed(target["embed"], tokens)
    X = jnp.broadcast_to(e[:, :, None, :], e.shape[:2] + (config.hc_mult, e.shape[-1]))
    for s, stage in enumerate(dparams["stages"]):
        X = _stage(X, stage, st.stage(s), config, tokens, positions, dcfg.context)
    y = hyper.hc_head(X, dparams["hc_head"], config)
    U = linear(rms_norm(y, dparams["norm"], config.rms_norm_eps), target["head"])
    return y, U.astype(jnp.float32)


def confidence(dparams: dict, y: jax.Array, e: jax.Array) -> jax.Array:
    """c = sigmoid(w · [y; e] (+ b)): y [B,D], e [B,R] -> [B] (float32)."""
    w = dparams["conf_proj"]["weight"].astype(jnp.float32)[0]
    z = jnp.concatenate([y.astype(jnp.float32), e.astype(jnp.float32)], axis=-1) @ w
    if "bias" in dparams["conf_proj"]:
        z = z + dparams["conf_proj"]["bias"].astype(jnp.float32)[0]
    return jax.nn.sigmoid(z)


def kept_drafts(conf: jax.Array, threshold, rule: str) -> jax.Array:
    """Drafts to verify from confidences [B,k]: per-position stops at the first c_j < τ, cumulative when Π c_i < τ."""
    score = conf if rule == "per-position" else jnp.cumprod(conf, axis=-1)
    return jnp.sum(jnp.cumprod((score >= threshold).astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def propose(run: Bound, st: DSparkState, anchor_pos: jax.Array, anchor_tok: jax.Array, key, knobs: Knobs,
            greedy: bool, forced=None):
    """Drafts for the k = run.setup.k positions after the anchor: (drafts [B,k], q [B,k,V], n_draft [B],
    confidences [B,k]); run.setup.settings is the DSparkConfig, knobs.drafter["confidence_threshold"] τ.

    knobs.draft_n: None (all k) or a traced int32 scalar <= k: the serial Markov head runs only the first
    draft_n positions, in a loop (the rest stay 0). forced [B,k] (teacher forcing, `Drafter.propose_along`): the
    Markov head's previous token at position j is forced[:, j−1] instead of draft j."""
    dparams, dcfg, k, n_steps = run.params["dspark"], run.setup.settings, run.setup.k, knobs.draft_n
    temperature, top_p, threshold = knobs.temperature, knobs.top_p, knobs.drafter["confidence_threshold"]
    y, U = block_outputs(dparams, run.params, run.config, dcfg, st, anchor_pos, anchor_tok)
    keys = jax.random.split(key, k)
    w1, w2 = dparams["markov_w1"], dparams["markov_w2"]

    def step(j, chain):
        prev, drafts, probs, confs = chain
        e = embed(w1, prev)                                              # [B,R]
        logits = U[:, j] + linear(e, w2).astype(jnp.float32)
        tok, q, _ = draw(keys[j], logits, temperature, top_p, greedy)
        conf = confidence(dparams, y[:, j], e)
        nxt = tok if forced is None else forced[:, j]
        return nxt, drafts.at[:, j].set(tok), probs.at[:, j].set(q), confs.at[:, j].set(conf)

    B, V = U.shape[0], U.shape[-1]
    chain = (anchor_tok, jnp.zeros((B, k), jnp.int32), jnp.zeros((B, k, V), jnp.float32),
             jnp.zeros((B, k), jnp.float32))
    if n_steps is None:
        for j in range(k):
            chain = step(j, chain)
    else:
        chain = jax.lax.fori_loop(0, jnp.clip(n_steps, 1, k), step, chain)
    _, drafts, probs, conf = chain
    n_draft = kept_drafts(conf, threshold, dcfg.confidence_rule)
    return drafts, probs, n_draft if n_steps is None else jnp.minimum(n_draft, n_steps), conf


@dataclasses.dataclass(frozen=True)
class DSparkOptions:
    """confidence_threshold: the confidence cut-off τ (per run, no recompilation); dspark_meta: static settings
    (a DSparkConfig) overriding those of a checkpoint bundle (None: the bundle's, or defaults fitted to
    the weights; `resolve`)."""

    confidence_threshold: float = dynamic(0.0)
    dspark_meta: Any = None


class DSparkDrafter(Drafter):
    """DSpark behind the loop's drafter interface (`drafters.base`); settings: the run's DSparkConfig.
    Drafts per round are capped at the block size."""

    name = "dspark"
    Options = DSparkOptions
    weights = "dspark"
    weights_help = "DSpark weights"
    stop_knob = "confidence_threshold"
    scored = True

    def configure(self, params, config, k, options=None, bundle=None) -> DraftSetup:
        self.require_weights(params)
        meta = getattr(options, "dspark_meta", None)
        dcfg = resolve(config, params["dspark"], meta if meta is not None else (bundle or {}).get(self.name))
        return DraftSetup(k=min(k, dcfg.block_size), taps=dcfg.target_layer_ids, settings=dcfg)

    def max_drafts(self, setup) -> int:
        return setup.settings.block_size

    def context_rows(self, run):
        """Its rows attend within the sliding window: the last `sliding_window` committed positions."""
        return run.config.sliding_window

    def init(self, run, batch, max_len, dtype):
        return init(run.params["dspark"], run.config, batch, dtype)

    def observe(self, run, state, aux, tokens, start, n_valid):
        return observe(run.params["dspark"], run.params, run.config, state, aux["taps"], start, n_valid)

    def propose(self, run, state, pos, last, key, knobs, greedy):
        drafts, q, n_draft, _ = propose(run, state, pos, last, key, knobs, greedy)
        return drafts, q, n_draft

    def propose_scored(self, run, state, pos, last, key, knobs, greedy):
        return propose(run, state, pos, last, key, knobs, greedy)

    def propose_along(self, run, state, pos, last, path, key, knobs):
        return propose(run, state, pos, last, key, knobs, False, forced=path)[1]


DRAFTER = DSparkDrafter()
