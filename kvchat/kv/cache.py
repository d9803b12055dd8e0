"""EpisodeCache: a transformers Cache whose layers keep, per KV head, a chosen subset of entries.

Two layouts of a layer, chosen per layer:
- `EpisodeLayer` (uniform): keys/values `[1, kv_heads, n, head_dim]` and the original token position of
  every entry, `positions [kv_heads, n]`. Heads may keep different tokens but the same number of them.
- `RaggedLayer` (head-wise budgets, kvchat.kv.heads): each KV head h keeps its own `n_h` entries, stored
  as separate tensors `[1, 1, n_h, head_dim]` (a `HeadList`) with positions `[n_h]`, so memory holds
  exactly the kept entries. A uniform layer becomes ragged when `keep` is given one index per head.
In both, entries stay in position order within a head, so "the first `protected` entries" of every
head is the system prompt, which is never evicted.

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

from kvchat.kv.attention import HeadList
from kvchat.kv.rope import reposition_keys

# One index per head (1-D, sorted) selects a different number of entries in each head.
HeadIndex = Sequence[torch.Tensor]


class EpisodeLayer(DynamicLayer):
    """One layer's kept entries plus their original positions; every head holds `n` entries."""

    ragged = False

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

    def truncate_heads(self, lengths: Sequence[int]) -> None:
        """`truncate` with one length per head (all equal in this layout)."""
        if len(set(lengths)) > 1:
            raise ValueError("a uniform layer cannot keep different lengths per head")
        if lengths:
            self.truncate(lengths[0])

    @property
    def size(self) -> int:
        """Entries per head (equal across heads in this layout)."""
        return self.get_seq_length()

    @property
    def lengths(self) -> list[int]:
        """Entries kept by each head."""
        return [self.size] * self.keys.shape[1] if self.is_initialized else []

    @property
    def entries(self) -> int:
        return sum(self.lengths)

    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes if self.is_initialized else 0

    def compact(self, rotary_emb: torch.nn.Module) -> None:
        """Re-rotate kept keys to positions 0..n-1."""
        new = torch.arange(self.size, device=self.keys.device).expand_as(self.positions)
        if not torch.equal(new, self.positions):
            self.keys = reposition_keys(self.keys, self.positions, new, rotary_emb)
            self.positions = new.clone()

    def to_tensors(self, i: int) -> dict[str, torch.Tensor]:
        return {
            f"k.{i}": self.keys[0].contiguous(),
            f"v.{i}": self.values[0].contiguous(),
            f"pos.{i}": self.positions.to(torch.int32).contiguous(),
        }


class RaggedLayer(DynamicLayer):
    """A layer whose KV heads keep different numbers of entries (head-wise budgets).

    `keys`/`values` are `HeadList`s of `[1, 1, n_h, head_dim]` tensors and `positions` a tuple of `[n_h]`
    tensors, one per head: no padding anywhere, so `nbytes()` is exactly kept entries x entry size.
    `update` returns the HeadLists, and kvchat's attention function attends per head over its own
    length. The token axis of every new forward is appended to every head, as in the uniform layout.
    """

    ragged = True

    def __init__(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], positions: Sequence[torch.Tensor]):
        super().__init__()
        if not (len(keys) == len(values) == len(positions)) or not keys:
            raise ValueError("a ragged layer needs keys, values and positions for every head")
        self.keys, self.values = HeadList(keys), HeadList(values)
        self.positions: tuple[torch.Tensor, ...] = tuple(positions)
        self.dtype, self.device = keys[0].dtype, keys[0].device
        self.is_initialized = True

    @classmethod
    def from_uniform(cls, layer: EpisodeLayer) -> RaggedLayer:
        """The same entries, one tensor per head (views: nothing is copied until `keep` gathers)."""
        heads = layer.keys.shape[1]
        return cls(
            [layer.keys[:, h : h + 1] for h in range(heads)],
            [layer.values[:, h : h + 1] for h in range(heads)],
            [layer.positions[h] for h in range(heads)],
        )

    def lazy_initialization(self, key_states, value_states) -> None:  # built initialised
        raise RuntimeError("a ragged layer is built from existing entries")

    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Add `keys/values [1, kv_heads, q, D]` (positions `[kv_heads, q]`) to every head."""
        self.keys, self.values = self.peek(keys, values)
        self.positions = tuple(torch.cat([p, new]) for p, new in zip(self.positions, positions, strict=True))

    def peek(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[HeadList, HeadList]:
        """What attention sees when `keys/values` are added, without keeping them."""
        return (
            HeadList(torch.cat([k, keys[:, h : h + 1]], dim=-2) for h, k in enumerate(self.keys)),
            HeadList(torch.cat([v, values[:, h : h + 1]], dim=-2) for h, v in enumerate(self.values)),
        )

    def keep(self, index: HeadIndex | torch.Tensor) -> None:
        """Keep entries `index[h]` (1-D, sorted, so position order is preserved) of every head h."""
        if len(index) != len(self.keys):
            raise ValueError(f"{len(index)} indices for {len(self.keys)} heads")
        self.keys = HeadList(k.index_select(2, i) for k, i in zip(self.keys, index, strict=True))
        self.values = HeadList(v.index_select(2, i) for v, i in zip(self.values, index, strict=True))
        self.positions = tuple(p.index_select(0, i) for p, i in zip(self.positions, index, strict=True))

    def truncate_heads(self, lengths: Sequence[int]) -> None:
        self.keys = HeadList(k[..., :n, :] for k, n in zip(self.keys, lengths, strict=True))
        self.values = HeadList(v[..., :n, :] for v, n in zip(self.values, lengths, strict=True))
        self.positions = tuple(p[:n] for p, n in zip(self.positions, lengths, strict=True))

    @property
    def lengths(self) -> list[int]:
        """Entries kept by each head."""
        return [k.shape[2] for k in self.keys]

    @property
    def entries(self) -> int:
        return sum(self.lengths)

    @property
    def size(self) -> int:
        """Entries per head on average, rounded up: the layer's memory in units of one head's entry, so
        `size <= budget` exactly when the layer holds at most `budget x kv_heads` entries."""
        return -(-self.entries // len(self.keys))

    def get_seq_length(self) -> int:
        """The longest head (only used by transformers to size masks, which kvchat builds itself)."""
        return max(self.lengths)

    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values, strict=True))

    def compact(self, rotary_emb: torch.nn.Module) -> None:
        """Re-rotate every head's kept keys to positions 0..n_h-1."""
        keys, positions = [], []
        for k, p in zip(self.keys, self.positions, strict=True):
            new = torch.arange(p.shape[0], device=p.device)
            if not torch.equal(new, p):
                k = reposition_keys(k, p.unsqueeze(0), new.unsqueeze(0), rotary_emb)
                p = new
            keys.append(k)
            positions.append(p)
        self.keys, self.positions = HeadList(keys), tuple(positions)

    def to_tensors(self, i: int) -> dict[str, torch.Tensor]:
        """Heads concatenated along the token axis: `k.{i}`/`v.{i}` `[total, D]`, `pos.{i}` `[total]`,
        and `len.{i}` `[kv_heads]` (int32) saying how many rows belong to each head, in head order."""
        return {
            f"k.{i}": torch.cat([k[0, 0] for k in self.keys]),
            f"v.{i}": torch.cat([v[0, 0] for v in self.values]),
            f"pos.{i}": torch.cat(self.positions).to(torch.int32),
            f"len.{i}": torch.tensor(self.lengths, dtype=torch.int32),
        }

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], i: int) -> RaggedLayer:
        keys, values, positions, lengths = (tensors[f"{n}.{i}"] for n in ("k", "v", "pos", "len"))
        split = [int(n) for n in lengths.tolist()]
        rows = keys.shape[0]
        if (
            lengths.dim() != 1 or min(split, default=-1) < 0 or sum(split) != rows
            or keys.dim() != 2 or values.shape != keys.shape or positions.shape != (rows,)
        ):
            raise ValueError(f"layer {i}: per-head lengths {split} do not match tensors of {rows} rows")
        return cls(
            [k.unsqueeze(0).unsqueeze(0) for k in keys.split(split)],
            [v.unsqueeze(0).unsqueeze(0) for v in values.split(split)],
            [p.to(torch.long) for p in positions.split(split)],
        )


@dataclass(frozen=True)
class Checkpoint:
    lengths: tuple[tuple[int, ...], ...]  # per layer, per head
    next_position: int


class EpisodeCache(Cache):
    """The cache of one episode. Feed tokens with `position_ids(n)` then `advance(n)`."""

    layers: list[EpisodeLayer | RaggedLayer]

    def __init__(self, num_layers: int) -> None:
        super().__init__(layers=[EpisodeLayer() for _ in range(num_layers)])
        self.next_position = 0       # logical position of the next token fed
        self.protected = 0           # leading entries (system prompt) that are never evicted
        self.peak_layer_entries = 0          # most entries one layer has held in attention (probe tokens included)
        self.peak_total_entries = 0          # most entries all layers together have held at once (same counting)
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
        self.peak_layer_entries = max(self.peak_layer_entries, layer_entries)
        self.peak_total_entries = max(self.peak_total_entries, sum(self.sizes) + transient)

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
        """Entries per head of each layer (for a ragged layer, the mean over its heads, rounded up)."""
        return [layer.size for layer in self.layers]

    @property
    def entries(self) -> int:
        """Kept entries over all layers and heads."""
        return sum(layer.entries for layer in self.layers)

    def keep(self, indices: Sequence[torch.Tensor | HeadIndex | None]) -> None:
        """Per layer, keep entries `indices[l]`: a `[kv_heads, m]` tensor (the same count in every head),
        or one sorted 1-D index per head (a count per head: the layer becomes a RaggedLayer); None leaves
        the layer as is."""
        for i, (layer, index) in enumerate(zip(self.layers, indices, strict=True)):
            if index is None:
                continue
            if not isinstance(index, torch.Tensor) and not layer.ragged:
                layer = self.layers[i] = RaggedLayer.from_uniform(layer)
            layer.keep(index)

    def compact(self, rotary_emb: torch.nn.Module) -> None:
        """Re-rotate every head's kept keys to positions 0..n-1 and continue after the longest head."""
        for layer in self.layers:
            layer.compact(rotary_emb)
        self.next_position = max(layer.get_seq_length() for layer in self.layers)

    # --- answering on top of the cache ------------------------------------------------------------
    def checkpoint(self) -> Checkpoint:
        return Checkpoint(tuple(tuple(layer.lengths) for layer in self.layers), self.next_position)

    def rollback(self, mark: Checkpoint) -> None:
        """Drop everything appended since `mark` (an answer and its question)."""
        for layer, lengths in zip(self.layers, mark.lengths, strict=True):
            layer.truncate_heads(lengths)
        self.next_position = mark.next_position

    # --- (de)serialisation as plain tensors ---------------------------------------------------------
    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Per layer l, uniform: `k.{l}`/`v.{l}` `[kv_heads, n, D]`, `pos.{l}` `[kv_heads, n]` int32 (DESIGN.md).
        Ragged: `k.{l}`/`v.{l}` `[total, D]` (heads concatenated in head order), `pos.{l}` `[total]` and
        `len.{l}` `[kv_heads]` int32, each head's row count. Only kept entries are written either way."""
        out: dict[str, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            out.update(layer.to_tensors(i))
        return out

    @classmethod
    def from_tensors(
        cls, tensors: dict[str, torch.Tensor], *, next_position: int, protected: int
    ) -> EpisodeCache:
        """The inverse of `to_tensors`; a layer with a `len.{l}` tensor is ragged. Raises ValueError when
        the tensors do not describe a cache."""
        num_layers = sum(1 for name in tensors if name.startswith("k."))
        if any(f"{n}.{i}" not in tensors for i in range(num_layers) for n in ("k", "v", "pos")):
            raise ValueError(f"cache tensors are incomplete: {sorted(tensors)}")
        cache = cls(num_layers)
        for i, layer in enumerate(cache.layers):
            if f"len.{i}" in tensors:
                cache.layers[i] = RaggedLayer.from_tensors(tensors, i)
                continue
            layer.append(
                tensors[f"k.{i}"].unsqueeze(0),
                tensors[f"v.{i}"].unsqueeze(0),
                tensors[f"pos.{i}"].to(torch.long),
            )
        cache.next_position = next_position
        cache.protected = protected
        return cache

    def nbytes(self) -> int:
        """Bytes of the kept keys and values (positions not counted)."""
        return sum(layer.nbytes() for layer in self.layers)
