"""The protocol every cache feature implements (`Feature`), and what one episode's build hands it.

A feature is an optional part of how an episode cache is built, stored and answered from: recall's share of the
budget (kvchat.features.recall), IceCache's offload (kvchat.features.icecache), IndexMem's latent memory
(kvchat.features.indexmem), a cache precision (kvchat.features.precision). The pipelines (ingest, append, a batch
worker, ask) call these hooks through the registry (kvchat.features) and never a feature's own modules; every
hook does nothing by default, so a feature implements only the ones it needs. Its saved settings are rows of
kvchat.settings_table naming it in `features`: saved while it is on, and nowhere else written.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvchat.kv.config import CacheConfig

if TYPE_CHECKING:  # types only: commands that load no model import kvchat.features without torch's weight
    import torch

    from kvchat.kv.cache import EpisodeCache, EvictionObserver
    from kvchat.kv.cascade import CakeBudgets

    Budgets = list[int] | CakeBudgets | None  # per layer M (None: full KV keeps everything)
    SideFileWriter = Callable[[Path], tuple[int, str]]  # writes and fsyncs a file at a path: (bytes, sha256)
    StoredFile = Callable[[], tuple[Mapping[str, torch.Tensor], Mapping[str, str]]]  # a stored file's tensors, metadata


class UnreadableFile(ValueError):
    """A feature's stored file that passed the store's checks but does not describe this cache."""

    def __init__(self, what: str, problem: str) -> None:
        super().__init__(f"{what} {problem}")
        self.what, self.problem = what, problem


@dataclass(frozen=True)
class EpisodeSetup:
    """What a feature may use while one episode's cache is built."""

    config: CacheConfig
    model: torch.nn.Module
    trained: Any = None                # a trained method's weights (kvchat.kv.trained.TrainedIndexMem)
    scratch: Path | None = None        # a private dir for the episode's intermediate files, removed with it
    stored: StoredFile | None = None   # an append: the episode's stored side file (its pages, with IceCache)


class EpisodePart:
    """One feature's state while one episode is built; the default does nothing."""

    on_evict: EvictionObserver | None = None  # sees every entry an eviction drops (kvchat.kv.cache)

    @property
    def offloaded(self) -> int:
        """Entries its side file holds (the ingest report)."""
        return 0

    def finish(self, cache: EpisodeCache, *, evicted: bool) -> None:
        """The prefill is done (`evicted`: a scorer chose what stays; full KV evicted nothing) and the cache's
        observer still set: last changes before the cache is stored."""

    def side_file(self, fingerprint: str) -> SideFileWriter | None:
        """How to write the episode's side file beside its cache file (IceCache's pages), if it has one."""
        return None


class Feature:
    """An optional part of an episode cache. `name` is the value of the setting that turns it on."""

    name: str = ""
    side_file_name: str = ""  # what its side file is called in messages ("pages file"), if it has one

    def active(self, cache: CacheConfig) -> bool:
        return False

    def validate(self, cache: CacheConfig) -> None:
        """Refuse settings of this feature that cannot work (errors.UserError); called whether it is on or not,
        so a bad value is caught before it is switched on."""

    def resolve(self, cache: CacheConfig, trained: Any, notes: list[str]) -> CacheConfig:
        """`cache` as this feature will run it, once the plan knows what there is (trained weights)."""
        return cache

    def resident_recent(self, cache: CacheConfig) -> int:
        """History tokens at the end that every eviction keeps whatever the scorer says."""
        return 0

    def episode_budget(self, cache: CacheConfig, budget: int) -> int:
        """M of each episode cache, of the `budget` the others left it."""
        return budget

    def budgets(self, cache: CacheConfig, budgets: Budgets, entries: int) -> Budgets:
        """Per-layer budgets as this feature keeps them (`entries`: the whole history with the system prompt)."""
        return budgets

    def check_append(self, cache: CacheConfig, name: str) -> None:
        """Refuse continuing conversation `name`'s caches with new turns (errors.UserError)."""

    def episode(self, setup: EpisodeSetup) -> EpisodePart | None:
        """Its part in building one episode's cache (None: none)."""
        return None

    def attach(self, cache: EpisodeCache, config: CacheConfig, stored: StoredFile, retrieve: int | None) -> None:
        """Make a loaded `cache` answer with what this feature stored beside it (`stored`, its side file);
        `retrieve` overrides what it reads per answer. UnreadableFile when the file does not fit the cache."""
