"""A history exported again later (a WhatsApp or Telegram chat, a ChatGPT export): the turns it shares with what
a conversation already stores, so that appending it adds only what came after.

The stored turns' tail (their speaker, text and time, as each turn's span keeps them) is looked for in the new
file's turns; everything up to its last occurrence there is already stored. When the tail is not found (the file
holds only new turns, or the stored turns were edited since) nothing is skipped.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvchat.history.formats.common import Turn
from kvchat.history.spans import STORED_CHARS, TurnSpan

TAIL_TURNS = 8  # stored turns that must follow each other in the new file, in order, to count as its past


def already_stored(turns: Sequence[Turn], stored: Sequence[TurnSpan]) -> int:
    """How many of `turns`, from their start, a conversation whose turns' spans are `stored` (in history order)
    holds already: 0 when the stored tail is not among them."""
    size = min(TAIL_TURNS, len(stored), len(turns))
    if size == 0:
        return 0
    tail = [(s.speaker, s.text, s.time) for s in stored[-size:]]
    keys = [(t.role, t.text.strip()[:STORED_CHARS], t.time) for t in turns]
    for end in range(len(keys), size - 1, -1):  # the last occurrence: a tail repeated earlier is older
        if keys[end - size : end] == tail:
            return end
    return 0
