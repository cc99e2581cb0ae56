"""An oracle drafter for tests and cost benchmarks: drafts read from a reference token table.

params["oracle"] = {"tokens": int [B, T] (each sequence's reference tokens by absolute position,
e.g. the target's own greedy output, so every draft is accepted), "wrong": bool [B, k] (positions
whose draft is replaced by a wrong token, to force an acceptance length)}. Drafts are point
masses (q = one-hot), which keeps rejection sampling exact too.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .base import DraftSetup, Drafter


def propose(oracle: dict, vocab_size: int, pos: jax.Array, k: int):
    """Drafts for the k positions after `last` (= tokens[pos]): (drafts [B,k], q [B,k,V], n_draft [B])."""
    table = oracle["tokens"]
    idx = jnp.clip(pos[:, None] + 1 + jnp.arange(k)[None, :], 0, table.shape[1] - 1)
    d = jnp.take_along_axis(table, idx, axis=1)
    d = jnp.where(oracle["wrong"], (d + 1) % vocab_size, d).astype(jnp.int32)
    return d, jax.nn.one_hot(d, vocab_size, dtype=jnp.float32), jnp.full(pos.shape, k, jnp.int32)


class OracleDrafter(Drafter):
    """The oracle behind the loop's drafter interface (`drafters.base`); stateless."""

    name = "oracle"
    weights = "oracle"
    weights_help = "its reference table {'tokens': [B,T], 'wrong': [B,k]}"

    def configure(self, params, config, k, options=None, bundle=None) -> DraftSetup:
        self.require_weights(params)
        return DraftSetup(k=k)

    def propose(self, run, state, pos, last, key, knobs, greedy):
        return propose(run.params["oracle"], run.config.vocab_size, pos, run.setup.k)


DRAFTER = OracleDrafter()
