"""Multi-host for real: 2 processes × 4 CPU devices joined by `jax.distributed` on localhost (gloo
collectives), against one process; and the launch recipe of docs/sharding.md run as written.

One launch serves both tests (module fixture `launched`): each process runs the docs' my_run.py, then the
checks of tests/multihost_checks.py on the recipe's params and compiled programs (plain mesh) and under the
`latency` preset; this process computes the single-process reference while they run."""
import json
import os
import re
import socket
import subprocess
import sys

import numpy as np
import pytest

import dsv4_jax as d
from dsv4_jax.config import HASH_MOE, _schedule
from dsv4_jax.io.convert.save import save_checkpoint
from dsv4_jax.model.params import init_mtp

from .eight_devices import host_devices_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 420


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DSV4_", "TPU_", "SLURM_", "OMPI_"))}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""),
               XLA_FLAGS=host_devices_flags(devices),
               DSV4_COMPILE_CACHE="0", **extra)
    return env


def _wait(procs) -> list[str]:
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=TIMEOUT)
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    return outs


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A 1-layer random target (CSA with a hash-routed MoE) with one MTP block (sliding-window attention,
    score-routed MoE), as a float32 checkpoint: every layer kind in the fewest layers, so the programs that
    three processes compile at once stay small."""
    types, ratios = _schedule([4])
    config = d.tiny().replace(name="multihost", num_layers=1, layer_types=types, compress_ratios=ratios,
                              mlp_layer_types=(HASH_MOE,), vocab_size=64)
    params = d.init_params(config, 0)
    params["mtp"] = init_mtp(config, 1)
    path = tmp_path_factory.mktemp("mh") / "ckpt"
    save_checkpoint(path, config, params, dtype="float32")
    return str(path)


PROMPT = [[1, 2, 3, 4, 5, 6, 7, 8]]     # the recipe's prompt (checked against what it ran)
N_NEW = 8                               # the recipe's new tokens


def docs_recipe() -> tuple[dict, str]:
    """(environment of host 0's column, my_run.py) as written in docs/sharding.md."""
    text = open(os.path.join(ROOT, "docs", "sharding.md")).read()
    env_block = re.search(r"```bash\n# host 0.*?\n```", text, re.S).group(0)
    env = dict(re.findall(r"^export (\w+)=(\S+)", env_block, re.M))
    script = re.search(r"```python\n(# my_run\.py.*?)```", text, re.S).group(1)
    return env, script


def reference(ckpt: str) -> dict:
    """One process, one device: forward and plain greedy generate of the recipe's prompt (that MTP's greedy
    tokens equal plain ones in one process is tests/test_spec_mtp.py's)."""
    config, params = d.load_checkpoint(ckpt, dtype=np.float32, verify=False)
    logits = np.asarray(d.forward(params, config, np.asarray(PROMPT, np.int32)))
    plain, _ = d.generate(params, config, PROMPT, N_NEW)
    return {"logits": logits, "plain": plain}


@pytest.fixture(scope="module")
def launched(ckpt, tmp_path_factory):
    """One launch of 2 processes × 4 CPU devices (tests/multihost_checks.py: the docs' my_run.py as written,
    then the checks on both meshes), with the docs' DSV4_* variables (coordinator on localhost); the
    single-process reference is computed here meanwhile. -> (docs env, process outputs, results, reference)."""
    env, script = docs_recipe()
    tmp = tmp_path_factory.mktemp("launch")
    recipe, out = tmp / "my_run.py", tmp / "multi.json"
    recipe.write_text(script)
    port = _free_port()
    argv = [sys.executable, os.path.join(ROOT, "tests", "multihost_checks.py"), str(recipe), ckpt, str(out)]
    procs = [subprocess.Popen(argv, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env=_env(4, DSV4_COORDINATOR=f"localhost:{port}",
                                       DSV4_NUM_PROCESSES=env.get("DSV4_NUM_PROCESSES", "2"), DSV4_PROCESS_ID=str(i)))
             for i in range(int(env.get("DSV4_NUM_PROCESSES", "2")))]
    try:
        ref = reference(ckpt)
    finally:
        outs = _wait(procs)
    return env, outs, json.loads(out.read_text()), ref


def test_docs_recipe_runs_as_written(launched):
    """The docs' my_run.py, launched with the docs' DSV4_* variables, one command per process: it joins 2
    processes, process 0 prints the logits' shape and the tokens, and its generate fetched through to_host."""
    env, outs, got, _ = launched
    assert {"DSV4_COORDINATOR", "DSV4_NUM_PROCESSES", "DSV4_PROCESS_ID"} <= set(env)
    assert env["DSV4_NUM_PROCESSES"] == "2" and got["processes"] == 2 and got["devices"] == 8
    assert "logits (1, 8, 64) tokens [[" in outs[0], outs[0][-2000:]
    assert "logits (" not in outs[1]               # only process 0 prints
    assert got["recipe_fetches"] >= 2              # generate's tokens and statistics came through to_host


def test_two_processes_match_one(launched):
    """load_checkpoint(mesh=...), forward (logits brought to the host by to_host; under `latency` they are
    split across the hosts, so it gathers) and generate (plain and MTP, greedy) on 2 processes × 4 devices,
    1×8×1 mesh (the recipe's) and the `latency` preset, equal one process on one device (logits to f32
    round-off; tokens exactly; MTP's tokens equal plain greedy)."""
    _, _, got, ref = launched
    assert got["prompt"] == PROMPT and len(ref["plain"][0]) == N_NEW
    assert got["latency"]["logits_split_across_hosts"] is True
    assert got["generate_fetches"] > got["recipe_fetches"]
    for name in ("plain_mesh", "latency"):
        r = got[name]
        assert r["split_leaves"] > 0 and r["dtypes"] == ["float32"], name
        np.testing.assert_allclose(np.asarray(r["logits"]), ref["logits"], atol=2e-5, rtol=1e-5, err_msg=name)
        assert r["plain"] == r["mtp"] == ref["plain"], name
