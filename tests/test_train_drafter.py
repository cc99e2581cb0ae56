"""dsv4-train-drafter: bad input fails before any work, data / tokenizer handling, initialisations, the
checkpoint export, and (in an 8-device subprocess) the sharded step == the single-device step, the
cached-target step == the on-the-fly step, and an interrupted + resumed run == an uninterrupted one."""
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from dsv4_jax.model import params as P
from dsv4_jax.io.checkpoint import CheckpointConfig, load_checkpoint
from dsv4_jax.io.demo_io import save_bundle
from dsv4_jax.training import drafter_cli as CLI, drafter_export as X, drafter_tasks as T, drafter_train as DT
from dsv4_jax.training import text_data as TD

from . import drafter_fixtures as F
from .eight_devices import host_devices_flags

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@pytest.fixture(scope="module")
def cfg():
    return F.config()


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, cfg):
    """A 128-token-vocabulary target saved as a bundle (no drafters)."""
    path = str(tmp_path_factory.mktemp("bundle") / "model")
    save_bundle(path, cfg, F.target(cfg), {}, dtype=np.float32)
    return path


def _text(tmp_path, name="data.txt", text="def f(x):\n    return x + 1\n" * 200):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def _tokenizer_json(tmp_path, n: int, name="tokenizer.json") -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(n)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = str(tmp_path / name)
    tok.save(path)
    return path


def fails(capsys, argv, *needles):
    """Exit status 2, every needle in the message, and --out never created."""
    out = argv[argv.index("--out") + 1]
    existed = os.path.exists(out)
    before = sorted(os.listdir(out)) if existed else None
    try:
        rc = CLI.main(argv)
    except SystemExit as e:          # argparse's own errors
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, err
    for n in needles:
        assert n in err, (n, err)
    assert os.path.exists(out) == existed and (not existed or sorted(os.listdir(out)) == before)
    return err


def base(tmp_path, *extra, model="tiny-demo", drafter="dspark", data=None):
    return ["--model", model, "--drafter", drafter, "--data", data or _text(tmp_path), "--out",
            str(tmp_path / "out"), *extra]


# ---- bad input -----------------------------------------------------------------------------------------

def test_help_lists_one_example_per_drafter():
    text = CLI.build_parser().format_help()
    assert "--drafter dspark" in text and "--drafter mtp" in text and "--resume" in text and "--cache-targets" in text


def test_unknown_drafter(tmp_path, capsys):
    fails(capsys, base(tmp_path, drafter="eagle"), "invalid choice: 'eagle'")


def test_taps_the_target_does_not_have(tmp_path, capsys):
    fails(capsys, base(tmp_path, "--taps", "40,41,42"), "layers 0..6 only", "[40, 41, 42]")


def test_target_layers_init_needs_enough_layers(tmp_path, capsys, bundle):
    fails(capsys, base(tmp_path, "--init", "target-layers", "--stages", "3", "--tokenizer", "byte", model=bundle),
          "3 stages but the target has 2 layers")


def test_fine_tuning_needs_the_drafter(tmp_path, capsys, bundle):
    data = str(tmp_path / "d.npy")
    np.save(data, np.arange(1000) % 100)
    fails(capsys, base(tmp_path, "--init", "drafter", model=bundle, data=data), "has no DSpark drafter")
    fails(capsys, base(tmp_path, "--init", "drafter", model=bundle, data=data, drafter="mtp"), "has no MTP drafter")


def test_empty_data(tmp_path, capsys):
    fails(capsys, base(tmp_path, data=_text(tmp_path, text="")), "holds no tokens")


def test_malformed_jsonl_names_the_line(tmp_path, capsys):
    p = tmp_path / "c.jsonl"
    p.write_text('{"text": "fine"}\n{"text": broken\n')
    fails(capsys, base(tmp_path, data=str(p)), "c.jsonl:2", "not a JSON object")
    p.write_text('{"text": "fine"}\n{"body": "no text"}\n')
    fails(capsys, base(tmp_path, data=str(p)), "c.jsonl:2", "\"text\" field")


def test_bad_npy(tmp_path, capsys, bundle):
    p = str(tmp_path / "t.npy")
    np.save(p, np.array([1, 2, 500]))
    fails(capsys, base(tmp_path, model=bundle, data=p), "[0, 128)", "1..500")
    np.save(p, np.zeros((4, 4), np.float32))
    fails(capsys, base(tmp_path, model=bundle, data=p), "integer array")


def test_missing_and_unsupported_files(tmp_path, capsys):
    fails(capsys, base(tmp_path, data=str(tmp_path / "nope.txt")), "does not exist")
    p = tmp_path / "x.csv"
    p.write_text("a,b")
    fails(capsys, base(tmp_path, data=str(p)), "unsupported type")


def test_data_shorter_than_a_window(tmp_path, capsys):
    fails(capsys, base(tmp_path, "--seq-len", "4096", data=_text(tmp_path, text="x" * 3000)),
          "fewer than one window needs")


def test_tokenizer_vocabulary_must_match_the_model(tmp_path, capsys, bundle):
    small, big = _tokenizer_json(tmp_path, 50, "small.json"), _tokenizer_json(tmp_path, 300, "big.json")
    fails(capsys, base(tmp_path, "--tokenizer", small), "50 tokens for a model with 260", "not this model's")
    fails(capsys, base(tmp_path, "--tokenizer", big), "300 tokens, more than the model's vocabulary (260)")
    fails(capsys, base(tmp_path, model=bundle), "128 tokens and no tokenizer.json", "--tokenizer")
    fails(capsys, base(tmp_path, "--tokenizer", "byte", model=bundle), "byte tokenizer has 260 tokens", "128")
    fails(capsys, base(tmp_path, "--tokenizer", str(tmp_path / "none.json")), "no such file")


def test_tokenizer_not_installed(tmp_path, capsys, monkeypatch):
    path = _tokenizer_json(tmp_path, 250)
    monkeypatch.setitem(sys.modules, "tokenizers", None)         # import tokenizers -> ImportError
    fails(capsys, base(tmp_path, "--tokenizer", path), "pip install 'dsv4_jax[tokenizers]'")


def test_bad_options(tmp_path, capsys):
    fails(capsys, base(tmp_path, "--steps", "0"), "--steps must be >= 1")
    fails(capsys, base(tmp_path, "--mesh", "2x2x2"), "needs 8 devices")
    fails(capsys, base(tmp_path, "--mesh", "8"), "DATAxEXPERTxMODEL")
    fails(capsys, base(tmp_path, "--seq-len", "8"), "needs at least")
    fails(capsys, base(tmp_path, "--noise-token-id", "999"), "outside the vocabulary")
    fails(capsys, base(tmp_path, "--cache-targets", "--target-cache", str(tmp_path)), "not both")
    fails(capsys, base(tmp_path, model=str(tmp_path / "missing")), "not a directory")


def test_existing_run_needs_resume_with_the_same_options(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "other.txt").write_text("x")
    fails(capsys, base(tmp_path), "not a dsv4-train-drafter run")
    (out / "other.txt").unlink()
    a = CLI.build_parser().parse_args(base(tmp_path))
    plan = CLI.prepare(a)
    CLI._write_json(str(out / "run.json"), plan.record)
    fails(capsys, base(tmp_path), "pass --resume")
    fails(capsys, base(tmp_path, "--resume", "--lr", "1e-4"), "other hyper settings")
    assert CLI.prepare(CLI.build_parser().parse_args(base(tmp_path, "--resume"))).resume


def test_write_into_another_models_checkpoint(tmp_path, capsys, cfg):
    ckpt = str(tmp_path / "other")
    other = cfg.replace(hidden_size=32)
    X.export_copy(ckpt, kind="mtp", drafter=T.init_drafter(T.MTPTask(), other, "scratch", 0),
                  specs=P.mtp_specs(other), record=X.drafter_record("mtp", T.MTPTask(), {}, np.float32),
                  dtype=np.float32, source_units={"target": {"record": {}, "units": X.target_units(
                      F.target(other), other, np.float32)}},
                  source_meta={"format_version": 1, "config": other.to_dict(), "source": {},
                               "conversion": X.conversion_meta(np.float32)})
    before = open(os.path.join(ckpt, "dsv4.json")).read()
    fails(capsys, base(tmp_path, "--write-into", ckpt), "its model config differs")
    assert open(os.path.join(ckpt, "dsv4.json")).read() == before


def test_target_cache_of_another_run(tmp_path, capsys):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "manifest.json").write_text(json.dumps({"format": 1, "model": "elsewhere", "drafter": "dspark"}))
    fails(capsys, base(tmp_path, "--target-cache", str(cache)), "model is 'elsewhere'")


# ---- data, windows, schedules, initialisation -----------------------------------------------------------

def test_windows_depend_on_seed_and_step_only():
    a = TD.window_starts(10_000, 64, 8, seed=3, step=5)
    assert np.array_equal(a, TD.window_starts(10_000, 64, 8, seed=3, step=5))
    assert not np.array_equal(a, TD.window_starts(10_000, 64, 8, seed=3, step=6))
    assert not np.array_equal(a, TD.window_starts(10_000, 64, 8, seed=4, step=5))
    assert a.min() >= 0 and a.max() <= 10_000 - 64


def test_corpus_documents_and_heldout_split(tmp_path, cfg):
    docs = [{"text": " ".join(f"w{(i * 7 + j) % 120}" for j in range(40))} for i in range(200)]
    p = tmp_path / "c.jsonl"
    p.write_text("\n".join(json.dumps(d) for d in docs) + "\n\n")
    tok = TD.hf_tokenizer(_tokenizer_json(tmp_path, 120))
    TD.check_tokenizer(tok, cfg)                                    # 120 of 128 rows: accepted
    c = TD.build_corpus([str(p)], tok, cfg, heldout_frac=0.1, min_train=65, min_heldout=65)
    assert c.info["documents"] == 200 and c.info["heldout_split"].startswith("documents")
    n_held = sum(TD.is_heldout(f"c.jsonl:{i}", 0.1) for i in range(200))
    assert cfg.bos_token_id is not None                              # each document: [BOS] + 40 words
    assert 0 < n_held < 200 and len(c.heldout) == 41 * n_held and len(c.train) == 41 * (200 - n_held)
    assert c.train.dtype == np.int32 and c.train.max() < 120 and c.train[0] == cfg.bos_token_id
    # one long document: the stream's tail is held out instead
    one = _text(tmp_path, text="w1 w2 w3 " * 300)
    c = TD.build_corpus([one], tok, cfg, heldout_frac=0.1, min_train=65, min_heldout=100)
    assert c.info["heldout_split"].startswith("stream tail") and len(c.heldout) == 100 and len(c.train) == 801
    # pre-tokenized rows are documents
    np.save(tmp_path / "r.npy", np.arange(60).reshape(3, 20))
    assert [d.tolist() for d in TD.documents(str(tmp_path / "r.npy"), None, 128)][1] == list(range(20, 40))


def test_schedules():
    h = DT.Hyper(steps=100, batch=1, seq_len=8, lr=1.0, warmup=10, min_lr_ratio=0.1)
    for name in DT.SCHEDULES:
        f = DT.lr_schedule(DT.Hyper(**{**h.__dict__, "schedule": name}))
        assert float(f(0)) == 0.0 and float(f(5)) == pytest.approx(0.5) and float(f(10)) == pytest.approx(1.0)
        end = float(f(100))
        assert end == pytest.approx({"cosine": 0.1, "linear": 0.1, "constant": 1.0}[name], abs=1e-6)
    with pytest.raises(ValueError):
        DT.Hyper(steps=1, batch=1, seq_len=8, schedule="exp")


def test_target_layers_init_copies_the_shared_leaves(cfg):
    target = F.target(cfg)
    task = T.DSparkTask(F.dspark_task(cfg).dcfg, n_stages=2, markov_rank=8)
    dp = T.init_drafter(task, cfg, "target-layers", 3, target=target)
    scratch = T.init_drafter(task, cfg, "scratch", 3)
    for s in range(2):
        layer = P.flatten(T.layer_params(target, cfg, s))                 # stage s <- layer L - 2 + s
        stage = P.flatten(dp["stages"][s])
        for k in ("attn.wq_a", "attn.wkv", "attn.attn_sink", "hc_attn.fn", "ffn.experts.w1", "ffn.gate.weight",
                  "ffn_norm"):
            np.testing.assert_array_equal(stage[k], layer[k])
    np.testing.assert_array_equal(dp["hc_head"]["fn"], target["hc_head"]["fn"])
    np.testing.assert_array_equal(dp["norm"], target["norm"])
    np.testing.assert_array_equal(dp["main_proj"], scratch["main_proj"])    # no counterpart: the fresh init
    mtp = T.init_drafter(T.MTPTask(), cfg, "target-layers", 3, target=target)
    np.testing.assert_array_equal(mtp["attn"]["wq_b"], T.layer_params(target, cfg, 1)["attn"]["wq_b"])
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(mtp))


# ---- export --------------------------------------------------------------------------------------------

def _in_memory_source(cfg, target, dtype=np.float32):
    return dict(source_units={"target": {"record": {"source": {"kind": "test"}},
                                         "units": X.target_units(target, cfg, dtype)}},
                source_meta={"format_version": 1, "config": cfg.to_dict(), "source": {"kind": "test"},
                             "conversion": X.conversion_meta(dtype)})


def test_export_copy_and_write_into_round_trip(tmp_path, cfg, monkeypatch):
    target = F.target(cfg)
    task = F.dspark_task(cfg)
    dp = T.init_drafter(task, cfg, "scratch", 5)
    specs = T.drafter_specs(task, cfg)
    first = str(tmp_path / "first")
    X.export_copy(first, kind="dspark", drafter=dp, specs=specs, dtype=np.float32,
                  record=X.drafter_record("dspark", task, {"kind": "test"}, np.float32),
                  **_in_memory_source(cfg, target))
    c, params = load_checkpoint(first, dtype=np.float32)
    assert isinstance(c, CheckpointConfig) and c.target == cfg and c.mtp_layers == 0
    assert (c.dspark.n_stages, c.dspark.n_taps, c.dspark.markov_rank, c.dspark.block_size,
            c.dspark.target_layer_ids) == (1, 2, 8, 3, (0, 1))
    for a, b in zip(jax.tree.leaves(params["dspark"]), jax.tree.leaves(dp)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves({k: v for k, v in params.items() if k != "dspark"}), jax.tree.leaves(target)):
        np.testing.assert_array_equal(a, b)

    # a copy of a converted checkpoint: other items hard-linked, the new MTP item added, bf16 storage
    mtp = T.init_drafter(T.MTPTask(), cfg, "scratch", 6)
    second = str(tmp_path / "second")
    X.export_copy(second, kind="mtp", drafter=mtp, specs=P.mtp_specs(cfg), dtype=jax.numpy.bfloat16,
                  record=X.drafter_record("mtp", T.MTPTask(), {}, jax.numpy.bfloat16), source_checkpoint=first)
    c2, p2 = load_checkpoint(second, dtype=np.float32)
    assert c2.mtp_layers == 1 and c2.dspark is not None
    np.testing.assert_array_equal(p2["mtp"][0]["e_proj"], np.asarray(mtp["e_proj"]).astype(jax.numpy.bfloat16))
    np.testing.assert_array_equal(p2["mtp"][0]["enorm"], mtp["enorm"])          # f32 leaves stay f32
    f1 = next(os.path.join(d, f) for d, _, fs in os.walk(os.path.join(first, "target")) for f in fs)
    assert os.stat(f1).st_ino == os.stat(f1.replace(first, second)).st_ino      # shared, not copied

    # --write-into replaces the item in place; a failing write leaves the checkpoint as it was
    dp2 = jax.tree.map(lambda x: x + 1.0, dp)
    X.export_into(first, kind="dspark", drafter=dp2, specs=specs, dtype=np.float32, config=cfg,
                  record=X.drafter_record("dspark", task, {"kind": "test2"}, np.float32))
    _, p3 = load_checkpoint(first, dtype=np.float32)
    np.testing.assert_array_equal(p3["dspark"]["main_proj"], dp2["main_proj"])
    assert sorted(os.listdir(first)) == ["dspark", "dsv4.json", "target"]
    _, p2 = load_checkpoint(second, dtype=np.float32)                 # the copy linked the old files: intact
    np.testing.assert_array_equal(p2["dspark"]["main_proj"], dp["main_proj"])
    before = open(os.path.join(first, "dsv4.json")).read()

    def broken(item_dir, units):
        os.makedirs(item_dir)
        raise OSError("disk full")
    monkeypatch.setattr(X, "write_item", broken)
    with pytest.raises(OSError):
        X.export_into(first, kind="dspark", drafter=dp, specs=specs, dtype=np.float32, config=cfg,
                      record=X.drafter_record("dspark", task, {}, np.float32))
    assert open(os.path.join(first, "dsv4.json")).read() == before
    assert sorted(os.listdir(first)) == ["dspark", "dsv4.json", "target"]
    with pytest.raises(OSError):
        X.export_copy(str(tmp_path / "third"), kind="dspark", drafter=dp, specs=specs, dtype=np.float32,
                      record={}, source_checkpoint=first)
    assert not any(n.startswith("third") for n in os.listdir(tmp_path))


# ---- sharded / cached / resumed training (8 forced host devices, subprocess) ------------------------------

@pytest.fixture(scope="module")
def checks():
    env = dict(os.environ, XLA_FLAGS=host_devices_flags(8), JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, os.path.join(HERE, "train_drafter_checks.py")], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=1500)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert r.returncode == 0 and line, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(line[len("RESULT "):])


# DSpark's first stage sees identical input streams (the embedding copied to every stream, docs/drafter_math.md §2.3),
# so its comb matrix C (doubly stochastic) gives C^T X = X whatever C is: those hc_attn parameters get an
# exactly-zero gradient, computed as float noise. Adam turns noise into steps of up to ~lr, so there the two
# runs can differ by up to steps x lr; every other leaf (and every optimizer moment) must agree to float
# tolerance.
NOISE_ONLY = ("stages.0.hc_attn.",)


def _assert_params_close(diffs: dict, r: dict, tol: float = 2e-5):
    for k, v in diffs.items():
        bound = r["steps"] * r["lr"] * 1.01 if k.startswith(NOISE_ONLY) else tol
        assert v <= bound, (k, v)


@pytest.mark.parametrize("kind", ["mtp", "dspark"])
def test_sharded_step_equals_single_device_step(checks, kind):
    r = checks[kind]
    assert checks["devices"] == 8 and checks["mesh"] == [2, 2, 2]
    assert r["split_params"] > 0 and r["split_opt"] == 2 * r["split_params"] and r["split_target"] > 0
    assert r["moved"] > 1e-3                                          # the steps changed the weights
    assert r["loss_diff"] <= 1e-5 and r["opt_diff"] <= 1e-6
    _assert_params_close(r["params_diff"], r)


def test_training_from_the_target_cache_equals_on_the_fly(checks):
    r = checks["dspark"]
    assert r["cache_tokens_match"] and r["cached_loss_diff"] <= 1e-5 and r["cached_opt_diff"] <= 1e-6
    _assert_params_close(r["cached_params_diff"], r)


def test_interrupted_run_resumes_to_the_same_result(checks):
    r = checks["mtp"]
    assert r["interrupted"] and r["checkpoint_step_after_interrupt"] == 2
    assert r["resumed_from"] == 2 and r["resumed_steps_run"] == 2 and r["resume_moved"] > 1e-3
    assert max(r["resume_diff"].values()) == 0.0                       # bit-identical on one device


# ---- the command end to end (slow: compiles the step, the held-out loss and the speculative loop) ---------

@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["mtp", "dspark"])
def test_cli_end_to_end(tmp_path, bundle, cfg, drafter):
    data = str(tmp_path / "tokens.npy")
    np.save(data, np.random.default_rng(0).integers(0, 127, 6000))
    out = str(tmp_path / "run")
    argv = ["--model", bundle, "--drafter", drafter, "--data", data, "--out", out, "--steps", "3", "--batch", "2",
            "--seq-len", "16", "--save-every", "2", "--eval-every", "2", "--eval-prompts", "2", "--eval-prompt-len",
            "8", "--eval-new-tokens", "6", "--dtype", "float32", "--quiet", "--stages", "1", "--markov-rank", "8",
            "--block-size", "3", "--anchors", "2", "--init", "target-layers"]
    assert CLI.main(argv) == 0
    s = json.load(open(os.path.join(out, "summary.json")))
    assert s["eval_final"]["step"] == 3 and s["eval_final"]["spec"]["lossless"]
    assert [json.loads(ln)["step"] for ln in open(os.path.join(out, "eval.jsonl"))] == [0, 2, 3]
    assert [json.loads(ln)["step"] for ln in open(os.path.join(out, "metrics.jsonl"))] == [1, 2, 3]
    assert all(os.path.exists(p) for p in s["plots"])
    c, params = load_checkpoint(os.path.join(out, "checkpoint"), dtype=np.float32)
    assert (c.mtp_layers == 1) == (drafter == "mtp") and (c.dspark is not None) == (drafter == "dspark")
    assert c.target == cfg
    # a finished run resumed with the same options does no step again and keeps its records
    assert CLI.main(argv + ["--resume"]) == 0
    assert [json.loads(ln)["step"] for ln in open(os.path.join(out, "metrics.jsonl"))] == [1, 2, 3]
    assert json.load(open(os.path.join(out, "summary.json")))["timings"]["steps_run"] == 0
