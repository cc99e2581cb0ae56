"""One process of the multi-process test (tests/test_multihost.py): load a checkpoint onto a mesh over the
devices of every process, run `forward` and `generate` (plain and MTP, greedy), and write the results
(process 0) as JSON. Without DSV4_* variables it is the single-process reference.

    python tests/multihost_checks.py CKPT OUT.json
"""
import json
import sys
import time

import jax
import numpy as np

from dsv4_jax import forward, generate, load_checkpoint
from dsv4_jax.parallel import initialize_distributed, make_mesh, to_host

PROMPT = [[5, 17, 3, 42, 8, 11, 29, 60, 7, 2]]       # token ids < 64 (the test model's vocabulary)
T0 = time.time()


def log(*a) -> None:
    print(f"[{time.time() - T0:6.1f}s p{jax.process_index()}]", *a, file=sys.stderr, flush=True)


def run(ckpt: str, mesh=None, sharding=None) -> dict:
    config, params = load_checkpoint(ckpt, dtype=np.float32, mesh=mesh, sharding=sharding)
    log("loaded", sharding or mesh)
    leaves = jax.tree.leaves(params)
    split = sum(1 for a in leaves if not a.is_fully_replicated) if mesh is not None or sharding else 0
    logits = to_host(forward(params, config, np.asarray(PROMPT, np.int32)))
    log("forward")
    plain, _ = generate(params, config, PROMPT, 6)
    log("generate")
    mtp, stats = generate(params, config, PROMPT, 6, drafter="mtp", draft_n_max=2)
    return {"logits": logits.tolist(), "plain": plain, "mtp": mtp, "split_leaves": split,
            "accepted": int(stats["accepted"]) if "accepted" in stats else None}


def main() -> None:
    ckpt, out = sys.argv[1], sys.argv[2]
    multi = initialize_distributed()
    res = {"processes": jax.process_count(), "devices": jax.device_count()}
    if multi:
        res["plain_mesh"] = run(ckpt, mesh=make_mesh((1, jax.device_count(), 1)))
        res["latency"] = run(ckpt, sharding="latency")
    else:
        res["reference"] = run(ckpt)
    if jax.process_index() == 0:
        with open(out, "w") as f:
            json.dump(res, f)


if __name__ == "__main__":
    main()
