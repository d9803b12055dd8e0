"""Per-layer budgets: how many entries (per KV head) each layer keeps.

Every strategy returns integers that sum exactly to `num_layers * budget` (the same memory as
uniform) with each layer at or above a floor. The floor is the strategy's own (a fraction of the
budget), raised where needed above the `protected` system prompt, which no layer ever evicts: a layer
must keep some history too. Shares are turned into integers by the largest remainder method, ties to
the lower layer, so results are deterministic.

CAKE's preferences span any range (`H^(1/tau1) * V^(1/tau2)` with `tau1 = 1e-300` is far beyond a float),
so they are `Preference`s: exact rationals times a power of two of any size, made from their logarithm.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import numpy.typing as npt

LAYER_BUDGET_STRATEGIES = ("uniform", "sensitivity", "pyramid", "cake")

# A preference below 2**-NEGLIGIBLE_BITS of the largest counts as zero. Floats span under 2100 binary orders
# of magnitude, so no preference given as a float is ever dropped; only `Preference.from_log2` reaches this.
NEGLIGIBLE_BITS = 2200


@dataclass(frozen=True)
class Preference:
    """A CAKE layer preference `P >= 0`, exactly `mantissa * 2**exponent` with an exponent of any size.

    `H^(1/tau1) * V^(1/tau2)` over- or underflows a float for small temperatures (`--tau1 1e-300`), while its
    logarithm does not: `from_log2` builds a preference from `log2 P`, and budgets split in proportion to
    preferences with exact rationals whatever their range. Floats are taken as they are (`of`).
    """

    mantissa: Fraction  # 0 (no preference at all), or in [1, 2)
    exponent: int

    @classmethod
    def of(cls, value: float | Preference) -> Preference:
        """`value` itself when a Preference; a finite non-negative float exactly (frexp)."""
        if isinstance(value, Preference):
            return value
        if not (math.isfinite(value) and value >= 0):
            raise ValueError("preferences must be finite and non-negative")
        if value == 0:
            return cls(Fraction(0), 0)
        mantissa, exponent = math.frexp(value)  # value = mantissa * 2**exponent, mantissa in [0.5, 1)
        return cls(Fraction(mantissa) * 2, exponent - 1)

    @classmethod
    def from_log2(cls, log2: Fraction) -> Preference:
        """`2**log2`, for an exact rational `log2` of any size (the fraction's power of two rounded to a float)."""
        exponent = math.floor(log2)
        mantissa = Fraction(2.0 ** float(log2 - exponent))
        if mantissa == 2:  # rounding reached the next power
            return cls(Fraction(1), exponent + 1)
        return cls(mantissa, exponent)

    def __float__(self) -> float:
        """The nearest float (inf beyond a float's range), for reports and tests."""
        if self.mantissa == 0:
            return 0.0
        if self.exponent > 1024:
            return math.inf
        try:
            return math.ldexp(float(self.mantissa), self.exponent)
        except OverflowError:
            return math.inf


def uniform_budgets(num_layers: int, budget: int) -> list[int]:
    """Every layer keeps `budget` entries."""
    if budget < 1:
        raise ValueError("budget must be >= 1")
    return [budget] * num_layers


def proportional_budgets(weights: Sequence[float] | npt.NDArray[np.float64], budget: int, floor: int) -> list[int]:
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
    preferences: Sequence[float | Preference], budget: int, floor: int, caps: Sequence[int] | None = None
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
        bounds = [*_stage_bounds(_exact(preferences[:-1], budget, floor), num_layers, budget, floor), None]
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
    preferences: Sequence[float | Preference],
    num_layers: int,
    budget: int,
    floor: int,
    caps: Sequence[int] | None = None,
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


def _exact(preferences: Sequence[float | Preference], budget: int, floor: int) -> list[Fraction]:
    """The preferences as exact rationals, all divided by one power of two (the largest one's), which no
    split in proportion to them sees. Those below 2**-NEGLIGIBLE_BITS of the largest become 0: a later
    stage, whose largest can only be larger, drops at least what an earlier one dropped, and what it drops
    weighs less than the layer that raised the largest, so each stage's sum still only grows (which the
    cascade's exactness rests on)."""
    if not 0 <= floor <= budget:
        raise ValueError(f"floor {floor} must be within 0..{budget}")
    exact = [Preference.of(x) for x in preferences]
    top = max((p.exponent for p in exact if p.mantissa), default=0)
    return [
        p.mantissa * Fraction(2) ** (p.exponent - top) if p.mantissa and p.exponent - top >= -NEGLIGIBLE_BITS
        else Fraction(0)
        for p in exact
    ]


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
        full = {i: room for i in active if (room := rooms[i]) is not None and level * weights[i] >= room}
        if not full:
            for i in active:
                extras[i] = level * weights[i]
            break
        for i, room in full.items():
            extras[i] = Fraction(room)
            remaining -= room
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
