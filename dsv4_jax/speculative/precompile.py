"""Compile `generate`'s programs before a run (research sweeps: a first run's compile time, reported apart).

`programs(params, r)` lists the jitted programs a prepared run (`generate.prepare`) calls — the
target's prefill and the priming (or, chunked, `speculative.prefill`'s empty rows, prefill piece,
priming piece and the rows' carry), the decode loop — with abstract arguments where they are computed (nothing runs).
`compile_all` traces, lowers and compiles the distinct ones, `threads` at a time (XLA compiles with the
GIL released; XLA:CPU already spreads one program's code generation over the cores, so on two cores one
at a time is as fast). The executables land in jit's own caches and in the persistent compilation cache
(when on), so the run's jit calls find them: the same programs, the same tokens.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from .generate import RunPlan
from .loop import hand_over, plain_knobs, plain_program, round_jit, run_rounds
from .prefill import init_rows, prefill_piece, prefill_target, prime, prime_piece, start_carry

KIND_ORDER = {"loop": 0, "prefill": 1, "prime": 2, "init": 3}     # biggest first: the pool's threads finish together


@dataclasses.dataclass(frozen=True)
class Call:
    """One jitted call of a run: fn(*args, **kwargs), args concrete or jax.ShapeDtypeStruct."""

    kind: str                 # "prefill" | "prime" | "loop" | "init" (a chunked prefill's empty rows)
    fn: Callable
    args: tuple
    kwargs: dict
    size: int = 0             # a rough size for ordering (the loop's drafts per round)

    def key(self) -> tuple:
        """Equal for calls that compile to the same program: the function, static arguments and shapes."""
        spec = lambda x: (tuple(x.shape), str(x.dtype)) if hasattr(x, "shape") and hasattr(x, "dtype") else x
        leaves, tree = jax.tree.flatten((self.args, self.kwargs))
        return (self.kind, tree, tuple(spec(x) for x in leaves))

    def compile(self):
        return self.fn.trace(*self.args, **self.kwargs).lower().compile()


def programs(params: dict, r: RunPlan) -> list[Call]:
    """The prefill, priming and loop programs `generate` runs for the prepared run r (nothing executes).

    Each is called as `generate` calls it (the same arguments positional or by keyword): jit's caches
    are keyed on the call's form, so a differently spelled call would trace and compile again."""
    tokens, lengths = jnp.asarray(r.tokens), jnp.asarray(r.lengths)
    key = jax.random.PRNGKey(r.seed)
    fill = dict(max_len=r.max_len, max_block=r.max_block, taps=r.prefill_taps)
    loop = round_jit if r.host_loop else run_rounds
    program = r.program.at_bound(r.max_block - 1)     # the carry's bound (`start`)
    if r.prefill_chunk is None:
        prefilled = jax.eval_shape(lambda p, t, n: prefill_target(p, r.config, t, n, **fill), params, tokens, lengths)
        prime_kw = dict(max_len=r.max_len, program=program, prefill_taps=r.prefill_taps, knobs=r.knobs, key=key)
        prime_args = (params, r.config, *prefilled, tokens, lengths)
        carry = jax.eval_shape(lambda p, *a: prime(p, r.config, *a, **prime_kw), params, *prime_args[2:])
        steps = [Call("prefill", prefill_target, (params, r.config, tokens, lengths), fill),
                 Call("prime", prime, prime_args, prime_kw)]
    else:
        B, C = tokens.shape[0], r.prefill_chunk
        init_kw = dict(batch=B, max_len=r.max_len, program=program)
        rows = jax.eval_shape(lambda p, k: init_rows(p, r.config, k, **init_kw), params, r.knobs)
        chunk, vec = jax.ShapeDtypeStruct((B, C), jnp.int32), lambda dtype: jax.ShapeDtypeStruct((B,), dtype)
        piece_args = (params, r.config, rows.target, chunk, vec(jnp.int32))
        _, last, aux = jax.eval_shape(lambda p, *a: prefill_piece(p, r.config, *a, taps=r.prefill_taps), params,
                                      *piece_args[2:])
        prime_args = (params, r.config, rows.drafter, rows.first, aux, last, chunk, vec(jnp.int32), vec(jnp.int32),
                      vec(jnp.bool_), key, r.knobs)
        carry = jax.eval_shape(lambda rw, k: start_carry(rw, k, program=program), rows, key)
        steps = [Call("prefill", prefill_piece, piece_args, {"taps": r.prefill_taps}),
                 Call("init", init_rows, (params, r.config, r.knobs), init_kw),
                 Call("prime", prime_piece, prime_args, dict(program=program, prefill_taps=r.prefill_taps)),
                 Call("prime", start_carry, (rows, key), {"program": program})]
    steps.append(Call("loop", loop, (params, r.config, carry, r.knobs, r.program), {}, size=r.program.k))
    if r.program.adaptive and not r.host_loop:      # after a switch to plain decoding: the `none` program
        plain = plain_program(r.program)
        lean = jax.eval_shape(lambda c: hand_over(c, plain), carry)
        steps.append(Call("loop", run_rounds, (params, r.config, lean, plain_knobs(r.knobs), plain), {}))
    return steps


def distinct(progs: Sequence[Call]) -> list[Call]:
    """One of each program, biggest first (loops by draft width, then prefills, then primings)."""
    seen: dict[tuple, Call] = {}
    for p in progs:
        seen.setdefault(p.key(), p)
    return sorted(seen.values(), key=lambda p: (KIND_ORDER[p.kind], -p.size))


def compile_all(progs: Sequence[Call], threads: int = 1) -> dict[str, Any]:
    """Compile the distinct programs on `threads` threads. -> {"programs": n, "wall_s": seconds}."""
    todo = distinct(progs)
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        for f in [pool.submit(p.compile) for p in todo]:
            f.result()
    return {"programs": len(todo), "wall_s": time.perf_counter() - t0}
