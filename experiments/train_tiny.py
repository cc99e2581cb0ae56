#!/usr/bin/env python
"""Train the tiny demo model: target LM, then MTP and DSpark drafters against the frozen target.

    python experiments/train_tiny.py all --out runs/tiny_demo            # every stage, then export + eval
    python experiments/train_tiny.py target --out runs/tiny_demo --steps 400
    python experiments/train_tiny.py mtp    --out runs/tiny_demo
    python experiments/train_tiny.py dspark --out runs/tiny_demo
    python experiments/train_tiny.py export --out runs/tiny_demo [--to dsv4_jax/assets/tiny_demo]
    python experiments/train_tiny.py evaluate --out runs/tiny_demo

Corpus: this interpreter's standard-library .py files (a fixed ~5 % of files held out), byte-level
vocabulary (dsv4_jax.demo.ByteTokenizer). Each stage is seeded and resumable: it checkpoints with
Orbax under OUT/ckpt_<stage> and continues from there when restarted with the same arguments. The
drafter stages use the training step, loop and objectives of `dsv4-train-drafter`
(dsv4_jax.training.drafter_train / drafter_tasks); `dsv4-train-drafter --model tiny-demo` trains a
drafter for the bundled model from any text.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax.numpy as jnp

import dsv4_jax as d
from dsv4_jax.backends import CHOICES
from dsv4_jax.demo import ByteTokenizer, demo_config, demo_dspark_config
from dsv4_jax.io.demo_io import load_bundle, save_bundle
from dsv4_jax.model.params import init_dspark, init_mtp
from dsv4_jax.training import data, drafter_tasks as T, drafter_train as DT, objectives, text_data as TD
from dsv4_jax.training.evaluate import evaluate_bundle, format_table
from dsv4_jax.training.loop import train

STAGES = ("target", "mtp", "dspark", "export", "evaluate", "all")
DEFAULT_STEPS = {"target": 400, "mtp": 300, "dspark": 1000}


def _bundle_dir(out, stage):
    return os.path.join(out, f"stage_{stage}")


def _logger(out, stage):
    path = os.path.join(out, f"log_{stage}.jsonl")

    def log(step, metrics):
        if step % 10 == 0:
            with open(path, "a") as f:
                f.write(json.dumps({"step": step, **metrics}) + "\n")
    return log


def stage_target(args, config):
    stream = data.corpus("train", ByteTokenizer.BOS)
    params = d.init_params(config, args.seed)
    batches = data.batches(stream, args.batch, args.length + 1, args.seed)
    t0 = time.time()
    params = train(lambda p, b: (objectives.target_loss(p, config, jnp.asarray(b)), {}), params, batches,
                   steps=args.steps, lr=args.lr, ckpt_dir=os.path.join(args.out, "ckpt_target"), desc="target",
                   log=_logger(args.out, "target"))
    save_bundle(_bundle_dir(args.out, "target"), config, params, {"train_s": time.time() - t0, "steps": args.steps})


def _frozen(args):
    config, params, _ = load_bundle(_bundle_dir(args.out, "target"), jnp.float32)
    return config, {k: v for k, v in params.items() if k not in ("mtp", "dspark")}


def _train_drafter(args, config, target, task, params, seed: int, stage: str):
    """The drafter stages run the same step and loop as dsv4-train-drafter (training.drafter_train, the
    objectives of training.drafter_tasks): float32, target states computed in the step, seeded windows."""
    stream = data.corpus("train", ByteTokenizer.BOS)
    hyper = DT.Hyper(steps=args.steps, batch=args.batch, seq_len=args.length, lr=args.lr,
                     warmup=min(50, max(args.steps // 10, 1)), compute_dtype="float32", seed=seed)

    def batch_fn(step):
        starts = TD.window_starts(len(stream), args.length, args.batch, seed, step)
        out = {"tokens": TD.windows(stream, starts, args.length)[None]}
        anchors = T.anchors_for(task, args.length, (1, args.batch), seed, step)
        return out if anchors is None else dict(out, anchors=anchors)

    t0 = time.time()
    params = DT.run(task=task, config=config, hyper=hyper, target=target, params=params, batch_fn=batch_fn,
                    ckpt_dir=os.path.join(args.out, f"ckpt_{stage}"), log=_logger(args.out, stage), desc=stage).params
    save_bundle(_bundle_dir(args.out, stage), config, params, {"train_s": time.time() - t0, "steps": args.steps})


def stage_mtp(args, config):
    config, target = _frozen(args)
    _train_drafter(args, config, target, T.MTPTask(), init_mtp(config, args.seed + 1)[0], args.seed + 1, "mtp")


def stage_dspark(args, config):
    config, target = _frozen(args)
    dcfg = demo_dspark_config()
    task = T.DSparkTask(dcfg, n_stages=2, markov_rank=32, anchors=args.anchors)
    params = init_dspark(config, args.seed + 2, n_stages=2, n_taps=len(dcfg.target_layer_ids), markov_rank=32)
    _train_drafter(args, config, target, task, params, args.seed + 2, "dspark")


def stage_export(args, config):
    config, target, ti = load_bundle(_bundle_dir(args.out, "target"))
    _, mtp, mi = load_bundle(_bundle_dir(args.out, "mtp"))
    _, dp, di = load_bundle(_bundle_dir(args.out, "dspark"))
    params = dict(target, mtp=[mtp], dspark=dp)
    info = {"train_s": {"target": ti.get("train_s"), "mtp": mi.get("train_s"), "dspark": di.get("train_s")},
            "steps": {"target": ti.get("steps"), "mtp": mi.get("steps"), "dspark": di.get("steps")},
            "seed": args.seed, "corpus": "python stdlib .py files (held-out: sha1(relpath) % 20 == 0)",
            "python": sys.version.split()[0]}
    dest = args.to or os.path.join(args.out, "bundle")
    save_bundle(dest, config, params, info)
    size = sum(os.path.getsize(os.path.join(dest, f)) for f in os.listdir(dest))
    print(f"exported {dest} ({size / 1e6:.1f} MB)")


def stage_evaluate(args, config):
    res = evaluate_bundle(args.to or os.path.join(args.out, "bundle"), n_prompts=args.eval_prompts,
                          max_new=args.eval_new, repeats=args.eval_repeats, backends=args.kernels)
    path = os.path.join(args.out, "eval.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print(format_table(res))
    print(json.dumps(res["summary"], indent=1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=STAGES)
    ap.add_argument("--out", default="runs/tiny_demo", help="working directory (checkpoints, logs, bundles)")
    ap.add_argument("--to", default=None, help="export / evaluate: bundle directory (default OUT/bundle)")
    ap.add_argument("--steps", type=int, default=None,
                    help="optimizer steps (default: target 400, mtp 300, dspark 1000)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--length", type=int, default=256, help="training sequence length in bytes")
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (default 3e-3 target, 2e-3 drafters)")
    ap.add_argument("--anchors", type=int, default=8, help="DSpark blocks per training sequence")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-prompts", type=int, default=16)
    ap.add_argument("--eval-new", type=int, default=128)
    ap.add_argument("--eval-repeats", type=int, default=3,
                    help="evaluate: timed calls per prompt (the fastest counts; timings on shared CPUs vary)")
    ap.add_argument("--kernels", choices=CHOICES, default="reference",
                    help="evaluate: implementation of the hot ops (dsv4_jax.backends; default reference)")
    args = ap.parse_args(argv)
    for v, name in ((args.batch, "--batch"), (args.length, "--length"), (args.anchors, "--anchors"),
                    (args.eval_prompts, "--eval-prompts"), (args.eval_new, "--eval-new"),
                    (args.eval_repeats, "--eval-repeats")):
        if v <= 0:
            ap.error(f"{name} must be positive")
    os.makedirs(args.out, exist_ok=True)
    config = demo_config()
    stages = ["target", "mtp", "dspark", "export", "evaluate"] if args.stage == "all" else [args.stage]
    for st in stages:
        a = argparse.Namespace(**vars(args))
        a.steps = args.steps or DEFAULT_STEPS.get(st, 0)
        a.lr = args.lr or (3e-3 if st == "target" else 2e-3)
        globals()[f"stage_{st}"](a, config)


if __name__ == "__main__":
    main()
