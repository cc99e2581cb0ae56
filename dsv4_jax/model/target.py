"""The target model's full-sequence forward: embed → expand to n streams → layers → hc_head → norm → head."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..backends import Backends
from ..bundle import CheckpointConfig, target_config
from ..config import ModelConfig
from ..ops.linear import embed as embed_rows
from ..ops.linear import linear
from .inplace import hoist_stacked_experts, in_place_tables, split_tables, with_row_tables, with_stacked_experts
from .schedule import segments
from .layers import hyper
from .layers.block import layer_sequence
from .layers.norms import rms_norm


def embed(params: dict, config: ModelConfig, tokens: jax.Array) -> jax.Array:
    """tokens int [B,S] -> X [B,S,n,D]: the embedding copied to every stream."""
    e = embed_rows(params["embed"], tokens)
    return jnp.broadcast_to(e[:, :, None, :], e.shape[:2] + (config.hc_mult, e.shape[-1]))


def head(params: dict, config: ModelConfig, X: jax.Array) -> jax.Array:
    """X [B,S,n,D] -> logits [B,S,V] (hc_head collapse, final norm, untied head)."""
    h = rms_norm(hyper.hc_head(X, params["hc_head"], config), params["norm"], config.rms_norm_eps)
    return linear(h, params["head"])


def run_segments(params: dict, config: ModelConfig, carry, layer_fn, states: list | None = None):
    """Apply every layer in order; repeated segments are a lax.scan over their stacked parameters.

    layer_fn(carry, layer_params, layer_state, kind_layer, layer) -> (carry, new_layer_state), where
    kind_layer is a static layer index with the right type (it fixes the code path) and layer the
    actual index (a traced int inside a scan). `states` mirrors params["segments"] (or None).
    Returns (carry, new states). With `config.backends.unroll_layers` the scans are unrolled (`unrolled`:
    one copy of the body per layer, what ahead-of-time cost analysis needs to count every layer).

    Inside a scan the row tables of the state stay in their stacked buffers and, under the MoE kernels, the
    routed experts in their stack: `model.inplace` (the copies XLA would otherwise make).
    """
    new_states = []
    for s, (seg, slots) in enumerate(zip(segments(config), params["segments"])):
        cache_slots = states[s] if states is not None else [None] * seg.pattern

        slots, stacked = hoist_stacked_experts(slots, config)

        def one_rep(carry, rep_params, rep_states, rep):
            outs = []
            for j in range(seg.pattern):
                carry, c = layer_fn(carry, with_stacked_experts(rep_params[j], stacked[j], rep), rep_states[j],
                                    seg.layer_index(j, 0), seg.start + rep * seg.pattern + j)
                outs.append(c)
            return carry, outs

        if seg.reps == 1:
            first = lambda tree: jax.tree.map(lambda a: a[0], tree)
            carry, outs = one_rep(carry, first(slots), first(cache_slots), 0)
            outs = jax.tree.map(lambda a: a[None], outs)
        else:
            rest, tables = zip(*map(split_tables, cache_slots))
            body = in_place_tables(one_rep)
            if config.backends.unroll_layers:
                (carry, tables), outs = unrolled(body, (carry, list(tables)), slots, list(rest), seg.reps)
            else:
                (carry, tables), outs = jax.lax.scan(lambda c, xs: body(c, *xs), (carry, list(tables)),
                                                     (slots, list(rest), jnp.arange(seg.reps)))
            outs = [None if o is None else with_row_tables(o, t) for o, t in zip(outs, tables)]
        new_states.append(outs)
    return carry, new_states


def unrolled(one_rep, carry, slots, cache_slots, reps: int):
    """The scan of `run_segments` as straight-line code: rep r reads its slice of the stacked parameters and
    state at a layer index XLA cannot constant-fold (an optimization barrier), so each copy of the body
    compiles like the scan body (a static slice would be materialised before its dynamic-slice users), and
    reads and writes its state in one stacked buffer (so the write-back can be in place)."""
    rs = jax.lax.optimization_barrier(jnp.arange(reps))
    out_states = cache_slots
    for r in range(reps):
        pick = lambda tree: jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, rs[r], 0, keepdims=False), tree)
        carry, out = one_rep(carry, pick(slots), pick(out_states), rs[r])   # slice r is not written yet
        put = lambda buf, new: jax.lax.dynamic_update_index_in_dim(buf, new.astype(buf.dtype), rs[r], 0)
        out_states = jax.tree.map(put, out_states, out)
    return carry, out_states


def hidden_states(params: dict, config: ModelConfig, tokens: jax.Array) -> jax.Array:
    """The last layer's HC streams before hc_head: tokens [B,S] -> X [B,S,n,D]."""
    B, S = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    X = embed(params, config, tokens)
    fn = lambda X, p, _c, kind, _layer: (layer_sequence(X, p, config, kind, tokens, positions), None)
    return run_segments(params, config, X, fn)[0]


def forward(params: dict, config: ModelConfig | CheckpointConfig, tokens: jax.Array, *,
            backends: Backends | str | None = None) -> jax.Array:
    """Full-sequence logits, no cache. tokens int32 [B,S] -> logits [B,S,V] in the parameters' dtype.

    config: a ModelConfig or the bundle `load_checkpoint` returns; backends: the kernels (a `Backends`,
    or "auto" | "reference" | "pallas"; default: the config's own), resolved here, outside traced code.
    """
    return forward_jit(params, target_config(config, backends), tokens)


@functools.partial(jax.jit, static_argnums=1)
def forward_jit(params: dict, config: ModelConfig, tokens: jax.Array) -> jax.Array:
    """`forward` for a ModelConfig whose backends are concrete (the config is the static jit key)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    return head(params, config, hidden_states(params, config, tokens))
