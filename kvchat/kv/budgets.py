"""Per-layer budgets: how many entries (per KV head) each layer keeps."""

from __future__ import annotations


def uniform_budgets(num_layers: int, budget: int) -> list[int]:
    """Every layer keeps `budget` entries."""
    if budget < 1:
        raise ValueError("budget must be >= 1")
    return [budget] * num_layers
