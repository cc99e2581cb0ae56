"""`dsv4-long-context`: prefill speed, decode-step cost and peak memory against the context length.

For each context L (a fresh subprocess each, so that its peak RSS is its own): random weights of the model
(default `config.tiny_long`, Flash's attention regime at a tiny width), a decode state of L + steps + 8
positions, a prefill of L random tokens in chunks of --chunk tokens (`decode.extend`, one program: the last
chunk right-padded), then --decode-steps single-token steps (`decode.decode_step`). Compiles happen before
the clocks start.

    column          what
    prefill_tok_s   L / the prefill's seconds (every chunk, ended with block_until_ready)
    decode_ms       median seconds of a decode step after the prefill, in ms
    indexer_ms      the indexer's part of a decode step: scores + exact top-k of one query against the
                    L/m compressed rows, per CSA layer, summed (the same ops, timed alone)
    state_MB        the decode state's bytes (`state.state_bytes`, float32): grows with L
    params_MB       the weights' bytes
    chunk_temp_MB   the compiled prefill chunk's temporaries (`memory_analysis`): grow with L, not L²
    chunk_run_MB    one chunk's activations as executed: the resident memory one prefill chunk adds while it
                    runs (peak minus the resident memory before it, measured on a throwaway state of the same
                    shape). Above chunk_temp_MB by XLA:CPU's YNNPACK fusions' own workspace, which the
                    compiled program's buffer assignment does not hold (~490 MB at chunk 2,048 on tiny_long;
                    none with XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=)
    expected_MB     params + state + chunk_run_MB (one chunk's activations)
    peak_rss_MB     the subprocess's peak resident memory (ru_maxrss): the Python / XLA runtime, the compiles
    base_rss_MB     the resident memory just before the timed run: the runtime, the compiled programs, the
                    weights and the empty state
    run_rss_MB      the peak resident memory during the timed prefill + decode alone (Linux: the peak is
                    reset through /proc/self/clear_refs after the compiles), incl. the runtime and programs
    rss_ratio       run_rss / expected

Output (--out DIR): results.json, results.md, long_context.png (prefill tokens/s and decode ms vs L).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from .. import config as C
from ..config import CSA
from ..io.outdir import OutDirError
from ..model import decode
from ..model.params import init_params
from ..model.state import state_bytes
from ..ops import indexer as ops_indexer
from .bench_decode import tree_bytes
from .report import atomic_dir, check_out_dir, write_json

DEFAULT_CONTEXTS = "1024,2048,4096,8192,16384,32768"


def _status_kib(field: str) -> int:
    """A /proc/self/status memory field in KiB (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak_rss() -> None:
    """Reset the process's peak RSS (VmHWM) to its current RSS (Linux ≥ 4.0: clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _indexer_ms(config, L: int, repeats: int = 20) -> float:
    """One decode query's indexer (scores + validity + exact top-k) against L/m rows, × the CSA layers."""
    ratio = next(r for t, r in zip(config.layer_types, config.compress_ratios) if t == CSA)
    T = max(L // ratio, 1)
    H, dI = config.index_n_heads, config.index_head_dim
    k = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(k[0], (1, 1, H, dI))
    keys = jax.random.normal(k[1], (1, T, dI))
    om = jax.random.normal(k[2], (1, 1, H))
    pos = jnp.full((1, 1), L - 1, jnp.int32)

    @jax.jit
    def one(q, keys, om, pos):
        sc = ops_indexer.scores(q, keys, om)
        sc = jnp.where(ops_indexer.validity(sc.shape, pos, None, ratio), sc, -jnp.inf)
        return ops_indexer.topk(sc, config.index_topk)

    jax.block_until_ready(one(q, keys, om, pos))
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(one(q, keys, om, pos))
        ts.append(time.perf_counter() - t)
    return 1e3 * statistics.median(ts) * config.layer_types.count(CSA)


def _chunk_run_bytes(params, config, max_len: int, chunk: int) -> int:
    """The resident bytes one (compiled) prefill chunk adds while it runs on an empty state of max_len
    positions: peak minus before (Linux)."""
    state = decode.init_state(config, 1, max_len, 8)
    jax.block_until_ready(state.pos)
    _reset_peak_rss()
    before = _status_kib("VmRSS")
    jax.block_until_ready(decode.extend(params, config, state, np.zeros((1, chunk), np.int32), [chunk])[1].pos)
    return (_status_kib("VmHWM") - before) * 1024


def measure(preset: str, L: int, chunk: int, steps: int, seed: int = 0) -> dict:
    """One context length, in this process (the subprocess body)."""
    config = C.preset(preset)
    params = init_params(config, seed)
    max_len = L + steps + 8
    state = decode.init_state(config, 1, max_len, 8)
    tokens = np.asarray(jax.random.randint(jax.random.key(seed + 1), (1, L + steps), 0, config.vocab_size), np.int32)
    chunk = min(chunk, L)
    tok_spec = jax.ShapeDtypeStruct((1, chunk), jnp.int32)
    t0 = time.perf_counter()
    compiled = decode.process_block.lower(params, config, state, tok_spec, jax.ShapeDtypeStruct((1,), jnp.int32)
                                          ).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    # the programs the clocks will run, compiled on a throwaway state of the same shape
    warm = decode.init_state(config, 1, max_len, 8)
    _, warm, _ = decode.extend(params, config, warm, np.zeros((1, chunk), np.int32), [chunk])
    logits, warm, _ = decode.decode_step(params, config, warm, tokens[:, 0])
    jax.block_until_ready(logits)
    compile_s = time.perf_counter() - t0
    del warm
    chunk_run = _chunk_run_bytes(params, config, max_len, chunk)
    _reset_peak_rss()
    base_rss = _status_kib("VmRSS")
    t = time.perf_counter()
    for lo in range(0, L, chunk):
        part = tokens[:, lo:min(lo + chunk, L)]
        n = part.shape[1]
        _, state, _ = decode.extend(params, config, state, np.pad(part, ((0, 0), (0, chunk - n))), [n])
    jax.block_until_ready(state.pos)
    prefill_s = time.perf_counter() - t
    step_s = []
    for i in range(steps):
        t = time.perf_counter()
        logits, state, _ = decode.decode_step(params, config, state, tokens[:, L + i])
        jax.block_until_ready(logits)
        step_s.append(time.perf_counter() - t)
    finite = bool(np.isfinite(np.asarray(logits)).all())
    sb = state_bytes(config, 1, max_len, 8, jnp.float32)
    row = {"context": L, "chunk": chunk, "decode_steps": steps, "compile_s": round(compile_s, 2),
           "prefill_s": round(prefill_s, 3), "prefill_tok_s": round(L / prefill_s, 1),
           "decode_ms": round(1e3 * statistics.median(step_s), 3), "indexer_ms": round(_indexer_ms(config, L), 3),
           "state_MB": round(sb["total"] / 1e6, 2), "state_parts_MB": {k: round(v / 1e6, 2) for k, v in sb.items()},
           "params_MB": round(tree_bytes(params) / 1e6, 2), "chunk_temp_MB": round(temp / 1e6, 2),
           "chunk_run_MB": round(chunk_run / 1e6, 2),
           "logits_finite": finite}
    row["expected_MB"] = round(row["params_MB"] + row["state_MB"] + row["chunk_run_MB"], 2)
    row["base_rss_MB"] = round(base_rss / 1024, 1)
    row["run_rss_MB"] = round(_status_kib("VmHWM") / 1024, 1)
    row["peak_rss_MB"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)   # KiB on Linux
    row["rss_ratio"] = round(row["run_rss_MB"] / row["expected_MB"], 2)
    row["indexer_share"] = round(row["indexer_ms"] / row["decode_ms"], 3)
    return row


COLUMNS = ("context", "prefill_tok_s", "decode_ms", "indexer_ms", "indexer_share", "state_MB", "params_MB",
           "chunk_temp_MB", "chunk_run_MB", "expected_MB", "base_rss_MB", "run_rss_MB", "peak_rss_MB",
           "rss_ratio", "compile_s")


def markdown(rows: list[dict], meta: dict) -> str:
    head = (f"# Long context: {meta['preset']} on {meta['machine']}\n\n{meta['date']}, jax {meta['jax']}, "
            f"`{meta['command']}`\n\n")
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in COLUMNS) + " |" for r in rows]
    return head + "\n".join(lines) + "\n\nColumns: `dsv4_jax.research.long_context` module docstring.\n"


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    L = [r["context"] for r in rows]
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ax[0].plot(L, [r["prefill_tok_s"] for r in rows], "o-")
    ax[0].set(xscale="log", xlabel="context (tokens)", ylabel="prefill tokens/s", title="chunked prefill")
    ax[1].plot(L, [r["decode_ms"] for r in rows], "o-", label="decode step")
    ax[1].plot(L, [r["indexer_ms"] for r in rows], "s--", label="indexer part")
    ax[1].set(xscale="log", xlabel="context (tokens)", ylabel="ms", title="decode step")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsv4-long-context", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="example: dsv4-long-context --out results/long --contexts 1024,8192,32768")
    p.add_argument("--preset", default="tiny_long", choices=sorted(C.PRESETS), help="model config (default tiny_long)")
    p.add_argument("--contexts", default=DEFAULT_CONTEXTS, metavar="L,L",
                   help=f"context lengths in tokens (default {DEFAULT_CONTEXTS})")
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk in tokens (default 2048)")
    p.add_argument("--decode-steps", type=int, default=64, help="decode steps after the prefill (default 64)")
    p.add_argument("--out", required=True, help="output directory (written when complete)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)     # the subprocess: one context, JSON to stdout
    return p


def _contexts(text: str, config) -> list[int]:
    try:
        Ls = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--contexts must be comma-separated integers, got {text!r}") from None
    if not Ls or min(Ls) < 1:
        raise ValueError(f"--contexts must be positive, got {text!r}")
    return Ls


def main(argv=None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    if a.chunk < 1 or a.decode_steps < 1:
        p.error("--chunk and --decode-steps must be >= 1")
    if a.one is not None:
        print(json.dumps(measure(a.preset, a.one, a.chunk, a.decode_steps)))
        return 0
    config = C.preset(a.preset)
    try:
        Ls = _contexts(a.contexts, config)
    except ValueError as e:
        p.error(str(e))
    too_long = [L for L in Ls if L + a.decode_steps + 8 > config.max_position_embeddings]
    if too_long:
        p.error(f"contexts {too_long} (+ {a.decode_steps} steps) are past the {config.max_position_embeddings} "
                f"positions of {a.preset}")
    try:
        check_out_dir(a.out, a.overwrite)
    except OutDirError as e:
        p.error(str(e))
    meta = {"preset": a.preset, "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "jax": jax.__version__,
            "machine": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs)",
            "command": "dsv4-long-context " + " ".join(argv if argv is not None else sys.argv[1:])}
    rows = []
    for L in Ls:
        cmd = [sys.executable, "-m", "dsv4_jax.research.long_context", "--one", str(L), "--preset", a.preset,
               "--chunk", str(a.chunk), "--decode-steps", str(a.decode_steps), "--out", "-"]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            print(f"dsv4-long-context: context {L} failed:\n{run.stderr[-3000:]}", file=sys.stderr)
            return 1
        rows.append(json.loads(run.stdout.strip().splitlines()[-1]))
        print("  ".join(f"{c}={rows[-1][c]}" for c in COLUMNS), flush=True)
    with atomic_dir(a.out) as tmp:
        write_json(os.path.join(tmp, "results.json"), {"meta": meta, "rows": rows})
        with open(os.path.join(tmp, "results.md"), "w", encoding="utf-8") as f:
            f.write(markdown(rows, meta))
        plot(rows, os.path.join(tmp, "long_context.png"))
    print(markdown(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
