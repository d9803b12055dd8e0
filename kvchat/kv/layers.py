"""Layer types of an episode cache: how one layer holds its kept entries.

Design notes (the details and the choices made): docs/internals.md, "kvchat/kv/layers.py".
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch
from transformers.cache_utils import DynamicLayer

from kvchat.kv.attention import HeadList, PagedKeys, PageSource
from kvchat.kv.quantize import QuantizedEntries, quantized_length
from kvchat.kv.rope import reposition_keys

# One index per head (1-D, sorted) selects a different number of entries in each head.
HeadIndex = Sequence[torch.Tensor]
# What one head gives up in an eviction: keys [n, D], values [n, D], original positions [n].
EvictedHead = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@runtime_checkable
class CacheLayer(Protocol):
    """What the prefill loop, the decoder and the codec need of one layer."""

    @property
    def ragged(self) -> bool:
        """Heads hold different counts (`keys`/`values` are HeadLists, `positions` one tensor per head)."""

    @property
    def keys(self) -> torch.Tensor | HeadList:
        """`[1, kv_heads, n, D]`, or a HeadList of `[1, 1, n_h, D]` (ragged); what attention reads."""

    @property
    def values(self) -> torch.Tensor | HeadList: ...

    @property
    def positions(self) -> torch.Tensor | Sequence[torch.Tensor]:
        """Original position of every entry: `[kv_heads, n]`, or one `[n_h]` tensor per head (ragged)."""

    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Add `keys/values [1, kv_heads, q, D]` at `positions [kv_heads, q]` to every head."""

    def peek(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor | HeadList, torch.Tensor | HeadList]:
        """What attention sees when `keys/values` are added, without keeping them."""

    def keep(self, index: torch.Tensor | HeadIndex) -> None:
        """Keep only the entries `index` of each head (sorted: position order is preserved)."""

    def evicted(self, index: torch.Tensor | HeadIndex) -> list[EvictedHead]:
        """Per head, the entries `keep(index)` would drop, in position order."""

    def truncate_heads(self, lengths: Sequence[int]) -> None:
        """Keep each head's first `lengths[h]` entries (rollback after an answer)."""

    def compact(self, rotary_emb: torch.nn.Module) -> None:
        """Re-rotate kept keys to positions 0..n_h-1."""

    @property
    def lengths(self) -> list[int]: ...

    @property
    def entries(self) -> int: ...

    @property
    def size(self) -> int: ...

    def get_seq_length(self) -> int: ...

    def nbytes(self) -> int: ...


def dropped_index(length: int, kept: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Indices in 0..length-1 that are not in `kept`, ascending."""
    mask = torch.ones(length, dtype=torch.bool, device=device)
    mask[kept] = False
    return mask.nonzero().squeeze(1)


# Spare room a full buffer grows by: a quarter of what it holds, at least 64 entries per head. Geometric, so
# appending one token at a time copies each entry a bounded number of times; a decode that knows its length
# reserves it up front (`EpisodeCache.reserve`) and never grows.
GROWTH = 0.25
MIN_ROOM = 64


def grown_capacity(length: int, new: int) -> int:
    """Entries per head a buffer holding `length` grows to when `new` more arrive and do not fit."""
    return length + new + max(MIN_ROOM, int(length * GROWTH))


class UniformLayer(DynamicLayer):
    """One layer's kept entries plus their original positions; every head holds `n` entries.

    Entries live in buffers with room to grow (`_k`, `_v` `[1, kv_heads, capacity, D]`, `_p`
    `[kv_heads, capacity]`): appending writes after the last entry instead of copying the whole layer,
    and `keys`, `values`, `positions` are views of the live part. A layer writes in place only into
    buffers it allocated itself (`_owned`): tensors it was built from (a file's, another layer's) and
    buffers a `copy` shares are copied out before the first write, so a copy never sees the other's
    appends.
    """

    ragged = False
    # transformers' base types these `Tensor | None` (None until initialised); this layer reads them only once
    # `is_initialized`.
    keys: torch.Tensor
    values: torch.Tensor
    _k: torch.Tensor
    _v: torch.Tensor
    _p: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.positions: torch.Tensor = torch.zeros(0, 0, dtype=torch.long)
        self._owned = False

    @classmethod
    def of(cls, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> UniformLayer:
        """A layer holding `keys/values [1, kv_heads, n, D]` at `positions [kv_heads, n]` (not copied)."""
        layer = cls()
        layer.append(keys, values, positions)
        return layer

    def __copy__(self) -> UniformLayer:
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__)
        self._owned = other._owned = False  # the buffers are shared now: the next append copies them out
        return other

    def _adopt(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Hold exactly these tensors (no spare room, not written in place)."""
        self._k, self._v, self._p = keys, values, positions
        self.keys, self.values, self.positions = keys, values, positions
        self._owned = False

    def _live(self, n: int) -> None:
        self.keys, self.values, self.positions = self._k[:, :, :n], self._v[:, :, :n], self._p[:, :n]

    def reserve(self, extra: int) -> None:
        """Make room for `extra` more entries per head, so the next appends write in place."""
        if self.is_initialized and (not self._owned or self.size + extra > self._k.shape[2]):
            self._grow(self.size + extra)

    def _grow(self, capacity: int) -> None:
        """Move the live entries into buffers of `capacity` entries per head that this layer owns."""
        n = self.size
        k = self._k.new_empty(*self._k.shape[:2], capacity, self._k.shape[3])
        v = self._v.new_empty(*self._v.shape[:2], capacity, self._v.shape[3])
        p = self._p.new_empty(self._p.shape[0], capacity)
        k[:, :, :n], v[:, :, :n], p[:, :n] = self.keys, self.values, self.positions
        self._k, self._v, self._p, self._owned = k, v, p, True
        self._live(n)

    @property
    def writable_room(self) -> int:
        """Entries per head that can still be written into this layer's buffers in place (0 while they are
        shared or not its own)."""
        return self._k.shape[2] - self.size if self.is_initialized and self._owned else 0

    @property
    def buffers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The whole buffers (`[1, kv_heads, capacity, D]` twice, `[kv_heads, capacity]`) that `keys`, `values`
        and `positions` are the first `size` entries of: for a writer that fills the room in place
        (kvchat.model.cuda_graph_step) while `writable_room` lasts, then calls `extend`."""
        return self._k, self._v, self._p

    def extend(self, n: int) -> None:
        """Count the `n` entries written after the live ones into `buffers` as live."""
        if n > self.writable_room:
            raise ValueError(f"{n} entries written in place but only {self.writable_room} fit")
        self._live(self.size + n)

    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
            self._adopt(keys, values, positions)
            return
        n, q = self.size, keys.shape[-2]
        if not self._owned or n + q > self._k.shape[2]:
            self._grow(grown_capacity(n, q))
        self._k[:, :, n : n + q] = keys
        self._v[:, :, n : n + q] = values
        self._p[:, n : n + q] = positions
        self._live(n + q)

    def peek(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            return keys, values
        return torch.cat([self.keys, keys], dim=-2), torch.cat([self.values, values], dim=-2)

    def keep(self, index: torch.Tensor | HeadIndex) -> None:
        """Keep entries `index` [kv_heads, m] (sorted per head, so position order is preserved)."""
        if not isinstance(index, torch.Tensor):  # EpisodeCache.keep_layer makes a layer ragged for these
            raise TypeError("a uniform layer keeps a [kv_heads, m] index: the same count in every head")
        gather = index.unsqueeze(0).unsqueeze(-1).expand(1, -1, -1, self.keys.shape[-1])
        self._adopt(self.keys.gather(2, gather), self.values.gather(2, gather), self.positions.gather(1, index))

    def evicted(self, index: torch.Tensor | HeadIndex) -> list[EvictedHead]:
        out = []
        for h, kept in enumerate(index):
            drop = dropped_index(self.size, kept, self.keys.device)
            out.append((self.keys[0, h, drop], self.values[0, h, drop], self.positions[h, drop]))
        return out

    def truncate(self, length: int) -> None:
        if self.is_initialized:
            self._live(min(length, self.size))

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
        """Bytes of the kept entries (spare room in the buffers not counted)."""
        return self.keys.nbytes + self.values.nbytes if self.is_initialized else 0

    def compact(self, rotary_emb: torch.nn.Module) -> None:
        """Re-rotate kept keys to positions 0..n-1."""
        new = torch.arange(self.size, device=self.keys.device).expand_as(self.positions)
        if not torch.equal(new, self.positions):
            self._adopt(reposition_keys(self.keys, self.positions, new, rotary_emb), self.values, new.clone())


class RaggedLayer(DynamicLayer):
    """A layer whose KV heads keep different numbers of entries (head-wise budgets).

    `keys`/`values` are `HeadList`s of `[1, 1, n_h, head_dim]` tensors and `positions` a tuple of `[n_h]`
    tensors, one per head: no padding anywhere, so `nbytes()` is exactly kept entries x entry size.
    `update` returns the HeadLists, and kvchat's attention function attends per head over its own
    length. The token axis of every new forward is appended to every head, as in the uniform layout.
    As in `UniformLayer`, each head's entries sit in a buffer with room to grow and those are views of
    its live part; only buffers the layer allocated itself are written in place.
    """

    ragged = True
    # One tensor per head where transformers' base has one `Tensor | None`: kvchat's attention function takes
    # HeadLists (kvchat.kv.attention), transformers only passes them through from `update`.
    keys: HeadList  # type: ignore[assignment]
    values: HeadList  # type: ignore[assignment]
    _k: list[torch.Tensor]
    _v: list[torch.Tensor]
    _p: list[torch.Tensor]
    _owned: bool

    def __init__(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], positions: Sequence[torch.Tensor]):
        super().__init__()
        if not (len(keys) == len(values) == len(positions)) or not keys:
            raise ValueError("a ragged layer needs keys, values and positions for every head")
        self._adopt(keys, values, positions)
        self.dtype, self.device = keys[0].dtype, keys[0].device
        self.is_initialized = True

    @classmethod
    def from_uniform(cls, layer: CacheLayer) -> RaggedLayer:
        """The same entries of a uniform layout (a `UniformLayer`, or a uniform `QuantizedLayer`'s dequantized
        ones), one tensor per head (views: nothing is copied until `keep` gathers)."""
        keys, values, positions = layer.keys, layer.values, layer.positions
        if not (isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor)
                and isinstance(positions, torch.Tensor)):  # fmt: skip
            raise TypeError(f"a {type(layer).__name__} holding one tensor per head is not a uniform layer")
        heads = keys.shape[1]
        return cls(
            [keys[:, h : h + 1] for h in range(heads)],
            [values[:, h : h + 1] for h in range(heads)],
            [positions[h] for h in range(heads)],
        )

    def __copy__(self) -> RaggedLayer:
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__)
        self._owned = other._owned = False  # the buffers are shared now: the next append copies them out
        return other

    def _adopt(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
               positions: Sequence[torch.Tensor]) -> None:  # fmt: skip
        """Hold exactly these tensors (no spare room, not written in place)."""
        self._k, self._v, self._p = list(keys), list(values), list(positions)
        self.keys, self.values = HeadList(keys), HeadList(values)
        self.positions: tuple[torch.Tensor, ...] = tuple(positions)
        self._owned = False

    def _live(self, lengths: Sequence[int]) -> None:
        self.keys = HeadList(k[:, :, :n] for k, n in zip(self._k, lengths, strict=True))
        self.values = HeadList(v[:, :, :n] for v, n in zip(self._v, lengths, strict=True))
        self.positions = tuple(p[:n] for p, n in zip(self._p, lengths, strict=True))

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:  # built initialised
        raise RuntimeError("a ragged layer is built from existing entries")

    def reserve(self, extra: int) -> None:
        """Make room for `extra` more entries in every head, so the next appends write in place."""
        if not self._owned or any(n + extra > k.shape[2] for n, k in zip(self.lengths, self._k, strict=True)):
            self._grow([n + extra for n in self.lengths])

    def _grow(self, capacities: Sequence[int]) -> None:
        """Move every head's live entries into buffers of `capacities[h]` entries that this layer owns."""
        lengths = self.lengths
        k = [t.new_empty(1, 1, c, t.shape[3]) for t, c in zip(self._k, capacities, strict=True)]
        v = [t.new_empty(1, 1, c, t.shape[3]) for t, c in zip(self._v, capacities, strict=True)]
        p = [t.new_empty(c) for t, c in zip(self._p, capacities, strict=True)]
        for h, n in enumerate(lengths):
            k[h][:, :, :n], v[h][:, :, :n], p[h][:n] = self.keys[h], self.values[h], self.positions[h]
        self._k, self._v, self._p, self._owned = k, v, p, True
        self._live(lengths)

    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Add `keys/values [1, kv_heads, q, D]` (positions `[kv_heads, q]`) to every head."""
        lengths, q = self.lengths, keys.shape[-2]
        if not self._owned or any(n + q > k.shape[2] for n, k in zip(lengths, self._k, strict=True)):
            self._grow([grown_capacity(n, q) for n in lengths])
        for h, n in enumerate(lengths):
            self._k[h][:, :, n : n + q] = keys[:, h : h + 1]
            self._v[h][:, :, n : n + q] = values[:, h : h + 1]
            self._p[h][n : n + q] = positions[h]
        self._live([n + q for n in lengths])

    def peek(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[HeadList, HeadList]:
        return (
            HeadList(torch.cat([k, keys[:, h : h + 1]], dim=-2) for h, k in enumerate(self.keys)),
            HeadList(torch.cat([v, values[:, h : h + 1]], dim=-2) for h, v in enumerate(self.values)),
        )

    def keep(self, index: HeadIndex | torch.Tensor) -> None:
        """Keep entries `index[h]` (1-D, sorted, so position order is preserved) of every head h."""
        if len(index) != len(self.keys):
            raise ValueError(f"{len(index)} indices for {len(self.keys)} heads")
        self._adopt(
            [k.index_select(2, i) for k, i in zip(self.keys, index, strict=True)],
            [v.index_select(2, i) for v, i in zip(self.values, index, strict=True)],
            [p.index_select(0, i) for p, i in zip(self.positions, index, strict=True)],
        )

    def evicted(self, index: HeadIndex | torch.Tensor) -> list[EvictedHead]:
        out = []
        for k, v, p, kept in zip(self.keys, self.values, self.positions, index, strict=True):
            drop = dropped_index(p.shape[0], kept, p.device)
            out.append((k[0, 0, drop], v[0, 0, drop], p[drop]))
        return out

    def truncate_heads(self, lengths: Sequence[int]) -> None:
        self._live([min(n, have) for n, have in zip(lengths, self.lengths, strict=True)])

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
        """Bytes of the kept entries (spare room in the buffers not counted)."""
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
        self._adopt(keys, list(self.values), positions)


class PagedLayer(RaggedLayer):
    """The resident entries of a layer (one tensor per KV head) and `pool`, which retrieves each head's
    offloaded pages for every forward's queries: `keys` is a `PagedKeys`, which kvchat's attention extends
    with them. Rolling back (`truncate_heads`, after an answer) empties the pool. For answering only."""

    def __init__(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                 positions: Sequence[torch.Tensor], pool: PageSource):  # fmt: skip
        self.pool = pool  # before the entries are adopted: `keys` carries it from the start
        super().__init__(keys, values, positions)

    @classmethod
    def over(cls, layer: CacheLayer, pool: PageSource) -> PagedLayer:
        """`layer`'s entries (views, nothing copied) answering with `pool`."""
        ragged = layer if isinstance(layer, RaggedLayer) else RaggedLayer.from_uniform(layer)
        return cls(ragged.keys, ragged.values, ragged.positions, pool)

    def _adopt(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
               positions: Sequence[torch.Tensor]) -> None:  # fmt: skip
        super()._adopt(keys, values, positions)
        self.keys = PagedKeys.of(self.keys, self.pool)

    def _live(self, lengths: Sequence[int]) -> None:
        super()._live(lengths)
        self.keys = PagedKeys.of(self.keys, self.pool)

    def truncate_heads(self, lengths: Sequence[int]) -> None:
        super().truncate_heads(lengths)
        self.pool.clear()

    def keep(self, index: HeadIndex | torch.Tensor) -> None:
        raise TypeError("a paged layer answers questions; it is not evicted from")

    def evicted(self, index: HeadIndex | torch.Tensor) -> list[EvictedHead]:
        raise TypeError("a paged layer answers questions; it is not evicted from")

    def compact(self, rotary_emb: torch.nn.Module) -> None:
        raise TypeError("a paged layer keeps original positions: its pages' keys are rotated for them")


class QuantizedLayer(DynamicLayer):
    """A layer's entries in 8 or 4 bits (`--cache-precision int8|int4`, `bits`), each head's last ones in full
    precision.

    Per KV head, the first `quantized[h]` entries (whole key groups, kvchat.kv.quantize) are `QuantizedEntries`
    and the rest, `residual`, a `UniformLayer` or `RaggedLayer` of full-precision entries: the history's last
    tokens that fill no group (or were kept as KIVI's residual), then whatever a question and its answer
    append. `keys`/`values` dequantize the quantized part at every access, into one tensor with the residual, in
    the layout of the residual (a `[1, kv_heads, n, D]` tensor, or a `HeadList`), so attention is unchanged.
    Rolling back truncates the residual only: the quantized part is never written after it is built, so a
    rollback restores the layer exactly. Not evicted from (`dequantized()` gives a full-precision layer to
    continue a prefill with).
    """

    def __init__(self, body: QuantizedEntries | Sequence[QuantizedEntries], body_positions: torch.Tensor | Sequence[
            torch.Tensor], residual: UniformLayer | RaggedLayer):  # fmt: skip
        # CacheLayerMixin.__init__ would assign `keys`/`values`, which are computed here.
        self.body, self.body_positions, self.residual = body, body_positions, residual
        self.ragged = residual.ragged
        # Entries of each head held in `bits`: fixed once built (answering appends to the residual only).
        self.quantized: tuple[int, ...]
        if isinstance(body, QuantizedEntries):
            first, self.quantized = body, (body.length,) * body.key_codes.shape[0]
        else:
            first, self.quantized = body[0], tuple(b.length for b in body)
        self.dtype, self.device, self.bits = first.dtype, first.key_codes.device, first.bits
        self.is_initialized = True

    @classmethod
    def of(cls, layer: UniformLayer | RaggedLayer, group: int, residual: int, bits: int = 8) -> QuantizedLayer:
        """`layer`'s entries quantized in `bits` in key groups of `group` tokens, each head's last `residual` or
        more in full precision (kvchat.kv.quantize.quantized_length)."""
        if isinstance(layer, RaggedLayer):
            counts = [quantized_length(n, group, residual) for n in layer.lengths]
            heads = tuple(
                QuantizedEntries.quantize(k[0, 0, :q], v[0, 0, :q], group, bits)
                for k, v, q in zip(layer.keys, layer.values, counts, strict=True)
            )
            # copies, not views: the full-precision tensors are freed once the layer is replaced
            return cls(heads, tuple(p[:q].clone() for p, q in zip(layer.positions, counts, strict=True)), RaggedLayer(
                [k[:, :, q:].clone() for k, q in zip(layer.keys, counts, strict=True)],
                [v[:, :, q:].clone() for v, q in zip(layer.values, counts, strict=True)],
                [p[q:].clone() for p, q in zip(layer.positions, counts, strict=True)],
            ))  # fmt: skip
        q = quantized_length(layer.size, group, residual)
        body = QuantizedEntries.quantize(layer.keys[0, :, :q], layer.values[0, :, :q], group, bits)
        rest = UniformLayer.of(
            layer.keys[:, :, q:].clone(), layer.values[:, :, q:].clone(), layer.positions[:, q:].clone()
        )
        return cls(body, layer.positions[:, :q].clone(), rest)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:  # built initialised
        raise RuntimeError("a quantized layer is built from existing entries")

    def __copy__(self) -> QuantizedLayer:
        """Sharing the quantized entries (never changed) but not the residual, which answering appends to."""
        return QuantizedLayer(self.body, self.body_positions, copy.copy(self.residual))

    # --- what attention sees ------------------------------------------------------------------------
    # Computed, where transformers' base has plain attributes (nothing assigns them: CacheLayerMixin.__init__ is
    # not called).
    @property
    def keys(self) -> torch.Tensor | HeadList:  # type: ignore[override]
        return self._joined(self.residual.keys, QuantizedEntries.keys_into)

    @property
    def values(self) -> torch.Tensor | HeadList:  # type: ignore[override]
        return self._joined(self.residual.values, QuantizedEntries.values_into)

    def _joined(self, tail: torch.Tensor | HeadList,
                dequantize: Callable[[QuantizedEntries, torch.Tensor], torch.Tensor]) -> torch.Tensor | HeadList:
        """The quantized entries dequantized, then `tail` (the residual's, in its layout), in one new tensor per
        layer (uniform) or per head (ragged)."""
        if isinstance(self.body, QuantizedEntries):
            if not isinstance(tail, torch.Tensor):  # never: a uniform body has a uniform residual
                raise TypeError("a uniform quantized layer with a ragged residual")
            q = self.body.length
            out = torch.empty(*tail.shape[:2], q + tail.shape[2], tail.shape[3], dtype=tail.dtype, device=tail.device)
            dequantize(self.body, out[0, :, :q])
            out[:, :, q:] = tail
            return out
        heads = []
        for body, t in zip(self.body, tail, strict=True):
            out = torch.empty(1, 1, body.length + t.shape[2], t.shape[3], dtype=t.dtype, device=t.device)
            dequantize(body, out[0, 0, : body.length])
            out[:, :, body.length :] = t
            heads.append(out)
        return HeadList(heads)

    @property
    def positions(self) -> torch.Tensor | tuple[torch.Tensor, ...]:
        body, rest = self.body_positions, self.residual.positions
        if isinstance(body, torch.Tensor) and isinstance(rest, torch.Tensor):  # uniform
            return torch.cat([body, rest], dim=-1)
        return tuple(torch.cat([b, r]) for b, r in zip(body, rest, strict=True))

    def dequantized(self) -> UniformLayer | RaggedLayer:
        """The same entries in full precision, as the layout the layer was quantized from."""
        keys, values, positions = self.keys, self.values, self.positions
        if isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor) and isinstance(positions, torch.Tensor):
            return UniformLayer.of(keys, values, positions)
        return RaggedLayer(list(keys), list(values), list(positions))

    # --- answering ----------------------------------------------------------------------------------
    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        self.residual.append(keys, values, positions)

    def reserve(self, extra: int) -> None:
        """Room for `extra` more full-precision entries (where answering appends)."""
        self.residual.reserve(extra)

    def peek(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor | HeadList, torch.Tensor | HeadList]:
        tail_k, tail_v = self.residual.peek(keys, values)
        return self._joined(tail_k, QuantizedEntries.keys_into), self._joined(tail_v, QuantizedEntries.values_into)

    def truncate_heads(self, lengths: Sequence[int]) -> None:
        """Keep each head's first `lengths[h]` entries; only full-precision entries may go (a rollback)."""
        rest = [n - q for n, q in zip(lengths, self.quantized, strict=True)]
        if min(rest, default=0) < 0:
            raise ValueError(f"a rollback cannot drop entries held in {self.bits} bits")
        self.residual.truncate_heads(rest)

    @property
    def lengths(self) -> list[int]:
        return [q + r for q, r in zip(self.quantized, self.residual.lengths, strict=True)]

    @property
    def entries(self) -> int:
        return sum(self.lengths)

    @property
    def size(self) -> int:
        """As the residual's layout counts it: entries per head (uniform), or their mean rounded up (ragged)."""
        if not self.ragged:  # asked for every layer at every forward (EpisodeCache's peak accounting): cheap
            return self.quantized[0] + self.residual.size
        return -(-self.entries // len(self.quantized))

    def get_seq_length(self) -> int:
        return max(self.lengths)

    def nbytes(self) -> int:
        """Codes, scales and minima, plus the full-precision residual."""
        bodies = [self.body] if isinstance(self.body, QuantizedEntries) else self.body
        return sum(b.nbytes() for b in bodies) + self.residual.nbytes()

    def keep(self, index: HeadIndex | torch.Tensor) -> None:
        raise TypeError("a quantized layer answers questions; dequantize it to evict from it")

    def evicted(self, index: HeadIndex | torch.Tensor) -> list[EvictedHead]:
        raise TypeError("a quantized layer answers questions; dequantize it to evict from it")

    def compact(self, rotary_emb: torch.nn.Module) -> None:
        raise TypeError("a quantized layer's positions are settled before it is quantized")
