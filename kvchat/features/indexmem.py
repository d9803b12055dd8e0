"""IndexMem's latent memory (`--method indexmem`, `--memory`): what eviction drops is folded into a fixed-size
state per layer and KV head (kvchat.kv.latent), stored in the episode file and read while answering.

An episode's memory is written by an eviction observer during its prefill and attached to the cache when
the prefill ends; the codec stores it and attention reads it (kvchat.kv.forward passes it), so answering
needs nothing more here. Without trained memory weights (`train-indexer --stage indexer`) there is no
memory, which the ingest notes once. The indexer's own scoring settings are saved here too: they exist only
for this method.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvchat.errors import UserError
from kvchat.features.feature import EpisodePart, EpisodeSetup, Feature
from kvchat.kv.config import CacheConfig

if TYPE_CHECKING:
    from kvchat.kv.cache import EpisodeCache
    from kvchat.kv.latent import LatentMemory

SETTINGS_KEYS = ("memory", "recent_window", "attention_mix", "indexer_pool_kernel")  # CacheConfig's fields


class IndexMem(Feature):
    name = "indexmem"

    def active(self, cache: CacheConfig) -> bool:
        return cache.method == self.name

    def validate(self, cache: CacheConfig) -> None:
        if cache.recent_window < 0:
            raise UserError(f"recent window must be >= 0 (got {cache.recent_window})")
        if not 0 <= cache.attention_mix <= 1:
            raise UserError(f"attention mix must be in [0, 1] (got {cache.attention_mix})")

    def resolve(self, cache: CacheConfig, trained: Any, notes: list[str]) -> CacheConfig:
        """The memory runs when asked for and trained weights hold memory weights."""
        memory = cache.memory and trained is not None
        if memory and trained.memory is None:
            notes.append(f"{trained.path} holds no memory weights (trained with --stage indexer): no latent memory")
            memory = False
        return cache if memory == cache.memory else dataclasses.replace(cache, memory=memory)

    def episode(self, setup: EpisodeSetup) -> EpisodePart | None:
        if not setup.config.memory or setup.trained is None:
            return None
        from kvchat.kv.latent import LatentMemory  # torch: only when an episode is built

        memory = LatentMemory(setup.trained.memory, setup.trained.config)  # written where the evictions are
        return _Memory(memory.to(next(setup.model.parameters()).device), setup)

    def settings(self, cache: CacheConfig) -> dict:
        return {key: getattr(cache, key) for key in SETTINGS_KEYS}

    def options(self, cache: CacheConfig) -> dict[str, object]:
        return {"memory": cache.memory}

    def from_settings(self, settings: Mapping[str, Any], cache: CacheConfig) -> dict:
        fields = {key: settings[key] for key in SETTINGS_KEYS if key in settings}
        if cache.method == self.name:  # a store written before the blend existed: the indexer alone, pooled
            fields.setdefault("attention_mix", 0.0)  # with pool_kernel
            fields.setdefault("indexer_pool_kernel", cache.pool_kernel)
        return fields


class _Memory(EpisodePart):
    """The episode's latent memory: written on every eviction, attached to the cache when the prefill ends."""

    def __init__(self, memory: LatentMemory, setup: EpisodeSetup) -> None:
        self.memory = memory
        self.on_evict = memory.writer(setup.model.model.rotary_emb)

    def finish(self, cache: EpisodeCache, *, evicted: bool) -> None:
        cache.memory = self.memory
