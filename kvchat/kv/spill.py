"""Spilling evicted entries to disk during block prefill, then paging them into one pages file.

Block prefill evicts back to the budget after every block; with IceCache the evicted entries are kept,
not dropped. Holding them in memory would make ingest's memory grow with the history, so each block's
evictions are appended at once to raw files (keys, values, positions) per layer and KV head in a
private directory, and memory keeps only the block being evicted: the ingest bound budget + block +
prompt still holds. After the episode, `write_pages` reads one layer at a time back, groups every
head's entries into semantic pages and streams the layer into the pages file.

Where the cache was compacted (`--positions compact`: its keys re-rotated to 0..n-1 so a history longer than
the model's window fits it), the evicted keys are rotated for whatever position they had when they left, and
that frame moves with every compaction. Each entry is therefore spilled with its original position and the
position its key is rotated for; when the episode is done (`place_beside`), every entry is re-rotated to a
position beside the resident cache's in history order (`beside_residents`) before it is paged, so what an
answer reads back sits where the resident entries and the question expect it. docs/how-it-works.md says why
this placement.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvchat.kv.cache import per_head
from kvchat.kv.config import PagingConfig
from kvchat.kv.pagefile import LayerPages, pages_metadata, write_layers
from kvchat.kv.pages import HeadPages, semantic_pages
from kvchat.kv.rope import reposition_keys

if TYPE_CHECKING:
    from kvchat.kv.cache import EpisodeCache, Evicted

PAGE_DTYPES = {"float16": torch.float16, "float32": torch.float32}  # how spilled entries and pages are stored
_NUMPY = {torch.float16: np.float16, torch.float32: np.float32}
_FILES = ("k", "v", "pos", "at")  # keys, values, original positions, positions the keys are rotated for


def beside_residents(origins: torch.Tensor, resident_origins: torch.Tensor, resident_positions: torch.Tensor,
                     end: int) -> torch.Tensor:  # fmt: skip
    """The position each offloaded entry of one head is answered at, from its original position (`origins`
    `[n]`) and the head's resident entries (their original positions and the positions they are at, both
    ascending, `[m]`): as far past its nearest resident predecessor in history order as it originally was, but
    before the next resident's position (and before `end`, the question's first). Where the residents kept their
    original positions that is the entry's own; where compaction closed the gaps between them, the predecessor's
    (entries evicted between two residents share it)."""
    # a resident before all (-1, -1) and one after all (at `end`) bound every entry on both sides
    origin = torch.cat([origins.new_tensor([-1]), resident_origins.to(origins), origins.new_tensor([2**62])])
    position = torch.cat([origins.new_tensor([-1]), resident_positions.to(origins), origins.new_tensor([end])])
    before = torch.searchsorted(origin, origins, right=True) - 1
    return torch.minimum(position[before] + (origins - origin[before]), position[before + 1] - 1).clamp_min(0)


# How offloaded entries are placed at the end of an episode: (original positions, positions their keys are rotated
# for, resident original positions, resident positions, the question's first position) -> positions.
Placement = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def _beside(origins, _rotated, resident_origins, resident_positions, end):  # the placement kvchat uses
    return beside_residents(origins, resident_origins, resident_positions, end)


@dataclasses.dataclass(frozen=True)
class Residents:
    """What placing an episode's offloaded entries needs of its finished cache: per layer, per KV head, the
    resident entries' original positions and the positions their keys are rotated for, and the question's
    first position. `compact`: those differ (the pages file then records where each key is rotated for)."""

    origins: list[list[torch.Tensor]]
    positions: list[list[torch.Tensor]]
    end: int
    compact: bool

    @classmethod
    def of(cls, cache: EpisodeCache) -> Residents:
        positions = [[p.cpu() for p in per_head(layer.positions)] for layer in cache.layers]
        if cache.origins is None:
            return cls(positions, positions, cache.next_position, compact=False)
        origins = [[o.cpu() for o in heads] for heads in cache.origins]
        return cls(origins, positions, cache.next_position, compact=True)


class SpillWriter:
    """Collects the evicted entries of one episode in `directory` (which must exist and be private).

    It is an eviction observer (`EpisodeCache.on_evict`): `writer(layer, evicted)` with, per KV head, the
    keys `[n, D]`, values `[n, D]`, the positions the keys are rotated for and the original positions `[n]` of
    the entries leaving the cache (kvchat.kv.cache.Evicted). Entries are stored at `dtype` (half precision by
    default). `rotary_emb`, the model's, re-rotates keys where `place_beside` moves them.
    """

    def __init__(
        self, directory: Path, *, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float16,
        rotary_emb: torch.nn.Module | None = None,
    ) -> None:  # fmt: skip
        if dtype not in _NUMPY:
            raise ValueError(f"entries spill as float16 or float32, not {dtype}")
        self.directory = Path(directory)
        self.num_layers, self.kv_heads, self.head_dim, self.dtype = num_layers, kv_heads, head_dim, dtype
        self.rotary_emb = rotary_emb
        self.counts = [[0] * kv_heads for _ in range(num_layers)]
        self.residents: Residents | None = None

    def __call__(self, layer: int, evicted: Sequence[Evicted | tuple[torch.Tensor, ...]]) -> None:
        """Append, per KV head h, `evicted[h]`: keys, values, the positions the keys are rotated for and the
        original positions (kvchat.kv.cache.Evicted; without the last, those positions are the original ones)."""
        if len(evicted) != self.kv_heads:
            raise ValueError(f"layer {layer}: evictions for {len(evicted)} heads, expected {self.kv_heads}")
        for head, (keys, values, positions, *origins) in enumerate(evicted):
            self.spill(layer, head, keys, values, origins[0] if origins else positions, at=positions)

    def spill(self, layer: int, head: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
              at: torch.Tensor | None = None) -> None:  # fmt: skip
        """Append one head's evicted entries: original `positions`, keys rotated for `at` (default: those)."""
        n = keys.shape[0]
        at = positions if at is None else at
        if keys.shape != (n, self.head_dim) or values.shape != keys.shape or not positions.shape == at.shape == (n,):
            raise ValueError(f"spilled entries of layer {layer} head {head} have mismatched shapes")
        if n == 0:
            return
        for suffix, tensor in zip(_FILES, (
            keys.detach().to("cpu", self.dtype), values.detach().to("cpu", self.dtype),
            positions.detach().to("cpu", torch.int32), at.detach().to("cpu", torch.int32),
        ), strict=True):  # fmt: skip
            with open(self._file(layer, head, suffix), "ab") as f:
                f.write(tensor.contiguous().numpy().tobytes())
        self.counts[layer][head] += n

    def spill_pages(self, layers: Sequence[Sequence[HeadPages]]) -> None:
        """Spill the entries of existing pages (per layer, per KV head; e.g. a stored pages file's `FileRows`),
        one head at a time, so they are paged again with what is evicted next."""
        for layer, heads in enumerate(layers):
            for head, pages in enumerate(heads):
                self.spill(layer, head, pages.keys, pages.values, pages.positions, at=pages.rotated_for)

    def place_beside(self, cache: EpisodeCache) -> None:
        """The episode is done: its entries will be paged at positions beside `cache`'s resident ones."""
        self.residents = Residents.of(cache)

    @property
    def entries(self) -> int:
        """Entries spilled so far, over all layers and heads."""
        return sum(map(sum, self.counts))

    def head_entries(self, layer: int, head: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Everything spilled for one head, in spill order: keys, values `[n, D]`, original positions `[n]` (long)."""
        n, dim = self.counts[layer][head], self.head_dim
        if n == 0:
            empty = torch.zeros(0, dim, dtype=self.dtype)
            return empty, empty.clone(), torch.zeros(0, dtype=torch.long)
        dtype = _NUMPY[self.dtype]
        keys = np.fromfile(self._file(layer, head, "k"), dtype=dtype).reshape(n, dim)
        values = np.fromfile(self._file(layer, head, "v"), dtype=dtype).reshape(n, dim)
        return torch.from_numpy(keys), torch.from_numpy(values), self._positions(layer, head, "pos")

    def head_rotations(self, layer: int, head: int) -> torch.Tensor:
        """The positions one head's spilled keys are rotated for `[n]` (long), in spill order."""
        return self._positions(layer, head, "at")

    def _positions(self, layer: int, head: int, suffix: str) -> torch.Tensor:
        if self.counts[layer][head] == 0:
            return torch.zeros(0, dtype=torch.long)
        return torch.from_numpy(np.fromfile(self._file(layer, head, suffix), dtype=np.int32)).to(torch.long)

    def layers(self, config: PagingConfig, placement: Placement = _beside) -> Iterator[LayerPages]:
        """Each layer's pages in turn, built when asked for: one layer's entries in memory at a time. After
        `place_beside`, keys are first re-rotated to the positions `placement` gives them (kvchat's: beside the
        residents, `beside_residents`)."""
        for layer in range(self.num_layers):
            yield [self._head_pages(layer, head, config, placement) for head in range(self.kv_heads)]

    def _head_pages(self, layer: int, head: int, config: PagingConfig, placement: Placement) -> HeadPages:
        keys, values, origins = self.head_entries(layer, head)
        residents = self.residents
        if residents is None:  # not placed: as spilled (an original-positions cache's keys are at their origins)
            return semantic_pages(keys, values, origins, config)
        at = self.head_rotations(layer, head)
        target = placement(origins, at, residents.origins[layer][head], residents.positions[layer][head],
                           residents.end)  # fmt: skip
        moved = target != at
        if bool(moved.any()):
            if self.rotary_emb is None:
                raise ValueError("moving spilled keys to new positions needs the model's rotary embedding")
            keys = keys.clone()
            keys[moved] = reposition_keys(keys[moved][None, None].float(), at[moved][None], target[moved][None],
                                          self.rotary_emb)[0, 0].to(keys.dtype)  # fmt: skip
        pages = semantic_pages(keys, values, origins, config)
        if not residents.compact:
            return pages
        order = torch.argsort(origins)  # original positions are unique within a head: look each page row's up
        return dataclasses.replace(pages, at=target[order][torch.searchsorted(origins[order], pages.positions)])

    def write_pages(
        self, path: Path, config: PagingConfig = PagingConfig(), metadata: Mapping[str, str] | None = None
    ) -> tuple[int, str]:
        """Page every head's spilled entries and write the pages file at `path` (fsynced), then remove
        the spill files. `metadata` is added to the file's (e.g. the model fingerprint). Returns (bytes,
        sha256 hex)."""
        compact = self.residents is not None and self.residents.compact
        shape = pages_metadata(self.num_layers, self.kv_heads, self.head_dim, config.page_size,
                               positions="compact" if compact else "original")  # fmt: skip
        result = write_layers(path, self.layers(config), {**shape, **(metadata or {})}, dtype=self.dtype)
        self.discard()
        return result

    def discard(self) -> None:
        """Remove the spill files (the directory itself is the caller's)."""
        for layer in range(self.num_layers):
            for head in range(self.kv_heads):
                for suffix in _FILES:
                    self._file(layer, head, suffix).unlink(missing_ok=True)

    def _file(self, layer: int, head: int, suffix: str) -> Path:
        return self.directory / f"spill.{layer}.{head}.{suffix}"
