"""CAKE: layer preferences, cascading eviction == one eviction to the final budgets (Theorem 1), and
what a cascaded block prefill holds at its peak."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from conftest import tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

from kvchat.kv import attention
from kvchat.kv.budgets import cake_budgets
from kvchat.kv.cache import EpisodeCache
from kvchat.kv.cascade import BlockWindow, CakeBudgets, layer_preference
from kvchat.kv.prefill import block_prefill
from kvchat.kv.scoring import CakeScorer, PatchedPromptScorer, select_top

SCORER = CakeScorer(window=8, gamma=200.0, pool_kernel=5)


def _cake(budget: int, cascade: bool = True, window: int = 8, floor_fraction: float = 0.25) -> CakeBudgets:
    return CakeBudgets(budget, window, tau1=1.0, tau2=1.0, floor_fraction=floor_fraction, cascade=cascade)


def _cache(sizes: list[int], protected: int, heads: int = 2) -> EpisodeCache:
    """Layers holding `sizes[l]` entries per head at positions 0..n-1 (random keys)."""
    cache = EpisodeCache(len(sizes))
    for layer, n in zip(cache.layers, sizes, strict=True):
        keys = torch.randn(1, heads, n, 4)
        layer.append(keys, keys.clone(), torch.arange(n).expand(heads, n))
    cache.protected = protected
    return cache


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_cascading_keeps_exactly_what_one_eviction_to_the_final_budgets_keeps(data):
    """Theorem 1 with integer budgets, floors and tied scores: random preferences arriving layer by layer."""
    layers = data.draw(st.integers(1, 8), label="layers")
    protected = data.draw(st.integers(0, 3), label="protected")
    budget = data.draw(st.integers(protected + 1, 40), label="budget")
    cake = _cake(budget, window=data.draw(st.integers(1, 4)), floor_fraction=data.draw(st.floats(0.0, 1.0)))
    prefs = data.draw(
        st.lists(st.one_of(st.just(0.0), st.sampled_from([0.5, 2.0]), st.floats(1e-9, 1e3)),
                 min_size=layers, max_size=layers),
        label="preferences",
    )
    sizes = data.draw(st.lists(st.integers(protected, 3 * budget), min_size=layers, max_size=layers), label="sizes")
    scores = []
    for n in sizes:  # few distinct values, so many ties; the window's entries +inf as CakeScorer gives them
        s = torch.tensor(data.draw(st.lists(st.integers(0, 3), min_size=2 * n, max_size=2 * n)), dtype=torch.float32)
        s = s.reshape(2, n)
        s[:, max(n - cake.window, 0) :] = float("inf")
        scores.append(s)

    caps = sizes if data.draw(st.booleans(), label="capped") else None
    final = cake_budgets(prefs, budget, cake.floor(protected), caps)
    for cascade in (True, False):
        cache = _cache(sizes, protected)
        window = BlockWindow(cache, replace(cake, cascade=cascade), SCORER, evict=True, caps=caps)
        for layer, (p, s) in enumerate(zip(prefs, scores, strict=True)):
            window.layer_done(layer, p, s.clone())
            if cascade:  # every stage already fits what eq. 9 allows the layers seen so far
                assert sum(cache.sizes[: layer + 1]) <= sum(window._stage_budgets(cake))
        for layer, (s, b) in enumerate(zip(scores, final, strict=True)):
            one_shot = select_top(s, b, protected)
            want = torch.arange(sizes[layer]).expand(2, -1) if one_shot is None else one_shot
            assert torch.equal(cache.layers[layer].positions, want), (cascade, layer)


def test_layer_preference_by_hand():
    # one head, a window of 2 queries over 2 earlier keys (and the window's own 2 keys, left out)
    weights = torch.tensor([[0.4, 0.4, 0.2, 0.0], [0.1, 0.1, 0.4, 0.4]]).reshape(1, 1, 2, 4)
    dispersion = -2 * (0.4 * math.log(0.4) + 0.1 * math.log(0.1))   # eq. 4: row entropies, summed
    shift = 2 * 0.045                                                # eq. 5: unbiased variance down each column
    assert float(layer_preference(weights, 1.0, 1.0)) == pytest.approx(dispersion * shift, rel=1e-6)
    assert float(layer_preference(weights, 0.5, 2.0)) == pytest.approx(dispersion**2 * shift**0.5, rel=1e-6)
    steady = torch.tensor([[0.3, 0.3, 0.4, 0.0], [0.3, 0.3, 0.2, 0.2]]).reshape(1, 1, 2, 4)
    assert float(layer_preference(steady, 1.0, 1.0)) == 0.0          # attention that never shifts asks for nothing
    # tiny temperatures: H^(1/tau1) is far beyond a float, the preference is not (issue 16)
    assert float(layer_preference(weights, 1e-300, 1.0)) == float("inf")
    assert layer_preference(weights, 1e-300, 1.0).exponent == pytest.approx(math.log2(dispersion) * 1e300, rel=1e-6)
    assert float(layer_preference(weights, 1.0, 5e-324)) == 0.0     # V < 1: vanishingly small, yet not zero
    assert layer_preference(weights, 1.0, 5e-324).mantissa > 0


@pytest.fixture(scope="module")
def model():
    """4 layers whose attention is sharpened by different amounts, so their preferences differ."""
    model = tiny_model("llama", layers=4)
    with torch.no_grad():
        for layer, scale in zip(model.model.layers, (1.0, 20.0, 5.0, 60.0), strict=True):
            layer.self_attn.q_proj.weight.mul_(scale)
    model.set_attn_implementation(attention.register())
    return model


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 512, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("block", [32, 96])
def test_cascaded_prefill_equals_eviction_at_the_end_of_each_block_and_holds_less(model, block):
    """On a real forward: evicting layer by layer during each block's pass keeps exactly what evicting
    every layer once after the pass keeps, with a lower peak."""
    budget, layers = 64, 4
    runs = {
        cascade: block_prefill(
            model, _ids(4, 1), _ids(500, 2), block_size=block, budgets=_cake(budget, cascade), scorer=SCORER
        )
        for cascade in (True, False)
    }
    cascaded, at_end = runs[True], runs[False]
    for a, b in zip(cascaded.cache.layers, at_end.cache.layers, strict=True):
        assert torch.equal(a.positions, b.positions) and torch.equal(a.keys, b.keys)
    sizes = cascaded.cache.sizes
    assert sum(sizes) == layers * budget and min(sizes) >= _cake(budget).floor(4)
    assert len(set(sizes)) > 1  # sharper layers got more
    assert at_end.peak_total_entries == layers * (budget + block)  # every layer holds its block before evicting
    assert cascaded.peak_total_entries < at_end.peak_total_entries


@settings(max_examples=10, deadline=None)
@given(history=st.integers(1, 400), budget=st.integers(20, 120), block=st.integers(16, 96))
def test_with_fixed_budgets_the_window_scorer_holds_at_most_total_budget_plus_block(model, history, budget, block):
    """CakeScorer evicts each layer right after its attention: the block is held by one layer at a time."""
    result = block_prefill(
        model, _ids(4, 6), _ids(history, 8), block_size=block, budgets=[budget] * 4, scorer=SCORER
    )
    assert result.peak_total_entries <= 4 * budget + block
    assert result.peak_layer_entries <= budget + block
    assert max(result.cache.sizes) <= max(budget, 4 + history)


def test_cake_budgets_with_a_probe_scorer_evict_once_after_the_probe(model):
    prompt = _ids(6, 9)
    result = block_prefill(
        model, _ids(4, 1), _ids(300, 3), block_size=48, budgets=_cake(64), scorer=PatchedPromptScorer(prompt)
    )
    sizes = result.cache.sizes
    assert sum(sizes) == 4 * 64 and len(set(sizes)) > 1 and min(sizes) >= _cake(64).floor(4)
    assert result.peak_total_entries <= 4 * (64 + 48) + 6
