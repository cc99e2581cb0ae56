import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# CLIs run in-process must not switch on the process-wide persistent compilation cache (~/.cache) in tests
os.environ["DSV4_COMPILE_CACHE"] = "0"

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)

import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _fresh_jax_caches():
    """Drop compiled executables between test modules: one long CPU process otherwise accumulates hundreds
    of them (and XLA's CPU compiler was seen to crash late in a full run, never in a module run alone)."""
    yield
    jax.clear_caches()
    gc.collect()
