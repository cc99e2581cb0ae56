"""`drafters.precision.drafter_at_precision`: the drafter's weights at another precision, the target's the same
objects; the converted values within their format's bound (derived from the format, not measured); greedy
speculative decoding with the converted drafter still equals plain greedy decoding (lossless)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax as d
from dsv4_jax.drafters import precision as DP
from dsv4_jax.model import params as P
from dsv4_jax.ops import quant
from dsv4_jax.research.models import random_tiny


@pytest.fixture(scope="module")
def tiny():
    return random_tiny(0)


@pytest.fixture(scope="module")
def demo():
    return d.tiny_demo()


def _flat(tree) -> dict:
    return {DP._flat(p): v for p, v in jax.tree_util.tree_leaves_with_path(tree, is_leaf=quant.is_qarray)}


def _block_amax(w: np.ndarray, br: int, bc: int) -> np.ndarray:
    """max |w| of each (br, bc) block of the last two dims, broadcast back to w's shape (edges partial)."""
    *lead, n, k = w.shape
    pn, pk = -(-n // br) * br, -(-k // bc) * bc
    a = np.pad(np.abs(w), [(0, 0)] * len(lead) + [(0, pn - n), (0, pk - k)])
    m = a.reshape(*lead, pn // br, br, pk // bc, bc).max(axis=(-3, -1), keepdims=True)
    return np.broadcast_to(m, a.reshape(*lead, pn // br, br, pk // bc, bc).shape).reshape(a.shape)[..., :n, :k]


@pytest.mark.parametrize("drafter", DP.DRAFTERS)
@pytest.mark.parametrize("precision", DP.PRECISIONS)
def test_target_and_kept_leaves_are_the_same_objects(tiny, drafter, precision):
    out = DP.drafter_at_precision(tiny.params, drafter, precision)
    if precision == "as-loaded":
        assert out is tiny.params
    assert out.keys() == tiny.params.keys()
    for key in tiny.params:
        if key != drafter:                                   # the target and the other drafter
            assert out[key] is tiny.params[key]
    assert all(a is b for a, b in zip(jax.tree.leaves(out["segments"]), jax.tree.leaves(tiny.params["segments"])))
    before, after = _flat(tiny.params[drafter]), _flat(out[drafter])
    assert before.keys() == after.keys()
    what = DP.converted_leaves(tiny.params[drafter], precision)
    for path, leaf in after.items():
        if what[path] == "kept" or precision == "f32":         # tiny is float32: an f32 cast keeps the leaf
            assert leaf is before[path], path
        elif precision in DP.QUANTIZED:
            assert isinstance(leaf, quant.QArray) and leaf.fmt == DP.QUANTIZED[precision], path
            assert leaf.dtype == before[path].dtype and leaf.shape == before[path].shape
        else:
            assert leaf.dtype == DP.CASTS[precision] and leaf.shape == before[path].shape, path


def test_which_leaves_convert(tiny):
    """The kept-float32 rule is the spec trees' kind "f32"; fp8 / int8 quantize exactly the release's quantized
    set (projections, shared and routed experts, e_proj / h_proj / main_proj), never router or Markov tables."""
    c = tiny.config
    for specs in (P.mtp_specs(c), P.dspark_specs(c, 2, 3, 8, conf_bias=True)):
        for path, s in P.flatten(specs).items():
            assert bool(DP.KEPT_F32.search(path)) == (s.kind == "f32"), path
    m = tiny
    mtp = DP.converted_leaves(m.params["mtp"], "fp8")
    dsp = DP.converted_leaves(m.params["dspark"], "int8")
    assert {p for p, v in mtp.items() if v != "kept"} == {
        f"0.{x}" for x in ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b", "e_proj", "h_proj",
                           *(f"ffn.{e}.w{i}" for e in ("experts", "shared_experts") for i in (1, 2, 3)))}
    assert dsp["main_proj"] == "q8_0" and dsp["stages.1.ffn.experts.w2"] == "q8_0"
    assert all(dsp[k] == "kept" for k in ("markov_w1", "markov_w2", "conf_proj.weight", "stages.0.ffn.gate.weight"))
    assert DP.converted_leaves(m.params["dspark"], "bf16")["markov_w1"] == "cast bfloat16"


@pytest.mark.parametrize("precision", ["bf16", "fp8", "int8"])
def test_converted_values_within_the_format_bound(tiny, precision):
    """bf16: |ŵ − w| ≤ 2^-8 |w| (round to nearest, 8 significand bits). fp8 (e4m3, e8m0 scale s ≤ 2·amax/448 per
    128×128 block): ≤ 2^-4 |w| + 2^-10 s (half an ulp of 3 mantissa bits; half the subnormal step 2^-9 s).
    int8 (Q8_0, float16 scale amax/127 per 32 columns of a row): ≤ (1 + 2^-11) amax/254 ≤ row max / 127."""
    for drafter in DP.DRAFTERS:
        before = _flat(tiny.params[drafter])
        after = _flat(DP.drafter_at_precision(tiny.params, drafter, precision)[drafter])
        what = DP.converted_leaves(tiny.params[drafter], precision)
        assert any(v != "kept" for v in what.values())
        for path, v in what.items():
            if v == "kept":
                continue
            w = np.asarray(before[path], np.float32)
            got = np.asarray(quant.dense(after[path], jnp.float32), np.float32)
            err = np.abs(got - w)
            if precision == "bf16":
                bound = 2.0 ** -8 * np.abs(w)
            elif precision == "fp8":
                bound = 2.0 ** -4 * np.abs(w) + 2.0 ** -10 * 2 * _block_amax(w, 128, 128) / 448
            else:
                bound = (1 + 2.0 ** -11) * _block_amax(w, 1, 32) / 254
                assert np.all(err <= np.abs(w).max(axis=-1, keepdims=True) / 127), path
            assert np.all(err <= bound), (path, float((err - bound).max()))
            assert np.any(err > 0), path          # really converted (random float32 values are not representable)


def test_quantized_leaves_reconverted(tiny):
    """A leaf already in the wanted format is kept; a release FP4 expert is re-quantized to FP8 from its values."""
    m = tiny
    fp8 = DP.drafter_at_precision(m.params, "mtp", "fp8")
    again = DP.drafter_at_precision(fp8, "mtp", "fp8")
    assert all(a is b for a, b in zip(jax.tree.leaves(again["mtp"]), jax.tree.leaves(fp8["mtp"])))
    w1 = m.params["mtp"][0]["ffn"]["experts"]["w1"]
    fp4 = quant.quantize(w1, quant.FP4)
    params = dict(m.params, mtp=[dict(m.params["mtp"][0], ffn=dict(m.params["mtp"][0]["ffn"],
                                                                   experts=dict(m.params["mtp"][0]["ffn"]["experts"], w1=fp4)))])
    q = DP.drafter_at_precision(params, "mtp", "fp8")["mtp"][0]["ffn"]["experts"]["w1"]
    assert q.fmt == quant.FP8 and q.dtype == fp4.dtype
    w = np.asarray(quant.dequantize(fp4))
    bound = 2.0 ** -4 * np.abs(w) + 2.0 ** -10 * 2 * _block_amax(w, 128, 128) / 448
    assert np.all(np.abs(np.asarray(quant.dequantize(q)) - w) <= bound)
    dense = DP.drafter_at_precision(params, "mtp", "bf16")["mtp"][0]["ffn"]["experts"]["w1"]
    np.testing.assert_array_equal(np.asarray(dense, np.float32), w)      # FP4 values are exact in bf16


# (dspark, fp8) in the slow set: fp8 reaches `quant.matmul_blocks` in the default set through MTP's e_proj /
# h_proj (whole 128×128 blocks at the demo's width 128, as DSpark's main_proj), DSpark runs quantized at int8
@pytest.mark.parametrize("runs", [pytest.param((("mtp", "bf16"), ("mtp", "fp8"), ("dspark", "int8")), id="default"),
                                  pytest.param((("dspark", "fp8"),), id="dspark-fp8", marks=pytest.mark.slow)])
def test_greedy_output_unchanged_by_drafter_precision(demo, runs):
    """The trained tiny drafters (they do get drafts accepted) at each precision: the greedy tokens are plain
    greedy decoding's (the drafter's precision moves acceptance at most, never the output). The demo computes
    in float32 (its bf16-stored drafters make "bf16" value-exact: it checks the mixed-dtype path)."""
    prompt = demo.tokenizer.encode("def fibonacci(n):\n    ")
    plain = d.generate(demo.params, demo.config, [prompt], 8, eos_token_id=-1).tokens
    # each run compiles its loop (~10 s): every drafter and every quantized format once
    accepted = 0
    for drafter, precision in runs:
        params = DP.drafter_at_precision(demo.params, drafter, precision)
        g = d.generate(params, demo.config, [prompt], 8, drafter=drafter, draft_n_max=2, eos_token_id=-1,
                       dspark_meta=demo.dspark)
        assert g.tokens == plain, (drafter, precision)
        assert g.stats["drafted"] > 0
        accepted += g.stats["accepted"]
    assert accepted > 0                 # accepted drafts were committed, not only rejected ones


def test_bad_arguments(tiny):
    with pytest.raises(ValueError, match="unknown drafter precision 'q4'.*as-loaded, f32, bf16, fp8, int8"):
        DP.drafter_at_precision(tiny.params, "mtp", "q4")
    with pytest.raises(ValueError, match="unknown drafter 'ngram'.*mtp, dspark"):
        DP.drafter_at_precision(tiny.params, "ngram", "fp8")
    no_dspark = {k: v for k, v in tiny.params.items() if k != "dspark"}
    for params in (no_dspark, dict(tiny.params, dspark=None)):
        with pytest.raises(ValueError, match="no dspark weights"):
            DP.drafter_at_precision(params, "dspark", "as-loaded")
    with pytest.raises(ValueError, match="no mtp weights"):
        DP.drafter_at_precision(dict(tiny.params, mtp=[]), "mtp", "int8")
    bf16 = {**tiny.params, "embed": tiny.params["embed"].astype(jnp.bfloat16)}
    with pytest.raises(ValueError, match="drafter precision 'f32' needs a target computing in f32 or wider"):
        DP.drafter_at_precision(bf16, "mtp", "f32")
