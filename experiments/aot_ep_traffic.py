"""Per-chip memory traffic of Flash decode / verify on an 8-chip TPU slice, GSPMD vs explicit expert parallelism.

Compiled ahead of time on this CPU machine for `--topology` (default v5p:2x2x2) with libtpu; nothing runs.
For each placement variant and each program (decode at B = 1 and 8, a verify block of 6 tokens at B = 8, all
at `--context` committed tokens), `decode.process_block` of full `flash()` in bf16 is lowered with abstract
sharded parameters and decode state, the layer scans unrolled (`Backends.unroll_layers`: XLA's cost
analysis counts a `while` body once), and compiled. Reported per chip:

    xla_bytes    `cost_analysis()["bytes accessed"]` of the per-device SPMD program, default compile
    xla_bytes_nomsa  the same compiled with XLA's VMEM memory-space assignment off (v5p:
                 `xla_vf_vmem_memory_space_assignment=False`): the default compile prefetches weights into
                 on-chip VMEM with copy-start/copy-done pairs, and the cost model counts such a weight three
                 times (HBM read, VMEM write, the consumer's VMEM read) although HBM is read once; without
                 the prefetches every operand is counted once where it is read, the closer HBM-traffic figure
    bound        the ideal split: what the step must read (`dsv4_jax.analysis.traffic.per_chip_bounds` in the --weights format:
                 weights with E·(1 − (1 − k/E)^T) distinct active experts per layer under uniform routing,
                 the head whole, embedding rows, + the cache rows of every sequence) / chips
    bound_bal    the same with min(E, T·k) active experts (balanced routing: the most a dropless static
                 program can be asked to skip; the two agree at B = 1)
    ratio        xla_bytes / bound (and / bound_bal)
    collectives  every all-gather / all-reduce / reduce-scatter / all-to-all / collective-permute of the
                 compiled HLO with its result bytes, grouped by (op, shape), and per layer
    memory       argument / temp / output bytes per chip (fits: ≤ the chip's HBM)

Variants (`--variants`, comma list): the placements of `dsv4_jax.analysis.placements.VARIANTS`.

    JAX_PLATFORMS=cpu TPU_SKIP_MDS_QUERY=1 TPU_WORKER_HOSTNAMES=localhost ALLOW_MULTIPLE_LIBTPU_LOAD=1 \\
        .venv/bin/python experiments/aot_ep_traffic.py --out experiments/results/aot_ep_traffic_DATE

writes OUT.json (every number) and OUT.md (the tables); each compile is also appended to OUT.partial.jsonl
as it finishes, so a long run can be resumed (`--resume`) or read while it runs.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import gzip
import json
import math
import os
import platform
import re
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from dsv4_jax import parallel  # noqa: E402
from dsv4_jax.analysis import libtpu, memplan  # noqa: E402
from dsv4_jax.analysis.placements import VARIANTS  # noqa: E402
from dsv4_jax.analysis.traffic import per_chip_bounds  # noqa: E402
from dsv4_jax.model import params as P  # noqa: E402
from dsv4_jax.ops import quant  # noqa: E402
from dsv4_jax.backends import REFERENCE, ExpertParallel, resolve  # noqa: E402
from dsv4_jax.model.state import state_shapes  # noqa: E402
from dsv4_jax.config import flash, with_pairs  # noqa: E402
from dsv4_jax.model.decode import process_block  # noqa: E402

GIB = 1024 ** 3
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
               "ragged-all-to-all")
# compiler options that switch VMEM memory-space assignment off, per topology family
NO_VMEM_MSA = {"v5p": {"xla_vf_vmem_memory_space_assignment": False}}
PROGRAMS = {"decode_b1": (1, 1), "decode_b8": (8, 1), "verify6_b8": (8, 6)}   # name: (batch, block tokens)
_DTYPE_BYTES = {"bf16": 2, "f32": 4, "s32": 4, "u32": 4, "f16": 2, "s8": 1, "u8": 1, "pred": 1, "s64": 8,
                "u64": 8, "f64": 8, "f8e4m3fn": 1}


# weight storage (`dsv4_jax.analysis.traffic` format names): formats rule for `params.with_formats` (None: all dense)
FP8_EXPERTS = quant.QFormat("e4m3", (128, 128), "f32")     # random_init's expert_format="fp8"
WEIGHTS = {
    "bf16": None,
    "fp8-experts": lambda path, spec: FP8_EXPERTS if memplan.part_of(path, spec) == "routed experts" else None,
    "release": P.release_format,
}


def topology_devices(name: str):
    try:
        return libtpu.topology_desc(name).devices
    except libtpu.LibtpuMissing as e:
        raise SystemExit(str(e))


def variant_setup(name: str, config, devices):
    """(config with backends, mesh, rules dict or None) of a placement variant."""
    shape, rules, moe = VARIANTS[name]
    base = REFERENCE.replace(unroll_layers=True)
    if isinstance(shape, str):
        pre = parallel.preset(shape)
        if rules:
            pre = dataclasses.replace(pre, rules=ExpertParallel.freeze_rules({**pre.rules_dict, **rules}))
        mesh = pre.make_mesh(devices)
        return config.with_backends(pre.backends(mesh, base)), mesh, pre.rules_dict
    mesh = parallel.make_mesh(shape, devices)
    if moe == "ep":
        b = resolve(base.replace(moe="ep", ep=ExpertParallel(mesh, ExpertParallel.freeze_rules(rules), "auto")),
                    "tpu")
        return config.with_backends(b), mesh, rules
    return config.with_backends(base), mesh, rules


def _placed(mesh, a, s):
    """A ShapeDtypeStruct (or QArray of them) with the NamedSharding(s) of PartitionSpec(s) s."""
    sds = lambda x, ps: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, ps))
    if isinstance(a, quant.QArray):
        return quant.QArray(sds(a.codes, s.codes), sds(a.scale, s.scale), a.fmt, a.dtype)
    return sds(a, s)


def capacity(context: int, block: int, multiple: int = 1) -> int:
    """The decode state's max_len: context + block rounded up to a multiple of `multiple` tokens."""
    return -(-(context + block) // multiple) * multiple


def abstract_inputs(config, mesh, rules, batch: int, block: int, context: int, dtype, formats=None,
                    capacity_multiple: int = 1):
    """ShapeDtypeStructs with shardings: params (QArrays where `formats` quantizes), state (max_len =
    `capacity(context, block, capacity_multiple)`), tokens, n_valid."""
    specs = parallel.param_partition_specs(config, mesh, rules, formats=formats)
    shapes = P.abstract_params(config, dtype, formats)
    params = jax.tree.map(lambda a, s: _placed(mesh, a, s), shapes, specs, is_leaf=quant.is_qarray)
    st = state_shapes(config, batch, capacity(context, block, capacity_multiple), block, dtype)
    st_specs = parallel.state_partition_specs(st, mesh, rules)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)),
                         st, st_specs, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    tok_spec = parallel.partition_spec((batch, block), ("batch", None), parallel.mesh_sizes(mesh), rules)
    tokens = jax.ShapeDtypeStruct((batch, block), jnp.int32, sharding=NamedSharding(mesh, tok_spec))
    n_valid = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec()))
    return params, state, tokens, n_valid


def _shape_bytes(text: str) -> int:
    """Bytes of an HLO result type such as 'bf16[8,4096]{1,0}' or a tuple of them."""
    total = 0
    for dt, dims in re.findall(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]", text):
        if dt in _DTYPE_BYTES:
            total += _DTYPE_BYTES[dt] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def collectives(hlo: str) -> list[dict]:
    """[{op, shape, bytes, count}] of the collectives in compiled HLO text (async pairs counted once)."""
    found = collections.Counter()
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT\s+)?%[\w.\-]+\s*=\s*(.+?)\s+([\w\-]+)\(", line)
        if not m:
            continue
        rtype, op = m.group(1), m.group(2)
        base = op.removesuffix("-start")
        if base not in COLLECTIVES or op.endswith("-done"):
            continue
        if op.endswith("-start") and rtype.startswith("("):     # async: (operands..., results...) — keep results
            parts = re.findall(r"[a-z0-9]+\[[0-9,]*\]", rtype)
            rtype = " ".join(parts[len(parts) // 2:]) if len(parts) > 1 else rtype
        shape = " ".join(re.findall(r"[a-z0-9]+\[[0-9,]*\]", rtype))
        found[(base, shape)] += 1
    return [{"op": op, "shape": shape, "bytes": _shape_bytes(shape), "count": n}
            for (op, shape), n in sorted(found.items(), key=lambda kv: -_shape_bytes(kv[0][1]) * kv[1])]


def _cost(compiled) -> dict:
    cost = compiled.cost_analysis()
    return cost[0] if isinstance(cost, list) else cost


_INSTR = re.compile(r"\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([\w\-]+)\((.*?)\)(.*)$")
_SKIP = ("parameter", "constant", "get-tuple-element", "bitcast", "tuple", "after-all", "partition-id")


def _computations(hlo: str) -> tuple[dict, str]:
    """{computation name: [(name, result type, opcode, operands, rest)]}, entry name."""
    comps, cur = {}, None
    for line in hlo.splitlines():
        m = re.match(r"^(?:ENTRY )?%([\w.\-]+) \(.*\{$", line)
        if m:
            cur = comps.setdefault(m.group(1), [])
        elif line.startswith("}"):
            cur = None
        elif cur is not None and (mm := _INSTR.match(line)):
            cur.append(mm.groups())
    return comps, re.search(r"^ENTRY %([\w.\-]+)", hlo, re.M).group(1)


def _fusion_bytes(body: list, operand_types: list[str], result_type: str) -> int:
    """Bytes a fusion reads and writes: each parameter whole, or only its (dynamic-)slices when that is all its
    users do; a fusion rooted in an in-place dynamic-update-slice of a parameter writes only the update and
    does not read the buffer."""
    params = {name: int(re.match(r"\s*(\d+)", ops).group(1)) for name, _, op, ops, _ in body if op == "parameter"}
    root = body[-1] if body else None
    written = _shape_bytes(result_type)
    in_place = None
    if root is not None and root[2] == "dynamic-update-slice":
        ops = re.findall(r"%([\w.\-]+)", root[3])
        types = {name: rt for name, rt, *_ in body}
        if ops and ops[0] in params:
            in_place, written = ops[0], _shape_bytes(types.get(ops[1], ""))
    users = collections.defaultdict(list)
    for _, rt, op, ops, _ in body:
        for o in re.findall(r"%([\w.\-]+)", ops):
            if o in params:
                users[o].append((op, rt))
    total = written
    for p, n in params.items():
        if p == in_place:
            continue
        full = _shape_bytes(operand_types[n]) if n < len(operand_types) else 0
        us = users[p]
        total += min(full, sum(_shape_bytes(rt) for _, rt in us)) if us and all(
            op in ("slice", "dynamic-slice") for op, _ in us) else full
    return total


def breakdown(hlo: str) -> dict:
    """Estimated bytes per category of the entry computation's ops (operands read + results written, fusion
    parameters read only through slices counted as those slices — the cost model's rule, approximately):
    {"categories": {name: bytes}, "estimate": total, "top": [(bytes, op, result type, op_name)]}."""
    comps, entry = _computations(hlo)
    types = {name: rt for body in comps.values() for name, rt, *_ in body}
    cats, top = collections.Counter(), []
    for name, rt, op, operands, rest in comps[entry]:
        if op in _SKIP:
            continue
        otypes = [types.get(o, "") for o in re.findall(r"%([\w.\-]+)", operands)]
        calls = re.search(r"calls=%([\w.\-]+)", rest)
        if op == "fusion" and calls and calls.group(1) in comps:
            read, wrote = _fusion_bytes(comps[calls.group(1)], otypes, rt), 0
        elif op == "dynamic-update-slice":
            read, wrote = 0, 2 * _shape_bytes(otypes[1]) if len(otypes) > 1 else 0
        else:
            read = sum(_shape_bytes(t) for t in otypes)
            wrote = 0 if op.endswith("-done") else _shape_bytes(rt)
        meta = re.search(r'op_name="([^"]*)"', rest)
        op_name = meta.group(1) if meta else ""
        if "shard_map" in op_name:
            cat = "routed + shared experts (shard_map)"
        elif "dynamic_update_index_in_dim" in op_name or "dynamic_index_in_dim" in op_name or \
                op_name.startswith("state."):
            cat = "decode state in/out of the layer loop (slabs)"
        elif op.startswith("copy-"):
            cat = "VMEM prefetch copies"
        elif op.removesuffix("-start") in COLLECTIVES:
            cat = "collectives"
        else:
            last = op_name.split("/")[-1] if op_name else op
            cat = {"dot_general": "matmuls outside the MoE (attention, head, router)", "scatter": "scatters (cache writes)",
                   "gather": "gathers (cache rows, embedding)"}.get(last, "other")
        cats[cat] += read + wrote
        top.append((read + wrote, op, rt[:60], op_name[:100]))
    top.sort(key=lambda t: -t[0])
    return {"categories": dict(cats.most_common()), "estimate": sum(cats.values()), "top": top[:12]}


def _stats(compiled, seconds: float, suffix: str) -> dict:
    """Cost-analysis bytes, compile time and HLO breakdown of one compile (keys with `suffix`), plus flops,
    memory and collectives (the same for both compiles: the partitioned program is the same)."""
    cost = _cost(compiled)
    mem = compiled.memory_analysis()
    hlo = compiled.as_text()
    coll = collectives(hlo)
    return {f"xla_bytes{suffix}": float(cost.get("bytes accessed", float("nan"))),
            f"compile{suffix}_s": round(seconds, 1), f"breakdown{suffix}": breakdown(hlo),
            "flops": float(cost.get("flops", 0.0)), "optimal_seconds": float(cost.get("optimal_seconds", float("nan"))),
            "argument_bytes": int(mem.argument_size_in_bytes), "temp_bytes": int(mem.temp_size_in_bytes),
            "output_bytes": int(mem.output_size_in_bytes), "collectives": coll,
            "collective_bytes": sum(c["bytes"] * c["count"] for c in coll), "hlo_lines": hlo.count("\n"),
            "while_loops": len(re.findall(r"\swhile\(", hlo)), "vmem_prefetches": hlo.count(" copy-start(")}, hlo


def compile_one(config, mesh, rules, batch, block, context, dtype, no_msa: dict | None, hlo_path: str | None = None,
                formats=None, default: bool = True, capacity_multiple: int = 1) -> dict:
    """Lower once; compile with the default options (`default`) and / or with `no_msa` (VMEM prefetching off)."""
    args = abstract_inputs(config, mesh, rules, batch, block, context, dtype, formats, capacity_multiple)
    t0 = time.perf_counter()
    lowered = process_block.lower(args[0], config, *args[1:])
    out = {"lower_s": round(time.perf_counter() - t0, 1), "xla_bytes": float("nan"), "compile_s": 0.0}
    if default:
        t1 = time.perf_counter()
        compiled = lowered.compile()
        stats, _ = _stats(compiled, time.perf_counter() - t1, "")
        out.update(stats)
        del compiled
    if no_msa:
        t1 = time.perf_counter()
        compiled = lowered.compile(compiler_options=no_msa)
        stats, text = _stats(compiled, time.perf_counter() - t1, "_nomsa")
        out.update({k: v for k, v in stats.items() if k.endswith("_nomsa") or k.endswith("_nomsa_s") or not default})
        if hlo_path:
            with gzip.open(hlo_path, "wt") as f:
                f.write(text)
    return out


def per_layer(coll: list[dict], n_layers: int) -> list[dict]:
    """Collectives that occur a multiple of n_layers times, as (op, shape, bytes, per layer)."""
    return [dict(c, per_layer=c["count"] / n_layers) for c in coll if c["count"] >= n_layers]


def markdown(out: dict) -> str:
    L = [f"# Per-chip traffic, GSPMD vs explicit expert parallelism ({out['topology']}, {out['model']}, {out.get('weights', 'bf16')} weights, "
         f"context {out['context']})", "",
         f"{out['date']}, {out['machine']}; `{out['command']}`", "",
         "XLA bytes = `cost_analysis()['bytes accessed']` of the per-chip program (layer scans unrolled); "
         "bound = what the step must read / chips (uniform routing: E(1-(1-k/E)^T) active experts); "
         "bound_bal = with min(E, T·k) active experts (balanced routing).", "",
         "| variant | program | mesh | XLA GiB/chip | no-prefetch GiB/chip | bound GiB | ratio | ratio no-prefetch | "
         "bound_bal GiB | ratio_bal no-prefetch | collective MiB | TFLOP | args GiB | temp GiB | compile s |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in out["rows"]:
        if "error" in r:
            L.append(f"| {r['variant']} | {r['program']} | {r.get('mesh', '')} | error: {r['error'][:80]} |"
                     + " |" * 11)
            continue
        nomsa = r.get("xla_bytes_nomsa", float("nan"))
        L.append(f"| {r['variant']} | {r['program']} | {r['mesh']} | {r['xla_bytes'] / GIB:.2f} | {nomsa / GIB:.2f} | "
                 f"{r['bound'] / GIB:.3f} | {r['xla_bytes'] / r['bound']:.2f} | {nomsa / r['bound']:.2f} | "
                 f"{r['bound_bal'] / GIB:.3f} | {nomsa / r['bound_bal']:.2f} | {r['collective_bytes'] / 2 ** 20:.1f} | "
                 f"{r['flops'] / 1e12:.2f} | {r['argument_bytes'] / GIB:.1f} | {r['temp_bytes'] / GIB:.2f} | "
                 f"{r['compile_s']:.0f} |")
    L += ["", "## Where the bytes go (estimated from the compiled HLO, no-prefetch compile; GiB per chip)", "",
          "Per category: operands read + results written of each top-level op, a fusion parameter read only "
          "through slices counted as those slices (approximately XLA's rule; `estimate` vs XLA's total shows "
          "how close).", ""]
    for r in out["rows"]:
        bd = r.get("breakdown_nomsa") or r.get("breakdown")
        if "error" in r or not bd:
            continue
        parts = ", ".join(f"{k} {v / GIB:.2f}" for k, v in bd["categories"].items() if v >= 0.01 * GIB)
        L.append(f"- **{r['variant']} / {r['program']}**: estimate {bd['estimate'] / GIB:.2f} "
                 f"(XLA {r.get('xla_bytes_nomsa', r['xla_bytes']) / GIB:.2f}): {parts}")
    L += ["", "## Collectives per layer (ops occurring at least once per layer)", ""]
    for r in out["rows"]:
        if "error" in r:
            continue
        L.append(f"**{r['variant']} / {r['program']}** ({r['n_layers']} layers): " + (", ".join(
            f"{c['op']} {c['shape']} {c['bytes'] / 1024:.1f} KiB ×{c['per_layer']:g}/layer"
            for c in r["per_layer"]) or "none"))
        L.append("")
    return "\n".join(L)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topology", default="v5p:2x2x2")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--programs", default=",".join(PROGRAMS))
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--weights", choices=tuple(WEIGHTS), default="bf16",
                    help="weight storage: bf16 everywhere, FP8 routed experts (float32 scale per 128x128 block), "
                         "or the release format (FP4 experts, FP8 attention / shared expert); the bound uses "
                         "the same format (dsv4_jax.analysis.traffic)")
    ap.add_argument("--pairs", type=int, default=None,
                    help="Flash with 3 + 2·PAIRS layers instead of all 43 (quick checks)")
    ap.add_argument("--out", required=True, help="output path prefix (writes PREFIX.json, PREFIX.md)")
    ap.add_argument("--resume", action="store_true", help="skip (variant, program) pairs in PREFIX.partial.jsonl")
    ap.add_argument("--hlo-dir", default=None, help="also write each no-prefetch compiled HLO here (gzip)")
    ap.add_argument("--only-nomsa", action="store_true",
                    help="compile only with VMEM prefetching off (half the compile time; no default-compile bytes)")
    ap.add_argument("--no-nomsa", default="", metavar="VARIANTS",
                    help="variants (comma list, or 'all') that skip the second compile with VMEM prefetching off")
    ap.add_argument("--capacity-multiple", type=int, default=1, metavar="N",
                    help="decode state capacity (max_len) = context + block rounded up to a multiple of N tokens "
                         "(default 1: exactly context + block; 1024 gives compressed tables with a multiple of 8 "
                         "rows, which v5p lays out without the copies an odd row count costs)")
    a = ap.parse_args(argv)
    devices = topology_devices(a.topology)
    no_msa = NO_VMEM_MSA.get(a.topology.split(":")[0])
    skip_nomsa = set(a.no_nomsa.split(",")) if a.no_nomsa != "all" else set(VARIANTS)
    chips = len(devices)
    config = flash() if a.pairs is None else with_pairs(flash(), a.pairs)
    partial = a.out + ".partial.jsonl"
    done = {}
    if a.resume and os.path.exists(partial):
        for line in open(partial):
            r = json.loads(line)
            done[(r["variant"], r["program"])] = r
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    if a.hlo_dir:
        os.makedirs(a.hlo_dir, exist_ok=True)
    rows = []
    for vname in a.variants.split(","):
        cfg, mesh, rules = variant_setup(vname, config, devices)
        for pname in a.programs.split(","):
            if (vname, pname) in done:
                rows.append(done[(vname, pname)])
                continue
            batch, block = PROGRAMS[pname]
            row = {"variant": vname, "program": pname, "batch": batch, "block": block,
                   "mesh": "x".join(str(n) for n in mesh.devices.shape), "backends": cfg.backends.describe(),
                   "n_layers": config.num_layers, "weights": a.weights}
            print(f"[{time.strftime('%H:%M:%S')}] {vname} {pname} ...", flush=True)
            try:
                row.update(compile_one(cfg, mesh, rules, batch, block, a.context, jnp.bfloat16,
                                       None if vname in skip_nomsa else no_msa,
                                       os.path.join(a.hlo_dir, f"{vname}_{pname}.hlo.gz") if a.hlo_dir else None,
                                       WEIGHTS[a.weights], default=not a.only_nomsa,
                                       capacity_multiple=a.capacity_multiple))
                row["max_len"] = capacity(a.context, block, a.capacity_multiple)
                row.update(per_chip_bounds(config, a.weights, batch, block, a.context, chips))
                row["per_layer"] = per_layer(row["collectives"], config.num_layers)
                nomsa = row.get("xla_bytes_nomsa", float("nan"))
                print(f"    {row['xla_bytes'] / GIB:.2f} GiB/chip ({nomsa / GIB:.2f} without VMEM prefetch) vs bound "
                      f"{row['bound'] / GIB:.3f} ({row['xla_bytes'] / row['bound']:.2f}x / "
                      f"{nomsa / row['bound']:.2f}x; balanced {row['xla_bytes'] / row['bound_bal']:.2f}x / "
                      f"{nomsa / row['bound_bal']:.2f}x), compile {row['compile_s']} + {row.get('compile_nomsa_s', 0)} s", flush=True)
            except Exception as e:  # noqa: BLE001 - record and continue with the next program
                row["error"] = f"{type(e).__name__}: {e}"[:2000]
                print("    ERROR", row["error"][:500], flush=True)
            rows.append(row)
            with open(partial, "a") as f:
                f.write(json.dumps(row) + "\n")
    out = {"date": datetime.date.today().isoformat(), "machine": f"{platform.node()} ({os.cpu_count()} CPUs), "
           f"jax {jax.__version__}, libtpu AOT", "command": " ".join(["python", "experiments/aot_ep_traffic.py"]
                                                                   + (argv if argv is not None else sys.argv[1:])),
           "topology": a.topology, "chips": chips, "model": config.name, "context": a.context, "weights": a.weights,
           "rows": rows}
    with open(a.out + ".json", "w") as f:
        json.dump(out, f, indent=1)
    with open(a.out + ".md", "w") as f:
        f.write(markdown(out) + "\n")
    print(markdown(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
