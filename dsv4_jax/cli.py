"""Command-line plumbing shared by the tools: dsv4-convert, dsv4-memplan, dsv4-aot, dsv4-sweep,
dsv4-batch-eval, dsv4-long-context, dsv4-train-drafter and dsv4-bench-decode.

- Bad input: `OptionError` (raised by the value parsers below) and `fail(prog, message)`: one message on
  stderr, exit status 2, before any work (nothing is written). argparse's own errors exit 2 the same way.
- Values: `items` (a comma list), `int_list` / `float_list` (sorted unique values, integer ranges 1-5),
  `int_tuple` (integers in the order given); argparse types `positive_int`, `positive_ints`,
  `non_negative_float`, `names` (a comma list of known names), `mesh_shape` / `mesh_or_auto` (--mesh
  DATAxEXPERTxMODEL).
- Flags: `add_preset`, `add_kernels`, `add_mesh`, `add_out_dir` (+ --overwrite), `add_quiet`,
  `add_compile_cache` (+ `enable_compile_cache`).
- `device_mesh`: a --mesh value as a `jax.sharding.Mesh` over every device; `claim_device_memory`: the
  share of GPU memory XLA may take (before the first device use).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Callable, Iterable

import jax

from . import backends, parallel
from .config import PRESETS

EXIT_BAD_INPUT = 2
MESH_METAVAR = "DxExM"
DEFAULT_CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "dsv4_jax", "xla")


class OptionError(ValueError):
    """An invalid command-line option (reported before any work starts)."""


def fail(prog: str, message: object) -> int:
    """Print `prog: error: message` on stderr; returns the exit status of bad input (2)."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


# ---- values ---------------------------------------------------------------------------------------------

def items(text: str) -> list[str]:
    """'a, b,,c' -> ['a', 'b', 'c']."""
    return [s.strip() for s in text.split(",") if s.strip()]


def _named(name: str | None, message: str) -> str:
    return f"{name}: {message}" if name else message


def int_list(text: str, name: str, minimum: int = 0) -> list[int]:
    """'1,2,3' | '1-5' | '1..5' | '1,3-5' -> sorted unique ints >= minimum."""
    out = set()
    for part in items(text):
        m = re.fullmatch(r"(-?\d+)(?:\s*(?:-|\.\.)\s*(-?\d+))?", part)
        if not m:
            raise OptionError(f"{name}: {part!r} is not an integer or a range like 1-5")
        lo, hi = int(m[1]), int(m[2]) if m[2] is not None else int(m[1])
        if hi < lo:
            raise OptionError(f"{name}: {part!r} is an empty range (write low-high, e.g. {hi}-{lo})")
        out.update(range(lo, hi + 1))
    if not out:
        raise OptionError(f"{name}: give at least one value")
    bad = sorted(v for v in out if v < minimum)
    if bad:
        raise OptionError(f"{name}: values must be >= {minimum}, got {', '.join(map(str, bad))}")
    return sorted(out)


def float_list(text: str, name: str, lo: float = 0.0, hi: float | None = None) -> list[float]:
    """'0,0.5,1' -> sorted unique floats in [lo, hi]."""
    out = set()
    for part in items(text):
        try:
            out.add(float(part))
        except ValueError:
            raise OptionError(f"{name}: {part!r} is not a number") from None
    if not out:
        raise OptionError(f"{name}: give at least one value")
    bad = sorted(v for v in out if v < lo or (hi is not None and v > hi))
    if bad:
        allowed = f"in [{lo:g}, {hi:g}]" if hi is not None else f">= {lo:g}"
        raise OptionError(f"{name}: values must be {allowed}, got {', '.join(f'{v:g}' for v in bad)}")
    return sorted(out)


def int_tuple(text: str, name: str | None = None, minimum: int | None = None) -> tuple[int, ...]:
    """'40,41,42' -> (40, 41, 42): integers in the order given (at least one, each >= minimum if given)."""
    try:
        out = tuple(int(v) for v in items(text))
    except ValueError:
        raise OptionError(_named(name, f"expected comma-separated integers, got {text!r}")) from None
    if not out:
        raise OptionError(_named(name, "give at least one value"))
    if minimum is not None and min(out) < minimum:
        raise OptionError(_named(name, f"expected integers >= {minimum}, got {text!r}"))
    return out


def arg_type(parse: Callable[[str], object], name: str) -> Callable[[str], object]:
    """An argparse type from a parser raising OptionError / ValueError (argparse then names the flag)."""
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = name       # argparse's "invalid <name> value" for other exceptions
    return convert


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise OptionError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise OptionError(f"expected a positive integer, got {v}")
    return v


positive_int = arg_type(_positive, "positive_int")                                          # one integer >= 1
positive_ints = arg_type(lambda text: list(int_tuple(text, minimum=1)), "positive_ints")    # '1,8,16', order kept


def _non_negative(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise OptionError(f"expected a number >= 0, got {text!r}") from None
    if not v >= 0 or v == float("inf"):
        raise OptionError(f"expected a finite number >= 0, got {text}")
    return v


non_negative_float = arg_type(_non_negative, "non_negative_float")                          # one number >= 0


def names(allowed: Iterable[str] | None = None, what: str = "name") -> Callable[[str], list[str]]:
    """argparse type: a comma list of names, each from `allowed` (any name when None), in the order given."""
    allowed = None if allowed is None else tuple(allowed)

    def parse(text: str) -> list[str]:
        out = items(text)
        if not out:
            raise OptionError(f"give at least one {what}")
        bad = [v for v in out if allowed is not None and v not in allowed]
        if bad:
            raise OptionError(f"unknown {what}(s) {bad}; choose from {','.join(allowed)}")
        return out
    return arg_type(parse, what)


mesh_shape = arg_type(parallel.parse_mesh_shape, "mesh")          # '1x8x1' -> (1, 8, 1)
mesh_or_auto = arg_type(lambda text: text if text == "auto" else parallel.parse_mesh_shape(text), "mesh")


def device_mesh(shape: tuple[int, ...] | str | None):
    """A --mesh value as a Mesh over every device: None -> None (no mesh), 'auto' -> `parallel.make_mesh()`
    (every device on 'expert'), sizes -> their mesh (OptionError when the device count differs)."""
    if shape is None:
        return None
    if shape == "auto":
        return parallel.make_mesh()
    try:
        return parallel.make_mesh(shape)
    except ValueError as e:
        raise OptionError(f"--mesh {'x'.join(map(str, shape))}: {e}") from None


# ---- flags ----------------------------------------------------------------------------------------------

def add_preset(p) -> None:
    p.add_argument("--preset", default="flash", choices=sorted(PRESETS), help="model config (default flash)")


def add_kernels(p, *aliases: str, help: str | None = None) -> None:
    """--kernels: the static `dsv4_jax.backends` choice of the hot-op implementations (default reference)."""
    p.add_argument("--kernels", *aliases, dest="kernels", default="reference", choices=backends.CHOICES,
                   help=help or "implementation of the hot ops (MoE experts, routing, indexer), a static "
                                "dsv4_jax.backends.Backends: reference (the jnp / XLA paths), pallas (the Pallas "
                                "GPU kernels), pallas_tpu (the Mosaic TPU kernels) or auto (Pallas on GPU and "
                                "TPU, references elsewhere); default reference")


def add_mesh(p, help: str, *, auto: bool = False, **kw) -> None:
    """--mesh DATAxEXPERTxMODEL, parsed to sizes (`mesh_shape`; with auto, 'auto' is kept as is)."""
    p.add_argument("--mesh", type=mesh_or_auto if auto else mesh_shape, metavar=kw.pop("metavar", MESH_METAVAR),
                   help=help, **kw)


OUT_DIR_HELP = "output directory: missing or empty (parents are created); written atomically"


def add_out_dir(p, help: str = OUT_DIR_HELP, overwrite: bool = True) -> None:
    """--out DIR (required) and, unless overwrite=False, --overwrite (the rules: `dsv4_jax.io.outdir`)."""
    p.add_argument("--out", required=True, metavar="DIR", help=help)
    if overwrite:
        p.add_argument("--overwrite", action="store_true", help="replace an existing non-empty --out")


def add_quiet(p, help: str, short: bool = False) -> None:
    p.add_argument(*(("-q",) if short else ()), "--quiet", action="store_true", help=help)


def add_compile_cache(p) -> None:
    p.add_argument("--compile-cache", default=DEFAULT_CACHE, metavar="DIR",
                   help=f"JAX persistent compilation cache, speeds up reruns (default {DEFAULT_CACHE})")
    p.add_argument("--no-compile-cache", action="store_true", help="do not use a persistent compilation cache")


def enable_compile_cache(a: argparse.Namespace) -> None:
    """Turn on JAX's persistent compilation cache (process-wide) unless --no-compile-cache or DSV4_COMPILE_CACHE=0."""
    if a.no_compile_cache or os.environ.get("DSV4_COMPILE_CACHE", "1") == "0":
        return
    os.makedirs(a.compile_cache, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", a.compile_cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def claim_device_memory(fraction: float) -> None:
    """Let XLA's GPU client take `fraction` of each GPU's memory (XLA_PYTHON_CLIENT_MEM_FRACTION, unless the
    environment sets it). Read once, when JAX starts its GPU client (the first device use), so call it before
    that; it selects no code path and does nothing on CPU / TPU."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{fraction:g}")
