"""The speculation payoff forecast's arithmetic on hand-computed cases (analysis/aot/forecast.py)."""
import json

import pytest

from dsv4_jax.analysis.aot import forecast as F


def test_expected_accepted_hand_computed():
    p = F.given([0.8, 0.5, 0.25])
    # 0.8 + 0.8·0.5 + 0.8·0.5·0.25 = 0.8 + 0.4 + 0.1
    assert F.expected_accepted(p, 1) == pytest.approx(0.8)
    assert F.expected_accepted(p, 3) == pytest.approx(1.3)
    # past the profile the last rate repeats: + 0.1·0.25
    assert F.expected_accepted(p, 4) == pytest.approx(1.325)


def test_forecast_row_hand_computed():
    p = F.given([0.8, 0.5, 0.25])
    # k = 2: tokens/round = 1 + 1.2 = 2.2; round = drafter 2 ms + verify 12 ms = 14 ms;
    # 2.2 / 0.014 = 157.142857 tokens/s; decode 10 ms -> 100 tokens/s; speed-up 1.571428...
    r = F.forecast_row(p, 2, decode_s=0.010, verify_s=0.012, drafter_s=0.002)
    assert r["tokens_per_round"] == pytest.approx(2.2)
    assert r["round_s"] == pytest.approx(0.014)
    assert r["tokens_per_s"] == pytest.approx(2.2 / 0.014)
    assert r["speedup"] == pytest.approx(1.5714285714)


def test_published_profile_is_geometric():
    p = F.profile("mtp-llamacpp-25784")
    assert F.expected_accepted(p, 3) == pytest.approx(0.65 + 0.65 ** 2 + 0.65 ** 3)


def test_sweep_profile_converts_cumulative_rates(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"settings": [
        {"drafter": "mtp", "draft_n_max": 3, "per_position_accept_rate": [0.8, 0.4, 0.1]},
        {"drafter": "dspark", "draft_n_max": 1, "per_position_accept_rate": [0.9]}]}))
    p = F.profile(str(path), drafter="mtp")
    assert p.rates == pytest.approx((0.8, 0.5, 0.25))
    # the cumulative rates summed are E[accepted] directly
    assert F.expected_accepted(p, 3) == pytest.approx(0.8 + 0.4 + 0.1)


def test_bad_profile_is_named():
    with pytest.raises(ValueError, match="rates must be"):
        F.given([1.2])
    with pytest.raises(ValueError, match="unknown acceptance profile"):
        F.profile("no-such-profile")
