"""`generate`: prompt tokens in, generated tokens and speculative-decoding statistics out.

Options come in three groups (`speculative.options`: Sampling, Speculation, RunShape) or as their published
keywords, the drafter's own options (`Speculation.options`) as keywords too; the config may be a
`ModelConfig` or the bundle `load_checkpoint` returns (DSpark's settings then come from the checkpoint);
`backends=` picks the kernels (`dsv4_jax.backends`), resolved here, before anything is traced.

    prepare(...) -> RunPlan      validated once: the drafter looked up and configured (`Drafter.configure`,
                                 once), the static `program.Program` (the loop's jit key, holding the
                                 Drafter object and its composed `DraftSetup`) and the run's data
    start_plan(params, plan)     the prefill and the drafter priming (`speculative.prefill`, shared with the
                                 slot engine) -> the loop's first `Carry`
    loop.decode(...)             the rounds (`speculative.round`) -> the last carry
    summarize(...)               the statistics (`speculative.stats`) -> `Generated(tokens, stats)`

How many drafts a round verifies, from the caller to the round (three names):

    name                     where                           what
    draft_n_max              `Speculation.draft_n_max`       asked for (or draft_n_max_bound under "auto")
    k                        `DraftSetup.k` = `Program.k`    the bound the loop is compiled for: draft_n_max
                                                             capped by the drafter (`Drafter.max_drafts`), or
                                                             max_block − 1 under RunShape.dynamic_draft_n
    draft_n                  `RunPlan.draft_n`,              the run's drafts per round (<= k): a traced
                             `Knobs.draft_n`                 scalar under a run-time bound, else None (= k);
                                                             the round verifies min(n_draft, draft_n)
    draft_n_max              stats["draft_n_max"]            reported: the run's draft_n
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..backends import Backends
from ..bundle import CheckpointConfig, unbundle
from ..config import ModelConfig
from ..drafters import pool, registry
from ..drafters.base import MODE_AUTO, Knobs
from ..model.decode import CapacityError
from ..ops.host import to_host
from ..ops.verification import RULES
from . import stats as S
from .cost_table import CostTable, as_table, cached_or_calibrate
from .loop import decode
from .options import LONG_PROMPT_CHUNK, RunShape, Sampling, Speculation, group_options
from .prefill import (chunk_plan, init_rows, next_tokens, prefill_piece, prefill_target, prime, prime_piece,  # noqa: F401
                      start, start_carry)
from .program import Carry, Program
from .stats import StatsSpec
from .width_policy import width_knobs

NO_DRAFTER = (None, "none")
AUTO = "auto"      # Speculation.draft_n_max: the width scheduler (docs/width_scheduler.md)


def _pad_prompts(prompt_tokens) -> tuple[np.ndarray, np.ndarray]:
    """A list of token lists or an int array [B,S] -> (right-padded int32 [B,S], lengths [B])."""
    if isinstance(prompt_tokens, (np.ndarray, jax.Array)) and np.ndim(prompt_tokens) == 2:
        arr = np.asarray(prompt_tokens, np.int32)
        return arr, np.full((arr.shape[0],), arr.shape[1], np.int32)
    seqs = [np.asarray(s, np.int32).reshape(-1) for s in prompt_tokens]
    if not seqs or any(len(s) == 0 for s in seqs):
        raise ValueError("every prompt needs at least one token")
    lengths = np.array([len(s) for s in seqs], np.int32)
    out = np.zeros((len(seqs), lengths.max()), np.int32)
    for b, s in enumerate(seqs):
        out[b, :len(s)] = s
    return out, lengths


def _validate(config: ModelConfig, tokens: np.ndarray, max_new_tokens: int, sp: Sampling, spec: Speculation):
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if spec.draft_n_max == AUTO:
        if spec.drafter in NO_DRAFTER:
            raise ValueError("draft_n_max='auto' needs a drafter")
        if not isinstance(spec.draft_n_max_bound, int) or spec.draft_n_max_bound < 1:
            raise ValueError(f"draft_n_max_bound must be an integer >= 1, got {spec.draft_n_max_bound!r}")
    elif not isinstance(spec.draft_n_max, (int, np.integer)) or isinstance(spec.draft_n_max, bool):
        raise ValueError(f"draft_n_max takes an integer or 'auto', got {spec.draft_n_max!r}")
    elif spec.drafter not in NO_DRAFTER and spec.draft_n_max < 1:
        raise ValueError(f"draft_n_max must be >= 1 with a drafter, got {spec.draft_n_max}")
    if sp.temperature < 0 or not 0 < sp.top_p <= 1:
        raise ValueError(f"need temperature >= 0, 0 < top_p <= 1 (got {sp.temperature}, {sp.top_p})")
    if spec.verify not in RULES:
        raise ValueError(f"verify must be one of {RULES}, got {spec.verify!r}")
    if spec.synthetic_accept is not None and (not synthetic_rates(spec.synthetic_accept)
                                              or not all(0 <= r <= 1 for r in synthetic_rates(spec.synthetic_accept))):
        raise ValueError(f"synthetic_accept takes rates in [0, 1] (one, or one per position), got {spec.synthetic_accept}")
    if tokens.min() < 0 or tokens.max() >= config.vocab_size:
        raise ValueError(f"prompt token ids must be in [0, {config.vocab_size})")


def synthetic_rates(value) -> tuple[float, ...] | None:
    """Speculation.synthetic_accept as a tuple of per-position rates (a number -> one rate); None stays None."""
    if value is None:
        return None
    return tuple(float(r) for r in (value if isinstance(value, (tuple, list)) else (value,)))


def summarize(c: Carry, program: Program, wall_s: float, draft_n: int | None = None) -> dict[str, Any]:
    """Statistics of a finished run (docs/drafter_math.md §4.1 definitions, `stats.summary`); per-sequence
    arrays as lists. draft_n: the run's drafts per round (default program.k; less when the loop was compiled
    for a wider bound, `RunShape.dynamic_draft_n`)."""
    n_out = to_host(c.out_len)
    out = S.summary(to_host(c.stats), program, program.k if draft_n is None else draft_n)
    return {**out, "generated": int(n_out.sum()), "per_sequence_generated": n_out.tolist(), "wall_s": wall_s,
            "tokens_per_s": float(n_out.sum()) / wall_s if wall_s > 0 else 0.0}


@dataclasses.dataclass(frozen=True, eq=False)
class RunPlan:
    """A validated run (`prepare`): the loop's static `Program` (its jit key) and the run's data."""

    program: Program             # static: drafter, DraftSetup (k: the compiled bound), sampling mode, budget ...
    config: ModelConfig          # the target config, backends resolved
    tokens: np.ndarray           # [B,S] right-padded prompts
    lengths: np.ndarray          # [B]
    knobs: Knobs                 # dynamic: temperature, top_p, the drafter's knobs, draft_n, the width costs
    draft_n: int                 # the run's drafts per round (<= program.k; Knobs.draft_n under a run-time bound)
    max_len: int
    max_block: int               # the decode state's and carry's widest verify block (>= program.k + 1)
    prefill_taps: tuple          # tap layers the prefill computes (contains program.taps)
    seed: int = 0
    host_loop: bool = False
    prefill_chunk: int | None = None   # the prefill in chunks of this many tokens (RunShape.prefill_chunk)
    cost_table: Any = None             # Speculation.cost_table (auto runs; `priced`)

    def replace(self, **changes) -> "RunPlan":
        return dataclasses.replace(self, **changes)


def prepare(params: dict, config: ModelConfig | CheckpointConfig, prompt_tokens, max_new_tokens: int, *,
            sampling: Sampling | None = None, speculation: Speculation | None = None, run: RunShape | None = None,
            backends: Backends | str | None = None, **options) -> RunPlan:
    """Validate the options (groups and / or published keywords, see `speculative.options`) and plan a run."""
    sp, spec, shape = group_options(sampling, speculation, run, **options)
    config, bundle_meta = unbundle(config, backends)
    drafter = registry.get(spec.drafter)
    dopts = drafter.options(spec.options)
    if shape.drafter_pool and drafter.name != "none":   # shorthand: the drafter as a pool's active member
        drafter = registry.get(pool.NAME)
        dopts = drafter.options(pool.wrap(spec.drafter, dopts, tuple(shape.drafter_pool)))
    tokens, lengths = _pad_prompts(prompt_tokens)
    if shape.pad_to is not None:
        if tokens.shape[1] > shape.pad_to:
            raise ValueError(f"a prompt has {tokens.shape[1]} tokens, more than pad_to={shape.pad_to}")
        tokens = np.pad(tokens, ((0, 0), (0, shape.pad_to - tokens.shape[1])))
    _validate(config, tokens, max_new_tokens, sp, spec)
    bundle = dict(bundle_meta)
    if shape.prefill_chunk is not None and shape.prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1 tokens, got {shape.prefill_chunk}")
    auto = spec.draft_n_max == AUTO
    adaptive = (auto or shape.adaptive_widths) and drafter.name != "none"
    dynamic = (shape.dynamic_draft_n or adaptive) and drafter.name != "none"
    max_block = shape.max_block
    if auto and max_block is None:
        max_block = spec.draft_n_max_bound + 1
    if dynamic and max_block is None:
        raise ValueError("dynamic_draft_n needs max_block: the verify width the loop is compiled for")
    draft_n = spec.draft_n_max_bound if auto else spec.draft_n_max
    # the program's bound: the run's draft_n_max, or max_block - 1 (dynamic_draft_n); a drafter may cap it
    setup = drafter.configure(params, config, max_block - 1 if dynamic else max(draft_n, 1), dopts, bundle)
    cap = drafter.max_drafts(setup)
    draft_n = min(draft_n, draft_n if cap is None else cap) if dynamic else setup.k
    if draft_n > setup.k:
        raise ValueError(f"draft_n_max={draft_n} needs verify blocks wider than max_block={max_block}")
    max_block = max_block or setup.k + 1
    if max_block < setup.k + 1:
        raise ValueError(f"max_block={max_block} is narrower than a verify block of draft_n_max {setup.k} (+1)")
    need = tokens.shape[1] + max_new_tokens + max_block
    max_len = shape.max_len or need
    if need > max_len:
        raise CapacityError(f"prompt ({tokens.shape[1]}) + max_new_tokens ({max_new_tokens}) + a verify block "
                            f"({max_block}) needs {need} positions, more than max_len={max_len}")
    if max_len > config.max_position_embeddings:
        raise CapacityError(f"prompt ({tokens.shape[1]}) + max_new_tokens ({max_new_tokens}) + a verify block "
                            f"({max_block}): a state of {max_len} positions, past the "
                            f"max_position_embeddings={config.max_position_embeddings} of {config.name}")
    chunk = shape.prefill_chunk
    if chunk is None and tokens.shape[1] > LONG_PROMPT_CHUNK:
        chunk = LONG_PROMPT_CHUNK
    eos = config.eos_token_id if shape.eos_token_id is None else shape.eos_token_id
    program = Program(drafter=drafter, setup=setup, greedy=sp.temperature == 0, max_new_tokens=max_new_tokens,
                      eos_token_id=int(eos),
                      # greedy and synthetic runs ignore the rule: one program for both (docs/verification.md §2)
                      verify=spec.verify if sp.temperature > 0 and spec.synthetic_accept is None else "token",
                      synthetic_accept=synthetic_rates(spec.synthetic_accept), adaptive=adaptive,
                      stats=StatsSpec(width=adaptive, trace=shape.round_trace))
    knobs = Knobs(temperature=jnp.float32(max(sp.temperature, 1e-6)), top_p=jnp.float32(sp.top_p),
                  drafter=drafter.knobs(dopts), draft_n=jnp.int32(draft_n) if dynamic else None)
    if adaptive:
        knobs = width_knobs(knobs, as_table(spec.cost_table) if auto else None, setup.k, auto)
    prefill_taps = setup.taps
    if shape.drafter_pool and drafter.name == "none":    # share the pool's runs' prefill program
        members = tuple(shape.drafter_pool)
        prefill_taps = registry.get(pool.NAME).configure(params, config, max_block - 1,
                                                         pool.PoolOptions(members, members[0]), bundle).taps
    return RunPlan(program=program, config=config, tokens=tokens, lengths=lengths, knobs=knobs, draft_n=draft_n,
                   max_len=max_len, max_block=max_block, prefill_taps=prefill_taps, seed=sp.seed,
                   host_loop=shape.host_loop, prefill_chunk=chunk, cost_table=spec.cost_table)


def priced(params: dict, r: RunPlan, table, progress=None) -> tuple[RunPlan, CostTable | None, str | None]:
    """An auto run with its cost table: the given one, or the cached / freshly measured one for this machine
    and the run's shapes (`cost_table.cached_or_calibrate`). -> (run, table, "given" | "cached" | "measured")."""
    if not r.program.adaptive or int(r.knobs.width_mode) != MODE_AUTO:
        return r, None, None
    table, how = (as_table(table), "given") if table is not None else \
        cached_or_calibrate(params, r.config, r, progress=progress)
    return r.replace(knobs=width_knobs(r.knobs, table, r.program.k, True)), table, how


def start_plan(params: dict, r: RunPlan) -> Carry:
    """The prefilled carry of a planned run (`prefill.start`)."""
    return start(params, r.config, jnp.asarray(r.tokens), jnp.asarray(r.lengths), max_len=r.max_len,
                 program=r.program, knobs=r.knobs, key=jax.random.PRNGKey(r.seed), max_block=r.max_block,
                 prefill_taps=r.prefill_taps, prefill_chunk=r.prefill_chunk)


class Generated(NamedTuple):
    """What `generate` returns: `tokens, stats = generate(...)` unpacks it; stats["key"] as before."""

    tokens: list[list[int]]      # per prompt, the generated tokens (the first one from the prefill)
    stats: dict[str, Any]        # every statistic (`summarize`, plus prefill_s, decode_s, cost_table)

    rounds = property(lambda self: self.stats["rounds"])
    accepted = property(lambda self: self.stats["accepted"])
    mean_accepted_length = property(lambda self: self.stats["mean_accepted_length"],
                                    doc="Tokens per round including the bonus token.")
    draft_acceptance_rate = property(lambda self: self.stats["draft_acceptance_rate"])
    tokens_per_s = property(lambda self: self.stats["tokens_per_s"])
    wall_s = property(lambda self: self.stats["wall_s"])


def generate(params: dict, config: ModelConfig | CheckpointConfig, prompt_tokens, max_new_tokens: int, *,
             sampling: Sampling | None = None, speculation: Speculation | None = None, run: RunShape | None = None,
             backends: Backends | str | None = None, **options):
    """Generate up to max_new_tokens per prompt, optionally with speculative decoding.

    params, config: as `load_checkpoint` returns them (config: a ModelConfig or, for a checkpoint with
    drafters, its CheckpointConfig bundle, whose DSpark settings are then used), or `tiny_demo()`'s.
    prompt_tokens: list of token lists (ragged) or int array [B,S].
    Options (`dsv4_jax.speculative.options`), as groups or as their keywords:
      sampling=Sampling(temperature=0.0, top_p=1.0, seed=0): greedy when temperature == 0; otherwise
        lossless rejection sampling (the output distribution equals plain sampling at T and top_p).
      speculation=Speculation(drafter=None, draft_n_max=3, options=None): drafter None | "mtp" | "dspark" |
        "ngram" (| "oracle" for tests; any name registered in `dsv4_jax.drafters.registry`); draft_n_max
        drafts per round (for DSpark ≤ its block size); options: the drafter's own (`Drafter.Options`),
        also as keywords: MTP p_min=0.0 stops the chain before a draft whose top-1 probability is below
        it; DSpark confidence_threshold=0.0 is its cut-off and dspark_meta=None overrides the bundle's
        DSpark settings (a DSparkConfig); n-gram n_min=1, n_max=3 are the matched suffix lengths.
      run=RunShape(eos_token_id=None, max_len=None, pad_to=None, host_loop=False, max_block=None,
        drafter_pool=None, dynamic_draft_n=False, prefill_chunk=None): stop a sequence after eos_token_id
        (None: the config's; -1: never); max_len / pad_to fix the cache capacity and the padded prompt
        length, so that runs with other prompts reuse the compiled functions; host_loop drives rounds
        from Python (debugging twin; identical results);
        max_block sizes the state for verify blocks up to that width, so runs with any draft_n_max below
        it share the prefill; drafter_pool (names) compiles one loop per draft width for all of them,
        the drafter picked at run time (`drafters.pool`; same tokens as the drafter alone);
        dynamic_draft_n (with max_block) compiles one loop for every draft_n_max < max_block, the
        verify block max_block wide and draft_n_max a run-time bound (greedy: the same tokens);
        prefill_chunk prefills in chunks of that many tokens, one program for every prompt length (None:
        prompts longer than `options.LONG_PROMPT_CHUNK` tokens in chunks of that many).
    backends: the kernels (a `Backends`, or "auto" | "reference" | "pallas"; default: the config's).

    Returns a `Generated`: .tokens (list of int lists) and .stats (dict: rounds, drafted, accepted,
    per-position acceptance, mean accepted length incl. the bonus token, draft acceptance rate, wall time
    (prefill_s + decode_s), tokens/s; RunShape.round_trace: per_round_accepted / per_round_drafted), the
    main numbers also as attributes; `tokens, stats = generate(...)` unpacks it.
    """
    r = prepare(params, config, prompt_tokens, max_new_tokens, sampling=sampling, speculation=speculation, run=run,
                backends=backends, **options)
    r, table, how = priced(params, r, r.cost_table)
    t0 = time.perf_counter()
    carry = jax.block_until_ready(start_plan(params, r))
    t1 = time.perf_counter()
    carry = jax.block_until_ready(decode(params, r.config, carry, r.knobs, r.program, r.host_loop))
    t2 = time.perf_counter()
    out, n = to_host((carry.out, carry.out_len))
    stats = summarize(carry, r.program, t2 - t0, r.draft_n)
    stats.update(prefill_s=t1 - t0, decode_s=t2 - t1)   # the first token comes from the prefill
    if table is not None:
        stats["cost_table"] = dict(table.to_json(), how=how)
    return Generated([out[b, :n[b]].tolist() for b in range(out.shape[0])], stats)
