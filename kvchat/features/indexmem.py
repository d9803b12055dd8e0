"""IndexMem's latent memory (`--method indexmem`, setting `latent_memory`): what eviction drops is folded into a
fixed-size state per layer and KV head (kvchat.kv.latent), stored in the episode file and read while answering.

An episode's memory is written by an eviction observer during its prefill and attached to the cache when
the prefill ends; the codec stores it and attention reads it (kvchat.kv.forward passes it), so answering
needs nothing more here. Without trained memory weights (`train-indexer --stage indexer`) there is no
memory, which the ingest notes once. The indexer's own scoring settings are saved while it is on: they exist
only for this method (their rows in kvchat.settings_table name it).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from kvchat.features.feature import EpisodePart, EpisodeSetup, Feature
from kvchat.kv.causal_lm import decoder_of
from kvchat.kv.config import CacheConfig
from kvchat.messages import option

if TYPE_CHECKING:
    from kvchat.kv.cache import EpisodeCache
    from kvchat.kv.latent import LatentMemory

class IndexMem(Feature):
    name = "indexmem"

    def active(self, cache: CacheConfig) -> bool:
        return cache.method == self.name

    def resolve(self, cache: CacheConfig, trained: Any, notes: list[str]) -> CacheConfig:
        """The memory runs when asked for and trained weights hold memory weights."""
        memory = cache.latent_memory and trained is not None
        if memory and trained.memory is None:
            notes.append(f"{trained.path} holds no memory weights (trained with {option('stage', 'indexer')}): no "
                         "latent memory")
            memory = False
        return cache if memory == cache.latent_memory else dataclasses.replace(cache, latent_memory=memory)

    def episode(self, setup: EpisodeSetup) -> EpisodePart | None:
        if not setup.config.latent_memory or setup.trained is None:
            return None
        from kvchat.kv.latent import LatentMemory  # torch: only when an episode is built

        memory = LatentMemory(setup.trained.memory, setup.trained.config)  # written where the evictions are
        return _Memory(memory.to(next(setup.model.parameters()).device), setup)


class _Memory(EpisodePart):
    """The episode's latent memory: written on every eviction, attached to the cache when the prefill ends."""

    def __init__(self, memory: LatentMemory, setup: EpisodeSetup) -> None:
        self.memory = memory
        self.on_evict = memory.writer(decoder_of(setup.model).rotary_emb)

    def finish(self, cache: EpisodeCache, *, evicted: bool) -> None:
        cache.memory = self.memory
