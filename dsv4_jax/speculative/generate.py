"""`generate`: prompt tokens in, generated tokens and speculative-decoding statistics out.

Options come in three groups (`speculative.options`: Sampling, Speculation, RunShape) or as their published
keywords, the drafter's own options (`Speculation.options`) as keywords too; the config may be a
`ModelConfig` or the bundle `load_checkpoint` returns (DSpark's settings then come from the checkpoint);
`backends=` picks the kernels (`dsv4_jax.backends`), resolved here, before anything is traced. The
prefill and the drafter priming are `speculative.prefill`'s (shared with the slot engine).
"""
from __future__ import annotations

import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..backends import Backends
from ..bundle import CheckpointConfig, unbundle
from ..config import ModelConfig
from ..model.decode import CapacityError
from ..drafters import pool, registry
from ..drafters.base import MODE_AUTO, MODE_FIXED
from .cost_table import CostTable, as_table, cached_or_calibrate
from .loop import Carry, Knobs, Options, run_rounds, run_rounds_python
from ..ops.host import to_host
from ..ops.verification import RULES, expected_accepted
from .options import LONG_PROMPT_CHUNK, RunShape, Sampling, Speculation, group_options
from .prefill import (chunk_plan, init_rows, next_tokens, prefill_piece, prefill_target, prime, prime_piece,  # noqa: F401
                      start, start_carry)

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


def summarize(c: Carry, opts: Options, wall_s: float, k: int | None = None) -> dict[str, Any]:
    """Statistics of a finished run (docs/drafter_math.md §4.1 definitions); per-sequence arrays as lists.

    k: the run's drafts per round (default opts.k; less when the loop was compiled for a wider bound,
    `RunShape.dynamic_draft_n`)."""
    s = to_host(c.stats)
    k = opts.k if k is None else k  # the carry may be sized for a wider bound (RunShape.max_block): trim
    s = s.replace(per_position=s.per_position[:, :k], proposed_at=s.proposed_at[:, :k],
                  length_hist=s.length_hist[:, :k + 1])
    n_out = to_host(c.out_len)
    rounds, drafted, accepted = int(s.rounds.sum()), int(s.drafted.sum()), int(s.accepted.sum())
    return {
        "drafter": opts.drafter, "draft_n_max": k, "rounds": rounds, "drafted": drafted, "accepted": accepted,
        "generated": int(n_out.sum()), "per_sequence_generated": n_out.tolist(),
        "per_position_accepted": s.per_position.sum(0).tolist(),
        "per_position_proposed": s.proposed_at.sum(0).tolist(),
        "draft_length_histogram": s.length_hist.sum(0).tolist(),     # rounds by drafts proposed (0..k)
        # accept_rate@j: rounds whose draft j was accepted / rounds that proposed a draft j
        "per_position_accept_rate": [float(a / p) if p else 0.0 for a, p in
                                     zip(s.per_position.sum(0), s.proposed_at.sum(0))],
        "mean_accepted_length": (accepted + rounds) / rounds if rounds else 0.0,   # includes the bonus token
        "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
        "per_sequence": {"rounds": s.rounds.tolist(), "drafted": s.drafted.tolist(), "accepted": s.accepted.tolist()},
        "wall_s": wall_s, "tokens_per_s": float(n_out.sum()) / wall_s if wall_s > 0 else 0.0,
        **verification_summary(s, opts, k),
        **width_summary(s, k),
    }


def width_summary(s, k: int) -> dict[str, Any]:
    """The width scheduler's statistics (docs/width_scheduler.md): rounds per verified width (0..k, then
    "plain": rounds without the drafter) and the expected vs realised tokens per round; s: numpy Stats."""
    if s.width_hist is None:
        return {}
    hist = s.width_hist.sum(0)
    rounds = int(s.rounds.sum())
    return {"width_histogram": {**{str(w): int(hist[w]) for w in range(k + 1)}, "plain": int(hist[-1])},
            "expected_tokens_per_round": float(s.predicted.sum()) / rounds if rounds else 0.0,
            "modelled_cost_s": float(s.cost_sum.sum())}


def verification_summary(s, opts: Options, k: int) -> dict[str, Any]:
    """The verify rule's statistics (docs/verification.md): analytic beside empirical per-position acceptance,
    per-request acceptance histograms (vLLM's names), DSpark confidence bins; s: numpy Stats."""
    if s.expected_at is None:
        return {}
    prop = s.proposed_at.sum(0)
    rate = lambda x: [float(a / p) if p else 0.0 for a, p in zip(x, prop)]
    rounds = int(s.rounds.sum())
    out = {"verify": "synthetic" if opts.synthetic_accept else ("greedy" if opts.greedy else opts.verify),
           "acceptance": "synthetic" if opts.synthetic_accept else ("forced" if opts.forced_acceptance else "real"),
           "synthetic_accept": list(opts.synthetic_accept) if opts.synthetic_accept else None,
           "per_position_expected_accept_rate": rate(s.expected_at[:, :k].sum(0)),
           "per_position_alpha": rate(s.alpha_at[:, :k].sum(0)),
           "expected_mean_accepted_length": (float(s.expected_at.sum()) + rounds) / rounds if rounds else 0.0,
           "acceptance_histogram": s.accept_hist[:, :k + 1].sum(0).tolist(),
           # vLLM's per-request spec-decode counters (num_drafts, num_draft_tokens, num_accepted_tokens,
           # num_accepted_tokens_per_pos) plus the histogram of accepted drafts per round (0..k)
           "per_request": [{"num_drafts": int(s.rounds[b]), "num_draft_tokens": int(s.drafted[b]),
                            "num_accepted_tokens": int(s.accepted[b]),
                            "num_accepted_tokens_per_pos": s.per_position[b, :k].tolist(),
                            "acceptance_histogram": s.accept_hist[b, :k + 1].tolist()}
                           for b in range(s.rounds.shape[0])]}
    if opts.synthetic_accept:
        out["synthetic_expected_mean_accepted_length"] = 1.0 + expected_accepted(opts.synthetic_accept, k)
    if s.calib[:, :k].sum() > 0:
        out["calibration"] = {"bins": s.calib[:, :k].sum(0).tolist(), "brier_sum": s.brier_at[:, :k].sum(0).tolist()}
    return out


class Prepared(NamedTuple):
    """A validated run: what `start` and the loop take."""

    config: ModelConfig          # the target config, backends resolved
    tokens: np.ndarray           # [B,S] right-padded prompts
    lengths: np.ndarray          # [B]
    opts: Options
    knobs: Knobs
    max_len: int
    seed: int
    host_loop: bool
    max_block: int               # the decode state's and carry's widest verify block (>= opts.k + 1)
    prefill_taps: tuple          # tap layers the prefill computes (contains opts.taps)
    draft_n: int                 # the run's drafts per round (< opts.k under RunShape.dynamic_draft_n)
    prefill_chunk: int | None = None   # the prefill in chunks of this many tokens (RunShape.prefill_chunk)
    cost_table: Any = None             # Speculation.cost_table (auto runs; `priced`)


def prepare(params: dict, config: ModelConfig | CheckpointConfig, prompt_tokens, max_new_tokens: int, *,
            sampling: Sampling | None = None, speculation: Speculation | None = None, run: RunShape | None = None,
            backends: Backends | str | None = None, **options) -> Prepared:
    """Validate the options (groups and / or published keywords, see `speculative.options`) and build a run."""
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
    max_block_given = shape.max_block
    if auto and max_block_given is None:
        max_block_given = spec.draft_n_max_bound + 1
    if dynamic and max_block_given is None:
        raise ValueError("dynamic_draft_n needs max_block: the verify width the loop is compiled for")
    n_run = spec.draft_n_max_bound if auto else spec.draft_n_max
    # the program's drafts per round: the run's, or the bound max_block - 1 (dynamic_draft_n)
    k_program = max_block_given - 1 if dynamic else max(n_run, 1)
    setup = drafter.configure(params, config, k_program, dopts, bundle)
    k = setup.k
    # the run's drafts per round (a drafter may cap draft_n_max: DSpark at its block size)
    draft_n = drafter.configure(params, config, n_run, dopts, bundle).k if dynamic else k
    if draft_n > k:
        raise ValueError(f"draft_n_max={n_run} needs verify blocks wider than max_block={max_block_given}")
    max_block = max_block_given or k + 1
    if max_block < k + 1:
        raise ValueError(f"max_block={max_block} is narrower than a verify block of draft_n_max {k} (+1)")
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
    opts = Options(drafter=drafter.name, k=k, greedy=sp.temperature == 0, max_new_tokens=max_new_tokens,
                   eos_token_id=int(eos), taps=setup.taps, settings=setup.settings,
                   # greedy and synthetic runs ignore the rule: one program for both (docs/verification.md §2)
                   verify=spec.verify if sp.temperature > 0 and spec.synthetic_accept is None else "token",
                   synthetic_accept=synthetic_rates(spec.synthetic_accept), adaptive=adaptive)
    knobs = Knobs(temperature=jnp.float32(max(sp.temperature, 1e-6)), top_p=jnp.float32(sp.top_p),
                  drafter=drafter.knobs(dopts), draft_n=jnp.int32(draft_n) if dynamic else None)
    if adaptive:
        knobs = width_knobs(knobs, as_table(spec.cost_table) if auto else None, k, auto)
    prefill_taps = setup.taps
    if shape.drafter_pool and drafter.name == "none":    # share the pool's runs' prefill program
        members = tuple(shape.drafter_pool)
        prefill_taps = registry.get(pool.NAME).configure(params, config, k_program,
                                                         pool.PoolOptions(members, members[0]), bundle).taps
    return Prepared(config, tokens, lengths, opts, knobs, max_len, sp.seed, shape.host_loop, max_block, prefill_taps,
                    draft_n, chunk, spec.cost_table)


def width_knobs(knobs: Knobs, table: CostTable | None, k: int, auto: bool) -> Knobs:
    """The width scheduler's knobs: MODE_AUTO priced by the table (None: unit costs, to be replaced by a
    calibration before the run) or MODE_FIXED (the table unused)."""
    n = int(knobs.draft_n)
    cost, plain = table.costs(n) if table is not None else (np.ones((n + 1,), np.float32), np.float32(1.0))
    cost = np.pad(cost, (0, k - n), constant_values=np.float32(1e9))   # widths beyond the run's bound: never
    return knobs.replace(width_mode=jnp.int32(MODE_AUTO if auto else MODE_FIXED), width_cost=jnp.asarray(cost),
                         plain_cost=jnp.asarray(plain))


def priced(params: dict, r: Prepared, table, progress=None) -> tuple[Prepared, CostTable | None, str | None]:
    """An auto run with its cost table: the given one, or the cached / freshly measured one for this machine
    and the run's shapes (`cost_table.cached_or_calibrate`). -> (run, table, "given" | "cached" | "measured")."""
    if not r.opts.adaptive or int(r.knobs.width_mode) != MODE_AUTO:
        return r, None, None
    table, how = (as_table(table), "given") if table is not None else \
        cached_or_calibrate(params, r.config, r, progress=progress)
    return r._replace(knobs=width_knobs(r.knobs, table, r.opts.k, True)), table, how


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

    Returns (tokens: list of int lists, stats dict: rounds, drafted, accepted, per-position
    acceptance, mean accepted length incl. the bonus token, draft acceptance rate, wall time
    (prefill_s + decode_s), tokens/s).
    """
    r = prepare(params, config, prompt_tokens, max_new_tokens, sampling=sampling, speculation=speculation, run=run,
                backends=backends, **options)
    r, table, how = priced(params, r, r.cost_table)
    t0 = time.perf_counter()
    carry = jax.block_until_ready(start(params, r.config, jnp.asarray(r.tokens), jnp.asarray(r.lengths),
                                        max_len=r.max_len, opts=r.opts, knobs=r.knobs, key=jax.random.PRNGKey(r.seed),
                                        max_block=r.max_block, prefill_taps=r.prefill_taps,
                                        prefill_chunk=r.prefill_chunk))
    t1 = time.perf_counter()
    loop = run_rounds_python if r.host_loop else run_rounds
    carry = jax.block_until_ready(loop(params, r.config, carry, r.knobs, r.opts))
    t2 = time.perf_counter()
    out, n = to_host((carry.out, carry.out_len))
    stats = summarize(carry, r.opts, t2 - t0, r.draft_n)
    stats.update(prefill_s=t1 - t0, decode_s=t2 - t1)   # the first token comes from the prefill
    if table is not None:
        stats["cost_table"] = dict(table.to_json(), how=how)
    return [out[b, :n[b]].tolist() for b in range(out.shape[0])], stats
