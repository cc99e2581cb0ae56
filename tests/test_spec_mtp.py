"""MTP drafter and the on-device speculative loop: exact drafts, lossless greedy and sampling."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax as d
from dsv4_jax.model.decode import CapacityError
from dsv4_jax.drafters import mtp, registry
from dsv4_jax.drafters.base import Bound, DraftSetup, Knobs
from dsv4_jax.model.state import Span
from dsv4_jax.model.target import hidden_states
from dsv4_jax.model.params import init_mtp
from dsv4_jax.speculative import generate as spec_generate, loop, prefill as spec_prefill
from dsv4_jax.speculative.program import Program
from dsv4_jax.speculative.round import round_step

from . import mtp_reference as ref

N_NEW = 200


@pytest.fixture(scope="module")
def model():
    config = d.tiny()
    params = d.init_params(config, 11)
    params["mtp"] = init_mtp(config, 12)
    return config, params


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(2, 97, n).tolist() for n in (7, 3, 12)]


class _Plain(dict):
    """Plain greedy decoding of the first B prompts, plain[B], each B generated on first use."""

    def __init__(self, model, prompts):
        super().__init__()
        self.model, self.prompts = model, prompts

    def __missing__(self, B):
        config, params = self.model
        self[B] = d.generate(params, config, self.prompts[:B], N_NEW, eos_token_id=-1, max_len=256)[0]
        return self[B]


@pytest.fixture(scope="module")
def plain(model, prompts):
    return _Plain(model, prompts)


# jitted here (one program per shape): `hidden_states` is the traced body of `forward_jit`, op by op it is
# several seconds of dispatch per call; the drafter functions below likewise run as the loop runs them
_hidden_states = jax.jit(hidden_states, static_argnums=1)


def _prefix_streams(params, config, seq):
    return np.asarray(_hidden_states(params, config, jnp.asarray([seq], jnp.int32)))[0]


def test_mtp_rows_match_full_recompute(model):
    config, params = model
    seq = np.random.default_rng(1).integers(2, 97, 21)
    S = _prefix_streams(params, config, seq[:-1])                       # [20, n, D]
    st = mtp.init(config, 1, 64, 4, jnp.float32)
    rows = jax.jit(lambda cache, hidden, tokens: mtp.rows(params["mtp"][0], params, config, cache, hidden, tokens,
                                                          Span.of(jnp.zeros(1, jnp.int32), 20, jnp.full(1, 20))))
    X1, logits, _ = rows(st.cache, jnp.asarray(S[None]), jnp.asarray(seq[None, 1:], jnp.int32))
    rX1, rlogits = ref.mtp_rows(params["mtp"][0], params["embed"], params["head"], config, S, seq[1:])
    diff = np.abs(np.asarray(logits[0]) - rlogits.numpy()).max()
    print(f"MTP rows vs full recompute: max |logit diff| {diff:.2e}")
    assert diff <= 1e-4
    assert np.abs(np.asarray(X1[0]) - rX1.numpy()).max() <= 1e-4


def test_incremental_chain_matches_full_recompute_over_rounds(model):
    """Commit rows in chunks as rounds with partial acceptance do; every chain equals recompute."""
    config, params = model
    seq = np.random.default_rng(2).integers(2, 97, 40)
    S = _prefix_streams(params, config, seq[:-1])
    k = 4
    st = mtp.init(config, 1, 64, k + 1, jnp.float32)
    observe = jax.jit(lambda st, hid, tok, start, n: mtp.observe(params["mtp"][0], params, config, st, hid, tok,
                                                                 start, n))
    propose = jax.jit(lambda st, pos, knobs: mtp.propose(Bound(params, config, DraftSetup(k=k)), st, pos,
                                                         jax.random.PRNGKey(0), knobs, greedy=True))
    committed = 0
    for chunk in (12, 3, 1, 5, 2, 4):      # rows committed per round (accepted + 1)
        R = k + 1 if committed else chunk
        hid = np.zeros((1, max(R, chunk), config.hc_mult, config.hidden_size), np.float32)
        hid[0, :chunk] = S[committed:committed + chunk]
        tok = np.zeros((1, hid.shape[1]), np.int32)
        tok[0, :chunk] = seq[committed + 1:committed + chunk + 1]
        st = observe(st, jnp.asarray(hid), jnp.asarray(tok), jnp.array([committed]), jnp.array([chunk]))
        committed += chunk
        knobs = Knobs(jnp.float32(1.0), jnp.float32(1.0), {"p_min": jnp.float32(0.0)})
        drafts, q, n = propose(st, jnp.array([committed]), knobs)
        want, want_logits = ref.greedy_chain(params["mtp"][0], params["embed"], params["head"], config,
                                             S[:committed], seq[1:committed + 1], k)
        assert np.asarray(drafts)[0].tolist() == want, committed
        want_q = np.exp(want_logits - want_logits.max(-1, keepdims=True))
        want_q /= want_q.sum(-1, keepdims=True)
        assert np.abs(np.asarray(q)[0] - want_q).max() <= 1e-5
        assert int(n[0]) == k


# k = 2..5 in the slow set: the default run covers MTP at k = 3 over 200 tokens and k = 5 (eos test), and
# every acceptance length at k = 5 (oracle test). B = 1 in the slow set: MTP greedy at batch 1 equals the
# target's greedy decoding in tests/test_api.py (test_readme_snippet_on_a_checkpoint_with_drafters, k = 2) and
# tests/test_drafter_precision.py (test_greedy_output_unchanged_by_drafter_precision, k = 2, the trained drafter)
@pytest.mark.parametrize("B", [pytest.param(1, marks=pytest.mark.slow), 3])
@pytest.mark.parametrize("k", [1, *(pytest.param(k, marks=pytest.mark.slow) for k in (2, 3, 4, 5))])
def test_greedy_speculative_equals_plain(model, prompts, plain, k, B):
    config, params = model
    toks, stats = d.generate(params, config, prompts[:B], N_NEW, drafter="mtp", draft_n_max=k,
                             eos_token_id=-1, max_len=256)
    assert toks == plain[B]
    assert all(len(t) == N_NEW for t in toks)
    assert stats["drafted"] == stats["rounds"] * k


def test_chunked_prefill_equals_whole_prompt_prefill(model, prompts, plain):
    """RunShape.prefill_chunk: prompts of 7, 3 and 12 tokens prefilled 4 at a time (rows idle in the chunks
    after their prompt) -> the same greedy tokens as plain decoding and the same MTP acceptance as the
    one-shot prefill (the drafter is primed from the chunks' hidden states), one piece program for all."""
    config, params = model
    kw = dict(drafter="mtp", draft_n_max=1, eos_token_id=-1, max_len=256)
    n0 = spec_prefill.prefill_piece._cache_size()
    whole = d.generate(params, config, prompts, N_NEW, **kw)[1]
    toks, stats = d.generate(params, config, prompts, N_NEW, prefill_chunk=4, **kw)
    assert toks == plain[3]
    for key in ("rounds", "drafted", "accepted", "per_position_accepted"):
        assert stats[key] == whole[key], key
    assert spec_prefill.prefill_piece._cache_size() == n0 + 1            # [3, 4] for 1, 2 and 3 chunks
    with pytest.raises(ValueError, match="prefill_chunk must be >= 1"):
        d.generate(params, config, prompts, 4, prefill_chunk=0, **kw)


def test_dynamic_draft_n_equals_plain_in_one_program(model, prompts, plain):
    """RunShape.dynamic_draft_n: one loop program (verify blocks 4 wide) runs draft_n_max 1 and 2, with and
    without p_min; greedy tokens equal plain decoding and no round proposes more than draft_n_max drafts."""
    config, params = model
    kw = dict(drafter="mtp", eos_token_id=-1, max_len=256, max_block=4, dynamic_draft_n=True)
    n0 = loop.run_rounds._cache_size()
    for k, p_min in ((1, 0.0), (2, 0.0), (2, 0.5)):
        toks, stats = d.generate(params, config, prompts, 40, draft_n_max=k, p_min=p_min, **kw)
        assert toks == [t[:40] for t in plain[3]]
        assert stats["draft_n_max"] == k and len(stats["per_position_accepted"]) == k
        assert sum(stats["draft_length_histogram"]) == stats["rounds"] and stats["drafted"] <= stats["rounds"] * k
        if p_min == 0:
            assert stats["drafted"] == stats["rounds"] * k
        else:
            assert stats["drafted"] < stats["rounds"] * k       # the p_min rule still shortens chains
    assert loop.run_rounds._cache_size() == n0 + 1
    with pytest.raises(ValueError, match="needs max_block"):
        d.generate(params, config, [[1, 2]], 4, drafter="mtp", dynamic_draft_n=True)
    with pytest.raises(ValueError, match="wider than max_block=4"):
        d.generate(params, config, [[1, 2]], 4, draft_n_max=4, **kw)


def _final_carry(params, config, prompts, k, **run):
    r = spec_generate.prepare(params, config, prompts, 40, drafter="mtp", draft_n_max=k, eos_token_id=-1,
                              max_len=256, max_block=4, **run)
    key = jax.random.PRNGKey(r.seed)
    carry = spec_generate.start(params, r.config, jnp.asarray(r.tokens), jnp.asarray(r.lengths), max_len=r.max_len,
                                program=r.program, knobs=r.knobs, key=key, max_block=r.max_block,
                                prefill_taps=r.prefill_taps)
    return loop.run_rounds(params, r.config, carry, r.knobs, r.program)


@pytest.mark.parametrize("k", [pytest.param(1, marks=pytest.mark.slow), 2])   # 2: a branch past the switch's first
def test_dynamic_draft_n_verifies_at_the_runs_own_width(model, prompts, k):
    """Under dynamic_draft_n a round verifies draft_n_max + 1 tokens, not max_block: the final decode state
    (every row written, rejected rows too) and drafter state equal those of the program compiled for k.
    (40 new tokens: the shared program is the one test_dynamic_draft_n_equals_plain_in_one_program compiled.)"""
    config, params = model
    own = _final_carry(params, config, prompts, k)
    shared = _final_carry(params, config, prompts, k, dynamic_draft_n=True)
    assert np.array_equal(own.out, shared.out) and int(own.round) == int(shared.round)
    for name, a, b in ((n, x, y) for n, t in (("target", (own.target, shared.target)),
                                              ("drafter", (own.drafter, shared.drafter)))
                       for x, y in zip(jax.tree.leaves(t[0]), jax.tree.leaves(t[1]))):
        assert a.shape == b.shape
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=1e-6, err_msg=name)


def test_oracle_drafter_exercises_every_acceptance_length(model, prompts, plain):
    config, params = model
    k, B = 5, 3
    table = np.zeros((B, 256), np.int32)
    for b in range(B):
        full = prompts[b] + plain[3][b]
        table[b, :len(full)] = full
    for wrong_at in [None, 0, 1, 2, 3, 4]:
        wrong = np.zeros((B, k), bool)
        if wrong_at is not None:
            wrong[:, wrong_at] = True
        p = dict(params, oracle={"tokens": jnp.asarray(table), "wrong": jnp.asarray(wrong)})
        toks, stats = d.generate(p, config, prompts, N_NEW, drafter="oracle", draft_n_max=k, eos_token_id=-1,
                                 max_len=256)
        assert toks == plain[3]
        a = k if wrong_at is None else wrong_at
        per_round = np.array(stats["per_sequence"]["accepted"]) / np.array(stats["per_sequence"]["rounds"])
        # every round accepts exactly a drafts (the last round may be cut by the budget)
        assert np.all(per_round <= a) and np.all(per_round > a - 1), (wrong_at, per_round)
        assert stats["per_position_accepted"][a:] == [0] * (k - a)
        assert stats["mean_accepted_length"] == pytest.approx((stats["accepted"] + stats["rounds"]) / stats["rounds"])


def _top_p(p, top_p):
    order = np.argsort(-p, kind="stable")
    keep = np.zeros_like(p, bool)
    mass = 0.0
    for i in order:
        keep[i] = True
        mass += p[i]
        if mass >= top_p:
            break
    q = np.where(keep, p, 0)
    return q / q.sum()


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


ALPHA = 1e-6     # the sampling-law tests' chance of failing a lossless sampler (for a random seed)


def tv_threshold(law, n: int, alpha: float = ALPHA) -> float:
    """A TV distance that the empirical law of n samples drawn from `law` exceeds with probability <= alpha:
    E[TV] <= ½·Σ_i sqrt(p_i(1 − p_i)/n) (Jensen, cell by cell) and one sample moves TV by at most 1/n, so by
    McDiarmid P(TV > E[TV] + t) <= exp(−2n·t²) = alpha at t = sqrt(ln(1/alpha)/(2n))."""
    law = np.asarray(law, np.float64)
    return 0.5 * np.sqrt(law * (1 - law) / n).sum() + np.sqrt(np.log(1 / alpha) / (2 * n))


def tv_radius(n: int, cells: int, alpha: float = ALPHA) -> float:
    """A lossy sampler whose law r is δ away from the exact one passes `TV(empirical, exact) < tv_threshold(exact)`
    only if TV(empirical, r) > δ − tv_threshold(exact); tv_threshold(r) <= ½·sqrt(cells/n) + t for any r
    (Cauchy–Schwarz), so with probability >= 1 − alpha every sampler farther than
    tv_threshold(exact) + tv_radius(n, cells) fails."""
    return 0.5 * np.sqrt(cells / n) + np.sqrt(np.log(1 / alpha) / (2 * n))


def test_sampling_is_lossless_on_a_tiny_vocabulary():
    """Joint law of the first two generated tokens: speculative == plain == exact (5000 samples each).

    False positives: a lossless sampler's empirical law exceeds `tv_threshold(exact, N)` (0.076 here) with
    probability <= 1e-6. False negatives: a sampler whose law is farther from the exact one than that
    threshold + `tv_radius(N, 64)` (0.094) fails with probability >= 1 − 1e-6; accepting drafts blindly (the
    draft law, asserted that far: 0.55 here) is such a sampler.
    """
    V, N, temp, top_p = 8, 5000, 1.0, 0.9
    config = d.tiny().replace(vocab_size=V, name="tiny-v8")
    params = d.init_params(config, 21)
    params["mtp"] = init_mtp(config, 22)
    prompt = [3, 1, 4, 1, 5, 2]
    # one forward of the V continuations: row x1's logits at the prompt's last position are the prompt's own
    logits = np.asarray(d.forward(params, config, jnp.asarray([prompt + [x1] for x1 in range(V)])))
    p1 = _top_p(_softmax(logits[0, -2] / temp), top_p)
    exact = np.zeros((V, V))
    draft = np.zeros((V, V))
    S = _prefix_streams(params, config, prompt)
    for x1 in range(V):
        exact[x1] = p1[x1] * _top_p(_softmax(logits[x1, -1] / temp), top_p)
        _, mlg = ref.mtp_rows(params["mtp"][0], params["embed"], params["head"], config, S, prompt[1:] + [x1])
        draft[x1] = p1[x1] * _top_p(_softmax(mlg[-1].numpy() / temp), top_p)
    threshold = tv_threshold(exact, N)
    assert 0.5 * np.abs(draft - exact).sum() > threshold + tv_radius(N, V * V)
    for drafter, k in [(None, 0), ("mtp", 3)]:
        toks, stats = d.generate(params, config, [prompt] * N, 2, temperature=temp, top_p=top_p, drafter=drafter,
                                 draft_n_max=max(k, 1), eos_token_id=-1, seed=5, max_len=16)
        counts = np.zeros((V, V))
        for t in toks:
            counts[t[0], t[1]] += 1
        tv = 0.5 * np.abs(counts / N - exact).sum()
        print(f"drafter={drafter}: TV(empirical, exact) = {tv:.4f} (< {threshold:.4f}), "
              f"accept rate {stats['draft_acceptance_rate']:.3f}")
        assert tv < threshold
        if drafter:
            assert 0.05 < stats["draft_acceptance_rate"] < 0.95      # both accept and reject paths ran


@pytest.mark.parametrize("temperature", [0.0, pytest.param(0.8, marks=pytest.mark.slow)])
def test_python_twin_gives_identical_results(model, prompts, temperature):
    config, params = model
    kw = dict(drafter="mtp", draft_n_max=3, temperature=temperature, top_p=0.95, seed=3, eos_token_id=-1,
              max_len=128)
    a, sa = d.generate(params, config, prompts, 40, **kw)
    b, sb = d.generate(params, config, prompts, 40, host_loop=True, **kw)
    assert a == b
    for key in ("rounds", "drafted", "accepted", "per_position_accepted", "per_sequence"):
        assert sa[key] == sb[key]


def test_one_compilation_per_shape(model):
    config, params = model
    rng = np.random.default_rng(9)
    kw = dict(drafter="mtp", draft_n_max=2, eos_token_id=-1, max_len=96, temperature=0.7)
    d.generate(params, config, [rng.integers(2, 97, 5).tolist()] * 2, 8, **kw)
    n = loop.run_rounds._cache_size()
    d.generate(params, config, [rng.integers(2, 97, 5).tolist()] * 2, 8, **dict(kw, temperature=1.1, seed=4))
    d.generate(params, config, [rng.integers(2, 97, 5).tolist()] * 2, 8, **dict(kw, top_p=0.5))
    assert loop.run_rounds._cache_size() == n


def test_loop_is_one_on_device_while(model):
    """The whole generation after the prefill is one while primitive: no host callbacks inside."""
    config, params = model
    from dsv4_jax.speculative.generate import start
    mtp = registry.get("mtp")
    program = Program(drafter=mtp, setup=DraftSetup(k=2), greedy=True, max_new_tokens=4, eos_token_id=-1)
    knobs = mtp.default_knobs()
    carry = start(params, config, np.array([[5, 6, 7]], np.int32), np.array([3]), max_len=32, program=program,
                  knobs=knobs, key=jax.random.PRNGKey(0))
    jaxpr = jax.make_jaxpr(lambda c: jax.lax.while_loop(
        lambda c: loop.cond(c, program), lambda c: round_step(params, config, c, knobs, program), c))(carry)
    text = str(jaxpr)
    assert [e.primitive.name for e in jaxpr.eqns] == ["while"]
    assert "callback" not in text


def test_eos_stops_and_budget(model, prompts, plain):
    config, params = model
    ref_toks = plain[3]
    eos = ref_toks[0][10]              # a token sequence 0 produces at step 10
    toks, _ = d.generate(params, config, prompts, N_NEW, drafter="mtp", draft_n_max=3, eos_token_id=eos,
                         max_len=256)
    first = ref_toks[0].index(eos)
    assert toks[0] == ref_toks[0][:first + 1]
    for b in range(3):
        want = ref_toks[b][:ref_toks[b].index(eos) + 1] if eos in ref_toks[b] else ref_toks[b]
        assert toks[b] == want
    toks, _ = d.generate(params, config, prompts, 7, drafter="mtp", draft_n_max=5, eos_token_id=-1)
    assert toks == [t[:7] for t in ref_toks]


def test_bad_options(model):
    config, params = model
    with pytest.raises(ValueError, match="drafter"):
        d.generate(params, config, [[1, 2]], 4, drafter="eagle")
    with pytest.raises(ValueError, match="draft_n_max"):
        d.generate(params, config, [[1, 2]], 4, drafter="mtp", draft_n_max=0)
    with pytest.raises(CapacityError, match="max_len=8"):
        d.generate(params, config, [[1, 2, 3, 4, 5]], 4, drafter="mtp", draft_n_max=2, max_len=8)
    with pytest.raises(ValueError, match="token ids"):
        d.generate(params, config, [[1, 200]], 4)
    with pytest.raises(ValueError, match="MTP weights"):
        d.generate({k: v for k, v in params.items() if k != "mtp"}, config, [[1, 2]], 4, drafter="mtp")
    with pytest.raises(ValueError, match="top_p"):
        d.generate(params, config, [[1, 2]], 4, top_p=0.0)
