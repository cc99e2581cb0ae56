"""The host side of slot batching: a request queue over B decode slots (`spec.slots`), static or continuous.

    continuous  between decode chunks, every freed slot takes the next queued request: its prompt is
                prefilled (chunks of `prefill_len` tokens) and its row inserted into the slot; the
                other slots keep their state
    static      the same programs, but slots are refilled only once all B are free: each batch runs
                until its longest sequence ends (what `generate` on consecutive batches does)

Prefill is one request at a time (one row: JetStream's prefill → insert), so a refill costs the same
under both schedules and one prefill program serves every refill. A decode chunk is `slots.run_chunk`: at most `chunk_rounds` speculative rounds, ending early when a
sequence finishes, so that its slot is refilled at once. All requests arrive at time 0; per request
the scheduler records when its prefill started (admitted_s), its first token (first_token_s: time to
first token; the prefill samples it) and when the host saw it finish (finished_s: its latency), its
tokens and its speculative statistics (rounds, drafted, accepted, acceptance per position, accepted
length incl. the bonus token).

    engine = SlotEngine.build(params, config, prompts, max_new_tokens=[...], batch=4, drafter="mtp")
    run = engine.run("continuous")            # RunResult: results in request order, wall_s, tokens_per_s
"""
from __future__ import annotations

import collections
import dataclasses
import math
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..backends import Backends
from ..bundle import CheckpointConfig
from . import slots as S
from .generate import prepare
from .options import RunShape, Sampling, Speculation

SCHEDULES = ("static", "continuous")


@dataclasses.dataclass
class RequestResult:
    """One request's outcome. Times in seconds from the start of the run (every request queued at 0)."""

    index: int
    tokens: list[int]
    max_new_tokens: int
    slot: int
    admitted_chunk: int          # decode chunks run before it was admitted
    admitted_s: float
    first_token_s: float
    finished_s: float
    rounds: int
    drafted: int
    accepted: int
    per_position_accepted: list[int]
    per_position_proposed: list[int]

    @property
    def generated(self) -> int:
        return len(self.tokens)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per round including the bonus token ((accepted + rounds) / rounds; 1 without rounds)."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 1.0

    @property
    def per_position_accept_rate(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.per_position_accepted, self.per_position_proposed)]

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "generated": self.generated, "latency_s": self.finished_s,
                "ttft_s": self.first_token_s, "queue_s": self.admitted_s,
                "mean_accepted_length": self.mean_accepted_length,
                "per_position_accept_rate": self.per_position_accept_rate}


@dataclasses.dataclass
class RunResult:
    schedule: str
    results: list[RequestResult]      # in request order
    wall_s: float
    prefill_s: float                  # time spent admitting requests (prefill + insert, synchronised)
    chunks: int                       # decode chunks run
    rounds: int                       # speculative rounds run (each over all B slots)
    batch: int

    @property
    def generated(self) -> int:
        return sum(r.generated for r in self.results)

    @property
    def tokens_per_s(self) -> float:
        return self.generated / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def slot_utilization(self) -> float:
        """Rounds in which a slot held a running request / (B × rounds run)."""
        return sum(r.rounds for r in self.results) / (self.batch * self.rounds) if self.rounds else 0.0


class SlotEngine:
    """B slots: one compiled decode-chunk program, one prefill-chunk and one insert program."""

    def __init__(self, params: dict, prepared, requests: Sequence[tuple[list[int], int]], *, batch: int,
                 chunk_rounds: int, prefill_len: int):
        if batch < 1 or chunk_rounds < 1 or prefill_len < 1:
            raise ValueError(f"batch, chunk_rounds and prefill_len must be >= 1 (got {batch}, {chunk_rounds}, "
                             f"{prefill_len})")
        self.params, self.p = params, prepared
        self.config, self.knobs, self.max_len = prepared.config, prepared.knobs, prepared.max_len
        # the output buffer holds max_len tokens, more than any request can generate: the budgets stay
        # per-request data (Carry.limit) and the compiled programs depend on max_len alone
        self.opts = prepared.opts.replace(max_new_tokens=prepared.max_len)
        self.requests = [(list(map(int, t)), int(n)) for t, n in requests]
        self.batch, self.chunk_rounds, self.prefill_len = batch, chunk_rounds, prefill_len
        self.rows_axes = S.rows_axes(params, self.config, self.max_len, self.opts)
        self.carry_axes = S.carry_axes(params, self.config, self.max_len, self.opts)

    @classmethod
    def build(cls, params: dict, config: Any | CheckpointConfig, prompts: Sequence[Sequence[int]],
              max_new_tokens: int | Sequence[int], *, batch: int, chunk_rounds: int = 64, prefill_len: int = 64,
              max_len: int | None = None, sampling: Sampling | None = None, speculation: Speculation | None = None,
              eos_token_id: int | None = None, backends: Backends | str | None = None, **options) -> "SlotEngine":
        """Validate a run (the options of `generate`: groups or keywords) and build its engine.

        max_new_tokens: one budget, or one per prompt; max_len (default: the longest prompt rounded up
        to prefill_len + the largest budget + a verify block) fixes the decode state's capacity: the
        compiled programs depend on (config, batch, max_len, drafter, draft_n_max, greedy, eos) only, so
        engines for other prompts and budgets with the same max_len reuse them."""
        budgets = [int(max_new_tokens)] * len(prompts) if np.ndim(max_new_tokens) == 0 else \
            [int(n) for n in max_new_tokens]
        if len(budgets) != len(prompts) or not prompts:
            raise ValueError(f"need one max_new_tokens per prompt ({len(prompts)} prompts, {len(budgets)} budgets)")
        if min(budgets) < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {min(budgets)}")
        if prefill_len < 1:
            raise ValueError(f"prefill_len must be >= 1, got {prefill_len}")
        longest = max(len(p) for p in prompts)
        run = RunShape(eos_token_id=eos_token_id, max_len=max_len,
                       pad_to=math.ceil(longest / prefill_len) * prefill_len)
        prepared = prepare(params, config, [list(p) for p in prompts], max(budgets), sampling=sampling,
                           speculation=speculation, run=run, backends=backends, **options)
        return cls(params, prepared, list(zip(prompts, budgets)), batch=batch, chunk_rounds=chunk_rounds,
                   prefill_len=prefill_len)

    # ---- device programs ------------------------------------------------------------------------

    def _admit(self, carry, i: int, slot: int, key):
        """Prefill request i (prefill_len tokens per chunk, one row) and insert it into `slot`."""
        C = self.prefill_len
        prompt, budget = self.requests[i]
        n = len(prompt)
        toks = np.zeros((1, math.ceil(n / C) * C + 1), np.int32)
        toks[0, :n] = prompt
        rows = S.init_rows(self.params, self.config, batch=1, max_len=self.max_len, opts=self.opts)
        for lo in range(0, n, C):
            rows = S.prefill_chunk(self.params, self.config, rows, jnp.asarray(toks[:, lo:lo + C]),
                                   jnp.asarray([min(C, n - lo)], jnp.int32), jnp.asarray(toks[:, lo + 1:lo + C + 1]),
                                   jnp.asarray([n <= lo + C]), jax.random.fold_in(key, lo), self.knobs,
                                   opts=self.opts, axes=self.rows_axes)
        return S.insert(carry, rows, jnp.asarray([slot], jnp.int32), jnp.asarray([budget], jnp.int32),
                        opts=self.opts, axes=self.carry_axes)

    # ---- the run --------------------------------------------------------------------------------

    def run(self, schedule: str) -> RunResult:
        """Decode every request under `schedule` ("static" | "continuous"); blocks until all are done."""
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        B = self.batch
        key_loop, key = jax.random.split(jax.random.PRNGKey(self.p.seed))
        max_rounds = jnp.int32(self.chunk_rounds)
        t0 = time.perf_counter()
        now = lambda: time.perf_counter() - t0
        carry = S.empty_carry(self.params, self.config, batch=B, max_len=self.max_len, opts=self.opts,
                              key=key_loop)
        pending = collections.deque(range(len(self.requests)))
        in_slot: list[int | None] = [None] * B
        admitted, admitted_chunk, first_at, results = {}, {}, {}, {}
        prefill_s, chunks = 0.0, 0
        while pending or any(i is not None for i in in_slot):
            free = [b for b in range(B) if in_slot[b] is None]
            if pending and free and (schedule == "continuous" or len(free) == B):
                for b in free[:len(pending)]:
                    i = pending.popleft()
                    admitted[i], admitted_chunk[i] = now(), chunks
                    carry = jax.block_until_ready(self._admit(carry, i, b, jax.random.fold_in(key, i)))
                    first_at[i] = now()
                    prefill_s += first_at[i] - admitted[i]
                    in_slot[b] = i
            carry = S.run_chunk(self.params, self.config, carry, self.knobs, max_rounds, opts=self.opts)
            chunks += 1
            done = np.asarray(carry.done)
            finished = [b for b in range(B) if in_slot[b] is not None and done[b]]
            if finished:
                out, out_len, st = jax.device_get((carry.out, carry.out_len, carry.stats))
                t = now()
                for b in finished:
                    i = in_slot[b]
                    results[i] = RequestResult(
                        index=i, tokens=out[b, :out_len[b]].tolist(), max_new_tokens=self.requests[i][1], slot=b,
                        admitted_chunk=admitted_chunk[i], admitted_s=admitted[i], first_token_s=first_at[i],
                        finished_s=t, rounds=int(st.rounds[b]), drafted=int(st.drafted[b]),
                        accepted=int(st.accepted[b]), per_position_accepted=st.per_position[b].tolist(),
                        per_position_proposed=st.proposed_at[b].tolist())
                    in_slot[b] = None
        rounds = int(carry.round)
        return RunResult(schedule=schedule, results=[results[i] for i in range(len(self.requests))], wall_s=now(),
                         prefill_s=prefill_s, chunks=chunks, rounds=rounds, batch=B)

    def warm_up(self) -> float:
        """Compile every program of a run (prefill, insert, the chunk) on the first request with a budget
        of 2; returns the seconds it took."""
        t0 = time.perf_counter()
        saved = self.requests
        self.requests = [(saved[0][0], min(2, saved[0][1]))]
        try:
            carry = S.empty_carry(self.params, self.config, batch=self.batch, max_len=self.max_len, opts=self.opts,
                                  key=jax.random.PRNGKey(0))
            carry = self._admit(carry, 0, 0, jax.random.PRNGKey(0))
            jax.block_until_ready(S.run_chunk(self.params, self.config, carry, self.knobs,
                                              jnp.int32(self.chunk_rounds), opts=self.opts))
        finally:
            self.requests = saved
        return time.perf_counter() - t0
