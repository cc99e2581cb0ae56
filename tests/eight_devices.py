"""Run a check script of tests/ in a fresh process with 8 forced host devices and read its RESULT line.

`--xla_force_host_platform_device_count=8` must be set before jax initialises, hence the subprocess
(`sharding_checks.py`, `ep_checks.py`). fast_compile: XLA backend optimisation off — both sides of every
comparison run in that one process with the same flags.
"""
import contextlib
import fcntl
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# XLA:CPU backend optimisation off: the test programs are tiny, compiling them is most of their time
FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")


def host_devices_flags(devices: int, fast_compile: bool = True) -> str:
    """XLA_FLAGS for `devices` forced CPU host devices.

    The collective timeout is raised from XLA:CPU's 40 s: every forced device is a thread of one process, and on a
    2-core machine running other tests beside, one device thread can reach an all-reduce more than 40 s after
    the others (seen in CI), which XLA:CPU answers by aborting the process."""
    flags = [f"--xla_force_host_platform_device_count={devices}",
             "--xla_cpu_collective_call_terminate_timeout_seconds=1200"]
    if fast_compile:
        flags += FAST_COMPILE
    return " ".join(flags)


# Tests hold this file's lock shared (conftest `_cpu_share`); a forced-device subprocess holds it exclusive: its
# device threads meet at every collective, and beside another pytest worker's compiles on 2 cores one such run
# took > 1,200 s where it takes 107 s alone (CI, 2026-12-07), so it runs while the other workers wait.
LOCK_PATH = os.path.join(tempfile.gettempdir(), f"dsv4_jax_tests_{os.getuid()}.lock")
_shared: list = []          # this process's shared-lock file, while a test runs


@contextlib.contextmanager
def shared_cpu():
    """Hold the tests' CPU lock shared (every test, through conftest)."""
    with open(LOCK_PATH, "a") as f:
        fcntl.flock(f, fcntl.LOCK_SH)
        _shared.append(f)
        try:
            yield
        finally:
            _shared.remove(f)
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def exclusive_cpu():
    """Hold the tests' CPU lock exclusive: no other pytest worker runs a test meanwhile (this process's own
    shared hold, if any, is converted and given back after)."""
    if _shared:
        f = _shared[-1]
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_SH)
        return
    with open(LOCK_PATH, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run_checks(script: str, args, timeout: int, fast_compile: bool = True) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=host_devices_flags(8, fast_compile))
    with exclusive_cpu():
        proc = subprocess.run([sys.executable, os.path.join(HERE, script), *args], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(lines[-1][len("RESULT "):])
    print(json.dumps(res, indent=1))
    assert res["devices"] == 8
    return res
