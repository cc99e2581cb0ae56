"""The chunked prefill's priming (`prefill.init_rows` + `prime_piece`): the drafters' states equal the
whole-prompt priming's (`prefill.prime`), with one program for every prompt length."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax as d
from dsv4_jax.model.params import init_dspark, init_mtp
from dsv4_jax.speculative import generate as G, prefill as F
from dsv4_jax.speculative.options import RunShape, Speculation


@pytest.fixture(scope="module")
def model():
    config = d.tiny()
    params = d.init_params(config, 41)
    params["mtp"] = init_mtp(config, 42)
    params["dspark"] = init_dspark(config, 43, n_stages=2, n_taps=2, markov_rank=8)
    return config, params


def _primed(model, prompts, drafter: str, chunk):
    config, params = model
    r = G.prepare(params, config, prompts, 8, speculation=Speculation(drafter=drafter, draft_n_max=2),
                  run=RunShape(max_len=96, drafter_pool=("mtp", "dspark"), prefill_chunk=chunk))
    return G.start(params, r.config, jnp.asarray(r.tokens), jnp.asarray(r.lengths), max_len=r.max_len,
                   program=r.program, knobs=r.knobs, key=jax.random.PRNGKey(0), max_block=r.max_block,
                   prefill_taps=r.prefill_taps, prefill_chunk=r.prefill_chunk)


def _leaves_close(x, y) -> bool:
    return all(np.allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=1e-5, atol=1e-5)
               for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(y)))


def test_chunked_priming_equals_whole_prompt_priming(model):
    """Prompts of 9, 2 and 5 tokens primed 4 at a time (the 2-token row idle in chunks 2 and 3, the 5-token
    one in chunk 3, its last token at a chunk's start), MTP and DSpark in one drafter pool -> every leaf
    of the carry (the pool's states, the first token, the target state) equals the whole prompt's within
    float32 rounding; the chosen member's state is primed (differs from the other run's, where that member
    keeps its start state); one `prime_piece` program for the three chunks and both drafters."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(2, 97, n).tolist() for n in (9, 2, 5)]
    n_pieces = F.prime_piece._cache_size()
    chunked = {}
    for drafter in ("mtp", "dspark"):
        whole, chunked[drafter] = _primed(model, prompts, drafter, None), _primed(model, prompts, drafter, 4)
        flat_w, tree_w = jax.tree.flatten(whole)
        flat_c, tree_c = jax.tree.flatten(chunked[drafter])
        assert tree_w == tree_c
        for a, b in zip(flat_w, flat_c):
            a, b = np.asarray(a), np.asarray(b)
            if np.issubdtype(a.dtype, np.floating):
                np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
            else:
                np.testing.assert_array_equal(b, a)
    for member, drafter, other in ((0, "mtp", "dspark"), (1, "dspark", "mtp")):
        assert not _leaves_close(chunked[drafter].drafter[1][member], chunked[other].drafter[1][member])
    assert F.prime_piece._cache_size() == n_pieces + 1
