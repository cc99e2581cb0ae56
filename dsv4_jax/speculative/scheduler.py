"""The host side of slot batching: a request queue over B decode slots (`speculative.slots`), static or continuous.

    continuous  between decode chunks, every freed slot takes the next queued request: its prompt is
                prefilled (chunks of `prefill_len` tokens) and its row inserted into the slot; the
                other slots keep their state
    static      the same programs, but slots are refilled only once all B are free: each batch runs
                until its longest sequence ends (what `generate` on consecutive batches does)

Admission is batched (JetStream's prefill → insert, several rows at once) the same way under both
schedules, and decoupled from the slots: when freed slots need more prefilled requests than wait in
the ready queue, the next max(needed, `prefill_ahead`) queued requests (default B) are prefilled
together — grouped by their number of prompt chunks (so that no row runs chunks past its prompt), each
group as the rows of one [P, prefill_len] call per chunk, P the smallest of the widths 1, 2, 4, ... B
that holds it (padded rows masked: n_valid 0), or split into several calls where padding would waste
more rows than the split adds calls (`call_widths`) — and wait as rows of those buffers; a refill writes
the next ready rows into the freed slots (one `slots.insert` per buffer, the buffer's other rows
dropped by slot index B). So continuous batching, which frees one or two slots at a time, makes the
same wide prefill calls as static (which takes B requests per refill) instead of many narrow ones;
the ready rows cost up to `prefill_ahead` rows of decode state. A program per width, compiled once
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
    table, how = engine.calibrate()           # draft_n_max="auto": measure this engine's rounds per width,
    engine.priced(table)                      # and let the width scheduler choose by them
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
from ..drafters.base import MODE_AUTO
from ..ops.host import to_host
from . import slots as S
from . import cost_table
from .cost_table import CostTable
from .generate import prepare
from .prefill import chunk_plan
from .options import RunShape, Sampling, Speculation
from .stats import Verification, Width
from .width_policy import width_knobs

SCHEDULES = ("static", "continuous")


@dataclasses.dataclass
class RequestResult:
    """One request's outcome. Times in seconds from the start of the run (every request queued at 0)."""

    index: int
    tokens: list[int]
    max_new_tokens: int
    slot: int
    admitted_chunk: int          # decode chunks run before it entered its slot
    admitted_s: float            # its prefill began (a prefill ahead of the slots may precede admitted_chunk)
    first_token_s: float
    finished_s: float
    rounds: int
    drafted: int
    accepted: int
    per_position_accepted: list[int]
    per_position_proposed: list[int]
    spec_decode: dict | None = None   # the verify rule's per-request evidence (`verification_evidence`)
    width: dict | None = None         # the width scheduler's per-request evidence (`width_evidence`)

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


def verification_evidence(st, b: int, program) -> dict | None:
    """Request b's verification statistics (docs/verification.md) from numpy Stats: analytic and Σ min(p, q)
    sums per position, the histogram of accepted drafts per round (vLLM's per-request layout), confidence bins."""
    v = st.group(Verification)
    if v is None:
        return None
    calib = {"bins": v.calib[b].tolist(), "brier_sum": v.brier_at[b].tolist()} if v.calib[b].sum() > 0 else None
    synthetic = program.synthetic_accept
    return {"verify": "synthetic" if synthetic else ("greedy" if program.greedy else program.verify),
            "acceptance": "synthetic" if synthetic else "real",
            "synthetic_accept": list(synthetic) if synthetic else None,
            "per_position_expected": v.expected_at[b].tolist(), "per_position_alpha_sum": v.alpha_at[b].tolist(),
            "acceptance_histogram": v.accept_hist[b].tolist(), "calibration": calib}


def width_evidence(st, b: int) -> dict | None:
    """Request b's width-scheduler statistics (docs/width_scheduler.md) from numpy Stats: rounds per verified
    width ("0".."K", "plain"), Σ expected tokens of its rounds, Σ cost-table seconds; None without the scheduler."""
    w = st.group(Width)
    if w is None:
        return None
    hist = w.width_hist[b].tolist()
    return {"width_histogram": {**{str(i): int(n) for i, n in enumerate(hist[:-1])}, "plain": int(hist[-1])},
            "expected_tokens": float(w.predicted[b]), "modelled_cost_s": float(w.cost_sum[b])}


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


@dataclasses.dataclass(frozen=True)
class Prefilled:
    """A prefilled request waiting for a slot: row `row` of a rows buffer (shared with the requests
    prefilled in the same calls)."""

    request: int
    rows: S.Rows
    row: int


class SlotEngine:
    """B slots: one compiled decode-chunk program; an init-rows, a prefill-chunk and an insert program per
    prefill width (`prefill_widths(B)`)."""

    def __init__(self, params: dict, prepared, requests: Sequence[tuple[list[int], int]], *, batch: int,
                 chunk_rounds: int, prefill_len: int, refill_min: int = 1, prefill_ahead: int | None = None):
        prefill_ahead = batch if prefill_ahead is None else prefill_ahead
        if min(batch, chunk_rounds, prefill_len, prefill_ahead, refill_min) < 1:
            raise ValueError(f"batch, chunk_rounds, prefill_len, prefill_ahead and refill_min must be >= 1 (got "
                             f"{batch}, {chunk_rounds}, {prefill_len}, {prefill_ahead}, {refill_min})")
        self.params, self.p = params, prepared
        self.config, self.knobs, self.max_len = prepared.config, prepared.knobs, prepared.max_len
        # the output buffer holds max_len tokens, more than any request can generate: the budgets stay
        # per-request data (Carry.limit) and the compiled programs depend on max_len alone
        self.program = prepared.program.replace(max_new_tokens=prepared.max_len)
        self.requests = [(list(map(int, t)), int(n)) for t, n in requests]
        self.batch, self.chunk_rounds, self.prefill_len, self.refill_min = batch, chunk_rounds, prefill_len, refill_min
        self.prefill_ahead = prefill_ahead
        self.widths = prefill_widths(batch)
        self.carry_axes = S.carry_axes(params, self.config, self.max_len, self.program)

    @classmethod
    def build(cls, params: dict, config: Any | CheckpointConfig, prompts: Sequence[Sequence[int]],
              max_new_tokens: int | Sequence[int], *, batch: int, chunk_rounds: int = 64, prefill_len: int = 64,
              refill_min: int = 1, prefill_ahead: int | None = None,
              max_len: int | None = None, sampling: Sampling | None = None, speculation: Speculation | None = None,
              eos_token_id: int | None = None, backends: Backends | str | None = None, **options) -> "SlotEngine":
        """Validate a run (the options of `generate`: groups or keywords) and build its engine.

        max_new_tokens: one budget, or one per prompt; refill_min: under "continuous", the finishes a
        decode chunk waits for before the host refills; prefill_ahead (default batch): the fewest queued
        requests a prefill takes at a time (module docstring); max_len (default: the longest
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
                   prefill_len=prefill_len, refill_min=refill_min, prefill_ahead=prefill_ahead)

    # ---- device programs ------------------------------------------------------------------------

    def _prefill(self, requests: Sequence[int], key) -> tuple[list["Prefilled"], int]:
        """Prefill requests (queue order) as the rows of [P, prefill_len] calls: -> (one `Prefilled` per
        request, in the order given; the number of prefill calls). Requests with the same number of prompt
        chunks share a call (so that no row runs chunks past its prompt)."""
        calls, done = 0, {}
        by_chunks = collections.defaultdict(list)
        for i in requests:
            by_chunks[math.ceil(len(self.requests[i][0]) / self.prefill_len)].append(i)
        for n_chunks, members in sorted(by_chunks.items()):
            lo = 0
            for width in call_widths(len(members), self.widths):
                piece, lo = members[lo:lo + width], lo + width
                rows = self._prefill_rows(piece, n_chunks, jax.random.fold_in(key, piece[0]))
                done.update((i, Prefilled(i, rows, r)) for r, i in enumerate(piece))
                calls += n_chunks
        return [done[i] for i in requests], calls

    def _prefill_rows(self, piece: Sequence[int], n_chunks: int, key) -> S.Rows:
        """One group of requests (each n_chunks prompt chunks long) as the rows of [P, prefill_len] prefill
        calls, P the smallest width that holds it (`call_widths`); the padded rows get no tokens."""
        C = self.prefill_len
        P = next(w for w in self.widths if w >= len(piece))
        toks = np.zeros((P, n_chunks * C + 1), np.int32)
        lengths = np.zeros((P,), np.int32)
        for r, i in enumerate(piece):
            prompt = self.requests[i][0]
            toks[r, :len(prompt)], lengths[r] = prompt, len(prompt)
        rows = S.init_rows(self.params, self.config, self.knobs, batch=P, max_len=self.max_len, program=self.program)
        for lo, n_valid, final in chunk_plan(lengths, C, n_chunks * C):
            rows = S.prefill_chunk(self.params, self.config, rows, jnp.asarray(toks[:, lo:lo + C]),
                                   jnp.asarray(n_valid), toks[:, lo + 1:lo + C + 1], jnp.asarray(final), lo,
                                   jax.random.fold_in(key, lo), self.knobs, program=self.program,
                                   taps=self.program.taps)
        return rows

    def _insert(self, carry, placed: Sequence[tuple["Prefilled", int]]):
        """Write prefilled requests into slots, [(prefilled, slot)]: one `slots.insert` per rows buffer
        they come from (the other rows of a buffer get slot index B: dropped)."""
        by_rows: dict[int, list] = {}
        for pre, b in placed:
            by_rows.setdefault(id(pre.rows), []).append((pre, b))
        for members in by_rows.values():
            rows = members[0][0].rows
            P = rows.first.shape[0]
            slots, limits = np.full((P,), self.batch, np.int32), np.zeros((P,), np.int32)
            for pre, b in members:
                slots[pre.row], limits[pre.row] = b, self.requests[pre.request][1]
            carry = S.insert(carry, rows, jnp.asarray(slots), jnp.asarray(limits), program=self.program,
                             axes=self.carry_axes)
        return carry

    def admit(self, carry, group: Sequence[tuple[int, int]], key):
        """Prefill the requests of group [(request, slot)] and insert them into their slots: -> (carry, the
        number of prefill calls)."""
        ready, calls = self._prefill([i for i, _ in group], key)
        return self._insert(carry, [(pre, b) for pre, (_, b) in zip(ready, group)]), calls

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
        carry = S.empty_carry(self.params, self.config, batch=B, max_len=self.max_len, program=self.program,
                              key=key_loop)
        pending = collections.deque(range(len(self.requests)))
        ready: collections.deque[Prefilled] = collections.deque()     # prefilled, waiting for a slot
        in_slot: list[int | None] = [None] * B
        admitted, admitted_chunk, first_at, results = {}, {}, {}, {}
        prefill_s, chunks, refills, calls = 0.0, 0, 0, 0
        while pending or ready or any(i is not None for i in in_slot):
            free = [b for b in range(B) if in_slot[b] is None]
            if (pending or ready) and free and (schedule == "continuous" or len(free) == B):
                t = now()
                need = min(len(free), len(pending) + len(ready))
                if len(ready) < need:
                    # prefill ahead: at least prefill_ahead queued requests at a time (their rows wait in
                    # `ready` for the next freed slots), so that narrow refills still make wide prefill calls
                    take = [pending.popleft() for _ in range(min(len(pending),
                                                                 max(need - len(ready), self.prefill_ahead)))]
                    new, n = self._prefill(take, jax.random.fold_in(key, take[0]))
                    jax.block_until_ready({id(pre.rows): pre.rows for pre in new})
                    t_first = now()
                    for pre in new:
                        admitted[pre.request], first_at[pre.request] = t, t_first
                    ready.extend(new)
                    calls += n
                placed = [(ready.popleft(), b) for b in free[:need]]
                carry = jax.block_until_ready(self._insert(carry, placed))
                for pre, b in placed:
                    admitted_chunk[pre.request], in_slot[b] = chunks, pre.request
                prefill_s, refills = prefill_s + now() - t, refills + 1
            # continuous: wait for refill_min finishes (no more than the queue can refill); static: exit at
            # the first, like continuous with refill_min 1, so that both see a finish equally soon
            wait = max(1, min(self.refill_min, len(pending) + len(ready))) if schedule == "continuous" else 1
            carry = S.run_chunk(self.params, self.config, carry, self.knobs, max_rounds, jnp.int32(wait),
                                program=self.program)
            chunks += 1
            done = to_host(carry.done)
            finished = [b for b in range(B) if in_slot[b] is not None and done[b]]
            if finished:
                out, out_len, st = to_host((carry.out, carry.out_len, carry.stats))
                t = now()
                for b in finished:
                    i = in_slot[b]
                    results[i] = RequestResult(
                        index=i, tokens=out[b, :out_len[b]].tolist(), max_new_tokens=self.requests[i][1], slot=b,
                        admitted_chunk=admitted_chunk[i], admitted_s=admitted[i], first_token_s=first_at[i],
                        finished_s=t, rounds=int(st.core.rounds[b]), drafted=int(st.core.drafted[b]),
                        accepted=int(st.core.accepted[b]), per_position_accepted=st.core.per_position[b].tolist(),
                        per_position_proposed=st.core.proposed_at[b].tolist(),
                        spec_decode=verification_evidence(st, b, self.program), width=width_evidence(st, b))
                    in_slot[b] = None
        rounds = int(carry.round)
        return RunResult(schedule=schedule, results=[results[i] for i in range(len(self.requests))], wall_s=now(),
                         prefill_s=prefill_s, chunks=chunks, rounds=rounds, batch=B, refills=refills,
                         prefill_calls=calls)

    def calibrate(self, schedule: str = "continuous", *, repeats: int = 3, cache_dir: str | None = None,
                  refresh: bool = False, progress=None, drafter: str | None = None) -> tuple[CostTable, str]:
        """The cost table of this engine's rounds (an engine built with draft_n_max="auto"): the engine runs
        its first 2·B requests under `schedule` at each fixed width and plain (`cost_table.measure`; seconds
        per round = decode time outside admission / rounds), so the table prices the rounds this engine runs —
        its chunked dispatch and partly filled batches — not a static `generate`'s. Cached like
        `cached_or_calibrate` (the key adds the engine's batch, chunking and schedule); `priced` then prices
        the engine's auto rounds by it. -> (table, "cached" | "measured")."""
        if not self.program.adaptive or int(self.knobs.width_mode) != MODE_AUTO:
            raise ValueError("calibrate needs an engine built with draft_n_max='auto'")
        drafter = drafter or self.program.drafter.name
        key = cost_table.cache_key(self.config, self.p, drafter)
        key["shapes"].update(batch=self.batch, engine={"schedule": schedule, "chunk_rounds": self.chunk_rounds,
                                                       "prefill_len": self.prefill_len, "refill_min": self.refill_min,
                                                       "requests": min(len(self.requests), 2 * self.batch)})

        def time_at(knobs) -> float:
            saved = self.requests, self.knobs
            self.requests, self.knobs = saved[0][:2 * self.batch], knobs
            try:
                run = self.run(schedule)
            finally:
                self.requests, self.knobs = saved
            return run.decode_s / max(run.rounds, 1)

        return cost_table.cached(key, lambda: cost_table.measure(
            time_at, self.knobs, self.program.k, repeats=repeats, progress=progress, drafter=drafter, batch=self.batch,
            key=key), cache_dir, refresh)

    def priced(self, table: CostTable) -> None:
        """Price this engine's auto rounds by table (the width scheduler's knobs, `width_policy.width_knobs`)."""
        self.knobs = width_knobs(self.knobs, table, self.program.k, True)

    def warm_up(self) -> float:
        """Compile every program of a run (prefill and insert at every width, the chunk) on copies of the
        first request with a budget of 2; returns the seconds it took."""
        t0 = time.perf_counter()
        saved = self.requests
        self.requests = [(saved[0][0], min(2, saved[0][1]))] * self.batch
        try:
            carry = S.empty_carry(self.params, self.config, batch=self.batch, max_len=self.max_len,
                                  program=self.program, key=jax.random.PRNGKey(0))
            for w in self.widths:
                carry, _ = self.admit(carry, [(r, r) for r in range(w)], jax.random.PRNGKey(0))
            jax.block_until_ready(S.run_chunk(self.params, self.config, carry, self.knobs,
                                              jnp.int32(self.chunk_rounds), jnp.int32(1), program=self.program))
        finally:
            self.requests = saved
        return time.perf_counter() - t0


def prefill_widths(batch: int) -> tuple[int, ...]:
    """The row counts a prefill call is compiled for: powers of two below batch, and batch."""
    return tuple(sorted({1 << j for j in range(batch.bit_length()) if 1 << j < batch} | {batch}))


def call_widths(n: int, widths: Sequence[int]) -> list[int]:
    """How many rows each prefill call of n requests (same chunk count) takes: the smallest width that holds
    them, padded, unless that pads more rows than splitting would add calls — then the widest width that
    fits, and the rest the same way (26 of widths 1, 2, 4, .. 32 -> 16, 8, 2; 30 -> 32; 7 -> 8; 5 -> 4, 1).
    On a compute-bound backend a padded row costs about as much as a real one and a call's fixed cost
    about one row, so this keeps both few."""
    out = []
    while n > 0:
        holds = next((w for w in widths if w >= n), widths[-1])
        width = holds if holds - n <= _greedy_pieces(n, widths) - 1 else max(w for w in widths if w <= n)
        out.append(width)
        n -= width
    return out


def _greedy_pieces(n: int, widths: Sequence[int]) -> int:
    """Calls that n rows split into, the widest fitting width each time."""
    count = 0
    while n > 0:
        n -= max(w for w in widths if w <= n)
        count += 1
    return count
