"""The programs the report compiles, each a jitted function with abstract, sharded arguments and its bound.

    prefill       `decode.process_block` on a chunk of [B, prefill_chunk] tokens against a state at `context`
    decode        `decode.process_block` on [B, 1] (the call `decode_step` makes)
    verify        `decode.process_block` on [B, k+1] (the call `verify` makes)
    spec-mtp      one round of the speculative loop with the MTP drafter (`spec.loop.round_step`: draft k,
                  verify k+1, accept, commit, observe) — one round, not `run_rounds`: the loop is a
                  `while_loop`, whose body XLA's cost analysis would count once whatever the trip count
    spec-dspark   the same with the DSpark drafter (3 stages, 3 taps, Markov rank 256; k ≤ block size 5)

The config passed in carries the backends; the report sets `unroll_layers=True` so every layer is in the
program text. The speculative round's options (`spec.loop.Options`) and carry are built in `_round` only.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from ..config import ModelConfig
from ..decode import process_block
from ..drafters import dspark, mtp
from ..spec import loop
from . import bounds
from . import inputs as I

PROGRAMS = ("prefill", "decode", "verify", "spec-mtp", "spec-dspark")
MAX_NEW_TOKENS = 256        # the loop's output buffer per sequence (a static size of the carry)


@dataclasses.dataclass
class Program:
    """One program to compile: `fn.lower(*args)`; `bound` = its bytes bound (whole slice)."""

    name: str
    fn: Callable
    args: tuple
    bound: dict
    tokens_per_sequence: int
    notes: str = ""

    def lower(self):
        return self.fn.lower(*self.args)

    @property
    def argument_bytes_per_device(self) -> float:
        return I.per_device_bytes([a for a in self.args if _is_abstract(a)])


def _is_abstract(x) -> bool:
    return all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(x)) and bool(jax.tree.leaves(x))


def _bound(fn, *args) -> dict:
    try:
        return fn(*args)
    except bounds.BytesModelMissing as e:
        return {"error": str(e)}


def _block(name: str, config: ModelConfig, mesh, weights: str, sh: I.Shapes, S: int, rules) -> Program:
    params = I.target_params(config, mesh, weights, rules)
    state = I.decode_state(config, mesh, sh.batch, sh.max_len, sh.max_block, rules)
    tokens = I.batch_array(mesh, (sh.batch, S), jnp.int32, rules=rules)
    n_valid = I.replicated(mesh, (sh.batch,), jnp.int32)
    bound = _bound(bounds.target_bound, config, weights, sh.batch, sh.context, S)
    return Program(name, process_block, (params, config, state, tokens, n_valid), bound, S)


def _round(drafter: str, config: ModelConfig, mesh, weights: str, sh: I.Shapes, rules) -> Program:
    """One speculative round (`spec.loop.round_step`, greedy verification) with `drafter`: the only place
    that builds the loop's Options and Carry."""
    B, k, dt = sh.batch, sh.draft_n_max, I.COMPUTE_DTYPE
    params = I.target_params(config, mesh, weights, rules)
    notes = ""
    if drafter == "mtp":
        params["mtp"] = I.mtp_params(config, mesh, weights, rules)
        dstate = jax.eval_shape(lambda: mtp.init(config, B, sh.max_len, sh.max_block, dt))
        dstate = jax.tree.map(lambda x: I.batch_array(mesh, x.shape, x.dtype, 0, rules), dstate)
        opts = loop.Options(drafter="mtp", k=k, greedy=True, max_new_tokens=MAX_NEW_TOKENS,
                            eos_token_id=config.eos_token_id)
        bound = _bound(bounds.mtp_round_bound, config, weights, B, sh.context, k)
    else:
        dparams = I.dspark_params(config, mesh, weights, rules)
        params["dspark"] = dparams
        dcfg = dspark.resolve(config, dparams)
        if k > dcfg.block_size:
            notes = f"k = {k} > DSpark block size {dcfg.block_size}: compiled with k = {dcfg.block_size}"
            k = dcfg.block_size
        dstate = jax.eval_shape(lambda: dspark.init(dparams, config, B, dt))      # [stages, B, ...]
        dstate = jax.tree.map(lambda x: I.batch_array(mesh, x.shape, x.dtype, 1, rules), dstate)
        opts = loop.Options(drafter="dspark", k=k, greedy=True, max_new_tokens=MAX_NEW_TOKENS,
                            eos_token_id=config.eos_token_id, taps=dcfg.target_layer_ids, dspark=dcfg)
        rank = dparams["markov_w1"].shape[1]
        bound = _bound(bounds.dspark_round_bound, config, weights, B, sh.context, k, dcfg.block_size,
                       len(dparams["stages"]), len(dcfg.target_layer_ids), rank)
    ints = lambda *shape: I.batch_array(mesh, shape, jnp.int32, rules=rules)
    carry = loop.Carry(
        out=ints(B, MAX_NEW_TOKENS + k + 1), out_len=ints(B), last=ints(B),
        done=I.batch_array(mesh, (B,), jnp.bool_, rules=rules),
        target=I.decode_state(config, mesh, B, sh.max_len, sh.max_block, rules), drafter=dstate,
        key=I.replicated(mesh, (2,), jnp.uint32),
        stats=loop.Stats(rounds=ints(B), drafted=ints(B), accepted=ints(B), per_position=ints(B, k),
                         proposed_at=ints(B, k), length_hist=ints(B, k + 1)),
        round=I.replicated(mesh, (), jnp.int32))
    scalar = lambda: I.replicated(mesh, (), jnp.float32)
    knobs = loop.Knobs(temperature=scalar(), top_p=scalar(), p_min=scalar(), confidence=scalar())
    return Program(f"spec-{drafter}", _round_jit(), (params, config, carry, knobs, opts), bound, k + 1, notes)


@functools.lru_cache(maxsize=None)
def _round_jit():
    return jax.jit(loop.round_step, static_argnames=("config", "opts"), donate_argnames=("c",))


def build(name: str, config: ModelConfig, mesh, weights: str, shapes: I.Shapes, rules=None) -> Program:
    """The program `name` (one of PROGRAMS) for `config` on `mesh` with weights in format `weights`."""
    I.check_weights(weights)
    if name == "prefill":
        return _block(name, config, mesh, weights, shapes, shapes.prefill_chunk, rules)
    if name == "decode":
        return _block(name, config, mesh, weights, shapes, 1, rules)
    if name == "verify":
        return _block(name, config, mesh, weights, shapes, shapes.max_block, rules)
    if name in ("spec-mtp", "spec-dspark"):
        return _round(name.split("-")[1], config, mesh, weights, shapes, rules)
    raise ValueError(f"unknown program {name!r}; choose from {PROGRAMS}")
