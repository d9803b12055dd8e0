"""Recall's chunks kept as KV entries (`--recall-entries stored`): computed once at ingest, placed at each question.

`--method recall` prefills each question's chunks of raw turns on top of the routed episode cache, which is most of
an answer's time on a CPU. Stored instead, every chunk's entries are computed at ingest, after the system prompt and
the chunk before it in the history (whose own entries are dropped): computed after the system prompt alone, a
chunk's entries carry what a conversation's first tokens carry, and the model goes on with the conversation
instead of answering. At each question the picked chunks' rows are read back (bounded reads), dequantized, their
keys re-rotated to the positions a prefill there would give them (kvchat.kv.rope) and appended to the cache; only
the question is prefilled.

They are kept as KIVI codes (kvchat.kv.quantize, as `--cache-precision` keeps caches) in one file per conversation
(the store's recall entries file). Per layer `l`, every chunk's entries one after another along dim 0, each chunk
padded to whole key groups (its last entry repeated) so that no group spans two chunks: `k.l`/`v.l` codes
`[rows, kv_heads, D or D/2]`, `ks.l`/`km.l` key scales and minima `[rows / group, kv_heads, D]`, `vs.l`/`vm.l`
value scales and minima `[rows, kv_heads, D / value group]`; then `rows` (each chunk's first row, and the end),
`tokens` (each chunk's entries) and `starts` (the position its first entry was computed at). The metadata names
the model, the codes and a digest of the chunk texts and system prompt, which ties the file to its recall index.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvchat.kv.cache import EpisodeCache
from kvchat.kv.quantize import SCALE_DTYPES, QuantizedEntries, value_group
from kvchat.kv.rope import rotate_keys
from kvchat.kv.tensorfile import FileRows, RowWriter
from kvchat.llm import LoadedModel
from kvchat.rag import Chunk

FORMAT = "1"
LEAD = "\n"  # what each chunk's text follows, as recall prefills it (kvchat.recall.recalled_text)
_PARTS = ("k", "ks", "km", "v", "vs", "vm")  # QuantizedEntries.tensors()' order


def chunk_ids(lm: LoadedModel, chunks: Sequence[Chunk]) -> list[torch.Tensor]:
    """Each chunk's token ids `[1, n]` as it is stored and placed: its text after `LEAD`."""
    return [lm.encode(LEAD + c.text) for c in chunks]


def digest(chunks: Sequence[Chunk], prefix: torch.Tensor) -> str:
    """What ties a file to its chunks and the system prompt they were computed after."""
    h = hashlib.sha256(json.dumps(prefix.reshape(-1).tolist()).encode())
    for c in chunks:
        h.update(b"\0" + c.text.encode())
    return h.hexdigest()


def padded(n: int, group: int) -> int:
    return -(-n // group) * group


@dataclass(frozen=True)
class StoredEntries:
    """A recall entries file opened: its tensors as `FileRows` (nothing read until a chunk is placed) and layout."""

    tensors: Mapping[str, FileRows]
    rows: list[int]
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
            rows, tokens, starts = (tensors[name].read().tolist() for name in ("rows", "tokens", "starts"))
            bits, group = int(metadata["bits"]), int(metadata["group"])
        except (KeyError, ValueError) as e:
            raise ValueError(f"its layout does not read ({e})") from None
        if len(rows) != len(tokens) + 1 or len(starts) != len(tokens) or bits not in SCALE_DTYPES:
            raise ValueError("its layout is inconsistent")
        return cls(tensors, rows, tokens, starts, bits, group, metadata.get("digest", ""))

    @property
    def chunks(self) -> int:
        return len(self.tokens)

    def entries(self, chunk: int, layer: int, dtype: torch.dtype, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Chunk `chunk`'s keys and values in `layer`, `[1, kv_heads, n, D]`, as computed (keys rotated for
        positions from `starts[chunk]`)."""
        first, end, n = self.rows[chunk], self.rows[chunk + 1], self.tokens[chunk]
        k, ks, km, v, vs, vm = (self.tensors[f"{part}.{layer}"] for part in _PARTS)
        group_rows = slice(first // self.group, end // self.group)
        parts = [t[first:end] for t in (k, v, vs, vm)] + [t[group_rows] for t in (ks, km)]
        kc, vc, vsc, vmn, ksc, kmn = (p.read().transpose(0, 1).contiguous().to(device) for p in parts)
        codes = QuantizedEntries(kc, ksc, kmn, vc, vsc, vmn, dtype, self.bits)
        return codes.keys()[None, :, :n], codes.values()[None, :, :n]

    def place(self, cache: EpisodeCache, chunk: int, lm: LoadedModel) -> int:
        """Chunk `chunk`'s entries appended to `cache` as a prefill of its text there would append them; returns
        their number."""
        rotary, dtype, device = lm.answering.model.rotary_emb, lm.dtype, lm.device
        n = self.tokens[chunk]
        for layer in range(len(cache.layers)):
            keys, values = self.entries(chunk, layer, dtype, device)
            delta = torch.full((keys.shape[1], n), cache.next_position - self.starts[chunk], device=device)
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
            yield start, [(layer.keys[:, :, -n:], layer.values[:, :, -n:]) for layer in cache.layers]


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
    rows = [0]
    for n in tokens:
        rows.append(rows[-1] + padded(n, group))
    kept = previous.chunks if previous is not None and _continues(previous, chunks, prefix, tokens, bits, group) else 0
    total, packed, vdim = rows[-1], dim // 2 if bits == 4 else dim, dim // value_group(group, dim)
    scale = SCALE_DTYPES[bits]
    shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {
        "rows": (torch.int64, (len(rows),)), "tokens": (torch.int64, (len(tokens),)),
        "starts": (torch.int64, (len(tokens),)),
    }  # fmt: skip
    part_shapes = {"k": (torch.uint8, (total, heads, packed)), "v": (torch.uint8, (total, heads, packed)),
                   "ks": (scale, (total // group, heads, dim)), "km": (scale, (total // group, heads, dim)),
                   "vs": (scale, (total, heads, vdim)), "vm": (scale, (total, heads, vdim))}  # fmt: skip
    for layer in range(lm.num_layers):
        shapes |= {f"{part}.{layer}": shape for part, shape in part_shapes.items()}
    metadata = {"fingerprint": lm.fingerprint, "recall_entries_format": FORMAT, "bits": str(bits),
                "group": str(group), "digest": digest(chunks, prefix)}  # fmt: skip
    writer = RowWriter(path, shapes, metadata)
    try:
        starts = list(previous.starts[:kept]) if kept else []
        for chunk in range(kept):
            _copy_rows(writer, previous, chunk, lm.num_layers)
            if on_chunk is not None:
                on_chunk(chunk + 1, len(chunks))
        for chunk, (start, layers) in enumerate(computed(lm, ids, prefix, first=kept), start=kept):
            starts.append(start)
            for layer, (keys, values) in enumerate(layers):
                codes = _quantized(keys[0], values[0], group, bits)
                for part, tensor in zip(_PARTS, codes.tensors(), strict=True):
                    first = rows[chunk] // group if part in ("ks", "km") else rows[chunk]
                    writer.write(f"{part}.{layer}", first, tensor.transpose(0, 1).cpu())
            if on_chunk is not None:
                on_chunk(chunk + 1, len(chunks))
        for name, values in (("rows", rows), ("tokens", tokens), ("starts", starts)):
            writer.write(name, 0, torch.tensor(values, dtype=torch.int64))
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
    first, end = previous.rows[chunk], previous.rows[chunk + 1]
    for layer in range(layers):
        for part in _PARTS:
            lo, hi = (first // previous.group, end // previous.group) if part in ("ks", "km") else (first, end)
            writer.write(f"{part}.{layer}", lo, previous.tensors[f"{part}.{layer}"][lo:hi].read())


def _quantized(keys: torch.Tensor, values: torch.Tensor, group: int, bits: int) -> QuantizedEntries:
    """`[kv_heads, n, D]` entries as codes of whole groups, the last entry repeated to fill the last group."""
    n = keys.shape[1]
    pad = padded(n, group) - n
    if pad:
        keys = torch.cat([keys, keys[:, -1:].expand(-1, pad, -1)], dim=1)
        values = torch.cat([values, values[:, -1:].expand(-1, pad, -1)], dim=1)
    return QuantizedEntries.quantize(keys.float(), values.float(), group, bits)
