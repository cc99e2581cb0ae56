"""Benchmark the Pallas kernels against their XLA references (issue 10).

MoE experts (SwiGLU FFN of the routed experts: gate/up + down + weighted combine) at decode shapes
(T tokens, k of E experts, D -> I), bf16 and weight-quantized (fp8 128x128 blocks, int8 per channel, FP4 e2m1 + e8m0
per 32 as released; `ops.quant.QArray` leaves):
  kernel_decode (active experts only), kernel_prefill (grouped matmul), ref_gather (gathered einsum,
  ops.moe.experts_gather), ref_ragged (sort + lax.ragged_dot, ops.moe.experts_sorted).
Lightning indexer (scores + validity + top-k) over R compressed rows (context = 4R), H heads x dI:
  kernel (Pallas scores + two-stage top-k), ref (ops.indexer.scores + validity + select_topk), and
  ref_topk_only (lax.top_k over R rows alone).

Each case also checks the kernel against the reference (max abs error). The bandwidth bound is
bytes that must be read / measured device bandwidth (a large elementwise copy, read+write).

  python experiments/bench_kernels.py --small              # CPU, interpret mode, reduced sizes
  python experiments/bench_kernels.py --out results.json   # GPU, DeepSeek-V4-Flash shapes
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
import warnings

import jax
import jax.numpy as jnp

from dsv4_jax.kernels import lightning_indexer as li
from dsv4_jax.kernels import moe_decode, moe_prefill
from dsv4_jax.ops import indexer as ops_indexer
from dsv4_jax.ops import moe as ops_moe
from dsv4_jax.ops import quant


def _dense_experts(path, limit=10.0):
    """A jitted reference expert path (ops.moe) on dense or QArray experts (dequantized inside the path)."""
    def run(x, i, w, pp):
        return path(x, i, w, pp["w1"], pp["w2"], pp["w3"], limit)
    return jax.jit(run)


def timeit(fn, *args, iters: int) -> float:
    """Median wall time in µs of fn(*args) (compiled, after warm-up), each call waited for: includes the
    host's dispatch of the call (a few µs to tens of µs), see `timeit_pipelined`."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append((time.perf_counter() - t) * 1e6)
    return statistics.median(ts)


def timeit_pipelined(fn, *args, iters: int) -> float:
    """µs per call of `iters` calls dispatched back to back with one wait at the end (best of 3): the
    device time per call once the host's dispatch overlaps the previous call (call after warm-up)."""
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        outs = [fn(*args) for _ in range(iters)]
        jax.block_until_ready(outs)
        best = min(best, (time.perf_counter() - t) * 1e6 / iters)
        del outs
    return best


def measure_bandwidth(nbytes: int, iters: int) -> float:
    """Achieved bytes/s of y = x + 1 (read + write) on an nbytes buffer."""
    x = jnp.zeros((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda v: v + 1.0)
    return 2 * nbytes / (timeit(f, x, iters=iters) * 1e-6)


def moe_cases(a, bw):
    E, D, I, k = a.experts, a.hidden, a.inter, a.topk
    key = jax.random.key(0)
    w1 = (jax.random.normal(key, (E, I, D), jnp.float32) * 0.02).astype(jnp.bfloat16)
    p = {"w1": w1, "w3": w1 * 0.5, "w2": jnp.swapaxes(w1, 1, 2)}
    blk = (min(128, I), min(128, D))
    fmts = {"bf16": p}
    for name, fmt in (("fp8_blk128", quant.QFormat("e4m3", blk, "f32")), ("int8_chan", quant.INT8),
                      ("fp4_e2m1_b32", quant.FP4)):
        if a.formats is None or name in a.formats:
            fmts[name] = {n: quant.quantize(m, fmt) for n, m in p.items()}
    interp = jax.default_backend() != "gpu"
    rows = []
    for T in a.tokens:
        x = jax.random.normal(jax.random.key(T), (T, D), jnp.bfloat16)
        idx = jnp.argsort(jax.random.uniform(jax.random.key(T + 1), (T, E)), -1)[:, :k].astype(jnp.int32)
        w = jax.random.uniform(jax.random.key(T + 2), (T, k))
        n_active = int(jnp.unique(idx).shape[0])
        for name, pp in fmts.items():
            if name != "bf16" and T not in a.quant_tokens:
                continue
            # stored bytes of the active experts (QArray: codes + block scales, not the logical dtype)
            wbytes = sum(leaf.nbytes for n in ("w1", "w2", "w3") for leaf in jax.tree.leaves(pp[n])) // E * n_active
            ref_g = _dense_experts(ops_moe.experts_gather)
            ref_r = _dense_experts(ops_moe.experts_sorted)
            want = ref_g(x, idx, w, pp).astype(jnp.float32)
            res = {"bench": "moe", "T": T, "E": E, "k": k, "D": D, "I": I, "weights": name, "active_experts": n_active,
                   "weight_bytes": wbytes, "bound_us": wbytes / bw * 1e6}
            impls = {"ref_gather": lambda: ref_g, "ref_ragged": lambda: ref_r}
            for blocks in a.decode_blocks:
                impls[f"kernel_decode{list(blocks)}"] = lambda b=blocks: jax.jit(
                    lambda x, i, w, pp: moe_decode.experts_decode(x, i, w, pp, limit=10.0, interpret=interp, blocks=b))
            impls["kernel_prefill"] = lambda: jax.jit(
                lambda x, i, w, pp: moe_prefill.experts_prefill(x, i, w, pp, limit=10.0, interpret=interp,
                                                                blocks=tuple(a.prefill_blocks)))
            for iname, make in impls.items():
                try:
                    f = make()
                    err = float(jnp.max(jnp.abs(f(x, idx, w, pp).astype(jnp.float32) - want)))
                    us = timeit(f, x, idx, w, pp, iters=a.iters)
                    up = timeit_pipelined(f, x, idx, w, pp, iters=a.iters)
                    res[iname] = {"us": us, "max_abs_err": err, "bytes_per_s": wbytes / (us * 1e-6),
                                  "x_bound": us / res["bound_us"], "us_pipelined": up,
                                  "x_bound_pipelined": up / res["bound_us"]}
                except Exception as e:  # noqa: BLE001 - a failing variant must not stop the run
                    res[iname] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            for key, sfx in (("us", ""), ("us_pipelined", "_pipelined")):
                kern = {kk: v[key] for kk, v in res.items() if kk.startswith("kernel_decode") and isinstance(v, dict)
                        and key in v}
                if kern:
                    bk = min(kern, key=kern.get)
                    best = kern[bk]
                    res["best_kernel" + sfx] = bk
                    res["best_kernel_us" + sfx] = best
                    res["best_kernel_x_bound" + sfx] = best / res["bound_us"]
                    res["speedup_vs_ref_gather" + sfx] = res["ref_gather"].get(key, float("nan")) / best
                    res["speedup_vs_ref_ragged" + sfx] = res["ref_ragged"].get(key, float("nan")) / best
            rows.append(res)
            print(fmt_moe(res), flush=True)
    return rows


def indexer_cases(a, bw):
    H, d, topk = a.heads, a.head_dim, a.index_topk
    interp = jax.default_backend() != "gpu"
    rows = []
    for R in a.rows:
        for S in a.queries:
            ks = jax.random.split(jax.random.key(R + S), 3)
            q = jax.random.normal(ks[0], (1, S, H, d), jnp.bfloat16)
            keys = jax.random.normal(ks[1], (1, R, d), jnp.bfloat16)
            om = jax.random.normal(ks[2], (1, S, H), jnp.float32)
            pos = jnp.full((1, S), 4 * R - S, jnp.int32) + jnp.arange(S)[None]
            n_rows = jnp.array([R], jnp.int32)

            def ref(q, keys, om, pos):
                sc = ops_indexer.scores(q, keys, om)
                return ops_indexer.select_topk(sc, ops_indexer.validity(sc.shape, pos, n_rows, 4), topk)

            def kern(q, keys, om, pos):
                return ops_indexer.topk_mask(li.scores(q, keys, om, pos, n_rows, ratio=4, interpret=interp,
                                              blocks=tuple(a.index_blocks)), topk, a.topk_chunk)

            def kern_scores(q, keys, om, pos):
                return li.scores(q, keys, om, pos, n_rows, ratio=4, interpret=interp, blocks=tuple(a.index_blocks))

            topk_only = jax.jit(lambda s: jax.lax.top_k(s, topk))
            two_stage = jax.jit(lambda s: ops_indexer.topk(s, topk, a.topk_chunk))
            kb = R * d * 2 + S * H * d * 2
            res = {"bench": "indexer", "rows": R, "context": 4 * R, "queries": S, "heads": H, "head_dim": d,
                   "topk": topk, "key_bytes": kb, "bound_us": kb / bw * 1e6}
            fr, fk = jax.jit(ref), jax.jit(kern)
            with jax.default_matmul_precision("highest"):      # XLA:GPU's default float32 dot is tf32
                want = jax.jit(ref)(q, keys, om, pos)
            mism = int(jnp.sum(want != fk(q, keys, om, pos)))
            scores = jax.jit(kern_scores)(q, keys, om, pos)
            for name, f, args in (("ref", fr, (q, keys, om, pos)), ("kernel", fk, (q, keys, om, pos)),
                                  ("kernel_scores_only", jax.jit(kern_scores), (q, keys, om, pos)),
                                  ("two_stage_topk_only", two_stage, (scores,)),
                                  ("ref_topk_only", topk_only, (scores,))):
                us = timeit(f, *args, iters=a.iters)
                up = timeit_pipelined(f, *args, iters=a.iters)
                res[name] = {"us": us, "us_per_query": us / S, "us_pipelined": up, "us_per_query_pipelined": up / S}
            res["kernel"]["mask_mismatches_vs_ref"] = mism      # vs the reference at float32 "highest"
            res["kernel"]["x_bound"] = res["kernel"]["us"] / res["bound_us"]
            res["speedup_vs_ref"] = res["ref"]["us"] / res["kernel"]["us"]
            rows.append(res)
            print(fmt_idx(res), flush=True)
    return rows


def fmt_moe(r):
    parts = [f"moe T={r['T']:>3} {r['weights']:<10} bound {r['bound_us']:9.1f}us"]
    for kk, v in r.items():
        if isinstance(v, dict):
            parts.append(f"{kk} " + (f"{v['us']:8.1f}us {v['us_pipelined']:8.1f}p (x{v['x_bound_pipelined']:.2f}, "
                                      f"err {v['max_abs_err']:.1e})"
                                      if "us" in v else v["error"][:60]))
    return " | ".join(parts)


def fmt_idx(r):
    return (f"indexer rows={r['rows']:>7} q={r['queries']:>2} bound {r['bound_us']:8.1f}us | "
            + " | ".join(f"{kk} {v['us']:8.1f}us {v['us_pipelined']:8.1f}p ({v['us_per_query_pipelined']:.1f}/q)"
                         for kk, v in r.items()
                         if isinstance(v, dict))
            + f" | mism {r['kernel']['mask_mismatches_vs_ref']} | speedup {r['speedup_vs_ref']:.2f}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="reduced sizes (CPU interpret mode)")
    ap.add_argument("--only", choices=["moe", "indexer"], default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--tokens", type=_ints, default=None, help="MoE token counts T (default 1,8,64; --small 1,8)")
    ap.add_argument("--quant-tokens", type=_ints, default=None,
                    help="T of the weight-quantized MoE cases (default 1,8; --small 1)")
    ap.add_argument("--formats", default=None,
                    help="quantized MoE formats, comma list of fp8_blk128,int8_chan,fp4_e2m1_b32 (default all)")
    ap.add_argument("--rows", type=_ints, default=None,
                    help="indexer compressed rows R, context 4R (default 2048,32768,262144; --small 512,2048)")
    ap.add_argument("--out", default=None, help="write JSON here (and the tables to the same name .md)")
    a = ap.parse_args(argv)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    chosen = {k: getattr(a, k) for k in ("tokens", "quant_tokens", "rows")}
    if a.small:
        a.experts, a.hidden, a.inter, a.topk, a.tokens, a.quant_tokens = 16, 256, 128, 6, [1, 8], [1]
        a.heads, a.head_dim, a.index_topk, a.rows, a.queries = 16, 32, 64, [512, 2048], [1, 4]
        a.decode_blocks, a.prefill_blocks, a.index_blocks, a.topk_chunk = [(16, 64, 16, 64)], (16, 64, 64), (4, 256), 512
        a.iters = a.iters or 3
        bw_bytes = 1 << 26
    else:
        a.experts, a.hidden, a.inter, a.topk, a.tokens, a.quant_tokens = 256, 4096, 2048, 6, [1, 8, 64], [1, 8]
        a.heads, a.head_dim, a.index_topk, a.rows, a.queries = 64, 128, 512, [2048, 32768, 262144], [1, 4]
        a.decode_blocks = [(16, 256, 16, 256), (8, 512, 8, 512), (32, 128, 32, 128)]
        a.prefill_blocks, a.index_blocks, a.topk_chunk = (16, 64, 64), (4, 128), 4096
        a.iters = a.iters or 20
        bw_bytes = 1 << 31
    a.__dict__.update({k: v for k, v in chosen.items() if v is not None})
    a.formats = None if a.formats is None else [f.strip() for f in a.formats.split(",") if f.strip()]
    bw = measure_bandwidth(bw_bytes, a.iters)
    dev = jax.devices()[0]
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "device": str(dev.device_kind),
            "backend": jax.default_backend(), "jax": jax.__version__, "host": platform.node(),
            "command": " ".join(sys.argv), "interpret_mode": jax.default_backend() != "gpu",
            "measured_bandwidth_GBps": bw / 1e9, "small": a.small}
    print(json.dumps(meta), flush=True)
    out = {"meta": meta, "moe": [], "indexer": []}

    def save():      # after each section: a run stopped by a time limit keeps what it measured
        if a.out:
            with open(a.out, "w") as f:
                json.dump(out, f, indent=1)
            with open(a.out.rsplit(".", 1)[0] + ".md", "w") as f:
                f.write(report(out) + "\n")

    if a.only in (None, "moe"):
        out["moe"] = moe_cases(a, bw)
        save()
    if a.only in (None, "indexer"):
        out["indexer"] = indexer_cases(a, bw)
        save()
    return out


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def report(out: dict) -> str:
    """Markdown tables of a run: one row per MoE case and implementation, one per indexer case."""
    m = out["meta"]
    L = [f"# bench_kernels {m['date']}", "", f"device {m['device']} ({m['backend']}), jax {m['jax']}, "
         f"measured copy bandwidth {m['measured_bandwidth_GBps']:.0f} GB/s, interpret mode {m['interpret_mode']}", "",
         f"`{m['command']}`", "", "## MoE experts (µs; x bound = time / (active expert bytes / bandwidth))", "",
         "µs: median of calls each waited for (dispatch included); pipelined: calls dispatched back to back.", "",
         "| T | weights | active experts | bound µs | impl | µs | x bound | µs pipelined | x bound pipelined | max abs err |",
         "|---|---|---|---|---|---|---|---|---|---|"]
    for r in out["moe"]:
        for k, v in r.items():
            if isinstance(v, dict):
                cells = (f"{v['us']:.1f} | {v['x_bound']:.2f} | {v['us_pipelined']:.1f} | {v['x_bound_pipelined']:.2f} | "
                         f"{v['max_abs_err']:.1e}" if "us" in v else f"error: {v['error'][:80]} | | | | ")
                L.append(f"| {r['T']} | {r['weights']} | {r['active_experts']} | {r['bound_us']:.1f} | {k} | {cells} |")
    L += ["", "## Lightning indexer (scores + validity + top-k; µs per call and per query)", "",
          "| rows | context | queries | bound µs | impl | µs | µs / query | µs pipelined | µs / query pipelined |",
          "|---|---|---|---|---|---|---|---|---|"]
    for r in out["indexer"]:
        for k, v in r.items():
            if isinstance(v, dict):
                L.append(f"| {r['rows']} | {r['context']} | {r['queries']} | {r['bound_us']:.1f} | {k} | "
                         f"{v['us']:.1f} | {v['us_per_query']:.1f} | {v['us_pipelined']:.1f} | "
                         f"{v['us_per_query_pipelined']:.1f} |")
        L.append(f"| | | | | mask mismatches vs ref | {r['kernel']['mask_mismatches_vs_ref']} | | | |")
    return "\n".join(L)


if __name__ == "__main__":
    main()
