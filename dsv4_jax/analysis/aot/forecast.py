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
roofline-seconds / bound-byte ratio applied to that k's bound (the rows' `bound["by_k"]`, `programs`), so
only one verify and one round per drafter need compiling. `report_forecast` does this for every run of a
`dsv4-aot` report that compiled decode, verify and a round; `section` and `plot_report` render it.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Callable, Sequence

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
# vllm-project/vllm#46995 (DSpark on DeepSeek-V4-Flash, k = 5) publishes per-position acceptance .82 / .67 / .55 /
# .45 / .37. Read as vLLM's spec-decode metric does: drafts at position j accepted over rounds, i.e. the cumulative
# P(draft j accepted) (a conditional reading could not fall this smoothly: .82^j is .82 / .67 / .55 / .45 / .37),
# converted to conditional rates (`conditional`: ≈ 0.82 at every position).
PUBLISHED["dspark-vllm-46995"] = Profile(
    "dspark-vllm-46995", tuple(round(r, 4) for r in (lambda c: [c[0]] + [b / a for a, b in zip(c, c[1:])])(
        (0.82, 0.67, 0.55, 0.45, 0.37))),
    "vllm-project/vllm#46995: DSpark on Flash, per-position acceptance .82/.67/.55/.45/.37 at k = 5, read as "
    "cumulative P(draft j accepted), converted to conditional rates")
DEFAULT_PROFILE = "mtp-llamacpp-25784"


def given(rates: Sequence[float], name: str = "given") -> Profile:
    return Profile(name, tuple(float(r) for r in rates), "user-given per-position conditional rates")


def conditional(cumulative: Sequence[float]) -> tuple[float, ...]:
    """P(accepted ≥ j) for j = 1..n -> conditional a_j = P(≥ j) / P(≥ j−1) (0 after a zero)."""
    out, prev = [], 1.0
    for c in cumulative:
        out.append(min(1.0, c / prev) if prev > 0 else 0.0)
        prev = c
    return tuple(out)


def _drafter_of(setting: dict) -> str | None:
    return setting.get("spec_type", setting.get("drafter"))


def from_sweep(path: str, drafter: str | None = None, temperature: float = 0.0) -> Profile:
    """The profile of a `dsv4-sweep` summary.json: among the settings of `drafter` (if given) at
    `temperature` (when the summary records one; the report's rounds verify greedily), the one with a
    numeric draft_n_max measuring the most positions (ties: the larger k)."""
    try:
        with open(path) as f:
            summary = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read acceptance profile {path}: {e}") from None
    best, best_key = None, None
    for s in summary.get("settings", []):
        rates = s.get("per_position_accept_rate") or []
        if not rates or not isinstance(s.get("draft_n_max"), int):
            continue
        if drafter and _drafter_of(s) != drafter:
            continue
        if s.get("temperature") is not None and float(s["temperature"]) != temperature:
            continue
        key = (len(rates), s["draft_n_max"])
        if best_key is None or key > best_key:
            best, best_key = s, key
    if best is None:
        raise ValueError(f"{path}: no setting with per_position_accept_rate" + (f" for drafter {drafter!r}"
                                                                                if drafter else "")
                         + f" at temperature {temperature:g}")
    label = _drafter_of(best) or "drafter"
    model = (summary.get("meta", {}).get("model") or {}).get("name")
    return Profile(f"sweep:{label}", conditional(best["per_position_accept_rate"]),
                   f"dsv4-sweep {path}" + (f" (model {model})" if model else "") + f", drafter {label}, "
                   f"draft_n_max {best['draft_n_max']}, temperature {temperature:g}")


def profile(spec: str | Sequence[float], drafter: str | None = None) -> Profile:
    """A profile from a published name, a summary.json path, or comma-separated rates ("0.8,0.6,0.5")."""
    if not isinstance(spec, str):
        return given(spec)
    if spec in PUBLISHED:
        return PUBLISHED[spec]
    if spec.endswith(".json"):
        return from_sweep(spec, drafter)
    try:
        rates = [float(v) for v in spec.split(",")]
    except ValueError:
        raise ValueError(f"unknown acceptance profile {spec!r}: a published name ({sorted(PUBLISHED)}), a "
                         "dsv4-sweep summary.json, or comma-separated rates") from None
    return given(rates)


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

# Step-time bases: "roofline" = the report's estimate per program (max(HLO-op HBM bytes, or XLA's bytes
# accessed where the HLO could not be read, at the HBM bandwidth; flops at the peak rate)); "xla" = XLA's
# bytes accessed (on-chip traffic included) for every program, one measure throughout; "bound" = the
# program's bytes bound at the HBM bandwidth (every program at its bound: the ideal payoff); "latency" and
# "bound+latency" = roofline and bound plus the program's latency terms (collectives × the per-collective
# latency + launched ops × the per-op overhead, `compile.latency_roofline`), which do not grow with k.
BASES = ("roofline", "xla", "bound", "latency", "bound+latency")
LATENCY_BASES = ("latency", "bound+latency")


def _fixed(row: dict, basis: str) -> float:
    """The part of a program's time that does not scale with its bytes: its latency terms (latency bases)."""
    if basis not in LATENCY_BASES:
        return 0.0
    e = row["estimate"]
    if "latency_roofline_s" not in e:
        raise ValueError(f"program {row['program']}: no latency roofline in the report (its HLO could not be "
                         "read); use a bytes-only basis")
    return e["collective_latency_s"] + e["op_overhead_s"]


def _seconds(row: dict, basis: str = "roofline") -> float:
    e = row["estimate"]
    if basis not in BASES:
        raise ValueError(f"unknown forecast basis {basis!r}; choose from {BASES}")
    if basis == "xla":
        return max(e["xla_bytes_s"], e.get("flops_s", 0.0))
    bytes_s = e["roofline_s"] if basis in ("roofline", "latency") else e["bound_s"]
    return bytes_s + _fixed(row, basis)


def default_bases(rows: dict) -> tuple[str, ...]:
    """roofline and bound; "xla" when the roofline times rest on different measures (a program whose HLO could
    not be read next to one whose could), which would bias the comparison; the latency bases when every
    program has its latency terms."""
    sources = {step_source(r) for r in rows.values()} - {"flops"}
    out = ("roofline", "xla", "bound") if len(sources) > 1 else ("roofline", "bound")
    if all("latency_roofline_s" in r["estimate"] for r in rows.values()):
        out += LATENCY_BASES
    return out


def step_source(row: dict) -> str:
    """What the report's roofline time of a row rests on: HLO-op bytes, XLA bytes or flops."""
    e = row["estimate"]
    if e.get("roofline_limit") == "flops":
        return "flops"
    return "HLO-op bytes" if "hlo_op_bytes_s" in e else "XLA bytes"


def _ratio(row: dict, basis: str = "roofline") -> float:
    """The compiled program's bytes-scaled time per byte of its bound (its time less the latency terms / bound
    at the same k)."""
    return (_seconds(row, basis) - _fixed(row, basis)) / row["bound"]["total"]


def _by_k(row: dict) -> dict[int, float]:
    by_k = row["bound"].get("by_k")
    if not by_k:
        raise ValueError(f"program {row['program']}: the report has no bound per k (compiled before the "
                         "payoff forecast; compile it again)")
    return {int(k): float(v) for k, v in by_k.items()}


def round_times(programs: dict, basis: str = "roofline") -> tuple[float, Callable[[int], float],
                                                                  dict[str, tuple[list[int], Callable]]]:
    """(decode_s, verify_s(k), {drafter: (ks, drafter_s(k))}) from a report run's compiled rows by program
    name ("decode", "verify", "spec-mtp", "spec-dspark"): each compiled row's seconds per bound byte scaled
    to k's bound (`bound["by_k"]`), plus its latency terms unscaled (latency bases); a drafter's own time is its
    round minus the verify step at the same k; ks = the k its bound covers (DSpark: at most its block size);
    basis: one of BASES."""
    decode = _seconds(programs["decode"], basis)
    v = programs["verify"]
    v_ratio, v_bound, v_fixed = _ratio(v, basis), _by_k(v), _fixed(v, basis)
    verify = lambda k: v_ratio * v_bound[k] + v_fixed
    drafters = {}
    for name in ("spec-mtp", "spec-dspark"):
        row = programs.get(name)
        if not row or not row.get("compiled"):
            continue
        r_bound = _by_k(row)
        ks = [k for k in sorted(r_bound) if k in v_bound]
        drafters[name.split("-")[1]] = (ks, (lambda rr, rb, rf: lambda k: max(0.0, rr * rb[k] + rf - verify(k)))(
            _ratio(row, basis), r_bound, _fixed(row, basis)))
    return decode, verify, drafters


def _compiled(run: dict) -> dict:
    return {r["program"]: r for r in run["programs"] if r.get("compiled")}


def report_forecast(report: dict, spec: str | Sequence[float], bases: Sequence[str] | None = None) -> dict | None:
    """The forecast of every run of a `dsv4-aot` report that compiled decode, verify and at least one round
    (None if none did): per run and step-time basis (`BASES`; default `default_bases`) the profile used per drafter
    (`profile(spec, drafter)`) and `forecast` rows for its k. ValueError on a bad profile."""
    runs, profiles = [], {}
    for run in report["runs"]:
        rows = _compiled(run)
        if not {"decode", "verify"} <= set(rows) or not {"spec-mtp", "spec-dspark"} & set(rows):
            continue
        steps = {n: r for n, r in rows.items() if n in ("decode", "verify", "spec-mtp", "spec-dspark")}
        for basis in bases or default_bases(steps):
            decode, verify, drafters = round_times(rows, basis)
            out = {"topology": run["topology"], "weights": run["weights"], "mesh_text": run["mesh_text"],
                   "sharding": run.get("sharding"), "basis": basis, "decode_s": decode, "drafters": {},
                   "steps": {n: {"s": _seconds(r, basis), "from": step_source(r) if basis == "roofline" else basis,
                                 "bound_bytes_per_chip": r["bound"]["total"] / run["chips"]}
                             for n, r in steps.items()}}
            for d, (ks, drafter_s) in drafters.items():
                p = profiles[d] = profiles.get(d) or profile(spec, d)     # a summary.json read once per drafter
                out["drafters"][d] = {"profile": dataclasses.asdict(p),
                                      "rows": forecast(p, decode, verify, drafter_s, ks)}
            runs.append(out)
    if not runs:
        return None
    return {"spec": spec if isinstance(spec, str) else ",".join(map(str, spec)), "batch": report["shapes"]["batch"],
            "context": report["shapes"]["context"], "runs": runs}


# ---- rendering -----------------------------------------------------------------------------------------

def _rate_text(p: dict) -> str:
    return f"**{p['name']}** (a_i = " + ", ".join(f"{r:.2f}" for r in p["rates"]) + f"; {p['source']})"


_BASIS_TEXT = {"roofline": "step times = the report's roofline estimates (as compiled)",
               "xla": "step times = XLA's bytes accessed at HBM bandwidth (one measure for every program)",
               "bound": "step times = each program's bytes bound at HBM bandwidth (the ideal payoff)",
               "latency": "step times = the roofline estimates as compiled + collectives × latency + launched ops "
                          "× overhead (the report's latency roofline)",
               "bound+latency": "step times = each program's bytes bound + its latency terms (the payoff once "
                                "the bytes are at their bound, launches and collectives as compiled)"}


def section(fc: dict | None) -> list[str]:
    """Markdown lines of a report's forecast (`report_forecast`), one table per run."""
    if not fc:
        return []
    L = ["## Speculation payoff forecast", "",
         f"Batch {fc['batch']}, context {fc['context']}. tokens/round = 1 + E[accepted] = "
         "1 + Σ_(j≤k) Π_(i≤j) a_i; round ms = drafter(k) + verify(k+1), each the compiled program's "
         "seconds (basis: per table) per bound byte applied to k's bound, drafter(k) = round(k) − verify(k); "
         "tokens/s/seq = tokens/round / round ms; speed-up = that × plain decode ms "
         "(`dsv4_jax.analysis.aot.forecast`, docs/aot.md). DSpark drafts at most its block size.", ""]
    for run in fc["runs"]:
        basis = run.get("basis", "roofline")
        L += [f"### {run['topology']}, {run['weights']} weights, mesh {run['mesh_text']}"
              + (f" ({run['sharding']} preset)" if run.get("sharding") else "") + f": {_BASIS_TEXT[basis]}", ""]
        L += ["- compiled steps: " + "; ".join(f"{n} {v['s'] * 1e3:.3g} ms ({v['from']}, bound "
                                               f"{v['bound_bytes_per_chip'] / 1e9:.3g} GB/chip)"
                                               for n, v in run.get("steps", {}).items())]
        L += [f"- {d}: acceptance profile {_rate_text(v['profile'])}" for d, v in run["drafters"].items()]
        L += ["", "| drafter | k | E[accepted] | tokens/round | verify ms | drafter ms | round ms | tokens/s/seq | "
              "plain decode tokens/s | speed-up |", "|---|---|---|---|---|---|---|---|---|---|"]
        for d, v in run["drafters"].items():
            for r in v["rows"]:
                L.append(f"| {d} | {r['k']} | {r['expected_accepted']:.2f} | {r['tokens_per_round']:.2f} | "
                         f"{r['verify_s'] * 1e3:.2f} | {r['drafter_s'] * 1e3:.2f} | {r['round_s'] * 1e3:.2f} | "
                         f"{r['tokens_per_s']:.1f} | {r['decode_tokens_per_s']:.1f} | {r['speedup']:.2f}× |")
        bests = [f"{d} k = {best(v['rows'])['k']} ({best(v['rows'])['speedup']:.2f}×)"
                 for d, v in run["drafters"].items() if v["rows"]]
        L += ["", "Best: " + "; ".join(bests) + ".", ""]
    return L


def plot_report(fc: dict, path: str) -> None:
    """Speed-up over plain decoding against k, one line per run × drafter."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for run in fc["runs"]:
        for d, v in run["drafters"].items():
            rows = v["rows"]
            basis = run.get("basis", "roofline")
            ax.plot([r["k"] for r in rows], [r["speedup"] for r in rows], marker="o",
                    ls={"roofline": "-", "xla": "--", "latency": "-."}.get(basis, ":"),
                    label=f"{run['topology']} {run['weights']} {d} ({v['profile']['name']}; {basis})")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set(xlabel="draft_n_max k", ylabel="speed-up over plain decoding",
           title=f"speculation payoff forecast, batch {fc['batch']}, context {fc['context']}")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def best(rows: list[dict]) -> dict:
    return max(rows, key=lambda r: (r["speedup"], -r["k"])) if rows else {}


__all__ = ["Profile", "PUBLISHED", "DEFAULT_PROFILE", "K_RANGE", "given", "conditional", "from_sweep", "profile",
           "expected_accepted", "forecast_row", "forecast", "BASES", "LATENCY_BASES", "default_bases", "step_source", "round_times",
           "report_forecast", "section", "plot_report", "best"]
