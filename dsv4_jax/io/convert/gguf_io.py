"""GGUF files (llama.cpp and ds4 DeepSeek-V4 exports) as a tensor source, including split files.

`GGUFSource(path)` opens one file or every shard of a `*-0000k-of-0000n.gguf` set through
`gguf.GGUFReader` (memory-mapped). Tensors come back in numpy order (= reversed GGUF `ne`,
docs/checkpoint_formats.md §1.2): dense types as typed arrays (BF16 viewed as ml_dtypes.bfloat16), Q8_0 split
into (codes, scale), MXFP4 repacked into the official FP4 layout, other quant types as raw blocks.
`config_dict` turns the `deepseek4.*` keys (§1.1) into a config.json-style dict for `from_hf_config`.
"""
from __future__ import annotations

import math
import os
import re
import warnings

import gguf
import ml_dtypes
import numpy as np
from gguf import GGMLQuantizationType as T

from . import quant_formats as qf
from .gguf_layout import check_offsets, diagnose
from .safetensors_io import read_range
from .truncation import cut_message, file_kind

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
    if not os.path.isfile(path):
        raise GGUFError(f"{path}: not a regular file ({file_kind(path)}); give the path of a .gguf file")
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
    bad = check_offsets(path, r.tensors, int(r.data_offset), int(r.alignment), size)
    if bad:
        raise GGUFError(bad)
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


class GGUFDefaultWarning(UserWarning):
    """An optional GGUF metadata key was absent and its default was used (the message names both)."""


_REQ = object()


def _meta(src: GGUFSource, key: str, kind: str, default=_REQ, warn: bool = True):
    """Typed metadata value (kind: int | float | bool | str | ints | floats). Missing: GGUFError when
    required, else `default` with a GGUFDefaultWarning naming key and default (when `warn`). A value of the
    wrong type: GGUFError naming the file, the key, the value and what was expected."""
    v = src.field(key)
    if v is None:
        if default is _REQ:
            raise GGUFError(f"{src.path}: missing metadata key {key!r}")
        if warn:
            warnings.warn(f"{src.path}: metadata key {key!r} is absent; using the default {default!r}",
                          GGUFDefaultWarning, stacklevel=3)
        return default
    base = kind[:-1] if kind in ("ints", "floats") else kind
    items = v if kind in ("ints", "floats") else [v]
    if kind in ("ints", "floats") and not isinstance(v, list):
        raise GGUFError(f"{src.path}: metadata key {key!r} = {v!r}: expected an array of {base}s")
    out = []
    for x in items:
        ok = {"int": isinstance(x, int) and not isinstance(x, bool),
              "float": isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x),
              "bool": isinstance(x, bool) or x in (0, 1) and isinstance(x, int),
              "str": isinstance(x, str)}[base]
        if not ok:
            raise GGUFError(f"{src.path}: metadata key {key!r} = {v!r}: expected "
                            f"{'an array of ' + base + 's' if base != kind else 'a ' + base}")
        out.append({"int": int, "float": float, "bool": bool, "str": str}[base](x))
    return out if kind in ("ints", "floats") else out[0]


# Required keys: every key llama.cpp's DeepseekV4 converter always writes (docs/checkpoint_formats.md §1.1),
# swiglu_clamp_exp and rope.scaling.type included (V4 always has the clamp and YaRN; a silent default
# would change the model). Optional ones (defaults warned): head_count_kv (must be 1), expert_shared_count,
# expert_weights_norm, expert_gating_func, the YaRN betas, tokenizer bos / eos ids; nextn_predict_layers
# (only MTP files) and vocab_size (token_embd's rows) default silently.
def config_dict(src: GGUFSource, arch: str = "deepseek4") -> dict:
    """config.json-style dict (DeepSeek legacy keys) from the `{arch}.*` metadata (docs/checkpoint_formats.md §1.1)."""
    a = arch + "."
    m = lambda k, kind, d=_REQ, warn=True: _meta(src, a + k, kind, d, warn)  # noqa: E731
    nextn = m("nextn_predict_layers", "int", 0, warn=False)
    n = m("block_count", "int") - nextn
    gating = m("expert_gating_func", "int", 4)
    if gating != 4:
        raise GGUFError(f"{src.path}: {a}expert_gating_func = {gating}, DeepSeek-V4 uses 4 (sqrtsoftplus)")
    if src.field(a + "swiglu_clamp_exp") is not None and isinstance(src.field(a + "swiglu_clamp_exp"), list):
        clamps = m("swiglu_clamp_exp", "floats")
        if not clamps or len(set(clamps)) != 1:
            raise GGUFError(f"{src.path}: metadata key {a + 'swiglu_clamp_exp'!r} = {clamps!r}: expected one "
                            "value repeated per layer (dsv4_jax has one swiglu_limit)")
        swiglu = clamps[0]
    else:
        swiglu = m("swiglu_clamp_exp", "float")
    ratios = m("attention.compress_ratios", "ints")
    if len(ratios) < n:
        raise GGUFError(f"{src.path}: metadata key {a + 'attention.compress_ratios'!r} has {len(ratios)} entries "
                        f"for {n} layers")
    d = {
        "num_hidden_layers": n, "hidden_size": m("embedding_length", "int"),
        "num_attention_heads": m("attention.head_count", "int"),
        "num_key_value_heads": m("attention.head_count_kv", "int", 1),
        "head_dim": m("attention.key_length", "int"),
        "qk_rope_head_dim": m("rope.dimension_count", "int"),
        "q_lora_rank": m("attention.q_lora_rank", "int"),
        "o_groups": m("attention.output_group_count", "int"),
        "o_lora_rank": m("attention.output_lora_rank", "int"),
        "sliding_window": m("attention.sliding_window", "int"),
        "compress_ratios": ratios[:n],
        "index_n_heads": m("attention.indexer.head_count", "int"),
        "index_head_dim": m("attention.indexer.key_length", "int"),
        "index_topk": m("attention.indexer.top_k", "int"),
        "hc_mult": m("hyper_connection.count", "int"),
        "hc_sinkhorn_iters": m("hyper_connection.sinkhorn_iterations", "int"),
        "hc_eps": m("hyper_connection.epsilon", "float"),
        "n_routed_experts": m("expert_count", "int"),
        "num_experts_per_tok": m("expert_used_count", "int"),
        "n_shared_experts": m("expert_shared_count", "int", 1),
        "moe_intermediate_size": m("expert_feed_forward_length", "int"),
        "routed_scaling_factor": m("expert_weights_scale", "float"),
        "norm_topk_prob": m("expert_weights_norm", "bool", True),
        "swiglu_limit": swiglu,
        "rope_theta": m("rope.freq_base", "float"),
        "compress_rope_theta": m("attention.compress_rope_freq_base", "float"),
        "max_position_embeddings": m("context_length", "int"),
        "rms_norm_eps": m("attention.layer_norm_rms_epsilon", "float"),
        "num_hash_layers": m("hash_layer_count", "int"),
        "num_nextn_predict_layers": nextn,
        "bos_token_id": _meta(src, "tokenizer.ggml.bos_token_id", "int", 0),
        "eos_token_id": _meta(src, "tokenizer.ggml.eos_token_id", "int", 1),
        "model_type": "deepseek_v4",
    }
    vocab = m("vocab_size", "int", None, warn=False)
    if vocab is None and "token_embd.weight" in src.names():
        vocab = src.shape("token_embd.weight")[0]
    if vocab is None:
        raise GGUFError(f"{src.path}: missing metadata key {a + 'vocab_size'!r} (and no token_embd.weight)")
    d["vocab_size"] = int(vocab)
    kind = m("rope.scaling.type", "str")
    if kind == "yarn":
        d["rope_scaling"] = {"type": kind, "factor": m("rope.scaling.factor", "float"),
                             "original_max_position_embeddings": m("rope.scaling.original_context_length", "int"),
                             "beta_fast": m("rope.scaling.yarn_beta_fast", "float", 32.0),
                             "beta_slow": m("rope.scaling.yarn_beta_slow", "float", 1.0)}
    elif kind != "none":
        raise GGUFError(f"{src.path}: metadata key {a + 'rope.scaling.type'!r} = {kind!r}: expected 'yarn' or "
                        "'none'")
    else:
        d["rope_scaling"] = {"type": "default"}
    return d
