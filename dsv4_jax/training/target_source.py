"""The frozen target a drafter is trained against: the bundled tiny model, a bundle, or a converted checkpoint.

    tiny-demo        the bundled tiny model (`dsv4_jax.tiny_demo()`, byte vocabulary); also "bundled"
    DIR/bundle.json  a bundle written by `dsv4_jax.io.demo_io.save_bundle` (e.g. experiments/train_tiny.py)
    DIR/dsv4.json    a checkpoint written by `dsv4-convert` (any stored format `load_checkpoint` reads)

`describe` reads metadata only (a checkpoint's dsv4.json; a bundle's small weight file), so every check
runs before the weights are loaded; `load` restores the target (onto a mesh when given) and the model's own
drafters (for `--init drafter`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os

from ..io.checkpoint import CheckpointConfig, load_checkpoint, read_metadata
from ..config import ModelConfig
from ..demo import ASSET_DIR, demo_dspark_config
from ..io.demo_io import META as BUNDLE_META, load_bundle
from ..drafters.dspark import DSparkConfig
from ..model import params as P
from .. import parallel

TINY_DEMO = ("tiny-demo", "bundled")


class ModelError(ValueError):
    """The --model cannot be used (missing, not a bundle or checkpoint)."""


@dataclasses.dataclass
class DSparkShape:
    """The shape-defining values of an existing DSpark drafter, and its settings."""

    n_stages: int
    markov_rank: int
    conf_bias: bool
    dcfg: DSparkConfig


@dataclasses.dataclass
class TargetSource:
    spec: str                       # as given on the command line
    kind: str                       # "tiny-demo" | "bundle" | "checkpoint"
    path: str                       # the directory holding it
    config: ModelConfig
    has_mtp: bool
    dspark: DSparkShape | None      # the model's own DSpark drafter, if any
    stored_dtype: str               # what the weights are stored as (bf16 for bundles)
    fingerprint: str                # identifies the weights (config, path, size / conversion record)

    @property
    def is_checkpoint(self) -> bool:
        return self.kind == "checkpoint"


def _bundle_dspark(config: ModelConfig, info: dict, dparams: dict | None, tiny: bool) -> DSparkShape | None:
    if dparams is None:
        return None
    d = info.get("dspark")
    if isinstance(d, dict):
        dcfg = DSparkConfig(**{k: tuple(v) if k == "target_layer_ids" else v for k, v in d.items()
                               if k in {f.name for f in dataclasses.fields(DSparkConfig)}})
    elif tiny or config.name == "tiny_demo":
        dcfg = demo_dspark_config()
    else:
        n = dparams["main_proj"].shape[1] // config.hidden_size
        dcfg = DSparkConfig(block_size=5, noise_token_id=config.vocab_size - 1,
                            target_layer_ids=tuple(range(config.num_layers - n, config.num_layers)))
    return DSparkShape(len(dparams["stages"]), int(dparams["markov_w1"].shape[1]), "bias" in dparams["conf_proj"], dcfg)


def _file_id(path: str) -> str:
    st = os.stat(path)
    return f"{os.path.abspath(path)}:{st.st_size}:{int(st.st_mtime)}"


def _fingerprint(config: ModelConfig, extra: str) -> str:
    return hashlib.sha1((json.dumps(config.to_dict(), sort_keys=True) + extra).encode()).hexdigest()[:16]


def describe(spec: str) -> TargetSource:
    """The model named by --model, from its metadata (ModelError when it is none of the three kinds)."""
    if spec in TINY_DEMO:
        path, kind = ASSET_DIR, "tiny-demo"
        if not os.path.exists(os.path.join(path, BUNDLE_META)):
            raise ModelError(f"the bundled tiny model is not installed (no {BUNDLE_META} in {path})")
    elif not os.path.isdir(spec):
        raise ModelError(f"--model {spec!r}: not a directory (a dsv4-convert checkpoint or a bundle) nor "
                         f"one of {', '.join(TINY_DEMO)}")
    elif os.path.exists(os.path.join(spec, "dsv4.json")):
        path, kind = spec, "checkpoint"
    elif os.path.exists(os.path.join(spec, BUNDLE_META)):
        path, kind = spec, "bundle"
    else:
        raise ModelError(f"--model {spec!r}: neither a dsv4-convert checkpoint (dsv4.json) nor a bundle "
                         f"({BUNDLE_META})")
    if kind == "checkpoint":
        meta = read_metadata(path)
        config = ModelConfig.from_dict(meta["config"])
        items = meta["items"]
        ds = None
        if "dspark" in items:
            c = items["dspark"]["config"]
            n_taps = c["n_taps"]
            dcfg = DSparkConfig(block_size=c.get("block_size") or 5,
                                noise_token_id=config.vocab_size - 1 if c.get("noise_token_id") is None
                                else c["noise_token_id"],
                                target_layer_ids=tuple(c.get("target_layer_ids") or
                                                       range(config.num_layers - n_taps, config.num_layers)))
            ds = DSparkShape(c["n_stages"], c["markov_rank"], c["conf_bias"], dcfg)
        rec = json.dumps(items["target"].get("leaves", {}), sort_keys=True) + json.dumps(meta.get("conversion"))
        return TargetSource(spec, kind, os.path.abspath(path), config, "mtp" in items, ds,
                            meta["conversion"].get("dtype", "bfloat16"),
                            _fingerprint(config, os.path.abspath(path) + hashlib.sha1(rec.encode()).hexdigest()))
    config, params, info = load_bundle(path)
    return TargetSource(spec, kind, os.path.abspath(path), config, bool(params.get("mtp")),
                        _bundle_dspark(config, info, params.get("dspark"), kind == "tiny-demo"), "bfloat16",
                        _fingerprint(config, _file_id(os.path.join(path, "weights.npz"))))


def load(src: TargetSource, dtype, mesh=None) -> tuple[dict, dict]:
    """(target params in `dtype`, the model's own drafters {"mtp": block, "dspark": tree}) on the mesh."""
    if src.is_checkpoint:
        cfg, params = load_checkpoint(src.path, dtype=dtype, mesh=mesh)
        if isinstance(cfg, CheckpointConfig):
            cfg = cfg.target
    else:
        cfg, params, _ = load_bundle(src.path)
        params = dict(P.cast_params({k: v for k, v in params.items() if k not in ("mtp", "dspark")}, cfg, dtype),
                      **{k: v for k, v in params.items() if k in ("mtp", "dspark")})
        if mesh is not None:
            params = parallel.shard_params(params, cfg, mesh)
    own = {}
    if params.get("mtp"):
        own["mtp"] = params["mtp"][0]
    if "dspark" in params:
        own["dspark"] = params["dspark"]
    target = {k: v for k, v in params.items() if k not in ("mtp", "dspark")}
    return target, own
