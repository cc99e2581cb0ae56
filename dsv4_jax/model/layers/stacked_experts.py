"""Routed experts of one layer left in their scanned segment's stack (`StackedExperts`), for the MoE kernels."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class StackedExperts(NamedTuple):
    """Routed experts of one layer of a scanned segment, left in the segment's stack: stack {"w1", "w2",
    "w3"} [reps, E, ...] (dense or QArray), rep the layer's index in it (traced inside the scan). Made by
    `target.run_segments` under the MoE kernels only (`inplace.reads_expert_stack`: "pallas", or "ep" with a
    "pallas_tpu" local matmul, where `moe_ep` hands each device its slice of the stack): the kernels read
    stack[rep] through expert ids offset by rep·E into the stack seen as [reps·E, ...] (a free reshape), with
    no per-layer copy."""

    stack: dict
    rep: jax.Array | int

    @property
    def n_experts(self) -> int:
        return self.stack["w1"].shape[1]

    def layer(self) -> dict:
        """stack[rep]: the layer's experts sliced out (a copy where a custom call consumes it)."""
        return jax.tree.map(lambda a: a[self.rep], self.stack)

    def flat(self, idx: jax.Array) -> tuple[dict, jax.Array]:
        """(the stack as [reps·E, ...] weights, idx + rep·E)."""
        E = self.stack["w1"].shape[1]
        flat = jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), self.stack)
        return flat, idx + jnp.asarray(self.rep, idx.dtype) * E
