"""Cost tables for the width scheduler (docs/width_scheduler.md §4): seconds per round of a batch verifying
w = 0..K drafts with a drafter, and per plain decoding round — measured on this machine by a short
calibration (cached with the machine, shapes and versions), read from a `dsv4-aot` report (roofline
times of a TPU topology), priced by a bandwidth roofline of a named machine (`roofline`: bytes from the
abstract shapes ÷ its bandwidth + a fixed cost per round, `analysis.roofline.table`), or given as a JSON file.

    table = cost_table.calibrate(params, config, prepared)           # a prepared auto run (generate.prepare)
    table = cost_table.cached_or_calibrate(params, config, prepared)  # the same, cached under ~/.cache
    table, how = engine.calibrate()                                   # a continuous-batching engine's rounds
    table = analysis.roofline.table(config, "mtp", 1, 7, "h100", context=4096)  # no model, no device
    table.save("costs.json"); CostTable.load("costs.json")
    table.predicted_speedup(mean_accepted_length, w)
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import statistics
import time
from importlib import metadata
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..drafters.base import MODE_FIXED, MODE_PLAIN
from .loop import decode
from .prefill import start

FORMAT = "dsv4_jax.cost_table/1"
DEFAULT_CACHE = "~/.cache/dsv4_jax/cost_tables"    # measured tables (`cache_path`); callers may pass another
# passes of a one-batch calibration (`calibrate`): a pass times one short run per width (≈ 1 s for the bundled
# model at B = 1); 5 medians keep a noisy pass from setting a width's price (widths after it inherit it: `physical`)
CALIBRATION_PASSES = 5


class CostTableError(ValueError):
    """A cost table file or report that cannot be used (names the file and the problem)."""


@dataclasses.dataclass(frozen=True)
class CostTable:
    """seconds[w]: one round of the batch verifying w drafts (w = 0..bound; the drafter's work included);
    plain_seconds: one round of plain decoding (no drafter). spread: per width (min, max) over the
    calibration repeats, or None; key: what the table was measured for (machine, shapes, versions)."""

    seconds: tuple[float, ...]
    plain_seconds: float
    drafter: str = ""
    batch: int = 1
    source: str = "measured"
    spread: tuple | None = None
    key: Any = None
    raw_seconds: tuple | None = None      # measured tables: the medians before `physical` (None otherwise)

    def __post_init__(self):
        if not self.seconds or any(not (s > 0) for s in self.seconds) or not self.plain_seconds > 0:
            raise CostTableError(f"a cost table needs positive seconds per round, got {self.seconds} and plain "
                                 f"{self.plain_seconds}")

    @property
    def bound(self) -> int:
        """The widest width (drafts per round) it prices."""
        return len(self.seconds) - 1

    def costs(self, k: int) -> tuple[np.ndarray, np.float32]:
        """(width_cost [k+1], plain_cost) for a program holding widths 0..k (CostTableError if it prices fewer)."""
        if k > self.bound:
            raise CostTableError(f"the cost table prices up to {self.bound} drafts per round; the run needs {k}")
        return np.asarray(self.seconds[:k + 1], np.float32), np.float32(self.plain_seconds)

    def predicted_speedup(self, mean_accepted_length: float, w: int) -> float:
        """Decode speed-up over plain decoding of rounds of width w committing mean_accepted_length tokens each,
        from the width's measured seconds (`raw_seconds`, before `physical`, where the table has them: the
        prediction for a fixed width uses what was measured for it; the scheduler's decisions use `seconds`)."""
        seconds = self.raw_seconds[w] if self.raw_seconds else self.seconds[w]
        return mean_accepted_length * self.plain_seconds / seconds

    def break_even(self, w: int) -> float:
        """The mean accepted length (tokens per round) at which width w matches plain decoding."""
        return self.seconds[w] / self.plain_seconds

    def lines(self) -> list[str]:
        """A printable table: per width its seconds per round, ratio to plain and break-even tokens per round."""
        out = [f"cost table ({self.source}; drafter {self.drafter or '?'}, batch {self.batch}):"]
        if isinstance(self.key, dict) and "roofline" in self.key:
            out.append(f"  {roofline_text(self.key['roofline'])}")
        out.append("  width  ms/round  x plain  break-even tokens/round")
        out.append(f"  plain  {self.plain_seconds * 1e3:8.3f}  {1.0:7.2f}  {1.0:6.2f}")
        for w, s in enumerate(self.seconds):
            out.append(f"  {w:5d}  {s * 1e3:8.3f}  {s / self.plain_seconds:7.2f}  {self.break_even(w):6.2f}")
        return out

    def to_json(self) -> dict:
        return {"format": FORMAT, "seconds": list(self.seconds), "plain_seconds": self.plain_seconds,
                "drafter": self.drafter, "batch": self.batch, "source": self.source,
                "spread": [list(s) for s in self.spread] if self.spread else None, "key": self.key,
                "raw_seconds": list(self.raw_seconds) if self.raw_seconds else None}

    @classmethod
    def from_json(cls, d: dict, where: str = "cost table") -> "CostTable":
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise CostTableError(f"{where}: not a cost table (expected a JSON object with format {FORMAT!r})")
        try:
            seconds = tuple(float(s) for s in d["seconds"])
            plain = float(d["plain_seconds"])
        except (KeyError, TypeError, ValueError) as e:
            raise CostTableError(f"{where}: seconds / plain_seconds missing or not numbers ({e})") from None
        spread = d.get("spread")
        try:
            return cls(seconds=seconds, plain_seconds=plain, drafter=str(d.get("drafter", "")),
                       batch=int(d.get("batch", 1)), source=str(d.get("source", "file")),
                       spread=tuple(tuple(float(x) for x in s) for s in spread) if spread else None, key=d.get("key"),
                       raw_seconds=tuple(float(x) for x in d["raw_seconds"]) if d.get("raw_seconds") else None)
        except CostTableError as e:
            raise CostTableError(f"{where}: {e}") from None

    def save(self, path: str) -> None:
        """Write atomically (a temporary file renamed)."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f, indent=1)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> "CostTable":
        try:
            with open(path) as f:
                d = json.load(f)
        except OSError as e:
            raise CostTableError(f"cost table {path}: {e.strerror or e}") from None
        except json.JSONDecodeError as e:
            raise CostTableError(f"cost table {path}: not JSON ({e})") from None
        return cls.from_json(d, f"cost table {path}")


AOT_SECONDS = {"roofline": "roofline_s", "latency": "latency_roofline_s"}   # `from_aot_report`'s bases


def from_aot_report(path: str, drafter: str, weights: str | None = None, basis: str = "roofline") -> CostTable:
    """A table of roofline seconds from a `dsv4-aot` JSON report (docs/width_scheduler.md §4): per run (one
    weight format; `weights` picks it, default the first run with the programs) the `decode` program's
    estimate is the plain round, the `verify` program's (T tokens) prices width T − 1, widths in between are
    interpolated linearly in the verified tokens (a memory-bound step's bytes grow affinely with them), and the
    drafter's round program `spec-<drafter>` (drafting + verify of T tokens), where present, adds its excess
    over that verify to every width. basis: "roofline" (bytes / bandwidth as compiled) or "latency" (the
    report's latency roofline: + collectives × latency + launched ops × overhead). CostTableError naming the
    report and what it lacks."""
    if basis not in AOT_SECONDS:
        raise CostTableError(f"dsv4-aot report {path}: unknown basis {basis!r}; choose from {tuple(AOT_SECONDS)}")
    field = AOT_SECONDS[basis]
    try:
        with open(path) as f:
            report = json.load(f)
        runs = [r for r in report["runs"] if weights in (None, r.get("weights"))]
        batch = int(report["shapes"]["batch"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise CostTableError(f"dsv4-aot report {path}: not a dsv4-aot report ({e})") from None
    for run in runs:
        est = {(p["program"], p.get("tokens_per_sequence")): p["estimate"][field]
               for p in run.get("programs", []) if isinstance(p.get("estimate"), dict) and field in p["estimate"]}
        plain = est.get(("decode", 1))
        verify = sorted((t, s) for (name, t), s in est.items() if name == "verify")
        if plain is None or not verify:
            continue
        T, s_verify = verify[-1]
        spec = est.get((f"spec-{drafter}", T))
        extra = max(spec - s_verify, 0.0) if spec is not None else 0.0
        seconds = tuple(plain + (s_verify - plain) * w / (T - 1) + extra for w in range(T))
        return CostTable(seconds=physical(seconds, plain), plain_seconds=plain, drafter=drafter, batch=batch,
                         source=f"aot:{os.path.basename(path)}:{run.get('topology')}:{run.get('weights')}"
                                + ("" if basis == "roofline" else f":{basis}"))
    raise CostTableError(f"dsv4-aot report {path}: no run with compiled decode and verify programs"
                         + ("" if basis == "roofline" else f" with a {basis} estimate")
                         + (f" for weights {weights!r}" if weights else ""))


def roofline_text(r: dict) -> str:
    """One line on a roofline table's machine and assumptions (its key["roofline"])."""
    return (f"roofline of {r['machine']}: {r['gbps']:g} GB/s read + {r['fixed_us']:g} us per round "
            f"({r['machine_source']}); {r['format']} weights, context {r['context']} tokens, "
            f"plain {r['plain_bytes'] / 1e9:.3g} GB/round")


def cache_key(config, prepared, drafter: str) -> dict:
    """What a measured table depends on: the machine, the program's shapes and options, the versions."""
    dev = jax.devices()[0]
    r = prepared
    return {"machine": {"platform": dev.platform, "device_kind": dev.device_kind, "devices": jax.device_count(),
                        "cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
            "shapes": {"model": config.name, "config": hashlib.sha1(repr(config).encode()).hexdigest()[:12],
                       "batch": int(r.tokens.shape[0]), "prompt": int(r.tokens.shape[1]), "max_len": r.max_len,
                       "k": r.program.k, "max_new_tokens": r.program.max_new_tokens, "greedy": r.program.greedy,
                       "drafter": drafter, "settings": repr(r.program.setup.settings), "verify": r.program.verify},
            "versions": {"jax": jax.__version__, "dsv4_jax": _version()}}


def _version() -> str:
    try:
        return metadata.version("dsv4_jax")
    except metadata.PackageNotFoundError:       # a source checkout on PYTHONPATH
        return "source"


def cache_path(key: dict, cache_dir: str | None = None) -> str:
    base = cache_dir or os.path.expanduser(DEFAULT_CACHE)
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(base, f"{key['shapes']['drafter']}-b{key['shapes']['batch']}-{digest}.json")


def seconds_per_round(params, config, r, knobs) -> float:
    """Time the loop once (prefill untimed) at the given knobs: seconds per round of the batch."""
    carry = jax.block_until_ready(start(params, r.config, jnp.asarray(r.tokens), jnp.asarray(r.lengths),
                                        max_len=r.max_len, program=r.program, knobs=knobs,
                                        key=jax.random.PRNGKey(r.seed), max_block=r.max_block,
                                        prefill_taps=r.prefill_taps, prefill_chunk=r.prefill_chunk))
    t0 = time.perf_counter()
    carry = jax.block_until_ready(decode(params, r.config, carry, knobs, r.program))
    return (time.perf_counter() - t0) / max(int(carry.round), 1)


def calibrate(params: dict, config, prepared, *, repeats: int = CALIBRATION_PASSES, progress=None,
              drafter: str | None = None) -> CostTable:
    """Measure a table with the prepared run's own program (generate.prepare of an auto run, or any run with
    the width scheduler): `measure` with the loop run once per timing (prefill untimed). progress: a
    callable(str) or None; drafter: the name the table is for (default the program's; a drafter pool's run
    names its member)."""
    r = prepared
    if not r.program.adaptive:
        raise ValueError("calibrate needs a run prepared with the width scheduler (draft_n_max='auto')")
    drafter = drafter or r.program.drafter.name
    time_at = lambda knobs: seconds_per_round(params, config, r, knobs)
    time_at(r.knobs.replace(width_mode=jnp.int32(MODE_PLAIN)))    # compile the `none` program plain rounds run in
    return measure(time_at, r.knobs, r.program.k, repeats=repeats, progress=progress, drafter=drafter,
                   batch=int(r.tokens.shape[0]), key=cache_key(config, r, drafter))


def measure(time_at, knobs, k_program: int, *, repeats: int = 3, progress=None, drafter: str = "", batch: int = 1,
            key: Any = None) -> CostTable:
    """A measured table: time_at(knobs) -> seconds per round of one timed run of a program with the width
    scheduler, at each fixed width w = 0..k (MODE_FIXED; k = the knobs' draft_n, else k_program) and plain
    (MODE_PLAIN), after one untimed warm-up. The widths are timed in passes (every width and plain once per
    pass, `repeats` passes) and each width is priced by its median ratio to plain within a pass times plain's
    median: a machine whose speed drifts between passes (a shared or throttled host) shifts every width of a
    pass alike, so the ratios the scheduler decides by stay put. Then `physical`."""
    k = k_program if knobs.draft_n is None else int(knobs.draft_n)
    base = knobs.replace(width_cost=jnp.ones((k_program + 1,), jnp.float32), plain_cost=jnp.float32(1.0))
    at = lambda w: base.replace(width_mode=jnp.int32(MODE_PLAIN)) if w == "plain" else \
        base.replace(width_mode=jnp.int32(MODE_FIXED), draft_n=jnp.int32(w))
    time_at(at(k))                                                      # compile + warm up
    order = ["plain"] + list(range(k + 1))
    times = {w: [] for w in order}
    for r in range(repeats):
        for w in order:
            times[w].append(time_at(at(w)))
        if progress:
            progress(f"calibration pass {r + 1}/{repeats}: plain {times['plain'][-1] * 1e3:.3f} ms/round, widths "
                     + " ".join(f"{times[w][-1] * 1e3:.3f}" for w in range(k + 1)))
    plain = statistics.median(times["plain"])
    ratio = lambda w: statistics.median(t / p for t, p in zip(times[w], times["plain"]))
    raw = tuple(ratio(w) * plain for w in range(k + 1))
    return CostTable(seconds=physical(raw, plain), plain_seconds=plain, drafter=drafter, raw_seconds=raw,
                     batch=batch, source="measured", spread=tuple((min(times[w]), max(times[w])) for w in range(k + 1)),
                     key=key)


def physical(seconds, plain: float) -> tuple[float, ...]:
    """Measured medians made consistent with what a round does: a round with the drafter costs at least a plain
    round (it does the plain round's work and the drafter's), and verifying more drafts never costs less
    (the running maximum). Timing noise otherwise makes the scheduler prefer a width it only measured as
    cheaper — e.g. width 0 priced below plain decoding would never let it stop drafting."""
    out, floor = [], plain
    for s in seconds:
        floor = max(floor, s)
        out.append(floor)
    return tuple(out)


def cached_or_calibrate(params: dict, config, prepared, *, cache_dir: str | None = None, refresh: bool = False,
                        repeats: int = CALIBRATION_PASSES, progress=None,
                        drafter: str | None = None) -> tuple[CostTable, str]:
    """The cached table for this machine, program shapes and versions, or a fresh calibration saved there.
    drafter: as in `calibrate`. -> (table, "cached" | "measured")."""
    drafter = drafter or prepared.program.drafter.name
    return cached(cache_key(config, prepared, drafter), lambda: calibrate(
        params, config, prepared, repeats=repeats, progress=progress, drafter=drafter), cache_dir, refresh)


def cached(key: dict, make, cache_dir: str | None = None, refresh: bool = False) -> tuple[CostTable, str]:
    """The table cached under key, or make() saved there. -> (table, "cached" | "measured")."""
    path = cache_path(key, cache_dir)
    if not refresh and os.path.exists(path):
        try:
            return CostTable.load(path), "cached"
        except CostTableError:
            pass                                  # a damaged cache entry: measure again and replace it
    table = make()
    table.save(path)
    return table, "measured"


def as_table(value) -> CostTable | None:
    """Speculation.cost_table as a CostTable: a CostTable, a JSON file path, or None."""
    if value is None or isinstance(value, CostTable):
        return value
    if isinstance(value, (str, os.PathLike)):
        return CostTable.load(os.fspath(value))
    raise TypeError(f"cost_table takes a CostTable or a JSON file path, got {type(value).__name__}")
