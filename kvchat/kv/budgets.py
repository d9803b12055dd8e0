"""Per-layer budgets: how many entries (per KV head) each layer keeps.

Every strategy returns integers that sum exactly to `num_layers * budget` (the same memory as
uniform) with each layer at or above a floor. Shares are turned into integers by the largest
remainder method, ties to the lower layer, so results are deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

LAYER_BUDGET_STRATEGIES = ("uniform", "sensitivity", "pyramid")


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


def sensitivity_budgets(
    sensitivity: Sequence[float], budget: int, alpha: float, floor_fraction: float = 0.25
) -> list[int]:
    """EpiCache eq. 10, `M_l ∝ s_l^alpha`, with a floor of `floor_fraction * budget` per layer.

    The floor (the official code uses M/4) keeps an insensitive layer from being starved; the rest of
    the total is split by `s_l^alpha`, so the sum is exactly `L * budget`.
    """
    s = np.clip(np.asarray(sensitivity, dtype=np.float64), 0.0, None)
    return proportional_budgets(s**alpha, budget, int(budget * floor_fraction))


def pyramid_budgets(num_layers: int, budget: int, beta: float = 20.0) -> list[int]:
    """PyramidKV: budgets fall linearly from the first layer to the last, mean `budget`.

    The last layer gets `budget / beta` (PyramidKV's beta = 20), the first `2 * budget - budget / beta`.
    """
    low = budget / beta
    high = 2 * budget - low
    weights = np.linspace(high, low, num_layers) - low
    return proportional_budgets(weights, budget, int(low))


def layer_budgets(
    strategy: str,
    num_layers: int,
    budget: int,
    *,
    sensitivity: Sequence[float] | None = None,
    alpha: float = 1.0,
) -> list[int]:
    """Budgets for a strategy name; `sensitivity` is needed by the sensitivity strategy."""
    if strategy == "uniform":
        return uniform_budgets(num_layers, budget)
    if strategy == "pyramid":
        return pyramid_budgets(num_layers, budget)
    if strategy == "sensitivity":
        if sensitivity is None or len(sensitivity) != num_layers:
            raise ValueError("the sensitivity strategy needs one score per layer")
        return sensitivity_budgets(sensitivity, budget, alpha)
    raise ValueError(f"unknown layer budget strategy {strategy!r}")
