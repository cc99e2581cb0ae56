"""Bandwidth-roofline prices of speculative rounds (docs/width_scheduler.md §4): the bytes a round must read,
from the abstract parameter shapes, ÷ a machine's read bandwidth + a fixed cost per round. Nothing is
allocated or compiled. `table` turns them into a `speculative.cost_table.CostTable`; this module holds the machines
and the byte counts (in `analysis`: `speculative` imports nothing above it).

Notation: B sequences, context C committed tokens, w drafts verified (w = 0..K), weight format f
(`analysis.traffic.FORMATS`), β the machine's read bandwidth (bytes/s), t₀ its fixed cost per round (s),
V vocabulary, D hidden size, d head dim, W sliding window, γ DSpark's block size.

    plain round   p   = T(1) / β + t₀
    width w       s_w = (T(w + 1) + Dr(w)) / β + t₀
    T(n)          = traffic.bytes_bound(config, f, B, C, tokens=n)["total"]: the target's step over n tokens
                    per sequence (weights once, routed experts for the distinct ones B·n tokens reach, each
                    sequence's cache at C)

Dr(w) is the drafter's work in a round of `round.speculative_round` at a fixed width w (MODE_FIXED,
`Knobs.draft_n` = w: what a measured table times): the drafter proposes, the target verifies
[last, d_1..d_w], the drafter observes the committed rows. w = 0 is the scheduler's width 0: the drafter
ran (proposed and observed) but nothing was verified. Each drafter pass reads the drafter weights it uses
for its tokens (`analysis.aot.bounds.tree_read_bytes`: routed experts × a(n)/E with
a(n) = E·(1 − (1 − k/E)^n), `traffic.expected_active_experts`) plus the target leaves it shares
(`shared_bytes`: the head [V, D] whole, n embedding rows, its cache rows of d at 2 bytes):

    MTP     Dr(w) = M(B·(w + 1)) + max(w − 1, 0) · M(B)
            M(n)  = the MTP block, enorm/hnorm/e_proj/h_proj, hc_head, norm over n rows + the head
                    + B·min(W, C) window rows.
            The observe runs the w + 1 committed rows (the block's static width, however many were
            accepted); the first draft comes from its logits (`mtp.propose`), each further one is a
            single-row chain step.
    DSpark  Dr(w) = S(B·γ) + max(1, min(w, γ)) · H + O(B·(w + 1))
            S(n)  = every stage over the block [anchor, noise × (γ − 1)], hc_head, norm + the head
                    + B·n_stages·min(W, C) context-ring rows;
            H     = one Markov step: markov_w2 [V, R] whole, B rows of markov_w1, conf_proj;
            O(n)  = the observe: main_proj, main_norm and each stage's attn.wkv / kv_norm over n rows.
            The Markov head runs at least one step (`dspark.propose` clips draft_n to 1..k); a width above γ
            verifies more than DSpark proposes and is priced with γ steps.
    ngram   Dr(w) = 4·B·C: its int32 token history, read once (no weights).

Decisions: the activations (logits, drafts, q) and the writes of new rows are not counted, as in
`traffic`; a drafter under MODE_AUTO drafts up to the bound before the width is chosen (stopping early
where no width could pay), so a round it verifies at width w can read more than Dr(w) — the table prices
what the calibration times. t₀ is one fixed cost per round, the same for plain and drafting rounds.

Machines (`MACHINES`, or "NAME:GBPS[:FIXED_US]" for any other): the read bandwidth is the published figure
of one device (a model split over N devices whose bytes divide evenly runs N× faster: give N·GBPS). The
fixed cost per round is an assumption, not a measurement: `DEFAULT_FIXED_US` = 30 µs on every machine, the
order of a decode step's launch and synchronisation overhead (a CUDA-graph step on a GPU; on a TPU the
round's few dozen small ops at the ≈ 1 µs per op `analysis.aot.chips` assumes); give it per run as the
third field.
"""
from __future__ import annotations

import dataclasses
import math
import re

from . import traffic
from .aot import bounds
from .aot.chips import ALIASES, CHIPS
from ..config import ModelConfig
from ..model import params as P
from ..speculative.cost_table import CostTable, CostTableError

DEFAULT_FIXED_US = 30.0           # fixed cost per round, µs (assumed: module docstring)
CACHE_ITEMSIZE = 2                # bf16 window / context rows
INT32 = 4
DRAFTERS = ("mtp", "dspark", "ngram")
# DSpark shapes when no weights are given: dsv4-train-drafter's defaults (3 stages, 3 taps, Markov rank 256)
DSPARK_STAGES, DSPARK_TAPS, DSPARK_RANK, DSPARK_BLOCK = 3, 3, 256, 5
REPORT_FORMAT = {v: k for k, v in bounds.MODEL_FORMAT.items()}     # traffic's format names -> bounds'


@dataclasses.dataclass(frozen=True)
class Machine:
    """A machine the roofline prices a round on: gbps read bandwidth (1e9 bytes/s), fixed_us per round."""

    name: str
    gbps: float
    fixed_us: float = DEFAULT_FIXED_US
    source: str = "given"

    def seconds(self, n_bytes: float) -> float:
        """n_bytes / bandwidth + the fixed cost per round."""
        return n_bytes / (self.gbps * 1e9) + self.fixed_us * 1e-6


_GPU = "published HBM bandwidth"
MACHINES: dict[str, Machine] = {
    "h100": Machine("h100", 3350.0, source=f"NVIDIA H100 SXM 80 GB, {_GPU} 3.35 TB/s"),
    "h200": Machine("h200", 4800.0, source=f"NVIDIA H200 SXM 141 GB, {_GPU} 4.8 TB/s"),
    **{g: Machine(g, c.hbm_gbps, source=f"{c.device_kind}, one chip, HBM bandwidth of the Cloud TPU pages "
                                        "(analysis/aot/chips.py)") for g, c in CHIPS.items()},
}
_CUSTOM = re.compile(r"([a-z0-9][a-z0-9_.-]*):([^:]+)(?::([^:]+))?")


def parse_machine(text: str) -> Machine:
    """A machine by name (`MACHINES`, TPU aliases such as "trillium") or "NAME:GBPS[:FIXED_US]" (GBPS > 0,
    FIXED_US >= 0, default `DEFAULT_FIXED_US`). ValueError naming the known machines otherwise."""
    t = text.strip().lower()
    if ALIASES.get(t, t) in MACHINES:
        return MACHINES[ALIASES.get(t, t)]
    m = _CUSTOM.fullmatch(t)
    if not m:
        raise ValueError(f"unknown machine {text!r}: give one of {', '.join(sorted(MACHINES))} or "
                         "NAME:GBPS[:FIXED_US] (read bandwidth in GB/s, fixed cost per round in µs)")
    gbps, fixed = _number(m[2], text, "GBPS"), _number(m[3] or str(DEFAULT_FIXED_US), text, "FIXED_US")
    if not gbps > 0 or not fixed >= 0:
        raise ValueError(f"machine {text!r}: GBPS must be > 0 and FIXED_US >= 0")
    return Machine(m[1], gbps, fixed, "given")


def _number(s: str, text: str, what: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise ValueError(f"machine {text!r}: {what} {s!r} is not a number") from None
    if not math.isfinite(v):
        raise ValueError(f"machine {text!r}: {what} must be finite")
    return v


# ---- bytes ----------------------------------------------------------------------------------------------------

def target_bytes(config: ModelConfig, fmt: str, batch: int, context: int, tokens: int) -> float:
    """T(tokens): the target's step over `tokens` tokens per sequence (`traffic.bytes_bound`'s total)."""
    return traffic.bytes_bound(config, fmt, batch, context, tokens)["total"]


def shared_bytes(config: ModelConfig, fmt: str, n_tokens: int, window_rows: int) -> float:
    """What a drafter pass over n_tokens rows reads of the target and the cache: the head [V, D] whole,
    n_tokens embedding rows, window_rows rows of head_dim."""
    V, D = config.vocab_size, config.hidden_size
    head = traffic.element_bytes("head", P.ParamSpec((V, D), ("vocab", "embed")), fmt)
    row = traffic.element_bytes("embed", P.ParamSpec((V, D), ("vocab", "embed"), init="embed"), fmt)
    return V * D * head + min(n_tokens, V) * D * row + window_rows * config.head_dim * CACHE_ITEMSIZE


def _read(specs, fmt: str, n_tokens: int, config: ModelConfig, keep=None) -> float:
    return bounds.tree_read_bytes(specs, REPORT_FORMAT[fmt], n_tokens, config.num_experts_per_tok, keep)


def mtp_bytes(config: ModelConfig, fmt: str, specs, batch: int, context: int, w: int) -> dict:
    """Dr(w) of MTP (module docstring): {"observe", "chain", "total"} in bytes."""
    window = batch * min(config.sliding_window, context)
    one = lambda n: _read(specs, fmt, n, config) + shared_bytes(config, fmt, n, window)
    out = {"observe": one(batch * (w + 1)), "chain": max(w - 1, 0) * one(batch)}
    return {**out, "total": sum(out.values())}


_MARKOV = ("markov_w1", "markov_w2", "conf_proj")
_OBSERVE = re.compile(r"^main_|(^|\.)attn\.(wkv|kv_norm)$")


def dspark_bytes(config: ModelConfig, fmt: str, specs, batch: int, context: int, w: int, block: int) -> dict:
    """Dr(w) of DSpark (module docstring): {"block", "markov", "observe", "total"} in bytes."""
    stages = len(specs["stages"])
    block_leaf = lambda p: not p.startswith(_MARKOV) and not p.startswith("main_")
    n = batch * block
    out = {"block": _read(specs, fmt, n, config, block_leaf)
           + shared_bytes(config, fmt, n, batch * stages * min(config.sliding_window, context)),
           "markov": max(1, min(w, block)) * _read(specs, fmt, batch, config, lambda p: p.startswith(_MARKOV)),
           "observe": _read(specs, fmt, batch * (w + 1), config, lambda p: bool(_OBSERVE.search(p)))}
    return {**out, "total": sum(out.values())}


def drafter_bytes(config: ModelConfig, drafter: str, fmt: str, batch: int, context: int, w: int, *,
                  specs=None, block: int | None = None) -> dict:
    """Dr(w) of a drafter in bytes, by pass (+ "total"); specs: its ParamSpec tree (default `default_specs`),
    block: DSpark's γ (default `DSPARK_BLOCK`). ValueError for a drafter it does not price."""
    specs = default_specs(config, drafter) if specs is None else specs      # ValueError for other drafters
    if drafter == "ngram":
        return {"history": INT32 * batch * context, "total": INT32 * batch * context}
    if drafter == "mtp":
        return mtp_bytes(config, fmt, specs, batch, context, w)
    return dspark_bytes(config, fmt, specs, batch, context, w, block or DSPARK_BLOCK)


def default_specs(config: ModelConfig, drafter: str):
    """The drafter's ParamSpec tree without weights at hand: the MTP block, or DSpark at DSPARK_* shapes."""
    if drafter not in DRAFTERS:
        raise ValueError(f"the roofline prices the drafters {', '.join(DRAFTERS)}, not {drafter!r}")
    if drafter == "mtp":
        return P.mtp_specs(config)
    return P.dspark_specs(config, DSPARK_STAGES, DSPARK_TAPS, DSPARK_RANK, False) if drafter == "dspark" else None


def specs_of(config: ModelConfig, drafter: str, params: dict):
    """The drafter's ParamSpec tree at the shapes of a model's weights (params["dspark"]: its stages, taps,
    Markov rank and confidence bias); None for a drafter without weights."""
    if drafter != "dspark":
        return default_specs(config, drafter)
    d = params["dspark"]
    return P.dspark_specs(config, len(d["stages"]), d["main_proj"].shape[1] // config.hidden_size,
                          d["markov_w1"].shape[1], "bias" in d["conf_proj"])


def weight_format(params: dict) -> str:
    """traffic's format of a model's weights: "release" (FP4 routed experts), "fp8-experts" (other
    quantized routed experts) or "bf16"."""
    experts = [f for path, f in P.formats_of(params).items() if P.RELEASE_FP4.search(path)]
    if not experts:
        return "bf16"
    return "release" if any(f.codes.startswith("e2m1") for f in experts) else "fp8-experts"


def round_bytes(config: ModelConfig, drafter: str, batch: int, bound: int, *, context: int, fmt: str = "bf16",
                dspark_block: int | None = None, specs=None) -> dict:
    """{"plain": T(1), "rounds": (T(w+1) + Dr(w) for w = 0..bound), "drafter": (Dr(w), ...)} in bytes."""
    if batch < 1 or bound < 0 or context < 0:
        raise ValueError(f"the roofline needs batch >= 1, bound >= 0 and context >= 0, got batch {batch}, "
                         f"bound {bound}, context {context}")
    if fmt not in traffic.FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; choose from {traffic.FORMATS}")
    if drafter not in DRAFTERS:
        raise ValueError(f"the roofline prices the drafters {', '.join(DRAFTERS)}, not {drafter!r}")
    specs = default_specs(config, drafter) if specs is None else specs
    draft = [drafter_bytes(config, drafter, fmt, batch, context, w, specs=specs, block=dspark_block)["total"]
             for w in range(bound + 1)]
    rounds = tuple(target_bytes(config, fmt, batch, context, w + 1) + draft[w] for w in range(bound + 1))
    return {"plain": target_bytes(config, fmt, batch, context, 1), "rounds": rounds, "drafter": tuple(draft)}


# ---- as a cost table (`speculative.cost_table.CostTable`) -----------------------------------------------

def machine(text: str) -> Machine:
    """A machine for `table`: a name of `MACHINES` ("h100", "h200", "v5e", "v5p", "v6e", ...)
    or "NAME:GBPS[:FIXED_US]"; CostTableError naming the known machines otherwise."""
    try:
        return parse_machine(text)
    except ValueError as e:
        raise CostTableError(str(e)) from None


def table(config, drafter: str, batch: int, bound: int, machine_: "Machine | str", *, context: int,
          fmt: str = "bf16", dspark_block: int | None = None, drafter_specs=None) -> CostTable:
    """A table of bandwidth-roofline seconds (docs/width_scheduler.md §4, formulas in the module docstring):
    width w = 0..bound costs (bytes of the target's verify of w + 1 tokens per sequence + the drafter's work
    for w drafts) / the machine's bandwidth + its fixed cost per round; plain the one-token decode's bytes /
    bandwidth + the fixed cost. batch sequences at `context` committed tokens, weights in traffic's format
    `fmt`; dspark_block: DSpark's block size γ; drafter_specs: the drafter's ParamSpec tree (default its
    released shapes, `default_specs`; a loaded model's: `specs_of`). Abstract shapes
    only. CostTableError for an unknown machine, drafter or format."""
    m = machine_ if isinstance(machine_, Machine) else machine(machine_)
    try:
        b = round_bytes(config, drafter, batch, bound, context=context, fmt=fmt, dspark_block=dspark_block,
                          specs=drafter_specs)
    except ValueError as e:
        raise CostTableError(f"roofline: {e}") from None
    key = {"roofline": {"machine": m.name, "gbps": m.gbps, "fixed_us": m.fixed_us, "machine_source": m.source,
                        "format": fmt, "context": context,
                        "dspark_block": (dspark_block or DSPARK_BLOCK) if drafter == "dspark" else None,
                        "plain_bytes": b["plain"], "bytes": list(b["rounds"]), "drafter_bytes": list(b["drafter"])}}
    return CostTable(seconds=tuple(m.seconds(x) for x in b["rounds"]), plain_seconds=m.seconds(b["plain"]),
                     drafter=drafter, batch=batch, source=f"roofline {m.name}", key=key)
