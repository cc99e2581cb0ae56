"""`generate`: prompt tokens in, generated tokens and speculative-decoding statistics out."""
from __future__ import annotations

import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..cache import init_state
from ..config import ModelConfig
from ..decode import CapacityError, advance, process_block
from . import sampling
from .loop import Carry, Knobs, Options, Stats, run_rounds, run_rounds_python

DRAFTERS = (None, "mtp", "dspark", "oracle")


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


def _validate(config, tokens, drafter, draft_n_max, max_new_tokens, temperature, top_p, p_min, params,
              confidence_threshold=0.0):
    if drafter not in DRAFTERS:
        raise ValueError(f"drafter must be one of {DRAFTERS}, got {drafter!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if drafter is not None and draft_n_max < 1:
        raise ValueError(f"draft_n_max must be >= 1 with a drafter, got {draft_n_max}")
    if temperature < 0 or not 0 < top_p <= 1 or not 0 <= p_min <= 1:
        raise ValueError(f"need temperature >= 0, 0 < top_p <= 1, 0 <= p_min <= 1 "
                         f"(got {temperature}, {top_p}, {p_min})")
    if tokens.min() < 0 or tokens.max() >= config.vocab_size:
        raise ValueError(f"prompt token ids must be in [0, {config.vocab_size})")
    if drafter == "mtp" and not params.get("mtp"):
        raise ValueError("drafter='mtp' needs MTP weights in params['mtp'] (a checkpoint with an MTP block)")
    if drafter == "dspark" and not 0 <= confidence_threshold <= 1:
        raise ValueError(f"confidence_threshold must be in [0, 1], got {confidence_threshold}")
    if drafter == "oracle" and "oracle" not in params:
        raise ValueError("drafter='oracle' needs params['oracle'] = {'tokens': [B,T], 'wrong': [B,k]}")
    if drafter == "dspark" and "dspark" not in params:
        raise ValueError("drafter='dspark' needs DSpark weights in params['dspark']")


@functools.partial(jax.jit, static_argnames=("config", "max_len", "opts"))
def start(params: dict, config: ModelConfig, tokens: jax.Array, lengths: jax.Array, *, max_len: int,
          opts: Options, knobs: Knobs, key) -> Carry:
    """Prefill the prompts, sample the first token, and prime the drafter: the loop's initial carry (one jit)."""
    from ..drafters import mtp
    B = tokens.shape[0]
    k = opts.k
    dtype = params["embed"].dtype
    state = init_state(config, B, max_len, k + 1, dtype)
    n = jnp.asarray(lengths)
    logits, state, aux = process_block(params, config, state, jnp.asarray(tokens), n, opts.taps)
    state = advance(state, n)
    key, k_first = jax.random.split(key)
    last_logits = jnp.take_along_axis(logits, (n - 1)[:, None, None], axis=1)[:, 0]
    first = sampling.sample_first(k_first, last_logits, knobs.temperature, knobs.top_p, opts.greedy)
    # the token after each prompt position: the prompt shifted left, then the first generated token
    nxt = jnp.concatenate([jnp.asarray(tokens)[:, 1:], jnp.zeros((B, 1), jnp.int32)], axis=1)
    nxt = jnp.where(jnp.arange(tokens.shape[1])[None, :] == (n - 1)[:, None], first[:, None], nxt)
    zero = jnp.zeros((B,), jnp.int32)
    if opts.drafter == "mtp":
        dstate = mtp.init(config, B, max_len, k + 1, dtype)
        dstate = mtp.observe(params["mtp"][0], params, config, dstate, aux["hidden"], nxt, zero, n)
    elif opts.drafter == "dspark":
        from ..drafters import dspark
        dstate = dspark.init(params["dspark"], config, B, dtype)
        dstate = dspark.observe(params["dspark"], params, config, dstate, aux["taps"], zero, n)
    else:
        dstate = ()
    out = jnp.full((B, opts.max_new_tokens + k + 1), -1, jnp.int32)
    fresh = lambda *shape: jnp.zeros(shape, jnp.int32)   # distinct buffers: the carry is donated
    c = Carry(out=out, out_len=fresh(B), last=first, done=jnp.zeros((B,), bool), target=state, drafter=dstate,
              key=key, stats=Stats(rounds=fresh(B), drafted=fresh(B), accepted=fresh(B), per_position=fresh(B, k),
                                   proposed_at=fresh(B, k), length_hist=fresh(B, k + 1)), round=fresh())
    # the first token is already generated: emit it (it may be EOS, or the whole budget)
    from .loop import _emit
    out, out_len, done, _ = _emit(c, first[:, None], jnp.ones((B,), jnp.int32), opts)
    return c.replace(out=out, out_len=out_len, done=done)


def summarize(c: Carry, opts: Options, wall_s: float) -> dict[str, Any]:
    """Statistics of a finished run (drafters.md §4.1 definitions); per-sequence arrays as lists."""
    s = jax.tree.map(np.asarray, c.stats)
    n_out = np.asarray(c.out_len)
    rounds, drafted, accepted = int(s.rounds.sum()), int(s.drafted.sum()), int(s.accepted.sum())
    return {
        "drafter": opts.drafter, "draft_n_max": opts.k, "rounds": rounds, "drafted": drafted, "accepted": accepted,
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
    }


def prepare(params: dict, config: ModelConfig, prompt_tokens, max_new_tokens: int, *, temperature: float = 0.0,
            top_p: float = 1.0, drafter: str | None = None, draft_n_max: int = 3, p_min: float = 0.0,
            confidence_threshold: float = 0.0, eos_token_id: int | None = None, max_len: int | None = None,
            pad_to: int | None = None, dspark_meta=None):
    """Validate the options and build (tokens [B,S], lengths [B], Options, Knobs, max_len) for a run."""
    tokens, lengths = _pad_prompts(prompt_tokens)
    if pad_to is not None:
        if tokens.shape[1] > pad_to:
            raise ValueError(f"a prompt has {tokens.shape[1]} tokens, more than pad_to={pad_to}")
        tokens = np.pad(tokens, ((0, 0), (0, pad_to - tokens.shape[1])))
    _validate(config, tokens, drafter, draft_n_max, max_new_tokens, temperature, top_p, p_min, params,
              confidence_threshold)
    k = draft_n_max if drafter else 0
    taps, dcfg = (), None
    if drafter == "dspark":
        from ..drafters import dspark
        dcfg = dspark.resolve(config, params["dspark"], dspark_meta)
        taps = dcfg.target_layer_ids
        k = min(k, dcfg.block_size)            # draft_n_max beyond the block size truncates to it
    need = tokens.shape[1] + max_new_tokens + k + 1
    max_len = max_len or need
    if need > max_len:
        raise CapacityError(f"prompt ({tokens.shape[1]}) + max_new_tokens ({max_new_tokens}) + a verify block "
                            f"({k + 1}) needs {need} positions, more than max_len={max_len}")
    eos = config.eos_token_id if eos_token_id is None else eos_token_id
    opts = Options(drafter=drafter or "none", k=k, greedy=temperature == 0, max_new_tokens=max_new_tokens,
                   eos_token_id=int(eos), taps=taps, dspark=dcfg)
    knobs = Knobs(temperature=jnp.float32(max(temperature, 1e-6)), top_p=jnp.float32(top_p),
                  p_min=jnp.float32(p_min), confidence=jnp.float32(confidence_threshold))
    return tokens, lengths, opts, knobs, max_len


def generate(params: dict, config: ModelConfig, prompt_tokens, max_new_tokens: int, *, temperature: float = 0.0,
             top_p: float = 1.0, drafter: str | None = None, draft_n_max: int = 3, p_min: float = 0.0,
             confidence_threshold: float = 0.0, eos_token_id: int | None = None, seed: int = 0,
             max_len: int | None = None, pad_to: int | None = None, host_loop: bool = False, dspark_meta=None):
    """Generate up to max_new_tokens per prompt, optionally with speculative decoding.

    prompt_tokens: list of token lists (ragged) or int array [B,S]. drafter: None | "mtp" | "dspark"
    (| "oracle" for tests). draft_n_max: drafts per round (for DSpark ≤ its block size). p_min: stop
    the MTP chain before a draft whose top-1 probability is below it. confidence_threshold: DSpark
    confidence cut-off. eos_token_id: stop a sequence after it (None: the config's eos; -1: never).
    max_len / pad_to: fix the cache capacity and the padded prompt length, so that runs with other
    prompts reuse the compiled functions. host_loop: drive rounds from Python (debugging twin;
    identical results). Greedy when temperature == 0; otherwise lossless rejection sampling (the
    output distribution equals plain sampling at T and top_p).

    Returns (tokens: list of int lists, stats dict: rounds, drafted, accepted, per-position
    acceptance, mean accepted length incl. the bonus token, draft acceptance rate, wall time
    (prefill_s + decode_s), tokens/s).
    """
    tokens, lengths, opts, knobs, max_len = prepare(
        params, config, prompt_tokens, max_new_tokens, temperature=temperature, top_p=top_p, drafter=drafter,
        draft_n_max=draft_n_max, p_min=p_min, confidence_threshold=confidence_threshold, eos_token_id=eos_token_id,
        max_len=max_len, pad_to=pad_to, dspark_meta=dspark_meta)
    t0 = time.perf_counter()
    carry = jax.block_until_ready(start(params, config, jnp.asarray(tokens), jnp.asarray(lengths), max_len=max_len,
                                        opts=opts, knobs=knobs, key=jax.random.PRNGKey(seed)))
    t1 = time.perf_counter()
    run = run_rounds_python if host_loop else run_rounds
    carry = jax.block_until_ready(run(params, config, carry, knobs, opts))
    t2 = time.perf_counter()
    out, n = np.asarray(carry.out), np.asarray(carry.out_len)
    stats = summarize(carry, opts, t2 - t0)
    stats.update(prefill_s=t1 - t0, decode_s=t2 - t1)   # the first token comes from the prefill
    return [out[b, :n[b]].tolist() for b in range(out.shape[0])], stats
