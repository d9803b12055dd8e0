"""The cache features, registered, and the calls the pipelines make on all of them at once.

A feature (kvchat.features.feature.Feature) is an optional part of how episode caches are built, stored and
answered from. `FEATURES` lists them; ingest, append, a batch worker and ask call the functions below and
never a feature's own module. Adding an offload scheme or a cache precision is one module beside these and
one line in `FEATURES` (its name in the option's choices, kvchat.kv.config, and its settings' rows in
kvchat.settings_table); ARCHITECTURE.md says more.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvchat.features.feature import EpisodePart, EpisodeSetup, Feature, UnreadableFile
from kvchat.features.icecache import IceCache
from kvchat.features.icecache import retrieved_positions as retrieved_positions  # what answering read
from kvchat.features.indexmem import IndexMem
from kvchat.features.precision import Precision
from kvchat.features.recall import Recall
from kvchat.kv.config import CacheConfig

if TYPE_CHECKING:
    from kvchat.features.feature import Budgets, SideFileWriter, StoredFile
    from kvchat.kv.cache import EpisodeCache

__all__ = ["EpisodeSetup", "EpisodeParts", "Feature", "UnreadableFile", "FEATURES"]

FEATURES: tuple[Feature, ...] = (
    Recall(),
    IceCache(),
    IndexMem(),
    Precision("int8", bits=8, group="quant_group"),
    Precision("int4", bits=4, group="quant_group_4bit"),
)


def active(cache: CacheConfig) -> list[Feature]:
    """The features `cache` turns on, in registry order."""
    return [f for f in FEATURES if f.active(cache)]


def validate(cache: CacheConfig) -> None:
    """Every feature's settings, whether it is on or not (errors.UserError)."""
    for feature in FEATURES:
        feature.validate(cache)


def resolve(cache: CacheConfig, trained: Any, notes: list[str]) -> CacheConfig:
    for feature in active(cache):
        cache = feature.resolve(cache, trained, notes)
    return cache


def resident_recent(cache: CacheConfig) -> int:
    """History tokens at the end that stay resident whatever the scorer says (IceCache's window; else none)."""
    return max((f.resident_recent(cache) for f in active(cache)), default=0)


def episode_budget(cache: CacheConfig) -> int:
    """M of each episode cache: `--budget`, less what the features spend elsewhere (recall's chunks)."""
    budget = cache.budget
    for feature in active(cache):
        budget = feature.episode_budget(cache, budget)
    return budget


def budgets(cache: CacheConfig, budgets: Budgets, entries: int) -> Budgets:
    for feature in active(cache):
        budgets = feature.budgets(cache, budgets, entries)
    return budgets


def check_append(cache: CacheConfig, name: str) -> None:
    for feature in active(cache):
        feature.check_append(cache, name)


def side_file_name(cache: CacheConfig) -> str | None:
    """What the side file stored beside each episode file is called ("pages file"), if the features write one."""
    return next((f.side_file_name for f in active(cache) if f.side_file_name), None)


def attach(cache: EpisodeCache, config: CacheConfig, stored: StoredFile, retrieve: int | None = None) -> None:
    """Make a loaded episode `cache` answer with what its features stored (`stored`: its side file, loaded when
    a feature asks for it). UnreadableFile when that file does not fit the cache."""
    for feature in active(config):
        feature.attach(cache, config, stored, retrieve)


class EpisodeParts:
    """The active features' parts in building one episode: one eviction observer for all of them, their last
    changes to the finished cache, its side file."""

    def __init__(self, setup: EpisodeSetup) -> None:
        parts = (f.episode(setup) for f in active(setup.config))
        self.parts: list[EpisodePart] = [p for p in parts if p is not None]
        observers = [p.on_evict for p in self.parts if p.on_evict is not None]
        self.on_evict = observers[0] if len(observers) == 1 else (
            (lambda layer, heads: [observe(layer, heads) for observe in observers]) if observers else None
        )

    def finish(self, cache: EpisodeCache, *, evicted: bool) -> EpisodeCache:
        """Hand the built cache to each part in registry order (offload first, precision last; the observer is
        still set, for what they evict), then clear the observer: the cache is as stored and answered from."""
        for part in self.parts:
            part.finish(cache, evicted=evicted)
        cache.on_evict = None
        return cache

    @property
    def offloaded(self) -> int:
        return sum(p.offloaded for p in self.parts)

    def side_file(self, fingerprint: str) -> SideFileWriter | None:
        return next((w for w in (p.side_file(fingerprint) for p in self.parts) if w is not None), None)
