"""The bundled tiny DeepSeek-V4-architecture model with trained MTP and DSpark drafters.

`tiny_demo()` loads it in one call: (config, params with params["mtp"] / params["dspark"],
tokenizer, DSpark settings). The target was trained on the Python standard library's source
files (a corpus every machine has) with a byte-level vocabulary; see experiments/train_tiny.py
and docs/tiny_demo.md for the training commands and their run time.
"""
from __future__ import annotations

import dataclasses
import os

from .config import HASH_MOE, MOE, ModelConfig, YarnScaling, _schedule
from .io.demo_io import load_bundle
from .drafters.dspark import DSparkConfig

ASSET_DIR = os.path.join(os.path.dirname(__file__), "assets", "tiny_demo")


class ByteTokenizer:
    """Bytes 0..255 plus four special tokens. encode(str) -> ids, decode(ids) -> str (invalid UTF-8 replaced)."""

    BOS, EOS, PAD, NOISE = 256, 257, 258, 259
    vocab_size = 260

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS] + ids if add_bos else ids

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


def demo_config() -> ModelConfig:
    """Flash's architecture in miniature: 2 SWA, CSA, then HCA/CSA pairs; 2 hash layers; mHC with 4 streams."""
    types, ratios = _schedule([0, 0, 4, 16, 4, 16, 4])
    n = len(ratios)
    return ModelConfig(
        name="tiny_demo", vocab_size=ByteTokenizer.vocab_size, hidden_size=128, num_layers=n, num_heads=4,
        head_dim=64, rope_head_dim=16, q_lora_rank=64, o_groups=2, o_lora_rank=32, sliding_window=32,
        layer_types=types, compress_ratios=ratios, mlp_layer_types=(HASH_MOE,) * 2 + (MOE,) * (n - 2),
        index_n_heads=8, index_head_dim=32, index_topk=8, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=64,
        routed_scaling_factor=1.5, swiglu_limit=10.0, rope_theta=10000.0, compress_rope_theta=160000.0,
        yarn=YarnScaling(factor=4.0, original_max_position_embeddings=512), max_position_embeddings=65536,
        bos_token_id=ByteTokenizer.BOS, eos_token_id=ByteTokenizer.EOS, num_nextn_predict_layers=1)


def demo_dspark_config() -> DSparkConfig:
    n = demo_config().num_layers
    return DSparkConfig(block_size=5, noise_token_id=ByteTokenizer.NOISE, target_layer_ids=(n - 3, n - 2, n - 1))


@dataclasses.dataclass
class Demo:
    config: ModelConfig
    params: dict
    tokenizer: ByteTokenizer
    dspark: DSparkConfig
    info: dict


def tiny_demo(path: str | None = None, dtype="float32") -> Demo:
    """Load the bundled tiny model and drafters (or a directory written by experiments/train_tiny.py).

    The weights are stored in bf16; by default they are computed with in float32, so greedy
    speculative decoding reproduces plain greedy decoding token for token (bf16 compute rounds
    a k-token verify block differently from a 1-token decode step, which can flip near-ties).
    Pass dtype=None to keep the stored bf16.
    """
    path = path or ASSET_DIR
    if not os.path.exists(os.path.join(path, "bundle.json")):
        raise FileNotFoundError(f"no tiny demo model at {path}: train one with `python experiments/train_tiny.py`")
    config, params, info = load_bundle(path, dtype)
    return Demo(config=config, params=params, tokenizer=ByteTokenizer(), dspark=demo_dspark_config(), info=info)
