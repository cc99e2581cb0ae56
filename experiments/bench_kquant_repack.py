"""Error of repacking GGML K- / IQ-quants into a device format (what `dsv4-convert` does by default: Q8_0).

    python experiments/bench_kquant_repack.py [--rows 256] [--cols 4096] [--out experiments/results/kquant_repack_DATE.json]

K- / IQ-quant tensors cannot stay in their own blocks on the device (dsv4_jax has no in-jit decoder for
them), so the converter dequantizes them exactly (gguf-py, float32) and requantizes the values to Q8_0
(int8 per 32 + f16 scale, gguf-py's quantizer = ggml's rounding). This measures, per source type, on
random blocks whose f16 scale fields are set so the values have std 0.02 (a weight-like scale; gguf-py has
no K-quant quantizer, so real blocks cannot be made here): the relative RMS and max error of the repack
against the source's exact values, for Q8_0 and, for comparison, for the FP4 (e2m1 + e8m0 / 32) alternative,
and the bytes per weight of each. Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

from dsv4_jax.io.convert import quant_formats as qf

TYPES = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ2_XXS, T.IQ2_XS, T.IQ3_XXS, T.IQ4_XS, T.Q4_0, T.Q5_0)


def random_blocks(rng, qtype: T, rows: int, cols: int, std: float = 0.02) -> np.ndarray:
    """Random GGML blocks of [rows, cols] with every f16 field that scales the block set so values have ~std."""
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    nb = rows * cols // bs
    raw = rng.integers(0, 256, (nb, ts), dtype=np.uint8)
    fields = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.IQ2_XXS: (0,),
              T.IQ2_XS: (0,), T.IQ3_XXS: (0,), T.IQ4_XS: (0,), T.Q4_0: (0,), T.Q5_0: (0,)}[qtype]

    def set_scale(v):
        for off in fields:
            raw[:, off:off + 2] = np.full((nb, 1), v, np.float16).view(np.uint8)
    set_scale(1.0)
    y = np.asarray(gguf.quants.dequantize(raw.reshape(rows, cols // bs * ts), qtype), np.float32)
    set_scale(np.float16(std / max(float(np.std(y)), 1e-12)))
    return raw.reshape(rows, cols // bs * ts)


def errors(x: np.ndarray, y: np.ndarray) -> dict:
    d = y - x
    return {"rel_rms": float(np.sqrt(np.mean(d ** 2)) / np.sqrt(np.mean(x ** 2))),
            "max_rel_to_tensor_max": float(np.abs(d).max() / np.abs(x).max())}


def fp4_repack(x: np.ndarray) -> np.ndarray:
    """e2m1 codes with an e8m0 scale per 32 (2^⌈log2(amax/6)⌉), dequantized (the release's FP4 expert format)."""
    import ml_dtypes
    b = x.reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(b).max(-1, keepdims=True)
    s = np.ldexp(1.0, np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)).astype(np.int32)).astype(np.float32)
    q = np.clip(b / s, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    return (q * s).reshape(x.shape)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON output path")
    a = ap.parse_args(argv)
    rng = np.random.default_rng(a.seed)
    rows = []
    for qt in TYPES:
        raw = random_blocks(rng, qt, a.rows, a.cols)
        g = qf.ggml_raw(raw, qt)
        x = qf.dequantize(g)
        q, max_rel = qf.repack_q8_0(g)
        bs, ts = gguf.GGML_QUANT_SIZES[qt]
        r = {"type": qt.name, "source_bits_per_weight": 8 * ts / bs,
             "q8_0": dict(errors(x, qf.dequantize(q)), bits_per_weight=8.5),
             "fp4_e2m1_b32": dict(errors(x, fp4_repack(x)), bits_per_weight=4.25)}
        assert abs(r["q8_0"]["max_rel_to_tensor_max"] - max_rel) < 1e-9     # what the converter reports
        rows.append(r)
    print(f"{'type':8} {'src bpw':>7} | {'Q8_0 rel RMS':>12} {'Q8_0 max/max':>12} | {'FP4 rel RMS':>11} {'FP4 max/max':>11}")
    for r in rows:
        print(f"{r['type']:8} {r['source_bits_per_weight']:7.3f} | {r['q8_0']['rel_rms']:12.2e} "
              f"{r['q8_0']['max_rel_to_tensor_max']:12.2e} | {r['fp4_e2m1_b32']['rel_rms']:11.2e} "
              f"{r['fp4_e2m1_b32']['max_rel_to_tensor_max']:11.2e}")
    out = {"date": datetime.date.today().isoformat(), "machine": platform.platform(), "rows": a.rows, "cols": a.cols,
           "seed": a.seed, "command": " ".join(["python", "experiments/bench_kquant_repack.py"] + list(argv or sys.argv[1:])),
           "results": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
