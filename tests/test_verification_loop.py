"""Verify rules, analytic acceptance and synthetic acceptance inside the on-device loop (docs/verification.md):
block verification's greedy runs equal plain decoding and its sampled runs have the target's law; analytic and
measured per-position acceptance agree on the bundled model and the tiny suite; synthetic rates give their
expected accepted length."""
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax as d
from dsv4_jax.model.params import init_mtp
from dsv4_jax.ops.verification import expected_accepted
from dsv4_jax.research.prompts import load_suite, tokenize

from .test_spec_mtp import _softmax, _top_p, tv_threshold


@pytest.fixture(scope="module")
def demo():
    m = d.tiny_demo()
    # every suite prompt, its first 64 tokens (one short padded shape keeps the test fast)
    prompts = [p["tokens"][:64] for p in tokenize(load_suite("tiny")["prompts"], m.tokenizer.encode,
                                                   m.config.vocab_size)]
    return m, prompts


# the block rule is the verifier's, the same for every drafter: DSpark's run in the slow set
@pytest.mark.parametrize("drafter", ["mtp", pytest.param("dspark", marks=pytest.mark.slow)])
def test_block_rule_greedy_equals_plain(demo, drafter):
    m, prompts = demo
    plain, _ = d.generate(m.params, m.config, prompts[:4], 24, eos_token_id=-1)
    toks, st = d.generate(m.params, m.config, prompts[:4], 24, drafter=drafter, draft_n_max=3, verify="block",
                          dspark_meta=m.dspark, eos_token_id=-1)
    assert toks == plain
    assert st["verify"] == "greedy" and st["accepted"] > 0
    # greedy: a round's analytic acceptance is its indicator
    assert st["per_position_expected_accept_rate"] == pytest.approx(st["per_position_accept_rate"], abs=1e-6)


@pytest.mark.parametrize("rule", ["token", "block"])
def test_analytic_acceptance_matches_measured_on_the_tiny_suite(demo, rule):
    """Every suite prompt, T = 1, MTP k = 3, seed 0. Per position j the measured rate (n_j rounds proposing j)
    and the mean analytic acceptance differ by the mean of n_j martingale differences bounded in [−1, 1]
    with variance <= a(1 − a): tolerance 4·sqrt(a(1 − a)/n_j) + 0.01 (a: the analytic rate)."""
    m, prompts = demo
    _, st = d.generate(m.params, m.config, prompts, 48, temperature=1.0, drafter="mtp", draft_n_max=3, verify=rule,
                       eos_token_id=-1, seed=0)
    assert st["verify"] == rule and st["acceptance"] == "real"
    emp, ana = np.array(st["per_position_accept_rate"]), np.array(st["per_position_expected_accept_rate"])
    n = np.array(st["per_position_proposed"])
    tol = 4 * np.sqrt(ana * (1 - ana) / n) + 0.01
    print(rule, emp.round(3), ana.round(3), tol.round(3), st["mean_accepted_length"], st["expected_mean_accepted_length"])
    assert np.all(np.abs(emp - ana) <= tol)
    assert 0.05 < emp[0] < 0.95                       # both outcomes occur
    assert sum(st["acceptance_histogram"]) == st["rounds"]
    req = st["per_request"][0]
    assert sum(req["acceptance_histogram"]) == req["num_drafts"]
    assert sum(i * c for i, c in enumerate(req["acceptance_histogram"])) == req["num_accepted_tokens"]


def test_block_rule_sampling_is_lossless_on_a_tiny_vocabulary():
    """Joint law of the 2nd and 3rd generated tokens (both from the first verify round when drafts are kept):
    block verification == the exact target law. Same test as tests/test_spec_mtp.py (N = 5000): TV(empirical,
    exact) < tv_threshold(exact), exceeded by a lossless sampler with probability <= 1e-6; a sampler whose law
    is farther than that threshold + tv_radius(N, 64) fails with probability >= 1 − 1e-6."""
    V, N, temp, top_p = 8, 5000, 1.0, 0.9
    config = d.tiny().replace(vocab_size=V, name="tiny-v8")
    params = d.init_params(config, 21)
    params["mtp"] = init_mtp(config, 22)
    prompt = [3, 1, 4, 1, 5, 2]
    # one forward of the V² two-token continuations (causal: position −3 / −2 of row (x1, ·) is the prompt's /
    # prompt + x1's last position)
    logits = np.asarray(d.forward(params, config, jnp.asarray([prompt + [x1, x2] for x1 in range(V)
                                                               for x2 in range(V)]))).reshape(V, V, -1, V)
    probs = lambda rows: np.stack([_top_p(_softmax(row / temp), top_p) for row in rows.reshape(-1, V)])
    p1 = probs(logits[0, 0, -3])[0]
    p2 = probs(logits[:, 0, -2])                                                     # [x1, x2]
    p3 = probs(logits[:, :, -1]).reshape(V, V, V)
    exact = np.einsum("a,ab,abc->bc", p1, p2, p3)                                   # law of (t2, t3)
    toks, st = d.generate(params, config, [prompt] * N, 3, temperature=temp, top_p=top_p, drafter="mtp",
                          draft_n_max=3, verify="block", eos_token_id=-1, seed=5, max_len=16)
    counts = np.zeros((V, V))
    for t in toks:
        counts[t[1], t[2]] += 1
    tv = 0.5 * np.abs(counts / N - exact).sum()
    threshold = tv_threshold(exact, N)
    print(f"block: TV = {tv:.4f} (< {threshold:.4f}), accept rate {st['draft_acceptance_rate']:.3f}")
    assert tv < threshold
    assert 0.05 < st["draft_acceptance_rate"] < 0.95


# 0.6 in the slow set: the same program path and formula as 0.3 and 0.9 (each rate compiles its own loop)
@pytest.mark.parametrize("rate", [0.3, pytest.param(0.6, marks=pytest.mark.slow), 0.9])
def test_synthetic_acceptance_gives_the_rates_expected_length(rate):
    """A random 2-layer target with MTP, k = 3, 64 sequences x 40 tokens. Accepted drafts per round have mean
    Σ_{j=1..3} r^j and standard deviation <= 1.5; over R >= 64·40/4 = 640 rounds the tolerance 4·1.5/sqrt(R)
    (<= 0.24) is a 4-sigma bound."""
    config = d.tiny().replace(num_layers=2, layer_types=d.tiny().layer_types[:2],
                              compress_ratios=d.tiny().compress_ratios[:2],
                              mlp_layer_types=d.tiny().mlp_layer_types[:2], name="tiny-2l")
    params = d.init_params(config, 3)
    params["mtp"] = init_mtp(config, 4)
    prompts = np.random.default_rng(0).integers(2, 97, (64, 5))
    _, st = d.generate(params, config, prompts, 40, drafter="mtp", draft_n_max=3, synthetic_accept=rate,
                       eos_token_id=-1, max_len=64)
    want = 1 + expected_accepted((rate,), 3)
    assert want == pytest.approx(1 + rate + rate ** 2 + rate ** 3)
    assert st["acceptance"] == "synthetic" and st["synthetic_expected_mean_accepted_length"] == pytest.approx(want)
    assert abs(st["mean_accepted_length"] - want) < 4 * 1.5 / np.sqrt(st["rounds"])
    assert st["per_position_expected_accept_rate"] == pytest.approx([rate, rate ** 2, rate ** 3])


def test_bad_verify_options():
    config = d.tiny()
    params = d.init_params(config, 0)
    with pytest.raises(ValueError, match="verify must be one of"):
        d.generate(params, config, [[1, 2]], 2, verify="tree")
    with pytest.raises(ValueError, match="synthetic_accept takes rates"):
        d.generate(params, config, [[1, 2]], 2, synthetic_accept=(0.5, 1.2))
