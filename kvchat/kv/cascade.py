"""CAKE in block prefill (Qin et al., ICLR 2025): layer preferences from each block's last window, and
cascading eviction during the block's forward pass.

Design notes (the details and the choices made): docs/internals.md, "kvchat/kv/cascade.py".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction

import torch

from kvchat.kv.attention import LayerView
from kvchat.kv.budgets import Preference, cake_budgets, cascade_budgets
from kvchat.kv.cache import EpisodeCache
from kvchat.kv.heads import HeadBudgets
from kvchat.kv.scoring import Scorer, select_top


@dataclass(frozen=True)
class CakeBudgets:
    """The `cake` layer-budget strategy: mean budget M per layer (total `L * M`) and CAKE's settings."""

    budget: int            # M
    window: int            # S_w: the block's last queries that measure the preferences
    tau1: float            # temperature of dispersion (eq. 6)
    tau2: float            # temperature of shift
    floor_fraction: float  # each layer keeps at least this fraction of M
    cascade: bool          # evict during the forward (False: once at its end, the reference of Theorem 1)

    def floor(self, protected: int) -> int:
        """`floor_fraction * M`, but at least the system prompt plus the window (never evicted by CAKE's
        scorer), and at most M."""
        return min(self.budget, max(int(self.budget * self.floor_fraction), protected + self.window))


def layer_preference(weights: torch.Tensor, tau1: float, tau2: float) -> Preference:
    """CAKE eq. 6 from the window's attention `weights` [kv_heads, group, w, kv] over all the layer's keys.

    As in CAKE's code, H and V are summed over the layer's heads, and the submatrix keeps the softmax
    over all keys (its rows do not sum to one). `log2 P = log2 H / tau1 + log2 V / tau2` in exact rationals:
    P itself overflows a float for small temperatures.
    """
    rows, kv = weights.shape[-2], weights.shape[-1]
    before = weights[..., : kv - rows].double()
    if before.shape[-1] == 0:
        return Preference.of(0.0)
    dispersion = float((-(before * torch.log(before + 1e-10)).sum()).clamp(min=0.0))
    shift = float(before.var(dim=-2, correction=1 if rows > 1 else 0).sum())
    if not (math.isfinite(dispersion) and math.isfinite(shift)):
        raise ValueError(f"attention gave a non-finite preference (dispersion {dispersion}, shift {shift})")
    if dispersion == 0 or shift == 0:  # 0 to any positive power
        return Preference.of(0.0)
    return Preference.from_log2(
        Fraction(math.log2(dispersion)) / Fraction(tau1) + Fraction(math.log2(shift)) / Fraction(tau2)
    )


@dataclass
class BlockWindow:
    """Attention recorder of one block's forward (see the module docstring).

    `budgets` are a layer's final budgets (fixed) or `CakeBudgets`; `scorer` is set when it scores during
    the forward (`Scorer.layer_scores`); `evict` says whether this block evicts at all (decided before the forward);
    `caps[l]` is what layer l holds once the block is appended (cake budgets never exceed it); `heads` shares a
    layer's budget among its KV heads (adaptive: scores laid out per head, each head's entries first). A
    scorer with a `kept(layer, index)` method is told what every eviction kept (kvchat.kv.indexer keeps
    per-entry state aligned with the cache that way).
    """

    cache: EpisodeCache
    budgets: Sequence[int] | CakeBudgets
    scorer: Scorer | None
    evict: bool
    caps: Sequence[int] | None = None
    heads: HeadBudgets | None = None
    preferences: list[Preference | float] = field(default_factory=list)
    scores: list[torch.Tensor] = field(default_factory=list)

    @property
    def query_rows(self) -> int:
        own = self.budgets.window if isinstance(self.budgets, CakeBudgets) else 0
        return max(own, self.scorer.query_rows if self.scorer else 0)

    @property
    def needs_hidden(self) -> bool:
        return self.scorer is not None and self.scorer.needs_hidden

    def record(self, view: LayerView) -> None:
        """Called by kvchat's attention once layer `view.layer_idx` has its output."""
        cake = self.budgets if isinstance(self.budgets, CakeBudgets) else None
        preference = (
            None if cake is None else layer_preference(view.weights[..., -cake.window :, :], cake.tau1, cake.tau2)
        )
        scores = None if self.scorer is None else self.scorer.layer_scores(view)
        self.layer_done(view.layer_idx, preference, scores)

    def layer_done(self, layer_idx: int, preference: Preference | float | None, scores: torch.Tensor | None) -> None:
        """Layer `layer_idx` ran: note its preference and scores, and evict what this stage allows (Alg. 1)."""
        if layer_idx != len(self.scores if self.scorer else self.preferences):
            raise RuntimeError(f"layers must run in order: got layer {layer_idx}")
        if isinstance(self.budgets, CakeBudgets):
            if preference is None:
                raise ValueError(f"layer {layer_idx}: cake budgets need its preference")
            self.preferences.append(preference)
        if self.scorer is None:
            return
        if scores is None:
            raise ValueError(f"layer {layer_idx}: the scorer gave no scores")
        self.scores.append(scores)
        if not self.evict:
            return
        if not isinstance(self.budgets, CakeBudgets):
            self._evict(layer_idx, self.budgets[layer_idx])
        elif self.budgets.cascade:
            for layer, budget in enumerate(self._stage_budgets(self.budgets)):
                self._evict(layer, budget)
        elif layer_idx == len(self.cache.layers) - 1:
            for layer, budget in enumerate(self.final_budgets()):
                self._evict(layer, budget)

    def final_budgets(self) -> list[int]:
        """The block's budgets once every layer has run."""
        if not isinstance(self.budgets, CakeBudgets):
            return list(self.budgets)
        cake = self.budgets
        return cake_budgets(self.preferences, cake.budget, cake.floor(self._kept_always), self.caps)

    def _stage_budgets(self, cake: CakeBudgets) -> list[int]:
        layers = len(self.cache.layers)
        return cascade_budgets(self.preferences, layers, cake.budget, cake.floor(self._kept_always), self.caps)

    @property
    def _kept_always(self) -> int:
        """Entries of every head no eviction drops: the system prompt and the resident window."""
        return self.cache.protected + self.cache.recent

    def _evict(self, layer: int, budget: int) -> None:
        scores = self.scores[layer]
        index: torch.Tensor | Sequence[torch.Tensor] | None
        if self.heads is None:
            index = select_top(scores, budget, self.cache.protected, self.cache.recent)
        else:
            lengths = self.cache.layers[layer].lengths
            index = self.heads.select(scores, budget, self.cache.protected, lengths, self.cache.recent)
        if index is None:
            return
        self.cache.keep_layer(layer, index)
        if isinstance(index, torch.Tensor):
            self.scores[layer] = scores.gather(-1, index)
        else:  # per head: each head's survivors first, padding after
            kept = scores.new_full((scores.shape[0], max(len(i) for i in index)), float("-inf"))
            for h, i in enumerate(index):
                kept[h, : len(i)] = scores[h, i]
            self.scores[layer] = kept
        notify = getattr(self.scorer, "kept", None)
        if notify is not None:
            notify(layer, index)


def block_evicts(cache: EpisodeCache, block_len: int, budgets: Sequence[int] | CakeBudgets) -> bool:
    """Whether appending a block of `block_len` tokens puts the cache over budget: fixed budgets, when a
    layer would exceed its own; cake, when all layers together would exceed `L * M` (before that, CAKE
    keeps everything, as its code does for a prompt within the cache size)."""
    if isinstance(budgets, CakeBudgets):
        return sum(cache.sizes) + len(cache.layers) * block_len > len(cache.layers) * budgets.budget
    return any(n + block_len > b for n, b in zip(cache.sizes, budgets, strict=True))
