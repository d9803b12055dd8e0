"""EpisodeCache: a transformers Cache whose layers keep, per KV head, a chosen subset of entries.

The layer layouts (uniform, ragged) live in kvchat.kv.layers; how a cache is written to and read from
a file lives in kvchat.kv.codec. This class adds what the stock DynamicCache cannot do and the prefill
and decode loops need:
- `probing()`: run tokens through the model whose KV is visible to themselves but not kept (the
  patched prompt of EpiCache eq. 3);
- `keep()` / `keep_layer()`: evict down to chosen entries per head — the one path every eviction takes,
  so an observer (`on_evict`) sees every entry that leaves (IceCache spills them to disk);
- `checkpoint()/rollback()`: decode an answer on top of the cache, then restore it exactly;
- `quantize()` / `dequantize()`: hold the finished cache in 8 or 4 bits (kvchat.kv.quantize) and back;
- `track_origins()`: keep every entry's original token position beside the position its key is rotated for,
  which `compact()` changes (an offload places the entries it reads back beside the resident ones by them, and
  receipts map entries to turns by them: every compacted cache keeps them).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
from transformers.cache_utils import Cache

from kvchat.kv.attention import HeadList
from kvchat.kv.layers import CacheLayer, HeadIndex, QuantizedLayer, RaggedLayer, UniformLayer, dropped_index

if TYPE_CHECKING:
    from kvchat.kv.latent import LatentMemory

__all__ = ["Checkpoint", "EpisodeCache", "Evicted", "EvictionObserver", "RaggedLayer", "UniformLayer"]


class Evicted(NamedTuple):
    """One KV head's entries leaving the cache: keys and values `[n, D]` as cached, `positions` `[n]` the positions
    their keys are rotated for, `origins` `[n]` their original token positions (the same unless compacted)."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    origins: torch.Tensor


# Called with (layer index, per KV head the entries leaving it) just before an eviction.
EvictionObserver = Callable[[int, list[Evicted]], None]
Origins = list[list[torch.Tensor]]  # per layer, per KV head: the original token position of every entry


@dataclass(frozen=True)
class Checkpoint:
    lengths: tuple[tuple[int, ...], ...]  # per layer, per head
    next_position: int
    next_origin: int | None = None  # with tracked origins (`EpisodeCache.track_origins`)

    def extended(self, n: int) -> Checkpoint:
        """This mark with `n` more tokens fed after it (every head takes each token fed): to roll back to a point
        inside a forward's tokens, such as a prompt's last."""
        return Checkpoint(tuple(tuple(k + n for k in heads) for heads in self.lengths), self.next_position + n,
                          None if self.next_origin is None else self.next_origin + n)  # fmt: skip


class EpisodeCache(Cache):
    """The cache of one episode. Feed tokens with `position_ids(n)` then `advance(n)`."""

    # kvchat's layer types (all transformers DynamicLayers), by what the loops here need of them (`CacheLayer`)
    layers: list[CacheLayer]  # type: ignore[assignment]

    def __init__(self, num_layers: int) -> None:
        super().__init__(layers=[UniformLayer() for _ in range(num_layers)])
        self.next_position = 0       # logical position of the next token fed
        self.protected = 0           # leading entries (system prompt) that are never evicted
        self.recent = 0              # trailing entries of every head never evicted (IceCache's window, offload)
        self.peak_layer_entries = 0          # most entries one layer has held in attention (probe tokens included)
        self.peak_total_entries = 0          # most entries all layers together have held at once (same counting)
        self.on_evict: EvictionObserver | None = None  # sees every entry an eviction drops
        self.memory: LatentMemory | None = None  # what was evicted, in a latent memory read while answering
        self.origins: Origins | None = None  # tracked original positions (`track_origins`), else None
        self.next_origin = 0         # with tracked origins: the original position of the next token fed
        self._probing = False
        self._positions_key: tuple | None = None
        self._positions = torch.zeros(0, 0, dtype=torch.long)

    @classmethod
    def of_layers(cls, layers: Sequence[CacheLayer], *, next_position: int, protected: int) -> EpisodeCache:
        """A cache holding `layers` as they are (kvchat.kv.codec builds caches from files this way)."""
        cache = cls(len(layers))
        cache.layers[:] = list(layers)
        cache.next_position = next_position
        cache.protected = protected
        return cache

    def copy(self) -> EpisodeCache:
        """A cache sharing this one's tensors; evicting from or appending to either leaves the other whole
        (every layer's `keep` builds new tensors, and a layer copies shared buffers out before writing)."""
        other = EpisodeCache.of_layers(
            [copy.copy(layer) for layer in self.layers], next_position=self.next_position, protected=self.protected
        )
        other.peak_layer_entries, other.peak_total_entries = self.peak_layer_entries, self.peak_total_entries
        other.memory = self.memory
        if self.origins is not None:
            other.origins, other.next_origin = [list(heads) for heads in self.origins], self.next_origin
        return other

    # --- the transformers side -------------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layer = self.layers[layer_idx]
        heads, q_len = key_states.shape[1], key_states.shape[2]
        if self._probing:
            self._note_peak(layer.size + q_len, q_len)
            return layer.peek(key_states, value_states)
        layer.append(key_states, value_states, self._new_positions(q_len, heads, key_states.device))
        if self.origins is not None:
            new = torch.arange(self.next_origin, self.next_origin + q_len, device=key_states.device)
            self.origins[layer_idx] = [torch.cat([o, new]) for o in self.origins[layer_idx]]
        self._note_peak(layer.size, 0)
        return layer.keys, layer.values

    def append_token(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
                     ) -> tuple[torch.Tensor | HeadList, torch.Tensor | HeadList]:
        """`update` for one answer token fed outside the model's forward (`kvchat.model.decode_step`): the layer's
        append alone. The caller has checked that nothing else `update` does applies (it is not probing, no
        origins are tracked) and calls `note_decoded` once after the last layer instead of a peak per layer."""
        layer = self.layers[layer_idx]
        layer.append(key_states, value_states, self._new_positions(1, key_states.shape[1], key_states.device))
        return layer.keys, layer.values

    def place(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Append entries computed elsewhere (`keys/values [1, kv_heads, q, D]`, keys rotated for `positions [kv_heads,
        q]`, each head its own, all at or after `next_position`): a stored chunk's, kept where a prefill there would
        have put them. Positions do not advance: `advance` once every layer has its entries."""
        layer = self.layers[layer_idx]
        layer.append(keys, values, positions)
        if self.origins is not None:
            shift = self.next_origin - self.next_position
            self.origins[layer_idx] = [torch.cat([o, p.to(o.device) + shift])
                                       for o, p in zip(self.origins[layer_idx], positions, strict=True)]  # fmt: skip
        self._note_peak(layer.size, 0)

    def note_decoded(self) -> None:
        """After `append_token` into every layer: the token's position taken, the peaks noted once."""
        self._note_peak(max(self.sizes), 0)
        self.advance(1)

    def _new_positions(self, q_len: int, heads: int, device: torch.device) -> torch.Tensor:
        """Positions `[heads, q_len]` of the tokens being fed: built once per forward, not once per layer."""
        key = (self.next_position, q_len, heads, device)
        if self._positions_key != key:
            start = self.next_position
            self._positions = torch.arange(start, start + q_len, device=device).expand(heads, q_len)
            self._positions_key = key
        return self._positions

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
            self.next_origin += n

    def track_origins(self) -> None:
        """From now on keep each entry's original token position (`origins`), which eviction and compaction
        carry along and observers receive. The positions held now must still be the original ones."""
        if self.origins is None:
            self.origins = [[p.clone() for p in per_head(layer.positions)] for layer in self.layers]
            self.next_origin = self.next_position

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
        """Per layer, keep entries `indices[l]` (see `keep_layer`); None leaves the layer as is."""
        if len(indices) != len(self.layers):
            raise ValueError(f"{len(indices)} indices for {len(self.layers)} layers")
        for i, index in enumerate(indices):
            if index is not None:
                self.keep_layer(i, index)

    def keep_layer(self, layer_idx: int, index: torch.Tensor | HeadIndex) -> None:
        """Keep entries `index` of layer `layer_idx`: a `[kv_heads, m]` tensor (the same count in every
        head), or one sorted 1-D index per head (a count per head: the layer becomes a RaggedLayer).
        `on_evict`, when set, first receives what leaves."""
        layer = self.layers[layer_idx]
        if not isinstance(index, torch.Tensor) and not layer.ragged:
            layer = self.layers[layer_idx] = RaggedLayer.from_uniform(layer)
        index = _on_device_of(layer, index)
        dropped = None
        if self.origins is not None:
            heads = self.origins[layer_idx]
            dropped = [o[dropped_index(o.shape[0], i, o.device)] for o, i in zip(heads, index, strict=True)]
            self.origins[layer_idx] = [o[i] for o, i in zip(heads, index, strict=True)]
        if self.on_evict is not None:
            self.on_evict(layer_idx, [
                Evicted(k, v, p, p if dropped is None else dropped[h])
                for h, (k, v, p) in enumerate(layer.evicted(index))
            ])  # fmt: skip
        layer.keep(index)

    def compact(self, rotary_emb: torch.nn.Module) -> None:
        """Re-rotate every head's kept keys to positions 0..n-1 and continue after the longest head."""
        for layer in self.layers:
            layer.compact(rotary_emb)
        self.next_position = max(layer.get_seq_length() for layer in self.layers)

    # --- answering on top of the cache ------------------------------------------------------------
    def checkpoint(self) -> Checkpoint:
        tracked = self.next_origin if self.origins is not None else None
        return Checkpoint(tuple(tuple(layer.lengths) for layer in self.layers), self.next_position, tracked)

    def rollback(self, mark: Checkpoint) -> None:
        """Drop everything appended since `mark` (an answer and its question)."""
        for i, (layer, lengths) in enumerate(zip(self.layers, mark.lengths, strict=True)):
            layer.truncate_heads(lengths)
            if self.origins is not None:
                self.origins[i] = [o[:n] for o, n in zip(self.origins[i], lengths, strict=True)]
        self.next_position = mark.next_position
        if mark.next_origin is not None:
            self.next_origin = mark.next_origin

    def reserve(self, extra: int) -> None:
        """Make room for `extra` more entries in every layer that keeps spare room, so feeding that many
        tokens writes in place (a decode reserves its question and longest answer once)."""
        for layer in self.layers:
            reserve = getattr(layer, "reserve", None)  # optional: a layer type may grow as it likes
            if reserve is not None:
                reserve(extra)

    # --- precision ------------------------------------------------------------------------------
    def quantize(self, group: int, residual: int, bits: int = 8) -> None:
        """Hold every layer in `bits` (8 or 4; `QuantizedLayer`: key groups of `group` tokens, each head's last
        `residual` entries or more in full precision); the cache then answers but is not evicted from."""
        self.layers[:] = [QuantizedLayer.of(_full_precision(layer), group, residual, bits) for layer in self.layers]

    def dequantize(self) -> None:
        """Every quantized layer back in full precision (to continue a prefill: `ingest --append`)."""
        self.layers[:] = [layer.dequantized() if isinstance(layer, QuantizedLayer) else layer for layer in self.layers]

    @property
    def precision(self) -> str:
        """int8 or int4 when the layers are held in 8 or 4 bits, else full."""
        bits = [layer.bits for layer in self.layers if isinstance(layer, QuantizedLayer)]
        return f"int{bits[0]}" if bits else "full"

    def nbytes(self) -> int:
        """Bytes of the kept keys and values (positions not counted)."""
        return sum(layer.nbytes() for layer in self.layers)


def per_head(positions: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One `[n_h]` tensor per KV head, of a uniform layer's `[kv_heads, n]` or a ragged layer's per-head tensors."""
    return list(positions.unbind(0)) if isinstance(positions, torch.Tensor) else list(positions)


def _full_precision(layer: CacheLayer) -> UniformLayer | RaggedLayer:
    if not isinstance(layer, UniformLayer | RaggedLayer):
        raise TypeError(f"a {type(layer).__name__} is not quantized (a quantized cache is dequantized first)")
    return layer


def _on_device_of(layer: CacheLayer, index: torch.Tensor | HeadIndex) -> torch.Tensor | HeadIndex:
    """Scores and selections may be computed on the CPU; the index goes where the layer's tensors are."""
    keys = layer.keys[0] if layer.ragged and len(layer.keys) else layer.keys
    if not isinstance(keys, torch.Tensor) or keys.device.type == "cpu":
        return index
    return index.to(keys.device) if isinstance(index, torch.Tensor) else [i.to(keys.device) for i in index]
