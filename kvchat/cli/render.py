"""How commands print: the consoles, one line of user data, tables (TSV when piped), JSON documents."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator, Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvchat.cli.terminal import cell, clean
from kvchat.cli.words import spell
from kvchat.documents import spelled

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


def emit_json(document: dict) -> None:
    """One JSON document on one line (JSON Lines when a command prints several), its messages in the CLI's words.
    Text from a history reaches a terminal through it too, so every character that is not printable (C1 controls,
    bidi overrides, line and paragraph separators; json escapes C0 itself) is written as its `\\u` escape: the same
    JSON value, nothing a terminal acts on."""
    sys.stdout.write(_printable_json(json.dumps(spelled(document, spell), ensure_ascii=False)) + "\n")
    sys.stdout.flush()


def _printable_json(text: str) -> str:
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _json_escape(c) for c in text)


def _json_escape(char: str) -> str:
    code = ord(char)
    if code < 0x10000:
        return f"\\u{code:04x}"
    code -= 0x10000  # beyond the first plane: a surrogate pair, as JSON writes one
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def say(*parts: str | tuple[str, str], console: Console | None = None) -> None:
    """One line to a console: user data shown as its characters (no markup, no escape sequences), never
    hard-wrapped; a part given as (text, style) is styled."""
    text = Text()
    for part in parts:
        value, style = part if isinstance(part, tuple) else (part, "")
        text.append(clean(value), style=style)
    (console or out).print(text, soft_wrap=True)


@contextlib.contextmanager
def said_notes() -> Iterator[None]:
    """Ctrl-C inside: what the library noted on it (an ingest's work kept for its next run) said on stderr before it
    goes on (typer turns it into an exit status, dropping the exception)."""
    try:
        yield
    except KeyboardInterrupt as exc:
        for note in getattr(exc, "__notes__", None) or ():
            say(f"kvchat: note: {spell(note)}", console=err)
        raise


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, title: str | None = None,
          right: Sequence[str] = ()) -> None:
    """A table: with rich's rules on a terminal (folded, never cut), tab-separated values otherwise
    (a header line, then one line per row: plain for cut, awk and sort)."""
    if not out.is_terminal:
        for line in [headers, *rows]:
            sys.stdout.write("\t".join(cell(v) for v in line) + "\n")
        sys.stdout.flush()
        return
    grid = Table(title=clean(title) if title else None)
    for header in headers:
        grid.add_column(header, justify="right" if header in right else "left", overflow="fold")
    for row in rows:
        grid.add_row(*(Text(cell(v)) for v in row))
    out.print(grid)


def beside_table() -> Console:
    """Where the lines a table comes with go: stdout on a terminal; stderr when stdout is piped, so that stdout
    holds the tab-separated values alone."""
    return out if out.is_terminal else err


def counted(count: int, noun: str) -> str:
    """`count` `noun`s: "1 episode", "4 episodes"."""
    return f"{count} {noun}{'s' * (count != 1)}"


def head_budgets_text(mode: str, entries: list[int]) -> str:
    """'uniform head budgets', or 'adaptive head budgets (12-301 entries per head)'."""
    if mode == "adaptive" and len(entries) == 2:
        return f"{mode} head budgets ({entries[0]}-{entries[1]} entries per head)"
    return f"{mode} head budgets"


def episode_lines(record) -> list[str]:
    """One line per episode of a stored conversation: its number, topic label and size (user text cleaned)."""
    from kvchat.history.topics import topic_labels

    labels = topic_labels([e.medoid_text for e in record.episodes])
    return [f"  {e.index}  {clean(label, one_line=True) or '(no topic words)'}  ({e.bytes / 2**20:.1f} MiB)"
            for e, label in zip(record.episodes, labels, strict=True)]
