"""Drafter training steps on 8 forced host devices against the single-device step (run by
tests/test_train_drafter.py in a subprocess: XLA_FLAGS must hold the device count before jax starts).

For MTP and DSpark: two optimizer steps (gradient accumulation over 2 micro-batches) on one device and on
a 2x2x2 (data x expert x model) mesh, from the same initial weights and batches. On one device (reusing
the compiled steps): MTP trained 4 steps in one go against 2 steps, an interruption, and a resume from the
checkpoint (`drafter_train.run`); DSpark with the target states precomputed (the --cache-targets path)
instead of computed in the step. Prints one line `RESULT {json}` with the largest differences per leaf,
which the test asserts on:

    python tests/train_drafter_checks.py [--only mtp,dspark] [--mesh 2x2x2]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dsv4_jax.model import params as P
from dsv4_jax import parallel as SH  # noqa: E402
from dsv4_jax.training import drafter_tasks as T, drafter_train as DT, target_cache as TC  # noqa: E402
from tests import drafter_fixtures as F  # noqa: E402

def _maxdiff(a, b) -> float:
    return max(_leaf_diffs(a, b).values())


def _leaf_diffs(a, b) -> dict[str, float]:
    fa, fb = P.flatten(a), P.flatten(b)
    return {k: float(np.max(np.abs(np.asarray(fa[k], np.float32) - np.asarray(fb[k], np.float32)))) for k in fa}


def _steps(task, config, h, target, params, mesh, batches=None, steps: int = 2):
    state = DT.init_state(task, config, h, params, mesh)
    losses = []
    for i in range(steps):
        b = F.batch(task, h, i) if batches is None else batches(i)
        state, m = DT.train_step(state, target, DT.place_batch(b, mesh), task=task, config=config, hyper=h,
                                 mesh=mesh)
        losses.append(float(m["loss"]))
    return state, losses


def check_cached(task, config, h, target, params) -> dict:
    """The same steps with the target states written by target_cache.write and read back by its Reader."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "cache")
        windows = lambda s: F.batch(task, h, s)["tokens"].reshape(-1, h.seq_len)
        TC.write(path, task, config, target, jnp.float32, fingerprint="test", window_fn=windows, n_steps=2,
                 per_step=h.grad_accum * h.batch, seq_len=h.seq_len)
        reader = TC.Reader(path, jnp.float32)

        def batches(i):
            b = reader.batch(i, h.grad_accum, h.batch)
            return dict(b, anchors=F.batch(task, h, i)["anchors"])
        same_tokens = all(np.array_equal(reader.batch(i, h.grad_accum, h.batch)["tokens"],
                                         F.batch(task, h, i)["tokens"]) for i in range(2))
        cached, losses = _steps(task, config, h, target, params, None, batches)
    return cached, losses, same_tokens


def _n_split(tree) -> int:
    return sum(not x.sharding.is_fully_replicated for x in jax.tree.leaves(tree))


def check_resume(task, config, h, target, params) -> dict:
    """4 steps in one go == 2 steps, an interruption while fetching step 3's batch, then a resume to 4."""
    h = dataclasses.replace(h, steps=4)
    kw = dict(task=task, config=config, hyper=h, target=target, params=params, save_every=2, quiet=True)
    with tempfile.TemporaryDirectory() as tmp:
        full = DT.run(batch_fn=lambda i: F.batch(task, h, i), ckpt_dir=os.path.join(tmp, "a"), **kw)

        def dies_at_3(i):
            if i == 2:
                raise KeyboardInterrupt
            return F.batch(task, h, i)
        try:
            DT.run(batch_fn=dies_at_3, ckpt_dir=os.path.join(tmp, "b"), **kw)
            interrupted = False
        except KeyboardInterrupt:
            interrupted = True
        saved = DT.latest_step(os.path.join(tmp, "b"))
        resumed = DT.run(batch_fn=lambda i: F.batch(task, h, i), ckpt_dir=os.path.join(tmp, "b"), **kw)
    return {"interrupted": interrupted, "checkpoint_step_after_interrupt": saved,
            "resumed_from": resumed.start_step, "resumed_steps_run": resumed.steps_run,
            "resume_diff": _leaf_diffs(full.params, resumed.params),
            "resume_moved": _maxdiff(full.params, params)}


def check(kind: str, mesh_shape) -> dict:
    config = F.config()
    task = F.mtp_task() if kind == "mtp" else F.dspark_task(config)
    h = F.hyper(grad_accum=2)
    target = F.target(config)
    params = T.init_drafter(task, config, "scratch", 1)
    single, l1 = _steps(task, config, h, target, params, None)
    mesh = SH.make_mesh(mesh_shape)
    sharded_target = SH.shard_params(target, config, mesh)
    sharded, l8 = _steps(task, config, h, sharded_target, params, mesh)
    out = {"losses_single": l1, "losses_sharded": l8, "loss_diff": max(abs(a - b) for a, b in zip(l1, l8)),
           "params_diff": _leaf_diffs(single["params"], sharded["params"]),
           "opt_diff": _maxdiff(single["opt"], sharded["opt"]),
           "moved": _maxdiff(single["params"], params), "lr": h.lr, "steps": 2,
           "split_params": _n_split(sharded["params"]), "split_opt": _n_split(sharded["opt"]),
           "split_target": _n_split(sharded_target), "n_params_leaves": len(jax.tree.leaves(params))}
    if kind == "mtp":
        out.update(check_resume(task, config, h, target, params))
    else:
        cached, lc, same = check_cached(task, config, h, target, params)
        out.update(losses_cached=lc, cache_tokens_match=same, cached_loss_diff=max(abs(a - b) for a, b in zip(l1, lc)),
                   cached_params_diff=_leaf_diffs(single["params"], cached["params"]),
                   cached_opt_diff=_maxdiff(single["opt"], cached["opt"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="mtp,dspark")
    ap.add_argument("--mesh", default="2x2x2")
    a = ap.parse_args()
    shape = tuple(int(x) for x in a.mesh.split("x"))
    out = {"devices": jax.device_count(), "mesh": list(shape)}
    for kind in a.only.split(","):
        out[kind] = check(kind, shape)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
