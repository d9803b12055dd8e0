"""Plain transcripts: "Name: text" lines, optionally after a timestamp, as chat apps and people write them.

    Alice: hi            [2023-05-08 13:56] Alice: hi            08/05/2023, 13:56 - Alice: hi

A line that does not open a turn continues the previous one. When the first turn has a timestamp, only
timestamped lines open turns (so "Note: ..." inside a message stays in it) and timestamped lines without a
speaker are the app's notices ("Messages are end-to-end encrypted"), left out. Timestamps are kept as written,
except WhatsApp's: its placeholders are left out and its dates read day or month first as the whole file says
(kvchat.history.formats.whatsapp).
"""

from __future__ import annotations

import re

from kvchat.history.formats.common import MAX_TURNS, Turn, quote, refuse
from kvchat.history.formats.whatsapp import day_first, is_whatsapp, iso_time, message_text

_STAMP = (
    r"(?:\[(?P<bracket>\d[^\]\n]{0,39})\]\s*"  # [2023-05-08 13:56], [08/05/2023, 13:56:01]
    r"|(?P<bare>\d{1,4}[./-]\d{1,2}[./-]\d{1,4},?\s+\d{1,2}:\d{2}(?::\d{2})?(?:\s?[AaPp]\.?\s?[Mm]\.?)?)"
    r"\s*(?:[-\u2013]\s*)?)"  # 08/05/2023, 13:56 - (WhatsApp)
)
_SPEAKER = re.compile(rf"{_STAMP}?(?P<name>[^\s:\[\]][^:\n]{{0,39}}?)\s*:(?:\s+(?P<text>.*))?")
_STAMPED = re.compile(rf"{_STAMP}.*")
MAX_NAME_WORDS = 4


def looks_transcript(text: str) -> bool:
    """Its first line that is not blank or an app's notice opens a turn."""
    return _first_content_line(text.splitlines())[1] is None


def parse_transcript(text: str, source: str) -> list[Turn]:
    lines = text.splitlines()
    start, bad = _first_content_line(lines)
    if bad == "":
        raise refuse(source, 'is not a "Name: text" transcript: no line opens a turn')
    if bad is not None:
        raise refuse(source, f'is not a "Name: text" transcript: line {start + 1} ({quote(bad)}) opens no turn')
    stamped: bool | None = None
    turns: list[tuple[str, list[str], str | None]] = []
    for line in lines[start:]:
        speaker = _speaker(line)
        if speaker is not None and stamped is None:
            stamped = speaker[2] is not None
        if speaker is not None and (speaker[2] is not None or not stamped):
            if len(turns) >= MAX_TURNS:
                raise refuse(source, f"has over {MAX_TURNS:,} turns, the limit")
            name, first, time = speaker
            turns.append((name, [first], time))
        elif stamped and _STAMPED.fullmatch(line.strip()):
            continue  # an app's notice: "Alice added Bob", "Messages are end-to-end encrypted"
        elif line.strip():
            turns[-1][1].append(line.strip())
    stamps = [time for _, _, time in turns if time is not None]
    whatsapp = is_whatsapp(stamps)
    order = day_first(stamps) if whatsapp else None
    result = []
    for name, parts, time in turns:
        body: str | None = "\n".join(p for p in parts if p)
        if whatsapp and body:
            body = message_text(body)  # None: media, a deleted message, a call, an iOS notice
        if order is not None and time is not None:
            time = iso_time(time, order) or time
        if body:  # "Alice:" with nothing after it
            result.append(Turn(name, body, time))
    return result


def _first_content_line(lines: list[str]) -> tuple[int, str | None]:
    """(index of the first line that is not blank or a timestamped notice, None if it opens a turn, else the
    line)."""
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        if _speaker(line) is not None:
            return i, None
        if not _STAMPED.fullmatch(line.strip()):
            return i, line.strip()
    return len(lines), ""


def _speaker(line: str) -> tuple[str, str, str | None] | None:
    """(name, text, timestamp) when `line` opens a turn."""
    m = _SPEAKER.fullmatch(line.strip())
    if m is None:
        return None
    name = " ".join(m.group("name").split())
    if len(name.split()) > MAX_NAME_WORDS:
        return None
    stamp = m.group("bracket") or m.group("bare")
    return name, (m.group("text") or "").strip(), " ".join(stamp.split()) if stamp else None
