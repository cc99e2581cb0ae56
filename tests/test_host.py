"""`to_host` (dsv4_jax.ops.host) in one process: numpy values of the same tree through one `jax.device_get`,
no cross-host gather; one function behind every public name. Its cross-host gather runs in
tests/test_multihost.py (2 processes, the `latency` logits split on the vocabulary across them)."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

import dsv4_jax as d
from dsv4_jax.ops import host


def test_one_function_behind_every_name():
    assert d.to_host is d.parallel.to_host is host.to_host


def test_single_process_is_one_device_get(monkeypatch):
    calls = []
    device_get = jax.device_get
    monkeypatch.setattr(jax, "device_get", lambda x: calls.append(len(x)) or device_get(x))
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda *a, **k: 1 / 0)   # never reached
    tree = {"a": jnp.arange(6, dtype=jnp.int32).reshape(2, 3), "b": (jnp.float32(1.5), None, 7),
            "c": np.ones(2, np.float32)}
    out = host.to_host(tree)
    assert calls == [4]                                  # every leaf in one call (None is no leaf)
    assert jax.tree.structure(out) == jax.tree.structure(tree)
    assert all(type(x) is np.ndarray for x in jax.tree.leaves(out))
    np.testing.assert_array_equal(out["a"], np.arange(6).reshape(2, 3))
    assert out["a"].dtype == np.int32 and out["b"][0] == 1.5 and out["b"][1] is None and out["b"][2] == 7
    np.testing.assert_array_equal(out["c"], tree["c"])


def test_a_bare_array():
    out = host.to_host(jnp.arange(3.0))
    assert type(out) is np.ndarray and out.tolist() == [0.0, 1.0, 2.0]
