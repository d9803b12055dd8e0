"""Recall (`--method recall`, and `auto`'s beyond the model's window) as a cache feature: of the budget M, the routed
episode caches keep `M - R` entries and each question's top chunks of raw turns take the other R.

This module is recall's part of building a conversation: how M is split (`split`), which settings it refuses, and
that its settings are saved (their rows in kvchat.settings_table name it). Answering from the chunks, their index
in each episode file and the recall entries file of `--recall-entries stored` are kvchat.answer.recall's and
kvchat.answer.recall_entries'; the entries file belongs to the conversation, not to an episode, so it is not an
episode's side file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvchat.errors import UserError
from kvchat.features.feature import Feature
from kvchat.kv.config import CacheConfig, RecallConfig
from kvchat.kv.methods import REGISTRY, may_recall
from kvchat.messages import setting


@dataclass(frozen=True)
class RecallSplit:
    """How `--method recall` spends a budget M per layer and KV head: `cache_budget` entries of the routed episode
    cache, `chunks` chunks of at most `chunk_tokens` tokens of recalled turns, each taking at most `chunk_entries`
    entries (its tokens, or with compressed stored entries their kept share), ranked by `retrieval`
    (RecallConfig.retrieval)."""

    cache_budget: int
    chunks: int
    chunk_tokens: int
    retrieval: str
    chunk_entries: int

    @property
    def recalled(self) -> int:
        return self.chunks * self.chunk_entries


def stored_entries(tokens: int, recall: RecallConfig) -> int:
    """Entries a chunk of `tokens` tokens takes when placed from stored entries: its first `repair` recomputed and
    the kept share of the rest (RecallConfig.kept, of the whole chunk); every token where they are prefilled."""
    if recall.entries != "stored":
        return tokens
    return max(min(recall.repair, tokens), min(tokens, math.ceil(recall.kept * tokens - 1e-9)))


def split(cache: CacheConfig) -> RecallSplit:
    """`cache.budget` split by its recall share into whole chunks (at least one; chunks shrink to fit a small
    budget), the episode caches keeping the rest."""
    share = cache.recall.share
    if not 0 < share < 1:
        raise UserError(f"{setting('recall_share')} must be between 0 and 1 (got {share})")
    if not 0 < cache.recall.kept <= 1:
        raise UserError(f"{setting('recall_kept')} must be above 0 and at most 1 (got {cache.recall.kept})")
    recalled = max(1, int(cache.budget * share))
    chunk_tokens = min(cache.recall.chunk_tokens, recalled)
    entries = stored_entries(chunk_tokens, cache.recall)
    chunks = max(1, recalled // entries)
    return RecallSplit(cache.budget - chunks * entries, chunks, chunk_tokens, cache.recall.retrieval, entries)


def split_for(cache: CacheConfig) -> RecallSplit | None:
    """`split(cache)` where its method recalls chunks (`--method recall`), else None."""
    entry = REGISTRY.get(cache.method)
    return split(cache) if entry is not None and entry.recalls else None


class Recall(Feature):
    """On for a method that recalls, and for `auto` until it is resolved (it may recall)."""

    name = "recall"

    def active(self, cache: CacheConfig) -> bool:
        return may_recall(cache.method)

    def validate(self, cache: CacheConfig) -> None:
        if self.active(cache):
            split(cache)  # refuses a share it cannot split the budget by
        elif cache.recall.entries != RecallConfig.entries:
            raise UserError(f"{setting('recall_entries', cache.recall.entries)} needs {setting('method', 'recall')} "
                            f"(or auto, which recalls beyond the model's window); {setting('method', cache.method)} "
                            "recalls nothing")

    def episode_budget(self, cache: CacheConfig, budget: int) -> int:
        found = split_for(cache)
        return budget if found is None else budget - found.recalled
