"""The report's "kernels" section: AOT numbers of the Mosaic TPU kernels, from the kernels' own helper.

The helper lives with the kernels (issue 20, Mosaic TPU kernels); this module only calls it. Contract:

    KERNEL_REPORT = "module:function"; function(devices, config, shapes, weights) -> list[dict]

`devices` are the topology's devices, `config` the model config, `shapes` the report's `aot.inputs.Shapes`
(batch, context, draft_n_max, prefill_chunk: decode is 1 token per sequence, verify k+1, prefill the
chunk), `weights` the report's weight format ("bf16" / "fp8"). One dict per compiled kernel case, with
any of: "kernel", "case", "compile_s", "memory" ({argument, output, temp} bytes), "flops", "xla_bytes"
(cost-analysis bytes of the compiled kernel), "blockspec_bytes" (bytes its BlockSpecs move),
"reference_xla_bytes" (the XLA reference path's bytes for the same case), "error". Rendered as given.
"""
from __future__ import annotations

import importlib

KERNEL_REPORT = "dsv4_jax.kernels.tpu_aot:aot_report"
COLUMNS = ("kernel", "case", "compile_s", "flops", "xla_bytes", "blockspec_bytes", "reference_xla_bytes", "error")


def available() -> tuple[bool, str]:
    mod, _, fn = KERNEL_REPORT.partition(":")
    try:
        module = importlib.import_module(mod)
    except ModuleNotFoundError as e:
        if e.name and mod.startswith(e.name):
            return False, f"no Mosaic TPU kernel AOT helper in this build ({KERNEL_REPORT} not found)"
        raise
    if not hasattr(module, fn):
        return False, f"{mod} has no {fn}()"
    return True, KERNEL_REPORT


def kernel_reports(devices, config, shapes, weights: str) -> dict:
    """{"available": bool, "source" or "reason", "rows": [...]} for the kernels section."""
    ok, why = available()
    if not ok:
        return {"available": False, "reason": why, "rows": []}
    mod, _, fn = KERNEL_REPORT.partition(":")
    try:
        rows = getattr(importlib.import_module(mod), fn)(devices, config, shapes, weights)
    except Exception as e:  # noqa: BLE001 - a failing helper is reported, the rest of the report stands
        return {"available": True, "source": why, "rows": [], "error": f"{type(e).__name__}: {str(e)[:400]}"}
    return {"available": True, "source": why, "rows": list(rows)}
