"""EpisodeCache: a transformers Cache whose layers keep, per KV head, a chosen subset of entries.

Each layer holds keys/values `[1, kv_heads, n, head_dim]` and the original token position of every
entry, `positions [kv_heads, n]` (heads may keep different tokens). Entries stay in position order, so
"the first `protected` entries" is the system prompt, which is never evicted.

Three things the stock DynamicCache cannot do and the prefill/decode loops need:
- `probing()`: run tokens through the model whose KV is visible to themselves but not kept (the
  patched prompt of EpiCache eq. 3);
- `keep()`: evict down to chosen entries per head;
- `checkpoint()/rollback()`: decode an answer on top of the cache, then restore it exactly.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvchat.kv.rope import reposition_keys


class EpisodeLayer(DynamicLayer):
    """One layer's kept entries plus their original positions."""

    def __init__(self) -> None:
        super().__init__()
        self.positions: torch.Tensor = torch.zeros(0, 0, dtype=torch.long)

    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
            self.keys, self.values = keys, values
            self.positions = positions
            return
        self.keys = torch.cat([self.keys, keys], dim=-2)
        self.values = torch.cat([self.values, values], dim=-2)
        self.positions = torch.cat([self.positions, positions], dim=-1)

    def peek(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What attention sees when `keys/values` are added, without keeping them."""
        if not self.is_initialized:
            return keys, values
        return torch.cat([self.keys, keys], dim=-2), torch.cat([self.values, values], dim=-2)

    def keep(self, index: torch.Tensor) -> None:
        """Keep entries `index` [kv_heads, m] (sorted per head, so position order is preserved)."""
        gather = index.unsqueeze(0).unsqueeze(-1).expand(1, -1, -1, self.keys.shape[-1])
        self.keys = self.keys.gather(2, gather)
        self.values = self.values.gather(2, gather)
        self.positions = self.positions.gather(1, index)

    def truncate(self, length: int) -> None:
        self.keys = self.keys[..., :length, :]
        self.values = self.values[..., :length, :]
        self.positions = self.positions[..., :length]

    @property
    def size(self) -> int:
        """Entries per head (equal across heads in this layout)."""
        return self.get_seq_length()


@dataclass(frozen=True)
class Checkpoint:
    lengths: tuple[int, ...]
    next_position: int


class EpisodeCache(Cache):
    """The cache of one episode. Feed tokens with `position_ids(n)` then `advance(n)`."""

    def __init__(self, num_layers: int) -> None:
        super().__init__(layers=[EpisodeLayer() for _ in range(num_layers)])
        self.next_position = 0       # logical position of the next token fed
        self.protected = 0           # leading entries (system prompt) that are never evicted
        self.peak_layer = 0          # most entries one layer has held in attention (probe tokens included)
        self.peak_total = 0          # most entries all layers together have held at once (same counting)
        self._probing = False

    # --- the transformers side -------------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layer: EpisodeLayer = self.layers[layer_idx]
        heads, q_len = key_states.shape[1], key_states.shape[2]
        if self._probing:
            self._note_peak(layer.size + q_len, q_len)
            return layer.peek(key_states, value_states)
        positions = torch.arange(
            self.next_position, self.next_position + q_len, device=key_states.device
        ).expand(heads, q_len)
        layer.append(key_states, value_states, positions)
        self._note_peak(layer.size, 0)
        return layer.keys, layer.values

    def _note_peak(self, layer_entries: int, transient: int) -> None:
        """Peaks are measured where entries are added, inside a forward: eviction may run between layers."""
        self.peak_layer = max(self.peak_layer, layer_entries)
        self.peak_total = max(self.peak_total, sum(self.sizes) + transient)

    # --- feeding ---------------------------------------------------------------------------------
    def position_ids(self, n: int) -> torch.Tensor:
        """Position ids [1, n] for the next `n` tokens."""
        return torch.arange(self.next_position, self.next_position + n).unsqueeze(0)

    def advance(self, n: int) -> None:
        if not self._probing:
            self.next_position += n

    @contextmanager
    def probing(self) -> Iterator[None]:
        """Inside, forwards see the cache but leave it unchanged (and do not advance positions)."""
        self._probing = True
        try:
            yield
        finally:
            self._probing = False

    # --- eviction --------------------------------------------------------------------------------
    @property
    def sizes(self) -> list[int]:
        return [layer.size for layer in self.layers]

    def keep(self, indices: Sequence[torch.Tensor | None]) -> None:
        """Per layer, keep entries `indices[l]` [kv_heads, m]; None leaves the layer as is."""
        for layer, index in zip(self.layers, indices, strict=True):
            if index is not None:
                layer.keep(index)

    def compact(self, rotary_emb: torch.nn.Module) -> None:
        """Re-rotate every head's kept keys to positions 0..n-1 and continue after the longest layer."""
        for layer in self.layers:
            n = layer.size
            new = torch.arange(n, device=layer.keys.device).expand_as(layer.positions)
            if not torch.equal(new, layer.positions):
                layer.keys = reposition_keys(layer.keys, layer.positions, new, rotary_emb)
                layer.positions = new.clone()
        self.next_position = max(self.sizes)

    # --- answering on top of the cache ------------------------------------------------------------
    def checkpoint(self) -> Checkpoint:
        return Checkpoint(tuple(self.sizes), self.next_position)

    def rollback(self, mark: Checkpoint) -> None:
        """Drop everything appended since `mark` (an answer and its question)."""
        for layer, length in zip(self.layers, mark.lengths, strict=True):
            layer.truncate(length)
        self.next_position = mark.next_position

    # --- (de)serialisation as plain tensors (layout in DESIGN.md) ---------------------------------
    def to_tensors(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            out[f"k.{i}"] = layer.keys[0].contiguous()
            out[f"v.{i}"] = layer.values[0].contiguous()
            out[f"pos.{i}"] = layer.positions.to(torch.int32).contiguous()
        return out

    @classmethod
    def from_tensors(
        cls, tensors: dict[str, torch.Tensor], *, next_position: int, protected: int
    ) -> EpisodeCache:
        num_layers = sum(1 for name in tensors if name.startswith("k."))
        cache = cls(num_layers)
        for i, layer in enumerate(cache.layers):
            layer.append(
                tensors[f"k.{i}"].unsqueeze(0),
                tensors[f"v.{i}"].unsqueeze(0),
                tensors[f"pos.{i}"].to(torch.long),
            )
        cache.next_position = next_position
        cache.protected = protected
        return cache

    def nbytes(self) -> int:
        return sum(
            layer.keys.nbytes + layer.values.nbytes for layer in self.layers if layer.is_initialized
        )
