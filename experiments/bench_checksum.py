"""What checkpoint checksums cost (dsv4_jax.io.integrity): at save / conversion (host numpy) and on load
(`load_checkpoint(verify=True)`, the default, against `verify=False`).

Two cases, each timed in the same run:
  bundled   the bundled tiny model (target + MTP + DSpark) saved with save_checkpoint; warm loads
            alternating verify on / off, plus `dsv4-convert verify` (verify_checkpoint)
  flash     the arrays of one DeepSeek-V4-Flash MoE layer as the release stores them with --keep-quantized
            (FP4 e2m1 experts w1 / w2 / w3 [256, 2048, 4096/2] + e8m0 scales, FP8 e4m3 attention / shared
            expert + 128×128 e8m0 scales, bf16 router / compressor, f32 norms and HC), written through
            Orbax and restored as load_checkpoint does, with and without the checksum pass; --fraction
            scales the expert count for small machines

    python experiments/bench_checksum.py --json experiments/results/checksum_cost_2026-12-04.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time

import jax
import numpy as np
import orbax.checkpoint.experimental.v1 as ocp1

import dsv4_jax as d
from dsv4_jax.io.convert.save import save_checkpoint
from dsv4_jax.io.checkpoint import verify_checkpoint
from dsv4_jax.io.integrity import checksum_np, checksums


def flash_layer(experts: int, rng) -> dict[str, np.ndarray]:
    """Stored arrays of one Flash MoE layer (docs/checkpoint_formats.md §3 shapes), random bytes."""
    D, I, H, Q, O = 4096, 2048, 64 * 512, 1024, 8 * 1024
    u8 = lambda *s: rng.integers(0, 256, s, dtype=np.uint8)  # noqa: E731
    bf = lambda *s: rng.standard_normal(s, dtype=np.float32).astype("bfloat16")  # noqa: E731
    out = {}
    for w, (o, i) in (("w1", (I, D)), ("w3", (I, D)), ("w2", (D, I))):
        out[f"experts.{w}.codes"] = u8(experts, o, i // 2)
        out[f"experts.{w}.scale"] = u8(experts, o, i // 32)
    for w, (o, i) in (("wq_a", (Q, D)), ("wq_b", (H, Q)), ("wkv", (512, D)), ("wo_a", (O, H // 8)),
                      ("wo_b", (D, O)), ("shared.w1", (I, D)), ("shared.w3", (I, D)), ("shared.w2", (D, I)),
                      ("indexer.wq_b", (64 * 128, Q))):
        out[f"{w}.codes"] = u8(o, i)
        out[f"{w}.scale"] = u8(-(-o // 128), -(-i // 128))
    out["gate.weight"] = bf(256, D)
    for w in ("compressor.wkv", "compressor.wgate"):
        out[w] = bf(2 * 512, D)
    out["hc_attn.fn"] = rng.standard_normal((24, 4 * D), dtype=np.float32)
    out["attn_norm"] = np.ones(D, np.float32)
    return out


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def bench_bundled(tmp: str, repeats: int) -> dict:
    demo = d.tiny_demo()
    path = os.path.join(tmp, "bundled")
    save_checkpoint(path, demo.config, demo.params, dspark_meta=demo.dspark, overwrite=True)
    d.load_checkpoint(path)                          # compile once
    d.load_checkpoint(path, verify=False)
    on, off = [], []
    for _ in range(repeats):                         # alternate, so load drift hits both
        on += timed(lambda: d.load_checkpoint(path), 1)
        off += timed(lambda: d.load_checkpoint(path, verify=False), 1)
    ver = timed(lambda: verify_checkpoint(path), repeats)
    size = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(path) for f in fs)
    return {"bytes": size, "load_verify_s": on, "load_noverify_s": off, "verify_checkpoint_s": ver,
            "median_extra_s": float(np.median(on) - np.median(off))}


def bench_flash(tmp: str, fraction: float, repeats: int) -> dict:
    rng = np.random.default_rng(0)
    arrays = flash_layer(max(1, int(256 * fraction)), rng)
    nbytes = sum(a.nbytes for a in arrays.values())
    host = timed(lambda: [checksum_np(a) for a in arrays.values()], repeats)
    path = os.path.join(tmp, "flash_layer")
    ctx = ocp1.Context()
    ctx.array.saving.use_compression = False
    with ctx:
        ocp1.save(path, {k.replace(".", "_"): v for k, v in arrays.items()})
    dev = jax.local_devices()[0]
    abstract = {k.replace(".", "_"): jax.ShapeDtypeStruct(v.shape, v.dtype,
                                                          sharding=jax.sharding.SingleDeviceSharding(dev))
                for k, v in arrays.items()}
    del arrays

    def restore():
        with ctx:
            return ocp1.load(path, abstract)

    def restore_verify():
        tree = restore()
        checksums(tree)
        return tree
    restore()
    r_off, r_on, dev_only = [], [], []
    for _ in range(repeats):
        r_on += timed(restore_verify, 1)
        r_off += timed(restore, 1)
        tree = restore()
        dev_only += timed(lambda: checksums(tree), 1)
        del tree
    return {"experts": max(1, int(256 * fraction)), "bytes": nbytes, "host_checksum_s": host,
            "host_GBps": nbytes / np.median(host) / 1e9, "restore_s": r_off, "restore_verify_s": r_on,
            "checksum_after_restore_s": dev_only,
            "extra_fraction_of_restore": float(np.median(dev_only) / np.median(r_off))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fraction", type=float, default=1.0, help="share of Flash's 256 experts to write")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench_checksum_")
    try:
        res = {"machine": platform.platform(), "cpus": os.cpu_count(), "backend": jax.default_backend(),
               "load_avg_start": os.getloadavg(), "bundled": bench_bundled(tmp, args.repeats),
               "flash_layer": bench_flash(tmp, args.fraction, args.repeats), "load_avg_end": os.getloadavg()}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    b, f = res["bundled"], res["flash_layer"]
    med = lambda x: float(np.median(x))  # noqa: E731
    print(f"{'case':<34}{'bytes':>14}{'verify off s':>14}{'verify on s':>13}{'extra':>9}")
    print(f"{'bundled model: load_checkpoint':<34}{b['bytes']:>14,}{med(b['load_noverify_s']):>14.3f}"
          f"{med(b['load_verify_s']):>13.3f}{med(b['load_verify_s']) / med(b['load_noverify_s']) - 1:>9.0%}")
    print(f"{'bundled model: verify_checkpoint':<34}{'':>14}{'':>14}{med(b['verify_checkpoint_s']):>13.3f}")
    print(f"{'Flash layer (' + str(f['experts']) + ' experts): restore':<34}{f['bytes']:>14,}{med(f['restore_s']):>14.3f}"
          f"{med(f['restore_verify_s']):>13.3f}{med(f['restore_verify_s']) / med(f['restore_s']) - 1:>9.0%}")
    print(f"{'Flash layer: host checksum (save)':<34}{f['bytes']:>14,}{'':>14}{med(f['host_checksum_s']):>13.3f}"
          f"{f['host_GBps']:>7.2f}GB/s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
