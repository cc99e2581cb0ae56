"""GGUF files (llama.cpp and ds4 DeepSeek-V4 exports) as a tensor source, including split files.

`GGUFSource(path)` opens one file or every shard of a `*-0000k-of-0000n.gguf` set through
`gguf.GGUFReader` (memory-mapped). Tensors come back in numpy order (= reversed GGUF `ne`,
docs/weight_formats.md §1.2): dense types as typed arrays (BF16 viewed as ml_dtypes.bfloat16), Q8_0 split
into (codes, scale), MXFP4 repacked into the official FP4 layout, other quant types as raw blocks.
`config_dict` turns the `deepseek4.*` keys (§1.1) into a config.json-style dict for `from_hf_config`.
"""
from __future__ import annotations

import os
import re

import gguf
import ml_dtypes
import numpy as np
from gguf import GGMLQuantizationType as T

from . import quant_formats as qf
from .gguf_layout import diagnose
from .safetensors_io import read_range
from .truncation import cut_message

_SPLIT = re.compile(r"^(?P<base>.*)-(?P<k>\d{5})-of-(?P<n>\d{5})\.gguf$")
_DENSE = {T.F32: np.float32, T.F16: np.float16, T.F64: np.float64, T.I8: np.int8, T.I16: np.int16,
          T.I32: np.int32, T.I64: np.int64}


class GGUFError(ValueError):
    """A GGUF file that is unreadable, truncated, of the wrong architecture or uses an unsupported type."""


def shard_paths(path: str | os.PathLike) -> list[str]:
    """All shards of a split GGUF set given any one of them (or [path] for a single file)."""
    path = os.fspath(path)
    m = _SPLIT.match(path)
    if not m:
        return [path]
    n = int(m["n"])
    paths = [f"{m['base']}-{k:05d}-of-{n:05d}.gguf" for k in range(1, n + 1)]
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        raise GGUFError(f"split GGUF set {path}: missing shard(s) {missing}")
    return paths


def _open(path: str) -> gguf.GGUFReader:
    """gguf-py's reader of one file; a cut-short or corrupt file is explained by `gguf_layout.diagnose`
    (the section, key or tensor that is missing, with the bytes expected and present)."""
    if not os.path.exists(path):
        raise GGUFError(f"{path}: no such file")
    try:
        r = gguf.GGUFReader(path, "r")
    except ValueError as e:
        if "GGMLQuantizationType" in str(e):
            raise GGUFError(f"{path}: unknown ggml tensor type ({e}); this converter knows "
                            f"{sorted(t.name for t in T)}") from None
        raise GGUFError(diagnose(path) or f"{path}: not a readable GGUF file: {e}") from None
    except Exception as e:  # noqa: BLE001 - gguf-py raises many kinds on corrupt input
        raise GGUFError(diagnose(path) or f"{path}: not a readable GGUF file: {type(e).__name__}: {e}") from None
    size = os.path.getsize(path)
    for t in r.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise GGUFError(diagnose(path) or cut_message(path, "tensor data", f"tensor {t.name!r}",
                                                          int(t.data_offset), int(t.n_bytes), size))
    return r


def _field(r: gguf.GGUFReader, key: str):
    f = r.fields.get(key)
    return None if f is None else f.contents()


class GGUFSource:
    """Tensors of one GGUF file or split set: `names()`, `shape(name)`, `dtype(name)`, `load(name)`."""

    def __init__(self, path: str | os.PathLike):
        self.paths = shard_paths(path)
        self.readers = [_open(p) for p in self.paths]
        self.path = self.paths[0]
        self._tensors = {}
        self._file = {}                  # tensor name -> shard path (data read with plain reads, not the mmap)
        for r, p in zip(self.readers, self.paths):
            for t in r.tensors:
                if t.name in self._tensors:
                    raise GGUFError(f"{p}: tensor {t.name!r} appears in two shards")
                self._tensors[t.name] = t
                self._file[t.name] = p
        n = _field(self.readers[0], "split.count")
        if n is not None and int(n) != len(self.paths):
            raise GGUFError(f"{self.path}: split.count = {n} but {len(self.paths)} shard(s) found; "
                            "pass the first shard of a `-0000k-of-0000n.gguf` set")

    @property
    def arch(self) -> str | None:
        return _field(self.readers[0], "general.architecture")

    def field(self, key: str, default=None):
        v = _field(self.readers[0], key)
        return default if v is None else v

    def names(self) -> list[str]:
        return list(self._tensors)

    def companions(self, name: str) -> tuple[str, ...]:
        return ()

    def dtype(self, name: str) -> str:
        return self._tensors[name].tensor_type.name

    def shape(self, name: str) -> tuple[int, ...]:
        """Logical numpy shape: reversed GGUF ne."""
        return tuple(int(d) for d in reversed(self._tensors[name].shape.tolist()))

    def nbytes(self, name: str) -> int:
        return int(self._tensors[name].n_bytes)

    def load(self, name: str):
        """numpy array (dense types) or QTensor (quantized), in numpy dim order."""
        t = self._tensors[name]
        qt = t.tensor_type
        data = read_range(self._file[name], int(t.data_offset), int(t.n_bytes), f"tensor {name!r}")
        data = data.view(t.data.dtype).reshape(t.data.shape)
        if qt in _DENSE:
            return data
        if qt == T.BF16:
            return data.view(ml_dtypes.bfloat16).reshape(self.shape(name))
        if qt == T.Q8_0:
            return qf.split_q8_0(data)
        if qt == T.MXFP4:
            return qf.repack_mxfp4(data)
        if qt in qf.GGML_RAW_TYPES:
            return qf.ggml_raw(data, qt)
        raise GGUFError(f"{self.path}: tensor {name!r} has ggml type {qt.name}, which this converter does not "
                        "support (gguf-py has no dequantizer for it)")


def _need(src: GGUFSource, key: str):
    v = src.field(key)
    if v is None:
        raise GGUFError(f"{src.path}: missing metadata key {key!r}")
    return v


def config_dict(src: GGUFSource, arch: str = "deepseek4") -> dict:
    """config.json-style dict (DeepSeek legacy keys) from the `{arch}.*` metadata (docs/weight_formats.md §1.1)."""
    a = arch + "."
    g = lambda k, d=None: src.field(a + k, d)  # noqa: E731
    nextn = int(g("nextn_predict_layers", 0))
    n = int(_need(src, a + "block_count")) - nextn
    gating = g("expert_gating_func")
    if gating is not None and int(gating) != 4:
        raise GGUFError(f"{src.path}: {a}expert_gating_func = {gating}, DeepSeek-V4 uses 4 (sqrtsoftplus)")
    swiglu = g("swiglu_clamp_exp", 10.0)
    d = {
        "num_hidden_layers": n, "hidden_size": int(_need(src, a + "embedding_length")),
        "num_attention_heads": int(_need(src, a + "attention.head_count")),
        "num_key_value_heads": int(g("attention.head_count_kv", 1)),
        "head_dim": int(_need(src, a + "attention.key_length")),
        "qk_rope_head_dim": int(_need(src, a + "rope.dimension_count")),
        "q_lora_rank": int(_need(src, a + "attention.q_lora_rank")),
        "o_groups": int(_need(src, a + "attention.output_group_count")),
        "o_lora_rank": int(_need(src, a + "attention.output_lora_rank")),
        "sliding_window": int(_need(src, a + "attention.sliding_window")),
        "compress_ratios": [int(x) for x in _need(src, a + "attention.compress_ratios")][:n],
        "index_n_heads": int(g("attention.indexer.head_count", 0)),
        "index_head_dim": int(g("attention.indexer.key_length", 0)),
        "index_topk": int(g("attention.indexer.top_k", 0)),
        "hc_mult": int(_need(src, a + "hyper_connection.count")),
        "hc_sinkhorn_iters": int(_need(src, a + "hyper_connection.sinkhorn_iterations")),
        "hc_eps": float(_need(src, a + "hyper_connection.epsilon")),
        "n_routed_experts": int(_need(src, a + "expert_count")),
        "num_experts_per_tok": int(_need(src, a + "expert_used_count")),
        "n_shared_experts": int(g("expert_shared_count", 1)),
        "moe_intermediate_size": int(_need(src, a + "expert_feed_forward_length")),
        "routed_scaling_factor": float(_need(src, a + "expert_weights_scale")),
        "norm_topk_prob": bool(g("expert_weights_norm", True)),
        "swiglu_limit": float(swiglu[0] if isinstance(swiglu, list) else swiglu),
        "rope_theta": float(_need(src, a + "rope.freq_base")),
        "compress_rope_theta": float(_need(src, a + "attention.compress_rope_freq_base")),
        "max_position_embeddings": int(_need(src, a + "context_length")),
        "rms_norm_eps": float(_need(src, a + "attention.layer_norm_rms_epsilon")),
        "num_hash_layers": int(_need(src, a + "hash_layer_count")),
        "num_nextn_predict_layers": nextn,
        "bos_token_id": src.field("tokenizer.ggml.bos_token_id", 0),
        "eos_token_id": src.field("tokenizer.ggml.eos_token_id", 1),
        "model_type": "deepseek_v4",
    }
    vocab = g("vocab_size")
    if vocab is None and "token_embd.weight" in src.names():
        vocab = src.shape("token_embd.weight")[0]
    if vocab is None:
        raise GGUFError(f"{src.path}: missing metadata key {a + 'vocab_size'!r} (and no token_embd.weight)")
    d["vocab_size"] = int(vocab)
    kind = g("rope.scaling.type")
    if kind not in (None, "none"):
        d["rope_scaling"] = {"type": kind, "factor": float(_need(src, a + "rope.scaling.factor")),
                             "original_max_position_embeddings": int(_need(src, a + "rope.scaling.original_context_length")),
                             "beta_fast": float(g("rope.scaling.yarn_beta_fast", 32.0)),
                             "beta_slow": float(g("rope.scaling.yarn_beta_slow", 1.0))}
    return d
