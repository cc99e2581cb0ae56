"""Load a Hugging Face transformers-format DeepSeek-V4 checkpoint directory (config.json + safetensors)."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from ...config import ModelConfig, load_hf_config
from ...model.params import cast_params

from .assemble import assemble
from .safetensors_io import open_dir


def load_hf_dir(path: str | os.PathLike, dtype=jnp.float32) -> tuple[ModelConfig, dict]:
    """(config, params) from a directory written by `DeepseekV4ForCausalLM.save_pretrained(...,
    save_original_format=False)`. Weight leaves are cast to `dtype`; float32-kept leaves stay float32.
    """
    config = load_hf_config(path)
    files = open_dir(path)

    def convert_leaf(_path, arr, spec):
        return np.asarray(arr, dtype=spec.dtype(dtype) if spec.kind != "weight" else np.float32)

    tree = assemble(config, "hf", files.keys(), lambda n: files[n].get(n), convert_leaf)
    return config, cast_params(jax.tree.map(jnp.asarray, tree), config, dtype)
