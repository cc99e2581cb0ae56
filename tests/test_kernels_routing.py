"""Routing kernel (interpret mode) == the reference routing (model.layers.moe.route / ops.moe), bit for bit,
ties included."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax.backends import Backends
from dsv4_jax.config import HASH_MOE, MOE, tiny
from dsv4_jax.kernels import routing
from dsv4_jax.model.layers import moe as moe_ref
from dsv4_jax.ops.moe import Router

PALLAS = Backends(routing="pallas", interpret=True)


def _gate(E, D, k, vocab, seed, dtype):
    ks = jax.random.split(jax.random.key(seed), 3)
    w = (jax.random.normal(ks[0], (E, D)) * 0.5).astype(dtype)
    w = w.at[1].set(w[4])                         # identical rows: exact score ties between experts 1 and 4
    bias = (jax.random.normal(ks[1], (E,)) * 0.1).at[1].set(0.05).at[4].set(0.05)
    tid2eid = jnp.argsort(jax.random.uniform(ks[2], (vocab, E)), axis=-1)[:, :k].astype(jnp.int32)
    return {"weight": w, "bias": bias, "tid2eid": tid2eid}


@pytest.mark.parametrize("T,E,k,dtype", [(1, 8, 1, jnp.float32), (5, 12, 3, jnp.bfloat16),
                                         (16, 256, 6, jnp.bfloat16), (33, 40, 6, jnp.float32),
                                         pytest.param(64, 9, 4, jnp.bfloat16, marks=pytest.mark.slow)])
@pytest.mark.parametrize("mlp_type", [MOE, HASH_MOE])
def test_route_matches_reference(T, E, k, dtype, mlp_type):
    cfg = tiny().replace(n_routed_experts=E, num_experts_per_tok=k, hidden_size=32)
    p = _gate(E, 32, k, cfg.vocab_size, T + E, dtype)
    x = jax.random.normal(jax.random.key(T), (T, 32), dtype)
    tokens = jax.random.randint(jax.random.key(E), (T,), 0, cfg.vocab_size)
    idx, w = moe_ref.route(x, tokens, p, cfg.with_backends(PALLAS), mlp_type)
    ridx, rw = moe_ref.route(x, tokens, p, cfg, mlp_type)
    np.testing.assert_array_equal(idx, ridx)
    np.testing.assert_array_equal(w, rw)


def test_route_tie_order_lower_index_first():
    logits = jnp.zeros((2, 10), jnp.float32)        # every score ties
    idx, _ = routing.route_from_logits(logits, jnp.zeros((10,)), None, router=Router(4, True, 1e-20, 1.0))
    np.testing.assert_array_equal(idx, [[0, 1, 2, 3]] * 2)


def test_route_in_jit_while_loop():
    cfg = tiny()
    p = _gate(cfg.n_routed_experts, cfg.hidden_size, cfg.num_experts_per_tok, cfg.vocab_size, 0, jnp.float32)
    x0 = jax.random.normal(jax.random.key(1), (3, cfg.hidden_size))
    tokens = jnp.arange(3)

    def run(route_fn):
        def body(c):
            i, x, acc = c
            idx, w = route_fn(x)
            return i + 1, x * 1.5 + 0.1, acc + jnp.sum(w * idx)
        return jax.jit(lambda x: jax.lax.while_loop(lambda c: c[0] < 3, body, (0, x, 0.0))[2])(x0)

    kern = run(lambda x: moe_ref.route(x, tokens, p, cfg.with_backends(PALLAS), MOE))
    ref = run(lambda x: moe_ref.route(x, tokens, p, cfg, MOE))
    np.testing.assert_array_equal(kern, ref)
