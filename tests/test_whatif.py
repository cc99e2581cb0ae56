"""What-if (docs/whatif.md): every greedy setting's rounds from one teacher-forced pass equal the decode loop's,
round by round — fixed widths with stop thresholds, the width scheduler's auto — and the walk itself on
hand-made cases; the sampled estimate's pieces (the forced chain, the Σ min(p, q) chain)."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax as d
from dsv4_jax.drafters import registry
from dsv4_jax.drafters.precision import drafter_at_precision
from dsv4_jax.research import sweep, whatif as W
from dsv4_jax.research.models import bundled
from dsv4_jax.research.runner import Setting
from dsv4_jax.speculative.cost_table import CostTable
from dsv4_jax.training.evaluate import heldout_prompts

N = 40          # new tokens per prompt
K = 3           # widest width
KNOB = {"mtp": "p_min", "dspark": "confidence_threshold"}


@pytest.fixture(scope="module")
def run():
    """The bundled model, three held-out prompts, their continuations, the target pass along them and both
    drafters' proposals."""
    model = bundled()
    prompts = heldout_prompts(3, prompt_len=48, seed=7)
    paths = W.continuations(model.params, model.bundle, prompts, N + K + 1)
    target = W.target_pass(model.params, model.config, paths, (4, 5, 6))
    props = {name: W.proposals(model.params, model.bundle, paths, name, K, N + K, (0.0, 0.6), target=target)
             for name in ("mtp", "dspark")}
    return model, prompts, paths, props, target


def _loop_rounds(model, prompts, drafter, **options):
    """Each prompt's rounds in the real loop: [[drafted, accepted], ...] (RunShape.round_trace)."""
    g = d.generate(model.params, model.bundle, prompts, N, drafter=drafter, round_trace=True, pad_to=48,
                   max_len=48 + N + K + 1, max_block=K + 1, **options)
    return [[[a, b] for a, b in zip(dr, ac)] for dr, ac in zip(g.stats["per_round_drafted"],
                                                                 g.stats["per_round_accepted"])], g.tokens


def test_continuation_is_the_plain_greedy_output(run):
    model, prompts, paths, *_ = run
    plain, _ = d.generate(model.params, model.bundle, prompts, N, eos_token_id=-1)
    assert [list(p.tokens[:N]) for p in paths] == plain


@pytest.mark.parametrize("drafter", ["mtp", "dspark"])
@pytest.mark.parametrize("k,threshold", [(1, 0.0), (3, 0.0), (3, 0.6)])
def test_fixed_width_rounds_equal_the_loops_round_by_round(run, drafter, k, threshold):
    model, prompts, paths, props, _ = run
    p = props[drafter]
    t = p.thresholds.index(threshold)
    want, tokens = _loop_rounds(model, prompts, drafter, draft_n_max=k, eos_token_id=-1, dynamic_draft_n=True,
                                **{KNOB[drafter]: threshold})
    for b, path in enumerate(paths):
        trace, out = W.walk(path, p.drafts[b], p.n_draft[t, b], k, N)
        assert trace == want[b]
        assert out == len(tokens[b]) == N


def test_an_ngram_drafter_that_reads_every_committed_token_walks_to_the_loops_rounds(run):
    """The n-gram drafter needs the whole history (`Drafter.context_rows` None): each anchor is fed all of it."""
    model, prompts, paths, *_ = run
    p = W.proposals(model.params, model.bundle, paths, "ngram", K, N, (0.0,))
    want, _ = _loop_rounds(model, prompts, "ngram", draft_n_max=K, eos_token_id=-1, dynamic_draft_n=True)
    assert any(d for rounds in want for d, _ in rounds)          # it found matches to draft from
    for b, path in enumerate(paths):
        assert W.walk(path, p.drafts[b], p.n_draft[0, b], K, N)[0] == want[b]


@pytest.mark.parametrize("drafter,batch", [("mtp", 3), ("dspark", 1)])
def test_auto_replay_equals_the_schedulers_rounds(run, drafter, batch):
    """draft_n_max="auto" with a given cost table, with the three prompts in one batch (one width per round for the
    batch, the calibration over it, MTP's chain stop over every sequence, finished sequences still drafting from
    their last anchor) and at batch 1: the chosen widths, the chain's early stop (MTP) and the switch to plain
    decoding replayed from the proposals give the loop's rounds for every sequence."""
    model, prompts, paths, props, _ = run
    table = CostTable(seconds=(1.2, 1.5, 1.7, 1.9), plain_seconds=1.0, drafter=drafter)
    rows = range(batch)
    want, _ = _loop_rounds(model, [prompts[b] for b in rows], drafter, draft_n_max="auto", draft_n_max_bound=K,
                           cost_table=table, eos_token_id=-1)
    traces, outs, widths = W.replay_auto([paths[b] for b in rows], props[drafter], rows, 0, K, table, N, -1,
                                         registry.get(drafter).sequential)
    assert traces == want
    assert outs == [N] * batch
    assert len(widths) == max(len(t) for t in traces)
    assert len(set(widths)) > 1                            # the scheduler chose between widths (or switched)


def test_an_auto_setting_without_a_cost_table_is_named_not_dropped_silently():
    said = []
    records, _ = W.evaluate(None, [], [Setting("mtp", 3, batch_size=4, auto=True)], N, tables={}, progress=said.append)
    assert records == [] and said == ["what-if: no cost table for mtp k=auto p_min=0 T=0 B=4: not replayed "
                                      "(auto needs one)"]


def test_a_quantized_drafters_rounds_equal_the_loops_with_that_drafter(run):
    """The drafter precision axis: proposals of the MTP drafter stored as fp8 (`drafters.precision`), the target
    pass reused, walk to the rounds the loop runs with those weights."""
    model, prompts, paths, _, target = run
    fp8 = drafter_at_precision(model.params, "mtp", "fp8")
    p = W.proposals(fp8, model.bundle, paths, "mtp", K, N, (0.0,), target=target)
    g = d.generate(fp8, model.bundle, prompts, N, drafter="mtp", draft_n_max=K, round_trace=True, eos_token_id=-1,
                   pad_to=48, max_len=48 + N + K + 1, max_block=K + 1, dynamic_draft_n=True)
    for b, path in enumerate(paths):
        trace, _ = W.walk(path, p.drafts[b], p.n_draft[0, b], K, N)
        assert trace == [[x, y] for x, y in zip(g.stats["per_round_drafted"][b], g.stats["per_round_accepted"][b])]


def test_a_window_of_committed_rows_gives_the_same_proposals_as_all_of_them(run):
    """`Drafter.context_rows`: MTP and DSpark fed only the last sliding_window committed positions propose what
    they propose after observing the whole sequence."""
    model, _, paths, props, _ = run
    config, bundle = W.unbundle(model.bundle)
    for name in ("mtp", "dspark"):
        drafter = registry.get(name)
        window = drafter.context_rows(W.Program(drafter, drafter.configure(model.params, config, K, None,
                                                                           dict(bundle))).bind(model.params, config))
        assert window == config.sliding_window < len(paths[0].prompt)

        class Everything(type(drafter)):
            def context_rows(self, run):
                return None
        everything = Everything()
        everything.name = "whatif-all-" + name
        registry.register(everything)
        meta = {"dspark_meta": dict(bundle)["dspark"]} if name == "dspark" else {}
        try:
            full = W.proposals(model.params, model.bundle, paths, everything.name, K, N, (0.0,),
                               options=everything.options(**meta))
        finally:
            registry.unregister("whatif-all-" + name)
        np.testing.assert_array_equal(full.drafts, props[name].drafts[:, :N])
        np.testing.assert_array_equal(full.n_draft[0], props[name].n_draft[0, :, :N])


def test_walk_by_hand():
    """Anchor i proposes drafts[i]; the continuation decides: prefix match, then the target's token."""
    path = W.Path(prompt=np.array([1, 2], np.int32), tokens=np.array([10, 11, 12, 13, 14, 15, 16, 17, 18], np.int32))
    drafts = np.zeros((9, 2), np.int32)
    drafts[0] = [11, 12]          # both accepted: emit 11, 12, 13 -> anchor 3
    drafts[3] = [14, 99]          # one accepted: emit 14, 15 -> anchor 5
    drafts[5] = [99, 17]          # none accepted: emit 16 -> anchor 6
    drafts[6] = [17, 18]
    n_rule = np.array([2, 2, 2, 2, 2, 2, 1, 2, 2])     # the stop rule keeps one draft at anchor 6
    trace, out = W.walk(path, drafts, n_rule, 2, max_new_tokens=9)
    assert trace == [[2, 2], [2, 1], [2, 0], [1, 1]] and out == 9
    # a budget of 5 tokens stops the second round's emission after 2 of its tokens
    trace, out = W.walk(path, drafts, n_rule, 2, max_new_tokens=5)
    assert trace == [[2, 2], [2, 1]] and out == 5
    # EOS (13) emitted in the first round ends the run there, the round's acceptance still counted
    trace, out = W.walk(path, drafts, n_rule, 2, max_new_tokens=9, eos=13)
    assert trace == [[2, 2]] and out == 4
    # width 1 verifies one draft per round whatever the drafter proposes
    trace, _ = W.walk(path, drafts, n_rule, 1, max_new_tokens=4)
    assert trace == [[1, 1], [1, 0]]       # 11 accepted (emit 11, 12), then 13 from anchor 2: 4 tokens


def test_whatif_cli_matches_a_sweep_and_predicts_from_its_cost_table(tmp_path, capsys):
    """dsv4-whatif --compare on a dsv4-sweep of the same grid (random tiny model): every prompt × setting equal,
    every round; a predicted speed-up per setting; the best setting named; bad options exit 2. In process, as
    tests/test_research_cli.py runs dsv4-sweep."""
    common = ["--random-tiny", "--limit", "3", "--max-new-tokens", "12", "--spec", "none,mtp,dspark",
              "--draft-n-max", "1,2", "--quiet", "--no-plots", "--no-compile-cache"]
    swept = tmp_path / "sweep"
    # the what-if compares the drafters' settings: the sweep leaves out the baseline
    assert sweep.main(["--out", str(swept), "--repeats", "1", "--by-output-position", *common,
                       "--spec", "mtp,dspark"]) == 0
    out = tmp_path / "whatif"
    table = tmp_path / "costs.json"
    CostTable(seconds=(1.5, 2.0, 2.5), plain_seconds=1.0).save(str(table))
    assert sweep.main(["--what-if", "--out", str(out), "--compare", str(swept), "--cost-table", str(table),
                       "--price", "h100", "--drafter-precision", "as-loaded,bf16", "--confidence-rule", "cumulative",
                       *common, "--temperature", "0,0.8"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    cmp_ = summary["compare"]
    assert cmp_["compared"] == 3 * (2 + 2) and cmp_["equal"] == cmp_["compared"], cmp_["differences"]
    rows = {r["label"]: r for r in summary["settings"]}
    sampled = rows["mtp k=2 p_min=0 T=0.8 B=1"]       # the estimate (docs/whatif.md §5), labelled as such
    assert "approximation" in sampled and 1.0 <= sampled["mean_accepted_length"] <= 3.0
    r = rows["mtp k=2 p_min=0 T=0 B=1"]
    # the given table: width 2 costs 2.5 plain rounds
    assert r["predicted_speedup"]["given"] == pytest.approx(
        (r["total_predicted"] - 3) / (r["rounds"] * 2.5), rel=1e-9)
    assert r["predicted_speedup"]["h100"] > 0
    assert any(b["spec_type"] == "best" for b in summary["best"])
    assert rows["dspark k=1 conf=0 T=0 B=1 prec=bf16"]["n_requests"] == 3
    assert rows["dspark k=2 conf=0 T=0 B=1 rule=cumulative"]["n_requests"] == 3
    lines = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines() if "round_trace" in x]
    assert lines and all(sum(a + 1 for _, a in x["round_trace"]) + 1 >= x["pred"] for x in lines)
    capsys.readouterr()
    for args, message in ((["--temperature", "0.8", "--p-min", "0,0.5"], "thresholds 0"),
                          (["--spec", "none"], "needs a drafter")):
        with pytest.raises(SystemExit) as e:
            sweep.main(["--what-if", "--out", str(tmp_path / "x"), *common, *args])
        assert e.value.code == 2 and message in capsys.readouterr().err and not (tmp_path / "x").exists()


@pytest.mark.parametrize("drafter", ["mtp", "dspark"])
def test_teacher_forcing_a_chain_with_its_own_drafts_changes_nothing(run, drafter):
    """`Drafter.propose_along` fed the drafter's own sampled drafts gives the distributions `propose` drew them
    from (the forced chain is the chain). One jitted program (as `whatif._alpha_along` runs them): op by op it
    took 3× longer."""
    model, _, paths, *_ = run
    config, bundle = W.unbundle(model.bundle)
    dr = registry.get(drafter)
    setup = dr.configure(model.params, config, K, None, dict(bundle))
    program = W.Program(dr, setup, greedy=False)

    @jax.jit
    def chains(params, hidden, tokens):
        """-> (q [2,K,V] the chain's draft distributions, propose_along's fed its drafts, fed its drafts + 1)."""
        run_ = program.bind(params, config)
        st = dr.begin(run_, 2, 128, jnp.float32, None)
        aux = {"hidden": hidden, "taps": jnp.repeat(hidden[:, :, :1], len(setup.taps), axis=2)}
        st = dr.observe(run_, st, aux, tokens, jnp.zeros(2, jnp.int32), jnp.full(2, 8, jnp.int32))
        knobs = dr.default_knobs(temperature=0.8)
        pos, last, key = jnp.full(2, 8, jnp.int32), jnp.asarray([5, 9]), jax.random.PRNGKey(3)
        drafts, q = dr.propose_scored(run_, st, pos, last, key, knobs, False)[:2]
        return (q, dr.propose_along(run_, st, pos, last, drafts, key, knobs),
                dr.propose_along(run_, st, pos, last, (drafts + 1) % config.vocab_size, key, knobs))

    hidden = jnp.asarray(np.random.default_rng(0).normal(size=(2, 8, config.hc_mult, config.hidden_size)), jnp.float32)
    q, along, other = chains(model.params, hidden, jnp.asarray(paths[0].prompt[:16].reshape(2, 8)))
    np.testing.assert_allclose(along, q, rtol=1e-6, atol=1e-7)
    # other tokens fed: the first draft's distribution (before any fed token) stays, the later ones move
    np.testing.assert_allclose(other[:, 0], q[:, 0], rtol=1e-6, atol=1e-7)
    assert np.abs(np.asarray(other[:, 1:]) - np.asarray(q[:, 1:])).max() > 1e-3


def test_the_cumulative_confidence_rule_walks_to_the_loops_rounds(run):
    """DSpark's confidence rule as an axis: the proposals under "cumulative" (a proposal pass with that rule) at a
    threshold give the rounds the loop runs with that rule."""
    model, prompts, paths, *_ = run
    config, bundle = W.unbundle(model.bundle)
    meta = dataclasses.replace(dict(bundle)["dspark"], confidence_rule="cumulative")
    p = W.proposals(model.params, model.bundle, paths, "dspark", K, N, (0.6,),
                    options=registry.get("dspark").options(dspark_meta=meta))
    want, _ = _loop_rounds(model, prompts, "dspark", draft_n_max=K, eos_token_id=-1, dynamic_draft_n=True,
                           confidence_threshold=0.6, dspark_meta=meta)
    assert any(d < K for rounds in want for d, _ in rounds)        # the rule cut some rounds short
    for b, path in enumerate(paths):
        assert W.walk(path, p.drafts[b], p.n_draft[0, b], K, N)[0] == want[b]



# ---- the sampled estimate (docs/whatif.md §5): the rounds' law given a path --------------------------------

def _enumerate_round(P, Q, n, V, rule):
    """A round of n drafts from a state whose target / drafter distributions depend on the prefix (P(prefix) [V],
    Q(prefix) [V]), every draft block and verify outcome enumerated -> {(a, y_1..y_{a+1}): P(τ = a and the round
    emits y_1..y_{a+1})}. Block: `ops.verification.block_weights` (the loop's rule); token-wise: accept draft j
    with probability min(1, P/Q), else emit from (P − Q)+ normalized."""
    import itertools
    from dsv4_jax.ops import verification as vf
    out = {}
    for x in itertools.product(range(V), repeat=n):
        pq = np.prod([Q(x[:j])[x[j]] for j in range(n)])
        p_rows = np.stack([P(x[:j]) for j in range(n + 1)])
        q_rows = np.stack([Q(x[:j]) for j in range(n)])
        if rule == "block":
            keep, h = (np.asarray(x)[0] for x in vf.block_weights(jnp.asarray(p_rows[None]), jnp.asarray(q_rows[None]),
                                                                  jnp.asarray(np.array(x)[None]), jnp.asarray([n])))
            hh = np.concatenate([[1.0], h[:n]])                           # h_0 = 1: τ = 0 when no η_i <= h_i
            tau = [hh[a] * np.prod(1 - hh[a + 1:]) for a in range(n + 1)]
            resid = lambda a: np.maximum(keep[a] * p_rows[a] - q_rows[a], 0.0)
        else:
            beta = np.minimum(1.0, [p_rows[j][x[j]] / q_rows[j][x[j]] for j in range(n)])
            tau = [np.prod(beta[:a]) * (1 - beta[a] if a < n else 1.0) for a in range(n + 1)]
            resid = lambda a: np.maximum(p_rows[a] - q_rows[a], 0.0)
        for a in range(n + 1):
            nxt = p_rows[n] if a == n else resid(a) / resid(a).sum() if resid(a).sum() > 0 else 0 * p_rows[a]
            for y in range(V):
                key = (a,) + tuple(x[:a]) + (y,)
                out[key] = out.get(key, 0.0) + pq * tau[a] * nxt[y]
    return out


@pytest.mark.parametrize("rule", ["token", "block"])
@pytest.mark.parametrize("n", [2, 3])
def test_round_survival_is_the_rounds_law_given_the_path(rule, n):
    """Enumerated over every draft block and verify draw (V = 3, prefix-dependent P and Q): given the tokens the
    round emits, P(τ = a | path) = S_a − S_{a+1} of `round_survival` (token: Π min(1, q/p); block: the running
    minimum of Π q/p), and the emitted tokens are distributed as the target's (lossless)."""
    import itertools
    V = 3
    rng = np.random.default_rng(n)
    table = {}
    dist = lambda key: table.setdefault(key, rng.dirichlet(np.full(V, 0.7)))
    P, Q = (lambda x: dist(("p",) + tuple(x))), (lambda x: dist(("q",) + tuple(x)))
    joint = _enumerate_round(P, Q, n, V, rule)
    for y in itertools.product(range(V), repeat=n + 1):
        py = [P(y[:m])[y[m]] for m in range(n + 1)]
        log_ratio = np.log([Q(y[:m])[y[m]] / py[m] for m in range(n)])
        S = W.round_survival(log_ratio[None], n, rule)[0]
        want = S - np.append(S[1:], 0.0)                                           # P(τ = a | y), a = 0..n
        got = [joint[(a,) + y[:a + 1]] / np.prod(py[:a + 1]) for a in range(n + 1)]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # block verification never accepts less than token-wise along the same path
    lr = np.log(rng.uniform(0.05, 3.0, size=(200, n)))
    assert (W.round_survival(lr, n, "block") >= W.round_survival(lr, n, "token") - 1e-12).all()


def test_expected_walk_equals_the_backward_recursion():
    """Visit weights forward (v(i + a + 1) += v(i)·P(τ = a | i)) against E[rounds], E[accepted] by recursion from
    each anchor backwards, on a hand-made survival; the budget stops the walk."""
    rng = np.random.default_rng(1)
    A, w, stop = 9, 2, 7
    S = np.concatenate([np.ones((A, 1)), np.cumprod(rng.uniform(0.2, 1.0, (A, w)), axis=1)], axis=1)
    dist = S - np.concatenate([S[:, 1:], np.zeros((A, 1))], axis=1)
    rounds, acc = np.zeros(A + w + 2), np.zeros(A + w + 2)
    for i in reversed(range(stop)):
        rounds[i] = 1 + sum(dist[i, a] * rounds[i + a + 1] for a in range(w + 1))
        acc[i] = S[i, 1:].sum() + sum(dist[i, a] * acc[i + a + 1] for a in range(w + 1))
    e = W.expected_walk(S, stop)
    assert e["rounds"] == pytest.approx(rounds[0]) and e["accepted"] == pytest.approx(acc[0])
    assert sum(e["per_position_accepted"]) == pytest.approx(acc[0])
    assert e["visits"][0] == 1.0 and not e["visits"][stop:].any()
    # every anchor accepts everything (S = 1): rounds of w + 1 tokens from anchor 0 — anchors 0, 3, 6
    e = W.expected_walk(np.ones((A, w + 1)), stop)
    assert e["rounds"] == 3 and e["accepted"] == 6 and list(np.flatnonzero(e["visits"])) == [0, 3, 6]


# block in the slow set: its per-round law is checked exactly against an enumeration through the real
# `block_weights` (test_round_survival_is_the_rounds_law_given_the_path), the walk over loop paths by token
@pytest.mark.parametrize("rule", ["token", pytest.param("block", marks=pytest.mark.slow)])
def test_the_sampled_estimate_on_the_loops_own_paths_gives_its_rounds(run, rule):
    """The loop at T = 0.8 (DSpark, k = 3, 48 rows: the 3 prompts 16 times): its paths fed to `along_path`,
    Σ rows of the expected rounds given each path (`round_survival` under the loop's verify rule, `expected_walk`)
    against the rounds the loop ran, within 4 % (≈ 4 standard deviations of the verify draws given the paths: on the
    bundled model their sd is ≈ 1 % of ~800 rounds; experiments/results/whatif_2026-12-07.md §5.2)."""
    model, prompts, *_ = run
    rows, k, T = [p for p in prompts for _ in range(16)], 3, 0.8
    g = d.generate(model.params, model.bundle, rows, N, drafter="dspark", draft_n_max=k, verify=rule,
                   temperature=T, seed=0, eos_token_id=-1, pad_to=48, max_len=48 + N + k + 1)
    paths = [W.Path(np.asarray(p, np.int32), np.asarray(t, np.int32)) for p, t in zip(rows, g.tokens)]
    assert len({tuple(p.tokens) for p in paths}) > 40                # the rows sampled different paths
    target = W.target_pass(model.params, model.config, paths, tuple(model.draft_setup("dspark", k).taps),
                           tempered=(T, 1.0))
    along = W.along_path(model.params, model.bundle, paths, "dspark", k, N - 1, target)
    expected = sum(W.expected_walk(W.round_survival(along.log_ratio[b], k, rule), N - 1)["rounds"]
                   for b in range(len(paths)))
    ran = g.stats["rounds"]
    assert expected == pytest.approx(ran, rel=0.04), (expected, ran)
