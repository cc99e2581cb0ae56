"""Timed generation runs for the research CLIs: settings, shared shapes, warm-up, repeats.

Every run is `dsv4_jax.generate` with the option groups of `plan_options` (`padded_options`, also behind
`generate_padded`): fixed shapes chosen for the whole invocation (`SweepPlan`), so that settings share
compiled programs:

  * prompts are right-padded to one of a few length buckets (`length_buckets`: at most --prompt-buckets
    lengths, chosen to minimise padding), not all to the longest prompt; the prompt lengths are passed
    as per-sequence lengths (a ragged batch in `generate`); one prefill program per bucket;
  * one `max_len` (the longest bucket + max_new_tokens + the widest verify block) and one `max_block`
    (the largest draft_n_max + 1) for every run: the prefill and the drafter priming compile once per
    bucket for all draft_n_max values (`RunShape.max_block`);
  * the drafters of the sweep are compiled together (`RunShape.drafter_pool`): one loop program per
    draft width shared by MTP and DSpark, the drafter chosen at run time;
  * with `SweepPlan.dynamic_draft_n` (dsv4-sweep --shared-draft-widths, its default) one loop program
    serves every draft_n_max: the drafting is compiled once with draft_n_max a run-time bound, the
    verify still draft_n_max + 1 wide (`RunShape.dynamic_draft_n`: a switch over the widths; the same
    tokens and per-round cost as the per-width program);
  * `precompile` compiles those distinct programs before the first run (`speculative.precompile`), so the
    warm-ups and timed runs find them compiled and a first run's compile time is reported apart.

Wall time covers prefill + all decode rounds and ends with `jax.block_until_ready` (inside
`generate`'s machinery); prefill and decode are timed apart.
"""
from __future__ import annotations

import dataclasses
import itertools
import statistics
import time
from typing import Any, Mapping, Sequence

from ..drafters import registry
from ..speculative.cost_table import cached_or_calibrate
from ..speculative.generate import generate, prepare
from ..speculative.precompile import compile_all, programs
from ..speculative.options import RunShape, Sampling, Speculation

BASELINE = "none"                          # no speculation: what speed-ups are measured against
SPEC_TYPES = (BASELINE, "mtp", "dspark", "ngram")   # the drafters the CLIs offer (names in drafters.registry)
KNOB_LABELS = {"p_min": "p_min", "confidence_threshold": "conf"}   # a drafter's stop knob, as shown in tables


@dataclasses.dataclass(frozen=True)
class Setting:
    """One point of a sweep grid."""

    spec: str                       # none | mtp | dspark | ngram
    draft_n_max: int = 0            # 0 for none; the bound (draft_n_max_bound) of an auto setting
    p_min: float = 0.0              # MTP only
    confidence_threshold: float = 0.0   # DSpark only
    temperature: float = 0.0
    batch_size: int = 1
    auto: bool = False              # draft_n_max="auto": the width scheduler (docs/width_scheduler.md)

    @property
    def drafter(self) -> str | None:
        return None if self.spec == BASELINE else self.spec

    @property
    def knob_name(self) -> str | None:
        """The drafter's stop knob (`Drafter.stop_knob`: "p_min", "confidence_threshold") or None."""
        return registry.get(self.drafter).stop_knob

    def drafter_options(self):
        """The drafter's options at this setting: its stop knob's value (`Drafter.options`); None for none."""
        if self.drafter is None:
            return None
        name = self.knob_name
        return registry.get(self.drafter).options(**({name: getattr(self, name)} if name else {}))

    @property
    def knob(self) -> str:
        """The spec-specific threshold, as shown in tables ('' for none)."""
        name = self.knob_name
        return f"{KNOB_LABELS[name]}={getattr(self, name):g}" if name else ""

    @property
    def label(self) -> str:
        k = "" if self.spec == BASELINE else " k=auto" if self.auto else f" k={self.draft_n_max}"
        knob = f" {self.knob}" if self.knob else ""
        return f"{self.spec}{k}{knob} T={self.temperature:g} B={self.batch_size}"

    @property
    def group(self) -> tuple[float, int]:
        """Settings compared against the same no-speculation baseline: same temperature and batch size."""
        return (self.temperature, self.batch_size)

    @property
    def table_key(self) -> tuple[str, int, bool]:
        """What a cost table is measured for: (drafter, batch size, greedy)."""
        return (self.spec, self.batch_size, self.temperature == 0)

    def as_dict(self) -> dict:
        """A results row's setting fields; draft_n_max "auto" (draft_n_max_bound: its bound) for auto settings."""
        return {"spec_type": self.spec, "draft_n_max": "auto" if self.auto else self.draft_n_max,
                "draft_n_max_bound": self.draft_n_max if self.auto else None, "p_min": self.p_min,
                "confidence_threshold": self.confidence_threshold, "knob_name": self.knob_name,
                "temperature": self.temperature, "batch_size": self.batch_size, "label": self.label}


def grid_settings(specs: Sequence[str], ks: Sequence[int], knob_values: Mapping[str, Sequence[float]],
                  temps: Sequence[float], batch_sizes: Sequence[int], auto_bound: int | None = None) -> list[Setting]:
    """The grid as a list: per (temperature, batch size) the baseline first, then each drafter (SPEC_TYPES
    order) × draft_n_max × the values of its stop knob (knob_values[Drafter.stop_knob]); auto_bound: after
    each drafter's fixed widths, its draft_n_max="auto" settings with that bound (None: none)."""
    out = []
    for t, b in itertools.product(temps, batch_sizes):
        for spec in (s for s in SPEC_TYPES if s in specs):
            if spec == BASELINE:
                out.append(Setting(BASELINE, 0, temperature=t, batch_size=b))
                continue
            knob = registry.get(spec).stop_knob
            widths = [(k, False) for k in ks] + ([(auto_bound, True)] if auto_bound is not None else [])
            for (k, auto), v in itertools.product(widths, knob_values[knob] if knob else [None]):
                out.append(Setting(spec, k, temperature=t, batch_size=b, auto=auto, **({knob: v} if knob else {})))
    return out


def padded_options(setting: Setting, plan: "SweepPlan", pad_to: int, cost_table=None) -> dict:
    """`generate`'s option groups for one setting, prompts right-padded to `pad_to`, the shapes and knobs fixed by
    the plan.

    An auto setting runs draft_n_max="auto" with its bound and cost_table (a CostTable; None: `generate`
    calibrates); `SweepPlan.adaptive_widths` (with a max_block): fixed widths run in the width scheduler's program,
    the one the auto settings compile (`RunShape.adaptive_widths`)."""
    spec = Speculation(drafter=setting.drafter, options=setting.drafter_options(), verify=plan.verify,
                       synthetic_accept=plan.synthetic_accept,
                       **({"draft_n_max": "auto", "draft_n_max_bound": setting.draft_n_max, "cost_table": cost_table}
                          if setting.auto else {"draft_n_max": max(setting.draft_n_max, 1)}))
    max_block = plan.max_block
    shared = max_block is not None
    return {"sampling": Sampling(temperature=setting.temperature, top_p=plan.top_p, seed=plan.seed),
            "speculation": spec,
            "run": RunShape(eos_token_id=plan.eos_token_id, max_len=plan.max_len, pad_to=pad_to, max_block=max_block,
                            drafter_pool=plan.drafter_pool,
                            dynamic_draft_n=(plan.dynamic_draft_n or plan.adaptive_widths) and shared,
                            prefill_chunk=plan.prefill_chunk, adaptive_widths=plan.adaptive_widths and shared,
                            round_trace=plan.round_trace)}


def generate_padded(params: dict, config, prompts: Sequence[Sequence[int]], setting: Setting, plan: "SweepPlan"):
    """`dsv4_jax.generate` for one setting, `plan.max_new_tokens` tokens, prompts right-padded to the plan's
    longest bucket, the shapes fixed by the plan.

    config: a ModelConfig or a config bundle (`LoadedModel.bundle`: the drafters' settings come from it).
    `SweepPlan.max_block` / `SweepPlan.drafter_pool`: `RunShape`'s (shared programs across draft_n_max values and
    drafters)."""
    return generate(params, config, [list(p) for p in prompts], plan.max_new_tokens,
                    **padded_options(setting, plan, plan.pad_to))


def plan_options(batch: Sequence[dict], setting: Setting, plan: "SweepPlan", cost_table=None) -> dict:
    """`padded_options` of a batch under the plan (its bucket, the plan's shapes and knobs); cost_table: an
    auto setting's."""
    return padded_options(setting, plan, plan.pad_for([len(p["tokens"]) for p in batch]), cost_table)


GRANULE = 16       # padded prompt lengths are multiples of this


def length_buckets(lengths: Sequence[int], n_buckets: int, granule: int = GRANULE) -> tuple[int, ...]:
    """At most n_buckets padded lengths (multiples of granule) for prompts of these lengths, chosen to
    minimise the padded tokens: the sorted lengths split into consecutive groups (dynamic programming),
    each padded to its longest. Each bucket is one prefill program, so few buckets compile fast."""
    up = lambda n: -(-n // granule) * granule
    xs = sorted({up(n) for n in lengths})
    count = {x: sum(1 for n in lengths if up(n) == x) for x in xs}
    n_buckets = max(1, min(n_buckets, len(xs)))
    # best[j][i]: least padded tokens for xs[:i] in j groups; cut[j][i]: where the last group starts
    inf = float("inf")
    best = [[inf] * (len(xs) + 1) for _ in range(n_buckets + 1)]
    cut = [[0] * (len(xs) + 1) for _ in range(n_buckets + 1)]
    best[0][0] = 0
    for j in range(1, n_buckets + 1):
        for i in range(1, len(xs) + 1):
            for s in range(i):
                c = best[j - 1][s] + xs[i - 1] * sum(count[x] for x in xs[s:i])
                if c < best[j][i]:
                    best[j][i], cut[j][i] = c, s
    j = min(range(1, n_buckets + 1), key=lambda j: best[j][len(xs)])
    out, i = [], len(xs)
    while i > 0:
        out.append(xs[i - 1])
        i, j = cut[j][i], j - 1
    return tuple(sorted(out))


def bucket_of(n: int, buckets: Sequence[int]) -> int:
    """The padded length of an n-token prompt: the smallest bucket that holds it."""
    fits = [b for b in buckets if b >= n]
    if not fits:
        raise ValueError(f"a {n}-token prompt is longer than every bucket {list(buckets)}")
    return min(fits)


@dataclasses.dataclass(frozen=True)
class SweepPlan:
    """Shapes and knobs shared by every run of a CLI invocation.

    buckets: the prompt lengths runs are padded to (`length_buckets`); max_len: the cache capacity of
    every run; max_block: the widest verify block (largest draft_n_max + 1); drafter_pool: the drafters
    compiled together (None: each its own program); dynamic_draft_n: one loop program for every
    draft_n_max (`RunShape.dynamic_draft_n`); prefill_chunk: every bucket prefilled in chunks of
    that many tokens by one program (`RunShape.prefill_chunk`; None: one prefill program per bucket);
    adaptive_widths: the drafters' fixed widths run in the width scheduler's program, shared with the
    draft_n_max="auto" settings (`RunShape.adaptive_widths`; with max_block)."""

    max_new_tokens: int
    buckets: tuple[int, ...]
    max_len: int
    max_block: int = 1
    drafter_pool: tuple[str, ...] | None = None
    dynamic_draft_n: bool = False
    seed: int = 0
    top_p: float = 1.0
    eos_token_id: int | None = None     # None: the config's; -1: never stop early
    prefill_chunk: int | None = None
    verify: str = "token"                          # Speculation.verify (docs/verification.md)
    synthetic_accept: tuple[float, ...] | None = None   # Speculation.synthetic_accept
    adaptive_widths: bool = False
    round_trace: bool = False          # RunShape.round_trace: every round's drafts and acceptance recorded

    @property
    def pad_to(self) -> int:
        """The longest bucket."""
        return max(self.buckets)

    def pad_for(self, lengths: Sequence[int]) -> int:
        """The bucket of a batch (its longest prompt's)."""
        return bucket_of(max(lengths), self.buckets)


def plan_shapes(prompt_lengths: Sequence[int], max_new_tokens: int, max_draft: int,
                n_buckets: int = 2) -> tuple[tuple[int, ...], int]:
    """(buckets, max_len): at most n_buckets padded prompt lengths (`length_buckets`); room for the longest
    bucket, the budget and the widest verify block."""
    buckets = length_buckets(prompt_lengths, n_buckets)
    return buckets, max(buckets) + max_new_tokens + max_draft + 1


def pool_for(model, specs: Sequence[str], k_max: int) -> tuple[str, ...] | None:
    """The drafters of a run that can share loop programs: those with weights whose cap on draft_n_max
    is the same at every k up to k_max (DSpark caps at its block size); None for fewer than two."""
    names = [s for s in specs if s != BASELINE]
    if len(names) < 2:
        return None
    caps = {n: tuple(model.draft_setup(n, k).k for k in range(1, k_max + 1)) for n in names}
    return tuple(names) if len(set(caps.values())) == 1 else None


def effective_draft_n_max(setting: Setting, model) -> int:
    """Drafts per round actually used (a drafter may cap draft_n_max: DSpark at its block size)."""
    if setting.spec == BASELINE:
        return setting.draft_n_max
    return model.draft_setup(setting.spec, setting.draft_n_max).k


def run_batch(model, batch: Sequence[dict], setting: Setting, plan: SweepPlan, repeats: int = 1,
              cost_table=None) -> dict[str, Any]:
    """Run one batch of prompts `repeats` times with the same seed; medians are reported (cost_table: an
    auto setting's).

    Returns {"tokens", "stats" (from the last repeat; counts are identical across repeats under one
    seed), "walls", "prefills", "decodes" (every repeat), "wall_s", "prefill_s", "decode_s" (medians;
    decode = the decode loop after the prefill, which also samples the first token), "pad_to"}.
    """
    options = plan_options(batch, setting, plan, cost_table)
    pad_to = options["run"].pad_to
    walls, prefills, decodes, tokens, stats = [], [], [], None, None
    for _ in range(repeats):
        tokens, stats = generate(model.params, model.bundle, [list(p["tokens"]) for p in batch],
                                 plan.max_new_tokens, **options)
        walls.append(stats["wall_s"])
        prefills.append(stats["prefill_s"])
        decodes.append(stats["decode_s"])
    return {"tokens": tokens, "stats": stats, "walls": walls, "prefills": prefills, "decodes": decodes,
            "wall_s": statistics.median(walls), "prefill_s": statistics.median(prefills),
            "decode_s": statistics.median(decodes), "pad_to": pad_to}


def merge_runs(runs: Sequence[dict]) -> dict[str, Any]:
    """One `run_batch` result from several (each of one or more repeats, in order): the timings of all,
    medians over them, tokens and stats of the last."""
    walls, prefills, decodes = ([t for r in runs for t in r[key]] for key in ("walls", "prefills", "decodes"))
    return {**runs[-1], "walls": walls, "prefills": prefills, "decodes": decodes, "wall_s": statistics.median(walls),
            "prefill_s": statistics.median(prefills), "decode_s": statistics.median(decodes)}


def warm_up(model, batch: Sequence[dict], setting: Setting, plan: SweepPlan, cost_table=None) -> float:
    """One untimed run of the batch shape (compilation, when its programs are new); returns its wall time."""
    t0 = time.perf_counter()
    run_batch(model, batch, setting, plan, repeats=1, cost_table=cost_table)
    return time.perf_counter() - t0


def calibrate_setting(model, batch: Sequence[dict], setting: Setting, plan: SweepPlan, *, refresh: bool = False,
                      progress=None, cache_dir: str | None = None):
    """The cost table of an auto setting: `cost_table.cached_or_calibrate` on the program its runs of this
    batch shape call (under a drafter pool, named after the setting's drafter). -> (CostTable, "cached" |
    "measured")."""
    r = prepare(model.params, model.bundle, [list(p["tokens"]) for p in batch], plan.max_new_tokens,
                **plan_options(batch, setting, plan))
    return cached_or_calibrate(model.params, r.config, r, cache_dir=cache_dir, refresh=refresh, progress=progress,
                               drafter=setting.spec)


def precompile(model, prompts: Sequence[dict], settings: Sequence[Setting], plan: SweepPlan,
               threads: int = 1) -> dict[str, Any]:
    """Compile every program the settings' runs call (each batch shape), `threads` at a time, before any
    run (`speculative.precompile`); the warm-ups and timed runs then find them compiled.
    -> {"programs": distinct programs, "wall_s": seconds}."""
    progs = []
    for s in settings:
        for g in shapes(prompts, s.batch_size, plan):
            r = prepare(model.params, model.bundle, [list(p["tokens"]) for p in g], plan.max_new_tokens,
                        **plan_options(g, s, plan))
            progs += programs(model.params, r)
    return compile_all(progs, threads)


def shapes(prompts: Sequence[dict], size: int, plan: SweepPlan) -> list[list[dict]]:
    """One batch per distinct compiled shape (batch size, bucket) among `batches(prompts, size)`."""
    seen, out = set(), []
    for g in batches(prompts, size):
        key = (len(g), plan.pad_for([len(p["tokens"]) for p in g]))
        if key not in seen:
            seen.add(key)
            out.append(g)
    return out


def batches(prompts: Sequence[dict], size: int) -> list[list[dict]]:
    """Consecutive groups of `size` prompts (the last one may be smaller)."""
    return [list(prompts[i:i + size]) for i in range(0, len(prompts), size)]


def per_sequence(stats: dict, b: int) -> dict[str, int]:
    """Counts of sequence b of a batch run: predicted, draft, accepted, rounds."""
    ps = stats["per_sequence"]
    return {"predicted": int(stats["per_sequence_generated"][b]), "draft": int(ps["drafted"][b]),
            "accepted": int(ps["accepted"][b]), "rounds": int(ps["rounds"][b])}
