"""The programs the report compiles, each a jitted function with abstract, sharded arguments and its bound.

    prefill       `decode.process_block` on a chunk of [B, prefill_chunk] tokens against a state at `context`
    decode        `decode.process_block` on [B, 1] (the call `decode_step` makes)
    verify        `decode.process_block` on [B, k+1] (the call `verify` makes)
    spec-mtp      one round of the speculative loop with the MTP drafter (`speculative.round.round_step`: draft k,
                  verify k+1, accept, commit, observe) — one round, not `run_rounds`: the loop is a
                  `while_loop`, whose body XLA's cost analysis would count once whatever the trip count
    spec-dspark   the same with the DSpark drafter (3 stages, 3 taps, Markov rank 256; k ≤ block size 5)

`bound["by_k"]` (verify and the rounds) holds the bound at every k of the speculation payoff forecast
(`forecast.round_times`). The config passed in carries the backends; the report sets `unroll_layers=True`
so every layer is in the program text. The speculative round's static program (`speculative.program.Program`)
and carry are built in `_round` only.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from ...config import ModelConfig
from ...model.decode import process_block
from ...parallel import expert_words
from ...drafters import registry
from ...drafters.base import Bound, Knobs
from ...speculative import loop
from ...speculative import stats as spec_stats
from ...speculative.program import Carry as LoopCarry, Program as Loop
from . import bounds
from . import forecast as F
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
    mesh: object = None     # set when the program holds Mosaic kernels (`uses_mosaic`)
    # a round's drafter MoE passes, (name, tokens per sequence, layer applications): the passes its bound counts
    drafter_moe: tuple = ()

    def lower(self):
        """`fn.lower(*args)`; with `mesh`, under `jax.set_mesh(mesh)`: Pallas' TPU lowering rules read the chip
        (`tpu_info.get_tpu_info`) from the context's abstract mesh, else from the default device (the CPU
        here: "Unsupported TPU device kind: cpu"), as `analysis.kernels_aot` does for single kernels."""
        if self.mesh is None:
            return self.fn.lower(*self.args)
        with jax.set_mesh(self.mesh):
            return self.fn.lower(*self.args)

    @property
    def argument_bytes_per_device(self) -> float:
        return I.per_device_bytes([a for a in self.args if _is_abstract(a)])


def _is_abstract(x) -> bool:
    return all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(x)) and bool(jax.tree.leaves(x))


def _for_run(params: dict, config: ModelConfig, mesh) -> dict:
    """The parameters as a run on `mesh` holds them: the routed experts through `parallel.expert_words.for_run`,
    the rule `load_checkpoint` applies (on TPU under expert parallelism with an XLA local matmul: FP4 as uint32
    words, codes and scales contraction-dim major; with a Pallas one as placed), so no program declares an input
    layout a run does not hold."""
    return expert_words.for_run(params, config.backends, platform(mesh))


def platform(mesh) -> str | None:
    """The platform of a mesh's devices ("tpu", "cpu"); an AbstractMesh (plans) its abstract device's, if any."""
    if isinstance(mesh, jax.sharding.AbstractMesh):
        return getattr(mesh.abstract_device, "platform", None)
    return mesh.devices.flat[0].platform


def _block(name: str, config: ModelConfig, mesh, weights: str, sh: I.Shapes, S: int, rules) -> Program:
    params = _for_run(I.target_params(config, mesh, weights, rules), config, mesh)
    state = I.decode_state(config, mesh, sh.batch, sh.max_len, sh.max_block, rules)
    tokens = I.batch_array(mesh, (sh.batch, S), jnp.int32, rules=rules)
    n_valid = I.replicated(mesh, (sh.batch,), jnp.int32)
    bound = bounds.target_bound(config, weights, sh.batch, sh.context, S)
    if name == "verify":        # the verify step over k + 1 tokens for every k of the payoff forecast
        bound["by_k"] = {str(k): bounds.target_bound(config, weights, sh.batch, sh.context, k + 1)["total"]
                         for k in F.K_RANGE}
    return Program(name, process_block, (params, config, state, tokens, n_valid), bound, S)


def _round(drafter_name: str, config: ModelConfig, mesh, weights: str, sh: I.Shapes, rules) -> Program:
    """One speculative round (`speculative.round.round_step`, greedy verification) with the drafter `drafter_name`
    (configured, initialised and run through the `drafters.registry` interface): the only place that builds
    the loop's Program and Carry."""
    B, dt = sh.batch, I.COMPUTE_DTYPE
    params = I.target_params(config, mesh, weights, rules)
    if drafter_name == "mtp":
        params["mtp"] = I.mtp_params(config, mesh, weights, rules)
    else:
        params["dspark"] = I.dspark_params(config, mesh, weights, rules)
    params = _for_run(params, config, mesh)
    drafter = registry.get(drafter_name)
    setup = drafter.configure(params, config, sh.draft_n_max)
    k = setup.k
    notes = "" if k == sh.draft_n_max else \
        f"k = {sh.draft_n_max} > DSpark block size {setup.settings.block_size}: compiled with k = {k}"
    # drafter state: MTP [B, ...]; DSpark [stages, B, ...]
    batch_axis = 0 if drafter_name == "mtp" else 1
    dstate = jax.eval_shape(lambda: drafter.init(Bound(params, config, setup), B, sh.max_len, dt))
    dstate = jax.tree.map(lambda x: I.batch_array(mesh, x.shape, x.dtype, batch_axis, rules), dstate)
    opts = Loop(drafter=drafter, setup=setup, greedy=True, max_new_tokens=MAX_NEW_TOKENS,
                eos_token_id=config.eos_token_id, stats=spec_stats.StatsSpec(verification=False))
    if drafter_name == "mtp":
        round_bound = lambda kk: bounds.mtp_round_bound(config, weights, B, sh.context, kk)
        ks = F.K_RANGE
        drafter_moe = (("mtp chain", 1, k - 1), ("mtp observe", k + 1, 1))
    else:
        dp = params["dspark"]
        round_bound = lambda kk: bounds.dspark_round_bound(config, weights, B, sh.context, kk,
                                                           setup.settings.block_size, len(dp["stages"]),
                                                           len(setup.taps), dp["markov_w1"].shape[1])
        ks = [kk for kk in F.K_RANGE if kk <= setup.settings.block_size]     # DSpark drafts at most a block
        drafter_moe = (("dspark block", setup.settings.block_size, len(dp["stages"])),)   # observe: no MoE
    bound = round_bound(k)
    bound["by_k"] = {str(kk): round_bound(kk)["total"] for kk in ks}     # the payoff forecast's rounds
    ints = lambda *shape: I.batch_array(mesh, shape, jnp.int32, rules=rules)
    carry = LoopCarry(
        out=ints(B, MAX_NEW_TOKENS + k + 1), out_len=ints(B), limit=ints(B), last=ints(B),
        done=I.batch_array(mesh, (B,), jnp.bool_, rules=rules),
        target=I.decode_state(config, mesh, B, sh.max_len, sh.max_block, rules), drafter=dstate,
        key=I.replicated(mesh, (2,), jnp.uint32),
        stats=spec_stats.Stats(spec_stats.Core(rounds=ints(B), drafted=ints(B), accepted=ints(B),
                                               per_position=ints(B, k), proposed_at=ints(B, k),
                                               length_hist=ints(B, k + 1)), ()),
        round=I.replicated(mesh, (), jnp.int32))
    scalar = lambda: I.replicated(mesh, (), jnp.float32)
    knobs = Knobs(temperature=scalar(), top_p=scalar(),
                  drafter=jax.tree.map(lambda _: scalar(), drafter.knobs(drafter.options())))
    return Program(f"spec-{drafter_name}", loop.round_jit, (params, config, carry, knobs, opts), bound, k + 1,
                   notes, drafter_moe=drafter_moe)


def uses_mosaic(config: ModelConfig, mesh) -> bool:
    """Whether the programs of `config` on `mesh` hold Pallas TPU (Mosaic) kernels: a `pallas_tpu` backend
    (the MoE experts, in the GSPMD program or as the EP local matmul, or the indexer) on TPU devices."""
    b = config.backends
    kinds = {b.moe, b.indexer} | ({b.ep.local} if b.ep is not None else set())
    return "pallas_tpu" in kinds and platform(mesh) == "tpu" and not isinstance(mesh, jax.sharding.AbstractMesh)


def build(name: str, config: ModelConfig, mesh, weights: str, shapes: I.Shapes, rules=None) -> Program:
    """The program `name` (one of PROGRAMS) for `config` on `mesh` with weights in format `weights`."""
    program = _build(name, config, mesh, weights, shapes, rules)
    return dataclasses.replace(program, mesh=mesh) if uses_mosaic(config, mesh) else program


def _build(name: str, config: ModelConfig, mesh, weights: str, shapes: I.Shapes, rules=None) -> Program:
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
