"""The MTP drafter (docs/drafter_math.md §1): one extra V4 block chained to draft up to k tokens.

Row i of the MTP block takes the target's last-layer HC streams S_i (before hc_head) and the token
x_{i+1}:  X0 = e_proj(enorm(E[x_{i+1}])) (on every stream) + h_proj(hnorm(S_i)) (per stream);
X1 = Block(X0) with sliding-window attention at position i; logits for x_{i+2} from the MTP's own
hc_head and norm and the target's head. Chaining reuses the block: row i+1 takes (X1_i, draft).

State (`MTPState`): the block's position-indexed window ring (a one-layer decode cache), holding
rows built from committed target hiddens, plus the last committed row's output X1 and logits —
the start of the next chain. Chain rows are written to the ring beyond the committed rows and
are invisible to (and overwritten by) later rows, like rejected target rows.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from ..model.state import LayerCache, Span, init_state
from ..config import ModelConfig
from ..model.layers import hyper
from ..model.layers.block import layer_step
from ..model.layers.norms import rms_norm
from ..ops.linear import embed, linear
from ..ops import width
from .base import MODE_AUTO, Bound, DraftSetup, Drafter, Knobs, dynamic
from .common import block_config, chain_length, draw


@struct.dataclass
class MTPState:
    cache: LayerCache       # one sliding layer's: window.kv [B,Rw,d], window.pos [B,Rw] (no compressor, indexer)
    last_hidden: jax.Array  # [B,n,D] X1 of the last committed row
    last_logits: jax.Array  # [B,V] its logits: the distribution of the first draft


def init(config: ModelConfig, batch: int, max_len: int, max_block: int, dtype) -> MTPState:
    bc = block_config(config)
    cache = jax.tree.map(lambda a: a[0], init_state(bc, batch, max_len, max_block, dtype).layers[0][0])
    return MTPState(cache=cache, last_hidden=jnp.zeros((batch, config.hc_mult, config.hidden_size), dtype),
                    last_logits=jnp.zeros((batch, config.vocab_size), jnp.float32))


def rows(mtp: dict, target: dict, config: ModelConfig, cache: LayerCache, hidden: jax.Array, tokens: jax.Array,
         span: Span):
    """Run MTP rows at positions span.positions [B,R]. hidden [B,R,n,D] (S_i), tokens [B,R] (x_{i+1}).

    Returns (X1 [B,R,n,D], logits [B,R,V] float32, cache with the first span.n_valid rows written).
    """
    eps = config.rms_norm_eps
    e = linear(rms_norm(embed(target["embed"], tokens), mtp["enorm"], eps), mtp["e_proj"])   # [B,R,D]
    h = linear(rms_norm(hidden, mtp["hnorm"], eps), mtp["h_proj"])                          # [B,R,n,D]
    X0 = (h + e[:, :, None, :]).astype(hidden.dtype)
    X1, cache = layer_step(X0, mtp, cache, block_config(config), 0, tokens, span)
    y = rms_norm(hyper.hc_head(X1, mtp["hc_head"], config), mtp["norm"], eps)
    return X1, linear(y, target["head"]).astype(jnp.float32), cache


def _last(x: jax.Array, n: jax.Array) -> jax.Array:
    """x[b, n[b] − 1] for x [B,R,...]."""
    return jnp.take_along_axis(x, (n - 1).reshape((-1, 1) + (1,) * (x.ndim - 2)), axis=1)[:, 0]


def observe(mtp: dict, target: dict, config: ModelConfig, st: MTPState, hidden, tokens, start, n_valid) -> MTPState:
    """Commit MTP rows from newly committed target positions start..start+n_valid−1.

    hidden [B,R,n,D]: the target's S at those positions; tokens [B,R]: the token after each (the
    accepted drafts, then the bonus token). The last committed row seeds the next chain; rows with
    n_valid 0 keep theirs.
    """
    X1, logits, cache = rows(mtp, target, config, st.cache, hidden, tokens, Span.of(start, tokens.shape[1], n_valid))
    fed = n_valid > 0      # a row given no positions (a chunked priming's later chunks) keeps its last row
    keep = lambda new, old: jnp.where(fed.reshape((-1,) + (1,) * (old.ndim - 1)), new, old)
    return MTPState(cache=cache, last_hidden=keep(_last(X1, n_valid), st.last_hidden),
                    last_logits=keep(_last(logits, n_valid), st.last_logits))


def propose(run: Bound, st: MTPState, pos: jax.Array, key, knobs: Knobs, greedy: bool, forced=None):
    """Draft a chain of k = run.setup.k tokens after committed position pos−1 (pos = target's committed count).

    knobs.draft_n: None (all k: a loop, written out step by step under `Backends.unroll_layers`) or a traced
    int32 scalar <= k: only the first draft_n drafts are computed, in a loop; the rest stay 0.
    Returns (drafts [B,k], draft probs q [B,k,V], n_draft [B] ≤ k after the rule knobs.drafter["p_min"]).
    forced [B,k] (teacher forcing, `Drafter.propose_along`): chain row j is fed forced[:, j−1] instead of draft j.
    """
    mtp, target, config, k, n_steps = run.params["mtp"][0], run.params, run.config, run.setup.k, knobs.draft_n
    temperature, top_p, p_min = knobs.temperature, knobs.top_p, knobs.drafter["p_min"]
    keys = jax.random.split(key, k)
    tok, q, top1 = draw(keys[0], st.last_logits, temperature, top_p, greedy)
    ones = jnp.ones_like(pos)

    def step(j, chain):
        # chain row at position pos−1+j: (X1 of the previous row, previous draft)
        X, cache, drafts, probs, tops = chain
        fed = drafts if forced is None else forced
        X1, logits, cache = rows(mtp, target, config, cache, X[:, None], fed[:, j - 1][:, None],
                                 Span.of(pos - 1 + j, 1, ones))
        tok, q, top1 = draw(keys[j], logits[:, 0], temperature, top_p, greedy)
        return X1[:, 0], cache, drafts.at[:, j].set(tok), probs.at[:, j].set(q), tops.at[:, j].set(top1)

    put = lambda first, like: jnp.zeros(first.shape[:1] + (k,) + first.shape[1:], like).at[:, 0].set(first)
    chain = (st.last_hidden, st.cache, put(tok, jnp.int32), put(q, q.dtype), put(top1, top1.dtype))
    if n_steps is not None and knobs.width_mode is not None:
        n_steps, chain = _scheduled_chain(step, chain, jnp.clip(n_steps, 1, k), knobs)   # the steps it ran
    elif n_steps is not None:
        n_steps = jnp.clip(n_steps, 1, k)
        chain = jax.lax.fori_loop(1, n_steps, step, chain)
    elif config.backends.unroll_layers:     # ahead-of-time counting: every step in the program
        for j in range(1, k):
            chain = step(j, chain)
    elif k > 1:                              # one compiled step (XLA compile time grows with each copy)
        chain = jax.lax.fori_loop(1, k, step, chain)
    _, _, drafts, probs, tops = chain
    n = chain_length(tops, p_min)
    return drafts, probs, n if n_steps is None else jnp.minimum(n, n_steps)


def _scheduled_chain(step, chain, n_steps, knobs: Knobs):
    """The chain under the width scheduler (docs/width_scheduler.md §2): MODE_AUTO stops before a draft that no
    width could pay for (`ops.width.keep_drafting` on the calibrated draft probabilities so far); the other
    modes run n_steps steps. -> (drafts computed, chain)."""
    def more(carry):
        j, chain = carry
        _, _, drafts, probs, _ = chain
        est = width.calibrated(width.draft_probability(drafts, probs), knobs.accept_scale)
        wanted = width.keep_drafting(est, j, knobs.width_cost, n_steps)
        return (j < n_steps) & ((knobs.width_mode != MODE_AUTO) | wanted)

    return jax.lax.while_loop(more, lambda carry: (carry[0] + 1, step(carry[0], carry[1])), (jnp.int32(1), chain))


@dataclasses.dataclass(frozen=True)
class MTPOptions:
    """p_min: stop the chain before a draft whose top-1 probability is below it (per run, no recompilation)."""

    p_min: float = dynamic(0.0)


class MTPDrafter(Drafter):
    """MTP behind the loop's drafter interface (`drafters.base`); uses the first MTP block params["mtp"][0]."""

    name = "mtp"
    Options = MTPOptions
    weights = "mtp"
    weights_help = "MTP weights"
    stop_knob = "p_min"
    sequential = True

    def configure(self, params, config, k, options=None, bundle=None) -> DraftSetup:
        self.require_weights(params)
        return DraftSetup(k=k)

    def context_rows(self, run):
        """Its rows attend within the sliding window: the last `sliding_window` committed positions."""
        return run.config.sliding_window

    def init(self, run, batch, max_len, dtype):
        return init(run.config, batch, max_len, run.setup.k + 1, dtype)

    def observe(self, run, state, aux, tokens, start, n_valid):
        return observe(run.params["mtp"][0], run.params, run.config, state, aux["hidden"], tokens, start, n_valid)

    def propose(self, run, state, pos, last, key, knobs, greedy):
        return propose(run, state, pos, key, knobs, greedy)

    def propose_along(self, run, state, pos, last, path, key, knobs):
        return propose(run, state, pos, key, knobs, False, forced=path)[1]


DRAFTER = MTPDrafter()
