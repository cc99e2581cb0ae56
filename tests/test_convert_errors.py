"""Bad inputs stop the converter with a clear message, exit status 2, and no output directory."""
import json
import os
import struct

import gguf

import numpy as np
import pytest

from dsv4_jax.io.convert.cli import main

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
    """The command exits 2 naming every needle; OUT_DIR (nested: its parent did not exist) is not left
    behind, nor its parent, nor a temporary directory."""
    out = tmp_path / "new" / "out"
    assert main(argv + [str(out), "-q"] if argv[0] != "drafter" else argv) == 2
    err = capsys.readouterr().err
    for n in needles:
        assert n in err, err
    assert not out.exists() and not out.parent.exists()
    assert not [p for p in os.listdir(tmp_path) if "incomplete" in p]
    return err


def _gguf(tmp_path, tensors, **kw):
    p = tmp_path / "m.gguf"
    fx.write_gguf(p, tensors, **kw)
    return p


def _cut(path, at: int) -> None:
    path.write_bytes(path.read_bytes()[:at])


def _gguf_cut(r: gguf.GGUFReader, key: str, where: str) -> tuple[int, list[str]]:
    """(cut offset, what the message must say) for a cut of the file read by `r` (gguf-py locates the parts).

    header: inside the u64 tensor count; metadata: inside the value of `key`; tensor-info: inside the
    shape of the first 2-D tensor; data: 1000 bytes into the largest tensor's data.
    """
    if where == "header":
        return 10, ["truncated in the header", "the tensor count", "needs 8 bytes at offset 8", "2 of 8 present"]
    if where == "metadata":
        f = r.fields[key]
        value_at = f.offset + sum(int(p.nbytes) for p in f.parts[:-1])
        n = int(f.parts[-1].nbytes)
        return value_at + 1, ["truncated in the metadata", repr(key), f"needs {n} bytes at offset {value_at}",
                              f"1 of {n} present"]
    if where == "tensor-info":
        t = next(t for t in r.tensors if len(t.shape) == 2)
        parts = t.field.parts                           # name length, name, n_dims, dims, type, offset
        dims_at = t.field.offset + sum(int(p.nbytes) for p in parts[:3])
        n = int(parts[3].nbytes)
        return dims_at + 5, ["truncated in the tensor-info table", repr(t.name), f"needs {n} bytes at offset {dims_at}",
                             f"5 of {n} present"]
    t = max(r.tensors, key=lambda t: t.n_bytes)
    return int(t.data_offset) + 1000, ["truncated in the tensor data", repr(t.name),
                                       f"needs {t.n_bytes} bytes at offset {t.data_offset}",
                                       f"1000 of {t.n_bytes} present"]


@pytest.mark.parametrize("where", ["header", "metadata", "tensor-info", "data"])
@pytest.mark.parametrize("split", [False, True], ids=["single", "split"])
def test_truncated_gguf(tmp_path, capsys, gguf_tensors, where, split):
    """A cut-short GGUF file (one file, or the second shard of a split set): the message names the file, the
    part (header field, metadata key or tensor) and the bytes it needs against those present."""
    fx.write_gguf(tmp_path / "m.gguf", gguf_tensors[0], split_max_tensors=60 if split else 0)
    path = tmp_path / ("m-00002-of-00002.gguf" if split else "m.gguf")
    at, needles = _gguf_cut(gguf.GGUFReader(str(path)), "split.count" if split else "deepseek4.rope.freq_base",
                            where)
    _cut(path, at)
    first = tmp_path / ("m-00001-of-00002.gguf" if split else "m.gguf")
    run_fails(tmp_path, capsys, ["gguf", str(first)], f"{path}: ", f"the file ends at {at} bytes", *needles)


def _safetensors_cut(path, where: str) -> tuple[int, list[str]]:
    """(cut offset, needles) for a cut of an intact safetensors file, located from its own header."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    if where == "length":
        return 5, ["truncated in the header", "the header length", "needs 8 bytes at offset 0", "5 of 8 present"]
    name = "layers.1.attn.wkv.weight"
    if where == "json":
        at = 8 + data[8:8 + n].index(json.dumps(name).encode()) + len(name) + 6     # inside the tensor's entry
        return at, ["truncated in the JSON header", f"needs {n} bytes at offset 8", f"{at - 8} of {n} present",
                    repr(name)]
    size = {k: e["data_offsets"][1] - e["data_offsets"][0] for k, e in header.items() if k != "__metadata__"}
    name = max(size, key=size.get)                                    # the largest tensor: cut 1000 bytes in
    lo = header[name]["data_offsets"][0]
    return 8 + n + lo + 1000, ["truncated in the tensor data", repr(name),
                               f"needs {size[name]} bytes at offset {8 + n + lo}", f"1000 of {size[name]} present"]


@pytest.mark.parametrize("where", ["length", "json", "data"])
def test_truncated_safetensors(tmp_path, capsys, gguf_tensors, where):
    fx.write_official(tmp_path / "hf", gguf_tensors[1], fx.official_config())
    f = tmp_path / "hf" / "model-00001-of-00001.safetensors"
    at, needles = _safetensors_cut(f, where)
    _cut(f, at)
    run_fails(tmp_path, capsys, ["hf", str(tmp_path / "hf")], f"{f}: ", f"the file ends at {at} bytes", *needles)


def test_safetensors_inconsistent_offsets(tmp_path, capsys, gguf_tensors):
    """data_offsets that do not match dtype x shape: a corrupt header, named with both sizes."""
    fx.write_official(tmp_path / "hf", gguf_tensors[1], fx.official_config())
    f = tmp_path / "hf" / "model-00001-of-00001.safetensors"
    data = f.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    e = header["layers.1.attn.attn_sink"]
    e["shape"] = [e["shape"][0] * 2]                 # F32 [8]: 32 bytes claimed, 16 stored
    text = json.dumps(header).encode()
    f.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n:])
    want = e["shape"][0] * 4
    run_fails(tmp_path, capsys, ["hf", str(tmp_path / "hf")], "corrupt header", "'layers.1.attn.attn_sink'",
              f"needs {want} bytes", f"span {want // 2}")


def test_file_shrinks_while_converting(tmp_path, capsys, gguf_tensors, monkeypatch):
    """A source cut short after it was checked (read in the reader thread): the tensor, both byte counts."""
    from dsv4_jax.io.convert import gguf_io
    p = _gguf(tmp_path, gguf_tensors[0])
    real, state = gguf_io.GGUFSource.__init__, {}

    def open_then_cut(self, path):
        real(self, path)
        t = self._tensors["blk.2.ffn_gate_exps.weight"]
        state.update(offset=int(t.data_offset), n=int(t.n_bytes))
        _cut(p, state["offset"] + 100)

    monkeypatch.setattr(gguf_io.GGUFSource, "__init__", open_then_cut)
    err = run_fails(tmp_path, capsys, ["gguf", str(p)], "truncated in the tensor data", "'blk.2.ffn_gate_exps.weight'")
    assert f"needs {state['n']} bytes at offset {state['offset']}" in err and f"100 of {state['n']} present" in err


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


def test_output_directory_rule(tmp_path, capsys, gguf_tensors):
    """The rule shared with dsv4-sweep (dsv4_jax.io.outdir): a missing OUT_DIR (parents created, normal
    permissions) or an existing empty one is written; a non-empty one needs --overwrite; a file, or a path
    below a file, is refused before any source is read."""
    p = _gguf(tmp_path, gguf_tensors[0])
    empty, nested = tmp_path / "empty", tmp_path / "a" / "b" / "out"
    empty.mkdir()
    for out in (empty, nested):
        assert main(["gguf", str(p), str(out), "-q"]) == 0
        assert (out / "dsv4.json").is_file() and (out / "target").is_dir()
    umask = os.umask(0)
    os.umask(umask)
    for d in (tmp_path / "a", tmp_path / "a" / "b", nested):
        assert d.stat().st_mode & 0o777 == 0o777 & ~umask, d
    assert sorted(os.listdir(tmp_path / "a" / "b")) == ["out"]
    afile = tmp_path / "afile"
    afile.write_text("x")
    for out, message in ((empty, "is not empty (pass --overwrite"), (afile, "exists and is not a directory"),
                         (afile / "sub", "is a file")):
        assert main(["gguf", str(tmp_path / "missing.gguf"), str(out), "-q"]) == 2   # the output is checked first
        assert message in capsys.readouterr().err


def test_drafter_merge_needs_checkpoint(tmp_path, capsys):
    assert main(["drafter", str(tmp_path / "none"), "--mtp", str(tmp_path / "x.gguf")]) == 2
    assert "dsv4.json" in capsys.readouterr().err


def test_failure_mid_stream_leaves_nothing(tmp_path, capsys, gguf_tensors, monkeypatch):
    """An error in the reader thread while layers are already written: clear message, no output."""
    from dsv4_jax.io.convert import plan as PL
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
