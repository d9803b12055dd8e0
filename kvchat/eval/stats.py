"""Intervals over questions: percentile bootstrap of a mean, of a paired difference, and of a ratio of means.

Every interval resamples the questions with a fixed seed, so the same records give the same report.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

RESAMPLES = 2000         # bootstrap resamples
SEED = 0                 # bootstrap seed: the same records give the same intervals


def bootstrap_interval(values: Sequence[float], *, resamples: int = RESAMPLES, seed: int = SEED,
                       confidence: float = 0.95) -> tuple[float, float]:  # fmt: skip
    """Percentile bootstrap interval of the mean of `values` (the same values give the same interval)."""
    data = np.asarray(values, dtype=np.float64)
    if data.size == 0:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    means = data[rng.integers(0, data.size, size=(resamples, data.size))].mean(axis=1)
    return _percentiles(means, confidence)


def paired_difference(a: dict, b: dict, **options) -> tuple[float, float, float, int]:
    """Mean of a[q] - b[q] over the questions both answered, its bootstrap interval, and how many."""
    shared = sorted(set(a) & set(b))
    diffs = [a[q] - b[q] for q in shared]
    if not diffs:
        return float("nan"), float("nan"), float("nan"), 0
    low, high = bootstrap_interval(diffs, **options)
    return float(np.mean(diffs)), low, high, len(diffs)


def statistic_interval(columns: Sequence[Sequence[float]], statistic: Callable[..., Any], *,
                       resamples: int = RESAMPLES, seed: int = SEED,
                       confidence: float = 0.95) -> tuple[float, float, float]:  # fmt: skip
    """`statistic(*means)` of the columns' means (one value per question in each, aligned), and its percentile
    bootstrap interval: the questions resampled together, as a ratio of means needs (a ratio per question explodes
    where its denominator is near zero)."""
    data = np.asarray(columns, dtype=np.float64)  # [columns, questions]
    if data.ndim != 2 or data.shape[1] == 0:
        return float("nan"), float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = data[:, rng.integers(0, data.shape[1], size=(resamples, data.shape[1]))].mean(axis=2)  # [columns, R]
    with np.errstate(divide="ignore", invalid="ignore"):
        values = np.asarray(statistic(*means), dtype=np.float64)
    low, high = _percentiles(values[np.isfinite(values)], confidence) if np.isfinite(values).any() else (
        float("nan"), float("nan"))  # fmt: skip
    with np.errstate(divide="ignore", invalid="ignore"):
        point = float(statistic(*data.mean(axis=1)))
    return point, low, high


def _percentiles(values: np.ndarray, confidence: float) -> tuple[float, float]:
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(values, [tail, 100 - tail])
    return float(low), float(high)
