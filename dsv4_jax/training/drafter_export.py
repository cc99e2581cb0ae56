"""Write a trained drafter into a checkpoint, in the format `load_checkpoint` reads and `dsv4-convert
drafter` writes (convert/writer.py): an Orbax item `mtp/` ({"0": block}) or `dspark/` (head leaves +
{"stages": {"0": ...}}) and its record under `items` in dsv4.json.

Two ways, never leaving a half-written checkpoint:
  * `export_copy(OUT, ...)` (the default of dsv4-train-drafter): a new checkpoint directory holding the
    source model with the new drafter item. A converted source's other items are hard-linked (copied where
    the file system cannot link: Orbax never rewrites a file in place, so sharing them is safe); a bundle or
    the bundled tiny model is written out in full (the target, its other drafter, the new one). Everything
    goes to `OUT.incomplete-<pid>` and is renamed when complete: one atomic step.
  * `export_into(CKPT, ...)` (`--write-into`): the item is written next to CKPT's items under a temporary
    name, then swapped in by renames and dsv4.json replaced atomically. Readers never see a partial item;
    a crash between the renames (microseconds) can leave the previous item as `CKPT/<item>.replaced-<pid>`
    with dsv4.json not yet updated, which `check_leftovers` reports.
"""
from __future__ import annotations

import datetime
import errno
import json
import os
import shutil

import numpy as np

from ..model import params as P
from ..io.checkpoint import META_FILE, read_metadata
from ..config import ModelConfig
from ..io.convert.writer import FORMAT_VERSION, ItemWriter, write_json_atomic
from ..io.outdir import AtomicDir
from ..model.schedule import segments


class ExportError(ValueError):
    """The drafter cannot be written there (another model's checkpoint, leftovers of a crashed write)."""


def _cast(tree, specs, dtype) -> dict:
    """Flat {path: numpy array} with compute-dtype leaves in `dtype` (float32 / int leaves kept)."""
    flat_specs = P.flatten(specs)
    return {k: np.asarray(v).astype(flat_specs[k].dtype(dtype)) for k, v in P.flatten(tree).items()}


def drafter_units(kind: str, drafter, specs, dtype) -> list[tuple[tuple[str, ...], dict]]:
    """(unit key, flat leaves) of the drafter item, in the converter's layout (convert/plan.py units)."""
    flat = _cast(drafter, specs, dtype)
    if kind == "mtp":
        return [(("0",), flat)]
    head = {k: v for k, v in flat.items() if not k.startswith("stages.")}
    n = len(specs["stages"])
    stages = [(("stages", str(s)), {k[len(f"stages.{s}."):]: v for k, v in flat.items()
                                    if k.startswith(f"stages.{s}.")}) for s in range(n)]
    return [((), head)] + stages


def target_units(target: dict, config: ModelConfig, dtype) -> list[tuple[tuple[str, ...], dict]]:
    """The target item's units: top-level leaves, then one unit per layer (scan segments unstacked)."""
    specs = P.param_specs(config)
    top = _cast({k: v for k, v in target.items() if k != "segments"}, {k: v for k, v in specs.items()
                                                                       if k != "segments"}, dtype)
    units = [((), top)]
    for s, seg in enumerate(segments(config)):
        for r in range(seg.reps):
            for j in range(seg.pattern):
                layer = {k: v[r] for k, v in P.flatten(target["segments"][s][j]).items()}
                lspecs = P.flatten(P.layer_specs(config, seg.layer_index(j, r)))
                units.append((("layers", f"{seg.layer_index(j, r):02d}"),
                              {k: np.asarray(v).astype(lspecs[k].dtype(dtype)) for k, v in layer.items()}))
    return sorted(units, key=lambda u: u[0])


def write_item(item_dir: str, units) -> dict:
    """Stream the units into a new Orbax item at item_dir; returns the per-leaf records for dsv4.json."""
    w = ItemWriter(item_dir)
    for key, flat in units:
        w.save(key, flat)
    w.finalize()
    return w.leaves


def drafter_record(kind: str, task, source: dict, dtype) -> dict:
    """The item's record in dsv4.json, without `leaves` (as dsv4-convert writes it)."""
    rec = {"source": source, "conversion": conversion_meta(dtype)}
    if kind == "mtp":
        rec["num_layers"] = 1
    else:
        d = task.dcfg
        rec["config"] = {"n_stages": task.n_stages, "n_taps": len(d.target_layer_ids), "markov_rank": task.markov_rank,
                         "conf_bias": task.conf_bias, "block_size": d.block_size, "noise_token_id": d.noise_token_id,
                         "target_layer_ids": list(d.target_layer_ids)}
    return rec


def conversion_meta(dtype) -> dict:
    return {"dtype": np.dtype(dtype).name, "keep_quantized": False, "converter": "dsv4-train-drafter",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _link_tree(src: str, dst: str) -> str:
    """Hard-link every file of src under dst (copy when linking fails); returns 'hardlink' or 'copy'."""
    how = "hardlink"
    for d, _, files in os.walk(src):
        rel = os.path.relpath(d, src)
        os.makedirs(os.path.join(dst, rel), exist_ok=True)
        for f in files:
            a, b = os.path.join(d, f), os.path.join(dst, rel, f)
            try:
                os.link(a, b)
            except OSError as e:
                if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES):
                    raise
                shutil.copy2(a, b)
                how = "copy"
    return how


def export_copy(out: str, *, kind: str, drafter, specs, record: dict, dtype, source_checkpoint: str | None = None,
                source_units: dict | None = None, source_meta: dict | None = None, overwrite: bool = False) -> dict:
    """A new checkpoint at `out`: the source model plus the drafter item `kind`.

    source_checkpoint: a dsv4-convert checkpoint whose other items are linked; or source_units
    {item: units} + source_meta (dsv4.json without the items) for a model held in memory (bundle).
    Returns the dsv4.json written.
    """
    with AtomicDir(out, overwrite=overwrite) as d:
        if source_checkpoint is not None:
            meta = read_metadata(source_checkpoint)
            how = None
            for item in meta["items"]:
                if item != kind:
                    how = _link_tree(os.path.join(source_checkpoint, item), os.path.join(d.tmp, item))
            meta = dict(meta, items={k: v for k, v in meta["items"].items() if k != kind})
            meta["derived_from"] = {"path": os.path.abspath(source_checkpoint), "items": how}
        else:
            meta = dict(source_meta, items={})
            for item, units in source_units.items():
                rec = units["record"]
                meta["items"][item] = dict(rec, leaves=write_item(os.path.join(d.tmp, item), units["units"]))
        meta["items"][kind] = dict(record, leaves=write_item(os.path.join(d.tmp, kind),
                                                             drafter_units(kind, drafter, specs, dtype)))
        write_json_atomic(os.path.join(d.tmp, META_FILE), meta)
        d.commit()
    return meta


def check_leftovers(ckpt: str) -> None:
    """ExportError when an earlier --write-into was interrupted between its renames."""
    left = [f for f in os.listdir(ckpt) if ".replaced-" in f]
    if left:
        raise ExportError(f"{ckpt}: {', '.join(sorted(left))} left by an interrupted --write-into: check that "
                          f"{META_FILE} matches the items, then remove the leftover")


def check_target(ckpt: str, config: ModelConfig) -> dict:
    """dsv4.json of ckpt; ExportError unless it holds the same target model."""
    meta = read_metadata(ckpt)
    if ModelConfig.from_dict(meta["config"]) != config:
        raise ExportError(f"--write-into {ckpt}: its model config differs from the trained target's")
    check_leftovers(ckpt)
    return meta


def export_into(ckpt: str, *, kind: str, drafter, specs, record: dict, dtype, config: ModelConfig) -> dict:
    """Add or replace the drafter item `kind` of an existing checkpoint (see the module docstring)."""
    ckpt = os.path.abspath(ckpt)
    meta = check_target(ckpt, config)
    final, pid = os.path.join(ckpt, kind), os.getpid()
    with AtomicDir(os.path.join(ckpt, f"{kind}.new"), overwrite=True, create=False) as d:
        leaves = write_item(d.tmp, drafter_units(kind, drafter, specs, dtype))
        meta = dict(meta, items=dict(meta["items"], **{kind: dict(record, leaves=leaves)}))
        new_json = os.path.join(ckpt, f"{META_FILE}.new-{pid}")
        with open(new_json, "w") as f:
            json.dump(meta, f, indent=1, sort_keys=True)
        old = f"{final}.replaced-{pid}"
        if os.path.exists(final):
            os.rename(final, old)
        os.rename(d.tmp, final)
        d.committed = True
        os.replace(new_json, os.path.join(ckpt, META_FILE))
        shutil.rmtree(old, ignore_errors=True)
    return meta


__all__ = ["ExportError", "FORMAT_VERSION", "check_target", "drafter_record", "drafter_units", "export_copy",
           "export_into", "target_units", "write_item"]
