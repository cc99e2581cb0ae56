"""DSpark drafter: incremental proposals equal a full recompute; greedy and sampling are lossless."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax as d
from dsv4_jax.model.decode import process_block
from dsv4_jax.model.state import init_state
from dsv4_jax.drafters import dspark
from dsv4_jax.drafters.base import Bound, DraftSetup, Knobs
from dsv4_jax.model.params import init_dspark
from dsv4_jax.speculative import generate as spec_generate

from . import dspark_reference as ref
from .test_spec_mtp import _softmax, _top_p, tv_radius, tv_threshold

N_NEW = 64
DCFG = dspark.DSparkConfig(block_size=5, noise_token_id=96, target_layer_ids=(2, 3, 4))


@pytest.fixture(scope="module")
def model():
    config = d.tiny()
    params = d.init_params(config, 31)
    params["dspark"] = init_dspark(config, 32, n_stages=2, n_taps=3, markov_rank=12, conf_bias=True)
    return config, params


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(4)
    return [rng.integers(2, 96, n).tolist() for n in (9, 4, 14)]


def _taps(params, config, seq):
    st = init_state(config, 1, 64, 8, jnp.float32)
    _, _, aux = process_block(params, config, st, jnp.asarray([seq], jnp.int32), jnp.array([len(seq)]),
                              DCFG.target_layer_ids)
    return np.asarray(aux["taps"])[0]


@pytest.mark.parametrize("rule", ["per-position", "cumulative"])
def test_incremental_proposal_matches_full_recompute(model, rule):
    """Rounds with partial acceptance: commit chunks of context, then propose; equal to a from-scratch run."""
    config, params = model
    dcfg = dspark.DSparkConfig(**{**DCFG.__dict__, "confidence_rule": rule})
    seq = np.random.default_rng(5).integers(2, 96, 40)
    taps = _taps(params, config, seq[:-1])                           # [39, 3, D]
    st = dspark.init(params["dspark"], config, 1, jnp.float32)
    run = Bound(params, config, DraftSetup(k=4, taps=dcfg.target_layer_ids, settings=dcfg))
    # jitted, as the loop runs them (op by op they are seconds of dispatch per call)
    observe = jax.jit(lambda st, taps, start, n: dspark.observe(params["dspark"], params, config, st, taps, start, n))
    propose = jax.jit(lambda st, pos, tok, knobs: dspark.propose(run, st, pos, tok, jax.random.PRNGKey(0), knobs,
                                                                 greedy=True))
    a = 0
    for chunk in (9, 1, 4, 2, 6, 5):                                  # accepted + 1 per round
        pad = np.zeros((1, 6 if a else chunk, 3, config.hidden_size), np.float32)
        pad[0, :chunk] = taps[a:a + chunk]
        st = observe(st, jnp.asarray(pad), jnp.array([a]), jnp.array([chunk]))
        a += chunk
        for threshold in (0.0, 0.5):
            knobs = Knobs(jnp.float32(1.0), jnp.float32(1.0), {"confidence_threshold": jnp.float32(threshold)})
            drafts, q, n, conf = propose(st, jnp.array([a]), jnp.array([seq[a]]), knobs)
            want, want_logits, want_conf, kept = ref.propose(params["dspark"], params["embed"], params["head"],
                                                             config, taps[:a], int(seq[a]), 5, 96, 4, threshold, rule)
            assert np.asarray(drafts)[0].tolist() == want, (a, threshold)
            assert np.abs(np.asarray(conf)[0] - want_conf).max() <= 1e-5
            want_q = np.stack([_softmax(l) for l in want_logits])
            assert np.abs(np.asarray(q)[0] - want_q).max() <= 1e-5
            assert int(n[0]) == kept
            # a run-time bound (Knobs.draft_n): only the first 2 positions of the Markov head run
            drafts, _, n, conf = propose(st, jnp.array([a]), jnp.array([seq[a]]), knobs.replace(draft_n=jnp.int32(2)))
            assert np.asarray(drafts)[0].tolist() == want[:2] + [0, 0] and int(n[0]) == min(kept, 2)
            assert np.abs(np.asarray(conf)[0, :2] - want_conf[:2]).max() <= 1e-5


@pytest.fixture(scope="module")
def plain(model, prompts):
    """plain(B): plain greedy decoding of the first B prompts (each B generated once, on first use)."""
    config, params = model
    return functools.cache(lambda B: d.generate(params, config, prompts[:B], N_NEW, eos_token_id=-1, max_len=96)[0])


# k = 2..5 in the slow set: by default DSpark at k = 2 is checked lossless through the sweep's drafter pool
# (tests/test_research_cli.py) and in the slot engine (tests/test_slots.py); the cap at the block size below.
# B = 1 in the slow set: DSpark greedy at batch 1 equals the target's greedy decoding in tests/test_api.py
# (test_readme_snippet_on_a_checkpoint_with_drafters) and tests/test_drafter_precision.py (the trained drafter)
@pytest.mark.parametrize("B", [pytest.param(1, marks=pytest.mark.slow), 3])
@pytest.mark.parametrize("k", [1, *(pytest.param(k, marks=pytest.mark.slow) for k in (2, 3, 4, 5))])
def test_greedy_speculative_equals_plain(model, prompts, plain, k, B):
    config, params = model
    for threshold in (0.0, 0.3, 0.7):
        toks, stats = d.generate(params, config, prompts[:B], N_NEW, drafter="dspark", draft_n_max=k,
                                 confidence_threshold=threshold, eos_token_id=-1, max_len=96, dspark_meta=DCFG)
        assert toks == plain(B), (k, B, threshold)
        hist = stats["draft_length_histogram"]
        assert len(hist) == k + 1 and sum(hist) == stats["rounds"]
        if threshold == 0.0:
            assert hist[k] == stats["rounds"]                     # τ = 0: the whole (truncated) block


def test_draft_n_max_beyond_block_size_truncates(model, prompts):
    """The plan (`generate.prepare`) caps draft_n_max at the block size: the loop is compiled for 5 drafts and
    the run reports 5 (the reported cap after a real run: tests/test_api.py, a checkpoint's block size)."""
    config, params = model
    r = spec_generate.prepare(params, config, prompts[:1], 6, drafter="dspark", draft_n_max=9, dspark_meta=DCFG,
                              eos_token_id=-1)
    assert r.program.k == r.draft_n == 5 and r.max_block == 6


def test_sampling_is_lossless_on_a_tiny_vocabulary():
    """Same statistical test as the MTP one (5000 samples; see its docstring and `tv_threshold` / `tv_radius`
    for the false-positive and false-negative bounds): TV(empirical, exact) < tv_threshold(exact), and the
    draft law (what accepting drafts blindly samples) farther than that threshold + tv_radius."""
    V, N, temp, top_p = 8, 5000, 1.0, 0.9
    config = d.tiny().replace(vocab_size=V, name="tiny-v8")
    params = d.init_params(config, 41)
    params["dspark"] = init_dspark(config, 42, n_stages=1, n_taps=3, markov_rank=4)
    dcfg = dspark.DSparkConfig(block_size=3, noise_token_id=7, target_layer_ids=(2, 3, 4))
    prompt = [3, 1, 4, 1, 5, 2]
    # one forward of the V continuations: row x1's logits at the prompt's last position are the prompt's own
    logits = np.asarray(d.forward(params, config, jnp.asarray([prompt + [x1] for x1 in range(V)])))
    p1 = _top_p(_softmax(logits[0, -2] / temp), top_p)
    exact, draft = np.zeros((V, V)), np.zeros((V, V))
    taps = _taps(params, config, prompt)
    for x1 in range(V):
        exact[x1] = p1[x1] * _top_p(_softmax(logits[x1, -1] / temp), top_p)
        _, dl, _, _ = ref.propose(params["dspark"], params["embed"], params["head"], config, taps, x1, 3, 7, 1, 0.0)
        draft[x1] = p1[x1] * _top_p(_softmax(dl[0] / temp), top_p)
    threshold = tv_threshold(exact, N)
    assert 0.5 * np.abs(draft - exact).sum() > threshold + tv_radius(N, V * V)
    toks, stats = d.generate(params, config, [prompt] * N, 2, temperature=temp, top_p=top_p, drafter="dspark",
                             draft_n_max=3, eos_token_id=-1, seed=7, max_len=16, dspark_meta=dcfg)
    counts = np.zeros((V, V))
    for t in toks:
        counts[t[0], t[1]] += 1
    tv = 0.5 * np.abs(counts / N - exact).sum()
    print(f"dspark: TV(empirical, exact) = {tv:.4f} (< {threshold:.4f}), "
          f"accept rate {stats['draft_acceptance_rate']:.3f}")
    assert tv < threshold
    assert 0.05 < stats["draft_acceptance_rate"] < 0.95


def test_bad_dspark_settings(model):
    config, params = model
    with pytest.raises(ValueError, match="confidence_rule"):
        dspark.DSparkConfig(confidence_rule="max")
    with pytest.raises(ValueError, match="taps"):
        d.generate(params, config, [[1, 2]], 4, drafter="dspark",
                   dspark_meta=dspark.DSparkConfig(target_layer_ids=(3, 4)))
    with pytest.raises(ValueError, match="noise_token_id"):
        d.generate(params, config, [[1, 2]], 4, drafter="dspark",
                   dspark_meta=dspark.DSparkConfig(noise_token_id=500, target_layer_ids=(2, 3, 4)))
    with pytest.raises(ValueError, match="confidence_threshold"):
        d.generate(params, config, [[1, 2]], 4, drafter="dspark", confidence_threshold=1.5, dspark_meta=DCFG)
