"""Compile one program ahead of time and read what the compiler says about it.

Per program: lower + compile times; `memory_analysis()` (per-device argument / output / alias / temp /
generated-code bytes; peak = argument + output − alias + temp); `cost_analysis()` (flops, bytes accessed,
transcendentals, and on TPU the compiler's own `optimal_seconds`); the HLO text's top ops by bytes and its
collectives (`aot.hlo`, while bodies × their trip counts); the bytes bound split ideally over the chips; and
time estimates at the chip's HBM bandwidth and peak bf16 rate (roofline: the larger of bytes / bandwidth and
flops / peak).

Two compiles per program. The program as a run executes it, with its layer scans, gives the memory (hence
the fit) and the HLO analysis: bytes per op, top ops and collectives, each while body counted × its trip
count. The program with every layer unrolled gives XLA's flops and bytes accessed with every layer counted
(XLA's cost analysis counts a `while` body once); unrolled, XLA may start several layers' weight transfers
at once and copies / re-lays out the stacked layer weights, so its memory and bytes overstate the run's. A program fits
when its peak ≤ the HBM one device may use. Before compiling, the exact per-device argument bytes (from the
shardings) are checked: arguments alone over HBM is "does not fit" without a compile (unless `force`).
On TPU the compiles run with `xla_tpu_no_crash_on_oom`, so a program that does not fit still compiles and
reports its memory and costs; a compile that fails anyway with RESOURCE_EXHAUSTED is "does not fit" with the
compiler's message.
"""
from __future__ import annotations

import gc
import time

from . import hlo
from .chips import GIB, Chip, required_from_error
from .programs import Program

_OOM_MARKERS = ("RESOURCE_EXHAUSTED", "Ran out of memory", "out of memory")


def memory(compiled) -> dict:
    m = compiled.memory_analysis()
    if m is None:
        return {}
    get = lambda k: float(getattr(m, k, 0) or 0)
    out = {"argument": get("argument_size_in_bytes"), "output": get("output_size_in_bytes"),
           "alias": get("alias_size_in_bytes"), "temp": get("temp_size_in_bytes"),
           "generated_code": get("generated_code_size_in_bytes")}
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out


def cost(compiled) -> dict:
    c = compiled.cost_analysis()
    if isinstance(c, (list, tuple)):      # older jax: one dict per partition
        c = c[0] if c else {}
    c = c or {}
    out = {"flops": float(c.get("flops", 0.0)), "bytes_accessed": float(c.get("bytes accessed", 0.0)),
           "transcendentals": float(c.get("transcendentals", 0.0))}
    if float(c.get("optimal_seconds", -1.0)) >= 0:   # the TPU compiler's own estimate (negative: none)
        out["optimal_seconds"] = float(c["optimal_seconds"])
    return out


def estimates(result: dict, chip: Chip, chips: int) -> dict:
    """Seconds at the chip's HBM bandwidth and peak rate: XLA's bytes, the HLO ops' HBM bytes, the ideal
    split of the bound; roofline = max(bytes time, flops time)."""
    bw, peak = chip.hbm_bytes_per_s, chip.flops_per_s
    c, out = result.get("cost", {}), {}
    flops_s = c.get("flops", 0.0) / peak
    out["flops_s"] = flops_s
    if c.get("bytes_accessed"):
        out["xla_bytes_s"] = c["bytes_accessed"] / bw
    ops = result.get("hlo", {}).get("top_ops", {}).get("total_bytes")
    if ops:
        out["hlo_op_bytes_s"] = ops / bw
    bound = result.get("bound", {}).get("total")
    if bound:
        out["bound_per_chip_bytes"] = bound / chips
        out["bound_s"] = bound / chips / bw
        if c.get("bytes_accessed"):
            out["xla_bytes_over_bound"] = c["bytes_accessed"] / (bound / chips)
        if ops:
            out["hlo_op_bytes_over_bound"] = ops / (bound / chips)
    mem_s = out.get("hlo_op_bytes_s", out.get("xla_bytes_s", 0.0))
    out["roofline_s"] = max(mem_s, flops_s)
    out["roofline_limit"] = "flops" if flops_s > mem_s else "memory"
    out["bound_roofline_s"] = max(out.get("bound_s", 0.0), flops_s)
    return out


def _oom(message: str) -> bool:
    return any(k in message for k in _OOM_MARKERS)


def _compile(program: Program, options: dict | None):
    """(compiled, lower_s, compile_s, error message or None)."""
    t = time.perf_counter()
    try:
        lowered = program.lower()
        lower_s = time.perf_counter() - t
        t = time.perf_counter()
        compiled = lowered.compile(compiler_options=options) if options else lowered.compile()
        return compiled, lower_s, time.perf_counter() - t, None
    except Exception as e:  # noqa: BLE001 - a failed compile is a result, not a crash of the report
        return None, None, time.perf_counter() - t, f"{type(e).__name__}: {' '.join(str(e).split())}"


def _failed(row: dict, error: str) -> dict:
    oom = _oom(error)
    row.update(compiled=False, fits=False if oom else None,
               reason=("compiler: out of memory: " if oom else "") + error[:600])
    if oom:
        row["required_bytes"] = required_from_error(error)
    return row


def _analyse(compiled, top: int, dump: str | None) -> dict:
    """HLO analysis of a compiled program, while bodies × trip counts (`hlo.analyse`); text saved to `dump`."""
    text = compiled.as_text()
    if dump:
        with open(dump, "w") as f:
            f.write(text)
    out = hlo.analyse(text, top, scale_loops=True)
    out["chars"] = len(text)
    del text
    gc.collect()
    return out


def compile_program(program: Program, chip: Chip, chips: int, hbm: float, *, as_run: Program | None = None,
                    options: dict | None = None, top: int = 15, force: bool = False,
                    hlo_dump: str | None = None, count_if_unfit: bool = True, unrolled: bool = True) -> dict:
    """Compile `program` (every layer unrolled: the costs) and `as_run` (the same program with the layer
    scans a real run has: the memory, hence the fit) and return the report row (module docstring).

    options: compiler options of both compiles (the TPU ones keep an oversized program compiling so that
    its memory and costs are still reported, `chips.TPU_COMPILE_OPTIONS`). count_if_unfit=False skips the
    unrolled compile when the program as run does not fit (a smaller prefill chunk will be tried).
    unrolled=False: `program` keeps its layer scans (`--no-unroll`): one compile gives the fit and the HLO
    analysis (every layer counted), XLA's cost analysis then counts each repeated layer once.
    """
    args = program.argument_bytes_per_device
    row = {"program": program.name, "tokens_per_sequence": program.tokens_per_sequence, "bound": program.bound,
           "argument_bytes_per_device": args, "hbm_bytes": hbm}
    if program.notes:
        row["notes"] = program.notes
    if args > hbm and not force:
        row.update(fits=False, compiled=False,
                   reason=f"arguments alone need {args / GIB:.2f} GiB per device > {hbm / GIB:.2f} GiB HBM")
        return row
    run_hlo = None
    if as_run is not None:
        compiled, _, secs, error = _compile(as_run, options)
        row["as_run_compile_s"] = secs
        if error:
            return _failed(row, error)
        row["memory_as_run"] = memory(compiled)
        row["cost_as_run"] = cost(compiled)        # repeated layers counted once: for comparison only
        run_hlo = _analyse(compiled, top, hlo_dump and hlo_dump.replace(".hlo.txt", ".as_run.hlo.txt"))
        del compiled
        peak = row["memory_as_run"].get("peak")
        if not count_if_unfit and peak is not None and peak > hbm:
            row.update(compiled=False, fits=False, required_bytes=peak, memory=row["memory_as_run"], hlo=run_hlo,
                       reason=f"as run it needs {peak / GIB:.2f} GiB per device > {hbm / GIB:.2f} GiB HBM")
            return row
    compiled, row["lower_s"], row["compile_s"], error = _compile(program, options)
    if error:
        return _failed(row, error)
    row["compiled"] = True
    mem = memory(compiled)
    row["memory"] = row.get("memory_as_run", mem)
    row["fit_from"] = "as run (layer scans)" if as_run is not None or not unrolled else "the unrolled program"
    row["cost"] = cost(compiled)
    row["cost_counts_every_layer"] = unrolled
    text_hlo = _analyse(compiled, top, hlo_dump)
    del compiled
    # bytes, top ops and collectives: the program as run, loop bodies × trip counts (the unrolled text has
    # copies of the stacked layer weights a run does not make); the unrolled text's totals for comparison
    row["hlo"] = run_hlo or text_hlo
    if unrolled:
        row["memory_unrolled"] = mem
        row["hlo_unrolled"] = {"top_ops": {k: text_hlo["top_ops"][k] for k in ("total_bytes", "instructions")},
                               "collectives": {k: text_hlo["collectives"][k]
                                               for k in ("by_opcode", "count", "total_operand_bytes")}}
    peak = row["memory"].get("peak")
    row["fits"] = None if peak is None else peak <= hbm
    if row["fits"] is False:
        row["required_bytes"] = peak
    row["estimate"] = estimates(row, chip, chips)
    return row
