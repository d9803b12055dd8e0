"""Per-layer budgets: how many entries (per KV head) each layer keeps.

Every strategy returns integers that sum exactly to `num_layers * budget` (the same memory as
uniform) with each layer at or above a floor. The floor is the strategy's own (a fraction of the
budget), raised where needed above the `protected` system prompt, which no layer ever evicts: a layer
must keep some history too. Shares are turned into integers by the largest remainder method, ties to
the lower layer, so results are deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

LAYER_BUDGET_STRATEGIES = ("uniform", "sensitivity", "pyramid", "cake")


def uniform_budgets(num_layers: int, budget: int) -> list[int]:
    """Every layer keeps `budget` entries."""
    if budget < 1:
        raise ValueError("budget must be >= 1")
    return [budget] * num_layers


def proportional_budgets(weights: Sequence[float], budget: int, floor: int) -> list[int]:
    """`floor` per layer, and the rest of `len(weights) * budget` split in proportion to `weights`."""
    num_layers = len(weights)
    if not 0 <= floor <= budget:
        raise ValueError(f"floor {floor} must be within 0..{budget}")
    w = np.asarray(weights, dtype=np.float64)
    if np.any(w < 0) or not np.isfinite(w).all():
        raise ValueError("weights must be finite and non-negative")
    w = np.full(num_layers, 1.0) if w.sum() == 0 else w
    spare = num_layers * (budget - floor)
    shares = spare * w / w.sum()
    base = np.floor(shares).astype(int)
    leftover = spare - int(base.sum())
    order = np.argsort(-(shares - base), kind="stable")  # largest remainders first, ties to lower layers
    base[order[:leftover]] += 1
    return [int(floor + b) for b in base]


def floor_above(floor: int, budget: int, protected: int) -> int:
    """A strategy's `floor`, raised to one entry past the `protected` prefix, never above `budget`."""
    return min(budget, max(floor, protected + 1 if protected else 0))


def sensitivity_budgets(
    sensitivity: Sequence[float], budget: int, alpha: float, floor_fraction: float = 0.25, protected: int = 0
) -> list[int]:
    """EpiCache eq. 10, `M_l ∝ s_l^alpha`, with a floor of `floor_fraction * budget` per layer.

    The floor (the official code uses M/4) keeps an insensitive layer from being starved; the rest of
    the total is split by `s_l^alpha`, so the sum is exactly `L * budget`.
    """
    s = np.clip(np.asarray(sensitivity, dtype=np.float64), 0.0, None)
    return proportional_budgets(s**alpha, budget, floor_above(int(budget * floor_fraction), budget, protected))


def pyramid_budgets(num_layers: int, budget: int, beta: float = 20.0, protected: int = 0) -> list[int]:
    """PyramidKV: budgets fall linearly from the first layer to the last, mean `budget`.

    The last layer gets `budget / beta` (PyramidKV's beta = 20), or just more than the protected prefix
    if that is larger (the slope then flattens); the first `2 * budget` less the last's.
    """
    low = floor_above(int(budget / beta), budget, protected)
    weights = np.linspace(2 * budget - low, low, num_layers) - low
    return proportional_budgets(weights, budget, low)


def cake_budgets(
    preferences: Sequence[float], budget: int, floor: int, caps: Sequence[int] | None = None
) -> list[int]:
    """CAKE eq. 7 with a floor: `floor` per layer, the rest of `L * budget` split in proportion to each
    layer's preference; the budgets the cascade ends at (see `cascade_budgets`). All-zero preferences
    give uniform budgets.

    `caps[l]`: the entries layer l holds, so a budget above it would be wasted. Such a surplus goes to
    the other layers in proportion to their preferences (water filling, as CAKE's code redistributes),
    each up to its budget at the cascade's last-but-one stage, so that cascading stays exact.
    Exact rationals, largest remainder, ties to the lower layer: a layer's final budget is provably
    never above any of its cascade budgets, which float rounding could break by one.
    """
    num_layers = len(preferences)
    p = _exact(preferences, budget, floor)
    rooms: list[int | None] = [None] * num_layers
    if caps is not None:
        if len(caps) != num_layers:
            raise ValueError(f"{len(caps)} caps for {num_layers} layers")
        bounds = [*_stage_bounds(p[:-1], num_layers, budget, floor), None]
        rooms = [max(min(c, c if b is None else b) - floor, 0) for c, b in zip(caps, bounds, strict=True)]
    weights = p if any(p) else [Fraction(1)] * num_layers
    extras = _water_fill(weights, rooms, num_layers * (budget - floor))
    base = [math.floor(x) for x in extras]
    leftover = int(sum(extras, Fraction(0))) - sum(base)
    order = sorted(range(num_layers), key=lambda i: (-(extras[i] - base[i]), i))
    for i in order[:leftover]:
        base[i] += 1
    return [floor + b for b in base]


def cascade_budgets(
    preferences: Sequence[float], num_layers: int, budget: int, floor: int, caps: Sequence[int] | None = None
) -> list[int]:
    """CAKE eq. 9: the budgets of layers 0..m once the preferences of those m + 1 layers are known.

    Before the last stage, each is the most that layer can still end with, whatever the preferences of
    the layers not seen yet (they could all be zero): `floor + ceil(spare * P_l / sum_{k<=m} P_k)`, or
    the uniform budget while every preference seen is zero (all-zero preferences end uniform). A new
    layer only adds to the sum, so each layer's successive budgets never increase; at the last stage
    they are `cake_budgets` (with `caps`), no higher. Evicting down to them stage by stage therefore
    keeps exactly what one eviction to the final budgets keeps (Theorem 1), rounding included. The seen
    layers' budgets sum to at most `L * budget - (unseen layers) * floor` plus one per seen layer.
    """
    if not 0 < len(preferences) <= num_layers:
        raise ValueError(f"{len(preferences)} preferences for {num_layers} layers")
    if len(preferences) == num_layers:
        return cake_budgets(preferences, budget, floor, caps)
    return _stage_bounds(_exact(preferences, budget, floor), num_layers, budget, floor)


def _exact(preferences: Sequence[float], budget: int, floor: int) -> list[Fraction]:
    if not 0 <= floor <= budget:
        raise ValueError(f"floor {floor} must be within 0..{budget}")
    if not all(math.isfinite(x) and x >= 0 for x in preferences):
        raise ValueError("preferences must be finite and non-negative")
    return [Fraction(float(x)) for x in preferences]


def _stage_bounds(p: list[Fraction], num_layers: int, budget: int, floor: int) -> list[int]:
    """The cascade budgets of the layers seen so far (preferences `p`), before the last stage."""
    total = sum(p, Fraction(0))
    if total == 0:
        return [budget] * len(p)
    spare = num_layers * (budget - floor)
    return [floor + math.ceil(spare * x / total) for x in p]


def _water_fill(weights: list[Fraction], rooms: list[int | None], total: int) -> list[Fraction]:
    """Split `total` in proportion to `weights`, none above its room (None: no limit); what a full
    layer cannot take goes to the others. Zero-weight layers get nothing."""
    extras: list[Fraction] = [Fraction(0)] * len(weights)
    active = [i for i, w in enumerate(weights) if w > 0]
    remaining = Fraction(total)
    while active:
        level = remaining / sum(weights[i] for i in active)
        full = [i for i in active if rooms[i] is not None and level * weights[i] >= rooms[i]]
        if not full:
            for i in active:
                extras[i] = level * weights[i]
            break
        for i in full:
            extras[i] = Fraction(rooms[i])
            remaining -= rooms[i]
        active = [i for i in active if i not in full]
    return extras


def layer_budgets(
    strategy: str,
    num_layers: int,
    budget: int,
    *,
    sensitivity: Sequence[float] | None = None,
    alpha: float = 1.0,
    protected: int = 0,
) -> list[int]:
    """Budgets for a strategy name; `sensitivity` is needed by the sensitivity strategy; every layer
    gets more than `protected` entries when the budget allows."""
    if strategy == "uniform":
        return uniform_budgets(num_layers, budget)
    if strategy == "pyramid":
        return pyramid_budgets(num_layers, budget, protected=protected)
    if strategy == "sensitivity":
        if sensitivity is None or len(sensitivity) != num_layers:
            raise ValueError("the sensitivity strategy needs one score per layer")
        return sensitivity_budgets(sensitivity, budget, alpha, protected=protected)
    if strategy == "cake":
        raise ValueError("cake budgets depend on the input: they are computed during prefill (kvchat.kv.cascade)")
    raise ValueError(f"unknown layer budget strategy {strategy!r}")
