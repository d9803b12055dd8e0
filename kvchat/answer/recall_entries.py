"""Recall's chunks kept as KV entries (`--recall-entries stored`): computed once at ingest, placed at each question.

`--method recall` prefills each question's chunks of raw turns on top of the routed episode cache, which is most of
an answer's time on a CPU. Stored instead, every chunk's entries are computed at ingest, after the system prompt and
the chunk before it in the history (whose own entries are dropped): computed after the system prompt alone, a
chunk's entries carry what a conversation's first tokens carry, and the model goes on with the conversation
instead of answering. At each question the picked chunks' rows are read back (bounded reads), dequantized, their
keys re-rotated to the positions a prefill there would give them (kvchat.kv.rope) and appended to the cache; only
the question is prefilled.

They are kept as KIVI codes (kvchat.kv.quantize) in one file per conversation (the store's recall entries file), as
`--cache-precision` keeps a cache: whole key groups of a chunk's entries quantized, the rest of them (its last
entries, fewer than a group, next to what follows) in float16, so that no group spans two chunks. Per layer `l`,
every chunk's rows one after another along dim 0: `k.l`/`v.l` codes `[rows, kv_heads, D or D/2]`, `ks.l`/`km.l`
key scales and minima `[rows / group, kv_heads, D]`, `vs.l`/`vm.l` value scales and minima `[rows, kv_heads,
D / value group]`, `kt.l`/`vt.l` the float16 rest `[tails, kv_heads, D]`; then `rows` and `tails` (each chunk's
first quantized and float16 row, and the ends), `tokens` (each chunk's entries) and `starts` (the position its
first entry was computed at). The metadata names the model, the codes and a digest of the chunk texts and system
prompt, which ties the file to its recall index.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvchat.answer.rag import Chunk
from kvchat.kv.cache import EpisodeCache
from kvchat.kv.causal_lm import decoder_of
from kvchat.kv.layers import CacheLayer
from kvchat.kv.quantize import SCALE_DTYPES, QuantizedEntries, value_group
from kvchat.kv.rope import rotate_keys
from kvchat.kv.tensorfile import FileRows, RowWriter
from kvchat.model.llm import LoadedModel

FORMAT = "1"
LEAD = "\n"  # what each chunk's text follows, as recall prefills it (answer.session: after the cache, a line break)
_PARTS = ("k", "ks", "km", "v", "vs", "vm")  # QuantizedEntries.tensors()' order
_GROUPED = ("ks", "km")  # a row per key group
_TAILS = ("kt", "vt")  # the float16 rest
_TAIL_DTYPE = torch.float16
_INDEX = ("rows", "tails", "tokens", "starts")


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
class StoredEntries:
    """A recall entries file opened: its tensors as `FileRows` (nothing read until a chunk is placed) and layout."""

    tensors: Mapping[str, FileRows]
    rows: list[int]
    tails: list[int]
    tokens: list[int]
    starts: list[int]
    bits: int
    group: int
    digest: str

    @classmethod
    def opened(cls, tensors: Mapping[str, FileRows], metadata: Mapping[str, str]) -> StoredEntries:
        """ValueError when the file is not one this version reads."""
        if metadata.get("recall_entries_format") != FORMAT:
            raise ValueError(f"unsupported recall entries format {metadata.get('recall_entries_format')!r}")
        try:
            rows, tails, tokens, starts = (tensors[name].read().tolist() for name in _INDEX)
            bits, group = int(metadata["bits"]), int(metadata["group"])
        except (KeyError, ValueError) as e:
            raise ValueError(f"its layout does not read ({e})") from None
        counts = [r1 - r0 + t1 - t0 for r0, r1, t0, t1 in zip(rows, rows[1:], tails, tails[1:], strict=False)]
        if (len(rows) != len(tokens) + 1 or len(tails) != len(rows) or len(starts) != len(tokens)
                or counts != tokens or bits not in SCALE_DTYPES):  # fmt: skip
            raise ValueError("its layout is inconsistent")
        return cls(tensors, rows, tails, tokens, starts, bits, group, metadata.get("digest", ""))

    @property
    def chunks(self) -> int:
        return len(self.tokens)

    def entries(self, chunk: int, layer: int, dtype: torch.dtype, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Chunk `chunk`'s keys and values in `layer`, `[1, kv_heads, n, D]`, as computed (keys rotated for
        positions from `starts[chunk]`)."""
        parts = {part: self._rows(part, layer, chunk).to(device) for part in (*_PARTS, *_TAILS)}
        codes = QuantizedEntries.of_tensors([parts[part] for part in _PARTS], dtype, self.bits)
        keys = torch.cat([codes.keys(), parts["kt"].to(dtype)], dim=1)
        values = torch.cat([codes.values(), parts["vt"].to(dtype)], dim=1)
        return keys[None], values[None]

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

    def place(self, cache: EpisodeCache, chunk: int, lm: LoadedModel) -> int:
        """Chunk `chunk`'s entries appended to `cache` as a prefill of its text there would append them; returns
        their number."""
        rotary, dtype, device = decoder_of(lm.model).rotary_emb, lm.dtype, lm.device
        n = self.tokens[chunk]
        delta = torch.full((lm.config.num_key_value_heads, n), cache.next_position - self.starts[chunk], device=device)
        for layer in range(len(cache.layers)):
            keys, values = self.entries(chunk, layer, dtype, device)
            cache.update(rotate_keys(keys, delta, rotary), values, layer)
        cache.advance(n)
        return n


def computed(lm: LoadedModel, ids: Sequence[torch.Tensor], prefix: torch.Tensor, first: int = 0
             ) -> Iterator[tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]]:  # fmt: skip
    """From chunk `first` on, each chunk's entries computed after `prefix` (the system prompt) and the chunk before
    it: (the position of its first entry, per layer keys and values `[1, kv_heads, n, D]`)."""
    cache = EpisodeCache(lm.num_layers)
    with torch.inference_mode():
        lm.forward(cache, prefix)
        mark = cache.checkpoint()
        for i in range(first, len(ids)):
            cache.rollback(mark)
            fed = torch.cat([ids[i - 1], ids[i]], dim=-1) if i > 0 else ids[i]  # one forward of both
            start, n = cache.next_position + fed.shape[-1] - ids[i].shape[-1], ids[i].shape[-1]
            lm.forward(cache, fed)
            yield start, [_last(layer, n) for layer in cache.layers]


def _last(layer: CacheLayer, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's last `n` keys and values (a cache nothing was evicted from: every layer uniform)."""
    keys, values = layer.keys, layer.values
    if not (isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor)):
        raise TypeError("recall entries are computed in a uniform cache")
    return keys[:, :, -n:], values[:, :, -n:]


def write(path: Path, lm: LoadedModel, chunks: Sequence[Chunk], prefix: torch.Tensor, *, bits: int, group: int,
          previous: StoredEntries | None = None, on_chunk: Callable[[int, int], None] | None = None
          ) -> tuple[int, str]:  # fmt: skip
    """Write the recall entries file of `chunks` at `path`, fsynced; returns (bytes, sha256). Memory: one chunk's
    entries at a time. `previous`: the file of an earlier version whose chunks begin `chunks` (an append), whose
    rows are copied instead of computed again. `on_chunk(done, total)` after each chunk."""
    config = lm.config
    heads = config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    ids = chunk_ids(lm, chunks)
    tokens = [int(t.shape[-1]) for t in ids]
    rows, tails = [0], [0]
    for n in tokens:
        rows.append(rows[-1] + n // group * group)
        tails.append(tails[-1] + n % group)
    kept = previous.chunks if previous is not None and _continues(previous, chunks, prefix, tokens, bits, group) else 0
    total, packed, vdim = rows[-1], dim // 2 if bits == 4 else dim, dim // value_group(group, dim)
    scale = SCALE_DTYPES[bits]
    shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {
        name: (torch.int64, (len(values),)) for name, values in zip(_INDEX, (rows, tails, tokens, tokens), strict=True)
    }
    part_shapes = {"k": (torch.uint8, (total, heads, packed)), "v": (torch.uint8, (total, heads, packed)),
                   "ks": (scale, (total // group, heads, dim)), "km": (scale, (total // group, heads, dim)),
                   "vs": (scale, (total, heads, vdim)), "vm": (scale, (total, heads, vdim)),
                   "kt": (_TAIL_DTYPE, (tails[-1], heads, dim)),
                   "vt": (_TAIL_DTYPE, (tails[-1], heads, dim))}  # fmt: skip
    for layer in range(lm.num_layers):
        shapes |= {f"{part}.{layer}": shape for part, shape in part_shapes.items()}
    metadata = {"fingerprint": lm.fingerprint, "recall_entries_format": FORMAT, "bits": str(bits),
                "group": str(group), "digest": digest(chunks, prefix)}  # fmt: skip
    writer = RowWriter(path, shapes, metadata)
    try:
        starts: list[int] = []
        if previous is not None and kept:
            starts = list(previous.starts[:kept])
            for chunk in range(kept):
                _copy_rows(writer, previous, chunk, lm.num_layers)
                if on_chunk is not None:
                    on_chunk(chunk + 1, len(chunks))
        for chunk, (start, layers) in enumerate(computed(lm, ids, prefix, first=kept), start=kept):
            starts.append(start)
            whole = rows[chunk + 1] - rows[chunk]
            for layer, (keys, values) in enumerate(layers):
                codes = QuantizedEntries.quantize(keys[0, :, :whole].float(), values[0, :, :whole].float(), group,
                                                  bits)  # fmt: skip
                for part, tensor in zip(_PARTS, codes.tensors(), strict=True):
                    first = rows[chunk] // group if part in _GROUPED else rows[chunk]
                    writer.write(f"{part}.{layer}", first, tensor.transpose(0, 1).cpu())
                for part, tensor in zip(_TAILS, (keys, values), strict=True):
                    rest = tensor[0, :, whole:].transpose(0, 1).to(_TAIL_DTYPE).cpu()
                    writer.write(f"{part}.{layer}", tails[chunk], rest)
            if on_chunk is not None:
                on_chunk(chunk + 1, len(chunks))
        for name, column in zip(_INDEX, (rows, tails, tokens, starts), strict=True):
            writer.write(name, 0, torch.tensor(column, dtype=torch.int64))
        return writer.finish()
    except BaseException:
        writer.discard()
        raise


def _continues(previous: StoredEntries, chunks: Sequence[Chunk], prefix: torch.Tensor, tokens: Sequence[int],
               bits: int, group: int) -> bool:  # fmt: skip
    """Whether `previous` holds the first of `chunks` (the same texts after the same system prompt, codes, layout)."""
    return ((previous.bits, previous.group) == (bits, group) and previous.tokens == list(tokens[: previous.chunks])
            and previous.digest == digest(chunks[: previous.chunks], prefix))  # fmt: skip


def _copy_rows(writer: RowWriter, previous: StoredEntries, chunk: int, layers: int) -> None:
    for layer in range(layers):
        for part in (*_PARTS, *_TAILS):
            first, end = previous.span(part, chunk)
            writer.write(f"{part}.{layer}", first, _read(previous.tensors[f"{part}.{layer}"], first, end))


def _read(tensor: FileRows, first: int, end: int) -> torch.Tensor:
    """Rows `[first, end)` of a stored tensor, read."""
    rows = tensor[first:end]  # FileRows: nothing read yet
    return rows.read() if isinstance(rows, FileRows) else rows
