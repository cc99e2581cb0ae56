"""Abstract parameter trees (shapes, dtypes, logical axes) and random initialisation.

Tree layout (leaf names follow `dsv4_jax.model.names`, which maps them to every checkpoint naming):

    embed            [V, D]
    segments[s][j]   the layer dict of slot j of segment s, every leaf stacked on a leading
                     `reps` axis (see `schedule.py`)
    hc_head          {fn [n, n·D], base [n], scale [1]}
    norm             [D]
    head             [V, D]

Matrices use the `[out, in]` layout of the checkpoints (y = W x). Norm weights, HC parameters,
sinks, compressor position biases and the router bias stay float32 whatever the compute dtype
(HF `_keep_in_fp32_modules`, docs/model_math.md §4); `tid2eid` is int32.

A weight leaf may be stored quantized: `ParamSpec.quant` (an `ops.quant.QFormat`) makes its abstract leaf
an `ops.quant.QArray` of ShapeDtypeStructs (`abstract_leaf`), and the same spec gives its sharding
(`parallel.spec_sharding`), Orbax restore target (`checkpoint`) and bytes (`memplan`). `with_formats`
sets formats on a spec tree from a rule such as `release_format` (the official FP8 / FP4 release).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from ..config import CSA, HASH_MOE, MOE, SLIDING, ModelConfig
from ..ops import quant
from .schedule import segments


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """Shape, dtype kind and logical axis names of one leaf; `quant` = its storage format when quantized."""

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    kind: str = "weight"   # weight (compute dtype) | f32 (kept float32) | index (int32)
    init: str = "matrix"   # matrix | norm | vector | hc_scale | embed | tid2eid | bias
    quant: quant.QFormat | None = None

    def dtype(self, compute_dtype) -> Any:
        return {"weight": compute_dtype, "f32": jnp.float32, "index": jnp.int32}[self.kind]


def _hc_specs(c: ModelConfig, n_out: int) -> dict[str, ParamSpec]:
    nd = c.hc_mult * c.hidden_size
    scales = 3 if n_out > c.hc_mult else 1
    return {"fn": ParamSpec((n_out, nd), ("hc_mix", "hc_embed"), "f32"),
            "base": ParamSpec((n_out,), ("hc_mix",), "f32", "vector"),
            "scale": ParamSpec((scales,), (None,), "f32", "hc_scale")}


def _norm(dim: int, axis: str) -> ParamSpec:
    return ParamSpec((dim,), (axis,), "f32", "norm")


def _compressor_specs(c: ModelConfig, ratio: int, dim: int, overlap: bool) -> dict[str, ParamSpec]:
    cd = 2 * dim if overlap else dim
    return {"wkv": ParamSpec((cd, c.hidden_size), ("comp_dim", "embed")),
            "wgate": ParamSpec((cd, c.hidden_size), ("comp_dim", "embed")),
            "ape": ParamSpec((ratio, cd), (None, "comp_dim"), "f32", "vector"),
            "norm": _norm(dim, "head_dim")}


def attention_specs(c: ModelConfig, layer_type: str, ratio: int) -> dict[str, Any]:
    D, H, d, G, R = c.hidden_size, c.num_heads, c.head_dim, c.o_groups, c.o_lora_rank
    out = {
        "wq_a": ParamSpec((c.q_lora_rank, D), ("q_lora", "embed")),
        "q_norm": _norm(c.q_lora_rank, "q_lora"),
        "wq_b": ParamSpec((H * d, c.q_lora_rank), ("q_heads", "q_lora")),
        "wkv": ParamSpec((d, D), ("head_dim", "embed")),
        "kv_norm": _norm(d, "head_dim"),
        "wo_a": ParamSpec((G * R, H * d // G), ("o_groups", "o_group_in")),
        "wo_b": ParamSpec((D, G * R), ("o_out", "o_groups")),
        "attn_sink": ParamSpec((H,), ("heads",), "f32", "vector"),
    }
    if layer_type != SLIDING:
        out["compressor"] = _compressor_specs(c, ratio, d, overlap=layer_type == CSA)
    if layer_type == CSA:
        nI, dI = c.index_n_heads, c.index_head_dim
        out["indexer"] = {
            "wq_b": ParamSpec((nI * dI, c.q_lora_rank), ("index_heads", "q_lora")),
            "weights_proj": ParamSpec((nI, D), ("index_heads", "embed")),
            "compressor": _compressor_specs(c, ratio, dI, overlap=True),
        }
    return out


def moe_specs(c: ModelConfig, mlp_type: str) -> dict[str, Any]:
    D, E, I, k = c.hidden_size, c.n_routed_experts, c.moe_intermediate_size, c.num_experts_per_tok
    # the router has axes of its own ("router_experts" is never split: the top-k wants every expert's score on
    # every device; "router_in", its contraction, could be split: a psum of the [T, E] logits; no preset does)
    gate = {"weight": ParamSpec((E, D), ("router_experts", "router_in"))}
    if mlp_type == HASH_MOE:
        gate["tid2eid"] = ParamSpec((c.vocab_size, k), ("vocab", None), "index", "tid2eid")
    else:
        gate["bias"] = ParamSpec((E,), ("router_experts",), "f32", "bias")
    out = {"gate": gate,
           "experts": {"w1": ParamSpec((E, I, D), ("experts", "mlp", "embed")),
                       "w2": ParamSpec((E, D, I), ("experts", "embed", "mlp")),
                       "w3": ParamSpec((E, I, D), ("experts", "mlp", "embed"))}}
    if c.n_shared_experts:
        out["shared_experts"] = {"w1": ParamSpec((I, D), ("mlp", "embed")),
                                 "w2": ParamSpec((D, I), ("embed", "mlp")),
                                 "w3": ParamSpec((I, D), ("mlp", "embed"))}
    return out


def layer_specs(c: ModelConfig, layer: int) -> dict[str, Any]:
    """Parameter specs of one decoder layer (no stacking axis)."""
    lt, ratio, mt = c.layer_kind(layer)
    n = c.hc_mult
    return {"attn_norm": _norm(c.hidden_size, "embed"), "ffn_norm": _norm(c.hidden_size, "embed"),
            "hc_attn": _hc_specs(c, (2 + n) * n), "hc_ffn": _hc_specs(c, (2 + n) * n),
            "attn": attention_specs(c, lt, ratio), "ffn": moe_specs(c, mt)}


def _stack(spec: ParamSpec, reps: int) -> ParamSpec:
    return dataclasses.replace(spec, shape=(reps,) + spec.shape, axes=("layers",) + spec.axes)


def _is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def param_specs(c: ModelConfig) -> dict[str, Any]:
    """The full tree of ParamSpec leaves for a config."""
    segs = []
    for seg in segments(c):
        slots = [jax.tree.map(lambda s: _stack(s, seg.reps), layer_specs(c, seg.start + j), is_leaf=_is_spec)
                 for j in range(seg.pattern)]
        segs.append(slots)
    return {"embed": ParamSpec((c.vocab_size, c.hidden_size), ("vocab", "embed"), init="embed"),
            "segments": segs,
            "hc_head": _hc_specs(c, c.hc_mult),
            "norm": _norm(c.hidden_size, "embed"),
            "head": ParamSpec((c.vocab_size, c.hidden_size), ("vocab", "embed"))}


def abstract_params(c: ModelConfig, dtype=jnp.float32, formats=None):
    """Tree of jax.ShapeDtypeStruct (QArray of them for quantized leaves): the parameters without allocating
    them. formats: see `with_formats` (e.g. `release_format`); default every leaf dense."""
    specs = param_specs(c) if formats is None else with_formats(param_specs(c), formats)
    return abstract_tree(specs, dtype)


def logical_axes(c: ModelConfig):
    """Tree of logical axis-name tuples, parallel to the parameter tree (for sharding rules)."""
    return jax.tree.map(lambda s: s.axes, param_specs(c), is_leaf=_is_spec)


def count_params(c: ModelConfig) -> int:
    return sum(int(np.prod(s.shape)) for s in jax.tree.leaves(param_specs(c), is_leaf=_is_spec))


def _init_leaf(spec: ParamSpec, rng: np.random.Generator, dtype, c: ModelConfig) -> np.ndarray:
    shape = spec.shape
    if spec.init == "tid2eid":
        # distinct experts per token, like a real table: the first k of a random permutation per row
        noise = rng.random(shape[:-1] + (c.n_routed_experts,))
        return np.argsort(noise, axis=-1)[..., : c.num_experts_per_tok].astype(np.int32)
    if spec.init == "norm":
        x = 1.0 + 0.1 * rng.standard_normal(shape)
    elif spec.init == "embed":
        x = rng.standard_normal(shape)
    elif spec.init == "hc_scale":
        x = 0.5 + rng.random(shape)
    elif spec.init == "vector":
        x = 0.5 * rng.standard_normal(shape)
    elif spec.init == "bias":
        x = 0.1 * rng.standard_normal(shape)
    else:
        x = rng.standard_normal(shape) / np.sqrt(shape[-1])
    return x.astype(np.float32)


def _seed_of(key) -> int:
    if isinstance(key, (int, np.integer)):
        return int(key)
    data = np.asarray(jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key)
    return int(np.uint64(data.ravel().astype(np.uint64).sum()) % np.uint64(2 ** 63))


def init_tree(specs, c: ModelConfig, key, dtype=jnp.float32):
    """Random arrays for any tree of ParamSpec leaves (see init_params for the distributions)."""
    flat = traverse_util.flatten_dict(_as_dict(specs), sep="/")
    children = np.random.SeedSequence(_seed_of(key)).spawn(len(flat))
    out = {name: jnp.asarray(_init_leaf(spec, np.random.default_rng(ss), dtype, c).astype(np.dtype(spec.dtype(dtype))))
           for (name, spec), ss in zip(sorted(flat.items()), children)}
    return _from_dict(traverse_util.unflatten_dict(out, sep="/"), specs)


def init_params(c: ModelConfig, key, dtype=jnp.float32):
    """Random target parameters for tests (host-side numpy RNG, fast), non-degenerate everywhere.

    key: a jax PRNG key or an int seed. norms ~ 1 ± 0.1, embedding ~ N(0, 1), matrices ~ N(0, 1/fan_in),
    vectors ~ N(0, 0.5), HC scales ~ U(0.5, 1.5), router bias ~ N(0, 0.1), tid2eid distinct experts per token.
    """
    return init_tree(param_specs(c), c, key, dtype)


def init_mtp(c: ModelConfig, key, dtype=jnp.float32, n_layers: int = 1) -> list:
    """Random MTP blocks (params["mtp"]), same distributions as init_params."""
    return [init_tree(mtp_specs(c), c, _seed_of(key) + 1000 * (i + 1), dtype) for i in range(n_layers)]


def init_dspark(c: ModelConfig, key, dtype=jnp.float32, n_stages: int = 3, n_taps: int = 3, markov_rank: int = 16,
                conf_bias: bool = False) -> dict:
    """Random DSpark drafter weights (params["dspark"]), same distributions as init_params."""
    return init_tree(dspark_specs(c, n_stages, n_taps, markov_rank, conf_bias), c, key, dtype)


def _as_dict(tree):
    """Lists -> dicts with string indices (for flax.traverse_util)."""
    if isinstance(tree, (list, tuple)):
        return {str(i): _as_dict(v) for i, v in enumerate(tree)}
    if isinstance(tree, dict):
        return {k: _as_dict(v) for k, v in tree.items()}
    return tree


def _from_dict(tree, like):
    if isinstance(like, (list, tuple)):
        return [_from_dict(tree[str(i)], v) for i, v in enumerate(like)]
    if isinstance(like, dict):
        return {k: _from_dict(tree[k], v) for k, v in like.items()}
    return tree


def flatten(tree, sep: str = ".") -> dict[str, Any]:
    """Flat {"segments.0.1.attn.wq_a": leaf} view of a parameter tree (or any tree in its layout)."""
    return traverse_util.flatten_dict(_as_dict(tree), sep=sep)


def unflatten(flat: dict[str, Any], c: ModelConfig, sep: str = "."):
    """Inverse of `flatten` for the parameter layout of config `c`."""
    return _from_dict(traverse_util.unflatten_dict(flat, sep=sep), param_specs(c))


def cast_params(params, c: ModelConfig, dtype):
    """Cast the compute-dtype leaves to `dtype`, keeping float32 and integer leaves as they are."""
    return jax.tree.map(lambda s, x: x.astype(s.dtype(dtype)), param_specs(c), params, is_leaf=_is_spec)


# ---- drafter trees (leaf names follow `names.MTP_NAMES` / `names.DSPARK_NAMES`) -------------------

def drafter_block_specs(c: ModelConfig) -> dict[str, Any]:
    """One drafter block (MTP layer or DSpark stage): a full V4 block with ratio 0 (SWA) and a
    score-routed (non-hash) MoE (docs/drafter_math.md §1.1, §2.1)."""
    one = c.replace(num_layers=1, layer_types=(SLIDING,), compress_ratios=(0,), mlp_layer_types=(MOE,))
    return layer_specs(one, 0)


def mtp_specs(c: ModelConfig) -> dict[str, Any]:
    """MTP block n (docs/drafter_math.md §1.1): block leaves + e_proj/h_proj [D, D], enorm/hnorm/norm [D], own hc_head."""
    D = c.hidden_size
    out = drafter_block_specs(c)
    out.update({"e_proj": ParamSpec((D, D), ("embed", "embed_in")), "h_proj": ParamSpec((D, D), ("embed", "embed_in")),
                "enorm": _norm(D, "embed"), "hnorm": _norm(D, "embed"), "norm": _norm(D, "embed"),
                "hc_head": _hc_specs(c, c.hc_mult)})
    return out


def dspark_specs(c: ModelConfig, n_stages: int, n_taps: int, markov_rank: int, conf_bias: bool) -> dict[str, Any]:
    """DSpark drafter (docs/drafter_math.md §2.2): stages[s] are blocks; main_proj [D, n_taps·D]; markov_w1/w2 [V, R];
    conf_proj.weight [1, D+R] (+ bias [1] when the checkpoint has one)."""
    D, V, R = c.hidden_size, c.vocab_size, markov_rank
    conf = {"weight": ParamSpec((1, D + R), (None, "conf_in"), "f32", "vector")}
    if conf_bias:
        conf["bias"] = ParamSpec((1,), (None,), "f32", "vector")
    return {"main_proj": ParamSpec((D, n_taps * D), ("embed", "taps")), "main_norm": _norm(D, "embed"),
            "stages": [drafter_block_specs(c) for _ in range(n_stages)],
            "norm": _norm(D, "embed"), "hc_head": _hc_specs(c, c.hc_mult),
            "markov_w1": ParamSpec((V, R), ("vocab", "markov")), "markov_w2": ParamSpec((V, R), ("vocab", "markov")),
            "conf_proj": conf}


# ---- quantized storage ---------------------------------------------------------------------------------------

# The official release (docs/checkpoint_formats.md §3, §6): FP8 e4m3 + e8m0 per 128×128 for the attention projections,
# indexer wq_b, shared expert and the drafters' projections; FP4 e2m1 + e8m0 per 32 for the routed experts;
# everything else (embedding, head, router, compressors, indexer weights_proj, Markov heads) bf16.
RELEASE_FP8 = re.compile(r"(^|\.)(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]"
                         r"|e_proj|h_proj|main_proj)$")
RELEASE_FP4 = re.compile(r"(^|\.)ffn\.experts\.w[123]$")


def release_format(path: str, spec: ParamSpec) -> quant.QFormat | None:
    """Storage format of a leaf (flat dot path) in the official release; None = dense."""
    if spec.kind != "weight":
        return None
    if RELEASE_FP4.search(path):
        return quant.FP4
    if RELEASE_FP8.search(path):
        return quant.FP8
    return None


def with_formats(specs, formats: Callable[[str, ParamSpec], Any] | Mapping[str, Any]):
    """The spec tree with `quant` set: formats(path, spec) -> QFormat | name | None, or {flat path: format}.
    Only matrices of kind "weight" may be quantized."""
    rule = formats if callable(formats) else (lambda path, _s: formats.get(path))

    def one(path, s: ParamSpec):
        flat = _flat_path(path)
        fmt = rule(flat, s)
        if fmt is None:
            return dataclasses.replace(s, quant=None)
        if s.kind != "weight" or len(s.shape) < 2:
            raise ValueError(f"{flat}: only weight matrices can be quantized (kind {s.kind}, shape {s.shape})")
        return dataclasses.replace(s, quant=quant.qformat(fmt))

    return jax.tree_util.tree_map_with_path(one, specs, is_leaf=_is_spec)


def abstract_leaf(spec: ParamSpec, dtype=jnp.float32, sharding=None):
    """jax.ShapeDtypeStruct of a dense leaf, or a QArray of them for a quantized one (children codes / scale;
    `sharding` then a QArray of shardings, e.g. `parallel.spec_sharding`)."""
    if spec.quant is None:
        return jax.ShapeDtypeStruct(spec.shape, spec.dtype(dtype), sharding=sharding)
    return quant.abstract(spec.quant, spec.shape, spec.dtype(dtype), getattr(sharding, "codes", sharding),
                          getattr(sharding, "scale", sharding))


def abstract_tree(specs, dtype=jnp.float32):
    """`abstract_leaf` of every ParamSpec of a tree (target, MTP or DSpark specs)."""
    return jax.tree.map(lambda s: abstract_leaf(s, dtype), specs, is_leaf=_is_spec)


def formats_of(tree) -> dict[str, quant.QFormat]:
    """{flat path: format} of the QArray leaves of a parameter tree (the rule that rebuilds its specs)."""
    return {_flat_path(path): v.fmt for path, v in jax.tree_util.tree_leaves_with_path(tree, is_leaf=quant.is_qarray)
            if isinstance(v, quant.QArray)}


def _flat_path(path) -> str:
    """A jax key path as the flat dot path of `flatten` ("segments.0.1.attn.wq_a")."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
