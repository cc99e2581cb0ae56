"""Run the report: for each topology × weight format, build and compile every requested program.

`model_config` picks the model (a preset, optionally with fewer of Flash's repeated HCA/CSA pairs, or
`small` dimensions for quick checks). `Counting` says how every layer is counted (XLA's cost analysis counts
a `while` body once; `aot.compile` describes the methods): "extrapolate" (default: the program as run for
the fit and HLO analysis, two small unrolled programs for the costs, `aot.extrapolate`), "unroll" (the full
program unrolled) or "scan" (one compile, repeated layers counted once by XLA). `mesh_shape` resolves
`--mesh` / `--mesh-preset` to (data, expert, model) sizes. `run` compiles an `AotRequest` (what the CLI's
flags ask for) and returns the report dict that `report.write` renders.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import importlib.metadata
import math
import os
import platform
import sys
import time
from typing import Callable, Sequence

import jax
from jax.sharding import AbstractMesh

from ... import backends as B
from ...model import params as P
from ... import parallel
from ...config import ConfigError, ModelConfig, preset, small as small_config, with_pairs
from . import chips, compile as C, ep as EP, extrapolate as X, inputs as I, programs as PR
from .kernel_hook import KERNEL_FORMAT, ep_local_declared, kernel_reports, local_expert_dims

# --mesh-preset: name -> (data, expert, model) sizes for n devices. "default" is sharding.default_mesh_shape
# (experts split n ways, attention data-parallel); the expert-parallel presets ("latency" / "throughput",
# issue 19) register here.
MESH_PRESETS: dict[str, Callable[[int], tuple[int, int, int]]] = {"default": parallel.default_mesh_shape}


def model_config(name: str = "flash", *, pairs: int | None = None, small: bool = False,
                 backends: str | B.Backends = "reference", platform: str = "tpu", unroll: bool = True) -> ModelConfig:
    """The preset `name`; `pairs` keeps the leading non-repeated layers and that many of the repeated
    HCA/CSA pairs (`config.with_pairs`; Flash: 3 + 2·20 layers); `small` shrinks the dimensions (same
    schedule, `config.small`)."""
    c = preset(name)
    if pairs is not None:
        try:
            c = with_pairs(c, pairs)
        except ConfigError as e:
            raise ValueError(f"--{e}") from None
    if small:
        c = small_config(c)
    b = B.resolve(backends, platform)       # Pallas off GPU switches interpret mode on
    if platform == "tpu" and b.interpret:
        raise B.BackendError(f"backends {b.describe()}: the Pallas GPU (Triton) kernels do not compile for TPU; "
                             "use --kernels reference or pallas_tpu")
    return c.with_backends(b.replace(unroll_layers=unroll))


COUNT_METHODS = ("extrapolate", "unroll", "scan")


@dataclasses.dataclass(frozen=True)
class Counting:
    """The configs a program is compiled from under one way of counting every layer.

    method: "extrapolated" (`program` = the model as run; `points` = (a, n, config with a, with a + 1
    repetitions, unrolled)), "unrolled" (`program` unrolled; `as_run` with the layer scans, or None with
    --fit-from-unrolled) or "scan" (`program` as run, nothing else)."""

    method: str
    program: ModelConfig
    as_run: ModelConfig | None = None
    points: tuple | None = None


def counting(config: ModelConfig, count: str = "extrapolate", fit_as_run: bool = True,
             base: int = X.DEFAULT_BASE) -> Counting:
    """The configs for `count` (one of COUNT_METHODS); "extrapolate" on a model with at most base + 1
    repetitions compiles it unrolled (as small as the two extrapolation points)."""
    if count not in COUNT_METHODS:
        raise ValueError(f"unknown count method {count!r}; choose from {COUNT_METHODS}")
    rolled = config.with_backends(config.backends.replace(unroll_layers=False))
    flat = config.with_backends(config.backends.replace(unroll_layers=True))
    if count == "scan":
        return Counting("scan", rolled)
    pts = X.points(config, base) if count == "extrapolate" else None
    if pts is None:
        return Counting("unrolled", flat, rolled if fit_as_run else None)
    a, b, n = pts
    return Counting("extrapolated", rolled, points=(a, n, X.with_reps(flat, a), X.with_reps(flat, b)))


def mesh_shape(n_devices: int, mesh: Sequence[int] | None = None, preset_name: str = "default") -> tuple[int, ...]:
    if mesh is not None:
        if math.prod(mesh) != n_devices:
            raise ValueError(f"mesh {'x'.join(map(str, mesh))} has {math.prod(mesh)} devices, the topology "
                             f"{n_devices}")
        return tuple(mesh)
    if preset_name not in MESH_PRESETS:
        raise ValueError(f"unknown mesh preset {preset_name!r}; choose from {sorted(MESH_PRESETS)}")
    return tuple(MESH_PRESETS[preset_name](n_devices))


def _versions() -> dict:
    out = {"jax": jax.__version__}
    try:
        out["libtpu"] = importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        out["libtpu"] = None
    return out


def meta(command: str) -> dict:
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs, "
                       f"{platform.system()} {platform.release()})",
            "python": platform.python_version(), "command": command, **_versions()}


def plan_run(request: AotRequest, topology: chips.Topology, weights: str) -> dict:
    """What `run` would compile for one topology and weight format, from abstract shapes only (no libtpu, no
    compile): per-device argument bytes against the table HBM, and the bounds."""
    r = request
    shape = mesh_shape(topology.chips, r.mesh, r.mesh_preset)
    amesh = AbstractMesh(shape, parallel.MESH_AXES)
    rows = []
    for name in r.programs:
        p = PR.build(name, r.config, amesh, weights, r.shapes, r.rules)
        rows.append({"program": name, "argument_bytes_per_device": p.argument_bytes_per_device,
                     "bound": p.bound, "tokens_per_sequence": p.tokens_per_sequence})
    return {"topology": topology.name, "chips": topology.chips, "mesh": shape, "weights": weights,
            "hbm_table_gib": topology.chip.hbm_gib, "programs": rows}


def _log(msg: str, t0: float, log) -> None:
    if log:
        print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", file=log, flush=True)


@dataclasses.dataclass(frozen=True)
class AotRequest:
    """One report: every topology × weight format × program of one model at one set of shapes, and how they
    are compiled and counted (the dsv4-aot flags, parsed once by its CLI).

    mesh: (data, expert, model) sizes, else `mesh_preset`'s for each topology; hbm_gib: HBM per device
    (default: asked from the compiler); top: HLO ops kept per program; force: compile even when the
    arguments alone do not fit; kernels: add the Mosaic kernels section (TPU topologies); hlo_dir: also
    write each program's HLO text there; command: recorded in the report's meta; prefill_min: a prefill
    chunk that does not fit is halved (`compile_prefill`) down to this many tokens per sequence; count: how
    every layer is counted (`counting`; the config's own unroll_layers is not used); base: the smaller
    repetition count of "extrapolate"; fit_from: saved (path, report)s whose rows of the same program as
    run (same model, shapes, topology, weights, mesh, chunk; compiled with the layer scans) give the fit
    and HLO analysis instead of a new full compile ("extrapolate" only; `reusable_row`); fit_as_run
    ("unroll" only): also compile each program with its layer scans (as a run executes it) for the fit;
    sharding: a sharding preset ("latency", "throughput", "auto": by batch, `ep.setup`) whose mesh, rules and
    expert-parallel MoE replace mesh / mesh_preset (the programs a user runs; `rules`, a dict, then updates
    the preset's rules); hlo_dump_compile:
    compile a program whose HLO libtpu cannot print once more for XLA's dump (`compile.dumped_text`);
    vmem_prefetch: "both" also compiles each program as run with XLA's VMEM prefetching off where the chip's
    option is known (`chips.no_prefetch_options`; the row's "no_prefetch"), "on" only the default compile.
    collective_latency_us / op_overhead_us: the latency-aware roofline's µs per collective and per launched op
    (`chips.with_latencies`; None: the chip's assumed defaults), recorded in the meta's "latency".
    """

    topologies: tuple[str, ...]
    weights: tuple[str, ...]
    shapes: I.Shapes
    config: ModelConfig
    programs: tuple[str, ...] = PR.PROGRAMS
    mesh: tuple[int, ...] | None = None
    mesh_preset: str = "default"
    rules: object = None
    hbm_gib: float | None = None
    top: int = 15
    force: bool = False
    kernels: bool = True
    hlo_dir: str | None = None
    hlo_dump_compile: bool = True
    command: str = ""
    prefill_min: int = 8
    fit_as_run: bool = True
    count: str = "extrapolate"
    base: int = X.DEFAULT_BASE
    fit_from: tuple[tuple[str, dict], ...] = ()
    sharding: str | None = None
    vmem_prefetch: str = "both"
    collective_latency_us: float | None = None
    op_overhead_us: float | None = None


VMEM_PREFETCH = ("both", "on")


def run(request: AotRequest, *, log=sys.stdout, checkpoint: Callable | None = None) -> dict:
    """Compile the request's programs for every topology × weight format; returns the report dict.
    log: progress lines (None: quiet); checkpoint(report) is called after every program (the CLI writes a
    partial JSON with it)."""
    r = request
    if r.vmem_prefetch not in VMEM_PREFETCH:
        raise ValueError(f"unknown vmem_prefetch {r.vmem_prefetch!r}; choose from {VMEM_PREFETCH}")
    config, shapes = r.config, r.shapes
    t0 = time.perf_counter()
    say = lambda msg: _log(msg, t0, log)
    how = counting(config, r.count, r.fit_as_run, r.base)
    report = {"meta": {**meta(r.command), "latency": latency_meta(r)}, "model": {"name": config.name, "layers": config.num_layers,
                                               "params_b": P.count_params(config) / 1e9,
                                               "unroll_layers": how.method == "unrolled"},
              "counting": _counting_meta(how), "backends": how.program.backends.describe(),
              "shapes": dataclasses.asdict(shapes), "runs": []}
    for tname in r.topologies:
        topo = chips.parse(tname)
        topo = dataclasses.replace(topo, chip=chips.with_latencies(topo.chip, r.collective_latency_us,
                                                                   r.op_overhead_us))
        devs = chips.devices(topo)
        hbm, source = (r.hbm_gib * chips.GIB, "--hbm-gib") if r.hbm_gib else chips.hbm_bytes(topo, devs)
        how_t, rules_t, preset_name = how, r.rules, None
        if r.sharding:
            preset_name, ep_config, ep_mesh, rules_t = EP.setup(r.sharding, config, devs, shapes.batch,
                                                                 r.rules)
            how_t = counting(ep_config, r.count, r.fit_as_run, r.base)
            shape = tuple(ep_mesh.devices.shape)
        else:
            ep_mesh, shape = None, mesh_shape(len(devs), r.mesh, r.mesh_preset)
        target = Target(topo, devs, ep_mesh if ep_mesh is not None else parallel.make_mesh(shape, devs), hbm,
                        chips.TPU_COMPILE_OPTIONS if topo.is_tpu else None,
                        chips.no_prefetch_options(topo.chip) if r.vmem_prefetch == "both" else None)
        for w in r.weights:
            run_ = {"topology": topo.name, "chips": len(devs), "hosts": chips.host_count(devs),
                    "chip": dataclasses.asdict(topo.chip), "device_kind": devs[0].device_kind,
                    "hbm_bytes": hbm, "hbm_source": source, "mesh": dict(zip(parallel.MESH_AXES, shape)),
                    "mesh_text": "×".join(map(str, shape)), "weights": w, "programs": []}
            if preset_name:      # the backends per run: the EP local matmul follows the chip (`backends.ep_local_auto`)
                run_["sharding"], run_["backends"] = preset_name, how_t.program.backends.describe()
            report["runs"].append(run_)
            for name in r.programs:
                dump = os.path.join(r.hlo_dir, f"{topo.name.replace(':', '_')}_{w}_{name}.hlo.txt") if r.hlo_dir else None
                saved = functools.partial(reusable_row, r.fit_from, config, shapes,
                                          (topo.name, w, run_["mesh_text"]), name)
                opts = C.CompileOptions(target.options, r.top, r.force, dump, r.hlo_dump_compile,
                                        no_prefetch=target.no_prefetch)
                one = functools.partial(compile_one, Job(target, name, how_t, w, rules_t), opts=opts, say=say,
                                        saved=saved)
                run_["programs"].append(compile_prefill(one, shapes, r.prefill_min) if name == "prefill"
                                        else one(shapes))
                if checkpoint:
                    report["meta"]["wall_s"] = time.perf_counter() - t0
                    checkpoint(report)
            if r.kernels and topo.is_tpu:
                run_["kernels"] = kernel_reports(topo.name, config, shapes, w, log=say)
    report["meta"]["wall_s"] = time.perf_counter() - t0
    return report


@dataclasses.dataclass(frozen=True)
class Target:
    """Where programs are compiled for: topology, its devices and mesh, HBM per device, compiler options, and
    the options of the second compile with VMEM prefetching off (None: no second compile)."""

    topology: chips.Topology
    devices: list
    mesh: object
    hbm: float
    options: dict | None
    no_prefetch: dict | None = None


def latency_meta(r: AotRequest) -> dict:
    """The latency-aware roofline's latencies of a request (µs) and where they came from."""
    given = {"collective_latency_us": r.collective_latency_us, "op_overhead_us": r.op_overhead_us}
    defaults = {k: getattr(chips.Chip, k) for k in given}
    return {**{k: defaults[k] if v is None else v for k, v in given.items()},
            "source": {k: "command line" if v is not None else chips.LATENCY_SOURCE for k, v in given.items()}}


def _counting_meta(how: Counting) -> dict:
    out = {"method": how.method}
    if how.points:
        a, n, ca, cb = how.points
        out.update(reps=(a, a + 1), layers=(ca.num_layers, cb.num_layers), extrapolated_to=n)
    return out


def reusable_row(sources: Sequence[tuple[str, dict]], config: ModelConfig, shapes: I.Shapes,
                 run: tuple[str, str, str], name: str, chunk: int) -> dict | None:
    """The row of program `name` as run in a saved report of the same model (name, layers), shapes
    (prefill: the same chunk) and run (topology, weights, mesh text), compiled with its layer scans (`--count
    scan`, or the as-run half of an "extrapolated" / "unrolled" row), with "fit_source" naming the report;
    else None."""
    for path, rep in sources:
        if (rep["model"]["name"], rep["model"]["layers"]) != (config.name, config.num_layers) or \
                {k: v for k, v in rep["shapes"].items() if k != "prefill_chunk"} != \
                {k: v for k, v in dataclasses.asdict(shapes).items() if k != "prefill_chunk"}:
            continue
        for run_ in rep["runs"]:
            if (run_["topology"], run_["weights"], run_["mesh_text"]) != tuple(run):
                continue
            for r in run_["programs"]:
                if r["program"] != name or not r.get("compiled") or \
                        (name == "prefill" and r["tokens_per_sequence"] != chunk):
                    continue
                method = r.get("cost_method") or ("unrolled" if r.get("cost_counts_every_layer", True) else "scan")
                if method == "scan":
                    out = dict(r, cost_as_run=r["cost"])
                elif "memory_as_run" in r or method == "extrapolated":   # its "hlo" is the program as run's
                    out = dict(r, memory=r.get("memory_as_run", r["memory"]))
                else:
                    continue
                out["fit_source"] = f"{path} ({rep['meta'].get('date')}: {rep['meta'].get('command')})"
                return out
    return None


@dataclasses.dataclass(frozen=True)
class Job:
    """One program of one run: where it compiles, its name, how it is counted (`counting`), the weight format
    and the logical-axis rules it is placed with (None: the defaults)."""

    target: Target
    name: str
    how: Counting
    weights: str
    rules: object = None


def compile_one(job: Job, shapes: I.Shapes, last_try: bool = True, *, opts: C.CompileOptions = C.CompileOptions(),
                say=lambda msg: None, saved: Callable[[int], dict | None] = lambda chunk: None) -> dict:
    """Build the job's program from the configs of its counting and compile it (`compile.compile_program`;
    last_try=False: a prefill chunk that will be halved if it does not fit); with "extrapolated" counting,
    `saved(chunk)` may give a saved row of the program as run (`reusable_row`)."""
    target, name, how, weights = job.target, job.name, job.how, job.weights
    label = f"{target.topology.name} {weights} {name}"
    say(f"{label}: building ({how.method})")
    build = lambda cfg: PR.build(name, cfg, target.mesh, weights, shapes, job.rules)
    prog = build(how.program)
    as_run = build(how.as_run) if how.as_run is not None else None
    points = None
    if how.points:
        a, n, ca, cb = how.points
        points = C.Counting(a, n, build(ca), build(cb), (ca.num_layers, cb.num_layers))
    reuse = saved(shapes.prefill_chunk) if points is not None else None
    if reuse is not None:
        say(f"{label}: fit and HLO analysis from {reuse['fit_source'][:160]}")
    row = C.compile_program(prog, C.Slice(target.topology.chip, len(target.devices), target.hbm), as_run=as_run,
                            counting=points, unrolled=how.method == "unrolled", as_run_row=reuse,
                            opts=dataclasses.replace(opts, count_if_unfit=last_try))
    declared = ep_kernel_row(prog, how.program, weights, shapes, target.mesh)
    if declared:
        row["ep_kernel"] = declared
        if "estimate" in row:            # the HLO-op bytes with the kernels' declared bytes (`compile.estimates`)
            row["estimate"] = C.estimates(row, target.topology.chip, len(target.devices))
    say(f"{label}: {summary_line(row)}")
    return row


def ep_kernel_row(prog: PR.Program, config: ModelConfig, weights: str, shapes: I.Shapes, mesh) -> dict | None:
    """With the Mosaic kernels as the EP local matmul (`ExpertParallel.local == "pallas_tpu"`): the bytes
    their BlockSpecs declare per chip for this program (`kernel_hook.ep_local_declared`), next to XLA's.
    Tokens per chip = batch × the program's tokens per sequence / the data axis (the EP shard_map gathers
    the tokens over the axes that split the experts); a round adds its drafter's MoE passes
    (`programs.Program.drafter_moe`: the passes its bound counts)."""
    ep = config.backends.ep
    if ep is None or ep.local != "pallas_tpu" or weights not in KERNEL_FORMAT:
        return None
    dims = local_expert_dims(prog.args[0])
    if dims is None:
        return None
    data = dict(zip(mesh.axis_names, mesh.devices.shape)).get("data", 1)
    calls = (("target", prog.tokens_per_sequence, config.num_layers),) + prog.drafter_moe
    parts = [dict(ep_local_declared(weights, max(1, shapes.batch * t // data), dims, config.num_experts_per_tok, n,
                                    config.swiglu_limit), name=name) for name, t, n in calls if n > 0]
    out = dict(parts[0])
    if len(parts) > 1:
        out.update(declared_bytes=sum(x["declared_bytes"] for x in parts),
                   ideal_bytes=sum(x["ideal_bytes"] for x in parts), calls=parts)
    return out


def compile_prefill(compile_one: Callable[..., dict], shapes: I.Shapes, min_chunk: int) -> dict:
    """The prefill chunk: when it does not fit, halve the chunk (down to `min_chunk` tokens per sequence) and
    compile again; the row is the largest chunk that fits, with every attempt listed. compile_one(shapes,
    last_try) may skip the costs of a chunk that does not fit when a smaller one follows."""
    attempts, sh = [], shapes
    while True:
        row = compile_one(sh, sh.prefill_chunk // 2 < min_chunk)
        attempts.append({"prefill_chunk": sh.prefill_chunk, "fits": row.get("fits"),
                         "required_bytes": row.get("required_bytes"), "reason": row.get("reason")})
        out_of_memory = row.get("fits") is False and row.get("required_bytes") is not None   # not args alone
        if not out_of_memory or sh.prefill_chunk // 2 < min_chunk:
            break
        sh = dataclasses.replace(sh, prefill_chunk=sh.prefill_chunk // 2)
    if len(attempts) > 1:
        row["attempts"] = attempts
        tried = ", ".join(f"{a['prefill_chunk']}: " + ("fits" if a["fits"] else
                          f"needs {a['required_bytes'] / chips.GIB:.1f} GiB" if a["required_bytes"] else "no")
                          for a in attempts)
        row["notes"] = (row.get("notes", "") + f" prefill chunks tried (tokens per sequence): {tried}").strip()
    return row


def summary_line(row: dict) -> str:
    if not row.get("compiled"):
        return f"not compiled — fits={row.get('fits')}: {row.get('reason', '')[:200]}"
    m, c, e = row["memory"], row["cost"], row["estimate"]
    g = chips.GIB
    unrolled = f"; unrolled {row['memory_unrolled']['peak'] / g:.2f}" if "memory_unrolled" in row else ""
    as_run = f"as run in {row['as_run_compile_s']:.0f} s, unrolled " if "as_run_compile_s" in row else ""
    counted = f", costs {row.get('cost_method')}" + (f" from {'+'.join(str(p['layers']) for p in row['cost_points'])}"
                                                    f"-layer compiles in {row['count_compile_s']:.0f} s"
                                                    if "cost_points" in row else "")
    return (f"compiled ({as_run}in {row['compile_s']:.0f} s, lower {row['lower_s']:.0f} s{counted}); peak "
            f"{m['peak'] / g:.2f} GiB/chip (args {m['argument'] / g:.2f}, temp {m['temp'] / g:.2f}{unrolled}) "
            f"{'fits' if row['fits'] else 'DOES NOT FIT'}; "
            f"{c['flops'] / 1e12:.3g} TFLOP, XLA {c['bytes_accessed'] / 1e9:.3g} GB, HLO ops "
            f"{row['hlo']['top_ops']['total_bytes'] / 1e9:.3g} GB, bound "
            f"{e.get('bound_per_chip_bytes', 0) / 1e9:.3g} GB per chip; roofline {e['roofline_s'] * 1e3:.3g} ms"
            + (f", latency roofline {e['latency_roofline_s'] * 1e3:.3g} ms ({e['latency_counts']['ops']} ops)"
               if "latency_roofline_s" in e else "") + "; "
            f"{row['hlo']['collectives']['count']} collectives")
