"""Ahead-of-time compile of the Pallas TPU kernels for a TPU topology, on a machine without a TPU.

libtpu (a PyPI wheel) compiles for an abstract topology (`jax.experimental.topologies`); a kernel program is
lowered on ShapeDtypeStructs placed on the topology's first chip (the kernels are single-chip programs),
compiled by XLA + Mosaic, and read back: compile time, `memory_analysis()` (argument / output / temp bytes
per chip) and `cost_analysis()`. Mosaic is the real check of the TPU tiling rules that interpret mode
ignores. Next to it:

- `blockspec_bytes`: the bytes the kernels' BlockSpecs move for a concrete routing / cache fill, counted
  from block shapes × grid steps (`tpu_common.traffic`), per operand;
- `ideal_bytes`: what any implementation must read and write (the active experts' weights once, the
  activations; for the indexer the visible key rows, queries and scores);
- `reference`: the XLA reference (`ops.moe` / `ops.indexer` on the same inputs) compiled for the same
  chip, with its `cost_analysis()` bytes (XLA's estimate, which counts a gather's whole operand for
  some ops and a while body once — read it as XLA's view, not a measurement).

`compile_case(case, topology)` returns one record (a dict, JSON-ready); `run(topology, cases)` all of them.
The `dsv4-aot` report calls these functions; `dsv4-aot kernels` (`main`) is the command line of this table alone:

    dsv4-aot kernels --topology v5p:2x2x1 --topology v6e:2x2 --out experiments/results/tpu_kernels_aot_<date>.json

compile time, per-chip argument / temp bytes, BlockSpec and ideal bytes and the reference's XLA bytes per
topology and case; prints the table, writes JSON (every operand) and Markdown next to it.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from . import libtpu
from ..ops import indexer as ops_indexer
from ..ops import moe as ops_moe
from ..ops import quant
from ..kernels import moe_prefill, tpu_indexer, tpu_moe
from ..kernels import tpu_common as tc


@dataclasses.dataclass(frozen=True)
class Shapes:
    """Model dimensions the kernels see (defaults: DeepSeek-V4-Flash)."""

    n_experts: int = 256
    top_k: int = 6
    hidden: int = 4096
    moe_inter: int = 2048
    index_heads: int = 64
    index_dim: int = 128
    index_topk: int = 512
    swiglu_limit: float = 10.0


FLASH = Shapes()
MOE_FORMATS = ("dense", "int8", "fp8_e4m3_b128", "fp4_e2m1_b32")


@dataclasses.dataclass(frozen=True)
class Case:
    """One kernel program: moe_decode / moe_prefill (fmt, tokens) or indexer_scores / indexer_select
    (batch, queries, rows = compressed key rows, ratio)."""

    kernel: str
    fmt: str = "dense"
    tokens: int = 8
    batch: int = 1
    queries: int = 1
    rows: int = 262144
    ratio: int = 4

    @property
    def name(self) -> str:
        if self.kernel.startswith("moe"):
            return f"{self.kernel} {self.fmt} T={self.tokens}"
        return f"{self.kernel} B={self.batch} S={self.queries} rows={self.rows}"


def default_cases(decode_tokens: int = 8, prefill_tokens: int = 2048) -> list[Case]:
    """Flash decode and prefill-chunk shapes: each MoE format in both kernels, the indexer at 1M context
    (262144 rows of ratio 4) for a decode batch and at a prefill chunk."""
    cases = [Case("moe_decode", f, tokens=decode_tokens) for f in MOE_FORMATS]
    cases += [Case("moe_prefill", f, tokens=prefill_tokens) for f in MOE_FORMATS]
    cases += [Case("indexer_scores", batch=8, queries=1, rows=262144),
              Case("indexer_select", batch=8, queries=1, rows=262144),
              Case("indexer_scores", batch=1, queries=512, rows=8192)]
    return cases


def topology_device(topology: str):
    """The first chip of a libtpu topology ("v5p:2x2x1", "v6e:2x2", ...); `libtpu.LibtpuMissing` without libtpu."""
    return libtpu.topology_desc(topology).devices[0]


# ---- inputs ----


def _sds(shape, dtype, sharding):
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sharding)


def expert_arrays(fmt: str, s: Shapes, sharding):
    """ShapeDtypeStructs (w1, w2, w3, w1_scale, w2_scale, w3_scale) of the routed experts in format fmt."""
    E, D, I = s.n_experts, s.hidden, s.moe_inter
    mats = {"w1": (I, D), "w2": (D, I), "w3": (I, D)}
    if fmt == "dense":
        return [_sds((E, *mats[n]), jnp.bfloat16, sharding) for n in ("w1", "w2", "w3")] + [None] * 3
    codes, scales = [], []
    for n in ("w1", "w2", "w3"):
        N, K = mats[n]
        if fmt == "int8":
            codes.append(_sds((E, N, K), jnp.int8, sharding))
            scales.append(_sds((E, N, 1), jnp.float32, sharding))
        elif fmt == "fp8":
            codes.append(_sds((E, N, K), jnp.float8_e4m3fn, sharding))
            scales.append(_sds((E, N // 128, K // 128), jnp.float32, sharding))
        elif fmt == "fp8_e4m3_b128":
            codes.append(_sds((E, N, K), jnp.uint8, sharding))
            scales.append(_sds((E, N // 128, K // 128), jnp.uint8, sharding))
        elif fmt == "fp4_e2m1_b32":
            codes.append(_sds((E, N, K // 2), jnp.uint8, sharding))
            scales.append(_sds((E, N, K // 32), jnp.uint8, sharding))
        else:
            raise ValueError(f"unknown format {fmt!r}; choose from {tc.FORMATS}")
    return codes + scales


def routing(kind: str, T: int, s: Shapes, seed: int = 0) -> np.ndarray:
    """idx [T, k]: "distinct" (every assignment its own expert, while T·k ≤ E) or "random" (uniform)."""
    if kind == "distinct":
        return (np.arange(T * s.top_k) % s.n_experts).reshape(T, s.top_k).astype(np.int32)
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((T, s.n_experts)), axis=-1)[:, :s.top_k].astype(np.int32)


# ---- the programs ----


def _dequant(fmt: str, codes, scale):
    """Stored kernel-format arrays -> bf16 through `ops.quant` (the XLA reference's dequantization)."""
    if fmt == "dense":
        return codes
    if fmt == "fp8_e4m3_b128":
        qf = quant.FP8
        codes = jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn) if codes.dtype == jnp.uint8 else codes
    elif fmt == "fp4_e2m1_b32":
        qf = quant.FP4
    else:                                            # int8 / fp8 with float32 block scales
        N, K = codes.shape[-2:]
        qf = quant.QFormat("int8" if fmt == "int8" else "e4m3", (N // scale.shape[-2], K // scale.shape[-1]), "f32")
    return quant.dequantize(quant.QArray(codes, scale, qf, jnp.bfloat16), jnp.bfloat16)


def reference_decode(x, idx, w, codes, scales, *, fmt: str, limit: float):
    """XLA reference for few tokens: gather the selected experts' codes, dequantize them, SwiGLU (ops.moe).
    codes (w1, w2, w3) and scales as `kernels.tpu_moe.experts_decode` takes them."""
    (w1, w2, w3), (s1, s2, s3) = codes, scales

    def take(c, sc):
        return _dequant(fmt, c[idx], None if sc is None else sc[idx])       # [T, k, N, K]
    g = jnp.einsum("td,tkid->tki", x, take(w1, s1))
    u = jnp.einsum("td,tkid->tki", x, take(w3, s3))
    y = jnp.einsum("tki,tkdi->tkd", ops_moe.swiglu(g, u, limit).astype(x.dtype), take(w2, s2))
    return ops_moe.combine(y, w, x.dtype)


def reference_prefill(x, idx, w, codes, scales, *, fmt: str, limit: float):
    """XLA reference for many tokens: dequantize every expert, sorted grouped matmul (ops.moe)."""
    (w1, w2, w3), (s1, s2, s3) = codes, scales
    W1, W2, W3 = _dequant(fmt, w1, s1), _dequant(fmt, w2, s2), _dequant(fmt, w3, s3)
    return ops_moe.experts_sorted(x, idx, w, W1, W2, W3, limit)


def reference_scores(q, keys, om, positions, n_rows, *, ratio: int):
    sc = ops_indexer.scores(q, keys, om)
    return jnp.where(ops_indexer.validity(sc.shape, positions, n_rows, ratio), sc, -jnp.inf)


def _programs(case: Case, s: Shapes, sharding):
    """(kernel fn, reference fn, abstract args) of a case."""
    if case.kernel.startswith("moe"):
        T = case.tokens
        args = [_sds((T, s.hidden), jnp.bfloat16, sharding), _sds((T, s.top_k), jnp.int32, sharding),
                _sds((T, s.top_k), jnp.float32, sharding)] + expert_arrays(case.fmt, s, sharding)
        kern = tpu_moe.experts_decode if case.kernel == "moe_decode" else tpu_moe.experts_prefill
        ref = reference_decode if case.kernel == "moe_decode" else reference_prefill
        spec = tpu_moe.Spec(s.swiglu_limit, case.fmt)
        return (lambda x, i, w, *e: kern(x, i, w, e[:3], e[3:], spec)), \
            (lambda x, i, w, *e: ref(x, i, w, e[:3], e[3:], fmt=case.fmt, limit=s.swiglu_limit)), args
    B, S, T, H, dI = case.batch, case.queries, case.rows, s.index_heads, s.index_dim
    args = [_sds((B, S, H, dI), jnp.bfloat16, sharding), _sds((B, T, dI), jnp.bfloat16, sharding),
            _sds((B, S, H), jnp.float32, sharding), _sds((B, S), jnp.int32, sharding),
            _sds((B,), jnp.int32, sharding)]

    def kern(q, k, om, pos, nr):
        sc = tpu_indexer.scores(q, k, om, pos, nr, ratio=case.ratio)
        return ops_indexer.topk(sc, s.index_topk) if case.kernel == "indexer_select" else sc

    def ref(q, k, om, pos, nr):
        sc = reference_scores(q, k, om, pos, nr, ratio=case.ratio)
        return ops_indexer.topk(sc, s.index_topk) if case.kernel == "indexer_select" else sc
    return kern, ref, args


def _compile(fn, args, device):
    """-> (compiled, seconds); the abstract mesh names the chip for Pallas' TPU lowering rules."""
    mesh = jax.sharding.Mesh(np.array([device]), ("chip",))
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        compiled = jax.jit(fn).lower(*args).compile()
    return compiled, time.perf_counter() - t0


def _analysis(compiled) -> dict:
    m = compiled.memory_analysis()
    ca = compiled.cost_analysis()
    ca = (ca[0] if isinstance(ca, (list, tuple)) else ca) or {}
    return {"argument_bytes": int(m.argument_size_in_bytes), "output_bytes": int(m.output_size_in_bytes),
            "temp_bytes": int(m.temp_size_in_bytes), "code_bytes": int(m.generated_code_size_in_bytes),
            "xla_bytes_accessed": float(ca.get("bytes accessed", float("nan"))),
            "xla_flops": float(ca.get("flops", float("nan")))}


def _nbytes(a) -> int:
    return 0 if a is None else int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize


def blockspec_bytes(case: Case, s: Shapes = FLASH) -> dict:
    """Bytes the kernels' BlockSpecs move, per scenario and operand, and the ideal bytes, for a case."""
    if case.kernel.startswith("moe"):
        T, E = case.tokens, s.n_experts
        arrays = expert_arrays(case.fmt, s, None)
        ex = tpu_moe.abstract_experts(*arrays[:3], arrays[3:], case.fmt)
        per_expert = sum(_nbytes(a) for a in arrays) // E
        act = T * s.hidden * 2 * 2                                       # x in, y out (bf16)
        out = {}
        kinds = ("distinct", "random") if case.kernel == "moe_decode" else ("random",)
        for kind in kinds:
            idx = routing(kind, T, s)
            ideal = len(np.unique(idx)) * per_expert + act
            if case.kernel == "moe_decode":
                plan = tpu_moe.decode_plan((T, s.hidden), jnp.bfloat16, idx.shape, ex)
                per_op = tpu_moe.decode_traffic(plan, idx)
            else:
                bM = tpu_moe.row_tile(T * s.top_k, E, jnp.bfloat16)
                M = moe_prefill.padded_rows(T * s.top_k, E, bM)
                plans = tpu_moe.prefill_plans(M, jnp.bfloat16, ex, block_m=bM,
                                              block_n=tpu_moe.PREFILL_BLOCK_N)
                per_op = tpu_moe.prefill_traffic(plans, idx, E, bM)
            out[kind] = {"total": int(sum(per_op.values())), "ideal": int(ideal),
                         "active_experts": int(len(np.unique(idx))), "per_operand": per_op}
        return out
    B, S, T = case.batch, case.queries, case.rows
    H, dI = s.index_heads, s.index_dim
    positions = np.full((B, S), case.ratio * T - 1, np.int32)             # every row visible
    per_op = tpu_indexer.traffic(jax.ShapeDtypeStruct((B, S, H, dI), jnp.bfloat16),
                                 jax.ShapeDtypeStruct((B, T, dI), jnp.bfloat16), positions, np.full((B,), T),
                                 case.ratio)
    ideal = B * T * dI * 2 + B * S * H * (dI * 2 + 4) + B * S * T * 4
    return {"full": {"total": int(sum(per_op.values())), "ideal": int(ideal), "per_operand": per_op}}


def compile_case(case: Case, topology: str, s: Shapes = FLASH, reference: bool = True) -> dict:
    """Lower + compile one case's kernel program (and its XLA reference) for `topology`: a JSON-ready dict."""
    device = topology_device(topology)
    sharding = jax.sharding.SingleDeviceSharding(device)
    kern, ref, args = _programs(case, s, sharding)
    rec = {"case": case.name, **dataclasses.asdict(case), "topology": topology, "device_kind": device.device_kind}
    try:
        compiled, secs = _compile(kern, args, device)
        rec.update(compile_ok=True, compile_s=round(secs, 2), compiled=_analysis(compiled))
    except Exception as e:  # noqa: BLE001 - a failed compile is a result to report
        rec.update(compile_ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:500]}")
    rec["blockspec_bytes"] = blockspec_bytes(case, s)
    if reference:
        try:
            compiled, secs = _compile(ref, args, device)
            rec["reference"] = {"compile_s": round(secs, 2), **_analysis(compiled)}
        except Exception as e:  # noqa: BLE001
            rec["reference"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:500]}"}
    return rec


def run(topology: str, cases: list[Case] | None = None, s: Shapes = FLASH, reference: bool = True,
        log=None) -> list[dict]:
    """compile_case for every case (default `default_cases()`)."""
    out = []
    for case in cases or default_cases():
        rec = compile_case(case, topology, s, reference)
        if log:
            log(rec)
        out.append(rec)
    return out


# ---- the command line (`dsv4-aot kernels`) ----

MiB = 2 ** 20
HEADER = ["topology", "case", "compile", "compile s", "args MiB", "temp MiB", "BlockSpec MiB", "ideal MiB",
          "kernel prog. XLA MiB", "ref XLA MiB", "ref temp MiB", "routing / fill"]


def table_row(rec: dict) -> list[str]:
    """One record as the cells of HEADER (the BlockSpec bytes of its random routing, else its first scenario)."""
    bs = rec["blockspec_bytes"]
    kind = "random" if "random" in bs else next(iter(bs))
    bs = bs[kind]
    k = rec.get("compiled", {})
    ref = rec.get("reference", {})
    return [rec["topology"], rec["case"], "ok" if rec["compile_ok"] else "FAIL",
            f"{rec.get('compile_s', float('nan')):.1f}", f"{k.get('argument_bytes', 0) / MiB:.0f}",
            f"{k.get('temp_bytes', 0) / MiB:.1f}", f"{bs['total'] / MiB:.1f}", f"{bs['ideal'] / MiB:.1f}",
            f"{k.get('xla_bytes_accessed', float('nan')) / MiB:.1f}",
            f"{ref.get('xla_bytes_accessed', float('nan')) / MiB:.1f}", f"{ref.get('temp_bytes', 0) / MiB:.1f}",
            kind]


def markdown(records: list[dict]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(table_row(r)) + " |" for r in records]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dsv4-aot kernels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--topology", action="append", help="libtpu topology name (repeatable); default v5p:2x2x1, "
                                                        "v6e:2x2")
    ap.add_argument("--case", action="append", help="only cases whose name contains this (repeatable)")
    ap.add_argument("--no-reference", action="store_true", help="skip the XLA reference compiles")
    ap.add_argument("--out", help="JSON path (a .md with the table is written next to it)")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[2:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    if not libtpu.available():
        print(f"dsv4-aot kernels: error: {libtpu.HELP}", file=sys.stderr)
        return 2
    libtpu.set_env()
    topologies = args.topology or ["v5p:2x2x1", "v6e:2x2"]
    cases = [c for c in default_cases() if not args.case or any(s in c.name for s in args.case)]
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "host": platform.node(),
            "cpus": os.cpu_count(), "jax": jax.__version__, "libtpu": importlib.metadata.version("libtpu"),
            "command": "dsv4-aot kernels " + " ".join(argv), "shapes": dataclasses.asdict(FLASH)}
    print(json.dumps(meta), flush=True)

    def log(rec):
        print(" | ".join(table_row(rec)) + ("" if rec["compile_ok"] else "  " + rec["error"]), flush=True)

    records = []
    for topo in topologies:
        records += run(topo, cases, reference=not args.no_reference, log=log)
    table = markdown(records)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "records": records}, f, indent=1)
        with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
            f.write(f"# TPU kernels ahead-of-time compile — {meta['date'][:10]}\n\n"
                    f"- command: `{meta['command']}`\n- machine: {meta['host']}, {meta['cpus']} CPUs, no TPU; jax "
                    f"{meta['jax']}, libtpu {meta['libtpu']}\n\n{table}\n")
    return 0 if all(r["compile_ok"] for r in records) else 1
