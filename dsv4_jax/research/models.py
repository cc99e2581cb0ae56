"""Model selection shared by the research CLIs: the bundled tiny model, a bundle / checkpoint directory,
or a random tiny model for smoke tests.

    (default)       the bundled tiny model (`dsv4_jax.demo.tiny_demo()`)
    --model DIR     a bundle written by `dsv4_jax.io.demo_io.save_bundle` (DIR/bundle.json) or a checkpoint
                    written by `dsv4-convert` (DIR/dsv4.json, loaded with `load_checkpoint`)
    --random-tiny   a random `dsv4_jax.config.tiny()` target (byte vocabulary) with random MTP and DSpark
                    drafters, seeded by --model-seed
    --kernels NAME  the backend choice (`dsv4_jax.backends`: auto | reference | pallas), stored in the
                    model's config (its static field; part of every jit key)
    --sharding P    place it on all devices with a sharding preset (`dsv4_jax.parallel.PRESETS`: "latency",
                    "throughput"): the preset's mesh and rules, the expert-parallel MoE in the config

A model is held as the config bundle `load_checkpoint` returns (`CheckpointConfig`: target config plus
drafter metadata), so every run passes it to `generate` as is and the drafters read their settings from it.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Callable

import jax.numpy as jnp

from .. import backends, cli
from ..bundle import CheckpointConfig, as_bundle
from .. import parallel
from ..io.checkpoint import load_checkpoint
from ..config import ModelConfig, tiny
from ..demo import ASSET_DIR, ByteTokenizer, demo_dspark_config, tiny_demo
from ..io.demo_io import load_bundle
from ..drafters import registry
from ..drafters.base import DraftSetup
from ..drafters.dspark import DSparkConfig
from ..model.params import init_dspark, init_mtp, init_params

BUNDLE_META = "bundle.json"
CHECKPOINT_META = "dsv4.json"


class ModelError(RuntimeError):
    """The requested model cannot be loaded (missing files, wrong directory)."""


@dataclasses.dataclass
class LoadedModel:
    """Everything a research run needs from a model."""

    name: str                                  # shown in reports
    source: str                                # "bundled" | "bundle:DIR" | "checkpoint:DIR" | "random-tiny"
    bundle: CheckpointConfig                   # target config + drafter metadata: what generate() takes
    params: dict
    encode: Callable[[str], list[int]] | None  # text -> token ids (None: pre-tokenized prompts only)
    default_suite: str                         # "tiny" (byte-level models) | "mtp-bench"
    info: dict = dataclasses.field(default_factory=dict)
    decode: Callable[[list[int]], str] | None = None   # ids -> text, for samples in the reports
    sharding: str | None = None                # the sharding preset it is placed with (None: one device)

    @property
    def config(self) -> ModelConfig:
        return self.bundle.target

    def drafters(self) -> list[str]:
        """Registered drafters whose weights this model holds."""
        return [n for n in registry.names() if registry.get(n).weights and self.params.get(registry.get(n).weights)]

    def draft_setup(self, spec: str, k: int) -> DraftSetup:
        """The drafter's static setup at draft_n_max k (its k may be capped, e.g. at DSpark's block size);
        ValueError when the model cannot run it."""
        return registry.get(spec).configure(self.params, self.config, k, None, self.bundle.drafter_meta())

    def with_backends(self, choice) -> "LoadedModel":
        """The same model with the backend choice (`--kernels`) in its config, resolved for this platform; a
        model placed with a sharding preset keeps its expert-parallel MoE."""
        b, old = backends.resolve(choice), self.config.backends
        if old.moe == "ep":
            b = b.replace(moe="ep", ep=old.ep)
        target = self.config.with_backends(b)
        return dataclasses.replace(self, bundle=dataclasses.replace(self.bundle, target=target))

    def describe(self) -> dict:
        c = self.config
        return {"name": self.name, "source": self.source, "config_name": c.name, "vocab_size": c.vocab_size,
                "hidden_size": c.hidden_size, "num_layers": c.num_layers, "drafters": self.drafters(),
                "backends": c.backends.describe(), "weight_dtype": str(self.params["embed"].dtype),
                "sharding": self.sharding}


def _bundle(config: ModelConfig, params: dict, dspark=None) -> CheckpointConfig:
    """The config bundle of a model held in memory (drafter metadata as a checkpoint would carry it)."""
    return CheckpointConfig(config, mtp_layers=len(params.get("mtp", [])), dspark=dspark)


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (default: the bundled tiny model)")
    m = g.add_mutually_exclusive_group()
    m.add_argument("--model", metavar="DIR", help="a bundle directory (bundle.json, written by save_bundle) or a "
                                                  "converted checkpoint (dsv4.json, written by dsv4-convert)")
    m.add_argument("--random-tiny", action="store_true",
                   help="a random tiny model with random MTP and DSpark drafters (smoke tests; no quality)")
    g.add_argument("--model-seed", type=int, default=0, help="seed of --random-tiny (default 0)")
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="compute dtype of the weights (default: float32 for the bundled model, else as stored)")
    cli.add_kernels(g)
    g.add_argument("--sharding", choices=("none",) + tuple(parallel.PRESETS), default="none",
                   help="place the model on all devices with a sharding preset: 'latency' (tensor-parallel "
                        "attention + expert-tensor-parallel experts; batches up to ~32) or 'throughput' "
                        "(data-parallel attention + expert-parallel experts; large batches); default none "
                        "(one device). See docs/sharding.md")


def load_model(args: argparse.Namespace) -> LoadedModel:
    """The model selected by the parsed --model / --random-tiny / --kernels / --sharding options."""
    dtype = None if args.dtype is None else jnp.dtype(args.dtype)
    sharding = getattr(args, "sharding", "none")
    sharding = None if sharding in (None, "none") else sharding
    if args.random_tiny:
        model = random_tiny(args.model_seed, dtype)
    elif args.model:
        model = load_dir(args.model, dtype, sharding)
    else:
        model = bundled(dtype)
    model = model.with_backends(args.kernels)
    return model if sharding is None or model.sharding == sharding else place(model, sharding)


def place(model: LoadedModel, sharding: str) -> LoadedModel:
    """The model's parameters on a sharding preset's mesh (all devices), its config with the preset's backends."""
    pre = parallel.preset(sharding)
    mesh = pre.make_mesh()
    params = parallel.shard_params(model.params, model.config, mesh, pre.rules_dict)
    bundle = dataclasses.replace(model.bundle, target=pre.apply(model.config, mesh))
    return dataclasses.replace(model, bundle=bundle, params=params, sharding=pre.name)


def check_model_dir(path: str) -> str:
    """'bundle' | 'checkpoint' for a model directory; ModelError otherwise (cheap: reads no weights)."""
    if not os.path.isdir(path):
        raise ModelError(f"--model {path!r} is not a directory")
    if os.path.exists(os.path.join(path, BUNDLE_META)):
        return "bundle"
    if os.path.exists(os.path.join(path, CHECKPOINT_META)):
        return "checkpoint"
    raise ModelError(f"--model {path!r}: neither a bundle ({BUNDLE_META}) nor a dsv4-convert checkpoint "
                     f"({CHECKPOINT_META})")


def bundled(dtype=None) -> LoadedModel:
    try:
        demo = tiny_demo(dtype=dtype or "float32")   # float32 compute: exact greedy losslessness
    except FileNotFoundError:
        raise ModelError(f"the bundled tiny model is not installed (no weights in {ASSET_DIR}). Train it with "
                         "`python experiments/train_tiny.py`, or use --model DIR (a bundle or converted "
                         "checkpoint) or --random-tiny (random weights, for a smoke test)") from None
    return LoadedModel(name=demo.config.name, source="bundled", bundle=_bundle(demo.config, demo.params, demo.dspark),
                       params=demo.params, encode=demo.tokenizer.encode, default_suite="tiny", info=demo.info,
                       decode=demo.tokenizer.decode)


def _byte_level(config: ModelConfig) -> bool:
    return config.vocab_size == ByteTokenizer.vocab_size


def _bundle_dspark_meta(config: ModelConfig, info: dict):
    """DSpark settings of a bundle: info["dspark"] when written, the demo's for the demo config, else None
    (defaults fitted to the weights)."""
    d = info.get("dspark")
    if isinstance(d, dict):
        fields = {f.name for f in dataclasses.fields(DSparkConfig)}
        kw = {k: (tuple(v) if k == "target_layer_ids" else v) for k, v in d.items() if k in fields}
        return DSparkConfig(**kw)
    if config.name == "tiny_demo":
        return demo_dspark_config()
    return None


def load_dir(path: str, dtype=None, sharding: str | None = None) -> LoadedModel:
    """A bundle or checkpoint directory; a checkpoint is restored straight into the `sharding` preset's
    placement (a bundle is placed after loading, by `load_model`)."""
    kind = check_model_dir(path)
    name = os.path.basename(os.path.normpath(path))
    if kind == "bundle":
        config, params, info = load_bundle(path, dtype)
        tok = (ByteTokenizer().encode, ByteTokenizer().decode) if _byte_level(config) else _hf_codec(path, config)
        return LoadedModel(name=name, source=f"bundle:{path}", bundle=_bundle(config, params,
                                                                              _bundle_dspark_meta(config, info)),
                           params=params, encode=tok[0], default_suite="tiny" if _byte_level(config) else "mtp-bench",
                           info=info, decode=tok[1])
    cfg, params = load_checkpoint(path, dtype=dtype, sharding=sharding)
    bundle = as_bundle(cfg)
    encode, decode = _hf_codec(path, bundle.target)
    return LoadedModel(name=name, source=f"checkpoint:{path}", bundle=bundle, params=params, encode=encode,
                       default_suite="mtp-bench", decode=decode, sharding=sharding)


def _hf_codec(path: str, config: ModelConfig):
    """(encode, decode) via DIR/tokenizer.json (the `tokenizers` package), BOS prepended once; (None, None)
    without a tokenizer.json."""
    tj = os.path.join(path, "tokenizer.json")
    if not os.path.exists(tj):
        return None, None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ModelError(f"{tj} needs the `tokenizers` package: pip install 'dsv4_jax[tokenizers]'") from None
    tok = Tokenizer.from_file(tj)
    bos = config.bos_token_id

    def encode(text: str) -> list[int]:
        ids = tok.encode(text, add_special_tokens=False).ids
        return ids if bos is None or (ids and ids[0] == bos) else [bos] + ids

    return encode, lambda ids: tok.decode([int(i) for i in ids])


def random_tiny_config() -> ModelConfig:
    """dsv4_jax.config.tiny() with the byte vocabulary (ByteTokenizer: 256 bytes + BOS, EOS, PAD, NOISE)."""
    return tiny().replace(name="random_tiny", vocab_size=ByteTokenizer.vocab_size, bos_token_id=ByteTokenizer.BOS,
                          eos_token_id=ByteTokenizer.EOS)


def random_tiny(seed: int = 0, dtype=None) -> LoadedModel:
    """A random tiny target with random MTP (1 block) and DSpark (2 stages, 3 taps, block 5) drafters."""
    config = random_tiny_config()
    dtype = dtype or jnp.float32
    params = init_params(config, seed, dtype)
    params["mtp"] = init_mtp(config, seed + 1, dtype)
    params["dspark"] = init_dspark(config, seed + 2, dtype, n_stages=2, n_taps=3, markov_rank=8)
    n = config.num_layers
    meta = DSparkConfig(block_size=5, noise_token_id=ByteTokenizer.NOISE, target_layer_ids=(n - 3, n - 2, n - 1))
    return LoadedModel(name=f"random_tiny(seed={seed})", source="random-tiny", bundle=_bundle(config, params, meta),
                       params=params, encode=ByteTokenizer().encode, default_suite="tiny", decode=ByteTokenizer().decode)
