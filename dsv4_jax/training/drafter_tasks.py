"""What training one drafter against a frozen target needs, for MTP and DSpark alike.

A task (`MTPTask`, `DSparkTask`: frozen, hashable, a static argument of the jitted step) fixes:
  * the target states the objective reads (`target_states`), computed from the frozen target in the
    training step or read from a cache of them (`training.target_cache`):
        MTP     hidden  [B,L,n,D]  last-layer HC streams before hc_head (docs/drafter_math.md §1.2)
        DSpark  taps    [B,L,t,D]  mean over HC streams of each tap layer (docs/drafter_math.md §2.3)
                head_in [B,L,D]    the target head's input, RMSNorm(hc_head(X_last))
    The target's logits are recomputed from them (`head_in @ head.T`; for MTP from `hidden`), which is
    one matmul: a cache needs no [L, V] rows. DSpark computes them only at the rows its blocks read.
  * the objective (`loss`, from `training.objectives`, shared with experiments/train_tiny.py);
  * the drafter's parameter specs (for sharding and mixed precision) and its initialisations
    (`init_drafter`: scratch, an existing drafter, or blocks copied from the target's last layers).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ..model import params as P
from ..config import ModelConfig
from ..drafters.dspark import DSparkConfig
from ..model.layers import hyper
from ..model.layers.norms import rms_norm
from ..model.schedule import locate
from . import objectives

INITS = ("scratch", "drafter", "target-layers")


@dataclasses.dataclass(frozen=True)
class MTPTask:
    """MTP: CE of row (S_i, x_{i+1}) to the target's greedy token at i+1 (objectives.mtp_loss)."""

    kind = "mtp"


@dataclasses.dataclass(frozen=True)
class DSparkTask:
    """DSpark: per-position CE + TV + confidence BCE, decayed by exp(−j/decay) (objectives.dspark_block_loss).

    anchors: blocks per training sequence, drawn in [min_context, L − block − 1).
    """

    dcfg: DSparkConfig
    n_stages: int
    markov_rank: int
    conf_bias: bool = False
    anchors: int = 8
    decay: float = 4.0
    w_tv: float = 1.0
    w_conf: float = 0.2
    min_context: int = 8
    kind = "dspark"


Task = MTPTask | DSparkTask


# ---- shapes ------------------------------------------------------------------------------------------

def drafter_specs(task: Task, config: ModelConfig):
    """ParamSpec tree parallel to the drafter's parameters (params.mtp_specs / params.dspark_specs)."""
    if task.kind == "mtp":
        return P.mtp_specs(config)
    return P.dspark_specs(config, task.n_stages, len(task.dcfg.target_layer_ids), task.markov_rank, task.conf_bias)


def state_fields(task: Task, config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Per-token shape of each target state the objective reads."""
    D = config.hidden_size
    if task.kind == "mtp":
        return {"hidden": (config.hc_mult, D)}
    return {"taps": (len(task.dcfg.target_layer_ids), D), "head_in": (D,)}


def min_seq_len(task: Task) -> int:
    """The shortest training window the objective can use."""
    return 2 if task.kind == "mtp" else task.min_context + task.dcfg.block_size + 2


def cast(tree, specs, dtype):
    """Compute-dtype leaves to `dtype` (float32 / int leaves as the specs say): f32 master -> bf16 compute."""
    return jax.tree.map(lambda s, x: x.astype(s.dtype(dtype)), specs, tree,
                        is_leaf=lambda x: isinstance(x, P.ParamSpec))


# ---- target states and the objective ---------------------------------------------------------------

def head_input(target: dict, config: ModelConfig, hidden: jax.Array) -> jax.Array:
    """The target head's input RMSNorm(hc_head(X)): hidden [B,L,n,D] -> [B,L,D]."""
    return rms_norm(hyper.hc_head(hidden, target["hc_head"], config), target["norm"], config.rms_norm_eps)


def target_states(task: Task, target: dict, config: ModelConfig, tokens: jax.Array) -> dict:
    """The frozen target's states for tokens [B,L] (no gradient): see the module docstring."""
    taps = () if task.kind == "mtp" else task.dcfg.target_layer_ids
    hidden, _, tap_vals = objectives.frozen_target(target, config, tokens, taps)
    if task.kind == "mtp":
        return {"hidden": hidden}
    return {"taps": tap_vals, "head_in": jax.lax.stop_gradient(head_input(target, config, hidden))}


def loss(task: Task, drafter, target: dict, config: ModelConfig, tokens: jax.Array, states: dict, anchors=None):
    """(loss, metrics) of the drafter on tokens [B,L] with the target's states (anchors [B,A] for DSpark)."""
    if task.kind == "mtp":
        S = states["hidden"]
        t_logits = (head_input(target, config, S) @ target["head"].T).astype(jnp.float32)
        ce, acc = objectives.mtp_loss(drafter, target, config, tokens, S, t_logits)
        return ce, {"acc": acc}
    rows = objectives.block_rows(states["head_in"], anchors, task.dcfg.block_size)        # [B·A, g, D]
    p_logits = rows @ target["head"].T
    return objectives.dspark_block_loss(drafter, target, config, task.dcfg, tokens, states["taps"], p_logits,
                                        anchors, decay=task.decay, w_tv=task.w_tv, w_conf=task.w_conf)


def anchors_for(task: Task, seq_len: int, shape: tuple[int, ...], seed: int, step: int) -> np.ndarray | None:
    """DSpark block anchors int32 shape + (anchors,) for a step (seeded by (seed, step), like the windows)."""
    if task.kind == "mtp":
        return None
    rng = np.random.default_rng([seed, step, 1])
    hi = seq_len - task.dcfg.block_size - 1
    return rng.integers(task.min_context, hi, shape + (task.anchors,)).astype(np.int32)


# ---- initialisation ------------------------------------------------------------------------------------

def layer_params(target: dict, config: ModelConfig, layer: int) -> dict:
    """One target layer's parameter tree, taken out of its stacked scan segment."""
    s, slot, rep = locate(config, layer)
    return jax.tree.map(lambda a: a[rep], target["segments"][s][slot])


def _path(path) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _overlay(base, source: dict):
    """base with every leaf that `source` has at the same path and shape replaced by source's."""
    flat_src = P.flatten(source)

    def pick(path, leaf):
        src = flat_src.get(_path(path))
        return src.astype(leaf.dtype) if src is not None and src.shape == leaf.shape else leaf

    return jax.tree_util.tree_map_with_path(pick, base)


def from_target_layers(task: Task, drafter, target: dict, config: ModelConfig):
    """Drafter blocks initialised from the target's last layers (stage s <- layer L − n_stages + s; MTP's
    block <- the last layer), its hc_head and norm from the target's; the rest as in `drafter`.

    Only leaves a drafter block shares with the layer are copied (mHC, norms, attention projections, sinks,
    router and experts); compressor / indexer weights do not exist in a ratio-0 block, and a hash-routed
    layer gives no router bias (the bias keeps its initial value).
    """
    top = {"hc_head": target["hc_head"], "norm": target["norm"]}
    if task.kind == "mtp":
        return _overlay(drafter, dict(layer_params(target, config, config.num_layers - 1), **top))
    n = len(drafter["stages"])
    stages = [_overlay(st, layer_params(target, config, config.num_layers - n + s))
              for s, st in enumerate(drafter["stages"])]
    return dict(_overlay({k: v for k, v in drafter.items() if k != "stages"}, top), stages=stages)


def init_drafter(task: Task, config: ModelConfig, how: str, seed: int, *, target: dict | None = None,
                 existing=None):
    """Float32 master weights of the drafter to train.

    how: 'scratch' (params.init_mtp / init_dspark distributions), 'drafter' (a copy of `existing`, the
    model's own drafter: fine-tuning), 'target-layers' (`from_target_layers` over a scratch init).
    """
    if how == "drafter":
        return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else
                            jnp.asarray(x), existing)
    specs = drafter_specs(task, config)
    fresh = P.init_tree(specs, config, seed, jnp.float32)
    if how == "scratch":
        return fresh
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                        from_target_layers(task, fresh, target, config))
