"""Small targets, drafter tasks and batches for the drafter-training tests (tests/test_train_drafter.py and
the 8-device subprocess tests/train_drafter_checks.py). Kept tiny: the training step compiles the target
forward, the drafter forward and backward and AdamW in one program."""
from __future__ import annotations

import numpy as np

from dsv4_jax.model import params as P
from dsv4_jax.config import _tiny_base
from dsv4_jax.drafters.dspark import DSparkConfig
from dsv4_jax.training import drafter_tasks as T, drafter_train as DT

VOCAB = 128          # divisible by 8: the vocabulary really shards on an 8-device `model` axis


def config(n_layers: int = 2):
    """SWA layers, score routing, 4 experts, 2 streams, 3 Sinkhorn iterations: the cheapest full V4 block."""
    return _tiny_base(name=f"train-test-{n_layers}", ratios=[0] * n_layers, n_hash=0, hc_mult=2,
                      hc_sinkhorn_iters=3, n_routed_experts=4, num_heads=2, o_groups=2).replace(vocab_size=VOCAB)


def target(cfg, seed: int = 0) -> dict:
    return P.init_params(cfg, seed)


def mtp_task() -> T.MTPTask:
    return T.MTPTask()


def dspark_task(cfg) -> T.DSparkTask:
    n = cfg.num_layers
    return T.DSparkTask(DSparkConfig(block_size=3, noise_token_id=VOCAB - 1, target_layer_ids=tuple(range(n))),
                        n_stages=1, markov_rank=8, anchors=2, min_context=2)


def hyper(steps: int = 4, grad_accum: int = 1, batch: int = 4, seq_len: int = 16) -> DT.Hyper:
    return DT.Hyper(steps=steps, batch=batch, seq_len=seq_len, grad_accum=grad_accum, lr=3e-3, warmup=1,
                    compute_dtype="float32", seed=0)


def batch(task, h: DT.Hyper, step: int, stream: np.ndarray | None = None) -> dict:
    """The step's batch the way the CLI builds it: seeded windows of a random stream + anchors."""
    from dsv4_jax.training import text_data as TD
    if stream is None:
        stream = np.random.default_rng(7).integers(0, VOCAB - 1, 4096).astype(np.int32)
    starts = TD.window_starts(len(stream), h.seq_len, h.grad_accum * h.batch, h.seed, step)
    out = {"tokens": TD.windows(stream, starts, h.seq_len).reshape(h.grad_accum, h.batch, h.seq_len)}
    anchors = T.anchors_for(task, h.seq_len, (h.grad_accum, h.batch), h.seed, step)
    if anchors is not None:
        out["anchors"] = anchors
    return out
