"""The report's "kernels" section: AOT numbers of the Mosaic TPU kernels, from the kernels' own helper.

The helper is `dsv4_jax.analysis.kernels_aot`: `Shapes` (model dimensions the
kernels see), `Case(kernel, fmt, tokens, batch, queries, rows, ratio)` and `compile_case(case, topology, s)`,
which compiles one kernel program (and its XLA reference) on one chip of the topology and returns a record
with "compile_s", "compiled" (argument / output / temp bytes, XLA bytes accessed and flops), "blockspec_bytes"
(per scenario: the bytes its BlockSpecs move, "total", and the "ideal" bytes) and "reference" (the XLA
reference's numbers). This module picks the cases for the report's shapes — the MoE decode kernel at the
decode step's and the verify block's tokens, the grouped prefill kernel at the prefill chunk's, the indexer
at the context — and flattens each record into a row.
"""
from __future__ import annotations

import re

import jax

from .. import kernels_aot as tpu_aot
from ...kernels import tpu_moe
from ...ops import quant

# report weight format -> the kernels' expert storage (`inputs.leaf_format`'s routed experts)
KERNEL_FORMAT = {"bf16": "dense", "fp8": "fp8", "release": "fp4_e2m1_b32"}
COLUMNS = ("kernel", "case", "compile_s", "flops", "temp_bytes", "xla_bytes", "blockspec_bytes", "ideal_bytes",
           "reference_xla_bytes", "reference_temp_bytes", "error")


def cases(aot, config, shapes, weights: str) -> list:
    """The kernel cases of a report: MoE decode (B and B·(k+1) tokens), grouped prefill (B·chunk tokens),
    the indexer at the context for a decode batch and for a prefill chunk."""
    fmt = KERNEL_FORMAT[weights]
    B, rows = shapes.batch, max(1, shapes.context // 4)           # CSA compressed rows (ratio 4)
    return [aot.Case("moe_decode", fmt, tokens=B), aot.Case("moe_decode", fmt, tokens=B * shapes.max_block),
            aot.Case("moe_prefill", fmt, tokens=B * shapes.prefill_chunk),
            aot.Case("indexer_scores", batch=B, queries=1, rows=rows),
            aot.Case("indexer_select", batch=B, queries=1, rows=rows),
            aot.Case("indexer_scores", batch=1, queries=shapes.prefill_chunk, rows=rows)]


def kernel_shapes(aot, config):
    return aot.Shapes(n_experts=config.n_routed_experts, top_k=config.num_experts_per_tok,
                      hidden=config.hidden_size, moe_inter=config.moe_intermediate_size,
                      index_heads=config.index_n_heads, index_dim=config.index_head_dim,
                      index_topk=config.index_topk, swiglu_limit=config.swiglu_limit)


def row(record: dict) -> dict:
    """One kernel record of `compile_case` -> a report row (bytes per chip; BlockSpec bytes of the random-
    routing scenario for MoE, the full cache for the indexer)."""
    out = {"kernel": record.get("kernel"), "case": record.get("case"), "compile_s": record.get("compile_s")}
    c = record.get("compiled") or {}
    out.update(flops=c.get("xla_flops"), temp_bytes=c.get("temp_bytes"), xla_bytes=c.get("xla_bytes_accessed"))
    spec = record.get("blockspec_bytes") or {}
    scenario = spec.get("random") or spec.get("full") or next(iter(spec.values()), {})
    out.update(blockspec_bytes=scenario.get("total"), ideal_bytes=scenario.get("ideal"))
    ref = record.get("reference") or {}
    out.update(reference_xla_bytes=ref.get("xla_bytes_accessed"), reference_temp_bytes=ref.get("temp_bytes"))
    if record.get("error") or ref.get("error"):
        out["error"] = record.get("error") or f"reference: {ref['error']}"
    return {k: v for k, v in out.items() if v is not None}


def kernel_reports(topology: str, config, shapes, weights: str, log=None, aot=tpu_aot) -> dict:
    """{"available": bool, "source" or "reason", "rows": [...]} for the kernels section of one run
    (`aot`: the helper module, `analysis.kernels_aot`)."""
    if weights not in KERNEL_FORMAT:
        return {"available": False, "reason": f"no kernel storage for {weights} weights", "rows": []}
    s, rows = kernel_shapes(aot, config), []
    for case in cases(aot, config, shapes, weights):
        try:
            rows.append(row(aot.compile_case(case, topology, s)))
        except Exception as e:  # noqa: BLE001 - one failing kernel case is reported, the rest stands
            rows.append({"kernel": case.kernel, "case": getattr(case, "name", str(case)),
                         "error": f"{type(e).__name__}: {str(e)[:300]}"})
        if log:
            log(f"kernel {rows[-1].get('case')}: {rows[-1].get('compile_s', '—')} s")
    return {"available": True, "source": aot.__name__, "rows": rows}


# ---- the Mosaic kernels inside an expert-parallel program (`--sharding ... --kernels pallas_tpu`) ----

_ROUTED_W1 = re.compile(r"(^|\.)ffn\.experts\.w1$")


def local_expert_dims(params) -> tuple[int, int, int] | None:
    """(E_loc, I_loc, D) of the routed experts one chip holds: the shard of w1 [.., E, I, D] (a QArray's codes
    [.., E, I, D/2] give E and I), from the first routed layer stack of abstract, placed `params`."""
    for path, x in jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda a: isinstance(a, quant.QArray))[0]:
        flat = ".".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)
        if not _ROUTED_W1.search(flat):
            continue
        a = x.codes if isinstance(x, quant.QArray) else x
        local = a.sharding.shard_shape(a.shape) if getattr(a, "sharding", None) is not None else a.shape
        return int(local[-3]), int(local[-2]), int(x.shape[-1])
    return None


def ep_local_declared(weights: str, tokens: int, dims: tuple[int, int, int], top_k: int, layers: int,
                      swiglu_limit: float = 10.0, aot=tpu_aot) -> dict:
    """What the Mosaic MoE kernels declare (their BlockSpecs' bytes, `kernels_aot.blockspec_bytes`, uniform
    random routing) as the EP program's per-chip local matmul: `tokens` per chip reach the chip's
    dims = (E_loc, I_loc, D) expert slices in each of `layers` routed layers; the decode kernel up to
    `tpu_moe.DECODE_MAX_TOKENS` tokens, the grouped prefill kernels above (`tpu_moe.routed`). Per chip:
    {"kernel", "fmt", "tokens", "dims", "layers", "per_layer_bytes", "declared_bytes", "ideal_bytes"}."""
    fmt = KERNEL_FORMAT[weights]
    kernel = "moe_decode" if tokens <= tpu_moe.DECODE_MAX_TOKENS else "moe_prefill"
    E, I, D = dims
    s = aot.Shapes(n_experts=E, top_k=top_k, hidden=D, moe_inter=I, swiglu_limit=swiglu_limit)
    b = aot.blockspec_bytes(aot.Case(kernel, fmt, tokens=tokens), s)["random"]
    return {"kernel": kernel, "fmt": fmt, "tokens": tokens, "dims": list(dims), "layers": layers,
            "per_layer_bytes": b["total"], "declared_bytes": b["total"] * layers,
            "ideal_bytes": b["ideal"] * layers}
