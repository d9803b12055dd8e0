"""Markdown chat logs, in the two shapes people and chat exporters write:

    **Dana:** The door code is 4821.            ## Dana
    **Sam**: Thanks!                            The door code is 4821.
    And the parking?
                                                ## Sam
                                                Thanks! And the parking?

A bold name and a colon open a turn (the colon inside or after the bold); otherwise a heading opens one, the
speaker's name being the heading: the level most headings have (a `# Title` above them is the log's title, left
out; deeper headings stay in the turn's text). Lines that open no turn continue the one above; a horizontal rule
(`---`) between turns is dropped; nothing inside a fenced code block opens a turn. A log has no times.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable

from kvchat.history.formats.common import MAX_TURNS, Turn, quote, refuse

_BOLD = re.compile(r"\*\*(?P<name>[^*\n:]{1,40}?)(?::\*\*|\*\*:)(?:\s+(?P<text>.*))?")
_HEADING = re.compile(r"(?P<level>#{1,6})\s+(?P<name>.*?)\s*#*")
_RULE = re.compile(r"(?:-{3,}|\*{3,}|_{3,})")
_FENCE = re.compile(r"(?:```|~~~)")
MAX_NAME_CHARS = 40


def looks_markdown(text: str) -> bool:
    """Its first line that is not blank is a heading or a bold speaker's."""
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return bool(_BOLD.fullmatch(first) or _HEADING.fullmatch(first))


def parse_markdown(text: str, source: str) -> list[Turn]:
    lines = _outside_fences(text.splitlines())
    opens: Callable[[str, int], Opened]
    if any(_BOLD.fullmatch(line.strip()) for line, plain in lines if plain):
        opens = _bold_opener
    else:
        levels = Counter(len(m["level"]) for line, plain in lines if plain
                         and (m := _HEADING.fullmatch(line.strip())) is not None)  # fmt: skip
        if not levels:
            raise refuse(source, "is not a markdown chat log: no **Name:** line or heading opens a turn")
        level = max(levels, key=lambda n: (levels[n], -n))  # the most headings' level; a tie: the higher one
        opens = _heading_opener(level, source)
    turns: list[tuple[str, list[str]]] = []  # each turn's speaker and lines
    for number, (line, plain) in enumerate(lines, start=1):
        opened = opens(line.strip(), number) if plain else None
        if opened == _TITLE:
            continue
        if opened is not None:
            if len(turns) >= MAX_TURNS:
                raise refuse(source, f"has over {MAX_TURNS:,} turns, the limit")
            turns.append(opened)
        elif turns and not (plain and _RULE.fullmatch(line.strip())):
            turns[-1][1].append(line.rstrip())
    result = []
    for name, parts in turns:
        body = "\n".join(parts).strip()
        if body:
            result.append(Turn(name, body))
    return result


def _outside_fences(lines: list[str]) -> list[tuple[str, bool]]:
    """Each line and whether it lies outside a fenced code block (where a turn may open)."""
    marked, fenced = [], False
    for line in lines:
        fence = _FENCE.match(line.strip()) is not None
        marked.append((line, not fenced and not fence))
        fenced ^= fence
    return marked


Opened = tuple[str, list[str]] | None  # a turn's speaker and its first line; None: the line opens no turn
_TITLE: Opened = ("", [])  # a heading above the speakers' level: the log's title or a section's, left out


def _bold_opener(line: str, number: int) -> Opened:
    m = _BOLD.fullmatch(line)
    return None if m is None else (" ".join(m["name"].split()), [(m["text"] or "").strip()])


def _heading_opener(level: int, source: str) -> Callable[[str, int], Opened]:
    def opens(line: str, number: int) -> Opened:
        m = _HEADING.fullmatch(line)
        if m is None or len(m["level"]) > level:
            return None
        if len(m["level"]) < level:
            return _TITLE
        name = " ".join(m["name"].replace("*", "").split())
        if not name or len(name) > MAX_NAME_CHARS:
            raise refuse(source, f"is not a markdown chat log: the heading at line {number} ({quote(line)}) is not "
                         f"a speaker's name (at most {MAX_NAME_CHARS} characters)")
        return name, []

    return opens
