"""One process of the multi-process test (tests/test_multihost.py). It first runs the docs' `my_run.py`
(docs/sharding.md) as written -- its `initialize_distributed()` joins the processes, it loads the checkpoint
onto a 1×8×1 mesh over the devices of every process, runs `forward` (through `to_host`) and plain greedy
`generate`, and prints -- then, reusing the recipe's params, prompt and compiled programs, adds MTP greedy
`generate` on that mesh and load / forward / plain / MTP under the `latency` preset. Process 0 writes the
results as JSON (the single-process reference is computed by the test itself).

    python tests/multihost_checks.py MY_RUN.py CKPT OUT.json
"""
import json
import runpy
import sys
import time

import jax
import numpy as np

from dsv4_jax import forward, generate, load_checkpoint, to_host

GENERATE = sys.modules["dsv4_jax.speculative.generate"]      # the module (dsv4_jax.generate is the function)
T0 = time.time()


def log(*a) -> None:
    print(f"[{time.time() - T0:6.1f}s p{jax.process_index()}]", *a, file=sys.stderr, flush=True)


def count_calls(module, name: str, calls: list) -> None:
    """Wrap module.name so that each call appends 1 to `calls` (generate's fetches of the results)."""
    f = getattr(module, name)

    def counted(tree):
        calls.append(1)
        return f(tree)
    setattr(module, name, counted)


def split_leaves(params) -> int:
    return sum(1 for a in jax.tree.leaves(params) if not a.is_fully_replicated)


def dtypes(params) -> list[str]:
    return sorted({str(a.dtype) for a in jax.tree.leaves(params) if jax.numpy.issubdtype(a.dtype, np.floating)})


def mtp(params, config, prompt, n: int) -> list:
    return generate(params, config, prompt, n, drafter="mtp", draft_n_max=2)[0]


def main() -> None:
    recipe, ckpt, out = sys.argv[1:4]
    fetches = []
    count_calls(GENERATE, "to_host", fetches)
    argv, sys.argv = sys.argv, [recipe, ckpt]
    g = runpy.run_path(recipe, run_name="__main__")          # the docs' program, as written
    sys.argv = argv
    log("recipe")
    prompt, n_new = g["prompt"], len(g["tokens"][0])
    params, config = g["params"], g["config"]
    res = {"processes": jax.process_count(), "devices": jax.device_count(), "prompt": prompt.tolist(),
           "recipe_fetches": len(fetches)}
    res["plain_mesh"] = {"logits": np.asarray(g["logits"]).tolist(), "plain": g["tokens"],
                         "mtp": mtp(params, config, prompt.tolist(), n_new), "split_leaves": split_leaves(params),
                         "dtypes": dtypes(params)}
    log("plain mesh")
    config, params = load_checkpoint(ckpt, sharding="latency", verify=False)   # the recipe verified it
    raw = forward(params, config, prompt)
    res["latency"] = {"logits": to_host(raw).tolist(),
                      "logits_split_across_hosts": not raw.is_fully_addressable and not raw.is_fully_replicated,
                      "plain": generate(params, config, prompt.tolist(), n_new)[0],
                      "mtp": mtp(params, config, prompt.tolist(), n_new), "split_leaves": split_leaves(params),
                      "dtypes": dtypes(params)}
    res["generate_fetches"] = len(fetches)
    log("latency")
    if jax.process_index() == 0:
        with open(out, "w") as f:
            json.dump(res, f)


if __name__ == "__main__":
    main()
