"""dsv4_jax: a pure-functional JAX reimplementation of DeepSeek-V4-Flash."""
from .checkpoint import load_checkpoint
from .config import ConfigError, ModelConfig, flash, from_hf_config, pro, tiny
from .model import forward
from .params import abstract_params, init_params
from . import sharding  # noqa: F401  (meshes, sharding rules, multi-host: docs/sharding.md)
from .spec.generate import generate
from .demo import tiny_demo

__all__ = ["ConfigError", "ModelConfig", "abstract_params", "flash", "forward", "from_hf_config", "generate", "init_params", "tiny_demo",
           "load_checkpoint", "pro", "tiny"]
