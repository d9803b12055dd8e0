"""Each turn's place in a cache: its token range (`TurnSpan`, stored in every episode file's metadata as `turns`) and
where it sits in a text of rendered turns (`TurnMark`, a recall chunk's): what receipts map attention back to."""

from __future__ import annotations

import bisect
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from kvchat.history.loading import Turn
from kvchat.packed_text import pack, unpack

METADATA_KEY = "turns"  # the episode file metadata entry holding the turn spans (JSON)
STORED_CHARS = 400     # of each turn's text, kept for quotes
_MAX_SPANS_BYTES = 1 << 28  # what an episode file's spans may inflate to: bounded before it allocates


@dataclass(frozen=True, slots=True)  # a history may have a million turns
class TurnSpan:
    """One turn of the history: its original positions `[start, end)` in the cache and what a receipt shows."""

    start: int
    end: int
    index: int                # the turn's 0-based index in the history
    speaker: str
    text: str                 # the turn's text, cut to STORED_CHARS
    time: str | None = None
    turn_id: str | None = None  # the format's own id (LoCoMo's "D1:3"), when it has one


def span_of(turn: Turn, start: int, end: int, index: int) -> TurnSpan:
    """`turn`'s span: its tokens at positions `[start, end)`, its place `index` in the history, what a receipt shows."""
    return TurnSpan(start, end, index, turn.role, turn.text.strip()[:STORED_CHARS], turn.time, turn.turn_id)


def token_ranges(tokenizer, text: str, starts: Sequence[int]) -> list[tuple[int, int]] | None:
    """The `[first, end)` tokens of each piece of `text` that starts at character `starts[i]` (ascending; the
    text before the first belongs to it): a token belongs to the piece its last character lies in. None when the
    tokenizer cannot give character offsets."""
    try:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, ValueError):  # a slow (Python) tokenizer has no offsets
        return None
    owner, pieces = token_owners(encoded["offset_mapping"], starts), np.arange(len(starts))
    return list(zip(np.searchsorted(owner, pieces, "left").tolist(), np.searchsorted(owner, pieces, "right").tolist(),
                    strict=True))


def token_owners(offset_mapping: Sequence[tuple[int, int]], starts: Sequence[int]) -> np.ndarray:
    """Per token (its character offsets), the index of the piece of text that starting at character `starts[i]`
    (ascending; the text before the first belongs to it) holds the token's last character."""
    return np.fromiter((max(0, bisect.bisect_right(starts, max(end - 1, begin)) - 1) for begin, end in offset_mapping),
                       dtype=np.int64, count=len(offset_mapping))  # fmt: skip


@dataclass(frozen=True)
class TurnMark:
    """Where one turn sits in a text of rendered turns (a recall chunk's, kvchat.answer.recall): the character its lines
    start at (a "[time]" line included), the character its text starts at (after "speaker: "), and what a
    receipt shows of it."""

    line: int
    text: int
    speaker: str
    time: str | None = None
    turn_id: str | None = None


def turn_marks(turns: Sequence[Turn], lines: Sequence[str]) -> tuple[TurnMark, ...]:
    """The marks of `turns` in their rendered `lines` (`format_turns`' lines of them) joined by newlines."""
    marks, cursor = [], 0
    for turn, line in zip(turns, lines, strict=True):
        body = len(line) - len(f"{turn.role}: {turn.text.strip()}")
        marks.append(TurnMark(cursor, cursor + body + len(turn.role) + 2, turn.role, turn.time, turn.turn_id))
        cursor += len(line) + 1
    return tuple(marks)


def to_metadata(spans: Sequence[TurnSpan]) -> str:
    return pack(json.dumps([asdict(s) for s in spans], separators=(",", ":")).encode())


def from_metadata(metadata: dict[str, str]) -> list[TurnSpan] | None:
    """The spans an episode file stores; None for a file written before kvchat recorded them (or a damaged entry)."""
    raw = metadata.get(METADATA_KEY)
    if raw is None:
        return None
    try:
        return [TurnSpan(**entry) for entry in json.loads(unpack(raw, _MAX_SPANS_BYTES))]
    except (TypeError, ValueError):
        return None
