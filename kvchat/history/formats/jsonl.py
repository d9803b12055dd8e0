"""JSONL of messages: one {"role", "content"} object per line. Also reads the lines of fine-tune JSONL."""

from __future__ import annotations

import json

from kvchat.history.formats.common import MAX_TURNS, Turn, load_json, refuse
from kvchat.history.formats.openai import parse_messages


def looks_jsonl(text: str) -> bool:
    """More than one non-empty line, the first a JSON object (a one-line file is plain JSON)."""
    lines = iter(line for line in text.splitlines() if line.strip())
    first, second = next(lines, None), next(lines, None)
    return first is not None and second is not None and isinstance(_try_json(first), dict)


def first_object(text: str) -> object:
    """The first non-empty line parsed, None when it is not JSON."""
    return next((_try_json(line) for line in text.splitlines() if line.strip()), None)


def parse_jsonl(text: str, source: str) -> list[Turn]:
    numbers, items = read_lines(text, source, 'one {"role", "content"} object per line', "turns")
    return parse_messages(items, source, lambda i: f"line {numbers[i]}")


def read_lines(text: str, source: str, expects: str, what: str) -> tuple[list[int], list[object]]:
    """Every non-empty line parsed as JSON, with its line number; `expects` says what a line should be."""
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if len(lines) > MAX_TURNS:
        raise refuse(source, f"has {len(lines):,} lines, over the limit of {MAX_TURNS:,} {what}")
    items: list[object] = []
    for n, line in lines:
        try:
            item = load_json(line)
        except RecursionError:
            raise refuse(source, f"line {n} is nested too deeply (JSONL expects {expects})") from None
        except ValueError as exc:
            raise refuse(source, f"line {n} is not valid JSON: {_decode_message(exc)} "
                         f"(JSONL expects {expects})") from None
        items.append(item)
    return [n for n, _ in lines], items


def _try_json(line: str) -> object:
    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        return None


def _decode_message(error: ValueError) -> str:
    if isinstance(error, json.JSONDecodeError):
        return f"{error.msg} at column {error.colno}"
    return str(error).split(";")[0]
