"""Model configuration: a frozen, hashable dataclass with every DeepSeek-V4 hyperparameter.

`ModelConfig` is a static argument of every jitted function, so it must be hashable: every
field is an immutable scalar or tuple. Presets: `flash()`, `pro()` (exact published values,
spec docs/model_math.md §1) and tiny test configs. `from_hf_config` reads both the
transformers form (`layer_types`, `mlp_layer_types`, `rope_parameters`) and DeepSeek's legacy
form (`compress_ratios`, `num_hash_layers`, `rope_scaling`, `qk_rope_head_dim`).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from typing import Any, Mapping

from .backends import REFERENCE, Backends

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
HASH_MOE = "hash_moe"
MOE = "moe"
MLP_LAYER_TYPES = (HASH_MOE, MOE)

# transformers' mapping of the legacy integer codes in `compress_ratios` (docs/model_math.md §1).
_HF_RATIO_CODE = {0: SLIDING, 4: CSA, 128: HCA}


class ConfigError(ValueError):
    """An invalid or unsupported model configuration."""


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """YaRN parameters of the compress RoPE (docs/model_math.md §2.0). No mscale: attention_factor must be 1."""

    factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Every hyperparameter of the DeepSeek-V4 target model (docs/model_math.md §1).

    `layer_types[i]` is one of SLIDING / CSA / HCA and `compress_ratios[i]` the ratio m of layer i
    (0 for sliding layers). `mlp_layer_types[i]` is HASH_MOE or MOE.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: tuple[str, ...]
    compress_ratios: tuple[int, ...]
    mlp_layer_types: tuple[str, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    swiglu_limit: float
    rope_theta: float
    compress_rope_theta: float
    yarn: YarnScaling | None
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    norm_topk_prob: bool = True
    router_eps: float = 1e-20  # HF adds 1e-20 to the routing-weight denominator (docs/model_math.md §4)
    bos_token_id: int = 0
    eos_token_id: int = 1
    num_nextn_predict_layers: int = 0
    name: str = "custom"
    # Implementation of the hot ops (dsv4_jax.backends): a static execution choice, not a hyperparameter;
    # never written to checkpoints. Part of the hash, so each choice gets its own jit cache entry.
    backends: Backends = REFERENCE

    def __post_init__(self):
        validate(self)

    # ---- derived quantities -------------------------------------------------------------
    @property
    def num_hash_layers(self) -> int:
        return sum(t == HASH_MOE for t in self.mlp_layer_types)

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.rope_head_dim

    def layer_kind(self, i: int) -> tuple[str, int, str]:
        """(attention type, compress ratio, mlp type) of layer i: what decides its parameter shapes."""
        return self.layer_types[i], self.compress_ratios[i], self.mlp_layer_types[i]

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def with_backends(self, backends: Backends) -> "ModelConfig":
        return self if backends == self.backends else dataclasses.replace(self, backends=backends)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        del d["backends"]
        for k in ("layer_types", "compress_ratios", "mlp_layer_types"):
            d[k] = list(d[k])
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        d = dict(d)
        d.pop("backends", None)
        yarn = d.get("yarn")
        d["yarn"] = YarnScaling(**yarn) if isinstance(yarn, Mapping) else yarn
        for k in ("layer_types", "compress_ratios", "mlp_layer_types"):
            d[k] = tuple(d[k])
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown ModelConfig fields: {unknown}")
        return cls(**d)


def validate(c: ModelConfig) -> None:
    """Raise ConfigError naming the first inconsistent hyperparameter."""

    def need(cond: bool, msg: str):
        if not cond:
            raise ConfigError(f"invalid DeepSeek-V4 config ({c.name}): {msg}")

    for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "q_lora_rank", "o_groups",
              "o_lora_rank", "sliding_window", "hc_mult", "hc_sinkhorn_iters", "n_routed_experts",
              "num_experts_per_tok", "moe_intermediate_size", "max_position_embeddings"):
        v = getattr(c, f)
        need(isinstance(v, int) and not isinstance(v, bool) and v > 0, f"{f} must be a positive int, got {v!r}")
    n = c.num_layers
    for f in ("layer_types", "compress_ratios", "mlp_layer_types"):
        v = getattr(c, f)
        need(isinstance(v, tuple), f"{f} must be a tuple")
        need(len(v) == n, f"len({f}) = {len(v)} but num_layers = {n}")
    bad = [t for t in c.layer_types if t not in LAYER_TYPES]
    need(not bad, f"layer_types entries must be in {LAYER_TYPES}, got {bad}")
    bad = [t for t in c.mlp_layer_types if t not in MLP_LAYER_TYPES]
    need(not bad, f"mlp_layer_types entries must be in {MLP_LAYER_TYPES}, got {bad}")
    for i, (t, m) in enumerate(zip(c.layer_types, c.compress_ratios)):
        need(isinstance(m, int) and m >= 0, f"compress_ratios[{i}] must be an int >= 0, got {m!r}")
        need((m == 0) == (t == SLIDING), f"layer {i} is {t} but its compress ratio is {m}")
    need(c.rope_head_dim % 2 == 0 and 0 < c.rope_head_dim <= c.head_dim,
         f"rope_head_dim must be even and in (0, head_dim], got {c.rope_head_dim}")
    need(c.num_heads % c.o_groups == 0, f"num_heads ({c.num_heads}) must be divisible by o_groups ({c.o_groups})")
    need(c.num_experts_per_tok <= c.n_routed_experts,
         f"num_experts_per_tok ({c.num_experts_per_tok}) > n_routed_experts ({c.n_routed_experts})")
    need(c.n_shared_experts in (0, 1), f"n_shared_experts must be 0 or 1, got {c.n_shared_experts}")
    if CSA in c.layer_types:
        for f in ("index_n_heads", "index_head_dim", "index_topk"):
            need(getattr(c, f) > 0, f"{f} must be > 0 when there are CSA layers")
        need(c.index_head_dim % 2 == 0 and c.rope_head_dim <= c.index_head_dim,
             f"index_head_dim ({c.index_head_dim}) must be even and >= rope_head_dim ({c.rope_head_dim})")
    need(c.hc_eps >= 0 and c.rms_norm_eps > 0, "epsilons must be non-negative (rms_norm_eps > 0)")
    need(0 <= c.bos_token_id < c.vocab_size and 0 <= c.eos_token_id < c.vocab_size, "bos/eos outside the vocab")
    if c.yarn is not None:
        need(c.yarn.factor >= 1 and c.yarn.original_max_position_embeddings > 0, "bad YaRN parameters")


# ---- presets ------------------------------------------------------------------------------

def _schedule(ratios, csa_ratio=4):
    """Legacy integer ratios -> (layer_types, compress_ratios), DeepSeek semantics (CSA iff ratio == 4)."""
    types = tuple(SLIDING if r == 0 else CSA if r == csa_ratio else HCA for r in ratios)
    return types, tuple(int(r) for r in ratios)


def flash() -> ModelConfig:
    """DeepSeek-V4-Flash (284B), exact published values (docs/model_math.md §1)."""
    types, ratios = _schedule([0, 0] + [4, 128] * 20 + [4])
    return ModelConfig(
        name="flash", vocab_size=129280, hidden_size=4096, num_layers=43, num_heads=64, head_dim=512,
        rope_head_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024, sliding_window=128,
        layer_types=types, compress_ratios=ratios, mlp_layer_types=(HASH_MOE,) * 3 + (MOE,) * 40,
        index_n_heads=64, index_head_dim=128, index_topk=512, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
        n_routed_experts=256, num_experts_per_tok=6, n_shared_experts=1, moe_intermediate_size=2048,
        routed_scaling_factor=1.5, swiglu_limit=10.0, rope_theta=10000.0, compress_rope_theta=160000.0,
        yarn=YarnScaling(), max_position_embeddings=1048576, num_nextn_predict_layers=1)


def pro() -> ModelConfig:
    """DeepSeek-V4-Pro (1.6T), published values (docs/model_math.md §1)."""
    types, ratios = _schedule([128, 128] + [4, 128] * 29 + [4])
    return flash().replace(
        name="pro", hidden_size=7168, num_layers=61, num_heads=128, q_lora_rank=1536, o_groups=16,
        layer_types=types, compress_ratios=ratios, mlp_layer_types=(HASH_MOE,) * 3 + (MOE,) * 58,
        index_topk=1024, n_routed_experts=384, moe_intermediate_size=3072, routed_scaling_factor=2.5)


def _tiny_base(**kw) -> ModelConfig:
    base = dict(
        vocab_size=97, hidden_size=64, num_heads=4, head_dim=32, rope_head_dim=8, q_lora_rank=24, o_groups=2,
        o_lora_rank=16, sliding_window=6, index_n_heads=8, index_head_dim=16, index_topk=3, hc_mult=4,
        hc_sinkhorn_iters=20, hc_eps=1e-6, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        moe_intermediate_size=32, routed_scaling_factor=1.5, swiglu_limit=10.0, rope_theta=10000.0,
        compress_rope_theta=160000.0, yarn=YarnScaling(original_max_position_embeddings=16),
        max_position_embeddings=4096)
    base.update(kw)
    ratios = base.pop("ratios")
    n_hash = base.pop("n_hash")
    types, ratios = _schedule(ratios)
    n = len(ratios)
    return ModelConfig(num_layers=n, layer_types=types, compress_ratios=ratios,
                       mlp_layer_types=(HASH_MOE,) * n_hash + (MOE,) * (n - n_hash), **base)


def tiny() -> ModelConfig:
    """5 layers SWA, SWA, CSA(4), HCA(8), CSA(4); 2 hash layers (the shape of the HF parity fixture, tests/hf_reference.py)."""
    return _tiny_base(name="tiny", ratios=[0, 0, 4, 8, 4], n_hash=2)


def tiny_flash_like() -> ModelConfig:
    """Flash's schedule shape in miniature: 2 SWA, CSA, then repeated HCA/CSA pairs (exercises the layer scan)."""
    return _tiny_base(name="tiny_flash_like", ratios=[0, 0, 4] + [8, 4] * 3, n_hash=3)


def tiny_long() -> ModelConfig:
    """Flash's attention regime exactly at a tiny width, for long-context work: sliding window 128, CSA ratio 4
    with index_topk 512 (the indexer truncates past 2,048 tokens), HCA ratio 128, RoPE dim 64 with Flash's
    thetas and YaRN, 1M positions; 7 layers SWA, SWA, CSA, (HCA, CSA) × 2 (a scanned pair), 3 hash layers.
    tests/hf_reference.py's "tiny_long" is the same model in transformers' form."""
    return _tiny_base(name="tiny_long", ratios=[0, 0, 4, 128, 4, 128, 4], n_hash=3, head_dim=96, rope_head_dim=64,
                      sliding_window=128, index_n_heads=16, index_head_dim=96, index_topk=512, yarn=YarnScaling(),
                      max_position_embeddings=1048576, num_nextn_predict_layers=1)


PRESETS = {"flash": flash, "pro": pro, "tiny": tiny, "tiny_flash_like": tiny_flash_like, "tiny_long": tiny_long}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}") from None


# ---- reduced presets (benchmarks and the AOT report) ------------------------------------------

LEADING_LAYERS = 3     # Flash / Pro: the layers before the repeated (HCA, CSA) pairs

# the same layer schedule with tiny dimensions: compiles in seconds (checks code paths and reports, not the model)
SMALL_DIMS = dict(vocab_size=256, hidden_size=64, num_heads=4, head_dim=32, rope_head_dim=8, q_lora_rank=24,
                  o_groups=2, o_lora_rank=16, sliding_window=8, index_n_heads=8, index_head_dim=16, index_topk=4,
                  n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=32)


def with_pairs(c: ModelConfig, pairs: int) -> ModelConfig:
    """`c` with its LEADING_LAYERS and the first `pairs` of its repeated HCA/CSA pairs (Flash: 3 + 2·20
    layers), named "{name}-{n}L" (unchanged when every pair is kept)."""
    n_pairs = (c.num_layers - LEADING_LAYERS) // 2
    if not 0 <= pairs <= n_pairs:
        raise ConfigError(f"pairs must be in 0..{n_pairs} for {c.name} ({n_pairs} HCA/CSA pairs), got {pairs}")
    n = LEADING_LAYERS + 2 * pairs
    if n == c.num_layers:
        return c
    return c.replace(name=f"{c.name}-{n}L", num_layers=n, layer_types=c.layer_types[:n],
                     compress_ratios=c.compress_ratios[:n], mlp_layer_types=c.mlp_layer_types[:n])


def small(c: ModelConfig) -> ModelConfig:
    """`c`'s layer schedule with SMALL_DIMS, named "small-{name}"."""
    return c.replace(name=f"small-{c.name}", **SMALL_DIMS,
                     yarn=dataclasses.replace(c.yarn, original_max_position_embeddings=64) if c.yarn else None)


# ---- Hugging Face / DeepSeek config.json ---------------------------------------------------

class ConfigDefaultWarning(UserWarning):
    """A model-defining key was absent from a config file and its documented default was used."""


_REQ = object()


def _type_error(key: str, value, expected: str) -> ConfigError:
    return ConfigError(f"field {key!r} = {value!r}: expected {expected}")


def _as(kind: str, key: str, v):
    """`v` checked and converted to `kind` (int | float | bool | str | ints | map); ConfigError naming
    the field, the value and the expectation otherwise. Integral floats count as ints (JSON writers)."""
    if kind == "int":
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
            raise _type_error(key, v, "an integer")
        return int(v)
    if kind == "float":
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise _type_error(key, v, "a finite number")
        return float(v)
    if kind == "bool":
        if not isinstance(v, bool) and v not in (0, 1):
            raise _type_error(key, v, "true or false")
        return bool(v)
    if kind == "str":
        if not isinstance(v, str):
            raise _type_error(key, v, "a string")
        return v
    if kind == "ints":
        if not isinstance(v, (list, tuple)):
            raise _type_error(key, v, "a list of integers")
        return [_as("int", f"{key}[{i}]", x) for i, x in enumerate(v)]
    if kind == "strs":
        if not isinstance(v, (list, tuple)):
            raise _type_error(key, v, "a list of strings")
        return [_as("str", f"{key}[{i}]", x) for i, x in enumerate(v)]
    if kind == "map":
        if not isinstance(v, Mapping):
            raise _type_error(key, v, "an object ({...})")
        return v
    raise AssertionError(kind)


def _get(d: Mapping[str, Any], key: str, kind: str, default=_REQ, warn: bool = True):
    """Typed value of `key` (None counts as absent). Absent: ConfigError when required, else `default`,
    with a ConfigDefaultWarning naming the key and the default when `warn` (model-defining keys)."""
    v = d.get(key)
    if v is None:
        if default is _REQ:
            raise ConfigError(f"required field {key!r} is missing")
        if warn:
            warnings.warn(f"config has no {key!r}; using the default {default!r}", ConfigDefaultWarning,
                          stacklevel=3)
        return default
    return _as(kind, key, v)


def _yarn_from(rp: Mapping[str, Any] | None, key: str = "rope_scaling") -> YarnScaling | None:
    if not rp:
        return None
    rp = _as("map", key, rp)
    kind = _as("str", f"{key}.type", rp.get("rope_type", rp.get("type", "default")))
    if kind == "default":
        return None
    if kind != "yarn":
        raise ConfigError(f"unsupported compress RoPE type {kind!r} (only 'yarn' or none)")
    af = rp.get("attention_factor")
    if af not in (None, 1, 1.0) or rp.get("mscale") not in (None, 0, 1, 1.0):
        raise ConfigError("DeepSeek-V4 YaRN has no mscale: attention_factor must be 1")
    if "factor" not in rp or "original_max_position_embeddings" not in rp:
        raise ConfigError("YaRN rope scaling needs 'factor' and 'original_max_position_embeddings'")
    sub = {k: v for k, v in rp.items()}
    g = lambda k, kind, dflt=_REQ: _get(sub, k, kind, dflt) if k not in sub else _as(kind, f"{key}.{k}", sub[k])  # noqa: E731
    return YarnScaling(factor=g("factor", "float"),
                       original_max_position_embeddings=g("original_max_position_embeddings", "int"),
                       beta_fast=g("beta_fast", "float", 32.0), beta_slow=g("beta_slow", "float", 1.0),
                       truncate=g("truncate", "bool", True) if "truncate" in sub else True)


# keys from_hf_config has no default for
_HF_REQUIRED = ("vocab_size", "hidden_size", "num_attention_heads", "q_lora_rank", "o_groups", "o_lora_rank",
                "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")


def from_hf_config(d: Mapping[str, Any]) -> ModelConfig:
    """Build a ModelConfig from a transformers or DeepSeek-legacy `config.json` dict.

    Every field is type-checked (ConfigError naming the field, its value and what was expected). The keys
    of `_HF_REQUIRED` and `num_hidden_layers` are required; a missing model-defining key with a default in
    transformers' DeepseekV4Config gets that default and a `ConfigDefaultWarning` naming key and default.

    Layer schedule, in order of precedence:
      * `layer_types` (transformers): ratios from `compress_rates` (default CSA 4, HCA 128);
      * `compress_ratios` with `compress_rates` and only the codes 0/4/128: transformers semantics
        (the codes name the type, `compress_rates` gives the ratio);
      * `compress_ratios` otherwise: DeepSeek semantics (official inference/model.py: overlap and
        indexer iff ratio == 4), any positive ratio accepted. Trailing MTP entries are dropped.
    """
    if not isinstance(d, Mapping):
        raise ConfigError(f"config is a {type(d).__name__}, expected a JSON object")
    d = dict(d)
    if d.get("num_hidden_layers") is None:
        raise ConfigError("config has no num_hidden_layers")
    n = _get(d, "num_hidden_layers", "int")
    missing = [k for k in _HF_REQUIRED if d.get(k) is None]
    if missing:
        raise ConfigError(f"config is missing required keys {missing}")
    rates = {CSA: 4, HCA: 128}
    for k, v in _as("map", "compress_rates", d.get("compress_rates") or {}).items():
        if k not in (CSA, HCA):
            raise ConfigError(f"field 'compress_rates' has unknown key {k!r}; expected {CSA!r} or {HCA!r}")
        rates[k] = _as("int", f"compress_rates.{k}", v)
    if d.get("compress_rate_csa") is not None:
        rates[CSA] = _get(d, "compress_rate_csa", "int")
    if d.get("compress_rate_hca") is not None:
        rates[HCA] = _get(d, "compress_rate_hca", "int")
    if d.get("layer_types") is not None:
        types = tuple(_get(d, "layer_types", "strs"))[:n]
        bad = [t for t in types if t not in LAYER_TYPES]
        if bad:
            raise ConfigError(f"unknown layer_types {bad}")
        ratios = tuple(0 if t == SLIDING else int(rates[t]) for t in types)
    elif d.get("compress_ratios") is not None:
        raw = _get(d, "compress_ratios", "ints")[:n]
        if d.get("compress_rates") is not None and set(raw) <= set(_HF_RATIO_CODE):
            types = tuple(_HF_RATIO_CODE[r] for r in raw)
            ratios = tuple(0 if t == SLIDING else int(rates[t]) for t in types)
        else:
            if any(r < 0 for r in raw):
                raise ConfigError(f"compress_ratios must be >= 0, got {raw}")
            types, ratios = _schedule(raw)
    else:
        raise ConfigError("config has neither layer_types nor compress_ratios")
    if len(types) != n:
        raise ConfigError(f"layer schedule has {len(types)} entries for {n} layers")

    if d.get("mlp_layer_types") is not None:
        mlp = tuple(_get(d, "mlp_layer_types", "strs"))[:n]
    else:
        n_hash = _get(d, "num_hash_layers", "int", 3)
        mlp = (HASH_MOE,) * min(n, n_hash) + (MOE,) * max(0, n - n_hash)

    head_dim = _get(d, "head_dim", "int", 512)
    if d.get("qk_rope_head_dim") is not None:
        rope_dim = _get(d, "qk_rope_head_dim", "int")
    elif d.get("partial_rotary_factor") is not None:
        rope_dim = int(round(head_dim * _get(d, "partial_rotary_factor", "float")))
    else:
        rope_dim = _get(d, "qk_rope_head_dim", "int", 64)

    rp = _as("map", "rope_parameters", d.get("rope_parameters") or {})
    if isinstance(rp.get("compress"), Mapping):
        comp = rp["compress"]
        main = _as("map", "rope_parameters.main", rp.get("main") or {})
        rope_theta = (_as("float", "rope_parameters.main.rope_theta", main["rope_theta"])
                      if main.get("rope_theta") is not None else _get(d, "rope_theta", "float", 10000.0))
        compress_theta = (_as("float", "rope_parameters.compress.rope_theta", comp["rope_theta"])
                          if comp.get("rope_theta") is not None else
                          _get(d, "compress_rope_theta", "float", 160000.0))
        if main.get("rope_type", "default") != "default":
            raise ConfigError("the main RoPE of DeepSeek-V4 has no scaling; got " + str(main.get("rope_type")))
        yarn = _yarn_from(comp, "rope_parameters.compress")
    else:
        if d.get("rope_scaling") is not None:
            scaling, key = _as("map", "rope_scaling", d["rope_scaling"]), "rope_scaling"
        else:
            scaling, key = (rp if rp else None), "rope_parameters"
            if scaling is None:
                warnings.warn("config has no 'rope_scaling' (nor 'rope_parameters'); using the default None "
                              "(compress RoPE without YaRN)", ConfigDefaultWarning, stacklevel=2)
        rope_theta = (_get(d, "rope_theta", "float") if d.get("rope_theta") is not None else
                      _as("float", "rope_parameters.rope_theta", rp["rope_theta"]) if rp.get("rope_theta") is not None
                      else _get(d, "rope_theta", "float", 10000.0))
        compress_theta = _get(d, "compress_rope_theta", "float", 160000.0)
        yarn = _yarn_from(scaling, key)

    if _get(d, "tie_word_embeddings", "bool", False, warn=False):
        raise ConfigError("tie_word_embeddings=True is not DeepSeek-V4 (the head is untied)")
    if _get(d, "num_key_value_heads", "int", 1, warn=False) != 1:
        raise ConfigError(f"DeepSeek-V4 has one shared K=V head; num_key_value_heads={d['num_key_value_heads']}")
    if _get(d, "scoring_func", "str", "sqrtsoftplus", warn=False) != "sqrtsoftplus":
        raise ConfigError(f"unsupported scoring_func {d['scoring_func']!r} (only sqrtsoftplus)")
    if _get(d, "hidden_act", "str", "silu", warn=False) != "silu":
        raise ConfigError(f"unsupported hidden_act {d['hidden_act']!r} (only silu)")
    eos = d.get("eos_token_id", 1)
    if isinstance(eos, (list, tuple)):
        eos = _as("ints", "eos_token_id", eos)[0] if eos else None
    eos = 1 if eos is None else _as("int", "eos_token_id", eos)
    name = d.get("_name_or_path") or d.get("model_type") or "hf"
    i = lambda k, dflt=_REQ, warn=True: _get(d, k, "int", dflt, warn)  # noqa: E731
    f = lambda k, dflt=_REQ, warn=True: _get(d, k, "float", dflt, warn)  # noqa: E731
    return ModelConfig(
        name=str(name),
        vocab_size=i("vocab_size"), hidden_size=i("hidden_size"), num_layers=n,
        num_heads=i("num_attention_heads"), head_dim=head_dim, rope_head_dim=rope_dim,
        q_lora_rank=i("q_lora_rank"), o_groups=i("o_groups"), o_lora_rank=i("o_lora_rank"),
        sliding_window=i("sliding_window", 128), layer_types=types, compress_ratios=ratios,
        mlp_layer_types=mlp, index_n_heads=i("index_n_heads", 64, CSA in types),
        index_head_dim=i("index_head_dim", 128, CSA in types), index_topk=i("index_topk", 512, CSA in types),
        hc_mult=i("hc_mult", 4), hc_sinkhorn_iters=i("hc_sinkhorn_iters", 20),
        hc_eps=f("hc_eps", 1e-6), n_routed_experts=i("n_routed_experts"),
        num_experts_per_tok=i("num_experts_per_tok"), n_shared_experts=i("n_shared_experts", 1),
        moe_intermediate_size=i("moe_intermediate_size"),
        routed_scaling_factor=f("routed_scaling_factor", 1.5),
        swiglu_limit=f("swiglu_limit", 10.0), rope_theta=rope_theta, compress_rope_theta=compress_theta,
        yarn=yarn, max_position_embeddings=i("max_position_embeddings", 1048576),
        rms_norm_eps=f("rms_norm_eps", 1e-6), norm_topk_prob=_get(d, "norm_topk_prob", "bool", True),
        bos_token_id=i("bos_token_id", 0, False), eos_token_id=eos,
        num_nextn_predict_layers=i("num_nextn_predict_layers", 0, False))


def load_hf_config(path: str | os.PathLike) -> ModelConfig:
    """Read `config.json` (a file or a checkpoint directory)."""
    p = os.fspath(path)
    if os.path.isdir(p):
        p = os.path.join(p, "config.json")
    if not os.path.exists(p):
        raise ConfigError(f"no config.json at {p}")
    if not os.path.isfile(p):
        raise ConfigError(f"{p}: not a regular file")
    try:
        with open(p, "rb") as f:
            d = json.loads(f.read().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p} is not valid JSON: {e}") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot read it: {e}") from None
    try:
        return from_hf_config(d)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None
