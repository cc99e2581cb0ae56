"""Sharded runs against single-device runs on 8 forced host devices (run by tests/test_sharding.py).

Run as a script in a fresh process: `--xla_force_host_platform_device_count=8` must be in XLA_FLAGS
before jax initialises (it is set here when missing). Prints one JSON line prefixed `RESULT ` with
the largest differences per mesh and check, which the test asserts on:

    python tests/sharding_checks.py [--meshes 1x8x1,1x1x8,2x2x2] [--only forward,decode,restore,generate]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

import dsv4_jax  # noqa: E402
from dsv4_jax.model import decode as D, params as P
from dsv4_jax import parallel as S  # noqa: E402
from dsv4_jax.parallel import expert_words  # noqa: E402
from dsv4_jax.config import tiny_flash_like  # noqa: E402

DEFAULT_MESHES = ((1, 8, 1), (1, 1, 8), (2, 2, 2))
CHECKS = ("forward", "decode", "restore", "generate")   # the default --only
EXTRA_CHECKS = ("expert_words",)                          # run only when named


def test_config():
    """tiny_flash_like with a vocabulary divisible by 8 (so `vocab` really shards): 8 experts, 4 heads, 2 groups."""
    return tiny_flash_like().replace(vocab_size=128, name="sharding-test")


def _maxdiff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


def _n_split(tree) -> int:
    """How many leaves are actually split over more than one device."""
    return sum(not s.is_fully_replicated for s in jax.tree.leaves(jax.tree.map(lambda x: x.sharding, tree)))


def decode_script(params, config, tokens, state):
    """Chunked ragged prefill (3 × extend of 4) -> 3 decode steps -> verify 4 -> commit -> 1 decode step.

    Only two block widths (4 and 1), so two compilations. Returns (list of logits, the last step's
    hidden streams [B,1,n,D], final state).
    """
    B = tokens.shape[0]
    outs = []
    lengths = np.array([[4, 4, 4], [4, 4, 1]])[np.arange(B) % 2].T   # prompts of 12 and 9 tokens, alternating
    start = np.zeros((B,), np.int64)
    for n in lengths:
        chunk = np.stack([tokens[b, start[b]:start[b] + 4] for b in range(B)])
        lg, state, _ = D.extend(params, config, state, chunk, n)
        outs.append(np.asarray(lg)[np.arange(B), n - 1])
        start += n
    nxt = tokens[np.arange(B), start]
    for i in range(3):
        lg, state, _ = D.decode_step(params, config, state, nxt)
        outs.append(np.asarray(lg))
        nxt = tokens[:, 20 + i]
    block = np.concatenate([nxt[:, None], tokens[:, 30:33]], axis=1)
    lg, state, aux = D.verify(params, config, state, block)
    outs.append(np.asarray(lg).reshape(B, -1))
    state = D.commit(state, (np.arange(B) % 2 + 1).astype(np.int32))
    lg, state, aux = D.decode_step(params, config, state, tokens[:, 40])
    outs.append(np.asarray(lg))
    return outs, np.asarray(aux["hidden"]), state


def check_forward_decode(meshes, do_forward: bool, do_decode: bool, decode_meshes=None, full: bool = True) -> dict:
    """Forward logits on `meshes`; prefill+decode+verify (logits, hidden, state) on `decode_meshes` (default all)."""
    config = test_config()
    params = P.init_params(config, 0)
    tokens = np.asarray(jax.random.randint(jax.random.PRNGKey(1), (2, 48), 0, config.vocab_size), np.int32)
    out = {}
    if do_forward:
        want = np.asarray(dsv4_jax.forward(params, config, tokens))
    if do_decode:
        from dsv4_jax.model.state import init_state
        ref_outs, ref_hidden, ref_state = decode_script(params, config, tokens, init_state(config, 2, 64, 4))
    for shape in meshes:
        name = "x".join(map(str, shape))
        mesh = S.make_mesh(shape)
        sp = S.shard_params(params, config, mesh)
        r = {"split_param_leaves": _n_split(sp)}
        if do_forward:
            r["forward"] = _maxdiff(dsv4_jax.forward(sp, config, S.shard_batch(tokens, mesh)), want)
        if do_decode and (decode_meshes is None or shape in decode_meshes):
            state = S.init_sharded_state(config, mesh, 2, 64, 4)
            r["split_state_leaves"] = _n_split(state)
            outs, hidden, st = decode_script(sp, config, tokens, state)
            r["decode"] = max(_maxdiff(a, b) for a, b in zip(outs, ref_outs))
            r["logits_scale"] = float(max(np.abs(o).max() for o in ref_outs))
            r["hidden"] = _maxdiff(hidden, ref_hidden) / float(np.abs(ref_hidden).max())   # relative
            r["state"] = max(_maxdiff(a, b) for a, b in zip(jax.tree.leaves(st.layers),
                                                            jax.tree.leaves(ref_state.layers)))
            r["pos_equal"] = np.asarray(st.pos).tolist() == np.asarray(ref_state.pos).tolist()
            want_sh = S.shardings_like(st, mesh)
            r["state_sharding_kept"] = all(a.sharding.is_equivalent_to(b, a.ndim) for a, b in
                                           zip(jax.tree.leaves(st), jax.tree.leaves(want_sh)))
            if full:   # prefill() builds an unplaced state: GSPMD must still give the same logits
                lg, _, _ = D.prefill(sp, config, tokens[:, :4], max_len=64, max_block=4)
                r["prefill_unplaced_state"] = _maxdiff(lg, D.prefill(params, config, tokens[:, :4], max_len=64,
                                                                     max_block=4)[0])
        out[name] = r
    return out


# ---- restore-with-sharding --------------------------------------------------------------------------

FP8_LEAVES = ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b", "attn.indexer.wq_b",
              "ffn.shared_experts.w1", "ffn.shared_experts.w2", "ffn.shared_experts.w3", "e_proj", "h_proj")


class ArraySource:
    """In-memory tensor source (the `SafetensorsSource` interface) holding official-release tensors:
    FP8 (e4m3 + e8m0/128²) attention / shared-expert matrices, FP4 (e2m1 + e8m0/32) routed experts,
    float32 everything else; random values (valid expert ids for tid2eid)."""

    def __init__(self, config, units, n_experts: int, seed: int = 0):
        from dsv4_jax.io.convert import plan as PL
        rng = np.random.default_rng(seed)
        self.t = {}
        for unit in units:
            for leaf in unit.leaves:
                names_ = PL.leaf_tensors(leaf, n_experts)
                shape = leaf.spec.shape[1:] if len(names_) > 1 or "{e}" in str(leaf.ref) else leaf.spec.shape
                for n in names_:
                    self.t[n] = self._make(rng, leaf, tuple(shape), config, expert="{e}" in str(leaf.ref))

    @staticmethod
    def _make(rng, leaf, shape, config, expert: bool):
        from dsv4_jax.io.convert import quant_formats as qf
        spec = leaf.spec
        if spec.kind == "index":
            return rng.integers(0, config.n_routed_experts, shape).astype(np.int64)
        if expert and len(shape) == 2:
            out, inn = shape
            codes = rng.integers(0, 256, (out, inn // 2), dtype=np.uint8)
            scale = rng.integers(120, 128, (out, inn // 32), dtype=np.uint8)
            return qf.host(codes, scale, qf.FP4)
        if leaf.path in FP8_LEAVES and len(shape) == 2:
            codes = rng.integers(0, 256, shape, dtype=np.uint8)
            codes[(codes & 0x7F) == 0x7F] = 0                      # no NaN codes
            scale = rng.integers(118, 126, (-(-shape[0] // 128), -(-shape[1] // 128)), dtype=np.uint8)
            return qf.host(codes.view(ml_dtypes.float8_e4m3fn), scale, qf.FP8)
        return (rng.standard_normal(shape) * 0.3).astype(np.float32)

    def names(self):
        return list(self.t)

    def shape(self, name):
        v = self.t[name]
        return tuple(v.shape)

    def dtype(self, name):
        return "F32"

    def companions(self, name):
        return ()

    def nbytes(self, name):
        return int(self.t[name].nbytes)

    def load(self, name):
        return self.t[name]


def write_checkpoint(out_dir: str, config) -> None:
    """A keep-quantized checkpoint (target + one MTP block) through the converter pipeline."""
    from dsv4_jax.io.convert import pipeline as PI, plan as PL
    E = config.n_routed_experts
    t_units = PL.target_units(config, "official")
    m_units = PL.mtp_units(config, "official", 1)
    src = ArraySource(config, t_units + m_units, E)
    source = {"kind": "test-arrays", "path": out_dir}
    jobs = [PI.Job("target", src, t_units, E, {"source": source}, ignore_prefixes=("mtp.",)),
            PI.Job("mtp", src, m_units, E, {"source": source, "num_layers": 1}, scope="mtp.")]
    PI.convert(out_dir, config, jobs, dtype="float32", keep_quantized=True, quiet=True)


def _check_leaf(got, want_global, want_sharding) -> dict:
    """Spec, every addressable shard's shape and values against the unsharded array."""
    ok_spec = got.sharding.is_equivalent_to(want_sharding, got.ndim) and got.sharding.spec == want_sharding.spec
    full = np.asarray(want_global)
    shard_shape = want_sharding.shard_shape(full.shape)
    ok_shape = ok_val = True
    for sh in got.addressable_shards:
        ok_shape &= sh.data.shape == shard_shape
        ok_val &= bool(np.array_equal(np.asarray(sh.data), full[sh.index]))
    return {"spec": ok_spec, "shape": ok_shape, "values": ok_val, "split": not got.sharding.is_fully_replicated,
            "dtype": got.dtype == full.dtype}


def _reference(d: str, config, key: int, seq: int, with_forward: bool = True):
    """A keep-quantized checkpoint written under d, its single-device dense load, tokens [2, seq] and the
    single-device logits (None without with_forward). -> (ckpt path, loaded config, params, tokens, logits)."""
    ckpt = os.path.join(d, "ckpt")
    write_checkpoint(ckpt, config)
    cfg, single = dsv4_jax.load_checkpoint(ckpt, dtype=jnp.float32)
    tokens = np.asarray(jax.random.randint(jax.random.PRNGKey(key), (2, seq), 0, config.vocab_size), np.int32)
    target = {k: v for k, v in single.items() if k != "mtp"}
    logits = np.asarray(dsv4_jax.forward(target, config, tokens)) if with_forward else None
    return ckpt, cfg, single, tokens, logits


def check_restore(meshes, with_forward: bool = True) -> dict:
    """Write a keep-quantized checkpoint, restore it unsharded and onto each mesh; compare every shard."""
    config = test_config()
    out = {}
    with tempfile.TemporaryDirectory() as d:
        ckpt, cfg, single, tokens, want_logits = _reference(d, config, 2, 24, with_forward)
        for shape in meshes:
            mesh = S.make_mesh(shape)
            _, got = dsv4_jax.load_checkpoint(ckpt, dtype=jnp.float32, mesh=mesh)
            want_sh = dict(S.param_shardings(config, mesh))
            want_sh["mtp"] = [S.drafter_shardings(P.mtp_specs(config), mesh)]
            flat_got, flat_want, flat_sh = P.flatten(got), P.flatten(single), P.flatten(want_sh)
            assert flat_got.keys() == flat_want.keys() == flat_sh.keys(), "leaf sets differ"
            res = {k: _check_leaf(flat_got[k], flat_want[k], flat_sh[k]) for k in flat_got}
            bad = sorted(k for k, v in res.items() if not all(v[c] for c in ("spec", "shape", "values", "dtype")))
            gt = {k: v for k, v in got.items() if k != "mtp"}
            r = out["x".join(map(str, shape))] = {
                "leaves": len(res), "split_leaves": sum(v["split"] for v in res.values()), "bad": bad[:10],
                "shards_checked": sum(len(flat_got[k].addressable_shards) for k in flat_got)}
            if with_forward:
                r["forward"] = _maxdiff(dsv4_jax.forward(gt, cfg.target, S.shard_batch(tokens, mesh)), want_logits)
            r["quantized"] = _check_quantized_restore(ckpt, config, mesh, single, tokens if with_forward else None,
                                                      want_logits)
    return out


def _check_quantized_restore(ckpt, config, mesh, single, tokens, want_logits) -> dict:
    """keep_quantized=True onto the mesh: QArray leaves placed as `param_shardings(formats=...)` says, FP8 / FP4
    codes split like their dense twins, values (dequantized) equal to the single-device dense load."""
    from dsv4_jax.ops import quant
    _, got = dsv4_jax.load_checkpoint(ckpt, dtype=jnp.float32, mesh=mesh, keep_quantized=True)
    target = {k: v for k, v in got.items() if k != "mtp"}
    formats = P.formats_of(target)
    want_sh = P.flatten(S.param_shardings(config, mesh, formats=formats))
    dense_sh = P.flatten(S.param_shardings(config, mesh))
    flat, flat_single = P.flatten(target), P.flatten(single)
    # every QArray dequantized in one program (eagerly, each leaf's ops on its shardings are compiled one by one:
    # ~6 s); exact either way (codes' values times power-of-two scales)
    qs = {k: v for k, v in flat.items() if isinstance(v, quant.QArray)}
    deq = jax.jit(lambda t: {k: quant.dequantize(v) for k, v in t.items()})(qs)
    bad, n_q, split_codes = [], 0, 0
    for k, v in qs.items():
        n_q += 1
        sh = want_sh[k]
        ok = (v.codes.sharding.spec == sh.codes.spec and v.scale.sharding.spec == sh.scale.spec
              and np.array_equal(np.asarray(deq[k]), np.asarray(flat_single[k])))
        if v.fmt == quant.FP8 or k.endswith(("experts.w1", "experts.w3")):   # codes shape = dense shape (or I/2)
            ok &= v.codes.sharding.spec == dense_sh[k].spec
        split_codes += not v.codes.sharding.is_fully_replicated
        if not ok:
            bad.append(k)
    r = {"quantized_leaves": n_q, "split_codes": split_codes, "bad": bad[:10], "formats": sorted({f.name for f in
                                                                                                formats.values()})}
    if tokens is not None:
        r["forward"] = _maxdiff(dsv4_jax.forward(target, config, S.shard_batch(tokens, mesh)), want_logits)
    return r


# ---- routed FP4 experts as words ------------------------------------------------------------------------

def _flat(tree) -> dict:
    """{dot path: leaf} of a parameter tree with its drafters (QArrays as leaves)."""
    from dsv4_jax.ops import quant
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=quant.is_qarray)[0]
    return {".".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path): v for path, v in leaves}


def words_config():
    """A 1-layer config (sliding-window attention, score-routed MoE; the MTP block likewise) whose routed experts'
    contraction dims (hidden 256, moe_intermediate 256) hold whole 256-column groups of the FP4 word layout, 8
    experts. One layer: the check is about the routed expert leaves (target and MTP), which every MoE layer
    holds alike; the attention kinds are the other checks' (every kind in `test_config`), and each extra kind
    here would be compiled 7 times (2 presets x codes / words / TPU layout, and the single-device model)."""
    from dsv4_jax.config import _tiny_base
    return _tiny_base(name="words-test", ratios=[0], n_hash=0, vocab_size=128, hidden_size=256,
                      moe_intermediate_size=256)


def check_expert_words(presets=("latency", "throughput")) -> dict:
    """load_checkpoint(keep_quantized=True, sharding=preset) with expert_words True vs False: which routed leaves
    became words, their partition specs and dequantized values against the uint8 codes' (exact), and the
    forward logits of both against the single-device dense model."""
    from dsv4_jax.ops import quant
    config = words_config()
    out = {}
    with tempfile.TemporaryDirectory() as d:
        ckpt, _, _, tokens, want = _reference(d, config, 3, 16)
        for name in presets:
            mesh = S.preset(name).make_mesh()
            loaded = {ew: dsv4_jax.load_checkpoint(ckpt, dtype=jnp.float32, sharding=name, keep_quantized=True,
                                                   expert_words=ew) for ew in (False, True)}
            codes, words = (_flat(loaded[ew][1]) for ew in (False, True))
            converted, bad = [], []
            changed = [k for k, v in words.items() if isinstance(v, quant.QArray) and v.fmt != codes[k].fmt]
            deq = jax.jit(lambda t: {k: quant.dequantize(v) for k, v in t.items()})   # one program per side
            deq_words, deq_codes = deq({k: words[k] for k in changed}), deq({k: codes[k] for k in changed})
            for k, v in words.items():
                if k in changed:
                    converted.append(k)
                    same = np.array_equal(np.asarray(deq_words[k]), np.asarray(deq_codes[k]))
                    if not (same and v.codes.sharding.spec == codes[k].codes.sharding.spec
                            and v.fmt.name.startswith("e2m1x8") and "experts.w" in k):
                        bad.append(k)
            # TPU's layout rule (`expert_words.for_run`: words, codes / scales contraction-dim major), forced here
            cfg0 = loaded[False][0]
            loaded["held"] = (cfg0, expert_words.for_run(loaded[False][1], cfg0.target.backends, "tpu", words=True))
            held = [v for k, v in _flat(loaded["held"][1]).items() if isinstance(v, quant.QArray)
                    and expert_words.ROUTED_EXPERTS.search(k)]
            k_major = all(a.format.layout.major_to_minor[-2:] == (a.ndim - 1, a.ndim - 2)
                          for q in held for a in (q.codes, q.scale))
            logits = {ew: np.asarray(dsv4_jax.forward({k: v for k, v in p.items() if k != "mtp"}, cfg.target,
                                                      S.shard_batch(tokens, mesh)))
                      for ew, (cfg, p) in loaded.items()}
            out[name] = {"converted": len(converted), "converted_mtp": sum(k.startswith("mtp") for k in converted),
                         "bad": bad[:10], "words_vs_codes": _maxdiff(logits[True], logits[False]),
                         "words_vs_single": _maxdiff(logits[True], want), "logit_scale": float(np.max(np.abs(want))),
                         "held_k_major": k_major and len(held) >= 3, "held_vs_words": _maxdiff(logits["held"], logits[True])}
    return out


# ---- speculative loop ---------------------------------------------------------------------------------

def check_generate(meshes) -> dict:
    """Greedy generate with the MTP drafter: the same tokens sharded as single-device (when available)."""
    try:
        from dsv4_jax import generate
    except ImportError as e:                      # the speculative loop is not in this tree yet
        return {"available": False, "why": str(e)}
    config = test_config()
    params = P.init_params(config, 0)
    params["mtp"] = P.init_mtp(config, 7)
    prompts = [[5, 9, 17, 33, 2, 64, 100, 7, 1, 12, 90], [3, 44, 61, 8, 99, 120, 15]]
    want, want_stats = generate(params, config, prompts, 12, drafter="mtp", draft_n_max=3)
    out = {"available": True, "tokens": want, "accepted": want_stats["accepted"], "rounds": want_stats["rounds"]}
    for shape in meshes:
        mesh = S.make_mesh(shape)
        got, stats = generate(S.shard_params(params, config, mesh), config, prompts, 12, drafter="mtp",
                              draft_n_max=3)
        out["x".join(map(str, shape))] = {"same_tokens": [list(g) for g in got] == [list(w) for w in want],
                                          "same_accepted": stats["accepted"] == want_stats["accepted"]}
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--meshes", default=",".join("x".join(map(str, m)) for m in DEFAULT_MESHES),
                    help="mesh shapes data x expert x model, comma separated")
    ap.add_argument("--only", default=",".join(CHECKS), help=f"subset of {','.join(CHECKS + EXTRA_CHECKS)}")
    ap.add_argument("--fast", action="store_true",
                    help="forward on every mesh; decode and restore (no forward) on the last mesh only")
    a = ap.parse_args(argv)
    meshes = [tuple(int(v) for v in m.split("x")) for m in a.meshes.split(",")]
    only = set(a.only.split(","))
    some = meshes[-1:] if a.fast else meshes
    res = {"devices": jax.device_count(), "fast": a.fast, "seconds": {}}
    t = time.perf_counter()

    def lap(name):
        nonlocal t
        res["seconds"][name] = round(time.perf_counter() - t, 1)
        t = time.perf_counter()

    if {"forward", "decode"} & only:
        res["runs"] = check_forward_decode(meshes, "forward" in only, "decode" in only, some, full=not a.fast)
        lap("runs")
    if "restore" in only:
        res["restore"] = check_restore(some, with_forward=not a.fast)
        lap("restore")
    if "expert_words" in only:
        res["expert_words"] = check_expert_words()
        lap("expert_words")
    if "generate" in only and not a.fast:
        res["generate"] = check_generate(meshes)
        lap("generate")
    print("RESULT " + json.dumps(res), flush=True)
    return res


if __name__ == "__main__":
    main()
