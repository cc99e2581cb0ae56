"""Bandwidth-roofline cost tables (`analysis.roofline.table`, `analysis.roofline`; docs/width_scheduler.md §4):
the prices' shape, a hand count of the bytes on the tiny config, the machines, --roofline on the CLIs.
Abstract shapes only: nothing is compiled."""
import json
import math

import pytest

import dsv4_jax as d
from dsv4_jax.analysis import traffic
from dsv4_jax.model import params as P
from dsv4_jax.research import batch_eval, common, sweep
from dsv4_jax.research.models import random_tiny
from dsv4_jax.research.runner import grid_settings
from dsv4_jax.analysis import roofline
from dsv4_jax.speculative import cost_table
from dsv4_jax.speculative.cost_table import CostTable, CostTableError
from dsv4_jax.speculative.generate import prepare

CONFIG = d.tiny()
FIXED = roofline.DEFAULT_FIXED_US * 1e-6


@pytest.mark.parametrize("drafter", ["mtp", "dspark", "ngram"])
def test_roofline_seconds_increase_with_width(drafter):
    t = roofline.table(CONFIG, drafter, 2, 6, "h100", context=64)
    assert t.bound == 6 and t.drafter == drafter and t.batch == 2 and t.source == "roofline h100"
    assert all(a < b for a, b in zip(t.seconds, t.seconds[1:]))
    assert t.plain_seconds <= t.seconds[0] < t.seconds[1]


def test_a_pooled_programs_cache_key_names_no_process_address():
    """The key a measured table is cached under (`cost_table.cache_key`) holds the program's settings as text:
    a drafter pool's members (dsv4-sweep's programs) must not print their drafter objects' addresses, or no
    other process (the next sweep, dsv4-whatif) ever finds the table."""
    model = random_tiny(seed=0)
    r = prepare(model.params, model.bundle, [[1, 2, 3, 4]], 4, drafter="mtp", draft_n_max="auto",
                  draft_n_max_bound=2, drafter_pool=("mtp", "dspark"))
    key = json.dumps(cost_table.cache_key(r.config, r, "mtp"), sort_keys=True)
    assert "Member(name='mtp'" in key and "Member(name='dspark'" in key
    assert " at 0x" not in key, key


def _hand_bytes(specs, n_tokens: int) -> float:
    """bf16 bytes a pass over n_tokens reads of a ParamSpec tree: 2 per weight element, 4 per float32 one,
    routed experts × E·(1 − (1 − k/E)^n) / E."""
    E, k = CONFIG.n_routed_experts, CONFIG.num_experts_per_tok
    active = k if n_tokens == 1 else E * (1 - (1 - k / E) ** n_tokens)
    total = 0.0
    for path, s in P.flatten(specs).items():
        b = math.prod(s.shape) * (2 if s.kind == "weight" else 4)
        total += b * active / E if ".experts.w" in f".{path}" else b
    return total


def test_roofline_by_hand():
    """The plain round is the one-token decode's bytes bound / bandwidth + the fixed cost; MTP's width 1
    adds the observe of 2 rows per sequence, width 2 a chain step of 1 row (formulas of `roofline`)."""
    B, C, gbps, fixed_us = 3, 40, 1000.0, 7.0
    t = roofline.table(CONFIG, "mtp", B, 2, f"x:{gbps:g}:{fixed_us:g}", context=C)
    at = lambda n_bytes: n_bytes / (gbps * 1e9) + fixed_us * 1e-6
    assert t.plain_seconds == pytest.approx(at(traffic.bytes_bound(CONFIG, "bf16", B, C, 1)["total"]), rel=1e-12)

    V, D, W, dh = CONFIG.vocab_size, CONFIG.hidden_size, CONFIG.sliding_window, CONFIG.head_dim
    mtp = P.mtp_specs(CONFIG)
    shared = lambda rows: 2 * V * D + 2 * rows * D + 2 * B * min(W, C) * dh     # head, embedding rows, window
    observe = lambda w: _hand_bytes(mtp, B * (w + 1)) + shared(B * (w + 1))
    chain = _hand_bytes(mtp, B) + shared(B)
    verify = lambda w: traffic.bytes_bound(CONFIG, "bf16", B, C, w + 1)["total"]
    assert t.seconds[0] == pytest.approx(at(verify(0) + observe(0)), rel=1e-12)
    assert t.seconds[1] == pytest.approx(at(verify(1) + observe(1)), rel=1e-12)
    assert t.seconds[2] == pytest.approx(at(verify(2) + observe(2) + chain), rel=1e-12)


def test_roofline_dspark_markov_steps():
    """DSpark's Markov head runs at least one step (width 0 and 1 alike) and at most γ (wider widths); its
    block pass and observe (dense weights) read the same bytes at every width."""
    by_w = [roofline.drafter_bytes(CONFIG, "dspark", "bf16", 2, 40, w, block=3) for w in (0, 1, 3, 5)]
    assert by_w[0]["markov"] == by_w[1]["markov"] and by_w[2]["markov"] == by_w[3]["markov"] == 3 * by_w[0]["markov"]
    assert by_w[0]["block"] == by_w[3]["block"] and by_w[0]["observe"] == by_w[3]["observe"] > 0


def test_roofline_machines():
    with pytest.raises(CostTableError, match=r"unknown machine 'nosuch'.*h100, h200, .*v5e, v5p, v6e"):
        roofline.table(CONFIG, "mtp", 1, 3, "nosuch", context=16)
    for bad in ("x:0", "x:fast", "x:100:-1"):
        with pytest.raises(CostTableError, match=bad):
            roofline.machine(bad)
    with pytest.raises(CostTableError, match="drafters mtp, dspark, ngram"):
        roofline.table(CONFIG, "oracle", 1, 3, "h100", context=16)
    slow, fast = (roofline.table(CONFIG, "mtp", 1, 3, f"x:{g}", context=16) for g in (1000, 2000))
    for s, f in zip(slow.seconds + (slow.plain_seconds,), fast.seconds + (fast.plain_seconds,)):
        assert s - FIXED == pytest.approx(2 * (f - FIXED), rel=1e-12)
    assert roofline.machine("H200").gbps == 4800 and roofline.machine("trillium").name == "v6e"
    assert roofline.machine("v5p").gbps == 2765 and roofline.machine("a:10:0").fixed_us == 0


def test_roofline_table_prints_and_round_trips(tmp_path):
    t = roofline.table(CONFIG, "dspark", 1, 2, "h100", context=16, dspark_block=4)
    lines = "\n".join(t.lines())
    assert "cost table (roofline h100; drafter dspark, batch 1)" in lines
    assert "roofline of h100: 3350 GB/s read + 30 us per round (NVIDIA H100" in lines and "context 16" in lines
    t.save(str(tmp_path / "t.json"))
    assert CostTable.load(str(tmp_path / "t.json")) == t


def test_roofline_table_of_a_loaded_model():
    """The CLIs' table: the model's DSpark shapes (2 stages, rank 8) and block size, the setting's bound."""
    model = random_tiny(0)
    s = grid_settings(["dspark"], [1], {"confidence_threshold": [0.0]}, [0.0], [2], auto_bound=3)[-1]
    t = common.roofline_table(model, s, roofline.machine("v5e"), 30)
    specs = P.dspark_specs(model.config, 2, 3, 8, False)
    want = roofline.table(model.config, "dspark", 2, 3, "v5e", context=30, dspark_block=5, drafter_specs=specs)
    assert t == want and t.bound == 3
    assert common.run_context([10, 20], [8, 12]) == 20


@pytest.mark.parametrize("main", [sweep.main, batch_eval.main], ids=["sweep", "batch_eval"])
@pytest.mark.parametrize("args, message", [
    (["--draft-n-max", "auto", "--roofline", "nosuch"], "unknown machine 'nosuch'"),
    (["--draft-n-max", "auto", "--roofline", "h100", "--cost-table", "x.json"], "not allowed with argument"),
    (["--draft-n-max", "2", "--roofline", "h100"], "need 'auto' in --draft-n-max"),
    (["--draft-n-max", "auto", "--roofline", "h100", "--recalibrate"], "--roofline or --recalibrate"),
])
def test_cli_rejects_bad_roofline(main, args, message, tmp_path, capsys):
    out = tmp_path / "never"
    with pytest.raises(SystemExit) as e:
        main(["--random-tiny", "--out", str(out), "--no-compile-cache", *args])
    assert e.value.code == 2 and message in capsys.readouterr().err and not out.exists()
