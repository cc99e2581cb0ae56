"""The width scheduler (docs/width_scheduler.md): its math on hand-computed cases, lossless generation under
draft_n_max="auto" (greedy equal to plain decoding for MTP, DSpark and n-gram; the sampling law at T = 0.8),
and cost tables (files, errors, calibration and its cache)."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax as d
from dsv4_jax.demo import tiny_demo
from dsv4_jax.model.params import init_mtp
from dsv4_jax.drafters import registry
from dsv4_jax.ops import verification, width
from dsv4_jax.speculative import cost_table, generate as spec_generate, loop, stats as S, width_policy
from dsv4_jax.speculative.cost_table import CostTable, CostTableError
from dsv4_jax.training.evaluate import heldout_prompts

from .test_spec_mtp import _softmax, _top_p, tv_threshold

BOUND = 2
POOL = ("mtp", "dspark", "ngram")


# ---- the math -------------------------------------------------------------------------------------

def test_expected_tokens_by_hand():
    """T_w = 1 + Σ_{i<=min(w,n)} Π_{l<=i} e_l, summed over live sequences."""
    est = jnp.asarray([[0.5, 0.4, 0.9], [1.0, 1.0, 1.0], [0.9, 0.9, 0.9]])
    n = jnp.asarray([3, 1, 2])
    live = jnp.asarray([True, True, False])
    got = np.asarray(width.expected_tokens(est, n, live))
    # row 0: 1, 1.5, 1.7, 1.88 ; row 1 (n = 1): 1, 2, 2, 2 ; row 2 not live
    np.testing.assert_allclose(got, [2.0, 3.5, 3.7, 3.88], rtol=1e-6)


def test_best_width_maximises_tokens_per_second():
    tokens = jnp.asarray([2.0, 3.5, 3.7, 3.88])
    # rates: 2/1 = 2, 3.5/1.5 = 2.33, 3.7/1.8 = 2.06, 3.88/2.5 = 1.55
    assert int(width.best_width(tokens, jnp.asarray([1.0, 1.5, 1.8, 2.5]), jnp.int32(3))) == 1
    # a cheap verify pays for the whole block; the bound caps it
    assert int(width.best_width(tokens, jnp.asarray([1.0, 1.0, 1.0, 1.0]), jnp.int32(3))) == 3
    assert int(width.best_width(tokens, jnp.asarray([1.0, 1.0, 1.0, 1.0]), jnp.int32(2))) == 2
    # verify so dear that no draft pays: width 0
    assert int(width.best_width(tokens, jnp.asarray([1.0, 9.0, 9.0, 9.0]), jnp.int32(3))) == 0


def test_keep_drafting_stops_when_the_next_draft_cannot_pay():
    est = jnp.asarray([[0.9, 0.0, 0.0]])
    cost = jnp.asarray([1.0, 1.2, 1.4, 1.6])
    # after 1 draft: width 1 rate (1.9 / 1.2 = 1.58) vs width 2 with e_2 := 0.9 (2.71 / 1.4 = 1.94): continue
    assert bool(width.keep_drafting(est, jnp.int32(1), cost, jnp.int32(3)))
    low = jnp.asarray([[0.2, 0.0, 0.0]])
    # width 0: 1.0, width 1: 1.2 / 1.2 = 1.0, width 2: (1 + .2 + .04) / 1.4 = 0.89 < 1: stop
    assert not bool(width.keep_drafting(low, jnp.int32(1), cost, jnp.int32(3)))
    assert not bool(width.keep_drafting(est, jnp.int32(3), cost, jnp.int32(3)))      # at the bound


def test_measured_costs_made_physical():
    """A drafter's round never below a plain one, wider never cheaper (running maximum)."""
    assert cost_table.physical((3.1, 2.9, 4.0, 3.5), 3.5) == (3.5, 3.5, 4.0, 4.0)
    assert cost_table.physical((1.0, 2.0), 0.5) == (1.0, 2.0)
    # a fixed width's predicted speed-up uses what was measured for it; the scheduler's costs are physical
    t = CostTable(seconds=(3.5, 3.5, 4.0, 4.0), plain_seconds=3.5, raw_seconds=(3.1, 2.9, 4.0, 3.5))
    assert t.predicted_speedup(2.0, 1) == pytest.approx(2.0 * 3.5 / 2.9) and t.costs(3)[0][1] == 3.5


def test_calibration_prices_widths_by_their_ratio_to_plain_within_a_pass():
    """A host whose speed changes between calibration passes (load from other processes): each width is timed
    beside plain in every pass and priced by its median ratio to plain, so the table's ratios are the machine's
    (blocks of repeats per width would price the widths timed in a slow stretch too dear)."""
    from dsv4_jax.drafters.base import MODE_PLAIN, Knobs
    true = {"plain": 1.0, 0: 1.4, 1: 2.0, 2: 2.6, 3: 3.1}
    speed = [1.0, 1.0, 2.5, 0.8, 1.7]                  # the host's slowdown in each pass (the warm-up: pass 0)
    calls = []

    def time_at(knobs):
        w = "plain" if int(knobs.width_mode) == MODE_PLAIN else int(knobs.draft_n)
        calls.append(w)
        return true[w] * speed[(len(calls) - 2) // 5 + 1 if len(calls) > 1 else 0]

    knobs = Knobs(temperature=jnp.float32(0.0), top_p=jnp.float32(1.0), drafter=None)
    t = cost_table.measure(time_at, knobs, 3, repeats=4)
    assert len(calls) == 1 + 4 * 5
    assert t.plain_seconds == pytest.approx(np.median([s * true["plain"] for s in speed[1:]]))
    for w in range(4):
        assert t.raw_seconds[w] / t.plain_seconds == pytest.approx(true[w] / true["plain"], rel=1e-6)


def test_calibration_factors():
    accepted = jnp.asarray([[3, 1], [1, 0]])
    raw = jnp.asarray([[5.0, 2.0], [3.0, 1.0]])
    np.testing.assert_allclose(np.asarray(width.scale(accepted, raw)), [(4 + 1) / (8 + 1), (1 + 1) / (3 + 1)])
    np.testing.assert_allclose(np.asarray(width.calibrated(jnp.asarray([[1.0, 0.5]]), jnp.asarray([0.5, 4.0]))),
                               [[0.5, 1.0]])


def test_statistics_groups_by_hand():
    """`speculative.stats`: one drafting round (sequence 0 verifies 2 drafts and accepts 1; sequence 1 done), then
    2 plain rounds of sequence 0 — the core, the width group and the per-round trace."""
    spec = S.StatsSpec(verification=False, width=True, trace=True)
    s = S.zeros(spec, 2, 3, 5)
    assert [type(g) for g in s.groups] == [S.Width, S.Trace] and s.group(S.Verification) is None
    o = verification.Outcome(n_accept=jnp.asarray([1, 0]), next=jnp.asarray([0, 0]), expected=jnp.zeros((2, 2)),
                             alpha=jnp.zeros((2, 2)))
    est = jnp.asarray([[0.5, 0.5], [0.5, 0.5]])
    s = S.add_round(s, S.Observed(active=jnp.asarray([True, False]), n_draft=jnp.asarray([2, 0]),
                                  n_accept=jnp.asarray([1, 0]), outcome=o, conf=None, est=est, raw=est,
                                  offered=jnp.asarray([True, False]), cost=jnp.float32(1.5), w=2,
                                  r0=s.core.rounds))
    s = S.add_plain(s, jnp.asarray([2, 0]), jnp.float32(1.0))
    class P:        # what the summaries read of the program
        drafter, greedy, verify, synthetic_accept, forced_acceptance = registry.get("mtp"), True, "token", None, False
    out = S.summary(jax.tree.map(np.asarray, s), P, 2)
    assert out["rounds"] == 3 and out["drafted"] == 2 and out["accepted"] == 1
    assert out["per_position_accepted"] == [1, 0] and out["draft_length_histogram"] == [2, 0, 1]
    assert out["width_histogram"] == {"0": 0, "1": 0, "2": 1, "plain": 2} and out["drafting_rounds"] == 1
    assert out["modelled_cost_s"] == 3.5 and out["expected_tokens_per_round"] == pytest.approx((1.75 + 2) / 3)
    assert out["per_round_accepted"] == [[1, 0, 0], []] and out["per_round_drafted"] == [[2, 0, 0], []]


# ---- cost tables --------------------------------------------------------------------------------------

def test_cost_table_file_round_trip_and_errors(tmp_path):
    t = CostTable(seconds=(1e-3, 1.5e-3, 2e-3), plain_seconds=0.9e-3, drafter="mtp", batch=2)
    path = tmp_path / "costs.json"
    t.save(str(path))
    assert CostTable.load(str(path)) == t
    assert t.bound == 2 and abs(t.predicted_speedup(2.0, 1) - 2.0 * 0.9 / 1.5) < 1e-12
    assert abs(t.break_even(2) - 2.0 / 0.9) < 1e-12 and "break-even" in "\n".join(t.lines())
    with pytest.raises(CostTableError, match="prices up to 2"):
        t.costs(3)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(CostTableError, match="bad.json.*not JSON"):
        CostTable.load(str(bad))
    bad.write_text(json.dumps({"format": cost_table.FORMAT, "seconds": [1.0, -1.0], "plain_seconds": 1.0}))
    with pytest.raises(CostTableError, match="bad.json.*positive"):
        CostTable.load(str(bad))
    bad.write_text(json.dumps({"seconds": [1.0]}))
    with pytest.raises(CostTableError, match="not a cost table"):
        CostTable.load(str(bad))
    with pytest.raises(CostTableError, match="missing.json"):
        CostTable.load(str(tmp_path / "missing.json"))


def test_cost_table_from_an_aot_report(tmp_path):
    """The committed v5p:2x2x2 bf16 report: decode (plain) and verify of 4 tokens (width 3), widths 1, 2 between."""
    path = os.path.join(os.path.dirname(__file__), "..", "experiments", "results", "aot_2026-12-01_v5p-2x2x2_bf16.json")
    with open(path) as f:
        est = {p["program"]: p["estimate"]["roofline_s"] for p in json.load(f)["runs"][0]["programs"]}
    t = cost_table.from_aot_report(path, "mtp", weights="bf16")
    assert t.batch == 8 and t.bound == 3 and t.plain_seconds == est["decode"]
    assert t.seconds[0] == est["decode"] and t.seconds[3] == pytest.approx(est["verify"])
    assert t.seconds[1] == pytest.approx(est["decode"] + (est["verify"] - est["decode"]) / 3)
    bad = tmp_path / "report.json"
    bad.write_text(json.dumps({"runs": [], "shapes": {"batch": 1}}))
    with pytest.raises(CostTableError, match="report.json.*no run"):
        cost_table.from_aot_report(str(bad), "mtp")
    # the latency basis: each program's latency roofline (the roofline + 1 ms here)
    with open(path) as f:
        rep = json.load(f)
    for p in rep["runs"][0]["programs"]:
        p["estimate"]["latency_roofline_s"] = p["estimate"]["roofline_s"] + 1e-3
    lat = tmp_path / "lat.json"
    lat.write_text(json.dumps(rep))
    t2 = cost_table.from_aot_report(str(lat), "mtp", weights="bf16", basis="latency")
    assert t2.plain_seconds == pytest.approx(est["decode"] + 1e-3) and t2.source.endswith(":latency")
    assert t2.seconds[3] == pytest.approx(est["verify"] + 1e-3)
    with pytest.raises(CostTableError, match="report.json.*latency estimate"):
        cost_table.from_aot_report(str(bad), "mtp", basis="latency")
    with pytest.raises(CostTableError, match="unknown basis"):
        cost_table.from_aot_report(str(lat), "mtp", basis="bytes")


def test_bad_auto_options():
    demo = _demo()
    with pytest.raises(ValueError, match="needs a drafter"):
        d.generate(demo.params, demo.config, [[1, 2, 3]], 4, draft_n_max="auto")
    with pytest.raises(ValueError, match="integer or 'auto'"):
        d.generate(demo.params, demo.config, [[1, 2, 3]], 4, drafter="mtp", draft_n_max="fast")
    with pytest.raises(ValueError, match="draft_n_max_bound"):
        d.generate(demo.params, demo.config, [[1, 2, 3]], 4, drafter="mtp", draft_n_max="auto", draft_n_max_bound=0)
    with pytest.raises(CostTableError, match="prices up to 1"):
        d.generate(demo.params, demo.config, [[1, 2, 3]], 4, drafter="mtp", draft_n_max="auto",
                   draft_n_max_bound=3, cost_table=CostTable(seconds=(1.0, 2.0), plain_seconds=1.0))


# ---- lossless generation --------------------------------------------------------------------------------

_DEMO = {}


def _demo():
    if "d" not in _DEMO:
        _DEMO["d"] = tiny_demo()
    return _DEMO["d"]


@pytest.fixture(scope="module")
def demo_runs():
    """Greedy plain decoding of three held-out prompts, and the keywords of the pooled auto program."""
    demo = _demo()
    prompts = heldout_prompts(3, prompt_len=40, seed=4)
    kw = dict(eos_token_id=-1, max_len=112, pad_to=40)
    plain, _ = d.generate(demo.params, demo.config, prompts, 48, **kw)
    return demo, prompts, plain, dict(kw, draft_n_max_bound=BOUND, dspark_meta=demo.dspark, drafter_pool=POOL)


# per-width seconds: a cheap verify (the scheduler drafts wide), one where width pays only at high acceptance,
# a plain round so cheap that the run stops drafting within the warm-up rounds, and one where no width can pay
# even with every draft accepted (width w costs more than w + 1 plain rounds: plain from the first round)
TABLES = {"cheap": CostTable(seconds=(1.0, 1.05, 1.1, 1.15), plain_seconds=1.3),
          "steep": CostTable(seconds=(1.0, 1.6, 2.1, 2.5), plain_seconds=1.0),
          "plain": CostTable(seconds=(2.0, 2.1, 2.2, 2.3), plain_seconds=1.0),
          "hopeless": CostTable(seconds=(2.0, 3.0, 4.0, 5.0), plain_seconds=1.0)}


@pytest.mark.parametrize("drafter", POOL)
def test_auto_greedy_equals_plain(demo_runs, drafter):
    """One pooled program (MTP, DSpark, n-gram) with the scheduler; each cost table moves the chosen widths."""
    demo, prompts, plain, kw = demo_runs
    hists = {}
    for name, table in TABLES.items():
        out, st = d.generate(demo.params, demo.config, prompts, 48, drafter=drafter, draft_n_max="auto",
                             cost_table=table, **kw)
        assert out == plain, (drafter, name)
        hists[name] = st["width_histogram"]
        assert st["cost_table"]["how"] == "given" and st["expected_tokens_per_round"] >= 1.0
    print(drafter, hists)
    cheap, steep, plain_h = hists["cheap"], hists["steep"], hists["plain"]
    wide = lambda h: sum(int(w) * n for w, n in h.items() if w != "plain") / max(1, sum(
        n for w, n in h.items() if w != "plain"))
    drafting = lambda h: sum(h.values()) - h["plain"]
    assert wide(cheap) > wide(steep)                    # dearer verify widths: narrower rounds
    # speculation that does not pay stops within the warm-up rounds (3 sequences x 1..WARMUP_ROUNDS: after one
    # where the scheduler's forecast agrees), speculation that cannot pay never starts, cheap one never stops
    assert 3 <= drafting(plain_h) <= 3 * width_policy.WARMUP_ROUNDS < sum(plain_h.values())
    assert drafting(hists["hopeless"]) == 0 < hists["hopeless"]["plain"]
    assert cheap["plain"] < plain_h["plain"]


def test_two_loop_program_equals_the_round_by_round_twin(demo_runs):
    """On the device the scheduler's drafting rounds run until the switch, the plain rounds after it in the
    `none` program (`loop.decode`); the host-driven twin takes the same decision inside every round
    (`round.round_step`).
    Same tokens and the same statistics, the switch included (the "plain" table forces it)."""
    demo, prompts, plain, kw = demo_runs
    run = lambda host: d.generate(demo.params, demo.config, prompts, 48, drafter="dspark", draft_n_max="auto",
                                  cost_table=TABLES["plain"], host_loop=host, **kw)
    (a, sa), (b, sb) = run(False), run(True)
    assert a == b == plain
    assert sa["width_histogram"] == sb["width_histogram"] and sa["width_histogram"]["plain"] > 0
    assert sa["expected_tokens_per_round"] == sb["expected_tokens_per_round"]


def test_plain_rounds_after_the_switch_run_the_none_programs_executable(demo_runs):
    """After the switch to plain decoding the rest of an auto run executes the loop a drafter=None run of the
    same shapes compiles (`loop.decode`): that run then compiles no loop of its own. The drafting rounds
    before the switch are reported."""
    demo, prompts, plain, kw = demo_runs
    out, st = d.generate(demo.params, demo.config, prompts, 48, drafter="mtp", draft_n_max="auto",
                         cost_table=TABLES["plain"], **kw)
    n = loop.run_rounds._cache_size()
    none, _ = d.generate(demo.params, demo.config, prompts, 48, max_block=BOUND + 1, **kw)
    assert loop.run_rounds._cache_size() == n
    assert out == none == plain and st["width_histogram"]["plain"] > 0
    assert 0 < st["drafting_rounds"] == st["rounds"] - st["width_histogram"]["plain"]


def test_fixed_widths_in_the_scheduler_program_equal_plain(demo_runs):
    """RunShape.adaptive_widths: fixed draft_n_max runs share the scheduler's program; same tokens, their width."""
    demo, prompts, plain, kw = demo_runs
    kw = {k: v for k, v in kw.items() if k != "draft_n_max_bound"}
    out, st = d.generate(demo.params, demo.config, prompts, 48, drafter="mtp", draft_n_max=2, max_block=BOUND + 1,
                         dynamic_draft_n=True, adaptive_widths=True, **kw)
    assert out == plain
    assert st["width_histogram"]["2"] == sum(st["width_histogram"].values()) > 0


def test_auto_sampling_is_lossless_on_a_tiny_vocabulary():
    """The MTP sampling-law test (tests/test_spec_mtp.py, N = 5000: TV(empirical, exact) < tv_threshold(exact),
    exceeded by a lossless sampler with probability <= 1e-6; a sampler whose law is farther than that threshold
    + tv_radius(N, 64) fails with probability >= 1 − 1e-6) at T = 0.8 under draft_n_max="auto": the round's
    width chosen on the device from the 5000 rows' drafts (one width for the batch; the greedy tests above show
    the width varying between rounds)."""
    V, N, temp, top_p = 8, 5000, 0.8, 0.9
    config = d.tiny().replace(vocab_size=V, name="tiny-v8")
    params = d.init_params(config, 21)
    params["mtp"] = init_mtp(config, 22)
    prompt = [3, 1, 4, 1, 5, 2]
    # one forward of the V continuations: row x1's logits at the prompt's last position are the prompt's own
    logits = np.asarray(d.forward(params, config, jnp.asarray([prompt + [x1] for x1 in range(V)])))
    p1 = _top_p(_softmax(logits[0, -2] / temp), top_p)
    exact = np.zeros((V, V))
    for x1 in range(V):
        exact[x1] = p1[x1] * _top_p(_softmax(logits[x1, -1] / temp), top_p)
    table = CostTable(seconds=(1.0, 1.1, 1.2, 1.3), plain_seconds=2.0)
    toks, st = d.generate(params, config, [prompt] * N, 2, temperature=temp, top_p=top_p, drafter="mtp",
                          draft_n_max="auto", draft_n_max_bound=BOUND, cost_table=table, eos_token_id=-1, seed=5,
                          max_len=16)
    counts = np.zeros((V, V))
    for t in toks:
        counts[t[0], t[1]] += 1
    tv = 0.5 * np.abs(counts / N - exact).sum()
    threshold = tv_threshold(exact, N)
    h = st["width_histogram"]
    print(f"auto: TV(empirical, exact) = {tv:.4f} (< {threshold:.4f}), widths {h}, "
          f"accept rate {st['draft_acceptance_rate']:.3f}")
    assert tv < threshold
    assert h["0"] == 0 and h["plain"] == 0 and sum(h.values()) == N    # the scheduler verified drafts
    assert 0.05 < st["draft_acceptance_rate"] < 0.95


def test_calibration_measures_and_caches(demo_runs, tmp_path):
    """calibrate() times the run's own program (the pooled one above: no new compile) at each width and plain;
    a second call reads the cache."""
    demo, prompts, _, kw = demo_runs
    r = spec_generate.prepare(demo.params, demo.config, prompts, 48, drafter="mtp", draft_n_max="auto", **kw)
    lines = []
    t, how = cost_table.cached_or_calibrate(demo.params, r.config, r, cache_dir=str(tmp_path), repeats=1,
                                            progress=lines.append)
    assert how == "measured" and t.bound == BOUND and t.plain_seconds > 0 and len(lines) == 1   # one progress line per pass
    assert t.seconds == cost_table.physical(t.raw_seconds, t.plain_seconds)
    assert t.key["shapes"]["batch"] == 3 and t.key["shapes"]["k"] == BOUND and t.batch == 3
    again, how = cost_table.cached_or_calibrate(demo.params, r.config, r, cache_dir=str(tmp_path))
    assert how == "cached" and again == t
    assert len(list(tmp_path.iterdir())) == 1
