"""The drafter training step and loop: sharded, gradient-accumulated, bf16 compute on f32 master weights,
resumable through an Orbax CheckpointManager.

Train state {params: f32 master weights, opt: optax state, step}. On a mesh every params leaf (and its
optimizer moments) lives in the NamedSharding that `dsv4_jax.parallel` derives from the drafter's logical
axes (`params.mtp_specs` / `dspark_specs`: experts over expert × model, heads and vocabulary over model,
the router replicated), the frozen target in `parallel.param_shardings`, and the batch is split over
data × expert (the `batch` rule). `train_step` is one jitted GSPMD program: for each of the grad_accum
micro-batches it computes the target's states (or takes them from the batch when they come from a cache),
casts the master weights to the compute dtype, and accumulates the gradient; then one AdamW update.

Determinism: the batch of step i is a function of (seed, i) only (`text_data.window_starts`,
`drafter_tasks.anchors_for`), so a run stopped after a checkpoint and resumed ends with the same
parameters as a run that was never stopped.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from .. import parallel
from ..config import ModelConfig
from ..ops.host import to_host
from . import drafter_tasks as T

SCHEDULES = ("cosine", "linear", "constant")


@dataclasses.dataclass(frozen=True)
class Hyper:
    """Optimisation settings (static: part of the jitted step's key)."""

    steps: int
    batch: int
    seq_len: int
    grad_accum: int = 1
    lr: float = 2e-3
    schedule: str = "cosine"
    warmup: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    clip: float = 1.0
    b2: float = 0.95
    seed: int = 0
    compute_dtype: str = "bfloat16"

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")


def lr_schedule(h: Hyper):
    """Linear warm-up from 0 over `warmup` steps, then cosine / linear decay to lr·min_lr_ratio, or constant."""
    warm = max(0, min(h.warmup, h.steps - 1))
    end = h.lr * h.min_lr_ratio
    if h.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, h.lr, warm, h.steps, end)
    after = optax.linear_schedule(h.lr, end, max(h.steps - warm, 1)) if h.schedule == "linear" \
        else optax.constant_schedule(h.lr)
    return optax.join_schedules([optax.linear_schedule(0.0, h.lr, warm), after], [warm]) if warm else after


def optimizer(h: Hyper) -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(h.clip),
                       optax.adamw(lr_schedule(h), b2=h.b2, weight_decay=h.weight_decay))


# ---- shardings ---------------------------------------------------------------------------------------

def _replicated(mesh):
    return NamedSharding(mesh, PartitionSpec())


def state_shardings(task: T.Task, config: ModelConfig, hyper: Hyper, mesh, opt_state):
    """NamedSharding tree of the train state: params by the drafter's rules, optimizer moments alike."""
    p_sh = parallel.drafter_shardings(T.drafter_specs(task, config), mesh)
    opt_sh = optax.tree_map_params(optimizer(hyper), lambda _, s: s, opt_state, p_sh,
                                   transform_non_params=lambda _: _replicated(mesh))
    return {"params": p_sh, "opt": opt_sh, "step": _replicated(mesh)}


def batch_sharding(shape: tuple[int, ...], mesh) -> NamedSharding:
    """[accum, B, ...] arrays: B split like the decode state's batch (data × expert)."""
    spec = parallel.partition_spec(shape, (None, "batch") + (None,) * (len(shape) - 2), parallel.mesh_sizes(mesh))
    return NamedSharding(mesh, spec)


def place_batch(batch: dict, mesh):
    """Host arrays -> device arrays (on a mesh: each process builds only its addressable shards)."""
    if mesh is None:
        return jax.tree.map(jnp.asarray, batch)

    def put(x):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, batch_sharding(x.shape, mesh), lambda idx: x[idx])
    return jax.tree.map(put, batch)


def init_state(task: T.Task, config: ModelConfig, hyper: Hyper, params, mesh):
    """The step-0 train state, on its shardings when a mesh is given."""
    for leaf in jax.tree.leaves(params):
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            raise ValueError(f"a drafter leaf has dtype {leaf.dtype}: every drafter weight must be a float")
    params = jax.tree.map(lambda x: jnp.array(x, jnp.float32, copy=True), params)   # own buffers: donated
    tx = optimizer(hyper)
    if mesh is None:
        return {"params": params, "opt": tx.init(params), "step": jnp.zeros((), jnp.int32)}
    abstract_opt = jax.eval_shape(tx.init, params)
    sh = state_shardings(task, config, hyper, mesh, abstract_opt)
    params = jax.device_put(params, sh["params"])
    opt = jax.jit(tx.init, out_shardings=sh["opt"])(params)
    return {"params": params, "opt": opt, "step": jax.device_put(jnp.zeros((), jnp.int32), sh["step"])}


# ---- the step ----------------------------------------------------------------------------------------

def _micro_loss(params, target, mb, task, config, hyper):
    dtype = jnp.dtype(hyper.compute_dtype)
    states = mb["states"] if "states" in mb else T.target_states(task, target, config, mb["tokens"])
    drafter = T.cast(params, T.drafter_specs(task, config), dtype)
    return T.loss(task, drafter, target, config, mb["tokens"], states, mb.get("anchors"))


@functools.partial(jax.jit, static_argnames=("task", "config", "hyper", "mesh"), donate_argnames=("state",))
def train_step(state: dict, target: dict, batch: dict, *, task: T.Task, config: ModelConfig, hyper: Hyper,
               mesh=None):
    """One optimizer step over batch {"tokens" [accum,B,L], "anchors" [accum,B,A] (DSpark), "states"
    {name: [accum,B,L,...]} (from a cache; computed here when absent)} -> (state, metrics)."""
    grad_fn = jax.value_and_grad(_micro_loss, has_aux=True)

    def micro(acc, mb):
        (l, m), g = grad_fn(state["params"], target, mb, task, config, hyper)
        return jax.tree.map(jnp.add, acc, g), (l, m)

    zeros = jax.tree.map(jnp.zeros_like, state["params"])
    grads, (losses, metrics) = jax.lax.scan(micro, zeros, batch)
    grads = jax.tree.map(lambda g: g / batch["tokens"].shape[0], grads)
    tx = optimizer(hyper)
    updates, opt = tx.update(grads, state["opt"], state["params"])
    new = {"params": optax.apply_updates(state["params"], updates), "opt": opt, "step": state["step"] + 1}
    if mesh is not None:
        new = jax.lax.with_sharding_constraint(new, state_shardings(task, config, hyper, mesh, opt))
    grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
    out = {"loss": losses.mean(), "grad_norm": grad_norm, "lr": lr_schedule(hyper)(state["step"])}
    out.update({k: v.mean(0) for k, v in metrics.items()})
    return new, out


@functools.partial(jax.jit, static_argnames=("task", "config", "hyper"))
def eval_loss(params, target: dict, batch: dict, *, task: T.Task, config: ModelConfig, hyper: Hyper):
    """The objective on held-out micro-batches (same layout as train_step's batch), averaged."""
    losses, metrics = jax.lax.map(lambda mb: _micro_loss(params, target, mb, task, config, hyper), batch)
    return {"loss": losses.mean(), **{k: v.mean(0) for k, v in metrics.items()}}


# ---- the loop ----------------------------------------------------------------------------------------

@dataclasses.dataclass
class LoopResult:
    params: dict
    start_step: int          # where this call began (0, or the restored checkpoint's step)
    steps_run: int
    train_s: float           # wall time of the steps run by this call (compilation included)
    step_s: list[float]      # wall time of each step (host-synchronised on the loss)


def _checkpoint_manager(ckpt_dir: str, keep: int) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(os.path.abspath(ckpt_dir),
                                 options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))


def latest_step(ckpt_dir: str) -> int | None:
    """The step of the newest complete checkpoint in ckpt_dir (None when there is none)."""
    if not os.path.isdir(ckpt_dir):
        return None
    return _checkpoint_manager(ckpt_dir, 1).latest_step()


def _jsonable(v):
    a = to_host(v)
    return a.item() if a.ndim == 0 else a.tolist()


def run(*, task: T.Task, config: ModelConfig, hyper: Hyper, target: dict, params, batch_fn: Callable[[int], dict],
        ckpt_dir: str, mesh=None, save_every: int = 100, keep: int = 2,
        log: Callable[[int, dict], None] | None = None, on_step: Callable[[int, dict], None] | None = None,
        desc: str = "train", quiet: bool = False) -> LoopResult:
    """Train from `params` (or from the newest checkpoint in ckpt_dir) to hyper.steps.

    batch_fn(step) -> host batch dict for that step. log(step, metrics) after every step (metrics as
    Python values); on_step(step, state) after every step (evaluation hooks). Checkpoints every
    `save_every` steps and at the end (atomic: Orbax writes a temporary directory and renames it; the
    newest `keep` are kept); an interrupted run keeps its last complete checkpoint.
    """
    state = init_state(task, config, hyper, params, mesh)
    mngr = _checkpoint_manager(ckpt_dir, keep)
    start = 0
    if mngr.latest_step() is not None:
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        state = mngr.restore(mngr.latest_step(), args=ocp.args.StandardRestore(abstract))
        start = int(state["step"])
    bar = tqdm(range(start, hyper.steps), desc=desc, initial=start, total=hyper.steps, dynamic_ncols=True,
               disable=True if quiet else None)
    step_s, t_all = [], time.perf_counter()
    try:
        for i in bar:
            t0 = time.perf_counter()
            state, metrics = train_step(state, target, place_batch(batch_fn(i), mesh), task=task, config=config,
                                        hyper=hyper, mesh=mesh)
            metrics = {k: _jsonable(v) for k, v in metrics.items()}       # waits for the step
            step_s.append(time.perf_counter() - t0)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}")
            if log is not None:
                log(i + 1, dict(metrics, step_s=step_s[-1]))
            if (i + 1) % save_every == 0 or i + 1 == hyper.steps:
                mngr.save(i + 1, args=ocp.args.StandardSave(state))
            if on_step is not None:
                on_step(i + 1, state)
    finally:
        mngr.wait_until_finished()
        mngr.close()
    return LoopResult(params=state["params"], start_step=start, steps_run=len(step_s),
                      train_s=time.perf_counter() - t_all, step_s=step_s)


def truncate_jsonl(path: str, last_step: int) -> None:
    """Drop records with step > last_step (a resumed run rewrites what it redoes), atomically."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        keep = [ln for ln in f if ln.strip() and json.loads(ln).get("step", 0) <= last_step]
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.writelines(keep)
    os.replace(tmp, path)
