"""Conversion jobs: plan (and check) every item, then stream unit by unit into an atomic output directory.

`plan_hf` / `plan_gguf` build the target job (plus MTP / DSpark jobs when the source holds them);
`plan_*_mtp` / `plan_*_dspark` build drafter jobs from separate files. `convert` writes a new
checkpoint; `add_drafters` merges drafter items onto an existing one. Host RAM is bounded by one
unit (one decoder layer) plus Orbax's copy of it.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import re
import warnings
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np
from tqdm import tqdm

from ...model import names
from ...config import ConfigError, ModelConfig, from_hf_config, load_hf_config
from ..outdir import AtomicDir

from . import gguf_io, plan as PL
from .hf_source import SafetensorsSource
from ..checkpoint import read_metadata as read_meta

from .writer import FORMAT_VERSION, META_FILE, ItemWriter, write_json_atomic

DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "bf16": np.dtype(ml_dtypes.bfloat16),
          "float32": np.dtype(np.float32), "f32": np.dtype(np.float32),
          "float16": np.dtype(np.float16), "f16": np.dtype(np.float16)}


@dataclasses.dataclass
class Job:
    item: str                              # "target" | "mtp" | "dspark"
    src: object                            # SafetensorsSource | GGUFSource
    units: list
    n_experts: int
    meta: dict                             # stored under items[item] in dsv4.json (source, drafter config)
    ignore_prefixes: tuple[str, ...] = ()
    allow_unused: tuple[str, ...] = ()
    scope: str = ""                        # only names with this prefix may be reported as unexpected
    total: int = 0
    allow_nonfinite: bool = False          # convert tensors holding NaN / inf (default: an error naming them)

    def check(self) -> "Job":
        self.total = PL.validate(self.src, self.units, self.n_experts, self.ignore_prefixes, self.allow_unused,
                                 what=f"{self.meta['source']['path']} ({self.item})", scope=self.scope)
        return self


def _hash_bias_names(config: ModelConfig, scheme: str) -> tuple[str, ...]:
    """Hash layers may ship an unused router bias (NeMo and llama.cpp drop it): tolerated."""
    return tuple(re.escape(names.layer_name(scheme, i, "ffn.gate.bias"))
                 for i in range(config.num_layers) if config.mlp_layer_types[i] == "hash_moe")


def _stage_indices(all_names, prefix: str) -> list[int]:
    pat = re.compile(re.escape(prefix) + r"(\d+)\.")
    return sorted({int(m.group(1)) for n in all_names if (m := pat.match(n))})


# ---- Hugging Face directories -----------------------------------------------------------------------

def detect_hf_scheme(names_: list[str]) -> str:
    """'official' (DeepSeek names) or 'hf' (transformers names)."""
    if any(n.startswith(("model.layers.", "model.embed_tokens")) for n in names_):
        return "hf"
    if any(n.startswith(("layers.", "embed.", "mtp.")) for n in names_):
        return "official"
    raise PL.ConvertError("cannot tell the checkpoint naming: neither official (`layers.N.*`) nor transformers "
                          "(`model.layers.N.*`) tensor names found")


def plan_hf(src_dir: str) -> tuple[ModelConfig, list[Job]]:
    """Target job (+ MTP or DSpark job for an official checkpoint holding `mtp.*`) of a safetensors directory."""
    if not os.path.isdir(src_dir):
        raise PL.ConvertError(f"{src_dir}: not a directory (SRC_DIR holds config.json and *.safetensors)"
                              if os.path.exists(src_dir) else f"{src_dir}: no such directory")
    config = load_hf_config(src_dir)
    src = SafetensorsSource(src_dir)
    scheme = detect_hf_scheme(src.names())
    E = config.n_routed_experts
    source = {"kind": f"hf-{scheme if scheme == 'official' else 'transformers'}", "path": os.path.abspath(src_dir)}
    jobs = [Job("target", src, PL.target_units(config, scheme), E, {"source": source},
                ignore_prefixes=names.IGNORED[scheme] + (("mtp.",) if scheme == "official" else ()),
                allow_unused=_hash_bias_names(config, scheme))]
    if scheme == "official" and any(n.startswith("mtp.") for n in src.names()):
        jobs.append(_official_drafter_job(src_dir, src, config, source))
    return config, jobs


def _official_drafter_job(path: str, src: SafetensorsSource, config: ModelConfig, source: dict) -> Job:
    """`mtp.*` of an official directory: DSpark stages if `mtp.0.main_proj` exists, else MTP blocks."""
    E = config.n_routed_experts
    stages = _stage_indices(src.names(), "mtp.")
    if stages != list(range(len(stages))):
        raise PL.ConvertError(f"{path}: mtp.* blocks are not numbered 0..n-1: {stages}")
    if "mtp.0.main_proj.weight" in src.names():
        meta = _dspark_meta_official(path, src, config, len(stages))
        return Job("dspark", src, PL.dspark_units(config, "official", meta), E,
                   {"source": source, "config": meta}, scope="mtp.")
    return Job("mtp", src, PL.mtp_units(config, "official", len(stages)), E,
               {"source": source, "num_layers": len(stages)}, scope="mtp.")


def _dspark_meta_official(path: str, src, config: ModelConfig, n_stages: int) -> dict:
    last = f"mtp.{n_stages - 1}."
    try:
        cfg = _read_json(os.path.join(path, "config.json"))
    except FileNotFoundError:
        cfg = {}
    given = (cfg.get("dspark_block_size"), cfg.get("dspark_noise_token_id"), cfg.get("dspark_target_layer_ids"))
    return _dspark_meta(src, config, n_stages, "official", given,
                        conf_bias=f"{last}confidence_head.proj.bias" in src.names())


def _dspark_meta(src, config: ModelConfig, n_stages: int, scheme: str, given: tuple, conf_bias: bool) -> dict:
    """The DSpark config of a source: stages, taps and Markov rank from its tensors; given: the source's
    (block size, noise token id, target layer ids), each None when it does not say."""
    block_size, noise, targets = given
    D = config.hidden_size
    mp = names.dspark_tensor(scheme, "main_proj", n_stages)
    w1 = names.dspark_tensor(scheme, "markov_w1", n_stages)
    for t in (mp, w1):
        if t not in src.names():
            raise PL.ConvertError(f"{getattr(src, 'path', '?')}: DSpark tensor {t!r} missing")
    n_in = src.shape(mp)[1]
    if n_in % D:
        raise PL.ConvertError(f"DSpark {mp} has input width {n_in}, not a multiple of hidden_size {D}")
    return {"n_stages": n_stages, "n_taps": n_in // D, "markov_rank": int(src.shape(w1)[1]),
            "conf_bias": bool(conf_bias), "block_size": None if block_size is None else int(block_size),
            "noise_token_id": None if noise is None else int(noise),
            "target_layer_ids": None if targets is None else [int(t) for t in targets]}


def _read_json(path: str) -> dict:
    import json
    with open(path) as f:
        return json.load(f)


def plan_hf_drafter(path: str, config: ModelConfig, kind: str | None = None) -> Job:
    """A separate official-format drafter directory (e.g. DeepSeek-V4-Flash-DSpark: only `mtp.*` tensors)."""
    src = SafetensorsSource(path)
    if not any(n.startswith("mtp.") for n in src.names()):
        raise PL.ConvertError(f"{path}: no mtp.* tensors (not an MTP / DSpark checkpoint)")
    job = _official_drafter_job(path, src, config, {"kind": "hf-official", "path": os.path.abspath(path)})
    if kind is not None and job.item != kind:
        raise PL.ConvertError(f"{path}: holds a {job.item} drafter, but was given as --{kind}")
    return job


# ---- GGUF files -------------------------------------------------------------------------------------------

def _gguf_arch(src: gguf_io.GGUFSource, want: str) -> None:
    arch = src.arch
    if arch == want:
        return
    hint = " (a DSpark drafter file: pass it with --dspark)" if arch == "dflash" else ""
    raise gguf_io.GGUFError(f"{src.path}: general.architecture is {arch!r}, expected {want!r}{hint}")


def plan_gguf(path: str) -> tuple[ModelConfig, list[Job]]:
    src = gguf_io.GGUFSource(path)
    _gguf_arch(src, "deepseek4")
    try:
        config = from_hf_config(gguf_io.config_dict(src))
    except ConfigError as e:
        raise ConfigError(f"{src.path}: {e}") from None
    n_mtp = config.num_nextn_predict_layers if f"blk.{config.num_layers}.nextn.eh_proj.weight" in src.names() else 0
    scheme = "ds4" if any(n.startswith(("mtp.", "dspark.")) for n in src.names()) else "llamacpp"
    source = {"kind": f"gguf-{scheme}", "path": os.path.abspath(path), "files": src.paths}
    mtp_ignore = tuple(f"blk.{config.num_layers + i}." for i in range(n_mtp))
    jobs = [Job("target", src, PL.target_units(config, "llamacpp"), config.n_routed_experts, {"source": source},
                ignore_prefixes=names.IGNORED["llamacpp"] + mtp_ignore + ("mtp.",),
                allow_unused=_hash_bias_names(config, "llamacpp"))]
    if n_mtp:      # MTP inside the main file as blk.{n_layer} (docs/drafter_math.md §5.2)
        jobs.append(plan_gguf_mtp(path, config, src))
    return config, jobs


def plan_gguf_mtp(path: str, config: ModelConfig, src: gguf_io.GGUFSource | None = None) -> Job:
    """llama.cpp `--mtp` file (blk.{n_layer}.* + nextn.*) or ds4 MTP file (mtp.0.*) (docs/checkpoint_formats.md §1.2)."""
    src = src or gguf_io.GGUFSource(path)
    _gguf_arch(src, "deepseek4")
    _check_dims(src, config)
    ds4 = any(n.startswith("mtp.") for n in src.names())
    scheme = "ds4" if ds4 else "llamacpp"
    if ds4:
        n = len(_stage_indices(src.names(), "mtp."))
        ignore = ()
    else:
        n = len([i for i in range(8) if f"blk.{config.num_layers + i}.nextn.eh_proj.weight" in src.names()])
        ignore = tuple(f"blk.{i}." for i in range(config.num_layers))   # target layers, when inside the main file
    if n == 0:
        raise PL.ConvertError(f"{path}: no MTP tensors (expected blk.{config.num_layers}.nextn.* or mtp.0.*)")
    units = PL.mtp_units(config, scheme, n)
    top = tuple(names.TOP_NAMES[k][2] for k in ("embed", "head", "norm"))
    return Job("mtp", src, units, config.n_routed_experts,
               {"source": {"kind": f"gguf-{scheme}", "path": os.path.abspath(path), "files": src.paths},
                "num_layers": n}, ignore_prefixes=ignore + top + names.IGNORED[scheme])


def _check_dims(src: gguf_io.GGUFSource, config: ModelConfig, arch: str = "deepseek4") -> None:
    for key, want in (("embedding_length", config.hidden_size), ("expert_count", config.n_routed_experts)):
        got = src.field(f"{arch}.{key}")
        if got is not None and int(got) != want:
            raise PL.ConvertError(f"{src.path}: {arch}.{key} = {got}, but the target model has {want}")


def plan_gguf_dspark(path: str, config: ModelConfig) -> Job:
    """llama.cpp `dflash` file (fc, markov_w*, conf_proj, blk.{s}.*) or ds4 support file (dspark.*)."""
    src = gguf_io.GGUFSource(path)
    if src.arch == "dflash":
        scheme, a = "llamacpp", "dflash."
        n = len(_stage_indices(src.names(), "blk."))
        targets = src.field(a + "target_layers")
        targets = None if targets is None else [int(t) - 1 for t in targets]   # stored as ids + 1 (§1.2)
        block, noise = src.field(a + "block_size"), src.field("tokenizer.ggml.mask_token_id")
    elif src.arch == "deepseek4" and any(n.startswith("dspark.") for n in src.names()):
        scheme, a = "ds4", "deepseek4."
        n = len(_stage_indices(src.names(), "dspark."))
        block = src.field(a + "dspark.block_size", src.field("dspark.block_size"))
        noise = src.field(a + "dspark.noise_token_id", src.field("tokenizer.ggml.mask_token_id"))
        targets = src.field(a + "dspark.target_layer_ids")
    else:
        raise gguf_io.GGUFError(f"{src.path}: general.architecture is {src.arch!r}; a DSpark file is 'dflash' "
                                "(llama.cpp) or 'deepseek4' with dspark.* tensors (ds4)")
    _check_dims(src, config, "dflash" if scheme == "llamacpp" else "deepseek4")
    bias = names.dspark_tensor(scheme, "conf_proj.bias", max(n, 1))
    meta = _dspark_meta(src, config, n, scheme, (block, noise, targets), conf_bias=bias in src.names())
    return Job("dspark", src, PL.dspark_units(config, scheme, meta), config.n_routed_experts,
               {"source": {"kind": f"gguf-{scheme}", "path": os.path.abspath(path), "files": src.paths},
                "config": meta}, ignore_prefixes=names.IGNORED[scheme])


# ---- running ---------------------------------------------------------------------------------------------------

class LossyConversionWarning(UserWarning):
    """Some tensors were rounded on the way into the checkpoint (the message says which and by how much)."""


# what each lossy (source -> stored) step loses, beyond the measured change
_LOSS_NOTES = {
    "q8_0": "each int8 × f16 product needs up to 19 significant bits",
    "ggml": "the exactly dequantized values are requantized to int8 per 32 (half a step ≤ max|block| / 254)",
}


def _describe_losses(losses: dict) -> str:
    lines = []
    for (src, dst), (n, err) in sorted(losses.items()):
        note = _LOSS_NOTES["ggml"] if src.startswith("ggml_") else _LOSS_NOTES.get(src, "values rounded")
        lines.append(f"  {src} -> {dst}: {n} tensor(s), max change {err:.2e} of a tensor's max |value| ({note})")
    return ("lossy conversion:\n" + "\n".join(lines) + "\nRounded weights can flip router / indexer top-k "
            "choices and change logits by O(1) against the source's own values. The default (no --dtype) keeps "
            "FP8 / FP4 / Q8_0 / MXFP4 codes and dense dtypes exactly; --dtype f32 dequantizes everything exactly "
            "(K- / IQ-quants are exact only with --dtype f32).")


def _read_unit(job: Job, unit, dtype, keep: bool, losses: dict | None = None) -> tuple[dict, int]:
    """Read and repack one unit: ({leaf path: array | QArray}, source bytes read); roundings noted in `losses`."""
    flat, seen = {}, set()
    for leaf in unit.leaves:
        tensors = PL.leaf_tensors(leaf, job.n_experts)
        if leaf.optional and any(t not in job.src.names() for t in tensors):
            continue
        what = f"{getattr(job.src, 'path', '?')}: tensor {tensors[0]!r}" + (" (and its experts)" if len(tensors) > 1
                                                                            else "")
        try:
            flat[leaf.path] = PL.convert_leaf(PL.read_leaf(job.src, leaf, job.n_experts), leaf.spec, dtype, keep,
                                              losses)
        except PL.ConvertError as e:
            raise PL.ConvertError(f"{what}: {e}") from None
        if not job.allow_nonfinite:
            PL.check_finite(flat[leaf.path], what)
        seen.update(tensors)
    return flat, sum(job.src.nbytes(t) for t in seen)


def run_job(job: Job, item_dir: str, dtype, keep: bool, bar, losses: dict | None = None) -> dict:
    """Stream the job's units into one Orbax item.

    Two-stage pipeline: a worker thread reads + repacks unit i+1 (file reads, numpy; both release the GIL)
    while this thread writes unit i through Orbax, so host RAM holds at most two units plus Orbax's copy.
    """
    w = ItemWriter(item_dir)
    with ThreadPoolExecutor(1, thread_name_prefix="dsv4-read") as pool:
        units = list(job.units)
        nxt = pool.submit(_read_unit, job, units[0], dtype, keep, losses) if units else None
        for i, unit in enumerate(units):
            flat, nbytes = nxt.result()
            nxt = pool.submit(_read_unit, job, units[i + 1], dtype, keep, losses) if i + 1 < len(units) else None
            w.save(unit.key, flat)
            del flat
            bar.update(nbytes)
    w.finalize()
    return dict(job.meta, leaves=w.leaves)


def _progress(total: int, desc: str, quiet: bool):
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, disable=quiet,
                dynamic_ncols=True, smoothing=0.1)


def _conversion_meta(dtype, keep: bool, losses: dict | None = None) -> dict:
    out = {"dtype": np.dtype(dtype).name, "keep_quantized": bool(keep), "converter": "dsv4-convert",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if losses:
        out["lossy"] = [{"source": s, "stored": d, "tensors": n, "max_relative_change": e}
                        for (s, d), (n, e) in sorted(losses.items())]
    return out


def _warn_losses(losses: dict) -> None:
    if losses:
        warnings.warn(_describe_losses(losses), LossyConversionWarning, stacklevel=3)


def convert(out_dir: str, config: ModelConfig, jobs: list[Job], *, dtype="bfloat16", keep_quantized=True,
            overwrite=False, quiet=False, allow_nonfinite=False) -> dict:
    """Check every job, then write a new checkpoint at `out_dir` atomically. Returns the metadata written.

    keep_quantized (default): quantized tensors keep their codes (K- / IQ-quants become Q8_0, with a
    LossyConversionWarning) and dtype is only load_checkpoint's default compute dtype; False: every weight
    is dequantized to dtype (a LossyConversionWarning says what was rounded)."""
    dtype = DTYPES[dtype] if isinstance(dtype, str) else np.dtype(dtype)
    for j in jobs:
        j.check()
        j.allow_nonfinite = j.allow_nonfinite or allow_nonfinite
    items = [j.item for j in jobs]
    if len(set(items)) != len(items):
        raise PL.ConvertError(f"two sources for the same item: {items}")
    losses: dict = {}
    meta = {"format_version": FORMAT_VERSION, "config": config.to_dict(), "source": jobs[0].meta["source"],
            "items": {}}
    with AtomicDir(out_dir, overwrite, label="OUT_DIR") as d:
        with _progress(sum(j.total for j in jobs), "convert", quiet) as bar:
            for j in jobs:
                meta["items"][j.item] = run_job(j, os.path.join(d.tmp, j.item), dtype, keep_quantized, bar, losses)
        meta["conversion"] = _conversion_meta(dtype, keep_quantized, losses)
        write_json_atomic(os.path.join(d.tmp, META_FILE), meta)
        d.commit()
    _warn_losses(losses)
    return meta


def add_drafters(ckpt_dir: str, jobs: list[Job], *, dtype=None, keep_quantized=None, overwrite=False,
                 quiet=False, allow_nonfinite=False) -> dict:
    """Convert drafter jobs into `ckpt_dir/{mtp,dspark}` of an existing checkpoint (each item atomic)."""
    meta = read_meta(ckpt_dir)
    conv = meta["conversion"]
    name = dtype or conv["dtype"]
    dtype = DTYPES[name] if isinstance(name, str) else np.dtype(name)
    keep = conv["keep_quantized"] if keep_quantized is None else keep_quantized
    for j in jobs:
        j.check()
        j.allow_nonfinite = j.allow_nonfinite or allow_nonfinite
    losses: dict = {}
    with _progress(sum(j.total for j in jobs), "drafters", quiet) as bar:
        for j in jobs:
            mine: dict = {}
            with AtomicDir(os.path.join(ckpt_dir, j.item), overwrite, create=False, label="drafter") as d:
                item = run_job(j, d.tmp, dtype, keep, bar, mine)   # Orbax creates the directory itself
                item["conversion"] = _conversion_meta(dtype, keep, mine)
                d.commit()
            meta["items"][j.item] = item
            write_json_atomic(os.path.join(ckpt_dir, META_FILE), meta)
            losses.update({k: (losses.get(k, (0, 0.0))[0] + v[0], max(losses.get(k, (0, 0.0))[1], v[1]))
                           for k, v in mine.items()})
    _warn_losses(losses)
    return meta


def config_of(ckpt_dir: str) -> ModelConfig:
    try:
        return ModelConfig.from_dict(read_meta(ckpt_dir)["config"])
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
