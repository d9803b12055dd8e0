"""Recall (`--method recall`): a routed episode cache, and on top of it the question's chunks of raw turns.

Beyond the model's window an episode cache keeps a fraction of its turns' entries, chosen at ingest before any
question is known; retrieval of raw turns (kvchat.answer.rag) chooses for the question but computes everything again
each time. Recall does both within one budget M: the routed episode caches keep `M - R` entries, and at each
question its top chunks of consecutive turns (R tokens, by the sentence encoder that routes it, so the
question is embedded once) are prefilled after the cache and before the question. A turn the cache dropped, or
that another episode holds, comes back as text.

The chunk index (chunks, their embeddings and the turns') is written into every episode file's
metadata, so each file answers on its own and is covered by its own digest; an append extends it with the new turns'
chunks. How M is
split, recall's settings and their checks are the recall feature's (kvchat.features.recall).
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Sequence
from dataclasses import asdict, replace

import numpy as np

from kvchat.answer.rag import Chunk, RagIndex, TurnEmbeddings
from kvchat.features.recall import RecallSplit as RecallSplit  # how M is split: the feature's, used here too
from kvchat.features.recall import split as split
from kvchat.features.recall import split_for as split_for
from kvchat.history.spans import STORED_CHARS, TurnMark, TurnSpan, token_ranges
from kvchat.packed_text import pack, unpack

METADATA_KEY = "recall"  # the episode file metadata entry holding the chunk index
_MAX_INDEX_BYTES = 1 << 30  # what an index may inflate to: bounded before it allocates


def offset(index: RagIndex, turns: int) -> RagIndex:
    """`index` of turns that follow `turns` stored ones: its chunks' turn numbers counted from the history's start."""
    chunks = [replace(c, first=c.first + turns, end=c.end + turns) for c in index.chunks]
    return RagIndex(chunks, index.embeddings, index.turns.offset(turns) if index.turns is not None else None)


def joined(first: RagIndex, then: RagIndex) -> RagIndex:
    """One index of `first`'s chunks followed by `then`'s (an append's new turns); the turns' embeddings where both
    have them."""
    turns = None
    if first.turns is not None and then.turns is not None:
        turns = TurnEmbeddings(np.concatenate([first.turns.starts, then.turns.starts]),
                               np.concatenate([first.turns.embeddings, then.turns.embeddings]))  # fmt: skip
    return RagIndex([*first.chunks, *then.chunks], np.concatenate([first.embeddings, then.embeddings]), turns)


def to_metadata(index: RagIndex) -> str:
    embeddings = index.embeddings.astype(np.float16)
    document = {"chunks": [asdict(c) for c in index.chunks], "dim": int(embeddings.shape[1]),
                "embeddings": _b64(embeddings)}  # fmt: skip
    if index.turns is not None:
        document["turns"] = {"starts": index.turns.starts.tolist(),
                             "embeddings": _b64(index.turns.embeddings.astype(np.float16))}  # fmt: skip
    return pack(json.dumps(document, separators=(",", ":")).encode())


def from_metadata(metadata: dict[str, str]) -> RagIndex | None:
    """The index an episode file stores; None when it has none. ValueError when the entry does not decode."""
    raw = metadata.get(METADATA_KEY)
    if raw is None:
        return None
    try:
        document = json.loads(unpack(raw, _MAX_INDEX_BYTES))
        chunks = [Chunk(**(c | {"marks": tuple(TurnMark(**m) for m in c.get("marks", ()))}))
                  for c in document["chunks"]]  # fmt: skip
        dim = int(document["dim"])
        embeddings = _from_b64(document["embeddings"], dim)
        turns = None
        if "turns" in document:  # written since recall's interleaved ranking
            starts = np.asarray(document["turns"]["starts"], dtype=np.int64)
            turns = TurnEmbeddings(starts, _from_b64(document["turns"]["embeddings"], dim))
            if len(turns.embeddings) != len(starts) or not len(starts) or np.any(np.diff(starts) <= 0):
                raise ValueError("turn embeddings out of order")
    except (TypeError, ValueError, KeyError, binascii.Error) as e:
        raise ValueError(f"its recall index does not decode ({e})") from None
    if not chunks or len(embeddings) != len(chunks):
        raise ValueError("its recall index has no chunks" if not chunks else "its recall index does not decode")
    return RagIndex(chunks, embeddings, turns)


def _b64(values: np.ndarray) -> str:
    return base64.b64encode(values.tobytes()).decode("ascii")


def _from_b64(text: str, dim: int) -> np.ndarray:
    """float16 rows of `dim` values, as float32."""
    return np.frombuffer(base64.b64decode(text, validate=True), dtype=np.float16).reshape(-1, dim).astype(np.float32)


def picked(index: RagIndex, question: str, query: np.ndarray, split: RecallSplit) -> list[int]:
    """The chunks recalled for `question` (embedded as `query`): their indices in `index`, in history order."""
    words = question if split.retrieval != "dense" else None
    return index.top(query, split.chunks, words, split.retrieval)


def recalled_text(chunks: Sequence[Chunk]) -> str:
    """The text prefilled for recalled `chunks` (after a line break: the cached history's last line has none)."""
    return "\n".join(c.text for c in chunks)


def recalled_spans(tokenizer, chunks: Sequence[Chunk], lead: str = "\n") -> list[TurnSpan]:
    """Each turn of `chunks` (a question's, as `recalled_text` joins them) with its `[start, end)` tokens in the
    text prefilled for them (`lead` + that text), counted from its first token: receipts for recalled turns
    (kvchat.answer.sources). Empty when the tokenizer gives no character offsets or a chunk was stored without its
    turns' places (an index written before kvchat kept them)."""
    if not chunks or any(len(c.marks) != c.end - c.first for c in chunks):
        return []
    starts, cursor = [], len(lead)
    for chunk in chunks:
        starts += [cursor + mark.line for mark in chunk.marks]
        cursor += len(chunk.text) + 1
    turns = recalled_turns(chunks)
    ranges = token_ranges(tokenizer, lead + "\n".join(c.text for c in chunks), starts)
    if ranges is None:
        return []
    return [TurnSpan(first, end, index, mark.speaker, text[:STORED_CHARS], mark.time, mark.turn_id)
            for (index, mark, text), (first, end) in zip(turns, ranges, strict=True)]  # fmt: skip


def recalled_turns(chunks: Sequence[Chunk]) -> list[tuple[int, TurnMark, str]]:
    """Each turn of `chunks`: its index in the history, its mark and its text (empty for chunks stored without their
    turns' places: an index written before kvchat kept them)."""
    turns = []
    for chunk in chunks:
        if len(chunk.marks) != chunk.end - chunk.first:
            continue
        for i, mark in enumerate(chunk.marks):
            end = chunk.marks[i + 1].line - 1 if i + 1 < len(chunk.marks) else len(chunk.text)
            turns.append((chunk.first + i, mark, chunk.text[mark.text : end].strip()))
    return turns


def turn_ranges(chunks: Sequence[Chunk]) -> list[list[int]]:
    """`[first, end)` turn numbers of each chunk, as answers report what was recalled."""
    return [[c.first, c.end] for c in chunks]
