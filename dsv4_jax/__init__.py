"""dsv4_jax: a pure-functional JAX reimplementation of DeepSeek-V4-Flash."""
from .backends import Backends
from .bundle import CheckpointConfig
from .checkpoint import load_checkpoint
from .config import ConfigError, ModelConfig, flash, from_hf_config, pro, tiny
from .model import forward
from .params import abstract_params, init_params
from . import sharding  # noqa: F401  (meshes, sharding rules, multi-host: docs/sharding.md)
from .spec.generate import generate
from .spec.options import RunShape, Sampling, Speculation
from .demo import tiny_demo

__all__ = ["Backends", "CheckpointConfig", "ConfigError", "ModelConfig", "RunShape", "Sampling", "Speculation",
           "abstract_params", "flash", "forward", "from_hf_config", "generate", "init_params", "tiny_demo",
           "load_checkpoint", "pro", "tiny"]
