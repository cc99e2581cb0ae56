"""Converters end to end: tiny checkpoints in every supported format -> dsv4-convert -> load_checkpoint,
logits equal to the HF reference on the same (dequantized) weights (fp32, ≤ 1e-4).

Lossy storage (bf16 / fp8 / fp4 / q8_0 / K-quants) is lossy in the fixture itself: the reference model
is loaded with exactly the dequantized values, so the comparison stays exact up to fp32 rounding.
Kept-quantized checkpoints (the converter's default) loaded with keep_quantized=True (QArray leaves on the
device) give the logits of the same checkpoint dequantized to f32 (≤ 1e-5), the same greedy continuation,
and the same MTP / DSpark drafter outputs, at the bytes of their codes + scales.
"""
import gc
import json
import warnings
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import traverse_util
from gguf import GGMLQuantizationType as T

import dsv4_jax
from dsv4_jax.analysis import memplan_cli as memplan
from dsv4_jax.model import params as P
from dsv4_jax.model.state import Span
from dsv4_jax.io.checkpoint import CheckpointConfig
from dsv4_jax.io.convert.cli import main
from dsv4_jax.io.convert.pipeline import LossyConversionWarning
from dsv4_jax.drafters import dspark as dspark_drafter, mtp as mtp_drafter
from dsv4_jax.ops import quant

from . import convert_fixtures as fx
from . import hf_reference as ref

TOL = 1e-4
KEEP_TOL = 1e-5          # keep_quantized=True vs the same checkpoint dequantized to f32
NAME = "convert-test"    # one config name: every checkpoint of the fixture shares compiled steps


@pytest.fixture(scope="module")
def model():
    return fx.build_model(seed=0)


@pytest.fixture(scope="module")
def sd(model):
    return fx.state(model)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(2, fx.V, (2, 24), generator=torch.Generator().manual_seed(1))


def _target(cfg):
    return cfg.target if isinstance(cfg, CheckpointConfig) else cfg


def check_logits(model, deq_sd, ckpt, ids, dtype=jnp.float32):
    fx.load_state(model, deq_sd)
    want = ref.logits(model, ids).numpy()
    cfg, params = dsv4_jax.load_checkpoint(ckpt, dtype=dtype)
    target = {k: v for k, v in params.items() if k not in ("mtp", "dspark")}
    # a fixed name so every format shares one compiled forward
    got = np.asarray(dsv4_jax.forward(target, _target(cfg).replace(name="convert-test"), ids.numpy().astype(np.int32)))
    diff = float(np.abs(got - want).max())
    assert 0.1 < np.abs(want).mean() < 10
    assert diff <= TOL, diff
    return cfg, params


def _flat(tree):
    return traverse_util.flatten_dict(tree, sep=".")


def _live_bytes() -> int:
    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays())


def _greedy(params, cfg, ids, steps: int = 5):
    """(logits of ids [B,S,V], greedy continuation [B,steps] of the prompt ids[:, :S-steps]). The model is causal
    (a position sees only earlier tokens, compressed rows and indexer choices included), so every call runs the
    one compiled forward of shape [B,S]: the continuation's not-yet-generated tail is padding."""
    S = ids.shape[1]
    logits = np.asarray(dsv4_jax.forward(params, cfg, ids))
    buf = np.asarray(ids).copy()
    buf[:, S - steps:] = 0
    for i in range(S - steps, S):
        buf[:, i] = np.asarray(dsv4_jax.forward(params, cfg, buf))[:, i - 1].argmax(-1)
    return logits, buf[:, S - steps:]


def _drafter_logits(params, cfg, ids, meta) -> dict:
    """MTP row logits (random target hiddens + the next tokens) and DSpark base logits, confidences and greedy
    drafts (random taps) of the loaded drafters."""
    out = {}
    hidden = jnp.asarray(np.random.default_rng(4).standard_normal((*ids.shape, cfg.hc_mult, cfg.hidden_size)),
                         jnp.float32)
    target = {k: v for k, v in params.items() if k not in ("mtp", "dspark")}
    if "mtp" in params:
        out["mtp"] = np.asarray(jax.jit(lambda m, t, h, x: mtp_drafter.rows(
            m, t, cfg, mtp_drafter.init(cfg, x.shape[0], 64, 2, jnp.float32).cache, h, x,
            Span.of(jnp.zeros((x.shape[0],), jnp.int32), x.shape[1], jnp.full((x.shape[0],), x.shape[1], jnp.int32))
            )[1])(params["mtp"][0], target, hidden, ids))
    if "dspark" in params:
        d = params["dspark"]
        dcfg = dspark_drafter.resolve(cfg, d, meta)
        taps = jnp.asarray(np.random.default_rng(5).standard_normal(
            (ids.shape[0], 8, len(dcfg.target_layer_ids), cfg.hidden_size)), jnp.float32)

        def run(d, t, taps, anchor):
            ds = dspark_drafter
            st = ds.observe(d, t, cfg, ds.init(d, cfg, anchor.shape[0], jnp.float32), taps,
                            jnp.zeros_like(anchor), jnp.full_like(anchor, taps.shape[1]))
            pos = jnp.full_like(anchor, taps.shape[1])
            y, U = ds.block_outputs(d, t, cfg, dcfg, st, pos, anchor)
            from dsv4_jax.drafters.base import Bound, DraftSetup, Knobs
            bound = Bound({**t, "dspark": d}, cfg, DraftSetup(k=3, taps=dcfg.target_layer_ids, settings=dcfg))
            knobs = Knobs(jnp.float32(0.0), jnp.float32(1.0), {"confidence_threshold": jnp.float32(0.0)})
            drafts, _, n, conf = ds.propose(bound, st, pos, anchor, jax.random.key(0), knobs, greedy=True)
            return U, drafts, conf
        U, drafts, conf = jax.jit(run)(d, target, taps, ids[:, -1])
        out.update(dspark=np.asarray(U), dspark_drafts=np.asarray(drafts), dspark_conf=np.asarray(conf))
    return out


def _stored_bytes(meta: dict) -> tuple[int, int]:
    """(all leaves, quantized leaves) bytes as stored in a checkpoint (dsv4.json records)."""
    total = quantized = 0
    for rec in meta["items"].values():
        for leaf in rec["leaves"].values():
            if leaf["format"] == "dense":
                total += int(np.prod(leaf["shape"])) * np.dtype(leaf["dtype"]).itemsize
            else:
                b = sum(int(np.prod(a["shape"])) * np.dtype(a["dtype"]).itemsize for a in leaf["arrays"].values())
                total += b
                quantized += b
    return total, quantized


def check_kept(ckpt, ids, formats: set, steps: int = 5):
    """keep_quantized=True against keep_quantized=False (dequantized to f32) of one checkpoint: leaf types and
    formats, logits ≤ KEEP_TOL, identical greedy continuation, MTP / DSpark outputs; and, at the default
    dtype, the device bytes of the loaded tree (every new live buffer) ≤ 1.1 × the stored codes + scales."""
    meta = json.loads((ckpt / "dsv4.json").read_text())
    total, quantized = _stored_bytes(meta)
    ids = jnp.asarray(np.asarray(ids), jnp.int32)
    before = _live_bytes()
    _, kb = dsv4_jax.load_checkpoint(ckpt, keep_quantized=True)            # default dtype: as stored
    grown = _live_bytes() - before
    q_bytes = sum(x.nbytes for x in jax.tree.leaves(kb, is_leaf=quant.is_qarray) if isinstance(x, quant.QArray))
    assert q_bytes == quantized and grown <= 1.1 * total, (q_bytes, quantized, grown, total)
    del kb
    _, dense = dsv4_jax.load_checkpoint(ckpt, dtype=jnp.float32)
    cfg_q, kept = dsv4_jax.load_checkpoint(ckpt, dtype=jnp.float32, keep_quantized=True)
    assert {f.name for f in P.formats_of(kept).values()} == formats, P.formats_of(kept)
    assert not any(isinstance(x, quant.QArray) for x in jax.tree.leaves(dense, is_leaf=quant.is_qarray))
    cfg = _target(cfg_q).replace(name=NAME)
    ld, td = _greedy({k: v for k, v in dense.items() if k not in ("mtp", "dspark")}, cfg, ids, steps)
    lq, tq = _greedy({k: v for k, v in kept.items() if k not in ("mtp", "dspark")}, cfg, ids, steps)
    assert float(np.abs(lq - ld).max()) <= KEEP_TOL * max(1.0, float(np.abs(ld).max()))
    np.testing.assert_array_equal(tq, td)
    dmeta = getattr(cfg_q, "dspark", None)
    a, b = _drafter_logits(kept, cfg, ids, dmeta), _drafter_logits(dense, cfg, ids, dmeta)
    assert set(a) == ({"mtp"} if "mtp" in kept else set()) | ({"dspark", "dspark_drafts", "dspark_conf"}
                                                              if "dspark" in kept else set())
    for k in a:
        if k == "dspark_drafts":
            np.testing.assert_array_equal(a[k], b[k])
        else:
            assert float(np.abs(a[k] - b[k]).max()) <= KEEP_TOL * max(1.0, float(np.abs(b[k]).max())), k
    return kept, lq


def test_official_fp8_fp4_with_mtp(model, sd, ids, tmp_path, capsys):
    rng = np.random.default_rng(0)
    tensors, deq = fx.official_tensors(sd)
    mtp = fx.official_mtp(rng, tensors)
    fx.write_official(tmp_path / "hf", tensors, fx.official_config())
    assert main(["hf", str(tmp_path / "hf"), str(tmp_path / "out"), "--dtype", "f32", "-q"]) == 0
    cfg, params = check_logits(model, deq, tmp_path / "out", ids)
    assert cfg.mtp_layers == 1
    m = params["mtp"][0]
    np.testing.assert_array_equal(np.asarray(m["e_proj"]), mtp["mtp.0.e_proj.weight"])
    np.testing.assert_array_equal(np.asarray(m["attn"]["wq_b"]), mtp["mtp.0.attn.wq_b.weight"])
    np.testing.assert_array_equal(np.asarray(m["ffn"]["experts"]["w2"][3]), mtp["mtp.0.ffn.experts.3.w2.weight"])
    np.testing.assert_array_equal(np.asarray(m["hc_head"]["fn"]), mtp["mtp.0.hc_head_fn"])
    assert params["segments"][0][0]["ffn"]["gate"]["tid2eid"].dtype == jnp.int32

    # the default keeps the codes on disk (no lossy step: no warning), exactly the same values after
    # load_checkpoint(dtype=f32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LossyConversionWarning)
        assert main(["hf", str(tmp_path / "hf"), str(tmp_path / "keep"), "-q"]) == 0
    meta = json.loads((tmp_path / "keep" / "dsv4.json").read_text())
    assert meta["format_version"] == 2 and meta["conversion"]["keep_quantized"]
    leaves = meta["items"]["target"]["leaves"]
    assert leaves["layers.01.attn.wq_a"]["format"] == "fp8_e4m3_b128"
    assert leaves["layers.01.attn.wq_a"]["arrays"]["codes"]["dtype"] == "float8_e4m3fn"
    assert leaves["layers.01.ffn.experts.w1"]["format"] == "fp4_e2m1_b32"
    assert leaves["layers.01.ffn.experts.w1"]["arrays"]["codes"]["dtype"] == "uint8"
    assert leaves["layers.00.ffn.gate.tid2eid"]["dtype"] == "int32"
    _, p32 = dsv4_jax.load_checkpoint(tmp_path / "out", dtype=jnp.float32)
    _, pk = dsv4_jax.load_checkpoint(tmp_path / "keep", dtype=jnp.float32)
    a, b = _flat(dsv4_jax.model.params.flatten(p32)), _flat(dsv4_jax.model.params.flatten(pk))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)
    # default dtype of a kept checkpoint: bf16 weights (exact for FP8/FP4), f32 norms
    _, pb = dsv4_jax.load_checkpoint(tmp_path / "keep")
    assert pb["segments"][1][0]["attn"]["wq_a"].dtype == jnp.bfloat16
    assert pb["norm"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(pb["segments"][1][0]["attn"]["wq_a"], np.float32),
                                  np.asarray(p32["segments"][1][0]["attn"]["wq_a"]))
    # kept quantized on the device: FP8 / FP4 QArrays (target and MTP block), same logits, tokens, MTP rows
    kept, _ = check_kept(tmp_path / "keep", ids, {"fp8_e4m3_b128", "fp4_e2m1_b32"})
    assert kept["segments"][1][0]["attn"]["wq_a"].fmt == quant.FP8
    assert kept["mtp"][0]["ffn"]["experts"]["w1"].fmt == quant.FP4 and kept["mtp"][0]["e_proj"].fmt == quant.FP8
    # dsv4-memplan --checkpoint: the plan of the stored formats next to the bytes measured on the device
    capsys.readouterr()
    assert memplan.main(["--checkpoint", str(tmp_path / "keep"), "--json"]) == 0
    m = json.loads(capsys.readouterr().out)
    assert m["formats"] == ["fp4_e2m1_b32", "fp8_e4m3_b128"] and "drafter (mtp 0)" in m["parts"]
    for part, v in m["parts"].items():
        assert v["estimate"] == v["measured"] and v["measured"]["total"] > 0, (part, v)


def test_transformers_format(model, sd, ids, tmp_path):
    fx.load_state(model, sd)
    ref.save(model, tmp_path / "hf")
    assert main(["hf", str(tmp_path / "hf"), str(tmp_path / "out"), "--dtype", "f32", "-q"]) == 0
    meta = json.loads((tmp_path / "out" / "dsv4.json").read_text())
    assert meta["source"]["kind"] == "hf-transformers"
    check_logits(model, sd, tmp_path / "out", ids)


def test_official_dspark_separate_dir_and_merge(sd, ids, tmp_path):
    rng = np.random.default_rng(1)
    tensors, _ = fx.official_tensors(sd)
    fx.write_official(tmp_path / "hf", tensors, fx.official_config())
    dsp = {}
    deq = fx.official_dspark(rng, dsp, rank=16, bias=True)
    fx.write_official(tmp_path / "dspark", dsp, fx.official_config(
        {"dspark_block_size": 5, "dspark_noise_token_id": 96, "dspark_target_layer_ids": [0, 1, 2],
         "num_nextn_predict_layers": 3}))
    assert main(["hf", str(tmp_path / "hf"), str(tmp_path / "out"), "--dspark", str(tmp_path / "dspark"),
                 "--keep-quantized", "-q"]) == 0
    cfg, p = dsv4_jax.load_checkpoint(tmp_path / "out", dtype=jnp.float32)
    assert cfg.dspark.n_stages == 3 and cfg.dspark.markov_rank == 16 and cfg.dspark.n_taps == 3
    assert cfg.dspark.target_layer_ids == (0, 1, 2) and cfg.dspark.block_size == 5 and cfg.dspark.conf_bias
    d = p["dspark"]
    np.testing.assert_array_equal(np.asarray(d["main_proj"]), deq["mtp.0.main_proj.weight"])
    np.testing.assert_array_equal(np.asarray(d["markov_w2"]), deq["mtp.2.markov_head.markov_w2.weight"])
    np.testing.assert_array_equal(np.asarray(d["conf_proj"]["bias"]), deq["mtp.2.confidence_head.proj.bias"])
    np.testing.assert_array_equal(np.asarray(d["stages"][1]["ffn"]["experts"]["w3"][5]),
                                  deq["mtp.1.ffn.experts.5.w3.weight"])
    kept, _ = check_kept(tmp_path / "out", ids, {"fp8_e4m3_b128", "fp4_e2m1_b32"})   # DSpark stages kept quantized
    assert kept["dspark"]["main_proj"].fmt == quant.FP8 and kept["dspark"]["stages"][2]["ffn"]["experts"]["w2"].fmt \
        == quant.FP4

    # the same drafter merged onto an existing target-only checkpoint
    assert main(["hf", str(tmp_path / "hf"), str(tmp_path / "base"), "-q", "--keep-quantized"]) == 0
    # official dir holds no mtp.* here, so the result is a plain target
    cfg0, _ = dsv4_jax.load_checkpoint(tmp_path / "base")
    assert isinstance(cfg0, dsv4_jax.ModelConfig)
    assert main(["drafter", str(tmp_path / "base"), "--dspark", str(tmp_path / "dspark"), "-q"]) == 0
    cfg1, p1 = dsv4_jax.load_checkpoint(tmp_path / "base", dtype=jnp.float32)
    assert cfg1.dspark == cfg.dspark
    np.testing.assert_array_equal(np.asarray(p1["dspark"]["main_norm"]), np.asarray(d["main_norm"]))


def test_gguf_llamacpp(model, sd, ids, tmp_path):
    rng = np.random.default_rng(2)
    tensors, deq = fx.gguf_tensors(rng, sd, fx.LLAMACPP_TYPES)
    types = {T(r).name if r is not None else str(d.dtype) for d, r in tensors.values()}
    assert {"BF16", "Q8_0", "MXFP4", "Q6_K", "Q4_K", "float32", "int32"} <= types
    fx.write_gguf(tmp_path / "m.gguf", tensors)
    # MTP from a separate llama.cpp --mtp file: blk.{n}.* + nextn.*, MTP's own hc_head as output_hc_*
    off = {}
    mtp = fx.official_mtp(rng, off)
    mt: dict = {}
    mdeq = fx.gguf_block_from_official(rng, mtp, "mtp.0.", "blk.3.", fx.LLAMACPP_TYPES, mt)
    eh = np.concatenate([mtp["mtp.0.e_proj.weight"], mtp["mtp.0.h_proj.weight"]], axis=1)
    data, raw, eh_deq = fx.gguf_tensor(rng, eh, T.Q8_0)
    mt["blk.3.nextn.eh_proj.weight"] = (data, raw)
    for n, g in (("enorm", "enorm"), ("hnorm", "hnorm"), ("norm", "shared_head_norm")):
        mt[f"blk.3.nextn.{g}.weight"] = (mtp[f"mtp.0.{n}.weight"], None)
    for n in ("fn", "base", "scale"):
        mt[f"output_hc_{n}.weight"] = (mtp[f"mtp.0.hc_head_{n}"], None)
    for g in ("token_embd.weight", "output.weight", "output_norm.weight"):   # copies of the main model's
        mt[g] = tensors[g]
    fx.write_gguf(tmp_path / "mtp.gguf", mt, n_blocks=4, nextn=1)
    # one real subprocess call of the installed console script: the default keeps Q8_0 / MXFP4 (-> FP4) codes and
    # requantizes the K-quants (Q6_K, Q4_K) to Q8_0, saying so
    r = subprocess.run([sys.executable, "-m", "dsv4_jax.io.convert.cli", "gguf", str(tmp_path / "m.gguf"),
                        str(tmp_path / "keep"), "--mtp", str(tmp_path / "mtp.gguf")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "B/s" in r.stderr                     # the progress bar reports throughput
    assert "LossyConversionWarning" in r.stderr and "ggml_Q6_K -> q8_0" in r.stderr and "ggml_Q4_K -> q8_0" in r.stderr
    assert not re.search(r"^\s+(q8_0|fp4_e2m1_b32|bfloat16) -> ", r.stderr, re.M)   # Q8_0 / MXFP4 / BF16 kept exactly
    meta = json.loads((tmp_path / "keep" / "dsv4.json").read_text())
    leaves = meta["items"]["target"]["leaves"]
    assert leaves["layers.01.ffn.experts.w1"]["format"] == "fp4_e2m1_b32"       # MXFP4, lossless repack
    assert leaves["layers.01.ffn.experts.w2"]["format"] == "q8_0"               # Q6_K, requantized
    assert leaves["layers.01.attn.wq_a"]["format"] == "q8_0"                    # Q8_0 as stored
    kept, logits = check_kept(tmp_path / "keep", ids, {"q8_0", "fp4_e2m1_b32"})
    # what the K-quant -> Q8_0 repack changes against the GGUF's own values (fixture: ~4e-3 of a tensor's max)
    fx.load_state(model, deq)
    want = ref.logits(model, torch.as_tensor(np.asarray(ids))).numpy()
    repack = float(np.abs(logits - want).max())
    assert TOL < repack < 0.1 * float(np.abs(want).max()), repack
    # exact conversion (--dtype f32): every value as the GGUF's own dequantization
    assert main(["gguf", str(tmp_path / "m.gguf"), str(tmp_path / "out"), "--mtp", str(tmp_path / "mtp.gguf"),
                 "--dtype", "f32", "-q"]) == 0
    cfg, params = check_logits(model, deq, tmp_path / "out", ids)
    m = params["mtp"][0]
    np.testing.assert_array_equal(np.asarray(m["e_proj"]), eh_deq[:, :fx.D])
    np.testing.assert_array_equal(np.asarray(m["h_proj"]), eh_deq[:, fx.D:])
    np.testing.assert_array_equal(np.asarray(m["hc_head"]["fn"]), mtp["mtp.0.hc_head_fn"])
    np.testing.assert_array_equal(np.asarray(m["ffn"]["experts"]["w1"]), mdeq["blk.3.ffn_gate_exps.weight"])
    np.testing.assert_array_equal(np.asarray(m["norm"]), mtp["mtp.0.norm.weight"])


def test_gguf_ds4_with_drafters(model, sd, ids, tmp_path):
    rng = np.random.default_rng(3)
    tensors, deq = fx.gguf_tensors(rng, sd, fx.DS4_TYPES)
    types = {T(r).name if r is not None else str(d.dtype) for d, r in tensors.values()}
    assert {"float16", "Q8_0", "IQ2_XXS", "Q2_K", "float32"} <= types
    fx.write_gguf(tmp_path / "m.gguf", tensors)
    # ds4 MTP support file: mtp.0.<gguf suffix>, separate e_proj / h_proj, mtp.0.hc_head_*
    off = {}
    mtp = fx.official_mtp(rng, off)
    mt: dict = {}
    fx.gguf_block_from_official(rng, mtp, "mtp.0.", "mtp.0.", fx.DS4_TYPES, mt)
    for n in ("e_proj", "h_proj", "enorm", "hnorm", "norm"):
        mt[f"mtp.0.{n}.weight"] = (mtp[f"mtp.0.{n}.weight"], None)
    for n in ("fn", "base", "scale"):
        mt[f"mtp.0.hc_head_{n}.weight"] = (mtp[f"mtp.0.hc_head_{n}"], None)
    fx.write_gguf(tmp_path / "mtp.gguf", mt, n_blocks=4, nextn=1)
    # ds4 DSpark support file: dspark.* head + dspark.{s}.* stages
    off2 = {}
    dsp = fx.official_dspark(rng, off2, rank=16, bias=False)
    dt: dict = {}
    for s in range(3):
        fx.gguf_block_from_official(rng, dsp, f"mtp.{s}.", f"dspark.{s}.", fx.DS4_TYPES, dt)
    for o, g in (("mtp.0.main_proj.weight", "main_proj"), ("mtp.0.main_norm.weight", "main_norm"),
                 ("mtp.2.norm.weight", "norm"), ("mtp.2.markov_head.markov_w1.weight", "markov_w1"),
                 ("mtp.2.markov_head.markov_w2.weight", "markov_w2"),
                 ("mtp.2.confidence_head.proj.weight", "conf_proj"), ("mtp.2.hc_head_fn", "hc_head_fn"),
                 ("mtp.2.hc_head_base", "hc_head_base"), ("mtp.2.hc_head_scale", "hc_head_scale")):
        dt[f"dspark.{g}.weight"] = (dsp[o], None)
    fx.write_gguf(tmp_path / "dspark.gguf", dt, n_blocks=3)
    # exact: IQ2_XXS / Q2_K dequantized in f32 (the default would requantize them to Q8_0)
    assert main(["gguf", str(tmp_path / "m.gguf"), str(tmp_path / "out"), "--mtp", str(tmp_path / "mtp.gguf"),
                 "--dspark", str(tmp_path / "dspark.gguf"), "--dtype", "f32", "-q"]) == 0
    meta = json.loads((tmp_path / "out" / "dsv4.json").read_text())
    assert meta["items"]["target"]["leaves"]["layers.01.ffn.experts.w1"]["format"] == "dense"
    assert meta["items"]["target"]["leaves"]["layers.01.attn.wq_a"]["dtype"] == "float32"
    assert "lossy" not in meta["conversion"]
    cfg, params = check_logits(model, deq, tmp_path / "out", ids)
    assert cfg.mtp_layers == 1 and cfg.dspark.n_stages == 3 and not cfg.dspark.conf_bias
    np.testing.assert_array_equal(np.asarray(params["mtp"][0]["hnorm"]), mtp["mtp.0.hnorm.weight"])
    np.testing.assert_array_equal(np.asarray(params["dspark"]["markov_w1"]), dsp["mtp.2.markov_head.markov_w1.weight"])


def test_split_gguf(sd, tmp_path):
    rng = np.random.default_rng(4)
    tensors, _ = fx.gguf_tensors(rng, sd, fx.LLAMACPP_TYPES)
    fx.write_gguf(tmp_path / "one.gguf", tensors)
    fx.write_gguf(tmp_path / "m.gguf", tensors, split_max_tensors=60)
    shards = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("m-"))
    assert len(shards) >= 2 and shards[0].endswith("-00001-of-%05d.gguf" % len(shards)), shards
    with pytest.warns(LossyConversionWarning, match="ggml_Q6_K -> q8_0"):
        assert main(["gguf", str(tmp_path / shards[0]), str(tmp_path / "a"), "--keep-quantized", "-q"]) == 0
    with pytest.warns(LossyConversionWarning):
        assert main(["gguf", str(tmp_path / "one.gguf"), str(tmp_path / "b"), "-q"]) == 0
    _, pa = dsv4_jax.load_checkpoint(tmp_path / "a", dtype=jnp.float32)
    _, pb = dsv4_jax.load_checkpoint(tmp_path / "b", dtype=jnp.float32)
    a, b = _flat(dsv4_jax.model.params.flatten(pa)), _flat(dsv4_jax.model.params.flatten(pb))
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)
    assert os.listdir(tmp_path / "a")
