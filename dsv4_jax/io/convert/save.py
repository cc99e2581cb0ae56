"""Write a parameter tree held in memory (target + drafters) as a dsv4-convert checkpoint.

The on-disk format is the converter's (`writer` module doc: dsv4.json + Orbax items target/, mtp/,
dspark/ with one entry per layer), so a trained or bundled model (`dsv4_jax.tiny_demo()`) loads
with `dsv4_jax.load_checkpoint` exactly like a converted release, onto a mesh included. Leaves are
stored dense: weights in `dtype`, the float32 / int32 leaves (norms, HC, sinks, biases, `tid2eid`)
as they are. Written atomically, with the output-directory rule of `dsv4_jax.io.outdir`.

    from dsv4_jax.io.convert.save import save_checkpoint
    save_checkpoint("ckpt/tiny", demo.config, demo.params, dspark_meta=demo.dspark)
"""
from __future__ import annotations

import datetime
import os

import ml_dtypes
import numpy as np

from ...model import params as P
from ...config import ModelConfig
from ..outdir import AtomicDir
from ...model.schedule import segments

from .writer import FORMAT_VERSION, META_FILE, ItemWriter, write_json_atomic

_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "bf16": ml_dtypes.bfloat16, "float32": np.float32, "f32": np.float32,
           "float16": np.float16, "f16": np.float16}


def _cast(flat: dict, specs: dict[str, P.ParamSpec], dtype) -> dict[str, np.ndarray]:
    """Host numpy copies of the leaves, weights cast to `dtype` (the spec decides which leaves are weights)."""
    missing = sorted(set(specs) - set(flat))
    if missing:
        raise ValueError(f"params lack leaves {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    return {p: np.asarray(flat[p]).astype(np.dtype(s.dtype(dtype))) for p, s in specs.items()}


def _save_target(item_dir: str, config: ModelConfig, params: dict, dtype) -> dict[str, dict]:
    """Top-level leaves, then one Orbax entry per layer (`layers.NN`, unstacked from the scan segments)."""
    w = ItemWriter(item_dir)
    top = {k: v for k, v in params.items() if k not in ("segments", "mtp", "dspark")}
    top_specs = P.flatten({k: v for k, v in P.param_specs(config).items() if k != "segments"})
    w.save((), _cast(P.flatten(top), top_specs, dtype))
    for s, seg in enumerate(segments(config)):
        for j in range(seg.pattern):
            stacked = P.flatten(params["segments"][s][j])        # leaves [reps, ...]
            layer_specs = P.flatten(P.layer_specs(config, seg.start + j))
            for r in range(seg.reps):
                one = {p: np.asarray(x)[r] for p, x in stacked.items()}
                w.save(("layers", f"{seg.layer_index(j, r):02d}"), _cast(one, layer_specs, dtype))
    w.finalize()
    return w.leaves


def _save_mtp(item_dir: str, config: ModelConfig, blocks: list, dtype) -> dict[str, dict]:
    w = ItemWriter(item_dir)
    specs = P.flatten(P.mtp_specs(config))
    for i, block in enumerate(blocks):
        w.save((str(i),), _cast(P.flatten(block), specs, dtype))
    w.finalize()
    return w.leaves


def dspark_item_config(config: ModelConfig, tree: dict, dspark_meta=None) -> dict:
    """The `config` record of a DSpark item (`checkpoint.DSparkMeta` fields) from the tree's shapes and
    the run settings of `dspark_meta` (a DSparkConfig or DSparkMeta; None: unknown, resolved at load)."""
    get = lambda k: getattr(dspark_meta, k, None)  # noqa: E731
    targets = get("target_layer_ids")
    return {"n_stages": len(tree["stages"]), "n_taps": int(np.shape(tree["main_proj"])[1]) // config.hidden_size,
            "markov_rank": int(np.shape(tree["markov_w1"])[1]), "conf_bias": "bias" in tree["conf_proj"],
            "block_size": None if get("block_size") is None else int(get("block_size")),
            "noise_token_id": None if get("noise_token_id") is None else int(get("noise_token_id")),
            "target_layer_ids": None if targets is None else [int(t) for t in targets]}


def _save_dspark(item_dir: str, config: ModelConfig, tree: dict, meta: dict, dtype) -> dict[str, dict]:
    w = ItemWriter(item_dir)
    specs = P.dspark_specs(config, meta["n_stages"], meta["n_taps"], meta["markov_rank"], meta["conf_bias"])
    head_specs = P.flatten({k: v for k, v in specs.items() if k != "stages"})
    w.save((), _cast(P.flatten({k: v for k, v in tree.items() if k != "stages"}), head_specs, dtype))
    for s, stage in enumerate(tree["stages"]):
        w.save(("stages", str(s)), _cast(P.flatten(stage), P.flatten(specs["stages"][s]), dtype))
    w.finalize()
    return w.leaves


def save_checkpoint(path: str | os.PathLike, config: ModelConfig, params: dict, *, dspark_meta=None,
                    dtype="bfloat16", overwrite: bool = False) -> dict:
    """Write `params` (target tree; optional params["mtp"]: list of MTP blocks, params["dspark"]: DSpark
    tree) as a checkpoint at `path`. dtype: storage dtype of the weight leaves (bfloat16 | float32 |
    float16). dspark_meta: block size / noise token / tap layers to record (e.g. `tiny_demo().dspark`).
    Returns the dsv4.json metadata written."""
    dt = _DTYPES[dtype] if isinstance(dtype, str) else np.dtype(dtype)
    source = {"kind": "params", "path": None}
    meta = {"format_version": FORMAT_VERSION, "config": config.to_dict(), "source": source, "items": {},
            "conversion": {"dtype": np.dtype(dt).name, "keep_quantized": False, "converter": "save_checkpoint",
                           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}}
    with AtomicDir(path, overwrite) as d:
        meta["items"]["target"] = {"source": source,
                                   "leaves": _save_target(os.path.join(d.tmp, "target"), config, params, dt)}
        if params.get("mtp"):
            meta["items"]["mtp"] = {"source": source, "num_layers": len(params["mtp"]),
                                    "leaves": _save_mtp(os.path.join(d.tmp, "mtp"), config, params["mtp"], dt)}
        if params.get("dspark"):
            cfg = dspark_item_config(config, params["dspark"], dspark_meta)
            meta["items"]["dspark"] = {"source": source, "config": cfg,
                                       "leaves": _save_dspark(os.path.join(d.tmp, "dspark"), config,
                                                              params["dspark"], cfg, dt)}
        write_json_atomic(os.path.join(d.tmp, META_FILE), meta)
        d.commit()
    return meta
