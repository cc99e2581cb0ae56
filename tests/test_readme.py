"""README.md stays true: every fenced ```python block runs as written, and the main-job command line (the
fenced bash block with `dsv4-sweep`) runs as written from a fresh directory.

The main job runs in-process with a tiny setting count appended (later options win in argparse):
`--spec none` (one setting: every setting compiles its own programs for the bundled 7-layer model, ~20 s
of CPU each; the MTP / DSpark paths of the sweep are checked on a 2-layer bundle in
test_research_cli.py), 2 prompts, 8 new tokens, no persistent compile cache, quiet. The python
blocks run unchanged; `tempfile` is pointed at the test's tmp_path so their temporary directories
are cleaned up.
"""
import json
import os
import re
import shlex
import tempfile
from pathlib import Path


from dsv4_jax.research import sweep
from dsv4_jax.speculative import prefill as spec_prefill

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
TINY_SETTINGS = ["--spec", "none", "--limit", "2", "--max-new-tokens", "8", "--no-compile-cache", "--quiet"]


def fenced(lang: str) -> list[str]:
    """Bodies of the README's ```lang blocks, in order."""
    return re.findall(rf"^```{lang}\n(.*?)^```", README, re.S | re.M)


def main_job() -> list[str]:
    """argv of `dsv4-sweep` in the README's set-up line `pip install -e . && dsv4-sweep ...`."""
    (block,) = [b for b in fenced("bash") if "dsv4-sweep" in b]
    steps = [s.strip() for s in block.strip().split("&&")]
    assert steps[0] == "pip install -e .", steps
    argv = shlex.split(steps[1])
    assert argv[0] == "dsv4-sweep"
    return argv[1:]


def test_python_snippets_run_as_written(tmp_path, monkeypatch, capsys):
    blocks = fenced("python")
    assert len(blocks) == 3
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    outs = []
    for i, code in enumerate(blocks):
        exec(compile(code, f"README.md python block {i + 1}", "exec"), {"__name__": "__readme__"})
        outs.append(capsys.readouterr().out)
    assert re.search(r"^\(1, \d+, 260\)$", outs[0], re.M), outs[0]   # block 1: logits [B, S, V] of the byte vocab
    assert outs[1].startswith("1 5 "), outs[1]                         # block 2: 1 MTP layer, DSpark block size 5
    assert outs[2] == "2 3\n", outs[2]                                # block 3: two prompts, draft_n_max 3


def test_main_job_runs_as_written(tmp_path, monkeypatch):
    """Fresh directory (no results/): the nested --out and its parent are created, the documented files written
    with normal permissions."""
    pyproject = (ROOT / "pyproject.toml").read_text()                   # (no tomllib: Python 3.10 is supported)
    assert '\ndsv4-sweep = "dsv4_jax.research.sweep:main"\n' in pyproject   # the function called below
    argv = main_job()
    out = Path(argv[argv.index("--out") + 1])
    assert not out.is_absolute() and len(out.parts) >= 2, out
    monkeypatch.chdir(tmp_path)
    assert not out.parent.exists()
    chunked = (spec_prefill.prefill_piece, spec_prefill.start_carry, spec_prefill.prime_piece)
    before = [f._cache_size() for f in chunked]
    assert sweep.main(argv + TINY_SETTINGS) == 0
    # one prefill piece and one priming (start, piece) for both buckets, precompiled once, the runs hit them
    assert [f._cache_size() for f in chunked] == [n + 1 for n in before]
    assert sorted(os.listdir(out)) == ["acceptance.png", "per_position.png", "results.jsonl", "summary.json",
                                       "summary.md", "tokens_per_s.png"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["meta"]["model"]["name"] == "tiny_demo" and summary["meta"]["n_prompts"] == 2
    # two buckets (26 and 109 tokens), one prefill program: 32-token chunks (RunShape.prefill_chunk)
    assert summary["meta"]["padding"]["buckets"] == [32, 112] and summary["meta"]["padding"]["prefill_chunk"] == 32
    assert [r["spec_type"] for r in summary["settings"]] == ["none"]
    assert len((out / "results.jsonl").read_text().splitlines()) == 2
    umask = os.umask(0)
    os.umask(umask)
    for d in (out.parent, out):
        assert d.stat().st_mode & 0o777 == 0o777 & ~umask, oct(d.stat().st_mode)
    assert (out / "summary.json").stat().st_mode & 0o777 == 0o666 & ~umask
    assert os.listdir(out.parent) == [out.name]                      # no temporary directory left
