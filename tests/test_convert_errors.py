"""Bad inputs stop the converter with a clear message, exit status 2, and no output directory."""
import os
import struct

import numpy as np
import pytest

from dsv4_jax.convert.cli import main

from . import convert_fixtures as fx

F32_TYPES = {"fp8": fx.T.F32, "bf16": fx.T.F32, "f32": fx.T.F32, "embed": fx.T.F32, "exps_gate_up": fx.T.F32,
             "exps_down": fx.T.F32, "shexp_gate_up": fx.T.F32}


@pytest.fixture(scope="module")
def gguf_tensors():
    sd = fx.state(fx.build_model(seed=0))
    tensors, _ = fx.gguf_tensors(np.random.default_rng(0), sd, F32_TYPES)
    official, _ = fx.official_tensors(sd)
    return tensors, official


def run_fails(tmp_path, capsys, argv, *needles):
    out = tmp_path / "out"
    assert main(argv + [str(out), "-q"] if argv[0] != "drafter" else argv) == 2
    err = capsys.readouterr().err
    for n in needles:
        assert n in err, err
    assert not out.exists()
    assert not [p for p in os.listdir(tmp_path) if "incomplete" in p]
    return err


def _gguf(tmp_path, tensors, **kw):
    p = tmp_path / "m.gguf"
    fx.write_gguf(p, tensors, **kw)
    return p


def test_truncated_gguf(tmp_path, capsys, gguf_tensors):
    p = _gguf(tmp_path, gguf_tensors[0])
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    run_fails(tmp_path, capsys, ["gguf", str(p)], "truncated")


def test_truncated_safetensors(tmp_path, capsys, gguf_tensors):
    fx.write_official(tmp_path / "hf", gguf_tensors[1], fx.official_config())
    f = tmp_path / "hf" / "model-00001-of-00001.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    run_fails(tmp_path, capsys, ["hf", str(tmp_path / "hf")], "truncated")


def test_unknown_ggml_type(tmp_path, capsys, gguf_tensors):
    p = _gguf(tmp_path, gguf_tensors[0])
    data = bytearray(p.read_bytes())
    name = b"blk.1.attn_q_a.weight"
    i = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, i)[0]
    struct.pack_into("<I", data, i + 4 + 8 * n_dims, 99)     # tensor type id 99: no such ggml type
    p.write_bytes(bytes(data))
    run_fails(tmp_path, capsys, ["gguf", str(p)], "unknown ggml tensor type", "99")


def test_missing_tensor(tmp_path, capsys, gguf_tensors):
    t = dict(gguf_tensors[0])
    del t["blk.2.attn_kv.weight"]
    run_fails(tmp_path, capsys, ["gguf", str(_gguf(tmp_path, t))], "missing", "blk.2.attn_kv.weight")


def test_unexpected_tensor(tmp_path, capsys, gguf_tensors):
    t = dict(gguf_tensors[0], **{"blk.1.bogus.weight": (np.zeros(4, np.float32), None)})
    run_fails(tmp_path, capsys, ["gguf", str(_gguf(tmp_path, t))], "unexpected", "blk.1.bogus.weight")


def test_wrong_shape(tmp_path, capsys, gguf_tensors):
    t = dict(gguf_tensors[1])
    t["layers.1.attn.attn_sink"] = ("F32", np.zeros(7, np.float32))
    fx.write_official(tmp_path / "hf", t, fx.official_config())
    run_fails(tmp_path, capsys, ["hf", str(tmp_path / "hf")], "layers.01.attn.attn_sink", "(7,)", "expected (4,)")


def test_wrong_architecture(tmp_path, capsys, gguf_tensors):
    p = tmp_path / "m.gguf"
    fx.write_gguf(p, gguf_tensors[0], arch="llama", extra_keys=[lambda w: w.add_uint32("llama.block_count", 3)])
    run_fails(tmp_path, capsys, ["gguf", str(p)], "architecture", "'llama'", "'deepseek4'")
    fx.write_gguf(p, {"fc.weight": (np.zeros((4, 12), np.float32), None)}, arch="dflash", n_blocks=1)
    run_fails(tmp_path, capsys, ["gguf", str(p)], "--dspark")


def test_missing_config(tmp_path, capsys, gguf_tensors):
    fx.write_official(tmp_path / "hf", gguf_tensors[1], None)
    run_fails(tmp_path, capsys, ["hf", str(tmp_path / "hf")], "config.json")


def test_missing_gguf_key(tmp_path, capsys, gguf_tensors):
    import gguf
    p = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(p), "deepseek4")          # no deepseek4.* hyperparameters
    w.add_tensor("token_embd.weight", np.zeros((fx.V, fx.D), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    run_fails(tmp_path, capsys, ["gguf", str(p)], "missing metadata key", "deepseek4.block_count")


def test_existing_output_is_kept(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    assert main(["gguf", str(tmp_path / "nope.gguf"), str(tmp_path / "out"), "-q"]) == 2
    assert (tmp_path / "out" / "keep.txt").exists()


def test_drafter_merge_needs_checkpoint(tmp_path, capsys):
    assert main(["drafter", str(tmp_path / "none"), "--mtp", str(tmp_path / "x.gguf")]) == 2
    assert "dsv4.json" in capsys.readouterr().err


def test_failure_mid_stream_leaves_nothing(tmp_path, capsys, gguf_tensors, monkeypatch):
    """An error in the reader thread while layers are already written: clear message, no output."""
    from dsv4_jax.convert import plan as PL
    real, calls = PL.read_leaf, []

    def failing(src, leaf, n_experts):
        calls.append(leaf.path)
        if len(calls) == 60:
            raise PL.ConvertError(f"simulated bad tensor at leaf {leaf.path!r}")
        return real(src, leaf, n_experts)

    monkeypatch.setattr(PL, "read_leaf", failing)
    p = _gguf(tmp_path, gguf_tensors[0])
    run_fails(tmp_path, capsys, ["gguf", str(p)], "simulated bad tensor")
    assert len(calls) == 60          # stopped at the failure, after earlier units were saved
