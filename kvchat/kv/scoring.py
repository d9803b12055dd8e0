"""Scorers: one score per (layer, KV head, cached entry); higher means keep.

Design notes (the details and the choices made): docs/internals.md, "kvchat/kv/scoring.py".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from kvchat.kv.attention import AttentionRecorder, LayerView
from kvchat.kv.cache import EpisodeCache
from kvchat.kv.forward import forward


class Scorer(Protocol):
    """Scores every cached entry of every layer: `[kv_heads, n_l]` per layer (see the module docstring)."""

    @property
    def transient_tokens(self) -> int:
        """Tokens the scorer adds to attention while scoring (counted in the peak)."""

    @property
    def in_forward(self) -> bool:
        """Scores come from `layer_scores` during the block's forward, not `__call__`."""

    @property
    def query_rows(self) -> int:
        """The block's last queries `layer_scores` reads."""

    @property
    def needs_hidden(self) -> bool:
        """`layer_scores` reads the layer's input hidden states."""

    def layer_scores(self, view: LayerView) -> torch.Tensor:
        """During the block's forward: scores `[kv_heads, n]` of layer `view.layer_idx`'s entries."""
        ...

    def __call__(self, model: torch.nn.Module, cache: EpisodeCache, block_ids: torch.Tensor) -> list[torch.Tensor]:
        """After the block: scores of every layer."""
        ...


class BlockScorer:
    """Defaults of the protocol: an after-block scorer adding no tokens. Subclasses override what they use (with
    a property, a class attribute or a dataclass field)."""

    @property
    def transient_tokens(self) -> int:
        return 0

    @property
    def in_forward(self) -> bool:
        return False

    @property
    def query_rows(self) -> int:
        return 0

    @property
    def needs_hidden(self) -> bool:
        return False

    def layer_scores(self, view: LayerView) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} scores after the block, not during its forward")

    def __call__(self, model: torch.nn.Module, cache: EpisodeCache, block_ids: torch.Tensor) -> list[torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} scores during the block's forward")


def scores_in_forward(scorer: Scorer) -> bool:
    """Whether `scorer` reads the block during its forward (a plain `__call__` object does not)."""
    return bool(getattr(scorer, "in_forward", False))


def probe_scores(model: torch.nn.Module, cache: EpisodeCache, prompt_ids: torch.Tensor) -> list[torch.Tensor]:
    """Attention of `prompt_ids`, placed after the cache, over every cached entry (EpiCache eq. 3).

    The prompt's own KV is not kept and positions do not advance.
    """
    recorder = AttentionRecorder()
    with cache.probing():
        forward(model, cache, prompt_ids, recorder=recorder)
    return [recorder.scores[i] for i in range(len(cache.layers))]


@dataclass(frozen=True)
class PatchedPromptScorer(BlockScorer):
    """EpiCache: score by the attention an episode-specific patched prompt pays to each entry."""

    prompt_ids: torch.Tensor  # [1, P]
    pool_kernel: int = 1      # max-pool scores over neighbours (see pool_scores); 1 = off

    def __call__(self, model, cache, block_ids):
        return [pool_scores(s, self.pool_kernel) for s in probe_scores(model, cache, self.prompt_ids)]

    @property
    def transient_tokens(self) -> int:
        return self.prompt_ids.shape[-1]


def pool_scores(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """Max-pool scores over neighbouring entries (SnapKV practice): a token next to an important one
    is kept too, which keeps short facts whole instead of their single loudest token."""
    if kernel <= 1:
        return scores
    return F.max_pool1d(scores.unsqueeze(0), kernel, stride=1, padding=kernel // 2).squeeze(0)[
        ..., : scores.shape[-1]
    ]


def select_top(scores: torch.Tensor, budget: int, protected: int, recent: int = 0) -> torch.Tensor | None:
    """Indices [kv_heads, budget] of the entries to keep, in position order; None if all fit.

    The first `protected` entries and the last `recent` (IceCache's resident window under offload) are
    always kept, inside `budget`. Ties go to the earlier entry (stable sort), so the selection is
    deterministic.
    """
    n = scores.shape[-1]
    if n <= budget:
        return None
    if budget < protected + recent:
        raise ValueError(f"budget {budget} is smaller than the {protected} protected and {recent} recent entries")
    ranked = scores.clone()
    ranked[:, :protected] = float("inf")
    ranked[:, max(protected, n - recent) :] = float("inf")
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices
    return order[:, :budget].sort(dim=-1).values


@dataclass(frozen=True)
class BlockPromptScorer(BlockScorer):
    """A patched prompt built from the block itself: SnapKV (its last `tail` tokens) and KVzip
    (an instruction followed by the whole block), as adapted to block prefill in EpiCache A.2."""

    before: torch.Tensor   # [1, a] ids before the block's tokens (may be empty)
    after: torch.Tensor    # [1, b] ids after them (may be empty)
    tail: int | None       # keep only the block's last `tail` tokens; None = the whole block
    block_size: int        # the largest block, for the transient-token bound
    pool_kernel: int = 1

    def prompt(self, block_ids: torch.Tensor) -> torch.Tensor:
        part = block_ids if self.tail is None else block_ids[:, -self.tail :]
        return torch.cat([self.before, part, self.after], dim=-1)

    def __call__(self, model, cache, block_ids):
        return [pool_scores(s, self.pool_kernel) for s in probe_scores(model, cache, self.prompt(block_ids))]

    @property
    def transient_tokens(self) -> int:
        part = self.block_size if self.tail is None else min(self.tail, self.block_size)
        return self.before.shape[-1] + part + self.after.shape[-1]


@dataclass(frozen=True)
class RecencyScorer(BlockScorer):
    """StreamingLLM: keep `sink` entries right after the protected prefix, then the most recent."""

    sink: int
    transient_tokens: int = 0

    def __call__(self, model, cache, block_ids):
        scores = []
        for layer in cache.layers:
            rank = torch.arange(layer.positions.shape[-1], dtype=torch.float32).expand(layer.positions.shape)
            rank = rank.clone()
            rank[:, cache.protected : cache.protected + self.sink] = float("inf")
            scores.append(rank)
        return scores


@dataclass(frozen=True)
class KeyDiffScorer(BlockScorer):
    """KeyDiff: keep keys least similar to the block's mean normalised key (distinct keys carry more)."""

    transient_tokens: int = 0

    def __call__(self, model, cache, block_ids):
        n = block_ids.shape[-1]
        scores = []
        for layer in cache.layers:
            keys = F.normalize(layer.keys[0].float(), dim=-1)       # [heads, entries, dim]
            anchor = F.normalize(keys[:, -n:].mean(dim=1), dim=-1)  # [heads, dim]
            scores.append(-(keys @ anchor.unsqueeze(-1)).squeeze(-1))
        return scores


@dataclass(frozen=True)
class CakeScorer(BlockScorer):
    """CAKE's attention-shift tolerant eviction indicator (eq. 11), from the block's own last window.

    For an entry n before the window, over the window's queries: `mean(A[:, n]) + gamma * var(A[:, n])`
    (a token attended unevenly may matter later even if its mean is low); then an average pool of
    `pool_kernel` neighbours (CAKE's code), and max over the query heads of each GQA group. The window
    itself scores +inf: always kept. Unlike the other scorers it needs no pass of its own: the block's
    forward supplies the window's attention, so the prefill loop evicts during that forward
    (kvchat.kv.cascade).
    """

    window: int        # S_w: the block's last queries
    gamma: float       # weight of the variance
    pool_kernel: int   # odd; 1 = no pooling
    transient_tokens: int = 0
    in_forward = True

    @property
    def query_rows(self) -> int:
        return self.window

    def layer_scores(self, view: LayerView) -> torch.Tensor:
        return self.window_scores(view.weights[..., -self.window :, :])

    def window_scores(self, weights: torch.Tensor) -> torch.Tensor:
        """Scores [kv_heads, kv] from the window's attention `weights` [kv_heads, group, w, kv]."""
        rows, kv = weights.shape[-2], weights.shape[-1]
        before = weights[..., : kv - rows].float()                           # [kv_heads, group, w, n]
        indicator = before.mean(dim=-2) + self.gamma * before.var(dim=-2, correction=1 if rows > 1 else 0)
        if self.pool_kernel > 1 and indicator.shape[-1] > 0:
            indicator = F.avg_pool1d(indicator, self.pool_kernel, stride=1, padding=self.pool_kernel // 2)
        indicator = indicator.amax(dim=1)                                    # max over the GQA group
        kept = torch.full((indicator.shape[0], rows), float("inf"), dtype=indicator.dtype, device=indicator.device)
        return torch.cat([indicator, kept], dim=-1)
