"""Decode attention of a paged layer (IceCache) as one batched paged-decode call over a slot buffer.

Today's ragged path (kvchat.kv.attention's `with_retrieved`, then attention per KV head) concatenates, at every
decode step and for every KV head, the head's resident entries, its retrieved ones and the new token, then
runs one attention call per head. This module lays the same entries out as a paged KV cache once and keeps
it up to date instead, so a decode step writes only the new token and runs one call for the whole layer.

Design notes (the details and the choices made): docs/internals.md, "kvchat/kv/paged_decode.py".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvchat.kv import backends
from kvchat.kv.attention import softmax_attention

if TYPE_CHECKING:
    from kvchat.kv.attention import Retrieved

# Entries of room each head's range gets beyond what it holds when laid out (an answer's tokens); a head
# that outgrows its range lays the buffer out again with more.
ROOM = 64
# flashinfer's float workspace (its documented example size); one per cache, shared by its paged layers.
WORKSPACE_BYTES = 128 << 20


@dataclass(frozen=True)
class PageTable:
    """One decode step of a paged layer in flashinfer's paged-KV layout, one entry per page.

    `keys`/`values` `[slots, 1, 1, D]`; request (KV head) h attends over slots `indices[indptr[h]:indptr[h+1]]`
    (int32, on the slots' device). `indptr` `[heads + 1]` int32 stays on the host: flashinfer's `plan` reads
    it there (a device one would be copied back, a synchronisation per layer and step)."""

    keys: torch.Tensor
    values: torch.Tensor
    indptr: torch.Tensor
    indices: torch.Tensor

    @property
    def heads(self) -> int:
        return self.indptr.shape[0] - 1

    @property
    def last_page_len(self) -> torch.Tensor:
        """Entries in each request's last page: one (every page holds one entry), on the host as `indptr`."""
        return torch.ones(self.heads, dtype=torch.int32)


def paged_decode_reference(
    query: torch.Tensor, table: PageTable, scale: float, softcap: float | None = None
) -> torch.Tensor:
    """Attention of `query [heads, group, D]` (request h: the query heads of KV head h) over each request's
    pages of `table`, `[heads, group, D]`: what flashinfer's paged decode computes, in torch (kvchat's
    `softmax_attention` per request: logits in float32, softcapped, softmax, weighted values)."""
    heads, group, dim = query.shape
    out = query.new_empty(heads, group, dim)
    bounds = table.indptr.tolist()
    for h in range(heads):
        rows = table.indices[bounds[h] : bounds[h + 1]].long()
        keys = table.keys.index_select(0, rows).view(1, 1, -1, dim)
        values = table.values.index_select(0, rows).view(1, 1, -1, dim)
        attended = softmax_attention(query[h].reshape(1, group, 1, dim), keys, values, scale, softcap=softcap)
        out[h] = attended.view(group, dim)
    return out


class PoolSlots:
    """One paged layer's entries while a question is answered, in one slot buffer (see the module's doc).

    `table(keys, values, retrieved)` brings the buffer up to date with the layer's entries and the pool's
    retrieved ones and returns the step's `PageTable`. Per KV head h, slots `[base_h, base_h + n_h)` hold the
    layer's `n_h` entries (position order) and `[got_h, got_h + r_h)` its `r_h` retrieved ones. Entries the
    buffer already holds are never written again: the layer's entries are only appended to between
    rollbacks, and `clear` (the pool's, at rollback) empties the buffer.
    """

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self._base: list[int] = []  # per head: first slot of its cache entries
        self._room: list[int] = []  # per head: slots of its range
        self._held: list[int] = []  # per head: cache entries written so far
        self._got: list[int] = []  # per head: first slot of its retrieved entries
        self._got_len: list[int] = []
        self._retrieved: Sequence[Retrieved] | None = None  # what the retrieved ranges hold

    @property
    def slots(self) -> int:
        return 0 if self.keys is None else self.keys.shape[0]

    def _buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values buffers (laid out by the first `table`)."""
        if self.keys is None or self.values is None:
            raise RuntimeError("the pool's slots are not laid out yet")
        return self.keys, self.values

    def table(
        self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], retrieved: Sequence[Retrieved]
    ) -> PageTable:
        """The page table of a decode step over `keys`/`values` (one `[1, 1, n_h, D]` per KV head, the step's
        token last) and each head's `retrieved` entries."""
        lengths = [k.shape[2] for k in keys]
        got = [int(r.keys.shape[0]) for r in retrieved]
        if (
            self.keys is None
            or len(lengths) != len(self._base)
            or any(n < held or n > room for n, held, room in zip(lengths, self._held, self._room, strict=True))
            or (retrieved is not self._retrieved and sum(got) > self.slots - self._got[0])
        ):
            self._lay_out(keys, values, retrieved)
        else:
            buffer_keys, buffer_values = self._buffers()
            for h, (k, v) in enumerate(zip(keys, values, strict=True)):
                start, n = self._held[h], lengths[h]
                if n > start:
                    buffer_keys[self._base[h] + start : self._base[h] + n, 0, 0] = k[0, 0, start:]
                    buffer_values[self._base[h] + start : self._base[h] + n, 0, 0] = v[0, 0, start:]
                    self._held[h] = n
            if retrieved is not self._retrieved:
                self._write_retrieved(retrieved, self._got[0])
        return self._page_table()

    def _lay_out(
        self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], retrieved: Sequence[Retrieved]
    ) -> None:
        """A new buffer: every head's range with `ROOM` to grow, then the retrieved ranges."""
        first = keys[0]
        self._room = [k.shape[2] + ROOM for k in keys]
        self._base = [sum(self._room[:h]) for h in range(len(keys))]
        cache_slots = sum(self._room)
        total = cache_slots + sum(int(r.keys.shape[0]) for r in retrieved) + ROOM * len(keys)
        self.keys = buffer_keys = first.new_empty(total, 1, 1, first.shape[-1])
        self.values = buffer_values = first.new_empty(total, 1, 1, first.shape[-1])
        for h, (k, v) in enumerate(zip(keys, values, strict=True)):
            n = k.shape[2]
            buffer_keys[self._base[h] : self._base[h] + n, 0, 0] = k[0, 0]
            buffer_values[self._base[h] : self._base[h] + n, 0, 0] = v[0, 0]
        self._held = [k.shape[2] for k in keys]
        self._write_retrieved(retrieved, cache_slots)

    def _write_retrieved(self, retrieved: Sequence[Retrieved], start: int) -> None:
        """Each head's retrieved entries one range after another from slot `start` (cast to the buffer's
        dtype and moved to its device once per retrieval, not at every step)."""
        self._got, self._got_len = [], []
        buffer_keys, buffer_values = self._buffers()
        for r in retrieved:
            n = int(r.keys.shape[0])
            buffer_keys[start : start + n, 0, 0] = r.keys.to(buffer_keys.device, buffer_keys.dtype)
            buffer_values[start : start + n, 0, 0] = r.values.to(buffer_values.device, buffer_values.dtype)
            self._got.append(start)
            self._got_len.append(n)
            start += n
        self._retrieved = retrieved

    def _page_table(self) -> PageTable:
        ranges = []
        for h in range(len(self._base)):
            ranges.append(torch.arange(self._base[h], self._base[h] + self._held[h], dtype=torch.int32))
            ranges.append(torch.arange(self._got[h], self._got[h] + self._got_len[h], dtype=torch.int32))
        sizes = [held + got for held, got in zip(self._held, self._got_len, strict=True)]
        indptr = torch.tensor([0, *sizes], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        buffer_keys, buffer_values = self._buffers()
        indices = torch.cat(ranges).to(buffer_keys.device, non_blocking=True)
        return PageTable(buffer_keys, buffer_values, indptr, indices)


class FlashinferPagedDecode:
    """flashinfer's `BatchDecodeWithPagedKVCacheWrapper` and its workspace, for the paged layers of one cache.

    Built at the first call (on the query's device). Layers run one after another and each plans its own
    table right before it runs, so one wrapper and one workspace serve them all. A page table changes at every
    step (every request gains its new token), so each call plans (page tables on the host: no
    synchronisation) and runs."""

    def __init__(self) -> None:
        self._wrapper: Any = None  # flashinfer's wrapper (flashinfer ships no types)
        self._group = 0

    def __call__(self, query: torch.Tensor, table: PageTable, scale: float, softcap: float | None = None):
        """As `paged_decode_reference`, through flashinfer."""
        import flashinfer

        heads, group, dim = query.shape
        if self._wrapper is None or group != self._group:
            workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=query.device)
            self._wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace, "NHD", use_tensor_cores=group not in (1, 2, 4)
            )  # as backends.flashinfer_decode: CUDA-core decode kernels for these group sizes
            self._group = group
        self._wrapper.plan(
            table.indptr, table.indices, table.last_page_len, group, 1, dim, 1,
            logits_soft_cap=softcap or None, q_data_type=query.dtype, kv_data_type=table.keys.dtype, sm_scale=scale,
        )  # fmt: skip
        return self._wrapper.run(query.contiguous(), (table.keys, table.values))


class PagedDecode:
    """A paged layer's decode attention through its `PoolSlots`: flashinfer where it runs (CUDA, half
    precision, the extra; `kernel`, shared by the cache's layers), `paged_decode_reference` elsewhere."""

    def __init__(self, kernel: FlashinferPagedDecode | None = None) -> None:
        self.slots = PoolSlots()
        self.kernel = kernel if kernel is not None else FlashinferPagedDecode()

    def __call__(
        self,
        query: torch.Tensor,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        retrieved: Sequence[Retrieved],
        scale: float,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Attention of one token's `query [1, q_heads, 1, D]` over each KV head's `keys`/`values` (one
        `[1, 1, n_h, D]` per head, the token's own entry last) and its `retrieved` entries, shaped as kvchat's
        attention returns it: `[1, 1, q_heads, D]`."""
        table = self.slots.table(keys, values, retrieved)
        q_heads, dim = query.shape[1], query.shape[-1]
        q = query[0, :, 0].reshape(table.heads, q_heads // table.heads, dim)
        if backends.decode_backend(q.device, q.dtype) == "flashinfer" and table.keys.dtype == q.dtype:
            out = self.kernel(q, table, scale, softcap)
        else:
            out = paged_decode_reference(q, table, scale, softcap)
        return out.reshape(1, 1, q_heads, dim)
