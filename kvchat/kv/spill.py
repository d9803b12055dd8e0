"""Spilling evicted entries to disk during block prefill, then paging them into one pages file.

Block prefill evicts back to the budget after every block; with IceCache the evicted entries are kept,
not dropped. Holding them in memory would make ingest's memory grow with the history, so each block's
evictions are appended at once to raw files (keys, values, positions) per layer and KV head in a
private directory, and memory keeps only the block being evicted: the ingest bound budget + block +
prompt still holds. After the episode, `write_pages` reads one layer at a time back, groups every
head's entries into semantic pages and streams the layer into the pages file.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from kvchat.kv.config import PagingConfig
from kvchat.kv.pagefile import LayerPages, pages_metadata, write_layers
from kvchat.kv.pages import HeadPages, semantic_pages

PAGE_DTYPES = {"float16": torch.float16, "float32": torch.float32}  # how spilled entries and pages are stored
_NUMPY = {torch.float16: np.float16, torch.float32: np.float32}


class SpillWriter:
    """Collects the evicted entries of one episode in `directory` (which must exist and be private).

    It is an eviction observer (`EpisodeCache.on_evict`): `writer(layer, evicted)` with, per KV head, the
    keys `[n, D]`, values `[n, D]` and original positions `[n]` leaving the cache. Entries are stored at
    `dtype` (half precision by default).
    """

    def __init__(
        self, directory: Path, *, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float16
    ) -> None:
        if dtype not in _NUMPY:
            raise ValueError(f"entries spill as float16 or float32, not {dtype}")
        self.directory = Path(directory)
        self.num_layers, self.kv_heads, self.head_dim, self.dtype = num_layers, kv_heads, head_dim, dtype
        self.counts = [[0] * kv_heads for _ in range(num_layers)]

    def __call__(self, layer: int, evicted: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        """Append, per KV head h, `evicted[h]` = (keys `[n, D]`, values `[n, D]`, positions `[n]`)."""
        if len(evicted) != self.kv_heads:
            raise ValueError(f"layer {layer}: evictions for {len(evicted)} heads, expected {self.kv_heads}")
        for head, (keys, values, positions) in enumerate(evicted):
            self.spill(layer, head, keys, values, positions)

    def spill(self, layer: int, head: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Append one head's evicted entries."""
        n = keys.shape[0]
        if keys.shape != (n, self.head_dim) or values.shape != keys.shape or positions.shape != (n,):
            raise ValueError(f"spilled entries of layer {layer} head {head} have mismatched shapes")
        if n == 0:
            return
        for suffix, tensor in (
            ("k", keys.detach().to("cpu", self.dtype)),
            ("v", values.detach().to("cpu", self.dtype)),
            ("pos", positions.detach().to("cpu", torch.int32)),
        ):
            with open(self._file(layer, head, suffix), "ab") as f:
                f.write(tensor.contiguous().numpy().tobytes())
        self.counts[layer][head] += n

    def spill_pages(self, layers: Sequence[Sequence[HeadPages]]) -> None:
        """Spill the entries of existing pages (per layer, per KV head; e.g. a stored pages file's `FileRows`),
        one head at a time, so they are paged again with what is evicted next."""
        for layer, heads in enumerate(layers):
            for head, pages in enumerate(heads):
                self.spill(layer, head, pages.keys, pages.values, pages.positions)

    @property
    def entries(self) -> int:
        """Entries spilled so far, over all layers and heads."""
        return sum(map(sum, self.counts))

    def head_entries(self, layer: int, head: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Everything spilled for one head, in spill order: keys, values `[n, D]`, positions `[n]` (long)."""
        n, dim = self.counts[layer][head], self.head_dim
        if n == 0:
            empty = torch.zeros(0, dim, dtype=self.dtype)
            return empty, empty.clone(), torch.zeros(0, dtype=torch.long)
        dtype = _NUMPY[self.dtype]
        keys = np.fromfile(self._file(layer, head, "k"), dtype=dtype).reshape(n, dim)
        values = np.fromfile(self._file(layer, head, "v"), dtype=dtype).reshape(n, dim)
        positions = np.fromfile(self._file(layer, head, "pos"), dtype=np.int32)
        return torch.from_numpy(keys), torch.from_numpy(values), torch.from_numpy(positions).to(torch.long)

    def layers(self, config: PagingConfig) -> Iterator[LayerPages]:
        """Each layer's pages in turn, built when asked for: one layer's entries in memory at a time."""
        for layer in range(self.num_layers):
            yield [semantic_pages(*self.head_entries(layer, head), config) for head in range(self.kv_heads)]

    def write_pages(
        self, path: Path, config: PagingConfig = PagingConfig(), metadata: Mapping[str, str] | None = None
    ) -> tuple[int, str]:
        """Page every head's spilled entries and write the pages file at `path` (fsynced), then remove
        the spill files. `metadata` is added to the file's (e.g. the model fingerprint). Returns (bytes,
        sha256 hex)."""
        shape = pages_metadata(self.num_layers, self.kv_heads, self.head_dim, config.page_size)
        result = write_layers(path, self.layers(config), {**shape, **(metadata or {})}, dtype=self.dtype)
        self.discard()
        return result

    def discard(self) -> None:
        """Remove the spill files (the directory itself is the caller's)."""
        for layer in range(self.num_layers):
            for head in range(self.kv_heads):
                for suffix in ("k", "v", "pos"):
                    self._file(layer, head, suffix).unlink(missing_ok=True)

    def _file(self, layer: int, head: int, suffix: str) -> Path:
        return self.directory / f"spill.{layer}.{head}.{suffix}"
