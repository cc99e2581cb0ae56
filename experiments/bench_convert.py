"""Converter throughput: a synthetic ~1 GB file per format through the converter's streaming path.

    python experiments/bench_convert.py [--mb 1024] [--repeat 3] [--formats fp8,fp4,q8_0,mxfp4,bf16] [--dequant]
        [--dir /tmp/bench_convert] [--json experiments/results/convert_DATE.json]

Per format, in a fresh subprocess (so peak RSS is per format): write a synthetic source file of
tensors of ~64 MB ("layers"), then stream it exactly as dsv4-convert does: memory-mapped read ->
`plan.convert_leaf` (keep codes, or --dequant to bf16) -> one Orbax partial save per tensor ->
finalize, into an atomic output directory, through the converter's own loop (`pipeline.run_job`: a reader
thread repacks the next unit while Orbax writes this one). Before converting, dirty pages are flushed and the
page cache dropped (when permitted: root), so the source is read from disk as in a real conversion
(`cold_source` in the JSON). Reports MB/s of source bytes for the conversion (`convert`), for
reading + repacking alone (`repack`, warm cache, no write), peak RSS and the peak anonymous memory in units
(`--repeat N` converts each source N times and reports the median: this VM's disk varies by ~1.5x run to run).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shutil
import struct
import subprocess
import sys
import time

import numpy as np

TENSOR_MB = 64


def _rows(fmt: str, mb: int, tensor_mb: int = TENSOR_MB) -> tuple[int, int, int]:
    """(n tensors, out rows, in cols) of ~TENSOR_MB-byte tensors (source bytes)."""
    inn = 4096
    per_row = {"fp8": inn, "fp4": inn // 2 + inn // 32, "q8_0": inn // 32 * 34, "mxfp4": inn // 32 * 17,
               "bf16": 2 * inn}[fmt]
    rows = tensor_mb * 2**20 // per_row
    rows -= rows % 128
    return max(1, mb // tensor_mb), rows, inn


def save_safetensors(path: str, tensors: dict) -> None:
    """Raw safetensors writer: {name: (dtype name, array)} (the safetensors package cannot write F8_E8M0)."""
    hdr, off, blobs = {}, 0, []
    for k in sorted(tensors):
        dt, a = tensors[k]
        b = np.ascontiguousarray(a).tobytes()
        hdr[k] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        off += len(b)
        blobs.append(b)
    h = json.dumps(hdr).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def write_source(fmt: str, mb: int, d: str, tensor_mb: int = TENSOR_MB) -> str:
    n, rows, inn = _rows(fmt, mb, tensor_mb)
    rng = np.random.default_rng(0)
    if fmt in ("fp8", "fp4", "bf16"):
        t = {}
        for i in range(n):
            if fmt == "fp8":
                t[f"w{i}.weight"] = ("F8_E4M3", rng.integers(0, 126, (rows, inn), dtype=np.uint8))
                t[f"w{i}.scale"] = ("F8_E8M0", rng.integers(110, 130, (rows // 128, inn // 128), dtype=np.uint8))
            elif fmt == "fp4":
                t[f"w{i}.weight"] = ("I8", rng.integers(-128, 128, (rows, inn // 2), dtype=np.int8))
                t[f"w{i}.scale"] = ("F8_E8M0", rng.integers(110, 130, (rows, inn // 32), dtype=np.uint8))
            else:
                t[f"w{i}.weight"] = ("BF16", rng.integers(0, 2**16, (rows, inn), dtype=np.uint16) & 0xBFFF)
        os.makedirs(os.path.join(d, "src"), exist_ok=True)
        save_safetensors(os.path.join(d, "src", "model.safetensors"), t)
        return os.path.join(d, "src")
    import gguf
    qt = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "mxfp4": gguf.GGMLQuantizationType.MXFP4}[fmt]
    bs, ts = gguf.GGML_QUANT_SIZES[qt]
    path = os.path.join(d, "src.gguf")
    w = gguf.GGUFWriter(path, "deepseek4")
    for i in range(n):
        raw = rng.integers(0, 256, (rows, inn // bs * ts), dtype=np.uint8)
        if fmt == "q8_0":   # finite f16 scales
            raw.reshape(rows, -1, 34)[..., 1] &= 0x3B
        w.add_tensor(f"w{i}.weight", raw, raw_dtype=qt)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return path


def drop_page_cache() -> bool:
    """Flush dirty pages and drop the page cache, so the conversion reads the source from disk (needs root)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


class AnonPeak:
    """Samples RssAnon (heap + Orbax buffers, excluding reclaimable mapped source pages) every 5 ms."""

    def __init__(self):
        import threading
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def now() -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        return 0

    def _run(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self.now())

    def __enter__(self):
        self.base = self.now()
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def orbax_startup(d: str) -> float:
    """Seconds of Orbax's one-off start-up (first partial save: JAX backend, tensorstore, event loop).

    Paid once per conversion, so it is timed apart from the throughput of a multi-GB file.
    """
    from dsv4_jax.io.convert.writer import ItemWriter
    p = os.path.join(d, "warmup")
    t0 = time.perf_counter()
    w = ItemWriter(p)
    w.save(("x",), {"w": np.zeros(256, np.uint8)})
    w.finalize()
    shutil.rmtree(p)
    return time.perf_counter() - t0


def run_one(fmt: str, src: str, d: str, dequant: bool) -> dict:
    """Convert `src` through `pipeline.run_job` (the converter's own streaming loop), one tensor per unit."""
    import ml_dtypes
    from tqdm import tqdm
    from dsv4_jax.io.convert import pipeline as PP, plan as PL
    from dsv4_jax.io.convert.gguf_io import GGUFSource
    from dsv4_jax.io.convert.hf_source import SafetensorsSource
    from dsv4_jax.io.outdir import AtomicDir
    from dsv4_jax.model.params import ParamSpec
    source = SafetensorsSource(src) if os.path.isdir(src) else GGUFSource(src)
    names = [n for n in source.names() if n.endswith(".weight")]
    total = sum(source.nbytes(n) for n in names)
    spec = ParamSpec(source.shape(names[0]), ("a", "b"))
    units = [PL.Unit("target", ("layers", f"{i:02d}"), (PL.Leaf("w", spec, n),)) for i, n in enumerate(names)]
    job = PP.Job("target", source, units, 1, {"source": {"path": src}}, total=total)
    dtype = np.dtype(ml_dtypes.bfloat16)
    startup_s = orbax_startup(d)
    cold = drop_page_cache()
    out = os.path.join(d, "out")
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    with AnonPeak() as anon, AtomicDir(out) as a, tqdm(total=total, disable=True) as bar:
        PP.run_job(job, os.path.join(a.tmp, "target"), dtype, not dequant, bar)
        a.commit()
    convert_s = time.perf_counter() - t0
    unit_bytes = total / len(names)
    t0 = time.perf_counter()
    for n in names:                     # host-side repack alone, source now in the page cache
        PL.convert_leaf(source.load(n), spec, dtype, keep_quantized=not dequant)
    repack_s = time.perf_counter() - t0
    out_bytes = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(out) for f in fs)
    return {"format": fmt, "mode": "dequant-bf16" if dequant else "keep-codes", "source_MB": round(total / 2**20, 1),
            "output_MB": round(out_bytes / 2**20, 1), "tensors": len(names), "cold_source": cold,
            "repack_MBps": round(total / 2**20 / repack_s, 1), "convert_MBps": round(total / 2**20 / convert_s, 1),
            "convert_s": round(convert_s, 2), "orbax_startup_s": round(startup_s, 2),
            "convert_with_startup_MBps": round(total / 2**20 / (convert_s + startup_s), 1), "peak_rss_MB": _peak_rss_mb(),
            "unit_MB": round(unit_bytes / 2**20, 1), "baseline_anon_MB": round(anon.base / 2**20),
            "peak_anon_MB": round(anon.peak / 2**20),
            "peak_anon_over_baseline_in_units": round((anon.peak - anon.base) / unit_bytes, 2)}


def _peak_rss_mb() -> int:
    """VmHWM (resets at exec, unlike ru_maxrss, which would report the parent's peak); includes mapped file pages."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=1024, help="source size per format in MB (default 1024)")
    ap.add_argument("--formats", default="fp8,fp4,q8_0,mxfp4,bf16")
    ap.add_argument("--tensor-mb", type=int, default=TENSOR_MB,
                    help=f"size of each source tensor = one streamed unit (default {TENSOR_MB}; a Flash layer's "
                         "experts are ~1.9 GB in FP4)")
    ap.add_argument("--repeat", type=int, default=1, help="conversions per format (the summary gives median/min/max)")
    ap.add_argument("--dequant", action="store_true", help="dequantize to bf16 instead of keeping codes")
    ap.add_argument("--dir", default="/tmp/bench_convert")
    ap.add_argument("--json", default=None, help="write results here")
    ap.add_argument("--one", nargs=2, metavar=("FMT", "SRC"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(run_one(a.one[0], a.one[1], a.dir, a.dequant)))
        return
    rows, summary = [], []
    for fmt in a.formats.split(","):
        d = os.path.join(a.dir, fmt)
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        src = write_source(fmt, a.mb, d, a.tensor_mb)
        cmd = [sys.executable, __file__, "--one", fmt, src, "--dir", d] + (["--dequant"] if a.dequant else [])
        runs = []
        for _ in range(a.repeat):       # the same source each time; the page cache is dropped before each run
            p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
            if p.returncode:
                sys.exit(p.stderr[-3000:])
            r = json.loads(p.stdout.strip().splitlines()[-1])
            runs.append(r)
            print(f"{fmt:6s} {r['mode']:12s} src {r['source_MB']:7.1f} MB  out {r['output_MB']:7.1f} MB  "
                  f"read+repack {r['repack_MBps']:7.1f} MB/s  convert {r['convert_MBps']:7.1f} MB/s  "
                  f"(with start-up {r['convert_with_startup_MBps']:6.1f})  peak RSS {r['peak_rss_MB']} MB  "
                  f"anon peak +{r['peak_anon_over_baseline_in_units']} units  cold={r['cold_source']}", flush=True)
        shutil.rmtree(d, ignore_errors=True)
        rows += runs
        rates = sorted(r["convert_MBps"] for r in runs)
        summary.append({"format": fmt, "runs": len(rates), "convert_MBps_median": rates[len(rates) // 2],
                        "convert_MBps_min": rates[0], "convert_MBps_max": rates[-1],
                        "peak_anon_units_max": max(r["peak_anon_over_baseline_in_units"] for r in runs)})
    if a.repeat > 1:
        print("\nformat  median   min     max   MB/s (convert)")
        for m in summary:
            print(f"{m['format']:6s} {m['convert_MBps_median']:7.1f} {m['convert_MBps_min']:7.1f} "
                  f"{m['convert_MBps_max']:7.1f}")
    res = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": platform.platform(),
           "cpus": os.cpu_count(), "command": " ".join(sys.argv), "summary": summary, "results": rows}
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
