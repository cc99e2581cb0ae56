"""dsv4_jax: a pure-functional JAX reimplementation of DeepSeek-V4-Flash."""
from .checkpoint import load_checkpoint
from .config import ConfigError, ModelConfig, flash, from_hf_config, pro, tiny
from .model import forward
from .params import abstract_params, init_params

__all__ = ["ConfigError", "ModelConfig", "abstract_params", "flash", "forward", "from_hf_config", "init_params",
           "load_checkpoint", "pro", "tiny"]
