"""`generate`: prompt tokens in, generated tokens and speculative-decoding statistics out.

Options come in three groups (`spec.options`: Sampling, Speculation, RunShape) or as their published
keywords; the config may be a `ModelConfig` or the bundle `load_checkpoint` returns (DSpark's settings
then come from the checkpoint); `backends=` picks the kernels (`dsv4_jax.backends`), resolved here,
before anything is traced.
"""
from __future__ import annotations

import functools
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..backends import Backends
from ..bundle import CheckpointConfig, unbundle
from ..model.state import init_state
from ..config import ModelConfig
from ..model.decode import CapacityError, advance, process_block
from ..drafters import pool, registry
from ..ops.sampling import sample_first
from ..ops.verification import RULES, expected_accepted
from .loop import Carry, Knobs, Options, initial_carry, run_rounds, run_rounds_python
from .options import RunShape, Sampling, Speculation, group_options

NO_DRAFTER = (None, "none")


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
    if spec.drafter not in NO_DRAFTER and spec.draft_n_max < 1:
        raise ValueError(f"draft_n_max must be >= 1 with a drafter, got {spec.draft_n_max}")
    if sp.temperature < 0 or not 0 < sp.top_p <= 1 or not 0 <= spec.p_min <= 1:
        raise ValueError(f"need temperature >= 0, 0 < top_p <= 1, 0 <= p_min <= 1 "
                         f"(got {sp.temperature}, {sp.top_p}, {spec.p_min})")
    if not 0 <= spec.confidence_threshold <= 1:
        raise ValueError(f"confidence_threshold must be in [0, 1], got {spec.confidence_threshold}")
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


@functools.partial(jax.jit, static_argnames=("config", "max_len", "max_block", "taps"))
def prefill_target(params: dict, config: ModelConfig, tokens: jax.Array, lengths: jax.Array, *, max_len: int,
                   max_block: int, taps: tuple[int, ...]):
    """The target's prefill of right-padded prompts tokens [B,S] (lengths [B] real ones), one jit.

    Returns (state advanced by lengths, logits at each prompt's last position [B,V], aux {"hidden"
    [B,S,n,D], "taps" [B,S,len(taps),D]}). Nothing here depends on the drafter or on k, so runs with
    the same shapes and taps share this program (`RunShape.max_block`, `RunShape.drafter_pool`)."""
    state = init_state(config, tokens.shape[0], max_len, max_block, params["embed"].dtype)
    n = jnp.asarray(lengths)
    logits, state, aux = process_block(params, config, state, jnp.asarray(tokens), n, taps)
    last_logits = jnp.take_along_axis(logits, (n - 1)[:, None, None], axis=1)[:, 0]
    return advance(state, n), last_logits, aux


@functools.partial(jax.jit, static_argnames=("config", "batch", "max_len", "max_block", "dtype"))
def empty_prefill(config: ModelConfig, *, batch: int, max_len: int, max_block: int, dtype):
    """A chunked prefill's start: (an empty state, last logits [B,V] zeros in dtype) (one small jit)."""
    return init_state(config, batch, max_len, max_block, dtype), jnp.zeros((batch, config.vocab_size), dtype)


@functools.partial(jax.jit, static_argnames=("config", "taps"), donate_argnames=("state", "last_logits"))
def prefill_piece(params: dict, config: ModelConfig, state, last_logits: jax.Array, tokens: jax.Array,
                  n_valid: jax.Array, final: jax.Array, *, taps: tuple[int, ...]):
    """One chunk of a chunked prefill (one jit for every prompt length): tokens [B,C] at state.pos, n_valid [B]
    real ones (0 for a prompt that ended in an earlier chunk). -> (state advanced by n_valid, last_logits
    [B,V] replaced by the logits at each row's last token where final [B] (its prompt ends here), aux of
    the chunk {"hidden" [B,C,n,D], "taps" [B,C,len(taps),D]})."""
    logits, state, aux = process_block(params, config, state, tokens, n_valid, taps)
    at = jnp.take_along_axis(logits, jnp.maximum(n_valid - 1, 0)[:, None, None], axis=1)[:, 0]
    return advance(state, n_valid), jnp.where(final[:, None], at.astype(last_logits.dtype), last_logits), aux


def chunk_plan(lengths: np.ndarray, chunk: int, width: int) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """The chunks of a prefill of prompts lengths [B] padded to width: [(start, n_valid [B], final [B])]."""
    return [(lo, np.clip(lengths - lo, 0, chunk).astype(np.int32), (lengths > lo) & (lengths <= lo + chunk))
            for lo in range(0, max(width, 1), chunk)]


def prefill_chunked(params: dict, config: ModelConfig, tokens, lengths, *, max_len: int, max_block: int,
                    taps: tuple[int, ...], chunk: int):
    """`prefill_target` as ⌈S/chunk⌉ calls of one `prefill_piece` program (`RunShape.prefill_chunk`): prompts
    of every padded length S share it. The same math as the one-shot prefill (a block's rows are written
    and committed chunk by chunk, decode.py). Returns (state, last logits [B,V] in the embedding's dtype,
    pieces: [(start, n_valid [B], aux of the chunk)] in order, what `prime_piece` feeds the drafter)."""
    tokens, lengths = np.asarray(tokens, np.int32), np.asarray(lengths, np.int32)
    B, S = tokens.shape
    padded = np.zeros((B, -(-S // chunk) * chunk), np.int32)
    padded[:, :S] = tokens
    state, last = empty_prefill(config, batch=B, max_len=max_len, max_block=max_block, dtype=params["embed"].dtype)
    pieces = []
    for lo, n_valid, final in chunk_plan(lengths, chunk, S):
        state, last, aux = prefill_piece(params, config, state, last, jnp.asarray(padded[:, lo:lo + chunk]),
                                         jnp.asarray(n_valid), jnp.asarray(final), taps=taps)
        pieces.append((lo, n_valid, aux))
    return state, last, pieces


def next_tokens(tokens: np.ndarray, width: int) -> np.ndarray:
    """The token after each prompt position, [B,S] -> [B,width] (the prompt shifted left, zero-padded); the
    position of each prompt's last token gets the first generated token later (`_observe_prompt`)."""
    out = np.zeros((tokens.shape[0], width), np.int32)
    out[:, :tokens.shape[1] - 1] = tokens[:, 1:]
    return out


def _first_carry(params: dict, config: ModelConfig, state, last_logits: jax.Array, *, max_len: int, opts: Options,
                 knobs: Knobs, key) -> Carry:
    """The first token sampled from the prompts' last logits [B,V], emitted into a fresh carry whose drafter
    state is the run's start (`begin`), not yet primed."""
    drafter = registry.get(opts.drafter)
    B = last_logits.shape[0]
    key, k_first = jax.random.split(key)
    first = sample_first(k_first, last_logits, knobs.temperature, knobs.top_p, opts.greedy)
    dstate = drafter.begin(params, config, opts.setup, B, max_len, params["embed"].dtype, knobs)
    return initial_carry(first, state, dstate, key, opts)


def _observe_prompt(params: dict, config: ModelConfig, c: Carry, aux: dict, nxt: jax.Array, start: jax.Array,
                    n_valid: jax.Array, lengths: jax.Array, *, opts: Options, prefill_taps: tuple[int, ...]) -> Carry:
    """Prime the drafter on prompt positions start + [0, C) (n_valid [B] real ones): aux of those positions
    (its "taps" hold prefill_taps; the drafter reads its own opts.taps among them), nxt [B,C] the token after
    each, the first generated token (c.last) put at each prompt's last position (lengths [B])."""
    C = nxt.shape[1]
    at = start[:, None] + jnp.arange(C, dtype=jnp.int32)[None, :]
    nxt = jnp.where(at == (lengths - 1)[:, None], c.last[:, None], nxt)
    aux = {"hidden": aux["hidden"], "taps": aux["taps"][:, :, [prefill_taps.index(t) for t in opts.taps]]}
    return c.replace(drafter=registry.get(opts.drafter).observe(params, config, opts.setup, c.drafter, aux, nxt,
                                                                start, n_valid))


@functools.partial(jax.jit, static_argnames=("config", "max_len", "opts", "prefill_taps"), donate_argnames=("state",))
def prime(params: dict, config: ModelConfig, state, last_logits: jax.Array, aux: dict, tokens: jax.Array,
          lengths: jax.Array, *, max_len: int, opts: Options, prefill_taps: tuple[int, ...], knobs: Knobs,
          key) -> Carry:
    """Sample the first token, prime the drafter on the whole prompt tokens [B,S] and build the loop's
    initial carry (one jit; the chunked prefill primes with `prime_start` and `prime_piece` instead).

    opts.k sizes the carry (statistics [B,k], output room, the drafter's state): `start` passes the run's
    bound (max_block − 1), so every draft_n_max up to it shares this program. aux["taps"] holds
    prefill_taps; the drafter reads its own opts.taps among them."""
    B, S = tokens.shape
    c = _first_carry(params, config, state, last_logits, max_len=max_len, opts=opts, knobs=knobs, key=key)
    nxt = jnp.concatenate([jnp.asarray(tokens)[:, 1:], jnp.zeros((B, 1), jnp.int32)], axis=1)
    n = jnp.asarray(lengths)
    return _observe_prompt(params, config, c, aux, nxt, jnp.zeros((B,), jnp.int32), n, n, opts=opts,
                           prefill_taps=prefill_taps)


@functools.partial(jax.jit, static_argnames=("config", "max_len", "opts"), donate_argnames=("state",))
def prime_start(params: dict, config: ModelConfig, state, last_logits: jax.Array, *, max_len: int, opts: Options,
                knobs: Knobs, key) -> Carry:
    """A chunked prefill's priming, first part: the first token sampled, the loop's initial carry with the
    drafter's start state (one small jit for every prompt length; `prime_piece` then feeds the chunks)."""
    return _first_carry(params, config, state, last_logits, max_len=max_len, opts=opts, knobs=knobs, key=key)


@functools.partial(jax.jit, static_argnames=("config", "opts", "prefill_taps"), donate_argnames=("carry",))
def prime_piece(params: dict, config: ModelConfig, carry: Carry, aux: dict, nxt: jax.Array, start: jax.Array,
                n_valid: jax.Array, lengths: jax.Array, *, opts: Options, prefill_taps: tuple[int, ...]) -> Carry:
    """Prime the drafter on one prefill chunk (one jit for every prompt length): aux of the chunk
    {"hidden" [B,C,n,D], "taps" [B,C,len(prefill_taps),D]} at positions start [B] + [0, C), n_valid [B] real
    ones (0: the row's prompt ended earlier), nxt [B,C] the prompt's next tokens (`next_tokens`)."""
    return _observe_prompt(params, config, carry, aux, nxt, start, n_valid, lengths, opts=opts,
                           prefill_taps=prefill_taps)


def start(params: dict, config: ModelConfig, tokens: jax.Array, lengths: jax.Array, *, max_len: int,
          opts: Options, knobs: Knobs, key, max_block: int | None = None, prefill_taps: tuple | None = None,
          prefill_chunk: int | None = None) -> Carry:
    """Prefill the prompts, sample the first token, and prime the drafter: the loop's initial carry.

    Two jits: `prefill_target` (the target alone) and `prime` (first token, drafter, carry). max_block
    (default opts.k + 1) sizes the decode state and the carry for verify blocks up to that width;
    prefill_taps (default opts.taps, must contain them) are the tap layers the prefill computes;
    prefill_chunk: the prefill as chunks of that many tokens (`prefill_chunked`), then the priming as
    `prime_start` and one `prime_piece` per chunk: one program each for every prompt length."""
    max_block = opts.k + 1 if max_block is None else max_block
    prefill_taps = tuple(opts.taps) if prefill_taps is None else tuple(prefill_taps)
    if max_block < opts.k + 1 or not set(opts.taps) <= set(prefill_taps):
        raise ValueError(f"max_block {max_block} / prefill taps {prefill_taps} do not cover k={opts.k}, "
                         f"taps {opts.taps}")
    opts = opts.replace(k=max_block - 1)
    if prefill_chunk is None:
        state, last_logits, aux = prefill_target(params, config, tokens, lengths, max_len=max_len,
                                                 max_block=max_block, taps=prefill_taps)
        return prime(params, config, state, last_logits, aux, tokens, lengths, max_len=max_len, opts=opts,
                     prefill_taps=prefill_taps, knobs=knobs, key=key)
    state, last_logits, pieces = prefill_chunked(params, config, tokens, lengths, max_len=max_len,
                                                 max_block=max_block, taps=prefill_taps, chunk=prefill_chunk)
    carry = prime_start(params, config, state, last_logits, max_len=max_len, opts=opts, knobs=knobs, key=key)
    nxt = next_tokens(np.asarray(tokens, np.int32), len(pieces) * prefill_chunk)
    lengths = jnp.asarray(lengths, jnp.int32)
    for lo, n_valid, aux in pieces:
        carry = prime_piece(params, config, carry, aux, jnp.asarray(nxt[:, lo:lo + prefill_chunk]),
                            jnp.full(n_valid.shape, lo, jnp.int32), jnp.asarray(n_valid), lengths, opts=opts,
                            prefill_taps=prefill_taps)
    return carry


def summarize(c: Carry, opts: Options, wall_s: float, k: int | None = None) -> dict[str, Any]:
    """Statistics of a finished run (docs/drafter_math.md §4.1 definitions); per-sequence arrays as lists.

    k: the run's drafts per round (default opts.k; less when the loop was compiled for a wider bound,
    `RunShape.dynamic_draft_n`)."""
    s = jax.tree.map(np.asarray, c.stats)
    k = opts.k if k is None else k  # the carry may be sized for a wider bound (RunShape.max_block): trim
    s = s.replace(per_position=s.per_position[:, :k], proposed_at=s.proposed_at[:, :k],
                  length_hist=s.length_hist[:, :k + 1])
    n_out = np.asarray(c.out_len)
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
    }


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


def prepare(params: dict, config: ModelConfig | CheckpointConfig, prompt_tokens, max_new_tokens: int, *,
            sampling: Sampling | None = None, speculation: Speculation | None = None, run: RunShape | None = None,
            backends: Backends | str | None = None, **options) -> Prepared:
    """Validate the options (groups and / or published keywords, see `spec.options`) and build a run."""
    sp, spec, shape = group_options(sampling, speculation, run, **options)
    config, bundle_meta = unbundle(config, backends)
    drafter = registry.get(spec.drafter)
    tokens, lengths = _pad_prompts(prompt_tokens)
    if shape.pad_to is not None:
        if tokens.shape[1] > shape.pad_to:
            raise ValueError(f"a prompt has {tokens.shape[1]} tokens, more than pad_to={shape.pad_to}")
        tokens = np.pad(tokens, ((0, 0), (0, shape.pad_to - tokens.shape[1])))
    _validate(config, tokens, max_new_tokens, sp, spec)
    meta = dict(bundle_meta)
    if spec.dspark_meta is not None:            # the published keyword for DSpark's settings
        meta["dspark"] = spec.dspark_meta
    if shape.prefill_chunk is not None and shape.prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1 tokens, got {shape.prefill_chunk}")
    dynamic = shape.dynamic_draft_n and drafter.name != "none"
    if dynamic and shape.max_block is None:
        raise ValueError("dynamic_draft_n needs max_block: the verify width the loop is compiled for")
    # the program's drafts per round: the run's, or the bound max_block - 1 (dynamic_draft_n)
    k_program = shape.max_block - 1 if dynamic else max(spec.draft_n_max, 1)
    pool_setup = registry.get(pool.NAME).configure(params, config, k_program,
                                                   {**meta, "members": tuple(shape.drafter_pool)}) \
        if shape.drafter_pool else None
    if pool_setup is not None and drafter.name != "none":
        if drafter.name not in pool.member_names(pool_setup):
            raise ValueError(f"drafter {drafter.name!r} is not in drafter_pool {tuple(shape.drafter_pool)}")
        setup, index = pool_setup, pool.member_names(pool_setup).index(drafter.name)
        run_drafter, drafter = drafter, registry.get(pool.NAME)
    else:
        setup, index, run_drafter = drafter.configure(params, config, k_program, meta.get(drafter.name)), 0, drafter
    k = setup.k
    # the run's drafts per round (a drafter may cap draft_n_max: DSpark at its block size)
    draft_n = run_drafter.configure(params, config, spec.draft_n_max, meta.get(run_drafter.name)).k if dynamic else k
    if draft_n > k:
        raise ValueError(f"draft_n_max={spec.draft_n_max} needs verify blocks wider than max_block={shape.max_block}")
    max_block = shape.max_block or k + 1
    if max_block < k + 1:
        raise ValueError(f"max_block={max_block} is narrower than a verify block of draft_n_max {k} (+1)")
    need = tokens.shape[1] + max_new_tokens + max_block
    max_len = shape.max_len or need
    if need > max_len:
        raise CapacityError(f"prompt ({tokens.shape[1]}) + max_new_tokens ({max_new_tokens}) + a verify block "
                            f"({max_block}) needs {need} positions, more than max_len={max_len}")
    eos = config.eos_token_id if shape.eos_token_id is None else shape.eos_token_id
    opts = Options(drafter=drafter.name, k=k, greedy=sp.temperature == 0, max_new_tokens=max_new_tokens,
                   eos_token_id=int(eos), taps=setup.taps, settings=setup.settings,
                   # greedy and synthetic runs ignore the rule: one program for both (docs/verification.md §2)
                   verify=spec.verify if sp.temperature > 0 and spec.synthetic_accept is None else "token",
                   synthetic_accept=synthetic_rates(spec.synthetic_accept))
    knobs = Knobs(temperature=jnp.float32(max(sp.temperature, 1e-6)), top_p=jnp.float32(sp.top_p),
                  p_min=jnp.float32(spec.p_min), confidence=jnp.float32(spec.confidence_threshold),
                  drafter_index=jnp.int32(index), draft_n=jnp.int32(draft_n) if dynamic else None)
    prefill_taps = pool_setup.taps if pool_setup is not None else setup.taps
    return Prepared(config, tokens, lengths, opts, knobs, max_len, sp.seed, shape.host_loop, max_block, prefill_taps,
                    draft_n, shape.prefill_chunk)


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
      speculation=Speculation(drafter=None, draft_n_max=3, p_min=0.0, confidence_threshold=0.0,
        dspark_meta=None): drafter None | "mtp" | "dspark" (| "oracle" for tests; any name registered in
        `dsv4_jax.drafters.registry`); draft_n_max drafts per round (for DSpark ≤ its block size); p_min
        stops the MTP chain before a draft whose top-1 probability is below it; confidence_threshold is
        DSpark's cut-off; dspark_meta overrides the bundle's DSpark settings (a DSparkConfig).
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
        prefill_chunk prefills in chunks of that many tokens, one program for every prompt length.
    backends: the kernels (a `Backends`, or "auto" | "reference" | "pallas"; default: the config's).

    Returns (tokens: list of int lists, stats dict: rounds, drafted, accepted, per-position
    acceptance, mean accepted length incl. the bonus token, draft acceptance rate, wall time
    (prefill_s + decode_s), tokens/s).
    """
    r = prepare(params, config, prompt_tokens, max_new_tokens, sampling=sampling, speculation=speculation, run=run,
                backends=backends, **options)
    t0 = time.perf_counter()
    carry = jax.block_until_ready(start(params, r.config, jnp.asarray(r.tokens), jnp.asarray(r.lengths),
                                        max_len=r.max_len, opts=r.opts, knobs=r.knobs, key=jax.random.PRNGKey(r.seed),
                                        max_block=r.max_block, prefill_taps=r.prefill_taps,
                                        prefill_chunk=r.prefill_chunk))
    t1 = time.perf_counter()
    loop = run_rounds_python if r.host_loop else run_rounds
    carry = jax.block_until_ready(loop(params, r.config, carry, r.knobs, r.opts))
    t2 = time.perf_counter()
    out, n = np.asarray(carry.out), np.asarray(carry.out_len)
    stats = summarize(carry, r.opts, t2 - t0, r.draft_n)
    stats.update(prefill_s=t1 - t0, decode_s=t2 - t1)   # the first token comes from the prefill
    return [out[b, :n[b]].tolist() for b in range(out.shape[0])], stats
