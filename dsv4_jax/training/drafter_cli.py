"""`dsv4-train-drafter`: train an MTP or DSpark drafter against a frozen target (any checkpoint it loads).

Every check runs before any work (options, data files and their format, the model's metadata, the
tokenizer against the model's vocabulary, the DSpark taps against the target's layers, the output
directory, a target cache): bad input exits with status 2 and a message, and nothing is written.

Output directory (--out):
    run.json          the options of the run (a resumed run must match them)
    ckpt/             Orbax CheckpointManager: {params (f32), opt, step}, newest --keep kept
    metrics.jsonl     one line per step: loss, grad_norm, lr, per-position acceptance (teacher forced), step_s
    eval.jsonl        one line per evaluation: held-out loss and the real speculative loop's acceptance
    target_cache/     with --cache-targets: the target states of every training window
    plots/            loss.png, acceptance.png
    summary.json      timings, the initial / final / baseline evaluations, where the drafter was written
    checkpoint/       the model with the trained drafter (unless --write-into or --no-export)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .. import cli, parallel
from ..cli import OptionError
from ..demo import ByteTokenizer
from ..drafters.dspark import DSparkConfig
from ..ops.host import to_host
from . import drafter_export as X, drafter_tasks as T, drafter_train as DT, target_cache as TC
from . import target_source as TS, text_data as TD
from ..research.report import plot_reliability
from .plots import plot_run
from .speculative_eval import SpeculativeEval

EXAMPLES = """examples:
  # the bundled tiny model, byte tokenizer, a few CPU minutes (the stdlib corpus as training text)
  dsv4-train-drafter --model tiny-demo --drafter dspark --data /usr/lib/python3.11 --out runs/dspark \\
      --steps 300 --batch 8 --seq-len 128 --dtype float32 --eval-every 100
  dsv4-train-drafter --model tiny-demo --drafter mtp --data corpus.jsonl --out runs/mtp --steps 300

  # a converted checkpoint on a mesh (data 2 x expert 4 x model 1), bf16 compute, accumulated batches
  dsv4-train-drafter --model /ckpt/dsv4-flash --drafter dspark --data shards/ --tokenizer /hf/tokenizer.json \\
      --out runs/flash-dspark --mesh 2x4x1 --batch 16 --grad-accum 4 --seq-len 2048 --steps 20000 \\
      --init target-layers --eval-dtype bfloat16 --write-into /ckpt/dsv4-flash

  # resume after an interruption (same options), or fine-tune the model's own drafter
  dsv4-train-drafter ... --out runs/flash-dspark --resume
  dsv4-train-drafter --model /ckpt/dsv4-flash --drafter dspark --init drafter --lr 2e-4 ...

  # precompute the target's states once, then train from them (several epochs or hyper-parameter sweeps)
  dsv4-train-drafter ... --cache-targets                    # writes OUT/target_cache, trains from it
  dsv4-train-drafter ... --target-cache runs/a/target_cache # reuses it
"""

DTYPES = {"bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16, "float32": jnp.float32, "f32": jnp.float32}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dsv4-train-drafter", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES,
        fromfile_prefix_chars="@",
        description="Train an MTP or DSpark drafter for a frozen DeepSeek-V4 target: JAX, sharded over a mesh, "
                    "resumable, with a held-out evaluation in the real speculative loop; the drafter is written "
                    "into a checkpoint that load_checkpoint reads.")
    g = p.add_argument_group("what to train")
    g.add_argument("--model", required=True, metavar="CKPT",
                   help="a dsv4-convert checkpoint, a bundle directory, or 'tiny-demo' (the bundled tiny model)")
    g.add_argument("--drafter", required=True, choices=("mtp", "dspark"))
    g.add_argument("--init", choices=T.INITS, default="scratch",
                   help="scratch (random), drafter (fine-tune the model's own drafter), target-layers (drafter "
                        "blocks copied from the target's last layers, hc_head and norm from the target's); "
                        "default scratch")
    g.add_argument("--data", required=True, nargs="+", metavar="FILE",
                   help=".txt / .jsonl (a 'text' field per line) / pre-tokenized .npy files, or directories of them")
    g.add_argument("--heldout-data", nargs="+", metavar="FILE", help="held-out files (default: a share of --data)")
    g.add_argument("--heldout-frac", type=float, default=0.05, help="held-out share of the documents (default 0.05)")
    g.add_argument("--tokenizer", metavar="PATH",
                   help="tokenizer.json (needs the `tokenizers` extra) or 'byte'; default: MODEL/tokenizer.json, "
                        "or bytes for a byte-vocabulary model")
    o = p.add_argument_group("optimisation")
    o.add_argument("--steps", type=int, default=300)
    o.add_argument("--batch", type=int, default=8, help="sequences per micro-batch (default 8)")
    o.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (default 1)")
    o.add_argument("--seq-len", type=int, default=128, help="tokens per training sequence (default 128)")
    o.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default 2e-3)")
    o.add_argument("--schedule", choices=DT.SCHEDULES, default="cosine",
                   help="after the warm-up: cosine or linear decay to lr x --min-lr-ratio, or constant")
    o.add_argument("--warmup", type=int, default=30, help="linear warm-up steps (default 30)")
    o.add_argument("--min-lr-ratio", type=float, default=0.1)
    o.add_argument("--weight-decay", type=float, default=0.01)
    o.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip (default 1)")
    o.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="compute dtype of the target and the drafter (master weights stay float32); default bf16")
    o.add_argument("--seed", type=int, default=0, help="windows, anchors and the initial weights (default 0)")
    cli.add_mesh(o, auto=True, default="auto",
                 help="data x expert x model device mesh, e.g. 2x4x1 (default: every device on 'expert')")
    d = p.add_argument_group("DSpark (defaults: the model's own DSpark drafter, else the released Flash shape)")
    d.add_argument("--taps", metavar="L1,L2,..", help="target layers whose HC-stream means feed the drafter "
                                                     "(default: the last 3)")
    d.add_argument("--stages", type=int, help="draft blocks (default 3)")
    d.add_argument("--markov-rank", type=int, help="rank of the Markov head (default 256)")
    d.add_argument("--block-size", type=int, help="drafts per round (default 5)")
    d.add_argument("--noise-token-id", type=int, help="the block's filler token (default: byte NOISE, else V-1)")
    d.add_argument("--conf-bias", action="store_true", help="give the confidence head a bias (released: none)")
    d.add_argument("--anchors", type=int, default=8, help="blocks per training sequence (default 8)")
    d.add_argument("--decay", type=float, default=4.0, help="position weight exp(-j/decay) (default 4)")
    d.add_argument("--w-tv", type=float, default=1.0, help="weight of the TV term (default 1)")
    d.add_argument("--w-conf", type=float, default=0.2, help="weight of the confidence BCE (default 0.2)")
    c = p.add_argument_group("target states")
    c.add_argument("--cache-targets", action="store_true",
                   help="first compute the target's states for every training window into OUT/target_cache, "
                        "then train from it (default: computed in the training step)")
    c.add_argument("--target-cache", metavar="DIR", help="train from an existing cache (checked against this run)")
    c.add_argument("--cache-windows", type=int, metavar="N",
                   help="windows in a new cache (default: every window of the run; fewer = epochs over them)")
    e = p.add_argument_group("evaluation (greedy, the real speculative loop on held-out prompts)")
    e.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (default 0: start and end)")
    e.add_argument("--no-eval", action="store_true",
                   help="skip the speculative loop (the held-out loss is still measured at start and end)")
    e.add_argument("--eval-prompts", type=int, default=16)
    e.add_argument("--eval-prompt-len", type=int, default=64)
    e.add_argument("--eval-new-tokens", type=int, default=128)
    e.add_argument("--eval-k", type=int, default=5, help="draft_n_max (DSpark: at most its block size; default 5)")
    e.add_argument("--eval-seed", type=int, default=0,
                   help="chooses the held-out prompts and windows (default 0; fixed across training seeds)")
    e.add_argument("--eval-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="float32 (exact greedy losslessness) or bfloat16 (half the memory for big targets; bf16 "
                        "verify blocks and decode steps round differently, so a near-tie can flip a token)")
    w = p.add_argument_group("output")
    cli.add_out_dir(w, help="the run directory (above); missing or empty, or a run to --resume", overwrite=False)
    w.add_argument("--resume", action="store_true", help="continue the run in --out (same options)")
    w.add_argument("--save-every", type=int, default=100, help="checkpoint every N steps (default 100)")
    w.add_argument("--keep", type=int, default=2, help="checkpoints kept (default 2)")
    w.add_argument("--write-into", metavar="CKPT",
                   help="add / replace the drafter in this checkpoint (same target) instead of writing "
                        "OUT/checkpoint")
    w.add_argument("--no-export", action="store_true", help="write no checkpoint with the drafter")
    w.add_argument("--save-dtype", choices=("bfloat16", "float32"),
                   help="dtype of the written drafter weights (default: the checkpoint's, bf16 for bundles)")
    w.add_argument("--no-plots", action="store_true")
    cli.add_quiet(w, "no progress bars")
    return p


# ---- checks --------------------------------------------------------------------------------------------

def check_options(a) -> None:
    for name in ("steps", "batch", "grad_accum", "seq_len", "anchors", "save_every", "keep", "eval_prompts",
                 "eval_prompt_len", "eval_new_tokens", "eval_k"):
        if getattr(a, name) < 1:
            raise OptionError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    for name in ("seed", "eval_seed", "warmup", "eval_every", "weight_decay", "min_lr_ratio", "clip", "w_tv", "w_conf"):
        if getattr(a, name) < 0:
            raise OptionError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(a, name)}")
    if a.lr <= 0 or a.decay <= 0:
        raise OptionError(f"--lr and --decay must be > 0 (got {a.lr}, {a.decay})")
    if not 0 < a.heldout_frac <= 0.5:
        raise OptionError(f"--heldout-frac must be in (0, 0.5], got {a.heldout_frac}")
    for name in ("stages", "markov_rank", "block_size", "cache_windows"):
        v = getattr(a, name)
        if v is not None and v < 1:
            raise OptionError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if a.cache_targets and a.target_cache:
        raise OptionError("give --cache-targets (write a new cache) or --target-cache DIR (use one), not both")
    if a.write_into and a.no_export:
        raise OptionError("--write-into and --no-export exclude each other")


def parse_mesh(shape: tuple[int, ...] | str):
    """None (one device, no mesh) or the Mesh of --mesh: data x expert x model sizes, or 'auto' (every device on
    'expert')."""
    mesh = cli.device_mesh(shape)
    return None if jax.device_count() == 1 else mesh


def make_task(a, src: TS.TargetSource):
    """The drafter task from the options and the model (its own drafter's shape as defaults)."""
    config = src.config
    if a.drafter == "mtp":
        if a.init == "drafter" and not src.has_mtp:
            raise OptionError(f"--init drafter: {src.spec} has no MTP drafter to fine-tune")
        return T.MTPTask()
    own = src.dspark
    if a.init == "drafter":
        if own is None:
            raise OptionError(f"--init drafter: {src.spec} has no DSpark drafter to fine-tune")
        for name, mine in (("taps", own.dcfg.target_layer_ids), ("stages", own.n_stages),
                           ("markov_rank", own.markov_rank)):
            given = getattr(a, name)
            if given is not None and (cli.int_tuple(given, "--taps") if name == "taps" else given) != mine:
                raise OptionError(f"--init drafter: --{name.replace('_', '-')} {given} differs from the model's "
                                  f"DSpark drafter ({mine})")
    n = config.num_layers
    taps = cli.int_tuple(a.taps, "--taps") if a.taps else own.dcfg.target_layer_ids if own else \
        tuple(range(max(n - 3, 0), n))
    bad = [t for t in taps if not 0 <= t < n]
    if bad:
        raise OptionError(f"--taps {','.join(map(str, taps))}: the target has layers 0..{n - 1} only; "
                          f"layer(s) {bad} do not exist")
    if len(set(taps)) != len(taps):
        raise OptionError(f"--taps {taps}: a layer is given twice")
    stages = a.stages or (own.n_stages if own else 3)
    if a.init == "target-layers" and stages > n:
        raise OptionError(f"--init target-layers: {stages} stages but the target has {n} layers")
    conf_bias = own.conf_bias if a.init == "drafter" else a.conf_bias
    byte = config.vocab_size == ByteTokenizer.vocab_size
    noise = a.noise_token_id if a.noise_token_id is not None else own.dcfg.noise_token_id if own else \
        ByteTokenizer.NOISE if byte else config.vocab_size - 1
    if not 0 <= noise < config.vocab_size:
        raise OptionError(f"--noise-token-id {noise} is outside the vocabulary (0..{config.vocab_size - 1})")
    block = a.block_size or (own.dcfg.block_size if own else 5)
    dcfg = DSparkConfig(block_size=block, noise_token_id=noise, target_layer_ids=tuple(taps))
    rank = a.markov_rank or (own.markov_rank if own else 256)
    return T.DSparkTask(dcfg, n_stages=stages, markov_rank=rank, conf_bias=conf_bias, anchors=a.anchors,
                        decay=a.decay, w_tv=a.w_tv, w_conf=a.w_conf)


def hyper_of(a) -> DT.Hyper:
    return DT.Hyper(steps=a.steps, batch=a.batch, seq_len=a.seq_len, grad_accum=a.grad_accum, lr=a.lr,
                    schedule=a.schedule, warmup=a.warmup, min_lr_ratio=a.min_lr_ratio,
                    weight_decay=a.weight_decay, clip=a.clip, seed=a.seed, compute_dtype=a.dtype)


# what a resumed run must share with the run it continues
RUN_IDENTITY = ("model_fingerprint", "drafter", "init", "task", "hyper", "data", "target_cache")


def run_record(a, src, task, hyper, files, heldout_files, cache_dir) -> dict:
    return {"tool": "dsv4-train-drafter", "model": src.spec, "model_fingerprint": src.fingerprint,
            "drafter": a.drafter, "init": a.init, "task": _task_dict(task), "hyper": dataclasses.asdict(hyper),
            "data": {"files": [os.path.abspath(f) for f in files],
                     "heldout": None if heldout_files is None else [os.path.abspath(f) for f in heldout_files],
                     "heldout_frac": a.heldout_frac, "tokenizer": a.tokenizer},
            "target_cache": None if cache_dir is None else os.path.abspath(cache_dir)}


def _task_dict(task) -> dict:
    if task.kind == "mtp":
        return {"kind": "mtp"}
    d = dataclasses.asdict(task)
    d["dcfg"]["target_layer_ids"] = list(d["dcfg"]["target_layer_ids"])
    return dict(d, kind="dspark")


def check_out(a, record: dict) -> bool:
    """True when --out holds a run to continue (--resume with matching options). OptionError otherwise."""
    run_json = os.path.join(a.out, "run.json")
    if not os.path.exists(a.out) or not os.listdir(a.out):
        return False
    if not os.path.exists(run_json):
        raise OptionError(f"--out {a.out} exists and is not a dsv4-train-drafter run directory")
    if not a.resume:
        raise OptionError(f"--out {a.out} already holds a run: pass --resume to continue it, or choose another --out")
    with open(run_json) as f:
        old = json.load(f)
    for k in RUN_IDENTITY:
        if json.dumps(old.get(k), sort_keys=True) != json.dumps(record.get(k), sort_keys=True):
            raise OptionError(f"--resume: the run in {a.out} was started with other {k} settings "
                              f"({json.dumps(old.get(k), sort_keys=True)[:300]})")
    return True


@dataclasses.dataclass
class Plan:
    """Everything checked and resolved before any work."""

    args: argparse.Namespace
    src: TS.TargetSource
    task: T.Task
    hyper: DT.Hyper
    mesh: object
    corpus: TD.Corpus
    record: dict
    resume: bool
    cache_dir: str | None
    cache_manifest: dict | None
    save_dtype: str
    tokenize_s: float


def prepare(a) -> Plan:
    """All checks, in order of cost; raises OptionError / DataError / ModelError / CacheError / ExportError."""
    check_options(a)
    files = TD.expand_paths(a.data)
    heldout_files = TD.expand_paths(a.heldout_data) if a.heldout_data else None
    src = TS.describe(a.model)
    config = src.config
    mesh = parse_mesh(a.mesh)
    task = make_task(a, src)
    if a.seq_len < T.min_seq_len(task):
        raise OptionError(f"--seq-len {a.seq_len}: the {a.drafter} objective needs at least {T.min_seq_len(task)}")
    all_files = files + (heldout_files or [])
    tok = None
    if TD.needs_tokenizer(all_files):
        tok = TD.resolve_tokenizer(a.tokenizer, None if src.kind == "tiny-demo" else src.path, config)
        TD.check_tokenizer(tok, config)
    hyper = hyper_of(a)
    cache_dir = a.target_cache or (os.path.join(a.out, "target_cache") if a.cache_targets else None)
    record = run_record(a, src, task, hyper, files, heldout_files, cache_dir)
    resume = check_out(a, record)
    manifest = None
    if a.target_cache:
        manifest = TC.read_manifest(a.target_cache)
        if manifest is None:
            raise TC.CacheError(f"--target-cache {a.target_cache}: not a target cache (no {TC.MANIFEST})")
        TC.check(manifest, TC.describe(task, config, DTYPES[a.dtype], a.seq_len, src.fingerprint), a.target_cache)
    if a.write_into:
        X.check_target(a.write_into, config)
    t0 = time.perf_counter()
    min_held = max(a.eval_prompt_len + 1, a.seq_len + 1)
    corpus = TD.build_corpus(files, tok, config, heldout_files=heldout_files, heldout_frac=a.heldout_frac,
                             min_train=a.seq_len + 1, min_heldout=min_held)
    save_dtype = a.save_dtype or (src.stored_dtype if src.is_checkpoint else "bfloat16")
    return Plan(a, src, task, hyper, mesh, corpus, record, resume, cache_dir, manifest, save_dtype,
                time.perf_counter() - t0)


# ---- the run -------------------------------------------------------------------------------------------

def _write_json(path: str, obj) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def _append_jsonl(path: str, rec: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


def _read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(ln) for ln in f if ln.strip()]


class Batches:
    """batch(step) -> host batch dict: windows of the training stream, or rows of a target cache."""

    def __init__(self, plan: Plan, cache: TC.Reader | None):
        self.plan, self.cache = plan, cache

    def windows(self, step: int) -> np.ndarray:
        h = self.plan.hyper
        starts = TD.window_starts(len(self.plan.corpus.train), h.seq_len, h.grad_accum * h.batch, h.seed, step)
        return TD.windows(self.plan.corpus.train, starts, h.seq_len)

    def __call__(self, step: int) -> dict:
        h, task = self.plan.hyper, self.plan.task
        if self.cache is not None:
            out = self.cache.batch(step, h.grad_accum, h.batch)
        else:
            out = {"tokens": self.windows(step).reshape(h.grad_accum, h.batch, h.seq_len)}
        anchors = T.anchors_for(task, h.seq_len, (h.grad_accum, h.batch), h.seed, step)
        if anchors is not None:
            out["anchors"] = anchors
        return out


HELDOUT_STEP = 2 ** 31 - 1     # the (seed, step) stream of the held-out windows: never a training step


def heldout_batch(plan: Plan) -> dict:
    """Fixed held-out windows in the training batch layout [1, B, L] (for the held-out loss)."""
    h = plan.hyper
    seed = plan.args.eval_seed
    starts = TD.window_starts(len(plan.corpus.heldout), h.seq_len, h.batch, seed, HELDOUT_STEP)
    out = {"tokens": TD.windows(plan.corpus.heldout, starts, h.seq_len)[None]}
    anchors = T.anchors_for(plan.task, h.seq_len, (1, h.batch), seed, HELDOUT_STEP)
    if anchors is not None:
        out["anchors"] = anchors
    return out


def build_cache(plan: Plan, target: dict) -> dict:
    """The --cache-targets pass (reused when OUT/target_cache already matches this run)."""
    a, h, task, config = plan.args, plan.hyper, plan.task, plan.src.config
    want = TC.describe(task, config, DTYPES[a.dtype], h.seq_len, plan.src.fingerprint)
    per_step = h.grad_accum * h.batch
    rows = a.cache_windows or h.steps * per_step
    n_steps = -(-rows // per_step)
    old = TC.read_manifest(plan.cache_dir)
    if old is not None:
        TC.check(old, dict(want, rows=n_steps * per_step), plan.cache_dir)
        return old
    batches = Batches(plan, None)
    from tqdm.auto import tqdm
    bar = tqdm(total=n_steps, desc="target cache", disable=True if a.quiet else None, dynamic_ncols=True)
    place = (lambda x: jnp.asarray(x)) if plan.mesh is None else \
        (lambda x: DT.place_batch({"t": x[None]}, plan.mesh)["t"][0])
    try:
        return TC.write(plan.cache_dir, task, config, target, DTYPES[a.dtype], fingerprint=plan.src.fingerprint,
                        window_fn=batches.windows, n_steps=n_steps, per_step=per_step, seq_len=h.seq_len,
                        place=place, progress=lambda s: bar.update(1))
    finally:
        bar.close()


class HeldOut:
    """The evaluation of a drafter: the objective on fixed held-out windows and (unless --no-eval) the real
    speculative loop on held-out prompts (spec_eval.SpeculativeEval)."""

    def __init__(self, plan: Plan, target: dict):
        a, self.plan, self.target = plan.args, plan, target
        prompts = TD.prompt_windows(plan.corpus.heldout, a.eval_prompts, a.eval_prompt_len, a.eval_seed)
        self.spec = None if a.no_eval else SpeculativeEval(plan.task, target, plan.src.config, prompts,
                                                           a.eval_new_tokens, a.eval_k, DTYPES[a.eval_dtype])
        self.batch = DT.place_batch(heldout_batch(plan), plan.mesh)

    def __call__(self, params) -> dict:
        t = time.perf_counter()
        m = DT.eval_loss(params, self.target, self.batch, task=self.plan.task, config=self.plan.src.config,
                         hyper=self.plan.hyper)
        rec = {"heldout": _scalar_metrics({k: DT._jsonable(v) for k, v in m.items()})}
        if self.spec is not None:
            rec["spec"] = self.spec(params)
        rec["eval_s"] = time.perf_counter() - t
        return rec


def _scalar_metrics(m: dict) -> dict:
    return {k: (v if not isinstance(v, list) else [round(x, 5) for x in v]) for k, v in m.items()}


def run(plan: Plan, argv) -> dict:
    a, task, h, config = plan.args, plan.task, plan.hyper, plan.src.config
    os.makedirs(a.out, exist_ok=True)
    _write_json(os.path.join(a.out, "run.json"), dict(plan.record, command=shlex.join(["dsv4-train-drafter"] +
                                                                                      list(argv or sys.argv[1:]))))
    timings = {"tokenize_s": plan.tokenize_s}
    t0 = time.perf_counter()
    dtype = DTYPES[a.dtype]
    target, own = TS.load(plan.src, dtype, plan.mesh)
    timings["load_s"] = time.perf_counter() - t0
    cache = None
    if plan.cache_dir is not None:
        t0 = time.perf_counter()
        manifest = plan.cache_manifest or build_cache(plan, target)
        timings["cache_s"] = time.perf_counter() - t0
        cache = TC.Reader(plan.cache_dir, dtype)
        timings["cache_bytes"] = manifest.get("bytes")
    evaluator = HeldOut(plan, target)
    ckpt_dir = os.path.join(a.out, "ckpt")
    start = DT.latest_step(ckpt_dir) or 0
    metrics_path, eval_path = os.path.join(a.out, "metrics.jsonl"), os.path.join(a.out, "eval.jsonl")
    DT.truncate_jsonl(metrics_path, start)
    DT.truncate_jsonl(eval_path, start)

    def evaluate(step: int, params) -> dict:
        rec = dict(step=step, **evaluator(params))
        _append_jsonl(eval_path, rec)
        return rec

    init = T.init_drafter(task, config, a.init, h.seed, target=target, existing=own.get(task.kind))
    if start == 0 and not any(r["step"] == 0 for r in _read_jsonl(eval_path)):
        evaluate(0, init)
    log = lambda step, m: _append_jsonl(metrics_path, {"step": step, **_scalar_metrics(m)})
    every = a.eval_every

    def on_step(step: int, state) -> None:
        if every and step % every == 0 and step < h.steps:
            evaluate(step, state["params"])

    res = DT.run(task=task, config=config, hyper=h, target=target, params=init, batch_fn=Batches(plan, cache),
                 ckpt_dir=ckpt_dir, mesh=plan.mesh, save_every=a.save_every, keep=a.keep, log=log, on_step=on_step,
                 desc=f"train {task.kind}", quiet=a.quiet)
    timings["train_s"] = res.train_s
    timings["steps_run"] = res.steps_run
    if len(res.step_s) > 1:
        timings["step_s_median"] = float(np.median(res.step_s[1:]))   # the first step includes compilation
        timings["first_step_s"] = res.step_s[0]
    evals = _read_jsonl(eval_path)
    final = next((r for r in evals if r["step"] == h.steps), None) or evaluate(h.steps, res.params)
    baseline = evaluator(own[task.kind]) if task.kind in own else None
    export = None
    if not a.no_export:
        t0 = time.perf_counter()
        export = export_drafter(plan, res.params, target, own)
        timings["export_s"] = time.perf_counter() - t0
    initial = next((r for r in evals if r["step"] == 0), None)
    summary = {"run": plan.record, "corpus": plan.corpus.info, "mesh": None if plan.mesh is None else
               dict(parallel.mesh_sizes(plan.mesh)), "devices": jax.device_count(), "backend": jax.default_backend(),
               "timings": timings, "bytes_per_token_target_states": TC.bytes_per_token(task, config, dtype),
               "eval_initial": initial, "eval_final": final, "eval_baseline_model_drafter": baseline,
               "export": export}
    if initial is not None and "spec" in final:
        summary["mean_accepted_length_gain"] = (final["spec"]["mean_accepted_length"]
                                                - initial["spec"]["mean_accepted_length"])
    if not a.no_plots:
        summary["plots"] = plot_run(os.path.join(a.out, "plots"), _read_jsonl(metrics_path), _read_jsonl(eval_path),
                                    baseline, title=f"{task.kind} drafter for {plan.src.spec}")
        summary["plots"] += reliability_plots(os.path.join(a.out, "plots"), {"initial": initial, "final": final,
                                                                             "model_drafter": baseline},
                                              f"{task.kind} drafter for {plan.src.spec}")
    _write_json(os.path.join(a.out, "summary.json"), summary)
    return summary


def reliability_plots(out_dir: str, evals: dict, title: str) -> list[str]:
    """reliability_<name>.png per evaluation with confidence calibration (DSpark; docs/verification.md §4)."""
    os.makedirs(out_dir, exist_ok=True)
    return [os.path.join(out_dir, plot_reliability(ev["spec"]["calibration"], out_dir, f"{name} — {title}",
                                                   f"reliability_{name}.png"))
            for name, ev in evals.items() if ev and ev.get("spec", {}).get("calibration")]


def export_drafter(plan: Plan, params, target, own) -> dict:
    """Write the drafter (see drafter_export): OUT/checkpoint, or into --write-into."""
    a, task, config, src = plan.args, plan.task, plan.src.config, plan.src
    specs = T.drafter_specs(task, config)
    dtype = DTYPES[plan.save_dtype]
    source = {"kind": "dsv4-train-drafter", "run": os.path.abspath(a.out), "step": plan.hyper.steps,
              "model": src.spec, "init": a.init}
    record = X.drafter_record(task.kind, task, source, dtype)
    params = to_host(params)
    if a.write_into:
        X.export_into(a.write_into, kind=task.kind, drafter=params, specs=specs, record=record, dtype=dtype,
                      config=config)
        return {"path": os.path.abspath(a.write_into), "mode": "write-into", "item": task.kind}
    out = os.path.join(a.out, "checkpoint")
    if src.is_checkpoint:
        X.export_copy(out, kind=task.kind, drafter=params, specs=specs, record=record, dtype=dtype,
                      source_checkpoint=src.path, overwrite=True)
    else:
        units = {"target": {"record": {"source": {"kind": src.kind, "path": src.path}},
                            "units": X.target_units(to_host(target), config, dtype)}}
        other = "dspark" if task.kind == "mtp" else "mtp"
        if other in own:
            orec = X.drafter_record(other, _own_task(other, src), {"kind": src.kind, "path": src.path}, dtype)
            units[other] = {"record": orec, "units": X.drafter_units(other, to_host(own[other]),
                                                                     T.drafter_specs(_own_task(other, src), config),
                                                                     dtype)}
        meta = {"format_version": X.FORMAT_VERSION, "config": config.to_dict(),
                "source": {"kind": src.kind, "path": src.path}, "conversion": X.conversion_meta(dtype)}
        X.export_copy(out, kind=task.kind, drafter=params, specs=specs, record=record, dtype=dtype,
                      source_units=units, source_meta=meta, overwrite=True)
    return {"path": os.path.abspath(out), "mode": "copy", "item": task.kind}


def _own_task(kind: str, src: TS.TargetSource):
    if kind == "mtp":
        return T.MTPTask()
    s = src.dspark
    return T.DSparkTask(s.dcfg, n_stages=s.n_stages, markov_rank=s.markov_rank, conf_bias=s.conf_bias)


ERRORS = (OptionError, TD.DataError, TS.ModelError, TC.CacheError, X.ExportError, FileNotFoundError)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        plan = prepare(a)
    except ERRORS as e:
        return cli.fail("dsv4-train-drafter", e)
    c = plan.corpus.info
    print(f"dsv4-train-drafter: {a.drafter} for {plan.src.spec} ({plan.src.config.name}), {c['train_tokens']} train / "
          f"{c['heldout_tokens']} held-out tokens, {a.steps} steps x {a.grad_accum} x {a.batch} x {a.seq_len}"
          f"{', resuming' if plan.resume else ''} -> {a.out}", file=sys.stderr)
    summary = run(plan, argv)
    print(f"dsv4-train-drafter: {result_line(summary)}; wrote {a.out}/summary.json"
          + (f", drafter in {summary['export']['path']}" if summary["export"] else ""), file=sys.stderr)
    return 0


def result_line(summary: dict) -> str:
    fin, ini, own = (summary[k] or {} for k in ("eval_final", "eval_initial", "eval_baseline_model_drafter"))
    line = f"held-out loss {fin['heldout']['loss']:.3f}"
    if "spec" in fin:
        f = fin["spec"]
        line += f", mean accepted length at k={f['k']}: {f['mean_accepted_length']:.2f}"
        if "spec" in ini:
            line += f" (initial {ini['spec']['mean_accepted_length']:.2f})"
        if "spec" in own:
            line += f", the model's own drafter {own['spec']['mean_accepted_length']:.2f}"
        line += f"; lossless: {f['lossless']}"
    return line


if __name__ == "__main__":
    sys.exit(main())
