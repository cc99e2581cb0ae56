"""`speculative.precompile`: the programs it lists are exactly the ones `generate` then calls (chunked prefill and
priming included), compiled two at a time."""
import numpy as np
from jax import monitoring

import dsv4_jax as d
from dsv4_jax.model.params import init_mtp
from dsv4_jax.speculative import generate as G, loop, prefill as F
from dsv4_jax.speculative import precompile as PC

COMPILES: list = []      # (phase, function name) of every XLA compile while a phase is recorded
PHASE = [None]
NAMES = ("prefill_piece", "init_rows", "prime_piece", "start_carry", "run_rounds")


def _on_event(event, duration, fun_name=None, **_):
    if PHASE[0] and event == "/jax/core/compile/backend_compile_duration":
        COMPILES.append((PHASE[0], fun_name))


monitoring.register_event_duration_secs_listener(_on_event)


def _compiled(phase: str) -> list:
    return sorted(n for p, n in COMPILES if p == phase and n in {f"jit({m})" for m in NAMES})


def test_two_threads_compile_what_generate_calls():
    """A chunked run (prompts of 6 and 11 tokens, chunks of 4): `compile_all(threads=2)` compiles each of its
    five programs once, the run then compiles none of them again, and its tokens equal a run without chunks."""
    config = d.tiny()
    params = d.init_params(config, 51)
    params["mtp"] = init_mtp(config, 52)
    rng = np.random.default_rng(6)
    prompts = [rng.integers(2, 97, n).tolist() for n in (6, 11)]
    kw = dict(drafter="mtp", draft_n_max=2, eos_token_id=-1, max_len=64, prefill_chunk=4)
    progs = PC.programs(params, G.prepare(params, config, prompts, 8, **kw))
    assert {p.fn for p in progs} == {F.prefill_piece, F.init_rows, F.prime_piece, F.start_carry, loop.run_rounds}
    try:
        PHASE[0] = "precompile"
        assert PC.compile_all(progs, threads=2)["programs"] == 5
        PHASE[0] = "run"
        toks, _ = d.generate(params, config, prompts, 8, **kw)
    finally:
        PHASE[0] = None
    assert _compiled("precompile") == sorted(f"jit({m})" for m in NAMES)
    assert _compiled("run") == []
    assert toks == d.generate(params, config, prompts, 8, **{**kw, "prefill_chunk": None})[0]
