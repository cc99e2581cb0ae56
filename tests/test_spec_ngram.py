"""The n-gram (prompt-lookup) drafter and the drafter interface seen from outside the package: exact
proposals against a plain-Python reference, lossless greedy and sampling, and a toy drafter with its own
options registered by this file and run through `generate`."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax as d
from dsv4_jax.drafters import ngram, registry
from dsv4_jax.drafters.base import DraftSetup, Drafter, dynamic

from .test_spec_mtp import _softmax, _top_p, tv_radius, tv_threshold


def reference_proposal(seq: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Plain Python: the tokens after the latest earlier occurrence of the longest suffix of seq (length n_max
    down to n_min) whose occurrence starts after position 0 (the drafter never sees the first token), at
    most k and at most up to the end of seq."""
    last = len(seq) - 1
    for n in range(n_max, n_min - 1, -1):
        if last - n + 1 < 1:
            continue
        suffix = seq[last - n + 1:]
        for e in range(last - 1, n - 1, -1):          # the match ends at e, starts at e − n + 1 >= 1
            if seq[e - n + 1:e + 1] == suffix:
                return seq[e + 1:min(e + 1 + k, last + 1)]
    return []


def test_proposals_match_the_reference():
    """Random sequences over a 4-token alphabet (many repeats), B = 3 rows at different lengths, k = 4:
    drafts and n_draft equal the plain-Python search, for suffixes 1..3 and 2..2."""
    rng = np.random.default_rng(0)
    k, L, V = 4, 40, 4
    for n_min, n_max in ((1, 3), (2, 2)):
        for _ in range(20):
            lens = rng.integers(2, L - 1, 3)
            seqs = [rng.integers(0, V, n).tolist() for n in lens]
            st = ngram.init(3, L)
            table = np.full((3, L), -1, np.int32)
            for b, s in enumerate(seqs):
                table[b, 1:len(s) - 1] = s[1:-1]          # observed: positions 1..pos−1 (pos = len − 1)
            st = st.replace(tokens=jnp.asarray(table))
            pos = jnp.asarray(lens - 1, jnp.int32)
            last = jnp.asarray([s[-1] for s in seqs], jnp.int32)
            drafts, q, n = ngram.propose(st, pos, last, k, n_min, n_max, V)
            for b, s in enumerate(seqs):
                want = reference_proposal(s, k, n_min, n_max)
                assert int(n[b]) == len(want), (s, want, n[b])
                assert np.asarray(drafts[b, :len(want)]).tolist() == want
                np.testing.assert_array_equal(np.asarray(q[b]), np.eye(V)[np.asarray(drafts[b])])


def test_observe_records_the_tokens_after_each_position():
    st = ngram.init(2, 8)
    st = ngram.observe(st, jnp.asarray([[7, 8, 9], [4, 5, 6]]), jnp.asarray([0, 3]), jnp.asarray([3, 2]))
    assert np.asarray(st.tokens).tolist() == [[-1, 7, 8, 9, -1, -1, -1, -1], [-1, -1, -1, -1, 4, 5, -1, -1]]


@pytest.fixture(scope="module")
def demo():
    return d.tiny_demo()


def test_greedy_equals_plain_on_the_bundled_model(demo):
    """Repetitive prompts (code with repeated lines) on the bundled tiny model: greedy n-gram speculation
    gives plain decoding's tokens, and drafts are accepted."""
    texts = ["x = 1\ny = 2\nx = 1\ny = 2\nx = 1\ny = 2\nx = ", "for i in range(3):\n    print(i)\n" * 2]
    prompts = [demo.tokenizer.encode(t) for t in texts]
    kw = dict(eos_token_id=-1, max_len=160)
    plain, _ = d.generate(demo.params, demo.config, prompts, 48, **kw)
    toks, stats = d.generate(demo.params, demo.config, prompts, 48, drafter="ngram", draft_n_max=4, **kw)
    assert toks == plain
    assert stats["accepted"] > 0 and stats["mean_accepted_length"] > 1.0
    print(f"ngram on the tiny demo: mean accepted length {stats['mean_accepted_length']:.2f}, "
          f"acceptance {stats['draft_acceptance_rate']:.2f}")


def test_sampling_is_lossless_on_a_tiny_vocabulary():
    """Same statistical test as the MTP one (5000 samples; see its docstring and `tv_threshold` / `tv_radius`
    for the false-positive and false-negative bounds): the joint law of the first two generated tokens equals
    the exact one, and the n-gram's point-mass draft law is farther from it than the threshold + tv_radius."""
    V, N, temp, top_p = 8, 5000, 1.0, 0.9
    config = d.tiny().replace(vocab_size=V, name="tiny-v8")
    params = d.init_params(config, 21)
    prompt = [3, 1, 4, 1, 5, 2]
    # one forward of the V continuations: row x1's logits at the prompt's last position are the prompt's own
    logits = np.asarray(d.forward(params, config, jnp.asarray([prompt + [x1] for x1 in range(V)])))
    p1 = _top_p(_softmax(logits[0, -2] / temp), top_p)
    exact, draft = np.zeros((V, V)), np.zeros((V, V))
    for x1 in range(V):
        exact[x1] = p1[x1] * _top_p(_softmax(logits[x1, -1] / temp), top_p)
        proposal = reference_proposal(prompt + [x1], 3, 1, 3)
        if proposal:
            draft[x1, proposal[0]] = p1[x1]
        else:
            draft[x1] = exact[x1]                 # no draft: the target's own token
    threshold = tv_threshold(exact, N)
    assert 0.5 * np.abs(draft - exact).sum() > threshold + tv_radius(N, V * V)
    toks, stats = d.generate(params, config, [prompt] * N, 2, temperature=temp, top_p=top_p, drafter="ngram",
                             draft_n_max=3, eos_token_id=-1, seed=9, max_len=16)
    counts = np.zeros((V, V))
    for t in toks:
        counts[t[0], t[1]] += 1
    tv = 0.5 * np.abs(counts / N - exact).sum()
    print(f"ngram: TV(empirical, exact) = {tv:.4f} (< {threshold:.4f}), accept rate {stats['draft_acceptance_rate']:.3f}")
    assert tv < threshold
    assert 0.05 < stats["draft_acceptance_rate"] < 0.95


def test_bad_ngram_options():
    with pytest.raises(ValueError, match="n_min <= n_max"):
        registry.get("ngram").options(n_min=3, n_max=2)


# ---- a drafter from outside the package, with its own options --------------------------------------

@dataclasses.dataclass(frozen=True)
class RepeatOptions:
    offset: int = 0                  # static: draft last + offset
    keep: float = dynamic(1.0)       # dynamic: propose only when keep >= 0.5


class RepeatDrafter(Drafter):
    """Drafts `last + offset` k times (point masses); no weights, no state."""

    name = "test-toy-repeat"
    Options = RepeatOptions

    def configure(self, params, config, k, options=None, bundle=None):
        return DraftSetup(k=k, settings=self.options(options).offset)

    def propose(self, run, state, pos, last, key, knobs, greedy):
        k, V = run.setup.k, run.config.vocab_size
        drafts = jnp.repeat(((last + run.setup.settings) % V)[:, None], k, axis=1).astype(jnp.int32)
        n = jnp.where(knobs.drafter["keep"] >= 0.5, k, 0) * jnp.ones(pos.shape, jnp.int32)
        return drafts, jax.nn.one_hot(drafts, V), n


def test_a_drafter_with_options_registered_from_outside():
    """Registered from this file, run through `generate` with its options as keywords (static offset,
    dynamic keep): greedy tokens equal plain decoding; keep=0 proposes nothing (the same compiled loop);
    an unknown option is a TypeError naming the drafter's options."""
    config = d.tiny()
    params = d.init_params(config, 3)
    prompts = [[5, 6, 5, 6, 5, 6, 5], [9, 9, 9]]
    kw = dict(eos_token_id=-1, max_len=48)
    plain, _ = d.generate(params, config, prompts, 12, **kw)
    registry.register(RepeatDrafter())
    try:
        toks, stats = d.generate(params, config, prompts, 12, drafter="test-toy-repeat", draft_n_max=2, offset=1,
                                 **kw)
        off, stats_off = d.generate(params, config, prompts, 12, drafter="test-toy-repeat", draft_n_max=2, offset=1,
                                    keep=0.0, **kw)
        with pytest.raises(TypeError, match=r"'test-toy-repeat''s options \['keep', 'offset'\]"):
            d.generate(params, config, prompts, 4, drafter="test-toy-repeat", ofset=1)
    finally:
        registry.unregister("test-toy-repeat")
    assert toks == plain and off == plain
    assert stats["drafter"] == "test-toy-repeat" and stats["drafted"] > 0
    assert stats_off["drafted"] == 0
