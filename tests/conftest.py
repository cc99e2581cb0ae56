import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# CLIs run in-process must not switch on the process-wide persistent compilation cache (~/.cache) in tests
os.environ["DSV4_COMPILE_CACHE"] = "0"
# XLA:CPU backend optimisation off (LLVM -O0, no expensive passes), as the 8-device subprocesses already run:
# the test models are tiny, so compiling is most of a test's time (~30 % less CPU per compile-bound test,
# e.g. test_decode.py::test_drafter_outputs_hidden_and_taps 54 -> 38 CPU s; the 20k-sample MTP sampling
# test 124 -> 121). The HLO passes and the float semantics are the same (no fast-math either way), so the
# parity tolerances are untouched; user runs keep XLA's defaults.
from .eight_devices import FAST_COMPILE, shared_cpu  # noqa: E402

os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", "")]
                                   + [f for f in FAST_COMPILE if f not in os.environ.get("XLA_FLAGS", "")]).strip()

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)

import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _cpu_share():
    """Every test holds the tests' CPU lock shared, so that a forced-device subprocess
    (`eight_devices.exclusive_cpu`) runs while no other worker's test does."""
    with shared_cpu():
        yield


@pytest.fixture(autouse=True, scope="module")
def _fresh_jax_caches():
    """Drop compiled executables between test modules: one long CPU process otherwise accumulates hundreds
    of them (and XLA's CPU compiler was seen to crash late in a full run, never in a module run alone)."""
    yield
    jax.clear_caches()
    gc.collect()
