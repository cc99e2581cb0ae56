"""Routed experts as a run holds them: FP4 as uint32 words, stored contraction-dim major on TPU (one rule for the
loader and for `dsv4-aot`; docs/quantized_weights.md, docs/aot.md).

The release checkpoint stores the routed experts as FP4 codes, two per byte. XLA:TPU re-tiles such a uint8 stack in
every step it slices one expert from; the same values as uint32 words (eight codes per word, laid out within
column groups, `ops.quant.words_format`) are sliced and decoded inside the matmul fusion
(experiments/results/aot_release_ep_2026-12-04.md). And XLA:TPU wants a routed stack [.., E, N, K] stored with its
contraction dim major (`Layout(major_to_minor=(.., −1, −2))`): given the default row-major layout it copies every
w1 / w3 stack into that layout in every step (v5p:2x2x2, 5-layer Flash slice, decode B = 1: 11.1× the bytes bound
vs 1.24×; docs/aot.md, "One layout truth").

`for_run(params, backends, platform)` is that rule, for concrete trees (the loader: `load_checkpoint(...,
keep_quantized=True, sharding=...)`) and abstract ones (`jax.ShapeDtypeStruct` leaves: the programs `dsv4-aot`
compiles) alike, so the report compiles exactly the layout a run holds:

    routed leaf (path `...ffn.experts.w1|w2|w3`, drafters' included) that is a QArray, when the run's
    expert-parallel local matmul is an XLA one (`wants_words`):
        FP4 whose contraction dim holds whole 256-column groups per shard  ->  words (`quant.to_words`)
        on TPU                                                             ->  codes and scales k-major
    anything else                                                          ->  unchanged

A committed array keeps its layout (`jax.Array.format`) and `jax.jit` compiles for the layouts of the committed
arguments it is handed, so the run's programs see the same input layouts as the report's.
"""
from __future__ import annotations

import functools
import re

import jax
from jax.experimental.layout import Format, Layout

from ..backends import Backends
from ..ops import quant

ROUTED_EXPERTS = re.compile(r"(^|\.)ffn\.experts\.w[123]$")   # flat leaf paths of routed-expert stacks [E, N, K]
WORDS_LOCAL = ("dense",)     # EP local matmuls that read words (`backends.ep_local_auto`: TPUs but v5p)
K_MAJOR_PLATFORMS = ("tpu",)  # platforms whose compiler wants the routed stacks contraction-dim major


def wants_words(backends: Backends | None) -> bool:
    """Whether a run under these (resolved) backends reads routed FP4 experts as words: the expert-parallel MoE
    with an XLA local matmul in `WORDS_LOCAL` (the Pallas kernels read uint8 codes in the default layout)."""
    return backends is not None and backends.moe == "ep" and backends.ep is not None \
        and backends.ep.local in WORDS_LOCAL


def shard_group(q: quant.QArray) -> int:
    """The word layout's column group for q (concrete or abstract): the width of one shard of its contraction
    dim (0: K not split)."""
    k = q.shape[-1]
    sharding = getattr(q.codes, "sharding", None)
    k_local = sharding.shard_shape(q.codes.shape)[-1] * 2 if sharding is not None else k
    return 0 if k_local == k else k_local


def k_major(ndim: int) -> Layout:
    """The layout with an array's last two dims swapped in memory (major_to_minor .., −1, −2), tiling left to
    the compiler. (Asking for XLA:TPU's uint8 tiling T(8,128)(4,1) as well is rejected by the sharded programs:
    "Unexpected XLA layout override".)"""
    return Layout(major_to_minor=(*range(ndim - 2), ndim - 1, ndim - 2))


def for_run(params, backends: Backends | None, platform: str | None = None, words: bool | None = None):
    """params with every routed-expert QArray as a run under `backends` on `platform` holds it (module
    docstring); concrete leaves converted / re-laid out on their devices with their partition specs, abstract
    ones (`jax.ShapeDtypeStruct`) described the same way. platform None: the leaves' devices' (abstract leaves
    without devices: no k-major layout). words: None = `wants_words(backends)`; True / False forces the word
    conversion and the layout rule that goes with it. Exact: the same values."""
    convert = wants_words(backends) if words is None else words
    if not convert:
        return params

    def one(path, x):
        flat = ".".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)
        if not (isinstance(x, quant.QArray) and ROUTED_EXPERTS.search(flat)):
            return x
        group = shard_group(x)
        fmt = quant.words_format(group) if quant.words_fit(x, group) else x.fmt
        layout = (platform or _platform(x)) in K_MAJOR_PLATFORMS
        if fmt == x.fmt and not layout:
            return x
        return _abstract(x, fmt, layout) if _is_abstract(x) else _concrete(x, fmt, layout)
    return jax.tree_util.tree_map_with_path(one, params, is_leaf=quant.is_qarray)


def routed_experts_as_words(params):
    """`for_run` with the word conversion forced (platform from the leaves: k-major on TPU)."""
    return for_run(params, None, words=True)


def _is_abstract(q: quant.QArray) -> bool:
    return isinstance(q.codes, jax.ShapeDtypeStruct)


def _platform(q: quant.QArray) -> str | None:
    sharding = getattr(q.codes, "sharding", None)
    if sharding is None or isinstance(sharding, Format):
        return None
    try:
        return next(iter(sharding.device_set)).platform
    except (AttributeError, ValueError, StopIteration):   # abstract shardings (AbstractMesh) have no devices
        return None


def _placement(sharding, ndim: int, layout: bool):
    return Format(k_major(ndim), sharding) if layout else sharding


def _abstract(q: quant.QArray, fmt: quant.QFormat, layout: bool) -> quant.QArray:
    """The abstract QArray `_concrete` would make of abstract q."""
    c, s = quant.stored_shapes(fmt, q.shape) if fmt != q.fmt else (q.codes.shape, q.scale.shape)
    dc, ds = (q.codes.dtype, q.scale.dtype) if fmt == q.fmt else (quant.CODES[fmt.codes], quant.SCALES[fmt.scale])
    sds = lambda shape, dt, a: jax.ShapeDtypeStruct(shape, dt, sharding=_placement(a.sharding, len(shape), layout))
    return quant.QArray(sds(c, dc, q.codes), sds(s, ds, q.scale), fmt, q.dtype)


def _concrete(q: quant.QArray, fmt: quant.QFormat, layout: bool) -> quant.QArray:
    """q in format fmt (words when it differs) on q's devices, codes and scales partitioned as q's, k-major when
    layout."""
    c, s = quant.stored_shapes(fmt, q.shape) if fmt != q.fmt else (q.codes.shape, q.scale.shape)
    out = quant.QArray(_placement(q.codes.sharding, len(c), layout), _placement(q.scale.sharding, len(s), layout),
                       fmt, q.dtype)
    if fmt == q.fmt:
        return jax.device_put(q, out)
    return jax.jit(functools.partial(quant.to_words, group=fmt.block[1]), out_shardings=out)(q)
