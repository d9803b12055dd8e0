"""A history's token ids and each turn's token range (`spans.TurnSpan`), from one pass over its rendered lines
tokenized a chunk of lines at a time.

Tokenizing a history as one string holds, for a moment, every token's id and character offsets as Python objects,
and the turn spans needed a second such pass: hundreds of bytes a token, gigabytes for a million tiny turns, and
nothing to report until both were done. Here each chunk's ids are kept as int32 and its turns' spans read from the
same call's offsets, then dropped. A chunk ends after a line's newline only where the tokenizer cuts the text
there anyway, checked on the lines around the cut (a tokenizer that cuts nowhere, one that opens every text with a
space marker, gets one chunk), so the ids are those of tokenizing the whole text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvchat.history.loading import Turn, format_turns
from kvchat.history.spans import TurnSpan, span_of, token_owners

CHUNK_CHARS = 1 << 16  # characters of rendered lines per tokenizer call (a chunk ends at the next line that allows)
_TRIES = 64  # lines in a row a chunk may look for a cut at before it takes the rest


@dataclass(frozen=True)
class TokenizedTurns:
    ids: torch.Tensor  # [1, n] int64, as `LoadedModel.encode` gives them
    bounds: np.ndarray | None  # [turns + 1]: where each turn's tokens begin, then the end; None without offsets

    def spans(self, turns: Sequence[Turn], offset: int, indices: Sequence[int] | None = None) -> list[TurnSpan]:
        """Each turn's `spans.TurnSpan`, positions from `offset` on; `indices`, the turns' places in the history
        (default 0, 1, ...; a routed episode holds some turns only). Empty without offsets."""
        if self.bounds is None:
            return []
        at = (self.bounds + offset).tolist()
        return [span_of(turn, at[i], at[i + 1], indices[i] if indices is not None else i)
                for i, turn in enumerate(turns)]  # fmt: skip


def tokenize_turns(
    tokenizer, turns: Sequence[Turn], *, lead: str = "", lines: Sequence[str] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> TokenizedTurns:
    """The ids of `lead` + `turns`' lines joined by newlines (as ingest lays out a history; an append's new turns
    start with a newline) and where each turn's tokens lie: a token belongs to the turn its last character lies in,
    a line's newline counting as its own. `lines`: `format_turns(turns)` when the caller has them;
    `on_progress(turns done, turns)` hears of every chunk."""
    lines = format_turns(turns) if lines is None else lines
    offsets = _gives_offsets(tokenizer)
    pieces: list[np.ndarray] = []
    bounds: list[np.ndarray] = []
    tokens = 0
    for first, end in _chunks(tokenizer, lines):
        text = (lead if first == 0 else "") + "\n".join(lines[first:end]) + ("\n" if end < len(lines) else "")
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=offsets)
        pieces.append(np.asarray(encoded["input_ids"], dtype=np.int32))
        if offsets:
            owners = _owners(encoded["offset_mapping"], lines[first:end], len(lead) if first == 0 else 0)
            bounds.append(tokens + np.searchsorted(owners, np.arange(end - first), "left"))
        del encoded
        tokens += len(pieces[-1])
        if on_progress is not None:
            on_progress(end, len(lines))
    joined = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
    ends = np.concatenate([*bounds, [tokens]]).astype(np.int64) if offsets else None
    return TokenizedTurns(torch.from_numpy(joined).to(torch.long).unsqueeze(0), ends)


def turn_spans(tokenizer, turns: Sequence[Turn], offset: int, *, lead: str = "",
               indices: Sequence[int] | None = None) -> list[TurnSpan]:
    """The spans of `turns` tokenized as ingest does (`tokenize_turns`), positions from `offset` on."""
    return tokenize_turns(tokenizer, turns, lead=lead).spans(turns, offset, indices)


def _gives_offsets(tokenizer) -> bool:
    """Whether the tokenizer gives character offsets (a slow, Python tokenizer does not: no spans then)."""
    try:
        tokenizer("a", add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, ValueError):
        return False
    return True


def _chunks(tokenizer, lines: Sequence[str]) -> list[tuple[int, int]]:
    """[first, end) line ranges of about `CHUNK_CHARS` characters each, cut only between two lines the tokenizer
    cuts between by itself; after `_TRIES` lines in a row where it does not, the rest is one chunk."""
    ranges, first, chars, misses = [], 0, 0, 0
    for i, line in enumerate(lines):
        chars += len(line) + 1
        if chars < CHUNK_CHARS or i + 1 == len(lines) or misses >= _TRIES:
            continue
        if _cuts_between(tokenizer, line, lines[i + 1]):
            ranges.append((first, i + 1))
            first, chars, misses = i + 1, 0, 0
        else:
            misses += 1
    if first < len(lines) or not ranges:
        ranges.append((first, len(lines)))
    return ranges


def _cuts_between(tokenizer, before: str, after: str) -> bool:
    """Whether `before` + newline + `after` tokenizes as `before` + newline, then `after`."""

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    return ids(f"{before}\n{after}") == ids(f"{before}\n") + ids(after)


def _owners(offset_mapping: Sequence[tuple[int, int]], lines: Sequence[str], start: int) -> np.ndarray:
    """Per token, the index (in `lines`) of the line its last character lies in; the lines begin at `start`."""
    starts = np.cumsum([start, *(len(line) + 1 for line in lines[:-1])]).tolist() if lines else []
    return token_owners(offset_mapping, starts)
