"""Layer budget strategies and layer-sensitivity profiling."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvchat.config import ProfileSettings
from kvchat.ingest.layer_profiles import LayerProfile, block_prefill_mask, find_profile, profile_layers
from kvchat.kv.budgets import (
    Preference,
    cake_budgets,
    cascade_budgets,
    layer_budgets,
    proportional_budgets,
    pyramid_budgets,
    sensitivity_budgets,
)

sensitivities = st.lists(st.floats(0.0, 1.0), min_size=1, max_size=40)


@settings(max_examples=200, deadline=None)
@given(s=sensitivities, budget=st.integers(4, 5000), alpha=st.floats(0.1, 3.0), protected=st.integers(0, 200))
def test_sensitivity_budgets_sum_exactly_and_respect_the_floor(s, budget, alpha, protected):
    budgets = sensitivity_budgets(s, budget, alpha, protected=protected)
    assert sum(budgets) == len(s) * budget
    assert min(budgets) >= budget // 4
    assert budget <= protected or min(budgets) > protected  # every layer keeps some history


@settings(max_examples=100, deadline=None)
@given(layers=st.integers(1, 64), budget=st.integers(20, 5000), protected=st.integers(0, 200))
def test_pyramid_budgets_sum_exactly_and_decrease(layers, budget, protected):
    budgets = pyramid_budgets(layers, budget, protected=protected)
    assert sum(budgets) == layers * budget
    assert all(a >= b - 1 for a, b in zip(budgets, budgets[1:], strict=False))  # linear, up to rounding
    assert min(budgets) >= int(budget / 20)
    assert budget <= protected or min(budgets) > protected


def test_pyramid_floor_rises_above_the_system_prompt():
    assert pyramid_budgets(30, 256)[-1] == 12  # PyramidKV's M / 20
    raised = pyramid_budgets(30, 256, protected=38)
    assert raised[-1] == 39 and sum(raised) == 30 * 256 and raised[0] < pyramid_budgets(30, 256)[0]


def test_more_sensitive_layers_get_more_and_alpha_sharpens():
    s = [0.1, 0.2, 0.4, 0.8]
    soft, sharp = sensitivity_budgets(s, 100, 1.0), sensitivity_budgets(s, 100, 2.0)
    assert soft == sorted(soft) and sharp == sorted(sharp)
    assert sharp[-1] - sharp[0] > soft[-1] - soft[0]


def test_equal_sensitivities_give_uniform_budgets():
    assert sensitivity_budgets([0.3] * 6, 64, 1.3) == [64] * 6
    assert proportional_budgets([0, 0, 0], 10, 2) == [10, 10, 10]


# preferences as CAKE produces them: often tiny, sometimes zero (uniform attention has no shift), ties
preferences = st.lists(
    st.one_of(st.just(0.0), st.sampled_from([0.5, 1.0, 3.0]), st.floats(1e-12, 1e6)), min_size=1, max_size=40
)


# preferences made from their logarithm (tau down to 1e-300): far beyond a float, apart by any factor, ties
log_preferences = st.lists(
    st.one_of(st.none(), st.sampled_from([0.0, -1e300, 1e300]), st.floats(-1e300, 1e300, allow_nan=False)).map(
        lambda log2: Preference.of(0.0) if log2 is None else Preference.from_log2(Fraction(log2))
    ),
    min_size=1, max_size=40,
)


def _order(p: float | Preference) -> tuple:
    exact = Preference.of(p)
    return (exact.mantissa > 0, exact.exponent, exact.mantissa)


def _assert_split_exactly_by_preference(p, budget: int, floor: int) -> None:
    budgets = cake_budgets(p, budget, floor)
    assert sum(budgets) == len(p) * budget
    assert min(budgets) >= floor
    for pa, ba in zip(p, budgets, strict=True):
        for pb, bb in zip(p, budgets, strict=True):
            if _order(pa) < _order(pb):
                assert ba <= bb
            elif _order(pa) == _order(pb):
                assert abs(ba - bb) <= 1


def _assert_cascade_exact(p, budget: int, floor: int, caps: list[int] | None) -> None:
    """What Theorem 1 needs from the budgets, integer rounding and caps (entries a layer holds) included."""
    layers = len(p)
    stages = [cascade_budgets(p[: m + 1], layers, budget, floor, caps) for m in range(layers)]
    final = cake_budgets(p, budget, floor, caps)
    assert stages[-1] == final
    for m in range(1, layers):
        assert all(now <= before for now, before in zip(stages[m], stages[m - 1], strict=False))
    for m, stage in enumerate(stages):  # seen layers hold no more than what unseen layers' floors leave
        assert sum(stage) <= layers * budget - (layers - 1 - m) * floor + m + 1
        assert min(stage) >= floor
    assert sum(final) <= layers * budget
    if caps is None or all(c >= b for c, b in zip(caps, cake_budgets(p, budget, floor), strict=True)):
        assert sum(final) == layers * budget
    else:  # nothing given to a layer beyond the entries it holds
        assert all(b <= max(c, floor) for b, c in zip(final, caps, strict=True))


def _caps(data, layers: int, budget: int) -> list[int] | None:
    return data.draw(st.none() | st.lists(st.integers(0, 3 * budget), min_size=layers, max_size=layers))


@settings(max_examples=300, deadline=None)
@given(p=preferences, budget=st.integers(1, 3000), fraction=st.floats(0.0, 1.0))
def test_cake_budgets_sum_exactly_respect_the_floor_and_follow_preferences(p, budget, fraction):
    _assert_split_exactly_by_preference(p, budget, int(budget * fraction))


@settings(max_examples=300, deadline=None)
@given(data=st.data(), p=preferences, budget=st.integers(1, 3000), fraction=st.floats(0.0, 1.0))
def test_cascade_budgets_never_grow_and_end_at_the_one_shot_budgets(data, p, budget, fraction):
    _assert_cascade_exact(p, budget, int(budget * fraction), _caps(data, len(p), budget))


@settings(max_examples=200, deadline=None)
@given(data=st.data(), p=log_preferences, budget=st.integers(1, 3000), fraction=st.floats(0.0, 1.0))
def test_preferences_of_any_size_keep_the_budgets_and_the_cascade_exact(data, p, budget, fraction):
    """CAKE with tau down to 1e-300 (issue 16: the float preference overflowed into a ValueError)."""
    floor = int(budget * fraction)
    _assert_split_exactly_by_preference(p, budget, floor)
    _assert_cascade_exact(p, budget, floor, _caps(data, len(p), budget))


def test_preferences_from_logarithms():
    assert float(Preference.from_log2(Fraction(3))) == 8.0
    assert float(Preference.from_log2(Fraction(-1, 2))) == pytest.approx(2**-0.5)
    assert Preference.of(12.0) == Preference(Fraction(3, 2), 3)  # floats are taken exactly
    huge, larger = Preference.from_log2(Fraction(10**300)), Preference.from_log2(Fraction(10**300 + 1))
    assert float(huge) == float("inf")
    assert cake_budgets([huge, larger, 5.0], 10, 2) == [10, 18, 2]  # twice the preference; 5.0 is negligible
    assert cake_budgets([huge, huge], 10, 2) == [10, 10]


def test_cake_budgets_by_hand():
    assert cake_budgets([1.0, 3.0], 10, 2) == [6, 14]            # spare 16 split 1:3
    assert cake_budgets([0.0, 0.0, 0.0], 10, 2) == [10, 10, 10]  # no preference at all: uniform
    assert cake_budgets([1.0, 1.0, 1.0], 10, 0) == [10, 10, 10]
    assert cake_budgets([1.0, 1.0], 5, 0) == [5, 5]
    assert cake_budgets([1.0, 1.0, 1.0], 1, 0) == [1, 1, 1]
    assert cake_budgets([2.0, 1.0, 1.0], 2, 0) == [3, 2, 1]      # 3, 1.5, 1.5: the tie goes to the lower layer
    assert cascade_budgets([1.0], 2, 10, 2) == [18]               # alone so far: all it could still end with
    assert cascade_budgets([1.0, 3.0], 2, 10, 2) == [6, 14]
    assert cascade_budgets([0.0], 3, 10, 2) == [10]               # zero so far: at most uniform at the end
    assert cake_budgets([1.0, 3.0], 10, 2, caps=[20, 12]) == [8, 12]  # layer 1 holds only 12: the rest to layer 0
    assert cascade_budgets([1.0], 2, 10, 2, caps=[15, 30]) == [18]  # caps only shape the last stage
    with pytest.raises(ValueError, match="non-negative"):
        cake_budgets([1.0, float("nan")], 10, 2)


def test_layer_budgets_dispatch():
    assert layer_budgets("uniform", 3, 8) == [8, 8, 8]
    with pytest.raises(ValueError, match="one score per layer"):
        layer_budgets("sensitivity", 3, 8)
    with pytest.raises(ValueError, match="unknown"):
        layer_budgets("magic", 3, 8)
    with pytest.raises(ValueError, match="during prefill"):
        layer_budgets("cake", 3, 8)


def test_block_prefill_mask_matches_what_a_budget_cache_holds():
    mask = block_prefill_mask(40, budget=12, block_size=4, sink=2)
    assert mask[:12, :12].equal(torch.ones(12, 12, dtype=torch.bool).tril())  # before any eviction: causal
    row = mask[33]  # offset 1 in its block: sink 0,1 plus the last 12 - 2 + 1 = 11 tokens
    assert row.nonzero().flatten().tolist() == [0, 1, *range(23, 34)]
    assert not mask.triu(1).any()


def test_profile_on_the_tiny_model(tiny_lm, tmp_path):
    text = " ".join(["Maya walks the dog in the park and Tom bakes sourdough bread ."] * 40)
    profile = profile_layers(tiny_lm, text, ProfileSettings(budget=48, block_size=16, sink=4, max_tokens=400))
    assert len(profile.sensitivity) == tiny_lm.num_layers
    assert all(0.0 <= s <= 1.0 for s in profile.sensitivity)
    assert profile.sensitivity[-1] > 0  # later layers see a different context under the window mask
    path = tmp_path / "profile.json"
    profile.save(path)
    assert LayerProfile.load(path) == profile
    assert find_profile(tiny_lm, [tmp_path]) == profile
    data = json.loads(path.read_text())
    data["weights"] = "someone-else"
    path.write_text(json.dumps(data))
    assert find_profile(tiny_lm, [tmp_path]) is None
