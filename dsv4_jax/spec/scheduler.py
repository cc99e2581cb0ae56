"""The host side of slot batching: a request queue over B decode slots (`spec.slots`), static or continuous.

    continuous  between decode chunks, every freed slot takes the next queued request: its prompt is
                prefilled (chunks of `prefill_len` tokens) and its row inserted into the slot; the
                other slots keep their state
    static      the same programs, but slots are refilled only once all B are free: each batch runs
                until its longest sequence ends (what `generate` on consecutive batches does)

Admission is batched (JetStream's prefill → insert, several rows at once) the same way under both
schedules: the requests taken in one refill are grouped by their number of prompt chunks (so that no
row runs chunks past its prompt), each group prefilled as the rows of one [P, prefill_len] call per
chunk, P the smallest of the widths 1, 2, 4, ... B that holds it (padded rows masked: n_valid 0, slot
index B), and its rows written into their slots by one insert. A program per width, compiled once
(`warm_up`). A decode chunk is `slots.run_chunk`: at most `chunk_rounds` speculative rounds, ending
early once `refill_min` sequences (capped by the queued requests; 1 when none are queued) have
finished since the chunk began, so that freed slots are refilled at once (refill_min 1) or together
(larger: fewer, wider refills, slots idle meanwhile). All requests arrive at time 0; per request
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
    refills: int = 0                  # admissions (host refills between chunks)
    prefill_calls: int = 0            # prefill_chunk calls ([P, prefill_len] each)

    @property
    def decode_s(self) -> float:
        """Wall time outside admission: the decode chunks and the host's look at the slots."""
        return self.wall_s - self.prefill_s

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
    """B slots: one compiled decode-chunk program; an init-rows, a prefill-chunk and an insert program per
    prefill width (`prefill_widths(B)`)."""

    def __init__(self, params: dict, prepared, requests: Sequence[tuple[list[int], int]], *, batch: int,
                 chunk_rounds: int, prefill_len: int, refill_min: int = 1):
        if min(batch, chunk_rounds, prefill_len, refill_min) < 1:
            raise ValueError(f"batch, chunk_rounds, prefill_len and refill_min must be >= 1 (got {batch}, "
                             f"{chunk_rounds}, {prefill_len}, {refill_min})")
        self.params, self.p = params, prepared
        self.config, self.knobs, self.max_len = prepared.config, prepared.knobs, prepared.max_len
        # the output buffer holds max_len tokens, more than any request can generate: the budgets stay
        # per-request data (Carry.limit) and the compiled programs depend on max_len alone
        self.opts = prepared.opts.replace(max_new_tokens=prepared.max_len)
        self.requests = [(list(map(int, t)), int(n)) for t, n in requests]
        self.batch, self.chunk_rounds, self.prefill_len, self.refill_min = batch, chunk_rounds, prefill_len, refill_min
        self.widths = prefill_widths(batch)
        self.rows_axes = S.rows_axes(params, self.config, self.max_len, self.opts)
        self.carry_axes = S.carry_axes(params, self.config, self.max_len, self.opts)

    @classmethod
    def build(cls, params: dict, config: Any | CheckpointConfig, prompts: Sequence[Sequence[int]],
              max_new_tokens: int | Sequence[int], *, batch: int, chunk_rounds: int = 64, prefill_len: int = 64,
              refill_min: int = 1,
              max_len: int | None = None, sampling: Sampling | None = None, speculation: Speculation | None = None,
              eos_token_id: int | None = None, backends: Backends | str | None = None, **options) -> "SlotEngine":
        """Validate a run (the options of `generate`: groups or keywords) and build its engine.

        max_new_tokens: one budget, or one per prompt; refill_min: under "continuous", the finishes a
        decode chunk waits for before the host refills (module docstring); max_len (default: the longest
        prompt rounded up to prefill_len + the largest budget + a verify block) fixes the decode state's
        capacity: the
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
                   prefill_len=prefill_len, refill_min=refill_min)

    # ---- device programs ------------------------------------------------------------------------

    def _admit(self, carry, group: Sequence[tuple[int, int]], key):
        """Prefill the requests of group [(request, slot)] and insert them into their slots: -> (carry, the
        number of prefill calls). Requests with the same number of prompt chunks share a call."""
        calls = 0
        by_chunks = collections.defaultdict(list)
        for i, b in group:
            by_chunks[math.ceil(len(self.requests[i][0]) / self.prefill_len)].append((i, b))
        for n_chunks, members in sorted(by_chunks.items()):
            for lo in range(0, len(members), self.widths[-1]):
                piece = members[lo:lo + self.widths[-1]]
                carry = self._admit_rows(carry, piece, n_chunks, jax.random.fold_in(key, piece[0][0]))
                calls += n_chunks
        return carry, calls

    def _admit_rows(self, carry, piece: Sequence[tuple[int, int]], n_chunks: int, key):
        """One group of requests (each n_chunks prompt chunks long) as the rows of [P, prefill_len] prefill
        calls, P the smallest width that holds it; padded rows (no tokens, slot B) are dropped by insert."""
        C, B = self.prefill_len, self.batch
        P = next(w for w in self.widths if w >= len(piece))
        toks = np.zeros((P, n_chunks * C + 1), np.int32)
        lengths = np.zeros((P,), np.int32)
        slots, limits = np.full((P,), B, np.int32), np.zeros((P,), np.int32)
        for r, (i, b) in enumerate(piece):
            prompt, budget = self.requests[i]
            toks[r, :len(prompt)], lengths[r], slots[r], limits[r] = prompt, len(prompt), b, budget
        rows = S.init_rows(self.params, self.config, batch=P, max_len=self.max_len, opts=self.opts)
        for lo in range(0, n_chunks * C, C):
            n_valid = np.clip(lengths - lo, 0, C).astype(np.int32)
            final = (lengths > lo) & (lengths <= lo + C)
            rows = S.prefill_chunk(self.params, self.config, rows, jnp.asarray(toks[:, lo:lo + C]),
                                   jnp.asarray(n_valid), jnp.asarray(toks[:, lo + 1:lo + C + 1]), jnp.asarray(final),
                                   jax.random.fold_in(key, lo), self.knobs, opts=self.opts, axes=self.rows_axes)
        return S.insert(carry, rows, jnp.asarray(slots), jnp.asarray(limits), opts=self.opts, axes=self.carry_axes)

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
        prefill_s, chunks, refills, calls = 0.0, 0, 0, 0
        while pending or any(i is not None for i in in_slot):
            free = [b for b in range(B) if in_slot[b] is None]
            if pending and free and (schedule == "continuous" or len(free) == B):
                group = [(pending.popleft(), b) for b in free[:len(pending)]]
                t = now()
                carry, n = self._admit(carry, group, jax.random.fold_in(key, group[0][0]))
                carry = jax.block_until_ready(carry)
                t_first = now()
                for i, b in group:
                    admitted[i], admitted_chunk[i], first_at[i], in_slot[b] = t, chunks, t_first, i
                prefill_s, refills, calls = prefill_s + t_first - t, refills + 1, calls + n
            # continuous: wait for refill_min finishes (no more than the queue can refill); static: exit at
            # the first, like continuous with refill_min 1, so that both see a finish equally soon
            wait = max(1, min(self.refill_min, len(pending))) if schedule == "continuous" else 1
            carry = S.run_chunk(self.params, self.config, carry, self.knobs, max_rounds, jnp.int32(wait),
                                opts=self.opts)
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
                         prefill_s=prefill_s, chunks=chunks, rounds=rounds, batch=B, refills=refills,
                         prefill_calls=calls)

    def warm_up(self) -> float:
        """Compile every program of a run (prefill and insert at every width, the chunk) on copies of the
        first request with a budget of 2; returns the seconds it took."""
        t0 = time.perf_counter()
        saved = self.requests
        self.requests = [(saved[0][0], min(2, saved[0][1]))] * self.batch
        try:
            carry = S.empty_carry(self.params, self.config, batch=self.batch, max_len=self.max_len, opts=self.opts,
                                  key=jax.random.PRNGKey(0))
            for w in self.widths:
                carry, _ = self._admit(carry, [(r, r) for r in range(w)], jax.random.PRNGKey(0))
            jax.block_until_ready(S.run_chunk(self.params, self.config, carry, self.knobs,
                                              jnp.int32(self.chunk_rounds), jnp.int32(1), opts=self.opts))
        finally:
            self.requests = saved
        return time.perf_counter() - t0


def prefill_widths(batch: int) -> tuple[int, ...]:
    """The row counts a prefill call is compiled for: powers of two below batch, and batch."""
    return tuple(sorted({1 << j for j in range(batch.bit_length()) if 1 << j < batch} | {batch}))
