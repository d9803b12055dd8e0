"""Recall's chunks kept as KV entries (`--recall-entries stored`): computed once at ingest, placed at each question.

`--method recall` prefills each question's chunks of raw turns on top of the routed episode cache, which is most of
an answer's time on a CPU. Stored instead, every chunk's entries are computed at ingest, after the system prompt and
the chunk before it in the history (whose own entries are dropped): computed after the system prompt alone, a
chunk's entries carry what a conversation's first tokens carry, and the model goes on with the conversation
instead of answering. At each question the picked chunks' rows are read back (bounded reads), dequantized, their
keys re-rotated to the positions a prefill there would give them (kvchat.kv.rope) and appended to the cache; only
the question is prefilled.

Two things a stored chunk can do besides (RecallConfig.repair, RecallConfig.kept):
- repaired: its first `repair` tokens are not stored but computed again at each question, with the cache and the
  chunks placed before it in view (EPIC's LegoLink, Hu et al. 2025: a chunk's first tokens are where computing it
  apart shows most), the rest of its entries placed after them;
- compressed: of the rest, only the entries that keep the chunk's share `kept` are stored, each KV head its own,
  chosen at ingest as an episode cache's block is (the attention of the chunk's last tokens, SnapKV, pooled), so a
  budget places about 1 / kept as many chunks. A placed entry sits at the position its token would have in a
  prefill there (the chunk's positions are taken whole, gaps included).

They are kept as KIVI codes (kvchat.kv.quantize) in one file per conversation (the store's recall entries file), as
`--cache-precision` keeps a cache: whole key groups of a chunk's entries quantized, the rest of them (its last
entries, fewer than a group, next to what follows) in float16, so that no group spans two chunks. Per layer `l`,
every chunk's rows one after another along dim 0: `k.l`/`v.l` codes `[rows, kv_heads, D or D/2]`, `ks.l`/`km.l`
key scales and minima `[rows / group, kv_heads, D]`, `vs.l`/`vm.l` value scales and minima `[rows, kv_heads,
D / value group]`, `kt.l`/`vt.l` the float16 rest `[tails, kv_heads, D]`, and (format "2") `o.l` int16 `[entries,
kv_heads]` each entry's token in its chunk (a chunk's quantized rows, then its rest); then `rows` and `tails` (each
chunk's first quantized and float16 row, and the ends), `tokens` (each chunk's stored entries per KV head),
`starts` (the position its first token was computed at) and (format "2") `lengths` (its tokens). The metadata names
the model, the codes, `repair`, `kept` and a digest of the chunk texts and system prompt, which ties the file to its
recall index. Format "1" files (every token of every chunk stored, none recomputed) are read as they were written.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvchat.answer.rag import Chunk
from kvchat.kv.cache import Checkpoint, EpisodeCache
from kvchat.kv.causal_lm import decoder_of
from kvchat.kv.layers import CacheLayer
from kvchat.kv.quantize import SCALE_DTYPES, QuantizedEntries, value_group
from kvchat.kv.rope import rotate_keys
from kvchat.kv.scoring import pool_scores, probe_scores
from kvchat.kv.tensorfile import FileRows, RowWriter
from kvchat.model.llm import LoadedModel

FORMAT = "2"
READABLE_FORMATS = ("1", "2")
LEAD = "\n"  # what each chunk's text follows, as recall prefills it (answer.session: after the cache, a line break)
_PARTS = ("k", "ks", "km", "v", "vs", "vm")  # QuantizedEntries.tensors()' order
_GROUPED = ("ks", "km")  # a row per key group
_TAILS = ("kt", "vt")  # the float16 rest
_TAIL_DTYPE = torch.float16
_INDEX = ("rows", "tails", "tokens", "starts", "lengths")
_OFFSET_DTYPE = torch.int16  # an entry's token in its chunk (chunks are far shorter than 32K tokens)


def chunk_ids(lm: LoadedModel, chunks: Sequence[Chunk]) -> list[torch.Tensor]:
    """Each chunk's token ids `[1, n]` as it is stored and placed: its text after `LEAD`."""
    return [lm.encode(LEAD + c.text) for c in chunks]


def digest(chunks: Sequence[Chunk], prefix: torch.Tensor) -> str:
    """What ties a file to its chunks and the system prompt they were computed after."""
    h = hashlib.sha256(json.dumps(prefix.reshape(-1).tolist()).encode())
    for c in chunks:
        h.update(b"\0" + c.text.encode())
    return h.hexdigest()


@dataclass(frozen=True)
class Storing:
    """How chunks are stored: KIVI `bits` in key groups of `group` tokens, the first `repair` tokens of each left to
    be recomputed, and the share `kept` of its entries stored (RecallConfig's fields of the same names)."""

    bits: int
    group: int
    repair: int = 0
    kept: float = 1.0
    queries: int = 64  # compressed: the chunk's last tokens whose attention scores its entries (SnapKV's window)
    pool_kernel: int = 7  # ... max-pooled over neighbouring entries (CacheConfig.pool_kernel)

    def stored(self, tokens: int) -> int:
        """Entries per KV head stored of a chunk of `tokens` tokens (kvchat.features.recall.stored_entries less the
        recomputed ones)."""
        recomputed = min(self.repair, tokens)
        return max(0, min(tokens, math.ceil(self.kept * tokens - 1e-9)) - recomputed)


@dataclass(frozen=True)
class StoredEntries:
    """A recall entries file opened: its tensors as `FileRows` (nothing read until a chunk is placed) and layout."""

    tensors: Mapping[str, FileRows]
    rows: list[int]
    tails: list[int]
    tokens: list[int]    # each chunk's stored entries per KV head
    starts: list[int]
    bits: int
    group: int
    digest: str
    lengths: list[int]   # each chunk's tokens (the positions a placed chunk takes)
    repair: int = 0      # each chunk's first tokens, recomputed when placed
    kept: float = 1.0
    offsets: bool = False  # entries name their tokens (`o.l`); else a chunk's entries are its tokens from `repair` on

    @classmethod
    def opened(cls, tensors: Mapping[str, FileRows], metadata: Mapping[str, str]) -> StoredEntries:
        """ValueError when the file is not one this version reads."""
        version = metadata.get("recall_entries_format")
        if version not in READABLE_FORMATS:
            raise ValueError(f"unsupported recall entries format {version!r}")
        try:
            rows, tails, tokens, starts = (tensors[name].read().tolist() for name in _INDEX[:4])
            lengths = tensors["lengths"].read().tolist() if version != "1" else list(tokens)
            bits, group = int(metadata["bits"]), int(metadata["group"])
            repair, kept = int(metadata.get("repair", 0)), float(metadata.get("kept", 1.0))
        except (KeyError, ValueError) as e:
            raise ValueError(f"its layout does not read ({e})") from None
        counts = [r1 - r0 + t1 - t0 for r0, r1, t0, t1 in zip(rows, rows[1:], tails, tails[1:], strict=False)]
        storing = Storing(bits, group, repair, kept) if bits in SCALE_DTYPES and repair >= 0 and 0 < kept <= 1 else None
        if (len(rows) != len(tokens) + 1 or len(tails) != len(rows) or len(starts) != len(tokens)
                or len(lengths) != len(tokens) or counts != tokens or storing is None
                or tokens != [storing.stored(n) for n in lengths]):  # fmt: skip
            raise ValueError("its layout is inconsistent")
        return cls(tensors, rows, tails, tokens, starts, bits, group, metadata.get("digest", ""), lengths, repair,
                   kept, version != "1")  # fmt: skip

    @property
    def chunks(self) -> int:
        return len(self.tokens)

    def placed(self, chunk: int) -> int:
        """Entries per KV head placing chunk `chunk` appends: its recomputed tokens and its stored entries."""
        return min(self.repair, self.lengths[chunk]) + self.tokens[chunk]

    def entries(self, chunk: int, layer: int, dtype: torch.dtype, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Chunk `chunk`'s stored keys and values in `layer`, `[1, kv_heads, n, D]`, as computed (keys rotated for
        positions from `starts[chunk]`, each at its token's: `token_offsets`)."""
        parts = {part: self._rows(part, layer, chunk).to(device) for part in (*_PARTS, *_TAILS)}
        codes = QuantizedEntries.of_tensors([parts[part] for part in _PARTS], dtype, self.bits)
        keys = torch.cat([codes.keys(), parts["kt"].to(dtype)], dim=1)
        values = torch.cat([codes.values(), parts["vt"].to(dtype)], dim=1)
        return keys[None], values[None]

    def token_offsets(self, chunk: int, layer: int, heads: int) -> torch.Tensor:
        """`[kv_heads, n]`: the token of chunk `chunk` (counted from its first) each stored entry of `layer` is."""
        if not self.offsets:
            return torch.arange(self.repair, self.repair + self.tokens[chunk]).expand(heads, -1)
        first = sum(self.tokens[:chunk])
        return _read(self.tensors[f"o.{layer}"], first, first + self.tokens[chunk]).T.long()

    def span(self, part: str, chunk: int) -> tuple[int, int]:
        """Chunk `chunk`'s `[first, end)` rows in the tensors of `part` (a key group's scale is one row)."""
        if part in _TAILS:
            return self.tails[chunk], self.tails[chunk + 1]
        scale = self.group if part in _GROUPED else 1
        return self.rows[chunk] // scale, self.rows[chunk + 1] // scale

    def _rows(self, part: str, layer: int, chunk: int) -> torch.Tensor:
        """Tensor `part` of `layer`: chunk `chunk`'s rows, `[kv_heads, rows, ...]`."""
        first, end = self.span(part, chunk)
        return _read(self.tensors[f"{part}.{layer}"], first, end).transpose(0, 1).contiguous()

    def place(self, cache: EpisodeCache, chunk: int, lm: LoadedModel, ids: torch.Tensor | None = None) -> int:
        """Chunk `chunk` appended to `cache` as a prefill of its text there would append it: its first `repair` tokens
        of `ids` (the chunk's, `chunk_ids`) computed on top of the cache, then its stored entries, each at its token's
        position; returns the entries per KV head appended. ValueError when `ids` are not the chunk's."""
        n, recomputed = self.lengths[chunk], min(self.repair, self.lengths[chunk])
        if recomputed and (ids is None or ids.shape[-1] != n):
            raise ValueError(f"holds chunk {chunk} of {n} tokens where its recall index gives another text")
        with torch.inference_mode():  # as every forward writes the cache
            if recomputed and ids is not None:
                lm.forward(cache, ids[:, :recomputed])  # with everything placed before it in view
            rotary, dtype, device = decoder_of(lm.model).rotary_emb, lm.dtype, lm.device
            base = cache.next_position - recomputed  # the chunk's first token
            heads = lm.config.num_key_value_heads
            if self.tokens[chunk]:
                delta = torch.full((heads, self.tokens[chunk]), base - self.starts[chunk], device=device)
                for layer in range(len(cache.layers)):
                    keys, values = self.entries(chunk, layer, dtype, device)
                    positions = base + self.token_offsets(chunk, layer, heads).to(device)
                    cache.place(layer, rotate_keys(keys, delta, rotary), values, positions)
            cache.advance(n - recomputed)
        return recomputed + self.tokens[chunk]


@dataclass(frozen=True)
class ChunkEntries:
    """One chunk's entries as computed at ingest: the position its first token was computed at, and per layer the
    stored keys and values `[1, kv_heads, m, D]` and their tokens in the chunk `[kv_heads, m]`."""

    start: int
    layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def chunk_entries(lm: LoadedModel, cache: EpisodeCache, mark: Checkpoint, ids: Sequence[torch.Tensor], chunk: int,
                  storing: Storing) -> ChunkEntries:  # fmt: skip
    """Chunk `chunk`'s entries computed after the system prompt (what `cache` holds at `mark`) and the chunk before it
    (one forward of both), its first `storing.repair` tokens left out and, compressed, the rest scored by the
    attention of its last `storing.queries` tokens (each KV head's best `storing.stored(n)` kept). Memory: the
    system prompt and two chunks; `cache` is rolled back to `mark` first."""
    cache.rollback(mark)
    fed = torch.cat([ids[chunk - 1], ids[chunk]], dim=-1) if chunk > 0 else ids[chunk]
    n = ids[chunk].shape[-1]
    start = cache.next_position + fed.shape[-1] - n
    recomputed, m = min(storing.repair, n), storing.stored(n)
    with torch.inference_mode():
        lm.forward(cache, fed)
        scores = None
        if m < n - recomputed:  # compressed: the chunk's last tokens score its entries (pooled), as SnapKV does
            probe = ids[chunk][:, -storing.queries :]
            scores = [pool_scores(s[..., -n:].float(), storing.pool_kernel) for s in probe_scores(lm.model, cache,
                                                                                                   probe)]  # fmt: skip
    layers = []
    for i, layer in enumerate(cache.layers):
        keys, values = _last(layer, n)
        heads = keys.shape[1]
        if scores is None:
            index = torch.arange(recomputed, recomputed + m, device=keys.device).expand(heads, -1)
        else:
            ranked = scores[i][:, recomputed:]
            index = ranked.topk(m, dim=-1, sorted=False).indices.sort(dim=-1).values + recomputed
        gather = index.unsqueeze(0).unsqueeze(-1).expand(1, heads, m, keys.shape[-1])
        layers.append((keys.gather(2, gather), values.gather(2, gather), index.cpu()))
    return ChunkEntries(start, layers)


def computed(lm: LoadedModel, ids: Sequence[torch.Tensor], prefix: torch.Tensor, storing: Storing, first: int = 0
             ) -> Iterator[ChunkEntries]:  # fmt: skip
    """From chunk `first` on, each chunk's entries (`chunk_entries`)."""
    cache = EpisodeCache(lm.num_layers)
    with torch.inference_mode():
        lm.forward(cache, prefix)
    mark = cache.checkpoint()
    for i in range(first, len(ids)):
        yield chunk_entries(lm, cache, mark, ids, i, storing)


def _last(layer: CacheLayer, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's last `n` keys and values (a cache nothing was evicted from: every layer uniform)."""
    keys, values = layer.keys, layer.values
    if not (isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor)):
        raise TypeError("recall entries are computed in a uniform cache")
    return keys[:, :, -n:], values[:, :, -n:]


@dataclass(frozen=True)
class Layout:
    """Where each chunk's rows lie in a recall entries file of given chunks stored as `storing` says: its tensors'
    shapes and metadata, and the index tensors but `starts` (known once the chunks are computed, `index`). Small: a
    few numbers per chunk."""

    rows: list[int]
    tails: list[int]
    tokens: list[int]  # each chunk's stored entries per KV head
    lengths: list[int]  # each chunk's tokens
    storing: Storing
    shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    metadata: dict[str, str]

    @classmethod
    def of(cls, lm: LoadedModel, chunks: Sequence[Chunk], prefix: torch.Tensor, storing: Storing,
           ids: Sequence[torch.Tensor] | None = None) -> Layout:  # fmt: skip
        """The layout of `chunks` after `prefix` (their `ids`, `chunk_ids`, if already known)."""
        config = lm.config
        heads, group, bits = config.num_key_value_heads, storing.group, storing.bits
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        lengths = [int(t.shape[-1]) for t in (ids if ids is not None else chunk_ids(lm, chunks))]
        tokens = [storing.stored(n) for n in lengths]
        rows, tails = [0], [0]
        for n in tokens:
            rows.append(rows[-1] + n // group * group)
            tails.append(tails[-1] + n % group)
        total, packed, vdim = rows[-1], dim // 2 if bits == 4 else dim, dim // value_group(group, dim)
        scale = SCALE_DTYPES[bits]
        index = zip(_INDEX, (rows, tails, tokens, tokens, lengths), strict=True)
        shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {name: (torch.int64, (len(v),)) for name, v in index}
        part_shapes = {"k": (torch.uint8, (total, heads, packed)), "v": (torch.uint8, (total, heads, packed)),
                       "ks": (scale, (total // group, heads, dim)), "km": (scale, (total // group, heads, dim)),
                       "vs": (scale, (total, heads, vdim)), "vm": (scale, (total, heads, vdim)),
                       "kt": (_TAIL_DTYPE, (tails[-1], heads, dim)), "vt": (_TAIL_DTYPE, (tails[-1], heads, dim)),
                       "o": (_OFFSET_DTYPE, (sum(tokens), heads))}  # fmt: skip
        for layer in range(lm.num_layers):
            shapes |= {f"{part}.{layer}": shape for part, shape in part_shapes.items()}
        metadata = {"fingerprint": lm.fingerprint, "recall_entries_format": FORMAT, "bits": str(bits),
                    "group": str(group), "digest": digest(chunks, prefix), "repair": str(storing.repair),
                    "kept": repr(storing.kept)}  # fmt: skip
        return cls(rows, tails, tokens, lengths, storing, shapes, metadata)

    @property
    def chunks(self) -> int:
        return len(self.tokens)

    @property
    def group(self) -> int:
        return self.storing.group

    @property
    def bits(self) -> int:
        return self.storing.bits

    def first_entry(self, chunk: int) -> int:
        """Chunk `chunk`'s first row in the `o.l` tensors (each chunk's stored entries one after another)."""
        return sum(self.tokens[:chunk])

    def index(self, writer: RowWriter, starts: Sequence[int]) -> None:
        """Write the index tensors, once every chunk is written (`starts`: each one's first position)."""
        for name, values in zip(_INDEX, (self.rows, self.tails, self.tokens, starts, self.lengths), strict=True):
            writer.write(name, 0, torch.tensor(list(values), dtype=torch.int64))


@dataclass(frozen=True)
class ChunkRows:
    """One chunk's rows of a recall entries file, computed (`chunk_rows`) and not yet written: what a Ray worker
    sends its driver, which writes them (`write`) into the file it keeps (kvchat.ingest.batch_units)."""

    chunk: int
    start: int  # the position its first token was computed at
    rows: dict[str, tuple[int, torch.Tensor]]  # tensor name -> (its first row, the rows)

    def write(self, writer: RowWriter) -> None:
        for name, (first, rows) in self.rows.items():
            writer.write(name, first, rows)


def chunk_rows(lm: LoadedModel, layout: Layout, ids: Sequence[torch.Tensor], prefix: torch.Tensor, first: int = 0,
               end: int | None = None) -> Iterator[ChunkRows]:  # fmt: skip
    """Chunks `first` to `end` (default: the last) computed after `prefix` and the chunk before each
    (`chunk_entries`, as `layout.storing` says), as rows of the file `layout` describes. Each chunk's rows are the
    same whichever chunk a call starts from."""
    end = len(ids) if end is None else end
    rows, tails, group = layout.rows, layout.tails, layout.group
    for chunk, entries in enumerate(computed(lm, ids[:end], prefix, layout.storing, first=first), start=first):
        out: dict[str, tuple[int, torch.Tensor]] = {}
        whole = rows[chunk + 1] - rows[chunk]
        for layer, (keys, values, index) in enumerate(entries.layers):
            codes = QuantizedEntries.quantize(keys[0, :, :whole].float(), values[0, :, :whole].float(), group,
                                              layout.bits)  # fmt: skip
            for part, tensor in zip(_PARTS, codes.tensors(), strict=True):
                at = rows[chunk] // group if part in _GROUPED else rows[chunk]
                out[f"{part}.{layer}"] = (at, tensor.transpose(0, 1).cpu())
            for part, tensor in zip(_TAILS, (keys, values), strict=True):
                out[f"{part}.{layer}"] = (tails[chunk], tensor[0, :, whole:].transpose(0, 1).to(_TAIL_DTYPE).cpu())
            out[f"o.{layer}"] = (layout.first_entry(chunk), index.T.to(_OFFSET_DTYPE).contiguous())
        yield ChunkRows(chunk, entries.start, out)


def write(path: Path, lm: LoadedModel, chunks: Sequence[Chunk], prefix: torch.Tensor, storing: Storing, *,
          previous: StoredEntries | None = None, on_chunk: Callable[[int, int], None] | None = None
          ) -> tuple[int, str]:  # fmt: skip
    """Write the recall entries file of `chunks` at `path`, fsynced; returns (bytes, sha256). Memory: one chunk's
    entries at a time. `previous`: the file of an earlier version whose chunks begin `chunks` (an append), whose
    rows are copied instead of computed again. `on_chunk(done, total)` after each chunk."""
    ids = chunk_ids(lm, chunks)
    layout = Layout.of(lm, chunks, prefix, storing, ids=ids)
    kept = (previous.chunks if previous is not None and _continues(previous, chunks, prefix, layout.lengths, storing)
            else 0)  # fmt: skip
    writer = RowWriter(path, layout.shapes, layout.metadata)
    try:
        starts: list[int] = []
        if previous is not None and kept:
            starts = list(previous.starts[:kept])
            for chunk in range(kept):
                _copy_rows(writer, previous, chunk, lm.num_layers, layout.first_entry(chunk))
                if on_chunk is not None:
                    on_chunk(chunk + 1, len(chunks))
        for computed_rows in chunk_rows(lm, layout, ids, prefix, first=kept):
            computed_rows.write(writer)
            starts.append(computed_rows.start)
            if on_chunk is not None:
                on_chunk(computed_rows.chunk + 1, len(chunks))
        layout.index(writer, starts)
        return writer.finish()
    except BaseException:
        writer.discard()
        raise


def _continues(previous: StoredEntries, chunks: Sequence[Chunk], prefix: torch.Tensor, lengths: Sequence[int],
               storing: Storing) -> bool:  # fmt: skip
    """Whether `previous` holds the first of `chunks` (the same texts after the same system prompt, codes, layout,
    recomputed and kept entries)."""
    return ((previous.bits, previous.group, previous.repair, previous.kept, previous.offsets) == (
        storing.bits, storing.group, storing.repair, storing.kept, True)
        and previous.lengths == list(lengths[: previous.chunks])
        and previous.digest == digest(chunks[: previous.chunks], prefix))  # fmt: skip


def _copy_rows(writer: RowWriter, previous: StoredEntries, chunk: int, layers: int, entry: int) -> None:
    """Chunk `chunk`'s rows of `previous` written where they are (its entries' offsets from `entry`)."""
    for layer in range(layers):
        for part in (*_PARTS, *_TAILS):
            first, end = previous.span(part, chunk)
            writer.write(f"{part}.{layer}", first, _read(previous.tensors[f"{part}.{layer}"], first, end))
        writer.write(f"o.{layer}", entry, _read(previous.tensors[f"o.{layer}"], entry, entry + previous.tokens[chunk]))


def _read(tensor: FileRows, first: int, end: int) -> torch.Tensor:
    """Rows `[first, end)` of a stored tensor, read."""
    rows = tensor[first:end]  # FileRows: nothing read yet
    return rows.read() if isinstance(rows, FileRows) else rows
