"""Expert-parallel MoE (moe="ep") against single-device runs on 8 forced host devices (run by tests/test_moe_ep.py).

Run as a script in a fresh process (`--xla_force_host_platform_device_count=8` must be set before jax
initialises; it is set here when missing). Prints one JSON line prefixed `RESULT ` with the largest
differences per case, which the test asserts on:

    python tests/ep_checks.py [--full]

Cases (name: mesh data×expert×model, rules, local grouped matmul):
    ep-1x8x1      default rules (experts split 8 ways over `expert`, batch split 8 ways), reference
    ep-2x4x1      default rules (experts over `expert`, batch over data × expert), reference
    ep-1x2x4      default rules (experts over expert × model, batch over expert), dense
    latency       the "latency" preset (1x1x8: experts split along `mlp`, tokens replicated; the decode
                  script at B = 8, so the decode state is split by sequence over `model`), reference
    throughput    the "throughput" preset (1x8x1), pallas (interpret mode, inside shard_map)
    odd-1x8x1     6 experts on 1x8x1: not divisible, the rules replicate them (stated fallback: pure DP)
    odd-1x2x4     6 experts on 1x2x4: experts over `expert` (2), `mlp` over `model` (4)
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

# A compilation cache private to this process: `process_block.lower(...).compile()` (the decode step's HLO read for
# expert all-gathers) lowers the very program the decode script's jitted step compiled, but the jit's in-memory
# cache does not serve explicit lowerings; the persistent cache (keyed on the HLO and the compile options) does,
# which saves a ~4 s recompile. Same executable either way, so no result changes.
_CACHE = tempfile.mkdtemp(prefix="ep_checks_xla_")
atexit.register(shutil.rmtree, _CACHE, True)
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)

import dsv4_jax  # noqa: E402
from dsv4_jax.model import decode as D, params as P
from dsv4_jax import parallel as S  # noqa: E402
from dsv4_jax.backends import Backends, ExpertParallel  # noqa: E402
from dsv4_jax.model.state import init_state  # noqa: E402
from dsv4_jax.config import tiny_flash_like  # noqa: E402
from dsv4_jax.model.target import forward_jit  # noqa: E402
from dsv4_jax.ops import quant  # noqa: E402
from sharding_checks import decode_script  # noqa: E402  (tests/ is on sys.path)

# name: (mesh shape or preset name, n_experts, local)
CASES = {
    "ep-1x8x1": ((1, 8, 1), 8, "reference"),
    "ep-2x4x1": ((2, 4, 1), 8, "reference"),
    "ep-1x2x4": ((1, 2, 4), 8, "dense"),
    "latency": ("latency", 8, "reference"),
    "throughput": ("throughput", 8, "pallas"),
    "odd-1x8x1": ((1, 8, 1), 6, "reference"),
    "odd-1x2x4": ((1, 2, 4), 6, "reference"),
    "release-latency": ("latency", 8, "reference"),
    "int8-1x2x4": ((1, 2, 4), 8, "dense"),
}
# quantized cases: the weights as QArrays (`ops.quant`), the single-device reference on the same QArrays.
# release: FP4 routed experts, FP8 attention / shared expert (scale blocks straddling the shards: the
# FP4 w2's 32-column blocks over I = 48 split 8 ways, FP8's 128-row blocks); int8: per-channel routed experts
QUANT = {"release-latency": "release", "int8-1x2x4": "int8_channel"}
# cases of the --full run only. release-latency: the release formats under the latency preset are checked in
# the fast run by tests/test_sharding.py::test_release_experts_load_as_words_on_the_presets (loaded checkpoint,
# both presets, against the single-device model)
FULL_ONLY = ("int8-1x2x4", "ep-1x8x1", "ep-2x4x1", "throughput", "odd-1x2x4", "release-latency")
FAST_DECODE = ("latency",)                      # prefill + decode + verify + commit (every case with --full)
DECODE_BATCH = {"latency": 8}                   # sequences of the decode script (default 2)
FAST_GENERATE = ("latency",)                    # speculative generation in the fast run


def _decode(params, config, tokens, state):
    """sharding_checks' ragged prefill -> decode -> verify -> commit -> decode script: (logits, final state)."""
    outs, _hidden, state = decode_script(params, config, tokens, state)
    return outs, state


def test_config(n_experts: int = 8):
    """tiny_flash_like (9 layers, scan of 3 HCA/CSA pairs) with a vocabulary divisible by 8 and an expert width
    (48) no other array has, so expert weights are recognisable in compiled HLO."""
    return tiny_flash_like().replace(vocab_size=128, n_routed_experts=n_experts, moe_intermediate_size=48,
                                     name=f"ep-test-{n_experts}")


def setup(case: str, config):
    """(config with the EP backend, mesh, rules dict or None) of a case."""
    shape, _, local = CASES[case]
    if isinstance(shape, str):
        pre = S.preset(shape)
        mesh = pre.make_mesh()
        rules = pre.rules_dict
    else:
        mesh, rules = S.make_mesh(shape), None
    b = Backends(moe="ep", ep=ExpertParallel(mesh, ExpertParallel.freeze_rules(rules), local),
                 interpret=local == "pallas")
    return config.with_backends(b), mesh, rules


def quantized(params, kind: str | None):
    """params with the case's leaves as QArrays (None: unchanged)."""
    if kind is None:
        return params
    if kind == "release":
        return quant.quantize_tree(params, lambda path, x: P.release_format(path, _spec_of(path, x)))
    fmt = quant.qformat(kind)
    return quant.quantize_tree(params, lambda path, x: fmt if ".ffn.experts.w" in path else None)


def _spec_of(path: str, x) -> P.ParamSpec:
    """A stand-in ParamSpec for release_format's path rule: weight kind for floating matrices."""
    kind = "weight" if x.ndim >= 2 and jnp.issubdtype(x.dtype, jnp.floating) else "f32"
    return P.ParamSpec(tuple(x.shape), (None,) * x.ndim, kind)


def maxdiff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


def n_split(tree) -> int:
    return sum(not x.sharding.is_fully_replicated for x in jax.tree.leaves(tree))


def expert_all_gathers(compiled_text: str, config) -> int:
    """All-gathers in compiled HLO whose result ends in an expert matrix's (I, D) or (D, I): weights moving."""
    I, D = config.moe_intermediate_size, config.hidden_size
    n = 0
    for m in re.finditer(r"= [a-z0-9]+\[([0-9,]+)\]\S* all-gather(?:-start)?\(", compiled_text):
        dims = tuple(int(d) for d in m.group(1).split(","))
        n += dims[-2:] in ((I, D), (D, I))
    return n


PROMPTS = [[5, 9, 17, 33, 2, 64, 100, 7, 1, 12, 90], [3, 44, 61, 8, 99, 120, 15], [7, 7, 1]]
N_NEW, K = 10, 3


def plain_greedy(params, config, prompts, n_new: int) -> list[list[int]]:
    """Greedy continuations (n_new tokens each) through the programs of the decode script: a state of 8 rows
    (DECODE_BATCH["latency"]; rows past the prompts are padding), max_len 64, max_block 4, the prompts
    extended 4 tokens at a time, then single-token steps. They only fill the oracle's table (both sides of
    the generation check read the same table), so no plain generation loop is compiled for them."""
    B = 8
    lens = np.array([len(p) for p in prompts] + [1] * (B - len(prompts)))
    toks = np.zeros((B, -(-int(lens.max()) // 4) * 4), np.int32)
    for b, p in enumerate(prompts):
        toks[b, :len(p)] = p
    state = init_state(config, B, 64, 4)
    last = np.zeros((B, config.vocab_size), np.float32)
    for s in range(0, toks.shape[1], 4):
        n = np.clip(lens - s, 0, 4)
        lg, state, _ = D.extend(params, config, state, toks[:, s:s + 4], n)
        lg = np.asarray(lg)
        for b in np.nonzero(n)[0]:
            last[b] = lg[b, n[b] - 1]
    out = [last.argmax(-1)]
    for _ in range(n_new - 1):
        lg, state, _ = D.decode_step(params, config, state, out[-1].astype(np.int32))
        out.append(np.asarray(lg).argmax(-1))
    return np.stack(out, 1)[:len(prompts)].tolist()


def oracle_params(params, config, prompts, plain):
    """params + an oracle drafter reading the plain greedy output, with some drafts forced wrong."""
    B = len(prompts)
    table = np.zeros((B, 64), np.int32)
    for b, (p, g) in enumerate(zip(prompts, plain)):
        seq = list(p) + list(g)
        table[b, :len(seq)] = seq
    wrong = np.array([[False, True, False], [False, False, False], [True, False, False]])
    return dict(params, oracle={"tokens": jnp.asarray(table), "wrong": jnp.asarray(wrong)})


def run(cases, decode_cases, generate_cases, mtp_cases) -> dict:
    out = {}
    refs = {}
    for case in cases:
        t0 = time.perf_counter()
        E, kind = CASES[case][1], QUANT.get(case)
        config = test_config(E)
        if (E, kind) not in refs:                      # single-device references, once per expert count / format
            params = quantized(P.init_params(config, 0), kind)
            params["mtp"] = quantized(P.init_mtp(config, 7), kind)
            tokens = np.asarray(jax.random.randint(jax.random.PRNGKey(1), (8, 48), 0, config.vocab_size), np.int32)
            r = {"params": params, "tokens": tokens,
                 "forward": np.asarray(dsv4_jax.forward(params, config, tokens[:, :8]))}
            refs[E, kind] = r
        ref = refs[E, kind]
        params, tokens = ref["params"], ref["tokens"]
        cfg, mesh, rules = setup(case, config)
        sp = S.shard_params(params, cfg, mesh, rules)
        res = {"split_param_leaves": n_split(sp), "backends": cfg.backends.describe(), "quantized": kind,
               "qarray_leaves": len(P.formats_of(sp))}
        fwd_in = S.shard_batch(tokens[:, :8], mesh, rules)
        lowered = forward_jit.lower(sp, cfg, fwd_in)
        res["shard_map_in_program"] = "SPMDFullToShardShape" in lowered.as_text() or \
            "manual_computation" in lowered.as_text()
        compiled = lowered.compile()
        res["forward"] = maxdiff(compiled(sp, fwd_in), ref["forward"])
        res["forward_expert_all_gathers"] = expert_all_gathers(compiled.as_text(), config)
        w1 = sp["segments"][1][0]["ffn"]["experts"]["w1"]            # control: gathering the experts is detected
        gather = jax.jit(lambda a: a * 1.0, out_shardings=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
        res["detector_control"] = None if isinstance(w1, quant.QArray) or w1.sharding.is_fully_replicated else \
            expert_all_gathers(gather.lower(w1).compile().as_text(), config)
        if case in decode_cases:
            B = DECODE_BATCH.get(case, 2)
            if ("decode", B) not in ref:
                ref["decode", B] = _decode(params, config, tokens[:B], init_state(config, B, 64, 4))
            state = S.init_sharded_state(cfg, mesh, B, 64, 4, rules=rules)
            outs, st = _decode(sp, cfg, tokens[:B], state)
            want, want_st = ref["decode", B]
            res["state_split_leaves"] = n_split(st.layers)
            res["decode"] = max(maxdiff(a, b) for a, b in zip(outs, want))
            res["state"] = max(maxdiff(a, b) for a, b in zip(jax.tree.leaves(st.layers),
                                                            jax.tree.leaves(want_st.layers)))
            res["state_scale"] = max(float(np.max(np.abs(np.asarray(b, np.float32))))
                                     for b in jax.tree.leaves(want_st.layers) if np.size(b))
            res["pos_equal"] = np.asarray(st.pos).tolist() == np.asarray(want_st.pos).tolist()
            step = D.process_block.lower(sp, cfg, S.init_sharded_state(cfg, mesh, B, 64, 4, rules=rules),
                                         jnp.zeros((B, 1), jnp.int32), jnp.ones((B,), jnp.int32)).compile()
            res["decode_expert_all_gathers"] = expert_all_gathers(step.as_text(), config)
        for drafter, wanted in (("oracle", generate_cases), ("mtp", mtp_cases)):
            if case not in wanted:
                continue
            key = f"gen-{drafter}"
            if key not in ref:
                plain = plain_greedy(params, config, PROMPTS, N_NEW)
                eos = plain[1][2]                        # sequence 1 stops early (after 3 tokens)
                p = oracle_params(params, config, PROMPTS, plain) if drafter == "oracle" else params
                toks, stats = dsv4_jax.generate(p, config, PROMPTS, N_NEW, drafter=drafter, draft_n_max=K,
                                                eos_token_id=eos)
                cut = [g[:g.index(eos) + 1] if eos in g else g for g in plain]
                ref[key] = (p, eos, toks, stats, toks == cut)
            p, eos, want, wstats, ref_lossless = ref[key]
            placed = dict(S.shard_params({k: v for k, v in p.items() if k != "oracle"}, cfg, mesh, rules))
            if "oracle" in p:
                placed["oracle"] = p["oracle"]
            got, stats = dsv4_jax.generate(placed, cfg, PROMPTS, N_NEW, drafter=drafter, draft_n_max=K,
                                           eos_token_id=eos)
            res[key] = {"same_tokens": got == want, "single_device_equals_plain": ref_lossless, "same_accepted": stats["accepted"] == wstats["accepted"],
                        "same_rounds": stats["rounds"] == wstats["rounds"], "lengths": [len(g) for g in got],
                        "accepted": stats["accepted"], "drafted": stats["drafted"]}
        res["seconds"] = round(time.perf_counter() - t0, 1)
        out[case] = res
        print(case, json.dumps(res), flush=True)
    return out


def check_layouts() -> dict:
    """Static layouts the explicit path derives (and refuses) on 8 devices."""
    from dsv4_jax.backends import BackendError
    from dsv4_jax.model.layers.moe_ep import layout
    config = test_config(8)
    p = P.init_params(config, 0)["segments"][1]
    ffn = jax.tree.map(lambda a: a[0], p[0]["ffn"])
    out = {}
    for case in ("ep-1x8x1", "ep-2x4x1", "ep-1x2x4", "latency", "odd-1x2x4"):
        cfg, mesh, rules = setup(case, test_config(CASES[case][1]))
        e = jax.tree.map(lambda a: a[0], P.init_params(cfg, 0)["segments"][1][0]["ffn"])
        lay = layout(cfg.backends.ep, cfg, 8, e["experts"], e["shared_experts"])
        out[case] = {"tokens": str(lay.tokens), "w1": str(lay.experts["w1"]), "gather": list(lay.gather_axes),
                     "reduce": list(lay.reduce_axes), "shared": list(lay.shared_axes), "fold": lay.fold_shared}
    errors = {}
    for name, rules in (("embed-split", {**S.DEFAULT_RULES, "embed": ("model",)}),
                        ("shared-over-tokens", {**S.DEFAULT_RULES, "mlp": ("expert",), "experts": ()})):
        mesh = S.make_mesh((1, 2, 4))
        ep = ExpertParallel(mesh, ExpertParallel.freeze_rules(rules))
        try:
            layout(ep, config, 8, ffn["experts"], ffn["shared_experts"])
            errors[name] = "no error"
        except BackendError as e:
            errors[name] = str(e)
    out["errors"] = errors
    return out


def check_checkpoint() -> dict:
    """A converted checkpoint restored with `load_checkpoint(path, sharding=preset)`: the preset's placement for
    every leaf, the same values as a single-device restore, and the EP backend in the returned config."""
    import tempfile
    from sharding_checks import test_config as ckpt_config, write_checkpoint
    out = {}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "ckpt")
        write_checkpoint(path, ckpt_config())
        _, single = dsv4_jax.load_checkpoint(path, dtype=jnp.float32)
        for name in ("latency", "throughput"):
            pre = S.preset(name)
            cfg, got = dsv4_jax.load_checkpoint(path, dtype=jnp.float32, sharding=name)
            target = cfg.target
            mesh = target.backends.ep.mesh
            want = dict(S.param_shardings(target, mesh, pre.rules_dict))
            want["mtp"] = [S.drafter_shardings(P.mtp_specs(target), mesh, pre.rules_dict)]
            fg, fw, fs = P.flatten(got), P.flatten(single), P.flatten(want)
            bad = [k for k in fg if not (fg[k].sharding.is_equivalent_to(fs[k], fg[k].ndim)
                                         and np.array_equal(np.asarray(fg[k]), np.asarray(fw[k])))]
            out[name] = {"leaves": len(fg), "split": sum(not v.sharding.is_fully_replicated for v in fg.values()),
                         "bad": bad[:5], "moe": target.backends.moe, "mesh": list(mesh.devices.shape)}
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="decode and generation (oracle and MTP) on every case")
    ap.add_argument("--cases", default=None, help="comma list (default: every case; --full adds FULL_ONLY)")
    a = ap.parse_args(argv)
    cases = a.cases.split(",") if a.cases else [c for c in CASES if a.full or c not in FULL_ONLY]
    if a.full:
        dec, gen, mtp = cases, cases, cases
    else:
        dec, gen, mtp = FAST_DECODE, FAST_GENERATE, ()
    t0 = time.perf_counter()
    res = {"devices": jax.device_count(), "full": a.full, "layouts": check_layouts()}
    if a.full:
        res["checkpoint"] = check_checkpoint()
    res["setup_seconds"] = round(time.perf_counter() - t0, 1)
    res["cases"] = run(cases, dec, gen, mtp)
    print("RESULT " + json.dumps(res), flush=True)
    return res


if __name__ == "__main__":
    main()
