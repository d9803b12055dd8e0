"""Head budgets: how a layer's budget is shared among its KV heads when it evicts.

`uniform`: every head keeps its own top-`M_l` entries (the same count in every head).
`adaptive` (AdaKV, Feng et al. 2024; used with every method in the EpiCache paper): the layer keeps its
top `M_l x kv_heads` (head, token) pairs across all heads, so heads that spread their attention keep
more entries and focused heads fewer. Scores are comparable across heads of a layer because each is a
softmax attention weight. A per-head floor (AdaKV's safeguard) keeps every head at least
`floor_fraction x M_l` of its best entries, and never fewer than the protected system prompt, which
every head keeps whole. The layer then holds heads of different lengths (kvchat.kv.cache.RaggedLayer).

Ties are broken deterministically: within a head the earlier entry wins, across heads the lower head.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvchat.kv.config import HEAD_BUDGETS, HEAD_FLOOR_FRACTION
from kvchat.kv.scoring import select_top


def head_floor(budget: int, protected: int, floor_fraction: float) -> int:
    """Entries every head keeps (when it has them) under adaptive selection: `floor_fraction` of the
    layer's per-head budget, at least the protected prefix, at most the budget."""
    return min(budget, max(protected, int(floor_fraction * budget)))


def select_adaptive(
    scores: torch.Tensor, lengths: Sequence[int], budget: int, protected: int, floor: int, recent: int = 0
) -> tuple[torch.Tensor, ...] | None:
    """Indices of the entries to keep in each head: the top `budget * kv_heads` (head, entry) pairs of
    the layer, each head keeping at least its own top `floor` (and its first `protected` and last `recent`
    entries, always).

    `scores` is `[kv_heads, n_max]`; head h's entries are `scores[h, :lengths[h]]` (anything after is
    padding and ignored). Returns one sorted 1-D index per head (position order preserved), or None
    when everything fits.
    """
    heads, n_max = scores.shape
    lengths_t = torch.as_tensor(list(lengths), dtype=torch.long)
    total = int(lengths_t.sum())
    if total <= budget * heads:
        return None
    if budget < protected + recent:
        raise ValueError(f"budget {budget} is smaller than the {protected} protected and {recent} recent entries")
    if not protected <= floor <= budget:
        raise ValueError(f"head floor {floor} must lie within {protected}..{budget}")
    valid = torch.arange(n_max).unsqueeze(0) < lengths_t.unsqueeze(1)           # [heads, n_max]
    ranked = scores.detach().float().cpu().clone()
    ranked[:, :protected] = float("inf")
    if recent:  # each head's own last entries
        column = torch.arange(n_max).unsqueeze(0)
        ranked[(column >= (lengths_t - recent).clamp_min(protected).unsqueeze(1)) & valid] = float("inf")
    ranked[~valid] = float("-inf")
    # Each head's own ranking (score desc, earlier entry first); padding sorts last.
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices
    order = torch.where(torch.gather(valid, 1, order), order, n_max)  # padding -> sentinel
    rank = torch.full((heads, n_max + 1), n_max, dtype=torch.long)
    rank.scatter_(1, order, torch.arange(n_max).expand(heads, n_max))
    rank = rank[:, :n_max]
    kept = valid & (rank < floor)
    # The rest of the layer's budget goes to the best remaining pairs across heads. Flattening is
    # head-major, so the stable sort breaks ties to the lower head, then the earlier entry.
    spare = budget * heads - int(kept.sum())
    candidates = (valid & ~kept).flatten().nonzero().squeeze(1)
    best = torch.sort(ranked.flatten()[candidates], descending=True, stable=True).indices[:spare]
    kept.view(-1)[candidates[best]] = True
    return tuple(kept[h].nonzero().squeeze(1).to(scores.device) for h in range(heads))


@dataclass(frozen=True)
class HeadBudgets:
    """How eviction shares a layer's budget among its KV heads (see the module docstring)."""

    mode: str = "uniform"
    floor_fraction: float = HEAD_FLOOR_FRACTION

    def __post_init__(self) -> None:
        if self.mode not in HEAD_BUDGETS:
            raise ValueError(f"unknown head budget mode {self.mode!r}")
        if not 0.0 <= self.floor_fraction <= 1.0:
            raise ValueError(f"head floor fraction {self.floor_fraction} must lie within 0..1")

    def select(
        self, scores: torch.Tensor, budget: int, protected: int, lengths: Sequence[int], recent: int = 0
    ) -> torch.Tensor | tuple[torch.Tensor, ...] | None:
        """What `EpisodeCache.keep` takes for one layer: `[kv_heads, budget]` (uniform), one index per
        head (adaptive), or None when the layer fits its budget. The first `protected` and the last `recent`
        entries of every head are kept whatever they score."""
        if self.mode == "uniform":
            return select_top(scores, budget, protected, recent)
        floor = head_floor(budget, protected, self.floor_fraction)
        return select_adaptive(scores, lengths, budget, protected, floor, recent)
