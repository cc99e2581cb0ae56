"""The shipped tiny demo model: loads in one call, drafters are lossless and useful; training is resumable."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax as d
from dsv4_jax.config import CSA, HCA, SLIDING
from dsv4_jax.demo import ByteTokenizer, tiny_demo
from dsv4_jax.training import objectives
from dsv4_jax.training.evaluate import heldout_prompts
from dsv4_jax.training.loop import train


@pytest.fixture(scope="module")
def demo():
    return tiny_demo()


@pytest.fixture(scope="module")
def prompts():
    return heldout_prompts(3, prompt_len=48, seed=1)


def test_loads_in_one_call_with_every_layer_type(demo):
    c = demo.config
    assert {SLIDING, CSA, HCA} <= set(c.layer_types) and c.num_hash_layers > 0 and c.hc_mult == 4
    assert c.vocab_size == ByteTokenizer.vocab_size and 128 <= c.hidden_size <= 256
    assert "mtp" in demo.params and "dspark" in demo.params
    assert demo.params["embed"].dtype == jnp.float32
    text = demo.tokenizer.decode(demo.tokenizer.encode("def f(x):\n    return x\n"))
    assert text == "def f(x):\n    return x\n"


def test_the_target_has_learned_python(demo):
    """Held-out bytes/nat: a trained byte model is far below the uniform log(260) = 5.56 nats."""
    toks = jnp.asarray(heldout_prompts(4, prompt_len=128, seed=2))
    # jitted, as training runs it (op by op the 7-layer forward is seconds of dispatch)
    loss = float(jax.jit(objectives.target_loss, static_argnums=1)(demo.params, demo.config, toks))
    print(f"held-out loss {loss:.3f} nats/byte")
    assert loss < 2.5


@pytest.fixture(scope="module")
def runs(demo, prompts):
    """Plain greedy decoding and both drafters at draft_n_max 5 (one compiled loop per drafter, each run once
    for the tests below)."""
    kw = dict(eos_token_id=-1, max_len=128, pad_to=48)
    plain, _ = d.generate(demo.params, demo.config, prompts, 64, **kw)
    spec = {drafter: d.generate(demo.params, demo.config, prompts, 64, drafter=drafter, draft_n_max=5,
                                dspark_meta=demo.dspark, **kw) for drafter in ("mtp", "dspark")}
    return plain, spec


@pytest.mark.parametrize("drafter", ["mtp", "dspark"])
def test_greedy_speculative_equals_plain_on_the_shipped_model(runs, drafter):
    plain, spec = runs
    toks, stats = spec[drafter]
    assert toks == plain
    assert stats["mean_accepted_length"] > 1.5      # trained drafters are accepted


def test_dspark_accepts_more_than_mtp_at_five(runs):
    _, spec = runs
    m, s = spec["mtp"].stats, spec["dspark"].stats
    print(f"mean accepted length at 5: MTP {m['mean_accepted_length']:.2f}, DSpark {s['mean_accepted_length']:.2f}")
    assert s["mean_accepted_length"] > m["mean_accepted_length"]


def test_training_resumes_to_the_same_result(tmp_path):
    """4 steps in one go == 2 steps, stop, then resume to 4 (same seeds, same batches)."""
    from dsv4_jax.config import _tiny_base
    config = _tiny_base(name="tiny-2", ratios=[0, 4], n_hash=1)       # small: the grad compiles fast
    params = d.init_params(config, 0)
    rng = np.random.default_rng(0)
    data = [rng.integers(0, config.vocab_size, (2, 17)).astype(np.int32) for _ in range(4)]
    loss = lambda p, b: (objectives.target_loss(p, config, jnp.asarray(b)), {})
    full = train(loss, params, iter(data), steps=4, lr=1e-3, ckpt_dir=str(tmp_path / "a"), save_every=2)

    def interrupted():
        yield from data[:2]
        raise KeyboardInterrupt      # the run dies while fetching its third batch

    with pytest.raises(KeyboardInterrupt):
        train(loss, params, interrupted(), steps=4, lr=1e-3, ckpt_dir=str(tmp_path / "b"), save_every=2)
    resumed = train(loss, params, iter(data), steps=4, lr=1e-3, ckpt_dir=str(tmp_path / "b"), save_every=2)
    for x, y in zip(jax.tree.leaves(full), jax.tree.leaves(resumed)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6)
    assert not all(np.array_equal(np.asarray(x), np.asarray(y))
                   for x, y in zip(jax.tree.leaves(full), jax.tree.leaves(params)))


def test_round_accounting_expresses_a_round_in_decode_steps():
    from dsv4_jax.training.evaluate import round_accounting
    acc = round_accounting({"decode_s": 0.3, "rounds": 10, "k": 3}, s_per_token_plain=0.01)
    assert acc["ms_per_round"] == pytest.approx(30.0)
    assert acc["round_cost_in_decode_steps"] == pytest.approx(3.0)
    assert acc["speedup_bound_full_acceptance"] == pytest.approx(4 / 3)
    # a batch of 2 counts each loop trip twice in `rounds`
    assert round_accounting({"decode_s": 0.3, "rounds": 20, "k": 3}, 0.01, batch=2)["ms_per_round"] == \
        pytest.approx(30.0)


def test_round_parts_split_a_round():
    from dsv4_jax.training.evaluate import round_parts
    run = {"k": 3, "decode_s": 0.3, "rounds": 100, "mean_accepted_length": 3.2}
    parts = round_parts(run, {1: 0.001, 4: 0.0016}, {"propose": {3: 0.0004}, "observe": {3: 0.0001}})
    assert parts["round_ms"] == pytest.approx({"verify": 1.6, "propose": 0.4, "observe": 0.1, "rest": 0.9})
    assert parts["speedup_bound_free_drafter"] == pytest.approx(2.0)


@pytest.mark.slow   # ~90 s of compiles; the accounting is test_round_parts_split_a_round
def test_evaluate_bundle_reports_speedups_and_where_they_are_bounded():
    from dsv4_jax.training.evaluate import evaluate_bundle, format_table
    res = evaluate_bundle(n_prompts=1, max_new=12, ks=(1,), chain=2, chain_repeats=1)
    plain = res["runs"][0]
    assert plain["drafter"] == "none" and plain["ms_per_decode_step"] > 0
    for r in res["runs"][1:]:
        assert r["lossless"] and r["rounds"] > 0
        assert r["speedup"] == pytest.approx(plain["wall_s"] / r["wall_s"])
        steps = (r["decode_s"] / r["rounds"]) / (plain["ms_per_decode_step"] / 1e3)
        assert r["round_cost_in_decode_steps"] == pytest.approx(steps)
        assert r["speedup_bound_full_acceptance"] == pytest.approx((r["k"] + 1) / steps)
    s = res["summary"]
    assert s["all_lossless"] and s["best_dspark"]["k"] == 1
    assert set(res["block_ms"]) == {"1", "2"} and all(v > 0 for v in res["block_ms"].values())
    assert s["verify_block_cost_in_decode_steps"]["1"] == pytest.approx(1.0)
    assert set(res["drafter_ms"]) == {"mtp", "dspark"}
    for name, ms in res["drafter_ms"].items():
        assert set(ms) == {"propose", "observe"}
        run = next(r for r in res["runs"] if r["drafter"] == name)
        assert run["round_ms"]["verify"] == pytest.approx(res["block_ms"]["2"])
        assert run["round_ms"]["propose"] == pytest.approx(ms["propose"]["1"])
        assert run["round_ms"]["propose"] > 0 and run["round_ms"]["observe"] > 0
        assert sum(run["round_ms"].values()) == pytest.approx(1e3 * run["decode_s"] / run["rounds"])
    dspark = next(r for r in res["runs"] if r["drafter"] == "dspark")
    assert s["best_dspark"]["speedup_bound_free_drafter"] == pytest.approx(
        dspark["mean_accepted_length"] * res["block_ms"]["1"] / res["block_ms"]["2"])
    table = format_table(res).splitlines()
    assert len(table) == 2 + len(res["runs"]) and table[-1].startswith("| dspark | 1 |")
    assert table[-1].count("|") == table[0].count("|") and table[1].count("|") == table[0].count("|")
