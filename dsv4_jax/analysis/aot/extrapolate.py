"""XLA's costs of every layer from two small unrolled compiles (the report's default way of counting layers).

XLA's `cost_analysis` counts a `while` body once, so a program with layer scans under-counts Flash's 20
repeated HCA/CSA pairs, and unrolling all 43 layers makes compiles of tens of minutes on a small machine.
Instead, the program is compiled unrolled with the leading layers + `a` and + `a + 1` repetitions of the
repeated segment (the same shapes otherwise) and the costs are extrapolated linearly to its `n` repetitions:

    cost(n) = cost(a) + (n − a) · (cost(a + 1) − cost(a))

exact when every repetition compiles to the same code (the unrolled repetitions are identical bodies reading
their slice of the stacked weights, `model.target.unrolled`); how close it is on TPU at Flash shapes is
measured in `experiments/results/aot_extrapolation_*.md`. The default a = 2: with a = 1 the repeated pair is
no longer a stacked segment (`schedule.segments` makes two single layers of it, read without a dynamic slice),
so the step from 1 to 2 pairs adds the stacked-weight slicing of both pairs, not of one.
The fit (memory) still comes from the full program as run (layer scans), one more compile.
"""
from __future__ import annotations

from ...config import ModelConfig
from ...model.schedule import Segment, segments

DEFAULT_BASE = 2
# cost_analysis entries that add up over layers (per device)
COST_KEYS = ("flops", "bytes_accessed", "transcendentals", "optimal_seconds")


def repeated_segment(config: ModelConfig) -> Segment | None:
    """The last segment when it repeats (reps ≥ 2): the one whose repetitions are extrapolated (Flash: the 20
    HCA/CSA pairs after 3 leading layers). None when the last segment is a single layer."""
    last = segments(config)[-1]
    return last if last.reps >= 2 else None


def with_reps(config: ModelConfig, reps: int) -> ModelConfig:
    """`config` with its repeated (last) segment cut to `reps` repetitions, every other layer kept."""
    seg = repeated_segment(config)
    if seg is None or not 1 <= reps <= seg.reps:
        raise ValueError(f"{config.name}: cannot keep {reps} repetitions of its last segment {seg}")
    n = seg.start + seg.pattern * reps
    if n == config.num_layers:
        return config
    return config.replace(name=f"{config.name}-{n}L", num_layers=n, layer_types=config.layer_types[:n],
                          compress_ratios=config.compress_ratios[:n], mlp_layer_types=config.mlp_layer_types[:n])


def points(config: ModelConfig, base: int = DEFAULT_BASE) -> tuple[int, int, int] | None:
    """(a, a + 1, n): the repetition counts to compile and the count to extrapolate to; None when the model
    has at most a + 1 repetitions (then the whole program is compiled unrolled: it is as small)."""
    seg = repeated_segment(config)
    if seg is None or seg.reps <= base + 1:
        return None
    return base, base + 1, seg.reps


def linear(at_a: dict, at_b: dict, a: int, n: int) -> dict:
    """cost(n) = cost(a) + (n − a)·(cost(a + 1) − cost(a)) for every numeric entry both dicts have."""
    return {k: at_a[k] + (n - a) * (at_b[k] - at_a[k]) for k in at_a
            if k in at_b and isinstance(at_a[k], (int, float)) and isinstance(at_b[k], (int, float))}
