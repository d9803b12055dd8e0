"""Scorers: one score per (layer, KV head, cached entry); higher means keep.

A scorer sees the model, the cache right after a block was appended, and that block's ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from kvchat.kv.attention import AttentionRecorder
from kvchat.kv.cache import EpisodeCache
from kvchat.kv.forward import forward


class Scorer(Protocol):
    """Scores every cached entry of every layer: a list of [kv_heads, n_l] tensors."""

    def __call__(
        self, model: torch.nn.Module, cache: EpisodeCache, block_ids: torch.Tensor
    ) -> list[torch.Tensor]: ...

    @property
    def transient_tokens(self) -> int:
        """Tokens the scorer adds to attention while scoring (counted in the peak)."""
        ...


def probe_scores(model: torch.nn.Module, cache: EpisodeCache, prompt_ids: torch.Tensor) -> list[torch.Tensor]:
    """Attention of `prompt_ids`, placed after the cache, over every cached entry (EpiCache eq. 3).

    The prompt's own KV is not kept and positions do not advance.
    """
    recorder = AttentionRecorder()
    with cache.probing():
        forward(model, cache, prompt_ids, recorder=recorder)
    return [recorder.scores[i] for i in range(len(cache.layers))]


@dataclass(frozen=True)
class PatchedPromptScorer:
    """EpiCache: score by the attention an episode-specific patched prompt pays to each entry."""

    prompt_ids: torch.Tensor  # [1, P]

    def __call__(self, model, cache, block_ids):
        return probe_scores(model, cache, self.prompt_ids)

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


def select_top(scores: torch.Tensor, budget: int, protected: int) -> torch.Tensor | None:
    """Indices [kv_heads, budget] of the entries to keep, in position order; None if all fit.

    The first `protected` entries are always kept. Ties go to the earlier entry (stable sort), so the
    selection is deterministic.
    """
    n = scores.shape[-1]
    if n <= budget:
        return None
    if budget < protected:
        raise ValueError(f"budget {budget} is smaller than the {protected} protected entries")
    ranked = scores.clone()
    ranked[:, :protected] = float("inf")
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices
    return order[:, :budget].sort(dim=-1).values
