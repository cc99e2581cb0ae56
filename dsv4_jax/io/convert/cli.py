"""`dsv4-convert`: DeepSeek-V4 safetensors / GGUF checkpoints -> Orbax checkpoints for dsv4_jax.

    dsv4-convert hf SRC_DIR OUT_DIR [--dspark DSPARK_DIR] [--dtype bf16|f32|f16] [--keep-quantized]
    dsv4-convert gguf SRC.gguf OUT_DIR [--mtp FILE] [--dspark FILE] [--dtype ...] [--keep-quantized]
    dsv4-convert drafter CKPT_DIR [--mtp PATH] [--dspark PATH]
    dsv4-convert verify CKPT_DIR

Exit status 0 on success, 2 on bad input (message on stderr; no output directory is left behind).
"""
from __future__ import annotations

import argparse
import os
import sys
import textwrap
import warnings

from ... import cli
from ...config import ConfigError
from ..checkpoint import CheckpointFormatError, verify_checkpoint
from ..integrity import ChecksumError
from ..outdir import OutDirError, check_apart, check_target

from . import pipeline
from .gguf_io import GGUFError
from .plan import ConvertError
from .quant_formats import FormatError
from .safetensors_io import SafetensorsError
from .truncation import TruncatedFileError, file_kind

ERRORS = (ConvertError, GGUFError, SafetensorsError, TruncatedFileError, FormatError, ConfigError, OutDirError,
          FileNotFoundError, CheckpointFormatError, ChecksumError)

DTYPES = ("bf16", "f32", "f16")
_OUTPUT = """
output: OUT_DIR/dsv4.json (config, source, per-tensor formats) and Orbax items OUT_DIR/target,
OUT_DIR/mtp, OUT_DIR/dspark. Load with dsv4_jax.load_checkpoint(OUT_DIR, dtype=..., mesh=...).
OUT_DIR must not exist or be an empty directory (--overwrite replaces a non-empty one); missing
parent directories are created. The conversion streams one layer at a time into
OUT_DIR.incomplete-<pid> next to OUT_DIR and renames it when complete; on any error nothing is left
behind (parent directories it created included). Exit status 0 on success, 2 on bad input.
"""

_EXAMPLES = {
    "hf": ["dsv4-convert hf /ckpt/DeepSeek-V4-Flash ckpt/flash                     # official FP8/FP4 release "
           "(+ its MTP) -> bf16",
           "dsv4-convert hf /ckpt/DeepSeek-V4-Flash ckpt/flash-q --keep-quantized  # keep FP8/FP4 codes + scales",
           "dsv4-convert hf /ckpt/DeepSeek-V4-Flash ckpt/flash --dspark /ckpt/DSpark-V4-Flash --overwrite",
           "dsv4-convert hf ./my-finetune ckpt/finetune --dtype f32                # a transformers "
           "save_pretrained directory"],
    "gguf": ["dsv4-convert gguf DeepSeek-V4-Flash-Q8_0.gguf ckpt/flash-q8 --keep-quantized",
             "dsv4-convert gguf DeepSeek-V4-Flash-Q4_K_M-00001-of-00009.gguf ckpt/flash-q4   # split set: any shard",
             "dsv4-convert gguf DeepSeek-V4-Flash-Q8_0.gguf ckpt/flash --mtp mtp.gguf --dspark dflash.gguf"],
    "drafter": ["dsv4-convert drafter ckpt/flash --mtp mtp.gguf                    # llama.cpp / ds4 MTP GGUF",
                "dsv4-convert drafter ckpt/flash --dspark /ckpt/DSpark-V4-Flash    # official safetensors directory",
                "dsv4-convert drafter ckpt/flash --dspark dflash.gguf --overwrite  # replace the DSpark drafter "
                "there"],
    "verify": ["dsv4-convert verify ckpt/flash                                  # every stored array against "
               "its checksum"],
}
_DRAFTER_NOTE = """
CKPT_DIR/dsv4.json gains the drafter items; each drafter is written atomically (a failed run leaves
CKPT_DIR as it was).
"""


def _examples(*cmds: str) -> str:
    return "examples:\n" + "".join(f"  {line}\n" for c in cmds for line in _EXAMPLES[c])


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="dequantize every weight to DTYPE (f32: exact; bf16: exact for FP8 / FP4, rounds Q8_0 "
                        "and K-quants; a rounding is reported as a warning). Default: keep the source's "
                        "codes and dtypes. Norms/HC/sinks/biases are always f32.")
    p.add_argument("--keep-quantized", action="store_true",
                   help="keep FP8 / FP4 / Q8_0 / MXFP4 (-> FP4, lossless) codes + scales as stored, K- and "
                        "IQ-quants requantized to Q8_0 (lossy, warned) -- the default; with --dtype, DTYPE is "
                        "then only load_checkpoint's default compute dtype. load_checkpoint(..., "
                        "keep_quantized=True) keeps them quantized on the device.")
    p.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists and is not empty "
                   "(never when OUT_DIR is, contains or lies inside a source)")
    _add_nonfinite(p)
    cli.add_quiet(p, "no progress bar", short=True)


def _add_nonfinite(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="convert tensors that decode to NaN / inf (default: an error naming the tensor)")


def _sub(sub, name: str, help: str, description: str, epilog: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help, description=textwrap.fill(description, 100), epilog=epilog,
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dsv4-convert", description="Convert DeepSeek-V4 (Flash) checkpoints "
                                 "to Orbax checkpoints for dsv4_jax.\n`dsv4-convert SUBCOMMAND --help` shows a "
                                 "subcommand's options.", epilog=_examples("hf", "gguf", "drafter", "verify") + _OUTPUT,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{hf,gguf,drafter,verify}")

    hf = _sub(sub, "hf", "a Hugging Face safetensors directory (official or transformers format)",
              "Convert a safetensors checkpoint directory (config.json + *.safetensors). The naming is "
              "detected: the official DeepSeek release (FP8 e4m3 + ue8m0 128x128 scales, FP4 experts; its "
              "mtp.* block is converted as the MTP drafter, or as DSpark stages when mtp.0.main_proj exists) "
              "or transformers' save_pretrained format.", _examples("hf") + _OUTPUT)
    hf.add_argument("src", metavar="SRC_DIR", help="directory with config.json and *.safetensors")
    hf.add_argument("out", metavar="OUT_DIR", help="checkpoint directory to create")
    hf.add_argument("--dspark", metavar="DSPARK_DIR",
                    help="also convert a DSpark drafter directory (official format, mtp.{0,1,2}.* tensors)")
    hf.add_argument("--mtp", metavar="MTP_DIR", help="also convert a separate MTP directory (official mtp.N.*)")
    _add_common(hf)

    gg = _sub(sub, "gguf", "a GGUF file (llama.cpp or ds4 naming; split sets supported)",
              "Convert a deepseek4 GGUF file. For a split set pass any shard (NAME-0000k-of-0000n.gguf); all "
              "shards are read. Tensor types: F32, F16, BF16, I32, Q8_0, MXFP4 natively; K- and IQ-quants "
              "through gguf-py.", _examples("gguf") + _OUTPUT)
    gg.add_argument("src", metavar="SRC.gguf", help="the GGUF file, or any shard of a split set")
    gg.add_argument("out", metavar="OUT_DIR", help="checkpoint directory to create")
    gg.add_argument("--mtp", metavar="FILE", help="MTP GGUF: llama.cpp --mtp file (blk.N.nextn.*) or ds4 (mtp.0.*)")
    gg.add_argument("--dspark", metavar="FILE",
                    help="DSpark GGUF: llama.cpp 'dflash' file or ds4 support file (dspark.*)")
    _add_common(gg)

    dr = _sub(sub, "drafter", "add MTP / DSpark drafters to an existing converted checkpoint",
              "Convert drafter files and merge them into CKPT_DIR (written as CKPT_DIR/mtp or CKPT_DIR/dspark, "
              "each atomically). PATH is a GGUF file or an official-format safetensors directory. Weights are "
              "stored like the checkpoint's (same --dtype / --keep-quantized unless given).",
              _examples("drafter") + _DRAFTER_NOTE)
    dr.add_argument("ckpt", metavar="CKPT_DIR", help="a checkpoint written by `dsv4-convert hf|gguf` (has dsv4.json)")
    dr.add_argument("--mtp", metavar="PATH", help="MTP drafter: a GGUF file (llama.cpp --mtp file, blk.N.nextn.*, "
                                                  "or ds4 mtp.0.*) or an official safetensors directory (mtp.N.*)")
    dr.add_argument("--dspark", metavar="PATH", help="DSpark drafter: a GGUF file (llama.cpp 'dflash' or ds4 "
                                                     "dspark.*) or an official safetensors directory (mtp.{0,1,2}.*)")
    dr.add_argument("--dtype", choices=DTYPES, default=None,
                    help="dtype of dequantized drafter weights (default: the checkpoint's conversion dtype)")
    dr.add_argument("--keep-quantized", action="store_true", default=None,
                    help="store quantized drafter tensors as codes + scales (default: as the checkpoint was "
                         "converted)")
    dr.add_argument("--overwrite", action="store_true", help="replace drafters already in CKPT_DIR")
    _add_nonfinite(dr)
    cli.add_quiet(dr, "no progress bar", short=True)

    ve = _sub(sub, "verify", "check a converted checkpoint against its recorded checksums",
              "Cross-check CKPT_DIR/dsv4.json against the stored leaves (names, shapes, dtypes, layer count) and "
              "every stored array against the checksum written with it, one layer at a time on one device. "
              "Exit status 0 when intact, 2 naming the file and leaf otherwise.", _examples("verify"))
    ve.add_argument("ckpt", metavar="CKPT_DIR", help="a checkpoint written by dsv4-convert or save_checkpoint")
    return ap


def _drafter_job(path: str, kind: str, config):
    if os.path.isdir(path):
        return pipeline.plan_hf_drafter(path, config, kind)
    if kind == "mtp":
        return pipeline.plan_gguf_mtp(path, config)
    return pipeline.plan_gguf_dspark(path, config)


def _check_sources(paths) -> None:
    """Every given source exists and is a directory or a regular file (a FIFO or device would block or
    stream): refused up front, before anything is opened."""
    for p in paths:
        if p is None:
            continue
        if not os.path.exists(p):
            raise ConvertError(f"{p}: no such file or directory")
        if not (os.path.isdir(p) or os.path.isfile(p)):
            raise ConvertError(f"{p}: not a regular file or directory ({file_kind(p)})")


def run(args) -> dict:
    if args.cmd == "verify":
        _check_sources([args.ckpt])
        return {"verified": verify_checkpoint(args.ckpt)}
    nonfinite = bool(getattr(args, "allow_nonfinite", False))
    if args.cmd == "drafter":
        if not (args.mtp or args.dspark):
            raise ConvertError("nothing to add: give --mtp and/or --dspark")
        config = pipeline.config_of(args.ckpt)
        _check_sources([args.mtp, args.dspark])
        for kind in ("mtp", "dspark"):
            if getattr(args, kind):
                check_apart(os.path.join(args.ckpt, kind), [getattr(args, kind)], f"CKPT_DIR/{kind}")
        jobs = [_drafter_job(p, k, config) for k, p in (("mtp", args.mtp), ("dspark", args.dspark)) if p]
        keep = args.keep_quantized or (False if args.dtype else None)    # --dtype alone: dequantize
        return pipeline.add_drafters(args.ckpt, jobs, dtype=args.dtype, keep_quantized=keep,
                                     overwrite=args.overwrite, quiet=args.quiet, allow_nonfinite=nonfinite)
    sources = [args.src, getattr(args, "mtp", None), getattr(args, "dspark", None)]
    check_apart(args.out, sources, "OUT_DIR")            # even with --overwrite: never replace a source
    check_target(args.out, args.overwrite, "OUT_DIR")     # before reading any source
    _check_sources(sources)
    if args.cmd == "hf":
        config, jobs = pipeline.plan_hf(args.src)
    else:
        config, jobs = pipeline.plan_gguf(args.src)
    for kind in ("mtp", "dspark"):
        p = getattr(args, kind, None)
        if p:
            jobs = [j for j in jobs if j.item != kind] + [_drafter_job(p, kind, config)]
    keep = args.keep_quantized or args.dtype is None                    # --dtype alone: dequantize to it
    return pipeline.convert(args.out, config, jobs, dtype=args.dtype or "bfloat16", keep_quantized=keep,
                            overwrite=args.overwrite, quiet=args.quiet, allow_nonfinite=nonfinite)


def _inputs(args) -> str:
    paths = [getattr(args, k, None) for k in ("src", "ckpt", "mtp", "dspark")]
    return ", ".join(p for p in paths if p)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=RuntimeWarning, module="numpy")   # NaN/inf: our own check
            meta = run(args)
    except ERRORS as e:
        return cli.fail("dsv4-convert", e)
    except KeyboardInterrupt:
        print("dsv4-convert: interrupted; nothing written", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - no traceback reaches a user: one message naming the inputs
        print(f"dsv4-convert: error: {_inputs(args)}: unexpected {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    if args.cmd == "verify":
        counts = ", ".join(f"{k} ({n} arrays)" for k, n in meta["verified"].items())
        print(f"dsv4-convert: {args.ckpt}: intact: {counts}", file=sys.stderr)
        return 0
    items = ", ".join(f"{k} ({len(v['leaves'])} leaves)" for k, v in meta["items"].items())
    dest = args.ckpt if args.cmd == "drafter" else args.out
    if not args.quiet:
        print(f"dsv4-convert: wrote {dest}: {items}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
