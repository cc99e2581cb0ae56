"""A speculative run's statistics: an accumulator whose groups a static spec chooses (docs/drafter_math.md §4.1).

    group          when (`StatsSpec`)   fields (B sequences, K the carry's bound, T = max_new_tokens)
    `Core`         always               rounds, drafted, accepted [B]; per_position, proposed_at [B,K]; length_hist
    `Verification` verification         analytic acceptance, Σ min(p, q), accepted-drafts histogram, confidence
                                        bins (docs/verification.md)
    `Width`        width                the width scheduler's rounds per width, expected tokens, raw estimates,
                                        modelled cost, offering rounds (docs/width_scheduler.md)
    `Trace`        trace                per round r of each sequence: accepted and verified drafts [B,T] (−1: none)

Each group has `zeros(B, K, T)`, `add_round(g, r)` (a verified round, `Observed`), `add_plain(g, n, r0, plain_cost)`
(n [B] rounds without the drafter from the sequence's round r0 [B] on) and `summary(g, core, program, k)` (numpy
in, `generate`'s statistics out, trimmed to the run's k). `Stats`: the core plus the spec's groups; never None.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from ..ops import verification

_int, _float = (lambda *shape: jnp.zeros(shape, jnp.int32)), (lambda *shape: jnp.zeros(shape, jnp.float32))


class Observed(NamedTuple):
    """One verified round of width w: active [B] (rows not done before it), n_draft [B] drafts verified (0 on
    done rows), n_accept [B], outcome (`ops.verification.Outcome`, [B,w]), conf [B,w] the drafter's confidences
    (−1 or None: none); the width scheduler's est / raw [B,w], offered [B], cost [] (None without it); r0 [B]:
    each sequence's rounds before this one."""

    active: jax.Array
    n_draft: jax.Array
    n_accept: jax.Array
    outcome: verification.Outcome
    conf: jax.Array | None
    est: jax.Array | None
    raw: jax.Array | None
    offered: jax.Array | None
    cost: jax.Array | None
    w: int
    r0: jax.Array


def _widen(x, K: int):      # [B,w,...] -> [B,K,...], zero-padded: a round of width w into the carry's bound K
    return jnp.pad(x, ((0, 0), (0, K - x.shape[1])) + ((0, 0),) * (x.ndim - 2))


_rate = lambda x, proposed: [float(a / p) if p else 0.0 for a, p in zip(x, proposed)]   # a rate per position


@struct.dataclass
class Core:
    rounds: jax.Array          # [B] rounds in which the sequence was active
    drafted: jax.Array         # [B] drafts verified
    accepted: jax.Array        # [B] drafts accepted
    per_position: jax.Array    # [B,K] rounds whose draft j was accepted
    proposed_at: jax.Array     # [B,K] rounds that verified a draft at position j
    length_hist: jax.Array     # [B,K+1] rounds that verified exactly L drafts (after p_min / confidence)

    @staticmethod
    def zeros(B: int, K: int, T: int) -> "Core":
        return Core(_int(B), _int(B), _int(B), _int(B, K), _int(B, K), _int(B, K + 1))

    def add_round(self, r: Observed) -> "Core":
        K, on = self.per_position.shape[1], r.active[:, None]
        at = lambda n, m: (jnp.arange(m)[None, :] < n[:, None]) & on
        return Core(rounds=self.rounds + r.active, drafted=self.drafted + r.n_draft,
                    accepted=self.accepted + jnp.where(r.active, r.n_accept, 0),
                    per_position=self.per_position + at(r.n_accept, K),
                    proposed_at=self.proposed_at + at(r.n_draft, K),
                    length_hist=self.length_hist + ((jnp.arange(K + 1)[None, :] == r.n_draft[:, None]) & on))

    def add_plain(self, n, r0, plain_cost) -> "Core":
        return self.replace(rounds=self.rounds + n, length_hist=self.length_hist.at[:, 0].add(n))

    def summary(self, core, program, k: int) -> dict[str, Any]:
        rounds, drafted, accepted = int(self.rounds.sum()), int(self.drafted.sum()), int(self.accepted.sum())
        acc, prop = self.per_position[:, :k].sum(0), self.proposed_at[:, :k].sum(0)
        return {"drafter": program.drafter.name, "draft_n_max": k, "rounds": rounds, "drafted": drafted,
                "accepted": accepted, "per_position_accepted": acc.tolist(), "per_position_proposed": prop.tolist(),
                "draft_length_histogram": self.length_hist[:, :k + 1].sum(0).tolist(),   # rounds by drafts (0..k)
                # accept_rate@j: rounds whose draft j was accepted / rounds that proposed a draft j
                "per_position_accept_rate": _rate(acc, prop),
                "mean_accepted_length": (accepted + rounds) / rounds if rounds else 0.0,   # incl. the bonus token
                "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
                "per_sequence": {n: getattr(self, n).tolist() for n in ("rounds", "drafted", "accepted")}}


@struct.dataclass
class Verification:
    expected_at: jax.Array     # [B,K] Σ over rounds of the analytic P(draft j accepted) (ops.verification)
    alpha_at: jax.Array        # [B,K] Σ over rounds of Σ_v min(p, q) at position j
    accept_hist: jax.Array     # [B,K+1] rounds that accepted exactly n drafts
    calib: jax.Array           # [B,K,NB,3] confidence bins: count, accepted, Σ confidence (scored drafters)
    brier_at: jax.Array        # [B,K] Σ (confidence − accepted)²

    @staticmethod
    def zeros(B: int, K: int, T: int) -> "Verification":
        return Verification(_float(B, K), _float(B, K), _int(B, K + 1),
                            _float(B, K, verification.CALIBRATION_BINS, 3), _float(B, K))

    def add_round(self, r: Observed) -> "Verification":
        K, on, o = self.expected_at.shape[1], r.active[:, None], r.outcome
        out = self.replace(expected_at=self.expected_at + _widen(jnp.where(on, o.expected, 0.0), K),
                           alpha_at=self.alpha_at + _widen(jnp.where(on, o.alpha, 0.0), K),
                           accept_hist=self.accept_hist + ((jnp.arange(K + 1)[None, :] == o.n_accept[:, None]) & on))
        if r.conf is None:
            return out
        bins, brier = verification.calibration_counts(r.conf, o.n_accept, r.n_draft, r.active, self.calib.shape[2])
        return out.replace(calib=self.calib + _widen(bins, K), brier_at=self.brier_at + _widen(brier, K))

    def add_plain(self, n, r0, plain_cost) -> "Verification":
        return self.replace(accept_hist=self.accept_hist.at[:, 0].add(n))

    def summary(self, core: Core, program, k: int) -> dict[str, Any]:
        prop = core.proposed_at[:, :k].sum(0)
        rounds = int(core.rounds.sum())
        synthetic = program.synthetic_accept
        out = {"verify": "synthetic" if synthetic else ("greedy" if program.greedy else program.verify),
               "acceptance": "synthetic" if synthetic else ("forced" if program.forced_acceptance else "real"),
               "synthetic_accept": list(synthetic) if synthetic else None,
               "per_position_expected_accept_rate": _rate(self.expected_at[:, :k].sum(0), prop),
               "per_position_alpha": _rate(self.alpha_at[:, :k].sum(0), prop),
               "expected_mean_accepted_length": (float(self.expected_at.sum()) + rounds) / rounds if rounds else 0.0,
               "acceptance_histogram": self.accept_hist[:, :k + 1].sum(0).tolist(),
               # vLLM's per-request spec-decode counters (num_drafts, num_draft_tokens, num_accepted_tokens,
               # num_accepted_tokens_per_pos) plus the histogram of accepted drafts per round (0..k)
               "per_request": [{"num_drafts": int(core.rounds[b]), "num_draft_tokens": int(core.drafted[b]),
                                "num_accepted_tokens": int(core.accepted[b]),
                                "num_accepted_tokens_per_pos": core.per_position[b, :k].tolist(),
                                "acceptance_histogram": self.accept_hist[b, :k + 1].tolist()}
                               for b in range(core.rounds.shape[0])]}
        if synthetic:
            out["synthetic_expected_mean_accepted_length"] = 1.0 + verification.expected_accepted(synthetic, k)
        if self.calib[:, :k].sum() > 0:
            out["calibration"] = {"bins": self.calib[:, :k].sum(0).tolist(),
                                  "brier_sum": self.brier_at[:, :k].sum(0).tolist()}
        return out


@struct.dataclass
class Width:
    width_hist: jax.Array      # [B,K+2] rounds that verified w = 0..K drafts; column K+1: plain rounds
    predicted: jax.Array       # [B] Σ over rounds of the expected tokens T_w of the verified width
    raw_sum: jax.Array         # [B,K] Σ raw acceptance estimates of drafts verified with their prefix accepted
    cost_sum: jax.Array        # [B] Σ over active rounds of the round's cost (cost table seconds)
    offered: jax.Array         # [B] drafting rounds in which the drafter proposed at least one draft

    @staticmethod
    def zeros(B: int, K: int, T: int) -> "Width":
        return Width(_int(B, K + 2), _float(B), _float(B, K), _float(B), _int(B))

    def add_round(self, r: Observed) -> "Width":
        out = self.replace(width_hist=self.width_hist.at[:, r.w].add(r.active.astype(jnp.int32)),
                           cost_sum=self.cost_sum + jnp.where(r.active, r.cost, 0.0),
                           offered=self.offered + (r.active & r.offered))
        if r.w == 0:
            return out.replace(predicted=self.predicted + r.active)
        j = jnp.arange(r.w)[None, :]
        proposed = j < r.n_draft[:, None]
        reached = proposed & (j <= r.n_accept[:, None]) & r.active[:, None]
        tokens = 1.0 + jnp.sum(jnp.cumprod(jnp.where(proposed, r.est, 0.0), axis=1), axis=1)
        return out.replace(predicted=self.predicted + jnp.where(r.active, tokens, 0.0),
                           raw_sum=self.raw_sum + _widen(jnp.where(reached, r.raw, 0.0), self.raw_sum.shape[1]))

    def add_plain(self, n, r0, plain_cost) -> "Width":
        return self.replace(width_hist=self.width_hist.at[:, -1].add(n), cost_sum=self.cost_sum + n * plain_cost,
                            predicted=self.predicted + n)

    def summary(self, core: Core, program, k: int) -> dict[str, Any]:
        hist, rounds = self.width_hist.sum(0), int(core.rounds.sum())
        return {"width_histogram": {**{str(w): int(hist[w]) for w in range(k + 1)}, "plain": int(hist[-1])},
                "drafting_rounds": rounds - int(hist[-1]),     # before the switch to plain decoding (per sequence)
                "expected_tokens_per_round": float(self.predicted.sum()) / rounds if rounds else 0.0,
                "modelled_cost_s": float(self.cost_sum.sum())}


@struct.dataclass
class Trace:
    accepted: jax.Array        # [B,T] drafts accepted in the sequence's round r (−1: no round r)
    drafted: jax.Array         # [B,T] drafts verified in its round r (0 in plain rounds)

    @staticmethod
    def zeros(B: int, K: int, T: int) -> "Trace":
        return Trace(jnp.full((B, T), -1, jnp.int32), jnp.full((B, T), -1, jnp.int32))

    def add_round(self, r: Observed) -> "Trace":
        rows, col = jnp.arange(r.r0.shape[0]), jnp.where(r.active, r.r0, self.accepted.shape[1])   # T: dropped
        return Trace(self.accepted.at[rows, col].set(r.n_accept, mode="drop"),
                     self.drafted.at[rows, col].set(r.n_draft, mode="drop"))

    def add_plain(self, n, r0, plain_cost) -> "Trace":
        col = jnp.arange(self.accepted.shape[1])[None, :]
        plain = (col >= r0[:, None]) & (col < (r0 + n)[:, None])
        return Trace(jnp.where(plain, 0, self.accepted), jnp.where(plain, 0, self.drafted))

    def summary(self, core: Core, program, k: int) -> dict[str, Any]:
        cut = lambda x: [x[b, :n].tolist() for b, n in enumerate(core.rounds)]
        return {"per_round_accepted": cut(self.accepted), "per_round_drafted": cut(self.drafted)}


@dataclasses.dataclass(frozen=True)
class StatsSpec:
    """Which groups a run's statistics hold (static: part of the loop's jit key)."""

    verification: bool = True
    width: bool = False        # the width scheduler (`Program.adaptive`)
    trace: bool = False        # `RunShape.round_trace`

    def groups(self) -> tuple[type, ...]:
        return tuple(g for g, on in ((Verification, self.verification), (Width, self.width), (Trace, self.trace)) if on)


@struct.dataclass
class Stats:
    core: Core
    groups: tuple              # one struct per group of the spec, in `StatsSpec.groups` order

    def group(self, kind: type):
        """The group of that type, or None when the spec leaves it out."""
        return next((g for g in self.groups if isinstance(g, kind)), None)


def zeros(spec: StatsSpec, B: int, K: int, T: int) -> Stats:
    """Empty statistics for B sequences, a carry bound K, T = max_new_tokens."""
    return Stats(Core.zeros(B, K, T), tuple(g.zeros(B, K, T) for g in spec.groups()))


def add_round(s: Stats, r: Observed) -> Stats:
    """The statistics after one verified round."""
    return Stats(s.core.add_round(r), tuple(g.add_round(r) for g in s.groups))


def add_plain(s: Stats, n: jax.Array, plain_cost) -> Stats:
    """The statistics after n [B] rounds without the drafter (no drafts: histograms' column 0, the width
    histogram's plain column, one expected token and plain_cost seconds each)."""
    r0 = s.core.rounds
    return Stats(s.core.add_plain(n, r0, plain_cost), tuple(g.add_plain(n, r0, plain_cost) for g in s.groups))


def summary(s: Stats, program, k: int) -> dict[str, Any]:
    """`generate`'s statistics of numpy Stats (`ops.host.to_host`): every group's, trimmed to k drafts."""
    out = s.core.summary(s.core, program, k)
    for g in s.groups:
        out.update(g.summary(s.core, program, k))
    return out
