"""A small, resumable optax training loop with Orbax checkpoints and a progress bar."""
from __future__ import annotations

import os
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
from tqdm.auto import tqdm

from ..ops.host import to_host


def optimizer(lr: float, steps: int, warmup: int = 50, weight_decay: float = 0.01, clip: float = 1.0):
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, min(warmup, max(steps // 10, 1)), steps, lr * 0.1)
    return optax.chain(optax.clip_by_global_norm(clip), optax.adamw(sched, b2=0.95, weight_decay=weight_decay))


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)


def split_trainable(params):
    """(float leaves with None elsewhere, integer leaves such as tid2eid with None elsewhere)."""
    return (jax.tree.map(lambda x: x if _is_float(x) else None, params),
            jax.tree.map(lambda x: None if _is_float(x) else x, params))


def merge(trainable, frozen):
    return jax.tree.map(lambda a, b: b if a is None else a, trainable, frozen, is_leaf=lambda x: x is None)


def train(loss_fn: Callable, params, batches: Iterator, *, steps: int, lr: float, ckpt_dir: str,
          save_every: int = 100, desc: str = "train", log: Callable[[int, dict], None] | None = None):
    """Minimise loss_fn(params, batch) -> (loss, metrics dict) for `steps` steps; resumes from ckpt_dir.

    Returns the trained params. Checkpoints {params, opt_state, step} every `save_every` steps and at
    the end (Orbax, last two kept); a run restarted with the same arguments continues where it stopped.
    The data iterator is advanced past the steps already done, so a resumed run sees the same batches.
    """
    tx = optimizer(lr, steps)
    params, frozen = split_trainable(params)
    state = {"params": params, "opt": tx.init(params), "step": jnp.zeros((), jnp.int32)}
    mngr = ocp.CheckpointManager(os.path.abspath(ckpt_dir), options=ocp.CheckpointManagerOptions(max_to_keep=2))
    start = 0
    if mngr.latest_step() is not None:
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        state = mngr.restore(mngr.latest_step(), args=ocp.args.StandardRestore(abstract))
        start = int(state["step"])
        for _ in range(start):
            next(batches)

    @jax.jit
    def step(state, batch):
        (loss, metrics), grads = jax.value_and_grad(lambda p: loss_fn(merge(p, frozen), batch), has_aux=True)(
            state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt,
                "step": state["step"] + 1}, loss, metrics

    bar = tqdm(range(start, steps), desc=desc, initial=start, total=steps, dynamic_ncols=True)
    ema = None
    try:
        for i in bar:
            state, loss, metrics = step(state, next(batches))
            loss = float(loss)
            ema = loss if ema is None else 0.95 * ema + 0.05 * loss
            bar.set_postfix(loss=f"{ema:.3f}")
            if log is not None:
                log(i + 1, {"loss": loss, **{k: v.tolist() for k, v in to_host(metrics).items()}})
            if (i + 1) % save_every == 0 or i + 1 == steps:
                mngr.save(i + 1, args=ocp.args.StandardSave(state))
    finally:   # an interrupted run keeps its last checkpoint complete
        mngr.wait_until_finished()
    return merge(state["params"], frozen)
