"""dsv4_jax: a pure-functional JAX reimplementation of DeepSeek-V4-Flash with MTP, DSpark and n-gram drafting.

The public API, by what it is for (docs/design.md describes the layers behind it):

    model               ModelConfig, flash, pro, tiny, from_hf_config, ConfigError, Backends,
                        forward, abstract_params, init_params
    incremental decode  prefill, extend, decode_step, verify, commit, DecodeState
    loading / saving    load_checkpoint, save_checkpoint, CheckpointConfig, tiny_demo
    generation          generate (-> Generated: .tokens, .stats), Sampling, Speculation, RunShape
    drafters            Drafter, register, drafter_names (docs/drafters.md)
    batching            SlotEngine (continuous batching, docs/batch_eval.md)
    sharding            parallel (module), make_mesh, preset, shard_params, param_shardings,
                        initialize_distributed, to_host (results to the host, also across hosts; docs/sharding.md)
"""
# model
from .backends import Backends
from .config import ConfigError, ModelConfig, flash, from_hf_config, pro, tiny
from .model.params import abstract_params, init_params
from .model.target import forward
# incremental decode
from .model.decode import commit, decode_step, extend, prefill, verify
from .model.state import DecodeState
# loading / saving
from .bundle import CheckpointConfig
from .demo import tiny_demo
from .io.checkpoint import load_checkpoint
from .io.convert.save import save_checkpoint
# generation
from .speculative.generate import Generated, generate
from .speculative.options import RunShape, Sampling, Speculation
# drafters
from .drafters.base import Drafter
from .drafters.registry import names as drafter_names, register
# batching
from .speculative.scheduler import SlotEngine
# sharding
from . import parallel
from .parallel import initialize_distributed, make_mesh, param_shardings, preset, shard_params, to_host

__all__ = [
    "Backends", "ConfigError", "ModelConfig", "flash", "from_hf_config", "pro", "tiny", "abstract_params",
    "init_params", "forward",
    "commit", "decode_step", "extend", "prefill", "verify", "DecodeState",
    "CheckpointConfig", "tiny_demo", "load_checkpoint", "save_checkpoint",
    "generate", "Generated", "RunShape", "Sampling", "Speculation",
    "Drafter", "drafter_names", "register",
    "SlotEngine",
    "parallel", "initialize_distributed", "make_mesh", "param_shardings", "preset", "shard_params",
    "to_host",
]
