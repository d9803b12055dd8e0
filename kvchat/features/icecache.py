"""IceCache offload (`--offload icecache`): what eviction drops is kept on disk, paged by key similarity, and read
back while answering.

During an episode's prefill its evicted entries are spilled to the episode's scratch dir (kvchat.kv.spill);
when the cache is done they are paged into the episode's pages file (kvchat.kv.pagefile), written beside its
cache file. Every head keeps its last `window` entries resident beside its budget M (budgets M + W). An
append spills the stored pages again first, so old and new evictions are paged together. While answering,
each layer becomes a paged layer over its own page pool (kvchat.kv.retrieval).

Beyond the model's window (`--positions compact`) the cache keeps every entry's original position beside its
compacted one, and the pages are written at positions beside the resident entries in history order
(kvchat.kv.spill.beside_residents), so what an answer reads back is where the resident cache expects it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from kvchat.errors import UserError
from kvchat.features.feature import EpisodePart, EpisodeSetup, Feature, UnreadableFile
from kvchat.kv.causal_lm import decoder_of
from kvchat.kv.config import CacheConfig, IceCacheConfig
from kvchat.messages import option, setting

if TYPE_CHECKING:  # torch and the KV core are imported where an episode is built or answered
    import torch

    from kvchat.features.feature import Budgets, SideFileWriter, StoredFile
    from kvchat.kv.cache import EpisodeCache
    from kvchat.kv.spill import SpillWriter

class IceCache(Feature):
    name = "icecache"
    side_file_name = "pages file"

    def active(self, cache: CacheConfig) -> bool:
        return cache.offload.mode == self.name

    def resident_recent(self, cache: CacheConfig) -> int:
        return cache.offload.recent

    def budgets(self, cache: CacheConfig, budgets: Budgets, entries: int) -> Budgets:
        """The window W beside each layer's M, and the layers below `first_paged_layer` keeping all their
        `entries` (nothing evicted or paged there, as IceCache keeps layers 0-1)."""
        from kvchat.kv.cascade import CakeBudgets

        if budgets is None:
            return budgets
        first, window = cache.offload.first_paged_layer, cache.offload.recent
        if isinstance(budgets, CakeBudgets):
            if first:
                raise UserError(f"a first paged layer above 0 needs fixed layer budgets, not "
                                f"{setting('layer_budgets', 'cake')}")
            return dataclasses.replace(budgets, budget=budgets.budget + window)
        return [max(entries, b) if i < first else b + window for i, b in enumerate(budgets)]

    def check_append(self, cache: CacheConfig, name: str) -> None:
        if cache.method == "full":
            raise UserError(
                f"conversation '{name}' pages everything past its last tokens ({setting('method', 'full')} "
                f"{setting('offload', 'icecache')}): new turns would be prefilled without the paged past; use "
                f"{option('append')} {option('reingest')}"
            )

    def episode(self, setup: EpisodeSetup) -> EpisodePart:
        from kvchat.kv import pagefile
        from kvchat.kv.shape import ModelShape
        from kvchat.kv.spill import PAGE_DTYPES, SpillWriter

        if setup.scratch is None:
            raise ValueError("IceCache spills an episode's evictions into a scratch dir; none was given")
        shape = ModelShape.of(setup.model)
        spill = SpillWriter(setup.scratch, num_layers=shape.layers, kv_heads=shape.kv_heads, head_dim=shape.head_dim,
                            dtype=PAGE_DTYPES[setup.config.offload.dtype],
                            rotary_emb=decoder_of(setup.model).rotary_emb)
        if setup.stored is not None:  # an append: the stored pages are paged again with the new evictions
            spill.spill_pages(pagefile.decode(*setup.stored()))
        return _Spill(spill, setup.config.offload)

    def attach(self, cache: EpisodeCache, config: CacheConfig, stored: StoredFile, retrieve: int | None) -> None:
        """Only the pages file's page tables and centroids are read now; entries as retrieval gathers them."""
        from kvchat.kv import pagefile
        from kvchat.kv.retrieval import attach_pages, page_scorer

        offload = config.offload
        tensors, metadata = stored()
        try:
            attach_pages(
                cache, pagefile.decode(tensors, metadata),
                budget=retrieve if retrieve is not None else offload.retrieve,
                scorer=page_scorer(offload.scorer, offload.candidates), refresh=offload.refresh,
                pinned_share=offload.pinned_share,
            )
        except ValueError as e:
            raise UnreadableFile(self.side_file_name, f"does not hold pages of this cache ({e})") from None


class _Spill(EpisodePart):
    """The episode's evictions on disk (kvchat.kv.spill), paged into its pages file when it is written, at positions
    beside the resident entries'."""

    def __init__(self, spill: SpillWriter, offload: IceCacheConfig) -> None:
        self.spill, self.offload = spill, offload
        self.on_evict = spill

    @property
    def offloaded(self) -> int:
        return self.spill.entries

    def finish(self, cache: EpisodeCache, *, evicted: bool) -> None:
        from kvchat.kv.prefill import keep_sink_and_window

        if not evicted:  # full KV evicted nothing: page everything but the system prompt and the window
            keep_sink_and_window(cache, self.offload.recent, self.offload.first_paged_layer)
        self.spill.place_beside(cache)

    def side_file(self, fingerprint: str) -> SideFileWriter:
        return lambda path: self.spill.write_pages(path, self.offload.paging, {"fingerprint": fingerprint})


def retrieved_positions(cache: EpisodeCache) -> list[list[torch.Tensor] | None]:
    """Per layer of `cache`, the original positions each KV head is attending to from its pages right now (None
    for a layer without pages). The pools empty when an answer ends."""
    from kvchat.kv.retrieval import PagePool

    out: list[list[torch.Tensor] | None] = []
    for layer in cache.layers:
        pool = getattr(layer, "pool", None)
        current = pool.current if isinstance(pool, PagePool) else None
        out.append(None if current is None else [got.positions for got in current])
    return out
