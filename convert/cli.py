"""`dsv4-convert`: DeepSeek-V4 safetensors / GGUF checkpoints -> Orbax checkpoints for dsv4_jax.

    dsv4-convert hf SRC_DIR OUT_DIR [--dspark DSPARK_DIR] [--dtype bf16|f32|f16] [--keep-quantized]
    dsv4-convert gguf SRC.gguf OUT_DIR [--mtp FILE] [--dspark FILE] [--dtype ...] [--keep-quantized]
    dsv4-convert drafter CKPT_DIR [--mtp PATH] [--dspark PATH]

Exit status 0 on success, 2 on bad input (message on stderr; no output directory is left behind).
"""
from __future__ import annotations

import argparse
import os
import sys

from dsv4_jax.config import ConfigError

from . import pipeline
from .gguf_io import GGUFError
from .plan import ConvertError
from .quant_formats import FormatError
from .safetensors_io import SafetensorsError

ERRORS = (ConvertError, GGUFError, SafetensorsError, FormatError, ConfigError, FileExistsError, FileNotFoundError)

_COMMON_EPILOG = """
output: OUT_DIR/dsv4.json (config, source, per-tensor formats) and Orbax items OUT_DIR/target,
OUT_DIR/mtp, OUT_DIR/dspark. Load with dsv4_jax.load_checkpoint(OUT_DIR, dtype=..., mesh=...).
The conversion streams one layer at a time into OUT_DIR.incomplete-<pid> next to OUT_DIR and
renames it when complete; on any error nothing is left behind.
"""


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default=None, choices=["bf16", "f32", "f16"],
                   help="dequantize every weight to DTYPE (f32: exact; bf16: exact for FP8 / FP4, rounds Q8_0 "
                        "and K-quants; a rounding is reported as a warning). Default: keep the source's "
                        "codes and dtypes. Norms/HC/sinks/biases are always f32.")
    p.add_argument("--keep-quantized", action="store_true",
                   help="keep FP8 / FP4 / Q8_0 / MXFP4 (-> FP4, lossless) codes + scales as stored, K- and "
                        "IQ-quants requantized to Q8_0 (lossy, warned) -- the default; with --dtype, DTYPE is "
                        "then only load_checkpoint's default compute dtype. load_checkpoint(..., "
                        "keep_quantized=True) keeps them quantized on the device.")
    p.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dsv4-convert", description="Convert DeepSeek-V4 (Flash) checkpoints "
                                 "to Orbax checkpoints for dsv4_jax.", epilog=_COMMON_EPILOG,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{hf,gguf,drafter}")

    hf = sub.add_parser("hf", help="a Hugging Face safetensors directory (official or transformers format)",
                        description="Convert a safetensors checkpoint directory (config.json + *.safetensors). "
                                    "The naming is detected: the official DeepSeek release (FP8 e4m3 + ue8m0 "
                                    "128x128 scales, FP4 experts; its mtp.* block is converted as the MTP "
                                    "drafter, or as DSpark stages when mtp.0.main_proj exists) or transformers' "
                                    "save_pretrained format.", epilog=_COMMON_EPILOG,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    hf.add_argument("src", metavar="SRC_DIR")
    hf.add_argument("out", metavar="OUT_DIR")
    hf.add_argument("--dspark", metavar="DSPARK_DIR",
                    help="also convert a DSpark drafter directory (official format, mtp.{0,1,2}.* tensors)")
    hf.add_argument("--mtp", metavar="MTP_DIR", help="also convert a separate MTP directory (official mtp.N.*)")
    _add_common(hf)

    gg = sub.add_parser("gguf", help="a GGUF file (llama.cpp or ds4 naming; split sets supported)",
                        description="Convert a deepseek4 GGUF file. For a split set pass any shard "
                                    "(NAME-0000k-of-0000n.gguf); all shards are read. Tensor types: F32, F16, "
                                    "BF16, I32, Q8_0, MXFP4 natively; K- and IQ-quants through gguf-py.",
                        epilog=_COMMON_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    gg.add_argument("src", metavar="SRC.gguf")
    gg.add_argument("out", metavar="OUT_DIR")
    gg.add_argument("--mtp", metavar="FILE", help="MTP GGUF: llama.cpp --mtp file (blk.N.nextn.*) or ds4 (mtp.0.*)")
    gg.add_argument("--dspark", metavar="FILE",
                    help="DSpark GGUF: llama.cpp 'dflash' file or ds4 support file (dspark.*)")
    _add_common(gg)

    dr = sub.add_parser("drafter", help="add MTP / DSpark drafters to an existing converted checkpoint",
                        description="Convert drafter files and merge them into CKPT_DIR (written as "
                                    "CKPT_DIR/mtp or CKPT_DIR/dspark, each atomically). PATH is a GGUF file or "
                                    "an official-format safetensors directory. Weights are stored like the "
                                    "checkpoint's (same --dtype / --keep-quantized unless given).")
    dr.add_argument("ckpt", metavar="CKPT_DIR")
    dr.add_argument("--mtp", metavar="PATH")
    dr.add_argument("--dspark", metavar="PATH")
    dr.add_argument("--dtype", choices=["bf16", "f32", "f16"], default=None)
    dr.add_argument("--keep-quantized", action="store_true", default=None)
    dr.add_argument("--overwrite", action="store_true", help="replace drafters already in CKPT_DIR")
    dr.add_argument("-q", "--quiet", action="store_true")
    return ap


def _drafter_job(path: str, kind: str, config):
    if os.path.isdir(path):
        return pipeline.plan_hf_drafter(path, config, kind)
    if kind == "mtp":
        return pipeline.plan_gguf_mtp(path, config)
    return pipeline.plan_gguf_dspark(path, config)


def run(args) -> dict:
    if args.cmd == "drafter":
        if not (args.mtp or args.dspark):
            raise ConvertError("nothing to add: give --mtp and/or --dspark")
        config = pipeline.config_of(args.ckpt)
        jobs = [_drafter_job(p, k, config) for k, p in (("mtp", args.mtp), ("dspark", args.dspark)) if p]
        keep = args.keep_quantized or (False if args.dtype else None)    # --dtype alone: dequantize
        return pipeline.add_drafters(args.ckpt, jobs, dtype=args.dtype, keep_quantized=keep,
                                     overwrite=args.overwrite, quiet=args.quiet)
    if args.cmd == "hf":
        config, jobs = pipeline.plan_hf(args.src)
    else:
        config, jobs = pipeline.plan_gguf(args.src)
    for kind in ("mtp", "dspark"):
        p = getattr(args, kind, None)
        if p:
            jobs = [j for j in jobs if j.item != kind] + [_drafter_job(p, kind, config)]
    keep = args.keep_quantized or args.dtype is None                    # --dtype alone: dequantize to it
    return pipeline.convert(args.out, config, jobs, dtype=args.dtype or "bf16", keep_quantized=keep,
                            overwrite=args.overwrite, quiet=args.quiet)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        meta = run(args)
    except ERRORS as e:
        print(f"dsv4-convert: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dsv4-convert: interrupted; nothing written", file=sys.stderr)
        return 130
    items = ", ".join(f"{k} ({len(v['leaves'])} leaves)" for k, v in meta["items"].items())
    dest = args.ckpt if args.cmd == "drafter" else args.out
    if not args.quiet:
        print(f"dsv4-convert: wrote {dest}: {items}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
