"""Hostile inputs: a seeded, time-bounded fuzz run over mutated GGUF, safetensors, config.json and checkpoint
files, plus the data-loss and blocking cases of the issue (#40).

Each case mutates a copy of an intact fixture and runs the reader the CLI runs (plan + read and check every
tensor for the converters; load_checkpoint for a checkpoint). Outcomes:

    error      one of the documented errors, its message naming the mutated file (or its directory)
    same       loads, every value equal to the intact input's (the mutation hit padding or was a no-op)
    value      loads with other values, the mutation being an edit inside unchecksummed tensor data of a
               source file (value-plausible; the non-finite check still applies)
    SILENT     loads with other values from any other mutation          -> the test fails
    TRACEBACK  any other exception                                       -> the test fails
    HANG       no answer within the per-case alarm                       -> the test fails

FUZZ_SEED / FUZZ_SECONDS (env, for manual runs) change the seed and the time budget.
"""
import json
import os
import shutil
import signal
import stat
import struct
import warnings

import gguf
import numpy as np
import pytest

import dsv4_jax as d
from dsv4_jax.config import HASH_MOE, MOE, _schedule
from dsv4_jax.io.checkpoint import load_checkpoint
from dsv4_jax.io.convert import pipeline
from dsv4_jax.io.convert.cli import ERRORS, main
from dsv4_jax.io.convert.save import save_checkpoint
from dsv4_jax.model.params import flatten

from . import convert_fixtures as fx

SEED = int(os.environ.get("FUZZ_SEED", "40"))
BUDGET = float(os.environ.get("FUZZ_SECONDS", "8"))       # seconds for all families together (fast run)
LONG_BUDGET = float(os.environ.get("FUZZ_SECONDS", "60"))  # the slow run's: the same seeded cases, and more
MIN_CASES = 6                                            # per family, even past the budget
ALARM = 30


# ---- fixtures -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """An intact GGUF file (BF16 / Q8_0 / MXFP4 / F32 tensors), official safetensors directory and a
    save_checkpoint checkpoint of a 3-layer model."""
    root = tmp_path_factory.mktemp("fuzz")
    sd = fx.state(fx.build_model(seed=0))
    types = dict(fx.LLAMACPP_TYPES, exps_down=fx.T.Q8_0, shexp_gate_up=fx.T.Q8_0)
    tensors, _ = fx.gguf_tensors(np.random.default_rng(0), sd, types)
    fx.write_gguf(root / "m.gguf", tensors)
    official, _ = fx.official_tensors(sd)
    fx.write_official(root / "hf", official, fx.official_config())
    types_, ratios = _schedule([0, 4, 8])
    config = d.tiny().replace(name="fuzz", num_layers=3, layer_types=types_, compress_ratios=ratios,
                              mlp_layer_types=(HASH_MOE, MOE, MOE))
    save_checkpoint(root / "ckpt", config, d.init_params(config, 0), dtype="bfloat16")
    return root


def _gguf_units(path):
    _, jobs = pipeline.plan_gguf(str(path))
    return _read_jobs(jobs)


def _hf_units(path):
    _, jobs = pipeline.plan_hf(str(path))
    return _read_jobs(jobs)


def _read_jobs(jobs):
    """{leaf: host array(s)} of every unit of every job, as the converter reads, checks and repacks them."""
    out = {}
    for j in jobs:
        j.check()
        for u in j.units:
            flat, _ = pipeline._read_unit(j, u, np.dtype(np.float32), True)
            for k, v in flat.items():
                parts = (v.codes, v.scale) if hasattr(v, "codes") else (v,)
                out[f"{j.item}.{u.label}.{k}"] = [np.asarray(p) for p in parts]
    return out


def _ckpt_values(path):
    _, params = load_checkpoint(path, dtype=np.float32)
    return {k: [np.asarray(v)] for k, v in flatten(params).items()}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        len(x) == len(y) and all(p.shape == q.shape and p.dtype == q.dtype and
                                 np.array_equal(p.view(np.uint8), q.view(np.uint8)) for p, q in zip(x, y))
        for x, y in ((a[k], b[k]) for k in a))


class _Hang(Exception):
    pass


def _alarm(*_):
    raise _Hang()


def run_case(fn, path, base, names_file: str, value_edit: bool) -> tuple[str, str]:
    """(outcome, detail) of reading `path` with `fn` (see the module doc)."""
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(ALARM)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = fn(path)
    except _Hang:
        return "HANG", ""
    except ERRORS as e:
        msg = str(e)
        named = names_file in msg or os.path.dirname(names_file) in msg
        return ("error" if named else "UNNAMED"), msg[:300]
    except Exception as e:  # noqa: BLE001
        return "TRACEBACK", f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    if _equal(got, base):
        return "same", ""
    return ("value" if value_edit else "SILENT"), ""


# ---- mutations --------------------------------------------------------------------------------------------

def pick(rng, options):
    """One of `options` (any Python objects), drawn by rng."""
    return options[int(rng.integers(0, len(options)))]


def _flip(b: bytearray, rng, lo: int, hi: int) -> None:
    i = int(rng.integers(lo, hi))
    b[i] ^= 1 << int(rng.integers(0, 8))


def gguf_mutation(rng, data: bytes, path) -> tuple[bytes, bool, str]:
    """(mutated bytes, inside tensor data?, description) of a GGUF file."""
    r = gguf.GGUFReader(str(path))
    start = int(r.data_offset)
    b = bytearray(data)
    ts = list(r.tensors)
    kind = pick(rng, ["truncate", "flip_header", "flip_data", "offset", "type", "huge_len", "alias", "key_rename",
                       "key_type"])
    t = ts[int(rng.integers(0, len(ts)))]
    parts = t.field.parts                                   # name len, name, n_dims, dims, type, offset
    at_type = t.field.offset + sum(int(p.nbytes) for p in parts[:4])
    at_off = at_type + 4
    if kind == "truncate":
        return bytes(b[:int(rng.integers(0, len(b)))]), False, kind
    if kind == "flip_header":
        _flip(b, rng, 0, start)
        return bytes(b), False, kind
    if kind == "flip_data":
        _flip(b, rng, start, len(b))
        return bytes(b), True, kind
    if kind == "offset":
        delta = int(pick(rng, [2, -2, 32, -32, 64, 1 << 20]))
        (off,) = struct.unpack_from("<Q", b, at_off)
        struct.pack_into("<Q", b, at_off, max(0, off + delta))
        return bytes(b), False, f"offset {t.name} {delta:+d}"
    if kind == "alias":
        other = ts[int(rng.integers(0, len(ts)))]
        struct.pack_into("<Q", b, at_off, int(other.data_offset) - start)
        return bytes(b), False, f"alias {t.name} -> {other.name}"
    if kind == "type":
        new = int(pick(rng, [0, 1, 8, 30, 39, 24, 26, 2, 99]))     # F32 F16 Q8_0 BF16 MXFP4 I8 I32 Q4_0 bad
        struct.pack_into("<I", b, at_type, new)
        return bytes(b), False, f"type {t.name} -> {new}"
    if kind == "huge_len":
        struct.pack_into("<Q", b, t.field.offset, 1 << 40)       # the tensor name's length
        return bytes(b), False, kind
    key = str(pick(rng, ["deepseek4.swiglu_clamp_exp", "deepseek4.rope.scaling.type", "deepseek4.block_count",
                          "deepseek4.expert_count", "deepseek4.attention.key_length"]))
    f = r.fields[key]
    if kind == "key_rename":
        name_at = f.offset + 8
        b[name_at] = ord("X")
        return bytes(b), False, f"rename {key}"
    type_at = f.offset + 8 + len(key)                        # value type u32 after the key string
    struct.pack_into("<I", b, type_at, int(pick(rng, [8, 6, 4, 0])))   # string / f32 / u32 / u8
    return bytes(b), False, f"value type of {key}"


def safetensors_mutation(rng, data: bytes) -> tuple[bytes, bool, str]:
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    names = sorted(k for k in header if k != "__metadata__")
    name = names[int(rng.integers(0, len(names)))]
    kind = pick(rng, ["truncate", "hlen", "flip_data", "dup_offsets", "shift", "json_type", "entry", "huge_len"])

    def rebuild(h, pad_to=None):
        t = json.dumps(h).encode()
        t += b" " * ((pad_to - len(t)) if pad_to and pad_to > len(t) else -len(t) % 8)
        return struct.pack("<Q", len(t)) + t + data[8 + n:]
    if kind == "truncate":
        return data[:int(rng.integers(0, len(data)))], False, kind
    if kind == "hlen":
        delta = int(pick(rng, [-1, -4, 1, 8]))
        return struct.pack("<Q", n + delta) + data[8:], False, f"header length {delta:+d}"
    if kind == "huge_len":
        return struct.pack("<Q", 1 << 50) + data[8:], False, kind
    if kind == "flip_data":
        b = bytearray(data)
        _flip(b, rng, 8 + n, len(b))
        return bytes(b), True, kind
    h = json.loads(data[8:8 + n])
    if kind == "dup_offsets":
        other = names[int(rng.integers(0, len(names)))]
        h[name]["data_offsets"] = list(h[other]["data_offsets"])
    elif kind == "shift":
        lo, hi = h[name]["data_offsets"]
        s = int(pick(rng, [1, 2, 4, 64]))
        h[name]["data_offsets"] = [lo + s, hi + s]
    elif kind == "json_type":
        h = pick(rng, [[1, 2], 3, None, "x"]) if rng.random() < 0.3 else h
        if isinstance(h, dict):
            field = pick(rng, ["shape", "data_offsets", "dtype"])
            h[name][field] = pick(rng, ["abc", 1.5, None, [1.5, 2], ["1"], {"a": 1}, [-1]])
    else:
        e = h[name]
        choice = int(rng.integers(0, 3))
        if choice == 0:
            e.pop(pick(rng, ["shape", "data_offsets", "dtype"]))
        elif choice == 1:
            e["shape"] = list(reversed(e["shape"])) + ([1] if rng.random() < 0.5 else [])
        else:
            e["dtype"] = pick(rng, ["F16", "F32", "I8", "U8", "BF16", "Q4"])
    return rebuild(h, pad_to=n), False, f"{kind} {name}"


CONFIG_EDITS = [
    ("hidden_size", "abc"), ("num_hidden_layers", "six"), ("compress_ratios", "0,4"), ("rope_scaling", "yarn"),
    ("hidden_size", 255), ("num_hidden_layers", 2), ("vocab_size", None), ("n_routed_experts", 1.5),
    ("q_lora_rank", [32]), ("rope_scaling", {"type": "yarn"}), ("swiglu_limit", "10"), ("num_hash_layers", "1"),
    ("compress_rates", [4, 8]), ("index_topk", -1), ("head_dim", True), ("eos_token_id", ["a"]),
    ("rms_norm_eps", "1e-6"), ("hc_mult", 0), ("o_groups", 3), ("norm_topk_prob", "yes"),
]


def config_mutation(rng, text: str) -> tuple[bytes, bool, str]:
    cfg = json.loads(text)
    r = rng.random()
    if r < 0.15:
        return text[:int(rng.integers(0, len(text)))].encode(), False, "truncate"
    if r < 0.25:
        return json.dumps(pick(rng, [[1], 3, None, "x"])).encode(), False, "top-level type"
    key, value = CONFIG_EDITS[int(rng.integers(0, len(CONFIG_EDITS)))]
    if value is None:
        cfg.pop(key, None)
    else:
        cfg[key] = value
    return json.dumps(cfg).encode(), False, f"{key} = {value!r}"


def ckpt_mutation(rng, ckpt) -> tuple[str, str]:
    """Mutate the checkpoint directory `ckpt` in place; returns (mutated file, description)."""
    files = sorted(os.path.join(dp, f) for dp, _, fs in os.walk(ckpt) for f in fs)
    data_files = [f for f in files if f"{os.sep}d{os.sep}" in f]
    kind = pick(rng, ["flip_data", "flip_data", "truncate_data", "meta_layers", "meta_json", "meta_leaf",
                       "orbax_meta", "manifest"])
    meta = os.path.join(ckpt, "dsv4.json")
    if kind in ("flip_data", "truncate_data"):
        f = data_files[int(rng.integers(0, len(data_files)))]
        b = bytearray(open(f, "rb").read())
        if kind == "flip_data":
            _flip(b, rng, 0, len(b))
        else:
            b = b[:int(rng.integers(0, len(b)))]
        open(f, "wb").write(bytes(b))
        return f, kind
    if kind.startswith("meta"):
        m = json.load(open(meta))
        if kind == "meta_layers":
            c = m["config"]
            n = int(pick(rng, [2, 4]))
            c["num_layers"] = n
            for k in ("layer_types", "compress_ratios", "mlp_layer_types"):
                c[k] = (c[k] * 2)[:n]
        elif kind == "meta_leaf":
            leaf = sorted(m["items"]["target"]["leaves"])[int(rng.integers(0, 10))]
            rec = m["items"]["target"]["leaves"][leaf]
            rec[pick(rng, ["shape", "format", "dtype", "checksum"])] = pick(rng, [[3], "fp8", "float16", "0" * 16])
        else:
            text = json.dumps(m)
            open(meta, "w").write(text[:int(rng.integers(0, len(text)))])
            return meta, "meta truncated"
        open(meta, "w").write(json.dumps(m))
        return meta, kind
    name = "_METADATA" if kind == "orbax_meta" else "manifest.ocdbt"
    f = next(f for f in files if f.endswith(os.sep + "target" + os.sep + "state" + os.sep + name)
             or (name == "_METADATA" and f.endswith(os.sep + name)))
    b = bytearray(open(f, "rb").read())
    if rng.random() < 0.5:
        b = b[:int(rng.integers(0, len(b)))]
    else:
        _flip(b, rng, 0, len(b))
    open(f, "wb").write(bytes(b))
    return f, f"{kind}"


# ---- the run ---------------------------------------------------------------------------------------------------

def test_fuzz_readers(sources, tmp_path):
    """Every family: no SILENT wrong load, no TRACEBACK, no HANG, no UNNAMED error; the summary is printed.
    (A BUDGET-second run, at least MIN_CASES per family; test_fuzz_readers_long runs the same seeded sequence
    for LONG_BUDGET seconds.)"""
    fuzz_readers(sources, tmp_path, BUDGET)


@pytest.mark.slow
def test_fuzz_readers_long(sources, tmp_path):
    """test_fuzz_readers for LONG_BUDGET seconds: the fast run's cases (the same seed: they come first), then
    more of each family."""
    fuzz_readers(sources, tmp_path, LONG_BUDGET)


def fuzz_readers(sources, tmp_path, budget: float):
    import time
    rng = np.random.default_rng(SEED)
    base = {"gguf": _gguf_units(sources / "m.gguf"), "hf": _hf_units(sources / "hf"),
            "ckpt": _ckpt_values(sources / "ckpt")}
    gguf_bytes = (sources / "m.gguf").read_bytes()
    st_path = sources / "hf" / "model-00001-of-00001.safetensors"
    st_bytes, cfg_text = st_path.read_bytes(), (sources / "hf" / "config.json").read_text()
    counts: dict = {}
    bad = []
    deadline = time.monotonic() + budget
    families = ["gguf", "safetensors", "config", "checkpoint"]
    done = {f: 0 for f in families}
    i = 0
    while min(done.values()) < MIN_CASES or time.monotonic() < deadline:
        fam = families[i % len(families)] if min(done.values()) < MIN_CASES else str(pick(rng, families))
        i += 1
        case = tmp_path / f"case{i}"
        case.mkdir()
        if fam == "gguf":
            p = case / "m.gguf"
            data, value_edit, what = gguf_mutation(rng, gguf_bytes, sources / "m.gguf")
            p.write_bytes(data)
            outcome, detail = run_case(_gguf_units, p, base["gguf"], str(p), value_edit)
        elif fam in ("safetensors", "config"):
            hf = case / "hf"
            shutil.copytree(sources / "hf", hf)
            if fam == "safetensors":
                data, value_edit, what = safetensors_mutation(rng, st_bytes)
                target = hf / st_path.name
            else:
                data, value_edit, what = config_mutation(rng, cfg_text)
                target = hf / "config.json"
            target.write_bytes(data)
            outcome, detail = run_case(_hf_units, hf, base["hf"], str(target), value_edit)
        else:
            ck = case / "ckpt"
            shutil.copytree(sources / "ckpt", ck)
            f, what = ckpt_mutation(rng, str(ck))
            outcome, detail = run_case(_ckpt_values, str(ck), base["ckpt"], str(ck), False)
        done[fam] += 1
        counts.setdefault(fam, {}).setdefault(outcome, 0)
        counts[fam][outcome] += 1
        if outcome in ("SILENT", "TRACEBACK", "HANG", "UNNAMED"):
            bad.append((fam, what, outcome, detail))
        shutil.rmtree(case, ignore_errors=True)
    print(f"\nfuzz seed {SEED}: " + "; ".join(f"{f}: {sum(c.values())} cases {dict(sorted(c.items()))}"
                                             for f, c in counts.items()))
    assert not bad, bad
    assert all(counts[f].get("error", 0) for f in families)     # the mutations did reach the checks


# ---- paths that must never lose data or block ---------------------------------------------------------------

def test_out_dir_apart_from_source(sources, tmp_path, capsys):
    """OUT_DIR equal to, inside, or containing SRC: refused even with --overwrite; SRC untouched."""
    src = tmp_path / "hf"
    shutil.copytree(sources / "hf", src)
    before = {p: (src / p).read_bytes() for p in os.listdir(src)}
    for out in (src, src / "sub", tmp_path):
        assert main(["hf", str(src), str(out), "--overwrite", "-q"]) == 2
        err = capsys.readouterr().err
        assert str(src) in err and "source" in err and "Traceback" not in err, err
        assert {p: (src / p).read_bytes() for p in os.listdir(src)} == before
        assert not (src / "sub").exists()
    assert main(["gguf", str(sources / "m.gguf"), str(sources), "--overwrite", "-q"]) == 2
    assert (sources / "m.gguf").exists()


def test_non_regular_sources_refused(sources, tmp_path, capsys):
    """A FIFO or a directory where a file is expected (and a file where a directory is): one message, exit 2,
    no blocking (the FIFO has no writer: opening it would hang)."""
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    (tmp_path / "adir").mkdir()
    hf_fifo = tmp_path / "hf"
    shutil.copytree(sources / "hf", hf_fifo)
    os.remove(hf_fifo / "config.json")
    os.mkfifo(hf_fifo / "config.json")
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(ALARM)
    try:
        for argv, needle in ((["gguf", str(fifo)], "FIFO"), (["gguf", str(tmp_path / "adir")], "not a regular file"),
                             (["hf", str(sources / "m.gguf")], "not a directory"),
                             (["hf", str(hf_fifo)], "not a regular file")):
            assert main(argv + [str(tmp_path / "out"), "-q"]) == 2
            err = capsys.readouterr().err
            assert needle in err and "Traceback" not in err, err
            assert not (tmp_path / "out").exists()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_drafter_failure_leaves_checkpoint_as_it_was(sources, tmp_path, capsys, monkeypatch):
    """`drafter` failing late (inside the Orbax write) leaves CKPT byte for byte as it was."""
    ck = tmp_path / "ckpt"
    shutil.copytree(sources / "ckpt", ck)

    def snapshot():
        return {os.path.relpath(os.path.join(dp, f), ck): open(os.path.join(dp, f), "rb").read()
                for dp, dirs, fs in os.walk(ck) for f in fs} | \
               {os.path.relpath(os.path.join(dp, x), ck) + "/": b"" for dp, dirs, _ in os.walk(ck) for x in dirs}
    before = snapshot()

    def failing_run(job, item_dir, *a, **k):
        """What Orbax leaves mid-write: the item directory and its `.partial_save` sibling, then an error."""
        os.makedirs(item_dir + ".partial_save")
        os.makedirs(os.path.join(item_dir, "state"))
        raise OSError("disk full (simulated)")
    monkeypatch.setattr(pipeline, "run_job", failing_run)
    job = pipeline.Job("mtp", None, [], 0, {"source": {"path": "x"}})
    monkeypatch.setattr(pipeline.Job, "check", lambda self: self)
    with pytest.raises(OSError, match="disk full"):
        pipeline.add_drafters(str(ck), [job], quiet=True)
    assert snapshot() == before
