"""Verify rules as pure math (ops/verification.py) on synthetic bigram models: block verification is lossless
and never behind token-wise; analytic acceptance is the empirical rate's expectation; synthetic outcomes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax.ops import verification as VF

V, K, N = 4, 3, 100_000
_VERIFY = jax.jit(VF.verify, static_argnames=("greedy", "rule", "synthetic", "forced"))


def _tables(seed):
    """Target / draft bigram tables [V,V] (row: the previous token), deliberately far apart."""
    rng = np.random.default_rng(seed)
    pt = rng.dirichlet(np.ones(V) * 0.7, V)
    qt = rng.dirichlet(np.ones(V) * 0.7, V)
    return pt, qt


def _round(pt, qt, rule, seed, n_draft=None):
    """One verify round per row after context token 0: drafts from qt, verify against pt.
    -> (outcome, drafts [N,K], n_draft [N])."""
    rng = np.random.default_rng(seed)
    d = np.zeros((N, K), np.int64)
    prev = np.zeros(N, np.int64)
    for j in range(K):
        cum = np.cumsum(qt[prev], axis=1)
        d[:, j] = np.minimum((rng.random(N)[:, None] > cum).sum(1), V - 1)
        prev = d[:, j]
    ctx = np.concatenate([np.zeros((N, 1), np.int64), d], axis=1)
    P, Q = pt[ctx], qt[ctx[:, :K]]
    n = np.full(N, K) if n_draft is None else n_draft
    out = _VERIFY(jax.random.PRNGKey(seed), jnp.log(jnp.asarray(P, jnp.float32)), jnp.asarray(d, jnp.int32),
                  jnp.asarray(Q, jnp.float32), jnp.asarray(n, jnp.int32), 1.0, 1.0, greedy=False, rule=rule)
    return jax.tree.map(np.asarray, out), d, n


def _continue(pt, out, d, seed, length):
    """The first `length` generated tokens: the round's emitted tokens, then plain sampling from the target."""
    rng = np.random.default_rng(seed + 1)
    seq = np.full((N, length), -1)
    for j in range(length):
        from_round = j < out.n_accept
        seq[:, j] = np.where(from_round, d[:, min(j, K - 1)], np.where(j == out.n_accept, out.next, -1))
    for j in range(length):
        todo = seq[:, j] < 0
        prev = seq[:, j - 1] if j else np.zeros(N, np.int64)
        cum = np.cumsum(pt[prev], axis=1)
        draw = np.minimum((rng.random(N)[:, None] > cum).sum(1), V - 1)
        seq[:, j] = np.where(todo, draw, seq[:, j])
    return seq


def _tv_to_exact(pt, seq):
    L = seq.shape[1]
    exact = np.ones([V] * L)
    for idx in np.ndindex(*[V] * L):
        prev, pr = 0, 1.0
        for t in idx:
            pr *= pt[prev, t]
            prev = t
        exact[idx] = pr
    counts = np.zeros([V] * L)
    np.add.at(counts, tuple(seq.T), 1)
    return 0.5 * np.abs(counts / N - exact).sum()


@pytest.mark.parametrize("rule", ["token", "block"])
def test_rules_are_lossless_on_a_bigram_model(rule):
    """Law of the first K+1 = 4 generated tokens (V^4 = 256 cells) vs the target's exact law; rows draft
    n ∈ {0..K}. Bound as tests/test_spec_mtp.py: E[TV] <= ½·sqrt(256 / 1e5) = 0.025, McDiarmid +0.015 at
    p ≈ 3e-20; assert TV < 0.04. A draft law far from the target's (mean TV over contexts > 0.2) makes a wrong
    rule fail this."""
    pt, qt = _tables(0)
    assert np.mean(0.5 * np.abs(pt - qt).sum(1)) > 0.2
    n = np.random.default_rng(3).integers(0, K + 1, N)
    out, d, n = _round(pt, qt, rule, 1, n)
    assert np.all(out.n_accept <= n)
    tv = _tv_to_exact(pt, _continue(pt, out, d, 1, K + 1))
    assert tv < 0.04, tv
    assert 0.1 < np.mean(out.n_accept[n == K]) < K - 0.1        # both accept and reject paths ran


def test_block_never_behind_token_wise_and_analytic_matches():
    """E[n_accept]: block >= token-wise (Sun et al. Theorem 2), on several bigram pairs; per position the
    mean analytic acceptance equals the empirical rate within 4 standard errors (≤ 0.0064 at N = 1e5)."""
    for seed in range(2):
        pt, qt = _tables(10 + seed)
        res = {}
        for rule in ("token", "block"):
            out, _, _ = _round(pt, qt, rule, 20 + seed)
            emp = np.array([(out.n_accept > j).mean() for j in range(K)])
            ana = out.expected.mean(0)
            se = np.sqrt(emp * (1 - emp) / N) + 1e-4
            assert np.all(np.abs(emp - ana) < 4 * se), (rule, emp, ana)
            res[rule] = out.n_accept.mean()
            # the analytic expectation itself: block's is the larger on the same drafts
            res[rule + "_ana"] = out.expected.sum(1).mean()
        assert res["block"] >= res["token"] - 4 * np.sqrt(2 * K / N), res
        assert res["block_ana"] >= res["token_ana"] - 1e-6, res


def test_greedy_and_single_draft_reduce_to_token_wise():
    """k = 1: block verification is token-wise (h_1 = min(1, P/Q)); greedy: prefix match for both rules."""
    pt, qt = _tables(5)
    P = jnp.asarray(pt[np.array([[0, 1]] * 4)], jnp.float32)
    Q = jnp.asarray(qt[np.array([[0]] * 4)], jnp.float32)
    d = jnp.asarray([[1]] * 4, jnp.int32)
    _, h = VF.block_weights(P, Q, d, jnp.full((4,), 1, jnp.int32))
    assert np.allclose(h[:, 0], min(1.0, pt[0, 1] / qt[0, 1]))
    lg = jnp.asarray(np.random.default_rng(0).normal(size=(2, K + 1, 9)), jnp.float32)
    best = np.asarray(jnp.argmax(lg, -1))
    drafts = jnp.asarray([best[0, :K], [best[1, 0], (best[1, 1] + 1) % 9, best[1, 2]]], jnp.int32)
    for rule in VF.RULES:
        o = _VERIFY(jax.random.PRNGKey(0), lg, drafts, jnp.zeros((2, K, 9)), jnp.full((2,), K, jnp.int32), 1.0,
                      1.0, greedy=True, rule=rule)
        assert np.asarray(o.n_accept).tolist() == [3, 1]
        assert np.asarray(o.expected).tolist() == [[1, 1, 1], [1, 0, 0]]


@pytest.mark.parametrize("rate", [0.3, 0.6, 0.9])
def test_synthetic_outcomes_follow_the_rate(rate):
    """E[n_accept] = Σ_{j=1..K} r^j; the empirical mean within 4 standard errors (sd <= sqrt(K²/4) / sqrt(N))."""
    lg = jnp.zeros((N // 10, K + 1, 5))
    o = VF.verify(jax.random.PRNGKey(1), lg, jnp.zeros((N // 10, K), jnp.int32), None,
                  jnp.full((N // 10,), K, jnp.int32), 1.0, 1.0, greedy=True, synthetic=(rate,))
    want = sum(rate ** j for j in range(1, K + 1))
    assert want == pytest.approx(VF.expected_accepted((rate,), K))
    assert abs(float(np.mean(o.n_accept)) - want) < 4 * (K / 2) / np.sqrt(N // 10)
    assert np.allclose(np.asarray(o.expected)[0], [rate ** j for j in range(1, K + 1)])


def test_calibration_counts_label_the_conditional_acceptance():
    conf = jnp.asarray([[0.9, 0.42, 0.1], [0.05, 0.5, 0.99]], jnp.float32)
    bins, brier = VF.calibration_counts(conf, jnp.asarray([1, 0]), jnp.asarray([3, 3]), jnp.asarray([True, True]),
                                        n_bins=10)
    bins = np.asarray(bins)
    # row 0: drafts 0 (accepted) and 1 (rejected) seen, draft 2 not reached; row 1: draft 0 (rejected) seen
    assert bins[0, 0, 9].tolist() == pytest.approx([1, 1, 0.9])
    assert bins[0, 1, 4].tolist() == pytest.approx([1, 0, 0.42])
    assert bins[0, 2].sum() == 0 and bins[1, 0, 0].tolist() == pytest.approx([1, 0, 0.05])
    assert bins[1, 1:].sum() == 0
    assert np.allclose(np.asarray(brier), [[0.01, 0.42 ** 2, 0], [0.05 ** 2, 0, 0]])


def test_bad_rule():
    with pytest.raises(ValueError, match="verify rule"):
        VF.verify(None, jnp.zeros((1, 2, 3)), jnp.zeros((1, 1), jnp.int32), None, jnp.ones((1,), jnp.int32), 1.0,
                  1.0, greedy=True, rule="tree")


def test_calibration_metrics_against_direct_definitions(tmp_path):
    """ECE / Brier / AUROC from bins equal the textbook formulas on samples whose confidences sit at bin
    centres (so binning loses nothing); AUROC by brute-force pair counting."""
    from dsv4_jax.research import calibration as C, report
    rng = np.random.default_rng(0)
    conf = (rng.integers(0, 20, 3000) + 0.5) / 20
    y = rng.random(3000) < conf ** 2                      # over-confident: acceptance below confidence
    bins, brier = C.bins_from_samples(conf, y, 20)
    m = C.position_metrics(bins, brier)
    ece = sum(abs(y[conf == c].mean() - c) * (conf == c).mean() for c in np.unique(conf))
    pos, neg = conf[y], conf[~y]
    pairs = (pos[:, None] > neg[None, :]).mean() + 0.5 * (pos[:, None] == neg[None, :]).mean()
    assert m["ece"] == pytest.approx(ece) and m["brier"] == pytest.approx(np.mean((conf - y) ** 2))
    assert m["auroc"] == pytest.approx(pairs) == pytest.approx(C.auroc(conf, y))
    assert m["n"] == 3000 and 0.6 < m["auroc"] < 0.9 and m["ece"] > 0.05
    perfect = C.position_metrics(*C.bins_from_samples(np.full(100, 0.5), np.arange(100) < 50, 20))
    assert perfect["ece"] == pytest.approx(0.0) and perfect["auroc"] == pytest.approx(0.5)
    calib = {"bins": [bins.tolist(), np.zeros_like(bins).tolist()], "brier_sum": [brier, 0.0]}
    rows = C.metrics(calib)
    assert rows[1]["n"] == 0 and "| 2 | 0 | – |" in C.markdown(rows)
    name = report.plot_reliability(calib, str(tmp_path), "test")
    assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
