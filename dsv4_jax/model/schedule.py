"""The layer schedule as scan segments.

A segment is `reps` repetitions of a short pattern of consecutive layers with identical
parameter shapes. Parameters of a segment are stacked on a leading `reps` axis and the forward
pass scans over it, so Flash's 20 HCA/CSA pairs compile once instead of 20 times. Irregular
layers become segments with `reps == 1` (unrolled).
"""
from __future__ import annotations

import dataclasses
import functools

from ..config import ModelConfig

MAX_PATTERN = 4


@dataclasses.dataclass(frozen=True)
class Segment:
    start: int            # index of the first layer
    pattern: int          # layers per repetition
    reps: int             # repetitions (scan length)

    @property
    def stop(self) -> int:
        return self.start + self.pattern * self.reps

    def layer_index(self, slot: int, rep: int) -> int:
        return self.start + rep * self.pattern + slot


def _repeats(kinds, i, p) -> int:
    r = 1
    while i + (r + 1) * p <= len(kinds) and kinds[i + r * p: i + (r + 1) * p] == kinds[i: i + p]:
        r += 1
    return r


@functools.lru_cache(maxsize=None)
def segments(config: ModelConfig) -> tuple[Segment, ...]:
    """Greedy split of the layers into segments; at each point take the pattern covering most layers."""
    kinds = [config.layer_kind(i) for i in range(config.num_layers)]
    out, i = [], 0
    while i < len(kinds):
        best = Segment(i, 1, 1)
        for p in range(1, MAX_PATTERN + 1):
            if i + p > len(kinds):
                break
            r = _repeats(kinds, i, p)
            if r >= 2 and p * r > best.pattern * best.reps:
                best = Segment(i, p, r)
        out.append(best)
        i = best.stop
    return tuple(out)


def locate(config: ModelConfig, layer: int) -> tuple[int, int, int]:
    """(segment, slot, rep) holding global layer `layer`."""
    if not 0 <= layer < config.num_layers:
        raise IndexError(f"layer {layer} outside 0..{config.num_layers - 1}")
    for s, seg in enumerate(segments(config)):
        if seg.start <= layer < seg.stop:
            off = layer - seg.start
            return s, off % seg.pattern, off // seg.pattern
    raise AssertionError("unreachable")
