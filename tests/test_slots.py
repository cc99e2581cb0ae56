"""Continuous batching (`speculative.slots`, `speculative.scheduler`): lossless against each request decoded alone, one
compiled chunk program across refills, per-request statistics, bad input.

Reference: every prompt decoded alone by `generate` (batch 1, no drafter, greedy, no EOS) with the largest
budget; a request's expected tokens are that sequence cut (in the test) at its own budget and at the first
EOS. Speculative decoding is lossless for greedy, so the same reference serves all three drafters. The
model is a 2-layer CSA + HCA target (every kind of decode-state leaf: window ring, compressor rings,
compressed rows, indexer keys) with random MTP and DSpark drafters; prompts of 1-3 prefill chunks.
"""
import jax
import numpy as np
import pytest

import dsv4_jax as d
from dsv4_jax.config import _tiny_base
from dsv4_jax.model.decode import CapacityError
from dsv4_jax.drafters.dspark import DSparkConfig
from dsv4_jax.model.params import init_dspark, init_mtp
from dsv4_jax.speculative import prefill as F, slots as S
from dsv4_jax.speculative.scheduler import SlotEngine, call_widths, prefill_widths

from .eight_devices import host_devices_flags

PREFILL_LEN = 8
MAX_LEN = 64
N_REQ = 7


@pytest.fixture(scope="module")
def model():
    cfg = _tiny_base(name="slots-test", ratios=[4, 8], n_hash=0, hc_mult=2, hc_sinkhorn_iters=3, n_routed_experts=4,
                     num_heads=2, o_groups=2)
    params = d.init_params(cfg, 0)
    params["mtp"] = init_mtp(cfg, 1)
    params["dspark"] = init_dspark(cfg, 2, n_stages=1, n_taps=2, markov_rank=8)
    meta = DSparkConfig(block_size=3, noise_token_id=cfg.vocab_size - 1, target_layer_ids=(0, 1))
    return cfg, params, meta


@pytest.fixture(scope="module")
def requests():
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 90, int(n)).tolist() for n in (3, 9, 20, 5, 12, 1, 17)]   # 1-3 chunks of 8
    budgets = [7, 1, 24, 3, 16, 11, 5]                                                      # 1 = the first token only
    return prompts, budgets


@pytest.fixture(scope="module")
def alone(model, requests):
    """Each prompt decoded by itself: plain greedy `generate`, batch 1, the largest budget, no EOS."""
    cfg, params, _ = model
    prompts, budgets = requests
    longest = max(len(p) for p in prompts)
    return [d.generate(params, cfg, [p], max(budgets), eos_token_id=-1, pad_to=longest, max_len=MAX_LEN)[0][0]
            for p in prompts]


@pytest.fixture(scope="module")
def eos(alone):
    """An EOS id that occurs inside some reference outputs (so that EOS, too, frees slots)."""
    return alone[2][4]


def expected(alone, budgets, eos):
    out = []
    for seq, n in zip(alone, budgets):
        seq = seq[:n]
        out.append(seq[:seq.index(eos) + 1] if eos in seq else seq)
    return out


def engine(model, requests, drafter, batch, eos, **kw) -> SlotEngine:
    cfg, params, meta = model
    prompts, budgets = requests
    return SlotEngine.build(params, cfg, prompts, budgets, batch=batch, chunk_rounds=kw.pop("chunk_rounds", 6),
                            prefill_len=PREFILL_LEN, max_len=MAX_LEN, drafter=drafter, draft_n_max=2,
                            dspark_meta=meta, eos_token_id=eos, **kw)


@pytest.fixture(scope="module")
def none_b2(model, requests, eos):
    return engine(model, requests, None, 2, eos)


def _check_requests(run, want, budgets, k):
    assert [r.tokens for r in run.results] == want
    for r, n in zip(run.results, budgets):
        assert r.generated == len(r.tokens) <= n and r.max_new_tokens == n
        # a round emits its accepted drafts and one more token; the first token comes from the prefill
        assert r.rounds <= r.generated - 1 <= r.rounds + r.accepted
        assert r.accepted <= r.drafted <= k * r.rounds
        assert sum(r.per_position_accepted) == r.accepted and len(r.per_position_accepted) == k
        assert all(a <= p for a, p in zip(r.per_position_accepted, r.per_position_proposed))
        assert 0 <= r.admitted_s <= r.first_token_s <= r.finished_s <= run.wall_s


LOSSLESS = [pytest.param(None, 2, id="none-B2"), pytest.param("mtp", 4, id="mtp-B4"),
            pytest.param("dspark", 2, id="dspark-B2"),
            pytest.param(None, 4, id="none-B4", marks=pytest.mark.slow),
            pytest.param("mtp", 2, id="mtp-B2", marks=pytest.mark.slow),
            pytest.param("dspark", 4, id="dspark-B4", marks=pytest.mark.slow)]


@pytest.mark.parametrize("drafter, batch", LOSSLESS)
def test_every_request_equals_it_decoded_alone(model, requests, alone, eos, none_b2, drafter, batch):
    """7 requests through B slots, continuous and static: each gets exactly its tokens decoded alone."""
    prompts, budgets = requests
    eng = none_b2 if (drafter, batch) == (None, 2) else engine(model, requests, drafter, batch, eos)
    want = expected(alone, budgets, eos)
    assert any(eos in w for w in want) and any(len(w) == n for w, n in zip(want, budgets))
    runs = {schedule: eng.run(schedule) for schedule in ("continuous", "static")}
    for run in runs.values():
        _check_requests(run, want, budgets, eng.program.k)
        assert {r.slot for r in run.results} == set(range(batch))
    # static admits a batch when the previous one is done; continuous refills slots while others run
    admissions = {s: len({r.admitted_chunk for r in run.results}) for s, run in runs.items()}
    assert admissions["static"] == -(-N_REQ // batch) < admissions["continuous"]
    if drafter is not None:
        assert sum(r.drafted for r in runs["continuous"].results) > 0


def test_one_chunk_program_across_refills(model, requests, alone, eos, none_b2):
    """Refills (a chunk per finished request) and a second engine with other prompts and budgets but the
    same (config, B, max_len, draft_n_max) compile nothing new."""
    none_b2.warm_up()
    sizes = lambda: (S.run_chunk._cache_size(), F.prefill_piece._cache_size(), F.prime_piece._cache_size(),
                     S.insert._cache_size(), S.init_rows._cache_size())
    before = sizes()
    run = none_b2.run("continuous")
    assert run.chunks >= N_REQ                     # a chunk ends at each finish: at least one per request
    prompts, budgets = requests
    other = (list(reversed(prompts)), [b + 2 for b in reversed(budgets)])
    eng2 = engine(model, other, None, 2, eos, chunk_rounds=3, refill_min=2, prefill_ahead=5)
    run2 = eng2.run("continuous")
    run3 = eng2.run("static")
    assert sizes() == before
    # prefill ahead of the slots: the first 5 requests prefilled together (their rows wait for slots), then
    # the last 2; under continuous the 5 enter their slots at different chunks
    for run in (run2, run3):
        first = {r.admitted_s for r in run.results[:5]}
        assert len(first) == 1 and run.results[5].admitted_s == run.results[6].admitted_s > first.pop()
    assert len({r.admitted_chunk for r in run2.results[:5]}) > 2 and run2.prefill_calls == run3.prefill_calls
    assert [r.tokens for r in run2.results] == [r.tokens for r in run3.results] == \
        expected(list(reversed(alone)), other[1], eos)


def test_prefill_widths():
    assert prefill_widths(1) == (1,) and prefill_widths(2) == (1, 2) and prefill_widths(4) == (1, 2, 4)
    assert prefill_widths(6) == (1, 2, 4, 6) and prefill_widths(16) == (1, 2, 4, 8, 16)


@pytest.mark.parametrize("n, widths, want", [
    (1, (1, 2, 4), [1]), (3, (1, 2, 4), [4]), (5, (1, 2, 4), [4, 1]), (6, (1, 2, 4), [4, 2]),
    (9, (1, 2, 4), [4, 4, 1]), (3, (1, 2), [2, 1]), (5, (1, 2, 4, 6), [6]),
    (26, prefill_widths(32), [16, 8, 2]), (30, prefill_widths(32), [32]), (7, prefill_widths(32), [8]),
    (70, prefill_widths(32), [32, 32, 4, 2])])
def test_call_widths(n, widths, want):
    """Pad a group up to a width only when that pads no more rows than splitting it adds calls."""
    got = call_widths(n, widths)
    assert got == want and sum(got) >= n and all(w in widths for w in got)
    assert sum(got[:-1]) < n                      # no call is wholly padding


def test_batched_admission_equals_one_at_a_time(model, eos):
    """Three requests of 2 prefill chunks (one a row shorter) admitted by one [4, C] call per chunk (a
    padded, masked row) write the same slot state as each admitted alone; the fourth slot is untouched."""
    cfg, params, meta = model
    rng = np.random.default_rng(1)
    prompts = [rng.integers(2, 90, n).tolist() for n in (16, 11, 9)]
    eng = engine(model, (prompts, [5, 6, 7]), "mtp", 4, eos)       # the programs of the mtp-B4 case
    empty = lambda: S.empty_carry(params, eng.config, batch=4, max_len=MAX_LEN, program=eng.program,
                                  key=jax.random.PRNGKey(0))
    group, calls = eng.admit(empty(), [(0, 3), (1, 0), (2, 1)], jax.random.PRNGKey(0))
    assert calls == 2                                   # one call per chunk for all three rows
    alone = empty()
    for i, b in [(0, 3), (1, 0), (2, 1)]:
        alone, calls = eng.admit(alone, [(i, b)], jax.random.PRNGKey(0))
        assert calls == 2
    ref = empty()
    for ax, g, a, e in zip(eng.carry_axes, *(jax.tree.leaves(c) for c in (group, alone, ref))):
        if ax is None:
            continue
        g, a, e = (np.moveaxis(np.asarray(x, np.float32), ax, 0) for x in (g, a, e))
        np.testing.assert_allclose(g[[0, 1, 3]], a[[0, 1, 3]], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(g[2], e[2])      # slot 2 got no row
    assert np.asarray(group.limit).tolist() == [6, 7, 0, 5]


def test_refill_min_groups_refills(model, requests, alone, eos):
    """refill_min 2: a chunk runs until two sequences finished, freed slots refilled together — fewer
    refills than requests, and still every request's own tokens and statistics. prefill_ahead 1: each
    refill prefills just the requests it takes (no rows wait for a slot)."""
    prompts, budgets = requests
    eng = engine(model, requests, "mtp", 4, eos, refill_min=2, prefill_ahead=1)
    run = eng.run("continuous")
    _check_requests(run, expected(alone, budgets, eos), budgets, eng.program.k)
    assert run.refills < N_REQ - 3 and run.prefill_calls >= run.refills
    assert 0 < run.decode_s < run.wall_s


def test_slot_utilization(none_b2):
    """Continuous keeps the slots busier than static: fewer rounds for the same tokens."""
    static, cont = none_b2.run("static"), none_b2.run("continuous")
    assert cont.rounds < static.rounds and cont.slot_utilization > static.slot_utilization
    assert cont.generated == static.generated


def test_batch_axes_of_the_carry(model):
    """Every batch-sized leaf of the carry has its batch axis found (layers: [reps, B, ...]; drafter: any)."""
    cfg, params, meta = model
    eng = SlotEngine.build(params, cfg, [[3, 4]], 2, batch=3, max_len=MAX_LEN, prefill_len=PREFILL_LEN,
                           drafter="dspark", draft_n_max=2, dspark_meta=meta)
    shapes = jax.eval_shape(lambda: S.empty_carry(params, eng.config, batch=3, max_len=MAX_LEN,
                                                  program=eng.program, key=jax.random.PRNGKey(0)))
    leaves = jax.tree.leaves(shapes)
    assert len(eng.carry_axes) == len(leaves)
    for ax, leaf in zip(eng.carry_axes, leaves):
        assert ax is None and leaf.shape in ((), (2,)) or leaf.shape[ax] == 3     # None: round counter, RNG key
    assert sum(ax is None for ax in eng.carry_axes) == 2
    assert {0, 1} <= set(eng.carry_axes)      # [B, ...] and [reps or stages, B, ...] leaves


def test_bad_requests(model):
    cfg, params, meta = model
    with pytest.raises(ValueError, match="one max_new_tokens per prompt"):
        SlotEngine.build(params, cfg, [[1, 2], [3]], [4], batch=2)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        SlotEngine.build(params, cfg, [[1, 2]], [0], batch=2)
    with pytest.raises(CapacityError, match="max_len=16"):
        SlotEngine.build(params, cfg, [[1] * 9], 8, batch=2, max_len=16, prefill_len=8)
    with pytest.raises(ValueError, match="prompt token ids"):
        SlotEngine.build(params, cfg, [[1, 999]], 4, batch=2)
    with pytest.raises(ValueError, match="batch, chunk_rounds, prefill_len, prefill_ahead and refill_min"):
        SlotEngine.build(params, cfg, [[1, 2]], 4, batch=0)
    with pytest.raises(ValueError, match="refill_min must be >= 1"):
        SlotEngine.build(params, cfg, [[1, 2]], 4, batch=2, refill_min=0)
    eng = SlotEngine.build(params, cfg, [[1, 2]], 4, batch=1, max_len=MAX_LEN, prefill_len=PREFILL_LEN)
    with pytest.raises(ValueError, match="schedule must be one of"):
        eng.run("fifo")
    assert eng.program.max_new_tokens == MAX_LEN        # the output buffer: budgets are per-request data


MESH_SCRIPT = r"""
import jax, numpy as np
import dsv4_jax as d
from dsv4_jax import parallel as sharding
from dsv4_jax.config import _tiny_base
from dsv4_jax.model.params import init_mtp
from dsv4_jax.speculative import prefill as F, slots as S
from dsv4_jax.speculative.scheduler import SlotEngine, prefill_widths
cfg = _tiny_base(name="slots-mesh", ratios=[4, 8], n_hash=0, hc_mult=2, hc_sinkhorn_iters=3, n_routed_experts=4,
                 num_heads=2, o_groups=2)
params = d.init_params(cfg, 0)
params["mtp"] = init_mtp(cfg, 1)
rng = np.random.default_rng(0)
prompts = [rng.integers(2, 90, int(n)).tolist() for n in (3, 9, 20, 5, 12)]
budgets = [7, 2, 12, 3, 9]
kw = dict(batch=2, chunk_rounds=4, prefill_len=8, max_len=64, drafter="mtp", draft_n_max=2, eos_token_id=-1)
want = [r.tokens for r in SlotEngine.build(params, cfg, prompts, budgets, **kw).run("continuous").results]
sp = sharding.shard_params(params, cfg, sharding.make_mesh((1, 2, 1)))
eng = SlotEngine.build(sp, cfg, prompts, budgets, **kw)
got = [r.tokens for r in eng.run("continuous").results]
n = S.run_chunk._cache_size()
again = [r.tokens for r in eng.run("static").results]
assert got == want == again, (got, want, again)
assert S.run_chunk._cache_size() == n, (n, S.run_chunk._cache_size())
print("MESH_OK", n)
"""


@pytest.mark.slow
def test_sharded_params_on_a_two_device_mesh():
    """Sharded params (expert axis of 2 host devices): the same tokens as one device, no recompilation."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=host_devices_flags(2, fast_compile=False))
    r = subprocess.run([sys.executable, "-c", MESH_SCRIPT], env=env, capture_output=True, text=True, timeout=900,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0 and "MESH_OK" in r.stdout, r.stderr[-3000:]
