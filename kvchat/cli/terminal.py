"""Untrusted text on a terminal: what a history, a file name or a model's answer may contain must reach
the screen as the characters it is, never as markup, escape sequences or control characters.

`clean` removes escape sequences (CSI, OSC, DCS, ... and lone ESC) and shows every other control
character as a visible `\\xNN` / `\\u....` escape, bidirectional overrides included (they reorder what the
reader sees). Newlines and tabs stay unless `one_line` is asked for. kvchat passes the result to rich as
a `Text` or with `markup=False`, so `[b]` stays `[b]`.
"""

from __future__ import annotations

import re
import unicodedata

# ESC then a CSI (`[` params final), an OSC/DCS/SOS/PM/APC string (up to BEL or ST), or one more character;
# the same introducers as 8-bit C1 characters.
_ESCAPE_SEQUENCE = re.compile(
    r"""
    (?: \x1b\[ | \x9b ) [0-?]* [ -/]* [@-~]?                           # CSI ... final byte
  | (?: \x1b[\]PX^_] | [\x90\x98\x9d\x9e\x9f] ) .*? (?: \x07 | \x1b\\ | \x9c | $ )  # OSC/DCS/SOS/PM/APC ... BEL or ST
  | \x1b [ -/]* [0-~]?                                                # ESC, intermediates, final (or a lone ESC)
    """,
    re.VERBOSE | re.DOTALL,
)
# Bidirectional controls and other invisible format characters that change how a line reads.
_FORMAT_CHARS = {"\u061c", "\u200e", "\u200f", "\u2028", "\u2029", "\ufeff"}
_FORMAT_CHARS |= {chr(c) for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))}


def _visible(ch: str) -> str:
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def clean(text: str, *, one_line: bool = False) -> str:
    """`text` with escape sequences removed and other control characters made visible."""
    text = _ESCAPE_SEQUENCE.sub("", text)
    keep = "" if one_line else "\n\t"
    out = []
    for ch in text:
        if ch in keep:
            out.append(ch)
        elif ch in _FORMAT_CHARS or (unicodedata.category(ch) == "Cc"):
            out.append(" " if one_line and ch in "\n\t\r" else _visible(ch))
        else:
            out.append(ch)
    return "".join(out)


def cell(text: object) -> str:
    """One table cell or TSV field: one line, no tab, nothing a terminal would act on."""
    return clean(str(text), one_line=True)


_INTRODUCERS = "\x1b\x9b\x90\x98\x9d\x9e\x9f"


class StreamCleaner:
    """`clean` for text that arrives in pieces (a streamed answer): an escape sequence split across two
    pieces is held back until it is complete, then removed whole."""

    def __init__(self) -> None:
        self._pending = ""

    def feed(self, piece: str) -> str:
        text = self._pending + piece
        start = max(text.rfind(ch) for ch in _INTRODUCERS)
        if start >= 0 and len(text) - start < 4096:
            match = _ESCAPE_SEQUENCE.match(text, start)
            if match is None or match.end() == len(text):  # may still be growing
                self._pending = text[start:]
                return clean(text[:start])
        self._pending = ""
        return clean(text)

    def flush(self) -> str:
        text, self._pending = self._pending, ""
        return clean(text)
