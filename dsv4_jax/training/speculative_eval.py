"""Held-out evaluation of a drafter with the real speculative loop (`dsv4_jax.generate`).

Greedy decoding of held-out prompts, all prompts in one batch: acceptance per position, mean accepted
length (docs/drafter_math.md §4.1, bonus token included), draft acceptance rate, and the losslessness check
(speculative greedy output == plain greedy output, token for token). The plain output is computed once:
the target is frozen. Shapes are fixed (max_len, prompt length), so every evaluation of a run reuses the
compiled loop.
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from ..config import ModelConfig
from ..research.calibration import metrics as calibration_metrics
from ..speculative.generate import generate
from . import drafter_tasks as T


class SpeculativeEval:
    """evaluate(drafter_params) -> metrics dict, for one task, target and prompt set."""

    def __init__(self, task: T.Task, target: dict, config: ModelConfig, prompts: np.ndarray, max_new: int, k: int,
                 dtype=jnp.float32):
        self.task, self.config, self.dtype = task, config, jnp.dtype(dtype)
        self.target = jax.tree.map(lambda x: x.astype(self.dtype) if jnp.issubdtype(x.dtype, jnp.floating)
                                   and x.ndim >= 2 else x, target)
        self.prompts, self.max_new = np.asarray(prompts, np.int32), max_new
        self.k = k if task.kind == "mtp" else min(k, task.dcfg.block_size)
        self.max_len = self.prompts.shape[1] + max_new + self.k + 1
        self._plain = None

    def _kw(self) -> dict:
        return dict(eos_token_id=-1, max_len=self.max_len)

    def plain(self) -> list[list[int]]:
        if self._plain is None:
            self._plain = generate(self.target, self.config, self.prompts, self.max_new, **self._kw())[0]
        return self._plain

    def params_with(self, drafter) -> dict:
        """The target params plus the drafter (in the evaluation dtype) where generate() looks for it."""
        d = T.cast(drafter, T.drafter_specs(self.task, self.config), self.dtype)
        return dict(self.target, mtp=[d]) if self.task.kind == "mtp" else dict(self.target, dspark=d)

    def __call__(self, drafter) -> dict:
        plain = self.plain()
        meta = None if self.task.kind == "mtp" else self.task.dcfg
        t0 = time.perf_counter()
        toks, st = generate(self.params_with(drafter), self.config, self.prompts, self.max_new,
                            drafter=self.task.kind, draft_n_max=self.k, dspark_meta=meta, **self._kw())
        wall = time.perf_counter() - t0
        return {"k": self.k, "mean_accepted_length": st["mean_accepted_length"],
                "per_position_accept_rate": st["per_position_accept_rate"],
                "draft_acceptance_rate": st["draft_acceptance_rate"], "rounds": st["rounds"],
                "drafted": st["drafted"], "accepted": st["accepted"],
                "lossless": toks == plain, "sequences_differing": sum(a != b for a, b in zip(toks, plain)),
                "n_prompts": len(plain), "prompt_len": int(self.prompts.shape[1]), "max_new_tokens": self.max_new,
                "dtype": self.dtype.name, "wall_s": wall,
                # the confidence head against realised acceptance, per position (docs/verification.md §4)
                **({"calibration": st["calibration"], "calibration_metrics": calibration_metrics(st["calibration"])}
                   if st.get("calibration") else {})}
