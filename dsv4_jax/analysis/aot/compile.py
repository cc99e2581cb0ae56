"""Compile one program ahead of time and read what the compiler says about it.

Per program: lower + compile times; `memory_analysis()` (per-device argument / output / alias / temp /
generated-code bytes; peak = argument + output − alias + temp); `cost_analysis()` (flops, bytes accessed,
transcendentals, and on TPU the compiler's own `optimal_seconds`); the HLO text's top ops by bytes and its
collectives (`aot.hlo`, while bodies × their trip counts); the bytes bound split ideally over the chips; and
time estimates at the chip's HBM bandwidth and peak bf16 rate (roofline: the larger of bytes / bandwidth and
flops / peak; latency roofline: that + collectives × the chip's per-collective latency + launched ops × its
per-op overhead, `latency_roofline`).

How every layer is counted (`method`, recorded in each row as `cost_method`):

  * "extrapolated" (the default, `Counting`): the full program as a run executes it, with its layer scans,
    gives the memory (hence the fit), the HLO analysis (bytes per op, top ops, collectives: each while body
    counted × its trip count) and XLA's costs with each repeated layer once ("cost_as_run"); two small
    programs, the leading layers + a and + a + 1 repetitions of the repeated segment compiled unrolled, give
    XLA's flops / bytes accessed / transcendentals / optimal seconds extrapolated linearly to every repetition
    (`aot.extrapolate`): three compiles; the two small ones hold 7 + 9 of Flash's 43 layers, unrolled.
  * "unrolled": the full program with every layer unrolled gives XLA's costs (XLA's cost analysis counts a
    `while` body once), the program as run (`as_run`) the memory and the HLO analysis; unrolled, XLA may
    start several layers' weight transfers at once and copies / re-lays out the stacked layer weights, so its
    memory and bytes overstate the run's (both peaks are reported).
  * "scan": one compile of the program as run; XLA's costs then count each repeated layer once.

A program fits when its peak ≤ the HBM one device may use. Before compiling, the exact per-device argument
bytes (from the shardings) are checked: arguments alone over HBM is "does not fit" without a compile (unless
`force`). On TPU the compiles run with `xla_tpu_no_crash_on_oom`, so a program that does not fit still
compiles and reports its memory and costs; a compile that fails anyway with RESOURCE_EXHAUSTED is "does not
fit" with the compiler's message.
"""
from __future__ import annotations

import dataclasses
import gc
import glob
import os
import tempfile
import time

from . import extrapolate, hlo
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
    split of the bound; roofline = max(bytes time, flops time). Ratios to the per-chip bound under uniform
    ("_over_bound") and balanced routing ("_over_bound_bal"), also of the compile with VMEM prefetching off
    (`no_prefetch`) when there is one."""
    bw, peak = chip.hbm_bytes_per_s, chip.flops_per_s
    c, out = result.get("cost", {}), {}
    flops_s = c.get("flops", 0.0) / peak
    out["flops_s"] = flops_s
    if c.get("bytes_accessed"):
        out["xla_bytes_s"] = c["bytes_accessed"] / bw
    ops = result.get("hlo", {}).get("top_ops", {}).get("total_bytes")
    declared = kernels_declared_bytes(result)
    if declared is not None:
        out["hlo_op_bytes_whole_kernel_operands"] = ops
        ops = declared
        out["hlo_op_bytes_kernels_declared"] = ops
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
    balanced = result.get("bound", {}).get("balanced")
    if balanced:
        out["bound_bal_per_chip_bytes"] = balanced / chips
        if c.get("bytes_accessed"):
            out["xla_bytes_over_bound_bal"] = c["bytes_accessed"] / (balanced / chips)
        if ops:
            out["hlo_op_bytes_over_bound_bal"] = ops / (balanced / chips)
    quiet = result.get("no_prefetch", {}).get("hlo_op_bytes")
    if quiet and bound:
        out["hlo_op_bytes_no_prefetch_over_bound"] = quiet / (bound / chips)
        if balanced:
            out["hlo_op_bytes_no_prefetch_over_bound_bal"] = quiet / (balanced / chips)
    mem_s = out.get("hlo_op_bytes_s", out.get("xla_bytes_s", 0.0))
    out["roofline_s"] = max(mem_s, flops_s)
    out["roofline_limit"] = "flops" if flops_s > mem_s else "memory"
    out["bound_roofline_s"] = max(out.get("bound_s", 0.0), flops_s)
    out.update(latency_terms(result.get("hlo", {}), out["roofline_s"], chip))
    return out


def latency_roofline(roofline_s: float, collectives: float, ops: float, collective_latency_us: float,
                     op_overhead_us: float) -> dict:
    """The latency-aware roofline of one program: roofline_s (max(HBM bytes / bandwidth, flops / peak), s) +
    collectives × collective_latency_us + ops (launched separately: fusions, custom calls, ...) ×
    op_overhead_us. Returns {"latency_roofline_s", "collective_latency_s", "op_overhead_s"} (seconds)."""
    coll_s, ops_s = collectives * collective_latency_us * 1e-6, ops * op_overhead_us * 1e-6
    return {"latency_roofline_s": roofline_s + coll_s + ops_s, "collective_latency_s": coll_s, "op_overhead_s": ops_s}


def latency_terms(h: dict, roofline_s: float, chip: Chip) -> dict:
    """`latency_roofline` from an HLO analysis (`hlo.analyse`, loop-scaled: collectives' and launched ops'
    counts × trip counts) at the chip's latencies, with the counts and latencies used; {} when the analysis
    has no op count (no HLO text, or a row saved before ops were counted)."""
    if "launches" not in h or "collectives" not in h:
        return {}
    n_coll, n_ops = h["collectives"]["count"], h["launches"]["count"]
    out = latency_roofline(roofline_s, n_coll, n_ops, chip.collective_latency_us, chip.op_overhead_us)
    out.update(latency_counts={"collectives": n_coll, "ops": n_ops, "ops_by_kind": h["launches"]["by_kind"]},
               collective_latency_us=chip.collective_latency_us, op_overhead_us=chip.op_overhead_us)
    return out


def kernels_declared_bytes(result: dict) -> float | None:
    """The HLO-op bytes with the Mosaic MoE kernels' calls counted as their BlockSpecs declare (the row's
    "ep_kernel", every routed layer) instead of their operands whole (`hlo.is_mosaic_call`): the HBM figure
    of a program whose only kernels are the EP local matmul (a round's: its target's and its drafter's MoE
    calls, `runner.ep_kernel_row`). None where that does not hold (no kernels, a round of a report before
    2026-12-08 whose declared bytes left the drafter's calls out ("scope"), no HLO text)."""
    k, top = result.get("ep_kernel"), result.get("hlo", {}).get("top_ops", {})
    if not k or k.get("scope") or not top.get("total_bytes") or "mosaic_call_bytes" not in top:
        return None
    return top["total_bytes"] - top["mosaic_call_bytes"] + k["declared_bytes"]


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


def dumped_text(program: Program, options: dict | None) -> str:
    """The compiled HLO text of `program` as XLA's own dump writes it: compiled again with
    `xla_dump_to` (a temporary folder) and `xla_dump_hlo_as_text`, the module's `*.after_codegen.txt`
    (libtpu: what `Compiled.as_text()` returns when it can; the CPU backend: `*after_optimizations.txt`).
    For programs whose text `as_text()` cannot rebuild (libtpu: "async-update instruction should have 1
    operands but sees 4", e.g. the verify programs)."""
    with tempfile.TemporaryDirectory(prefix="dsv4_hlo_dump_") as d:
        program.lower().compile(compiler_options={**(options or {}), "xla_dump_to": d,
                                                  "xla_dump_hlo_as_text": True})
        files = (glob.glob(os.path.join(d, "*.after_codegen.txt"))                      # TPU
                 or glob.glob(os.path.join(d, "*after_optimizations.txt")))               # CPU
        if not files:
            raise RuntimeError("XLA's dump holds no optimized module text (*.after_codegen.txt)")
        with open(max(files, key=os.path.getsize)) as f:
            return f.read()


def _analyse(compiled, top: int, dump: str | None, program: Program | None = None,
             options: dict | None = None) -> dict:
    """HLO analysis of a compiled program, while bodies × trip counts (`hlo.analyse`); text saved to `dump`.
    When libtpu cannot print the compiled module (seen with Mosaic kernels under shard_map and the verify
    programs: "async-update instruction should have 1 operands"), the text of XLA's dump (`dumped_text`, one
    more compile) when `program` is given, else an empty analysis with the error: the costs still stand."""
    source = "as_text"
    try:
        text = compiled.as_text()
    except Exception as e:  # noqa: BLE001 - the HLO text is diagnostics; its absence is reported, not fatal
        error = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        text = None
        if program is not None:
            try:
                text, source = dumped_text(program, options), "xla_dump"
            except Exception as e2:  # noqa: BLE001 - as above
                error += f"; XLA dump: {type(e2).__name__}: {' '.join(str(e2).split())[:300]}"
        if text is None:
            empty = {"ops": [], "groups": [], "total_bytes": 0.0, "instructions": 0}
            return {"top_ops": empty, "collectives": {"ops": [], "by_opcode": {}, "total_operand_bytes": 0.0,
                                                      "count": 0},
                    "scale_loops": True, "chars": 0, "error": error}
    if dump:
        with open(dump, "w") as f:
            f.write(text)
    out = hlo.analyse(text, top, scale_loops=True)
    out["chars"] = len(text)
    out["text_source"] = source
    del text
    gc.collect()
    return out


@dataclasses.dataclass
class Counting:
    """The small unrolled programs whose costs are extrapolated to every layer: the leading layers + `a` and
    + `a + 1` repetitions of the repeated segment (`aot.extrapolate`), to `n` repetitions."""

    a: int
    n: int
    at_a: Program
    at_b: Program
    layers: tuple[int, int] = (0, 0)      # layers of the two small programs (for the report)


def _hlo_totals(h: dict) -> dict:
    return {"hlo_op_bytes": h["top_ops"]["total_bytes"], "instructions": h["top_ops"]["instructions"],
            "collectives": h["collectives"]["count"], "collective_operand_bytes": h["collectives"]["total_operand_bytes"]}


def count_by_extrapolation(counting: Counting, options: dict | None, top: int) -> dict:
    """Compile the two small unrolled programs and extrapolate their costs (and the HLO-op / collective totals
    of their unrolled text, for comparison with the loop-scaled ones) to `counting.n` repetitions. Returns
    {"cost", "hlo_unrolled_totals", "points": [per small program: reps, layers, cost, peak, compile s]} or
    {"error"}."""
    points = []
    for reps, layers, prog in ((counting.a, counting.layers[0], counting.at_a),
                               (counting.a + 1, counting.layers[1], counting.at_b)):
        compiled, lower_s, secs, error = _compile(prog, options)
        if error:
            return {"error": f"{reps}-repetition compile: {error}"}
        h = _analyse(compiled, top, None)
        points.append({"reps": reps, "layers": layers, "cost": cost(compiled), "hlo_totals": _hlo_totals(h),
                       "peak": memory(compiled).get("peak"), "lower_s": lower_s, "compile_s": secs})
        del compiled
    lo, hi = points
    return {"cost": extrapolate.linear(lo["cost"], hi["cost"], counting.a, counting.n),
            "hlo_unrolled_totals": extrapolate.linear(lo["hlo_totals"], hi["hlo_totals"], counting.a, counting.n),
            "points": points}


@dataclasses.dataclass(frozen=True)
class Slice:
    """What a program is compiled for: the chip, how many of them, HBM per chip (bytes)."""

    chip: Chip
    chips: int
    hbm: float


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    """How every compile of one program runs and is read.

    options: compiler options of every compile (the TPU ones keep an oversized program compiling so that its
    memory and costs are still reported, `chips.TPU_COMPILE_OPTIONS`); top: HLO ops kept; force: compile even
    when the arguments alone do not fit; hlo_dump: also write the HLO text there; hlo_dump_compile=False: no
    second compile for XLA's dump when libtpu cannot print the HLO (a fit-only run: the row then has no HLO-op
    bytes, `hlo.error` says why); count_if_unfit=False skips the costs' compiles when the program as run does
    not fit (a smaller prefill chunk will be tried); no_prefetch: compiler options that switch VMEM
    prefetching off (`chips.no_prefetch_options`): the program as run is compiled once more with them
    (`no_prefetch_row`, the row's "no_prefetch").
    """

    options: dict | None = None
    top: int = 15
    force: bool = False
    hlo_dump: str | None = None
    hlo_dump_compile: bool = True
    count_if_unfit: bool = True
    no_prefetch: dict | None = None


def compile_program(program: Program, where: Slice, *, as_run: Program | None = None,
                    counting: Counting | None = None, unrolled: bool = True, as_run_row: dict | None = None,
                    opts: CompileOptions = CompileOptions()) -> dict:
    """Compile one program and return the report row (module docstring for the three ways of counting).

    counting given ("extrapolated"): `program` is the program as run (layer scans); `counting` the small
    unrolled programs for the costs (`as_run_row`: a saved row of the program as run instead of its compile).
    Otherwise `program` is the unrolled program ("unrolled") and `as_run` the same with its layer scans, or
    `program` keeps its scans and unrolled=False ("scan", `--count scan`).
    """
    chip, chips, hbm = where.chip, where.chips, where.hbm
    options, top, hlo_dump, count_if_unfit = opts.options, opts.top, opts.hlo_dump, opts.count_if_unfit
    again = (lambda p: p) if opts.hlo_dump_compile else (lambda p: None)
    args = program.argument_bytes_per_device
    row = {"program": program.name, "tokens_per_sequence": program.tokens_per_sequence, "bound": program.bound,
           "argument_bytes_per_device": args, "hbm_bytes": hbm}
    if program.notes:
        row["notes"] = program.notes
    if args > hbm and not opts.force:
        row.update(fits=False, compiled=False,
                   reason=f"arguments alone need {args / GIB:.2f} GiB per device > {hbm / GIB:.2f} GiB HBM")
        return row
    if counting is not None:
        row = _extrapolated(row, program, counting, where, opts, as_run_row)
        return _refinish(_with_no_prefetch(row, program, opts), chip, chips)
    run_hlo = None
    if as_run is not None:
        compiled, _, secs, error = _compile(as_run, options)
        row["as_run_compile_s"] = secs
        if error:
            return _failed(row, error)
        row["memory_as_run"] = memory(compiled)
        row["cost_as_run"] = cost(compiled)        # repeated layers counted once: for comparison only
        run_hlo = _analyse(compiled, top, hlo_dump and hlo_dump.replace(".hlo.txt", ".as_run.hlo.txt"), again(as_run),
                           options)
        del compiled
        peak = row["memory_as_run"].get("peak")
        if not count_if_unfit and peak is not None and peak > hbm:
            return _unfit_as_run(row, row["memory_as_run"], run_hlo, hbm)
    compiled, row["lower_s"], row["compile_s"], error = _compile(program, options)
    if error:
        return _failed(row, error)
    row["compiled"] = True
    mem = memory(compiled)
    row["memory"] = row.get("memory_as_run", mem)
    row["fit_from"] = "as run (layer scans)" if as_run is not None or not unrolled else "the unrolled program"
    row["cost"] = cost(compiled)
    row["cost_counts_every_layer"] = unrolled
    row["cost_method"] = "unrolled" if unrolled else "scan"
    text_hlo = _analyse(compiled, top, hlo_dump, None if run_hlo else again(program), options)
    del compiled
    # bytes, top ops and collectives: the program as run, loop bodies × trip counts (the unrolled text has
    # copies of the stacked layer weights a run does not make); the unrolled text's totals for comparison
    row["hlo"] = run_hlo or text_hlo
    if unrolled:
        row["memory_unrolled"] = mem
        row["hlo_unrolled"] = {"top_ops": {k: text_hlo["top_ops"][k] for k in ("total_bytes", "instructions")},
                               "collectives": {k: text_hlo["collectives"][k]
                                               for k in ("by_opcode", "count", "total_operand_bytes")}}
    _with_no_prefetch(row, as_run or program, opts)
    return _finish(row, chip, chips, hbm)


def no_prefetch_row(program: Program, options: dict | None, no_prefetch: dict, top: int,
                    hlo_dump_compile: bool = True) -> dict:
    """The program as run compiled once more with XLA's VMEM prefetching off (`no_prefetch`, from
    `chips.no_prefetch_options`): its memory, XLA's costs (each repeated layer once: comparable with the row's
    "cost_as_run", not with its every-layer "cost"), its HLO-op bytes (loop bodies × trip counts: every layer)
    and how many prefetches it kept (0 when the option took effect). Or {"error"}."""
    opts = {**(options or {}), **no_prefetch}
    compiled, lower_s, secs, error = _compile(program, opts)
    if error:
        return {"options": no_prefetch, "error": error[:600]}
    h = _analyse(compiled, top, None, program if hlo_dump_compile else None, opts)
    out = {"options": no_prefetch, "lower_s": lower_s, "compile_s": secs, "memory": memory(compiled),
           "cost_as_run": cost(compiled), "hlo_op_bytes": h["top_ops"]["total_bytes"] or None,
           "vmem_prefetches": h.get("vmem_prefetches"), "top_groups": h["top_ops"]["groups"][:6]}
    if "error" in h:
        out["hlo_error"] = h["error"]
    del compiled
    gc.collect()
    return out


def _with_no_prefetch(row: dict, program: Program, opts: CompileOptions) -> dict:
    if opts.no_prefetch and row.get("compiled"):
        row["no_prefetch"] = no_prefetch_row(program, opts.options, opts.no_prefetch, opts.top, opts.hlo_dump_compile)
    return row


def _unfit_as_run(row: dict, mem: dict, run_hlo: dict, hbm: float) -> dict:
    peak = mem["peak"]
    row.update(compiled=False, fits=False, required_bytes=peak, memory=mem, hlo=run_hlo,
               reason=f"as run it needs {peak / GIB:.2f} GiB per device > {hbm / GIB:.2f} GiB HBM")
    return row


def _refinish(row: dict, chip: Chip, chips: int) -> dict:
    """The estimates again once a finished row gained its no-prefetch compile."""
    if "no_prefetch" in row and "estimate" in row:
        row["estimate"] = estimates(row, chip, chips)
    return row


def _finish(row: dict, chip: Chip, chips: int, hbm: float) -> dict:
    peak = row["memory"].get("peak")
    row["fits"] = None if peak is None else peak <= hbm
    if row["fits"] is False:
        row["required_bytes"] = peak
    row["estimate"] = estimates(row, chip, chips)
    return row


def _extrapolated(row: dict, program: Program, counting: Counting, where: Slice, opts: CompileOptions,
                  as_run_row: dict | None = None) -> dict:
    """The "extrapolated" row: fit, HLO analysis and cost_as_run from `program` (as run; or from a saved
    `as_run_row`); costs from the two small unrolled programs of `counting`, extrapolated (falls back to
    cost_as_run, said so, when one of them fails to compile)."""
    options, top, hbm = opts.options, opts.top, where.hbm
    if as_run_row is not None:
        row.update(memory=as_run_row["memory"], hlo=as_run_row["hlo"], fit_source=as_run_row["fit_source"],
                   cost_as_run=as_run_row.get("cost_as_run", as_run_row.get("cost")),
                   lower_s=as_run_row.get("lower_s", 0.0), compile_s=as_run_row.get("compile_s", 0.0))
    else:
        compiled, row["lower_s"], row["compile_s"], error = _compile(program, options)
        if error:
            return _failed(row, error)
        row["memory"] = memory(compiled)
        row["cost_as_run"] = cost(compiled)        # repeated layers counted once: for comparison only
        row["hlo"] = _analyse(compiled, top, opts.hlo_dump, program if opts.hlo_dump_compile else None, options)
        del compiled
    row["fit_from"] = "as run (layer scans)"
    peak = row["memory"].get("peak")
    if not opts.count_if_unfit and peak is not None and peak > hbm:
        return _unfit_as_run(row, row["memory"], row["hlo"], hbm)
    row["compiled"] = True
    counted = count_by_extrapolation(counting, options, top)
    if "error" in counted:
        row.update(cost=row["cost_as_run"], cost_counts_every_layer=False, cost_method="scan",
                   count_error=counted["error"][:600])
    else:
        row.update(cost=counted["cost"], cost_counts_every_layer=True, cost_method="extrapolated",
                   cost_points=counted["points"], hlo_unrolled_totals=counted["hlo_unrolled_totals"],
                   count_compile_s=sum(p["compile_s"] for p in counted["points"]))
    return _finish(row, where.chip, where.chips, hbm)
