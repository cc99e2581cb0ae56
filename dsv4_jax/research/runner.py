"""Timed generation runs for the research CLIs: settings, fixed shapes, warm-up, repeats.

Every run goes through `generate_padded`, which is `dsv4_jax.generate` with the prompts right-padded
to one length for the whole run (the prompt lengths are passed as per-sequence lengths, exactly like
a ragged batch in `generate`), and one explicit `max_len`. So each setting compiles once (its
warm-up run), whatever the prompt lengths; wall time covers prefill + all decode rounds and ends
with `jax.block_until_ready` (inside `generate`'s machinery).
"""
from __future__ import annotations

import dataclasses
import itertools
import statistics
import time
from typing import Any, Mapping, Sequence

from ..drafters import registry
from ..spec.generate import generate
from ..spec.options import RunShape, Sampling, Speculation

BASELINE = "none"                          # no speculation: what speed-ups are measured against
SPEC_TYPES = (BASELINE, "mtp", "dspark")   # the drafters the CLIs offer (names in drafters.registry)
KNOB_LABELS = {"p_min": "p_min", "confidence_threshold": "conf"}   # a drafter's stop knob, as shown in tables


@dataclasses.dataclass(frozen=True)
class Setting:
    """One point of a sweep grid."""

    spec: str                       # none | mtp | dspark
    draft_n_max: int = 0            # 0 for none
    p_min: float = 0.0              # MTP only
    confidence_threshold: float = 0.0   # DSpark only
    temperature: float = 0.0
    batch_size: int = 1

    @property
    def drafter(self) -> str | None:
        return None if self.spec == BASELINE else self.spec

    @property
    def knob_name(self) -> str | None:
        """The drafter's stop knob (`Drafter.stop_knob`: "p_min", "confidence_threshold") or None."""
        return registry.get(self.drafter).stop_knob

    @property
    def knob(self) -> str:
        """The spec-specific threshold, as shown in tables ('' for none)."""
        name = self.knob_name
        return f"{KNOB_LABELS[name]}={getattr(self, name):g}" if name else ""

    @property
    def label(self) -> str:
        k = f" k={self.draft_n_max}" if self.spec != BASELINE else ""
        knob = f" {self.knob}" if self.knob else ""
        return f"{self.spec}{k}{knob} T={self.temperature:g} B={self.batch_size}"

    @property
    def group(self) -> tuple[float, int]:
        """Settings compared against the same no-speculation baseline: same temperature and batch size."""
        return (self.temperature, self.batch_size)

    def as_dict(self) -> dict:
        return {"spec_type": self.spec, "draft_n_max": self.draft_n_max, "p_min": self.p_min,
                "confidence_threshold": self.confidence_threshold, "knob_name": self.knob_name,
                "temperature": self.temperature, "batch_size": self.batch_size, "label": self.label}


def grid_settings(specs: Sequence[str], ks: Sequence[int], knob_values: Mapping[str, Sequence[float]],
                  temps: Sequence[float], batch_sizes: Sequence[int]) -> list[Setting]:
    """The grid as a list: per (temperature, batch size) the baseline first, then each drafter (SPEC_TYPES
    order) × draft_n_max × the values of its stop knob (knob_values[Drafter.stop_knob])."""
    out = []
    for t, b in itertools.product(temps, batch_sizes):
        for spec in (s for s in SPEC_TYPES if s in specs):
            if spec == BASELINE:
                out.append(Setting(BASELINE, 0, temperature=t, batch_size=b))
                continue
            knob = registry.get(spec).stop_knob
            for k, v in itertools.product(ks, knob_values[knob] if knob else [None]):
                out.append(Setting(spec, k, temperature=t, batch_size=b, **({knob: v} if knob else {})))
    return out


def generate_padded(params: dict, config, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, pad_to: int,
                    max_len: int, setting: Setting, top_p: float = 1.0, eos_token_id: int | None = None,
                    seed: int = 0):
    """`dsv4_jax.generate` for one setting, prompts right-padded to `pad_to` (one compiled shape per setting).

    config: a ModelConfig or a config bundle (`LoadedModel.bundle`: the drafters' settings come from it)."""
    return generate(params, config, [list(p) for p in prompts], max_new_tokens,
                    sampling=Sampling(temperature=setting.temperature, top_p=top_p, seed=seed),
                    speculation=Speculation(drafter=setting.drafter, draft_n_max=max(setting.draft_n_max, 1),
                                            p_min=setting.p_min, confidence_threshold=setting.confidence_threshold),
                    run=RunShape(eos_token_id=eos_token_id, max_len=max_len, pad_to=pad_to))


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """Shapes and knobs shared by every run of a CLI invocation (one compilation per setting)."""

    max_new_tokens: int
    pad_to: int
    max_len: int
    seed: int = 0
    top_p: float = 1.0
    eos_token_id: int | None = None     # None: the config's; -1: never stop early


def plan_shapes(prompt_lengths: Sequence[int], max_new_tokens: int, max_draft: int) -> tuple[int, int]:
    """(pad_to, max_len): pad to the longest prompt; room for the budget plus the widest verify block."""
    pad_to = max(prompt_lengths)
    return pad_to, pad_to + max_new_tokens + max_draft + 1


def effective_draft_n_max(setting: Setting, model) -> int:
    """Drafts per round actually used (a drafter may cap draft_n_max: DSpark at its block size)."""
    if setting.spec == BASELINE:
        return setting.draft_n_max
    return model.draft_setup(setting.spec, setting.draft_n_max).k


def run_batch(model, batch: Sequence[dict], setting: Setting, plan: RunPlan, repeats: int = 1) -> dict[str, Any]:
    """Run one batch of prompts `repeats` times with the same seed; the median wall time is reported.

    Returns {"tokens", "stats" (from the last repeat; counts are identical across repeats under one
    seed), "walls" (every repeat), "wall_s" (median), "decode_s" (median time of the decode loop alone,
    after the prefill that also samples the first token)}.
    """
    walls, decodes, tokens, stats = [], [], None, None
    for _ in range(repeats):
        tokens, stats = generate_padded(model.params, model.bundle, [p["tokens"] for p in batch],
                                        plan.max_new_tokens, pad_to=plan.pad_to, max_len=plan.max_len,
                                        setting=setting, top_p=plan.top_p, eos_token_id=plan.eos_token_id,
                                        seed=plan.seed)
        walls.append(stats["wall_s"])
        decodes.append(stats["decode_s"])
    return {"tokens": tokens, "stats": stats, "walls": walls, "wall_s": statistics.median(walls),
            "decode_s": statistics.median(decodes)}


def warm_up(model, batch: Sequence[dict], setting: Setting, plan: RunPlan) -> float:
    """One untimed run of the batch shape (compilation); returns its wall time for the log."""
    t0 = time.perf_counter()
    run_batch(model, batch, setting, plan, repeats=1)
    return time.perf_counter() - t0


def batches(prompts: Sequence[dict], size: int) -> list[list[dict]]:
    """Consecutive groups of `size` prompts (the last one may be smaller)."""
    return [list(prompts[i:i + size]) for i in range(0, len(prompts), size)]


def per_sequence(stats: dict, b: int) -> dict[str, int]:
    """Counts of sequence b of a batch run: predicted, draft, accepted, rounds."""
    ps = stats["per_sequence"]
    return {"predicted": int(stats["per_sequence_generated"][b]), "draft": int(ps["drafted"][b]),
            "accepted": int(ps["accepted"][b]), "rounds": int(ps["rounds"][b])}
