"""`dsv4-aot`: will DeepSeek-V4 fit on a TPU slice, and how fast could it be — compiled ahead of time on CPU.

For each topology (as libtpu names them: v5p:2x2x2, v5e:4x4, v6e:2x4, ...) and weight format, compiles the
prefill chunk, the decode step, the verify block (k+1 tokens) and one speculative round with MTP and with
DSpark, from abstract sharded inputs (nothing is allocated, no TPU is needed: libtpu compiles on this CPU),
and reports per program: fits or not (HBM per chip), argument / temp / output bytes, compile time, flops,
bytes accessed against the bytes bound, estimated time at the chip's bandwidth and peak rate, top HLO ops by
bytes and collectives; when decode, verify and a speculative round compiled, the speculation payoff forecast
for k = 1..7 under an acceptance profile (`--acceptance`). JSON + Markdown + plots (`--out`).

Subcommands (the first argument) for the tables built on the same code:

    placements   per-chip traffic of decode / verify under each placement of the expert-parallel study
                 (`aot.placement_table`)
    fit-table    the README's "will it fit" table from saved reports, compiling nothing (`aot.fit_summary`)
    kernels      the Mosaic TPU kernels alone, compiled per case with their XLA references (`analysis.kernels_aot`)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Iterable

import jax

from ... import backends as B, cli
from .. import kernels_aot, libtpu
from . import chips, ep as EP, extrapolate as X, fit_summary, forecast as F, inputs as I, placement_table
from . import programs as PR, report as R, runner

EXAMPLES = """examples:
  dsv4-aot --topology v5p:2x2x2 --weights bf16 --batch 8 --context 32768 --out aot_v5p8.json
  dsv4-aot --topology v5p:2x2x1 --weights fp8 --batch 8 --context 32768
  dsv4-aot --topology v5e:4x4,v5p:2x2x1,v5p:2x2x2,v6e:2x4 --weights bf16,fp8 --plan    # no compile, no libtpu
  dsv4-aot --small --topology v5p:2x2x1 --programs decode,verify                        # seconds: a quick check
  dsv4-aot --topology cpu --small                                                         # without libtpu
  dsv4-aot --render a.json b.json --out merged.json                                       # re-render / merge
  dsv4-aot --render dec.json ver.json mtp.json --acceptance 0.9,0.7,0.5 --out fc.json   # forecast, other profile
  dsv4-aot placements --topology v6e:2x4 --weights release --pairs 0 --count scan --out OUT   # placements table
  dsv4-aot fit-table a.json b.json --reproduce                                            # the README's fit table
  dsv4-aot kernels --topology v5p:2x2x1 --topology v6e:2x2 --out kernels.json             # Mosaic kernels alone

Full flash() compiles take minutes per program on 2 cores. Every layer is counted by default from the program
as run plus two small unrolled compiles (3 + 2 and 3 + 3 layers of Flash), extrapolated to all 20 HCA/CSA
pairs (--count extrapolate); --count unroll compiles every layer written out (tens of minutes per program)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsv4-aot", description=__doc__, epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--topology", type=cli.names(what="topology"), default=["v5p:2x2x2"],
                   help="comma list of topologies as libtpu names them (v5p:2x2x2, v5e:4x4, v6e:2x4, ...; "
                        "'cpu' or 'cpu:N' for this machine's CPU backend); default v5p:2x2x2")
    p.add_argument("--weights", type=cli.names(I.WEIGHTS, "weight format"), default=["bf16"],
                   help="comma list of weight formats: bf16; fp8 (routed experts as FP8 e4m3 codes + a float32 "
                        "scale per 128x128 block, the MoE kernels' storage); release (the official release "
                        "precision kept quantized: FP4 experts, FP8 attention / shared experts) (default bf16)")
    p.add_argument("--batch", type=cli.positive_int, default=8, help="sequences per step (default 8)")
    p.add_argument("--context", type=cli.positive_int, default=32768,
                   help="committed tokens per sequence when the step runs (default 32768)")
    p.add_argument("--draft-n-max", type=cli.positive_int, default=3,
                   help="drafts per round k; the verify block is k+1 tokens (default 3; DSpark: at most its "
                        "block size 5)")
    p.add_argument("--prefill-chunk", type=cli.positive_int, default=256,
                   help="tokens per sequence in one prefill call (default 256: 2048 tokens at batch 8)")
    p.add_argument("--prefill-min", type=cli.positive_int, default=8,
                   help="when the prefill chunk runs out of memory, halve it down to this many tokens per "
                        "sequence and report the largest that fits (default 8; = --prefill-chunk: no retry)")
    p.add_argument("--programs", type=cli.names(PR.PROGRAMS, "program"), default=list(PR.PROGRAMS),
                   help=f"comma list of {','.join(PR.PROGRAMS)} (default all)")
    cli.add_mesh(p, help="mesh DATAxEXPERTxMODEL (product = devices of the topology); default from --mesh-preset")
    p.add_argument("--mesh-preset", default="default", choices=sorted(runner.MESH_PRESETS),
                   help="named mesh for n devices (default: 1 x n x 1, experts split n ways, attention "
                        "data-parallel)")
    p.add_argument("--sharding", default=None, choices=EP.SHARDINGS,
                   help="compile the expert-parallel programs a user runs: a sharding preset's mesh, rules and "
                        "EP MoE (latency: tensor-parallel attention + expert-tensor-parallel experts; throughput: "
                        "data-parallel attention + expert parallelism; auto: by batch). Replaces --mesh / "
                        "--mesh-preset; --kernels pallas_tpu makes the Mosaic kernels the per-device local "
                        "matmul. Default: the GSPMD mesh of --mesh-preset")
    cli.add_preset(p)
    p.add_argument("--pairs", type=int, default=None,
                   help="keep only this many of the repeated HCA/CSA pairs (flash has 20; default all)")
    p.add_argument("--small", action="store_true",
                   help="tiny dimensions, same layer schedule: seconds per compile (checks the report, not Flash)")
    cli.add_kernels(p, "--backends",
                    help="hot-op implementations, a static dsv4_jax.backends.Backends: reference (XLA), pallas_tpu "
                         "(the Mosaic TPU kernels for the MoE experts and the indexer scores; auto = the same on "
                         "TPU); default reference")
    p.add_argument("--count", choices=runner.COUNT_METHODS, default="extrapolate",
                   help="how XLA's costs count every layer (its cost analysis counts a while body once): "
                        "extrapolate (default: the program as run gives the fit and HLO analysis; the leading "
                        "layers + N and + N+1 repeated pairs compiled unrolled give the costs, extrapolated "
                        "linearly to every pair); unroll (the whole program unrolled: exact, slow); scan (one "
                        "compile, each repeated layer counted once)")
    p.add_argument("--count-base", type=cli.positive_int, default=X.DEFAULT_BASE,
                   help=f"N of --count extrapolate: the smaller number of repeated pairs compiled (default "
                        f"{X.DEFAULT_BASE})")
    p.add_argument("--no-unroll", action="store_true", help="the same as --count scan")
    p.add_argument("--fit-from", nargs="+", metavar="JSON", default=(),
                   help="with --count extrapolate: take each program as run (fit, HLO bytes, top ops, "
                        "collectives) from these saved reports when they hold it (same model, shapes, topology, "
                        "weights, mesh; layer scans kept) and compile only the two small unrolled programs")
    p.add_argument("--fit-from-unrolled", action="store_true",
                   help="with --count unroll: take the fit from the unrolled program (one compile per program "
                        "instead of two; the unrolled program may need more memory than the run's)")
    p.add_argument("--plan", "--dry-run", dest="plan", action="store_true",
                   help="print what would be compiled (per-device arguments, bounds) and stop; needs no libtpu")
    p.add_argument("--force", action="store_true",
                   help="compile even when the arguments alone exceed the HBM of a device")
    p.add_argument("--hbm-gib", type=float, default=None,
                   help="HBM per device (default: asked from the TPU compiler; the CPU backend uses 16)")
    p.add_argument("--top", type=cli.positive_int, default=15, help="top HLO ops kept per program (default 15)")
    p.add_argument("--hlo-dir", default=None, help="also write each compiled program's HLO text here")
    p.add_argument("--no-hlo-dump", action="store_true",
                   help="when libtpu cannot print a compiled program's HLO, leave its HLO-op bytes out instead of "
                        "compiling it once more for XLA's dump (fit-only runs: one compile per program)")
    p.add_argument("--vmem-prefetch", choices=runner.VMEM_PREFETCH, default="both",
                   help="both (default): also compile each program as run with XLA:TPU's VMEM prefetching off "
                        "(v5e, v5p, v6e) and report its HBM bytes next to the default compile's (XLA's cost "
                        "analysis counts a prefetched weight three times); on: the default compile only (one "
                        "compile less per program)")
    p.add_argument("--collective-latency-us", type=cli.non_negative_float, default=None, metavar="US",
                   help="latency-aware roofline: fixed cost per collective in µs (default "
                        f"{chips.Chip.collective_latency_us:g}: assumed, no published per-chip figure)")
    p.add_argument("--op-overhead-us", type=cli.non_negative_float, default=None, metavar="US",
                   help="latency-aware roofline: launch cost per separately run op (fusion, custom call, ...) "
                        f"in µs (default {chips.Chip.op_overhead_us:g}: assumed)")
    p.add_argument("--no-kernels", action="store_true", help="skip the Mosaic TPU kernels section")
    p.add_argument("--no-plot", action="store_true", help="write JSON and Markdown only")
    p.add_argument("--out", default="aot_report.json",
                   help="report JSON path; the Markdown and plot go next to it (x.md, x.png); default "
                        "aot_report.json")
    p.add_argument("--acceptance", default=None, metavar="PROFILE",
                   help="acceptance profile of the speculation payoff forecast (per-position conditional rates): a "
                        f"published name ({', '.join(sorted(F.PUBLISHED))}), a dsv4-sweep summary.json (each "
                        "drafter's own greedy setting with the most positions), or comma rates '0.8,0.6,0.5'; "
                        f"default {F.DEFAULT_PROFILE} (with --render: the first report's)")
    p.add_argument("--render", nargs="+", metavar="JSON", default=None,
                   help="compile nothing: re-render (and merge) saved reports into --out")
    return p


def _fail(msg: str) -> int:
    return cli.fail("dsv4-aot", msg)


def _use_cpu_backend() -> None:
    """Compiling for a TPU topology never needs a local accelerator: keep jax on the CPU backend."""
    if not jax.config.jax_platforms:          # JAX_PLATFORMS (or the option) unset: the CPU backend
        try:
            jax.config.update("jax_platforms", "cpu")
        except Exception:  # noqa: BLE001 - backends already initialised: leave them
            pass


def check_acceptance(spec: str | None) -> None:
    """A bad --acceptance fails before anything compiles (cli.OptionError naming the problem)."""
    if spec is None:
        return
    try:
        F.profile(spec)
    except ValueError as e:
        raise cli.OptionError(f"--acceptance: {e}") from None


def with_forecast(report: dict, spec: str) -> dict:
    """The report with its speculation payoff forecast under profile `spec` (none when no run compiled
    decode, verify and a round)."""
    report = dict(report)
    report.pop("forecast", None)
    fc = F.report_forecast(report, spec)
    if fc:
        report["forecast"] = fc
    return report


def render(paths: list[str], out: str, plot: bool, acceptance: str | None = None) -> int:
    reports = []
    for p in paths:
        try:
            with open(p) as f:
                reports.append(json.load(f))
        except (OSError, json.JSONDecodeError) as e:
            return _fail(f"cannot read report {p}: {e}")
    try:
        merged = R.merge(reports, paths)
    except ValueError as e:
        return _fail(str(e))
    spec = acceptance or (reports[0].get("forecast") or {}).get("spec") or F.DEFAULT_PROFILE
    try:
        merged = with_forecast(merged, spec)
    except ValueError as e:      # e.g. rows saved before the forecast's bounds per k: rendered without it
        print(f"dsv4-aot: no forecast: {e}", file=sys.stderr)
    for p in R.write(merged, out, plot):
        print(f"wrote {p}")
    print(R.fit_table(merged))
    return 0


def print_plan(plans: list[dict], config, shapes) -> None:
    g = chips.GIB
    print(f"{config.name}: {config.num_layers} layers, backends {config.backends.describe()}; batch {shapes.batch}, "
          f"context {shapes.context}, k {shapes.draft_n_max}, prefill chunk {shapes.prefill_chunk}")
    for pl in plans:
        print(f"\n{pl['topology']} ({pl['chips']} chips, mesh {'x'.join(map(str, pl['mesh']))}), {pl['weights']} "
              f"weights, HBM {pl['hbm_table_gib']:g} GiB/chip (table):")
        for r in pl["programs"]:
            args = r["argument_bytes_per_device"]
            b = r["bound"].get("total")
            fit = "arguments fit" if args <= pl["hbm_table_gib"] * g else "DOES NOT FIT (arguments alone)"
            print(f"  {r['program']:12s} arguments {args / g:8.2f} GiB/chip  {fit:32s} bound "
                  f"{(b or 0) / pl['chips'] / 1e9:8.3g} GB/chip")


def parse_request(a: argparse.Namespace, argv: list[str] | None) -> runner.AotRequest:
    """The report the flags ask for, every flag checked and the --fit-from reports read (cli.OptionError
    naming the problem otherwise)."""
    try:
        topologies = [chips.parse(t) for t in a.topology]
        for w in a.weights:
            I.check_weights(w)
    except (chips.TopologyError, I.WeightFormatError) as e:
        raise cli.OptionError(str(e)) from None
    if a.mesh is not None and len({t.chips for t in topologies}) > 1:
        raise cli.OptionError("--mesh fixes the device count; give one topology (or topologies of one size) with it")
    platform = "tpu" if any(t.is_tpu for t in topologies) else "cpu"
    if platform == "tpu" and any(not t.is_tpu for t in topologies):
        raise cli.OptionError("mix of TPU and cpu topologies: run them separately")
    count = "scan" if a.no_unroll else a.count
    try:
        config = runner.model_config(a.preset, pairs=a.pairs, small=a.small, backends=a.kernels,
                                     platform=platform, unroll=count != "scan")
        for t in topologies:
            runner.mesh_shape(t.chips, a.mesh, a.mesh_preset)
    except (ValueError, B.BackendError) as e:
        raise cli.OptionError(str(e)) from None
    fit_from = []
    for path in a.fit_from:
        try:
            with open(path) as f:
                fit_from.append((path, json.load(f)))
        except (OSError, json.JSONDecodeError) as e:
            raise cli.OptionError(f"cannot read --fit-from report {path}: {e}") from None
    return runner.AotRequest(
        tuple(a.topology), tuple(a.weights), I.Shapes(a.batch, a.context, a.draft_n_max, a.prefill_chunk), config,
        programs=tuple(a.programs), mesh=a.mesh, mesh_preset=a.mesh_preset, hbm_gib=a.hbm_gib, top=a.top,
        force=a.force, kernels=not a.no_kernels, hlo_dir=a.hlo_dir,
        command="dsv4-aot " + " ".join(sys.argv[1:] if argv is None else argv), prefill_min=a.prefill_min,
        fit_as_run=not a.fit_from_unrolled, count=count, base=a.count_base, fit_from=tuple(fit_from),
        sharding=a.sharding, hlo_dump_compile=not a.no_hlo_dump, vmem_prefetch=a.vmem_prefetch,
        collective_latency_us=a.collective_latency_us, op_overhead_us=a.op_overhead_us)


# subcommand: its main(argv without the subcommand's name)
SUBCOMMANDS = {"placements": placement_table.main, "fit-table": fit_summary.main, "kernels": kernels_aot.main}


def main(argv: Iterable[str] | None = None) -> int:
    argv = None if argv is None else list(argv)
    words = sys.argv[1:] if argv is None else argv
    if words and words[0] in SUBCOMMANDS:
        _use_cpu_backend()
        return SUBCOMMANDS[words[0]](words[1:])
    a = build_parser().parse_args(argv)
    try:
        check_acceptance(a.acceptance)
    except cli.OptionError as e:
        return _fail(str(e))
    if a.render:
        return render(a.render, a.out, not a.no_plot, a.acceptance)
    try:
        req = parse_request(a, argv)
    except cli.OptionError as e:
        return _fail(str(e))
    topologies = [chips.parse(t) for t in req.topologies]
    if a.plan:
        print_plan([runner.plan_run(req, t, w) for t in topologies for w in req.weights], req.config, req.shapes)
        return 0
    if any(t.is_tpu for t in topologies) and not libtpu.available():
        return _fail(chips.LIBTPU_HELP)
    if a.hlo_dir:
        os.makedirs(a.hlo_dir, exist_ok=True)
    _use_cpu_backend()
    libtpu.set_env()
    partial = os.path.splitext(a.out)[0] + ".partial.json"

    def checkpoint(rep):
        R._atomic_write(partial, lambda p: json.dump(rep, open(p, "w"), indent=1, default=str))

    try:
        rep = runner.run(req, checkpoint=checkpoint)
    except (chips.TopologyError, chips.LibtpuMissing) as e:
        return _fail(str(e))
    try:
        rep = with_forecast(rep, a.acceptance or F.DEFAULT_PROFILE)
    except ValueError as e:      # e.g. a sweep summary without this drafter: the report is written without it
        print(f"dsv4-aot: no forecast: {e}", file=sys.stderr)
    for p in R.write(rep, a.out, not a.no_plot):
        print(f"wrote {p}")
    if os.path.exists(partial):
        os.remove(partial)
    print()
    print(R.fit_table(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
