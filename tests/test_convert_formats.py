"""Quant formats: host (numpy) decoders against gguf-py and direct formulas, device (jnp) twins against host."""
import gguf
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from dsv4_jax.ops import quant
from dsv4_jax.io.convert import quant_formats as qf

from . import convert_fixtures as fx

rng = np.random.default_rng(0)


def test_e8m0_exact_including_subnormal():
    assert qf.E8M0_F32[127] == 1.0 and qf.E8M0_F32[130] == 8.0 and qf.E8M0_F32[1] == 2.0 ** -126
    assert qf.E8M0_F32[0] == np.float32(2.0 ** -127) and qf.E8M0_F32[0] > 0     # not flushed to zero
    assert np.isnan(qf.E8M0_F32[255])


def test_fp8_block_dequant_matches_formula():
    w = rng.standard_normal((200, 300)).astype(np.float32)
    codes, scale, deq = fx.quant_fp8(w)
    assert scale.shape == (2, 3)
    q = qf.check(qf.host(codes.view(ml_dtypes.float8_e4m3fn), scale, qf.FP8), shape=(200, 300))
    got = qf.dequantize(q)
    np.testing.assert_array_equal(got, deq)
    direct = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.ldexp(
        1.0, scale.astype(int) - 127).repeat(128, 0)[:200].repeat(128, 1)[:, :300]
    np.testing.assert_array_equal(got, direct)
    dev = jax.device_put(q)
    np.testing.assert_array_equal(np.asarray(quant.dequantize(dev, jnp.float32)), got)
    # exact in bf16 too (e4m3 × 2^k)
    np.testing.assert_array_equal(np.asarray(quant.dequantize(dev, jnp.bfloat16), np.float32), got)


def test_fp4_nibble_order_low_first():
    codes = np.array([[0x21] + [0] * 15], np.uint8)            # element 0 = code 1 (0.5), element 1 = code 2 (1.0)
    scale = np.array([[127]], np.uint8)
    got = qf.dequantize(qf.host(codes, scale, qf.FP4))
    assert got[0, 0] == 0.5 and got[0, 1] == 1.0 and not got[0, 2:].any()
    w = rng.standard_normal((64, 128)).astype(np.float32)
    c, s, deq = fx.quant_fp4(w)
    got = qf.dequantize(qf.host(c, s, qf.FP4))
    np.testing.assert_array_equal(got, deq)
    np.testing.assert_array_equal(np.asarray(quant.dequantize(jax.device_put(qf.host(c, s, qf.FP4)))), got)


def test_mxfp4_repack_is_lossless():
    x = rng.standard_normal((3, 16, 256)).astype(np.float32)
    raw = gguf.quants.quantize(x, T.MXFP4)
    q = qf.repack_mxfp4(raw)
    assert q.shape == (3, 16, 256) and q.codes.shape == (3, 16, 128) and q.scale.shape == (3, 16, 8)
    np.testing.assert_array_equal(qf.dequantize(q), gguf.quants.dequantize(raw, T.MXFP4))


def test_q8_0_split():
    x = rng.standard_normal((5, 96)).astype(np.float32)
    raw = gguf.quants.quantize(x, T.Q8_0)
    q = qf.split_q8_0(raw)
    assert q.codes.dtype == np.int8 and q.scale.dtype == np.float16 and q.scale.shape == (5, 3)
    want = gguf.quants.dequantize(raw, T.Q8_0)
    np.testing.assert_array_equal(qf.dequantize(q), want)
    np.testing.assert_array_equal(np.asarray(quant.dequantize(jax.device_put(q), jnp.float32)), want)


@pytest.mark.parametrize("qtype", sorted(qf.GGML_RAW_TYPES, key=lambda t: t.value), ids=lambda t: t.name)
def test_ggml_raw_types(qtype):
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (4, 2 * ts), dtype=np.uint8)
    q = qf.ggml_raw(raw, qtype)
    assert q.shape == (4, 2 * bs)
    np.testing.assert_array_equal(qf.dequantize(q), gguf.quants.dequantize(raw, qtype), strict=False)


def test_slice_fused_q8_0_columns():
    x = rng.standard_normal((4, 128)).astype(np.float32)
    q = qf.split_q8_0(gguf.quants.quantize(x, T.Q8_0))
    full = qf.dequantize(q)
    np.testing.assert_array_equal(qf.dequantize(qf.slice_axis(q, 1, 64, 128)), full[:, 64:])
    with pytest.raises(qf.FormatError):
        qf.slice_axis(q, 1, 0, 40)


def test_convert_leaf_keeps_codes_and_notes_every_rounding():
    from dsv4_jax.model import params as P
    from dsv4_jax.io.convert import pipeline as PI, plan as PL
    spec = P.ParamSpec((4, 64), ("embed", None))
    x = rng.standard_normal((4, 64)).astype(np.float32)
    q8 = qf.split_q8_0(gguf.quants.quantize(x, T.Q8_0))
    losses = {}
    kept = PL.convert_leaf(q8, spec, np.float32, True, losses)            # default: codes kept, exact
    assert isinstance(kept, quant.QArray) and kept.fmt == quant.Q8_0 and not losses
    np.testing.assert_array_equal(kept.codes, q8.codes)
    c, s, deq = fx.quant_fp8(x)
    fp8 = qf.host(c.view(ml_dtypes.float8_e4m3fn), s, qf.FP8)
    out = PL.convert_leaf(fp8, spec, ml_dtypes.bfloat16, False, losses)  # FP8 -> bf16 is exact: nothing noted
    np.testing.assert_array_equal(out.astype(np.float32), deq)
    assert not losses
    PL.convert_leaf(q8, spec, ml_dtypes.bfloat16, False, losses)         # Q8_0 -> bf16 rounds the products
    (n, err), = losses.values()
    assert list(losses) == [("q8_0", "bfloat16")] and n == 1 and 0 < err < 2 ** -8
    raw, _ = fx.random_kquant(np.random.default_rng(1), (4, 256), T.Q4_K)
    repacked = PL.convert_leaf(qf.ggml_raw(raw, T.Q4_K), spec.__class__((4, 256), ("embed", None)), np.float32, True,
                               losses)
    assert repacked.fmt == quant.Q8_0 and 0 < losses[("ggml_Q4_K", "q8_0")][1] < 1 / 200
    msg = PI._describe_losses(losses)
    assert "q8_0 -> bfloat16" in msg and "ggml_Q4_K -> q8_0" in msg and "top-k" in msg and "--dtype f32" in msg


def test_checkpoint_versions(tmp_path):
    """format_version 1 (uint8 FP8 codes, raw GGML leaves) is read; unknown versions stop with a clear error."""
    import json
    from dsv4_jax.io import checkpoint as CK
    from dsv4_jax.model import params as P
    spec = P.ParamSpec((8, 32), ("embed", None))
    rec = {"format": "fp8_e4m3_b128", "shape": [8, 32], "arrays": {"codes": {"shape": [8, 32], "dtype": "uint8"},
                                                                   "scale": {"shape": [1, 1], "dtype": "uint8"}}}
    place = CK._Placement()
    t = CK._target(rec, spec, jnp.float32, place, "w", 1)
    assert t.codes.dtype == np.uint8 and t.fmt == quant.FP8
    with pytest.raises(CK.CheckpointFormatError, match="do not match"):
        CK._target(rec, spec, jnp.float32, place, "w", 2)                  # v2 stores float8_e4m3fn codes
    w = rng.standard_normal((8, 32)).astype(np.float32)
    c, s, deq = fx.quant_fp8(w)
    stored = jax.device_put(quant.QArray(c, s, quant.FP8, jnp.float32))    # as a v1 restore returns it
    got = CK._to_model(rec, stored, spec, jnp.float32, place, "w", keep=True)
    assert got.codes.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(np.asarray(quant.dequantize(got)), deq)
    np.testing.assert_array_equal(np.asarray(CK._to_model(rec, stored, spec, jnp.float32, place, "w", keep=False)), deq)
    ggml = {"format": "ggml_Q4_K", "shape": [8, 256], "arrays": {"codes": {"shape": [8, 144], "dtype": "uint8"}}}
    with pytest.raises(CK.CheckpointFormatError, match="re-convert"):
        CK._to_model(ggml, {"codes": np.zeros((8, 144), np.uint8)}, P.ParamSpec((8, 256), ("embed", None)),
                     jnp.float32, place, "w", keep=True)
    (tmp_path / "dsv4.json").write_text(json.dumps({"format_version": 3}))
    with pytest.raises(CK.CheckpointFormatError, match="format_version 3"):
        CK.load_checkpoint(tmp_path)
