"""Speculation payoff forecast: does drafting k tokens per round beat plain decoding on this slice?

From an acceptance profile and the compiled programs' step times (docs/aot.md, "Speculation payoff"):

    a_1 .. a_n          per-position conditional acceptance: a_i = P(draft i accepted | drafts 1..i-1 accepted)
    E[accepted](k)      = Σ_{j=1..k} Π_{i≤j} a_i        (positions past the profile repeat its last rate)
    tokens per round    = 1 + E[accepted](k)             (the verify step always yields one token)
    time per round      = drafter round(k) + verify(k+1)
    tokens/s per seq    = tokens per round / time per round
    speed-up            = (tokens per round / time per round) / (1 / decode)

Profiles: `given` (a list of conditional rates), `from_sweep` (a `dsv4-sweep` summary.json: its
per_position_accept_rate[j] is P(draft j+1 accepted) over the rounds that proposed it, i.e. the cumulative
product; converted to conditional rates), or a named published one (`PUBLISHED`). Times per k come from
`round_times`: the compiled program's roofline time at the report's k, and at other k the same
XLA-bytes / bound ratio applied to that k's bound (`bounds`), so only one verify and one round per drafter
need compiling.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Callable, Sequence

from ...config import ModelConfig
from . import bounds as BD

K_RANGE = tuple(range(1, 8))


@dataclasses.dataclass(frozen=True)
class Profile:
    """Per-position conditional acceptance rates (a_1, a_2, ...) with where they came from."""

    name: str
    rates: tuple[float, ...]
    source: str

    def __post_init__(self):
        if not self.rates or any(not 0.0 <= r <= 1.0 for r in self.rates):
            raise ValueError(f"acceptance profile {self.name!r}: rates must be a non-empty list in [0, 1], "
                             f"got {list(self.rates)}")

    def rate(self, i: int) -> float:
        """a_i (1-based); past the last measured position the last rate."""
        return self.rates[min(i, len(self.rates)) - 1]


# Named published profiles. llama.cpp PR #25784 (DeepSeek MTP) reports a 0.65 aggregate draft acceptance;
# with no per-position split published it is taken as a constant conditional rate (a geometric profile).
PUBLISHED = {
    "mtp-llamacpp-25784": Profile("mtp-llamacpp-25784", (0.65,),
                                  "llama.cpp PR #25784: MTP, 0.65 aggregate acceptance, taken as a_i = 0.65 "
                                  "for every position"),
}


def given(rates: Sequence[float], name: str = "given") -> Profile:
    return Profile(name, tuple(float(r) for r in rates), "user-given per-position conditional rates")


def conditional(cumulative: Sequence[float]) -> tuple[float, ...]:
    """P(accepted ≥ j) for j = 1..n -> conditional a_j = P(≥ j) / P(≥ j−1) (0 after a zero)."""
    out, prev = [], 1.0
    for c in cumulative:
        out.append(min(1.0, c / prev) if prev > 0 else 0.0)
        prev = c
    return tuple(out)


def from_sweep(path: str, drafter: str | None = None) -> Profile:
    """The profile of a `dsv4-sweep` summary.json: the setting (of `drafter`, if given) with the most
    measured positions."""
    with open(path) as f:
        summary = json.load(f)
    best = None
    for s in summary.get("settings", []):
        rates = s.get("per_position_accept_rate") or []
        if drafter and s.get("drafter") != drafter:
            continue
        if rates and (best is None or len(rates) > len(best.get("per_position_accept_rate", []))):
            best = s
    if best is None:
        raise ValueError(f"{path}: no setting with per_position_accept_rate" + (f" for drafter {drafter!r}"
                                                                                if drafter else ""))
    label = best.get("drafter", "drafter")
    return Profile(f"sweep:{label}", conditional(best["per_position_accept_rate"]),
                   f"dsv4-sweep {path}, drafter {label}, draft_n_max {best.get('draft_n_max')}")


def profile(spec: str | Sequence[float], drafter: str | None = None) -> Profile:
    """A profile from a published name, a summary.json path, or comma-separated rates ("0.8,0.6,0.5")."""
    if not isinstance(spec, str):
        return given(spec)
    if spec in PUBLISHED:
        return PUBLISHED[spec]
    if spec.endswith(".json"):
        return from_sweep(spec, drafter)
    try:
        return given([float(v) for v in spec.split(",")])
    except ValueError:
        raise ValueError(f"unknown acceptance profile {spec!r}: a published name ({sorted(PUBLISHED)}), a "
                         "dsv4-sweep summary.json, or comma-separated rates") from None


def expected_accepted(p: Profile, k: int) -> float:
    """E[accepted drafts] of a round drafting k: Σ_{j=1..k} Π_{i≤j} a_i."""
    total, run = 0.0, 1.0
    for j in range(1, k + 1):
        run *= p.rate(j)
        total += run
    return total


def forecast_row(p: Profile, k: int, decode_s: float, verify_s: float, drafter_s: float) -> dict:
    """One k: tokens per round, time per round, tokens/s per sequence and speed-up over plain decoding."""
    if min(decode_s, verify_s, drafter_s) < 0 or decode_s == 0:
        raise ValueError(f"step times must be positive: decode {decode_s}, verify {verify_s}, drafter {drafter_s}")
    tokens = 1.0 + expected_accepted(p, k)
    t = drafter_s + verify_s
    rate = tokens / t
    return {"k": k, "expected_accepted": tokens - 1.0, "tokens_per_round": tokens, "round_s": t,
            "verify_s": verify_s, "drafter_s": drafter_s, "tokens_per_s": rate, "decode_tokens_per_s": 1 / decode_s,
            "speedup": rate * decode_s}


def forecast(p: Profile, decode_s: float, verify_s: Callable[[int], float], drafter_s: Callable[[int], float],
             ks: Sequence[int] = K_RANGE) -> list[dict]:
    """`forecast_row` for each k; verify_s(k) is the verify step over k + 1 tokens, drafter_s(k) the rest
    of a round drafting k."""
    return [forecast_row(p, k, decode_s, verify_s(k), drafter_s(k)) for k in ks]


# ---- step times from a report's compiled programs ------------------------------------------------------

def _seconds(row: dict) -> float:
    return row["estimate"]["roofline_s"]


def _ratio(row: dict) -> float:
    """The compiled program's time per byte of its bound (its roofline time / bound time at the same k)."""
    return _seconds(row) / row["bound"]["total"]


def round_times(programs: dict, config: ModelConfig, weights: str, batch: int, context: int,
                bound_fns: dict | None = None) -> tuple[float, Callable, dict]:
    """(decode_s, verify_s(k), {drafter: drafter_s(k)}) from a report run's compiled rows by program name
    ("decode", "verify", "spec-mtp", "spec-dspark"): each compiled row's seconds per bound byte scaled to
    k's bound; a drafter's own time is its round minus the verify step at the same k."""
    decode = _seconds(programs["decode"])
    v_ratio = _ratio(programs["verify"])
    verify = lambda k: v_ratio * BD.target_bound(config, weights, batch, context, k + 1)["total"]
    drafters = {}
    fns = bound_fns or {}
    for name in ("spec-mtp", "spec-dspark"):
        row = programs.get(name)
        if not row or not row.get("compiled") or name not in fns:
            continue
        r_ratio = _ratio(row)
        drafters[name.split("-")[1]] = (lambda rr, fn: lambda k: max(0.0, rr * fn(k)["total"] - verify(k)))(
            r_ratio, fns[name])
    return decode, verify, drafters


# ---- rendering -----------------------------------------------------------------------------------------

def markdown(title: str, p: Profile, rows_by_drafter: dict[str, list[dict]]) -> str:
    L = [f"### {title}", "", f"Acceptance profile **{p.name}**: {p.source}; a_i = "
         + ", ".join(f"{r:.2f}" for r in p.rates), "",
         "| drafter | k | E[accepted] | tokens/round | round ms | tokens/s/seq | plain decode tokens/s | speed-up |",
         "|---|---|---|---|---|---|---|---|"]
    for d, rows in rows_by_drafter.items():
        for r in rows:
            L.append(f"| {d} | {r['k']} | {r['expected_accepted']:.2f} | {r['tokens_per_round']:.2f} | "
                     f"{r['round_s'] * 1e3:.2f} | {r['tokens_per_s']:.1f} | {r['decode_tokens_per_s']:.1f} | "
                     f"{r['speedup']:.2f}× |")
    return "\n".join(L)


def plot(title: str, rows_by_drafter: dict[str, list[dict]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for d, rows in rows_by_drafter.items():
        ax.plot([r["k"] for r in rows], [r["speedup"] for r in rows], marker="o", label=d)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set(xlabel="draft_n_max k", ylabel="speed-up over plain decoding", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def best(rows: list[dict]) -> dict:
    return max(rows, key=lambda r: (r["speedup"], -r["k"])) if rows else {}


__all__ = ["Profile", "PUBLISHED", "given", "conditional", "from_sweep", "profile", "expected_accepted",
           "forecast_row", "forecast", "round_times", "markdown", "plot", "best"]
