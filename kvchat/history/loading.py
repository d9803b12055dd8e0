"""Load a chat history file into a flat list of turns, rejecting every malformed input with one clear line.

The file is read once, its format detected (or forced with `format`) and handed to its importer in
`kvchat.history.formats`; everything downstream sees only `Turn`s. Files that hold several conversations (ChatGPT and
Claude exports, fine-tune JSONL) need `pick`: a 1-based number, a title, or "all".
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from collections.abc import Sequence
from pathlib import Path

from kvchat.history.formats.chatgpt import looks_chatgpt, parse_chatgpt
from kvchat.history.formats.claude import looks_claude, parse_claude
from kvchat.history.formats.common import (
    FORMATS,
    MAX_FILE_BYTES,
    MAX_TURN_CHARS,
    MAX_TURNS,
    Pick,
    Turn,
    load_json,
    one_line,
    quote,
    refuse,
    type_name,
)
from kvchat.history.formats.discord import looks_discord, parse_discord
from kvchat.history.formats.finetune import parse_finetune
from kvchat.history.formats.jsonl import first_object, looks_jsonl, parse_jsonl
from kvchat.history.formats.locomo import looks_locomo, parse_locomo, parse_locomo_samples
from kvchat.history.formats.longmemeval import parse_longmemeval
from kvchat.history.formats.markdown import looks_markdown, parse_markdown
from kvchat.history.formats.openai import parse_messages, parse_wrapper
from kvchat.history.formats.slack import is_channel_folder, looks_slack, parse_slack, read_channel, users_beside
from kvchat.history.formats.telegram import looks_telegram, parse_telegram
from kvchat.history.formats.transcript import looks_transcript, parse_transcript
from kvchat.untrusted_text import valid_text

__all__ = ["FORMATS", "FORMAT_NAMES", "MAX_FILE_BYTES", "MAX_TURN_CHARS", "MAX_TURNS", "Pick", "Turn",
           "checked_turns", "format_turns", "load_history", "parse_history"]

# --format NAME: what each name reads. Detection finds the same names; the first four are JSON documents.
FORMAT_NAMES = {
    "openai": 'an OpenAI messages list or {"messages": [...]}',
    "chatgpt": "a ChatGPT export (conversations.json) or one of its conversations",
    "claude": "a Claude export (conversations.json) or one of its conversations",
    "telegram": "a Telegram Desktop export (result.json): one chat, or every chat",
    "slack": "a Slack channel export: its folder of day files, or one day's file",
    "discord": "a Discord channel exported by DiscordChatExporter (JSON)",
    "locomo": "a LoCoMo conversation",
    "longmemeval": "a LongMemEval instance",
    "jsonl": 'JSONL of messages, one {"role", "content"} object per line',
    "finetune": 'OpenAI fine-tune JSONL, one {"messages": [...]} conversation per line',
    "transcript": 'a plain "Name: text" transcript, optionally timestamped (a WhatsApp chat too)',
    "markdown": "a markdown chat log: **Name:** lines or a heading per speaker",
}
_JSON_FORMATS = ("openai", "chatgpt", "claude", "telegram", "slack", "discord", "locomo", "longmemeval")
_TEXT_FORMATS = ("jsonl", "finetune", "transcript", "markdown")
# the formats that hold several conversations: pick applies
_SEVERAL = ("chatgpt", "claude", "telegram", "finetune", "locomo")


# ----------------------------------------------------------------------------------------------------------
# Reading the file


def load_history(path: str | os.PathLike[str], *, format: str | None = None, pick: Pick = None,
                 min_turns: int = 2, name: str | None = None) -> list[Turn]:
    """Read and validate a history file; every problem with the file is a UserError naming it (as `name` says, when
    given: the server names a file as its client did, never by its path on the server).

    `min_turns`: a history to ingest needs 2 turns; new turns appended to a stored one may be a single turn.

    `format` forces one of FORMAT_NAMES instead of detecting it; `pick` chooses among several conversations.
    """
    source = os.fspath(path) if name is None else name
    if format is not None and format not in FORMAT_NAMES:
        raise one_line(source, f"unknown format {quote(str(format), 20)} (expected one of "
                       f"{', '.join(FORMAT_NAMES)})")
    if format in (None, "slack") and _channel_folder(Path(path)):  # a Slack export's channel
        _check_pick("slack", pick, source)
        return _at_least(min_turns, read_channel(Path(path), source, lambda p: _read_text(p, str(p))), source)
    text = _read_text(Path(path), source)
    if format in _TEXT_FORMATS:
        return _at_least(min_turns, _parse_text(format, text, source, pick), source)
    try:
        data = load_json(text)
    except RecursionError:
        raise refuse(source, "is nested too deeply to be a chat history") from None
    except ValueError as exc:
        if format is not None:
            raise refuse(source, _json_error(text, exc)) from None
        return _at_least(min_turns, _parse_text(_text_format(text, source, exc), text, source, pick), source)
    return parse_history(data, source, format=format, pick=pick, min_turns=min_turns, beside=Path(source).parent)


def _channel_folder(path: Path) -> bool:
    try:
        return is_channel_folder(path)
    except OSError:  # not there, or not readable: the file reader says which
        return False


def _read_text(path: Path, source: str) -> str:
    """The file's text, decoded as UTF-8 with an optional BOM; size is checked before reading."""
    try:
        info = path.stat()
    except (FileNotFoundError, NotADirectoryError):
        raise one_line(source, "no such file (expected a chat history file)") from None
    except PermissionError:
        raise one_line(source, "cannot be read: permission denied") from None
    except (OSError, ValueError) as exc:
        raise one_line(source, f"cannot be read: {getattr(exc, 'strerror', None) or exc}") from None
    if stat.S_ISDIR(info.st_mode):
        raise one_line(source, "is a directory (expected a chat history file)")
    if stat.S_ISREG(info.st_mode) and info.st_size > MAX_FILE_BYTES:
        raise one_line(source, f"is {info.st_size:,} bytes, over the {MAX_FILE_BYTES:,}-byte limit for a history")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)  # pipes and devices have no size to stat
    except PermissionError:
        raise one_line(source, "cannot be read: permission denied") from None
    except IsADirectoryError:
        raise one_line(source, "is a directory (expected a chat history file)") from None
    except OSError as exc:
        raise one_line(source, f"cannot be read: {exc.strerror or exc}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise one_line(source, f"is over the {MAX_FILE_BYTES:,}-byte limit for a history")
    if not raw:
        raise refuse(source, "is empty")
    if raw.startswith(b"PK\x03\x04"):
        raise refuse(source, "is a zip archive (an export? unzip it and pass its conversations.json)")
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise refuse(source, "is UTF-16 encoded (expected UTF-8; re-save the file as UTF-8)")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        bad = f"0x{raw[exc.start]:02x} at offset {exc.start}"
        raise refuse(source, f"is not valid UTF-8 (byte {bad}; re-save the file as UTF-8)") from None
    if not text.strip():
        raise refuse(source, "is empty, only whitespace")
    return text


def _text_format(text: str, source: str, error: ValueError) -> str:
    """Not one JSON document: JSONL (of messages, or of conversations), a transcript, or a JSON error."""
    if looks_jsonl(text):
        first = first_object(text)
        return "finetune" if isinstance(first, dict) and "messages" in first else "jsonl"
    if looks_markdown(text):
        return "markdown"
    if looks_transcript(text):
        return "transcript"
    if text.lstrip()[:1] in ("[", "{"):
        raise refuse(source, _json_error(text, error))
    line = next(line.strip() for line in text.splitlines() if line.strip())
    raise refuse(source, f'is not valid JSON, nor a "Name: text" transcript (it begins {quote(line)})')


def _parse_text(format: str, text: str, source: str, pick: Pick) -> list[Turn]:
    _check_pick(format, pick, source)
    if format == "finetune":
        return parse_finetune(text, source, pick)
    if format == "jsonl":
        return parse_jsonl(text, source)
    if format == "markdown":
        return parse_markdown(text, source)
    return parse_transcript(text, source)


def _check_pick(format: str, pick: Pick, source: str) -> None:
    if pick is not None and format not in _SEVERAL:
        raise one_line(source, f"holds one conversation ({FORMAT_NAMES[format]}): pick applies to "
                       "ChatGPT, Claude and Telegram exports and fine-tune JSONL, and to LoCoMo files of several "
                       "conversations")


def _json_error(text: str, error: ValueError) -> str:
    if not isinstance(error, json.JSONDecodeError):  # e.g. an integer too long to convert
        return f"is not valid JSON: {str(error).split(';')[0]}"
    if error.msg.startswith("Unterminated string") or error.pos >= len(text.rstrip()):
        return f"is not valid JSON: it ends early at line {error.lineno} (truncated file?)"
    return f"is not valid JSON: {error.msg} at line {error.lineno} column {error.colno}"


# ----------------------------------------------------------------------------------------------------------
# Recognising a JSON document's format


def parse_history(data: object, source: str = "<input>", *, format: str | None = None,
                  pick: Pick = None, min_turns: int = 2, beside: Path | None = None) -> list[Turn]:
    """Validate an already-parsed JSON value; `source` names it in error messages. `beside`: the folder the file
    was in (a Slack day file's export names its users there)."""
    if format is not None and format not in _JSON_FORMATS:
        raise one_line(source, f"format {quote(format, 20)} is not a JSON document format (expected one of "
                       f"{', '.join(_JSON_FORMATS)})")
    if format is None:
        format, data = _detect_json(data, source)
    _check_pick(format, pick, source)
    return _at_least(min_turns, _parse_json(format, data, source, pick, beside), source)


def _at_least(count: int, turns: list[Turn], source: str) -> list[Turn]:
    if len(turns) < count:
        what = "a chat history" if count > 1 else "new turns"
        raise refuse(source, f"needs at least {count} turn{'s' * (count > 1)} to be {what}, found {len(turns)}")
    return checked_turns(turns, source)


def checked_turns(turns: list[Turn], source: str) -> list[Turn]:
    """`turns` as everything downstream may take them, before any is tokenized: none longer than `MAX_TURN_CHARS`
    (a turn is tokenized whole, and a tokenizer holds hundreds of bytes a character: one 20 MB line took 5 GB), and
    every lone surrogate (`"\\ud800"` in JSON) replaced (`untrusted_text.valid_text`)."""
    for index, turn in enumerate(turns):
        size = len(turn.text) + len(turn.role) + len(turn.time or "") + len(turn.conversation_title or "")
        if size > MAX_TURN_CHARS:
            raise one_line(source, f"turn {index + 1} is {size:,} characters, over the limit of {MAX_TURN_CHARS:,} "
                           "characters a turn (split it)")
    return [_valid(turn) for turn in turns]


def _valid(turn: Turn) -> Turn:
    fields = {name: valid_text(value) for name in ("role", "text", "time", "turn_id", "conversation_title")
              if isinstance(value := getattr(turn, name), str) and valid_text(value) is not value}
    return dataclasses.replace(turn, **fields) if fields else turn


def _item_kind(item: object) -> str:
    """What a top-level list element looks like, to spot files that mix formats."""
    if not isinstance(item, dict):
        return type_name(item)
    if "haystack_sessions" in item:
        return "a LongMemEval instance"
    if looks_chatgpt(item):
        return "a ChatGPT conversation"
    if looks_claude(item):
        return "a Claude conversation"
    if looks_slack(item):
        return "a Slack message"
    if "role" in item or "content" in item:
        return "a message object"
    if "conversation" in item or looks_locomo(item):
        return "a LoCoMo conversation"
    return "a message object"  # the message checks then say which key is missing


_KIND_FORMAT = {"a message object": "openai", "a ChatGPT conversation": "chatgpt",
                "a Claude conversation": "claude", "a Slack message": "slack", "a LongMemEval instance": "longmemeval",
                "a LoCoMo conversation": "locomo"}


def _detect_json(data: object, source: str) -> tuple[str, object]:
    """(format name, the value its importer reads): a list of one LoCoMo or LongMemEval item is that item."""
    if isinstance(data, dict):
        return _object_format(data, source), data
    if not isinstance(data, list):
        raise refuse(source, f"top level is {type_name(data)}")
    if not data:
        raise refuse(source, "is an empty list")
    first = _item_kind(data[0])
    for i, item in enumerate(data):
        kind = _item_kind(item)
        if kind != first:
            raise refuse(source, f"mixes formats: item 1 is {first} but item {i + 1} is {kind} "
                         "(expected one format per file)")
    if first == "a LoCoMo conversation" and len(data) > 1:  # the official locomo10.json: pick chooses
        return "locomo", data
    if first in ("a LongMemEval instance", "a LoCoMo conversation"):
        if len(data) > 1:
            raise refuse(source, f"holds {len(data)} {first.removeprefix('a ')}s; "
                           "split it into one file per conversation")
        return _KIND_FORMAT[first], data[0]
    if first in _KIND_FORMAT:
        return _KIND_FORMAT[first], data
    plural = {"null": "nulls", "a boolean": "booleans", "a number": "numbers", "a string": "strings",
              "a list": "lists"}.get(first, first)
    raise refuse(source, f"is a list of {plural}, not messages")


def _object_format(data: dict, source: str) -> str:
    if looks_discord(data):  # its "messages" are Discord's, not OpenAI's
        return "discord"
    if looks_telegram(data):  # a chat's "messages" typed "message"/"service", or every chat's "chats"
        return "telegram"
    markers = [(name, fmt) for name, fmt, present in (
        ('"messages"', "openai", "messages" in data),
        ('"mapping" (ChatGPT)', "chatgpt", looks_chatgpt(data)),
        ('"chat_messages" (Claude)', "claude", looks_claude(data)),
        ('"haystack_sessions" (LongMemEval)', "longmemeval", "haystack_sessions" in data),
        ('"conversation"/"session_N" (LoCoMo)', "locomo", "conversation" in data or looks_locomo(data)),
    ) if present]
    if len(markers) > 1:
        raise refuse(source, f"mixes formats: it has both {markers[0][0]} and {markers[1][0]} keys "
                     "(expected one format per file)")
    if markers:
        return markers[0][1]
    if "role" in data or "content" in data:
        raise refuse(source, "is a single message object (expected a list of at least 2 messages)")
    keys = ", ".join(quote(str(k), 20) for k in list(data)[:5])
    found = f"an object with keys {keys}{', ...' if len(data) > 5 else ''}" if data else "an empty object"
    raise refuse(source, f"is {found}, not a known history format")


def _parse_json(format: str, data: object, source: str, pick: Pick, beside: Path | None = None) -> list[Turn]:
    """`data` read as `format`: the importers' own checks say what does not fit."""
    if format == "telegram" and isinstance(data, dict) and looks_telegram(data):
        return parse_telegram(data, source, pick)
    if format == "discord" and isinstance(data, dict) and looks_discord(data):
        return parse_discord(data, source)
    if format == "slack" and isinstance(data, list):
        return parse_slack(data, source, users_beside(beside) if beside is not None else None)
    if format == "chatgpt" and isinstance(data, list | dict):
        return parse_chatgpt(data, source, pick)
    if format == "claude" and isinstance(data, list | dict):
        return parse_claude(data, source, pick)
    if format == "openai" and isinstance(data, list):
        return parse_messages(data, source, lambda i: f"message {i + 1}")
    if format == "openai" and isinstance(data, dict) and "messages" in data:
        return parse_wrapper(data, source)
    if format == "locomo" and isinstance(data, list) and len(data) > 1 and all(
            isinstance(item, dict) and ("conversation" in item or looks_locomo(item)) for item in data):
        return parse_locomo_samples(data, source, pick)
    if isinstance(data, list) and len(data) == 1 and format in ("locomo", "longmemeval"):
        data = data[0]
    if format == "longmemeval" and isinstance(data, dict) and "haystack_sessions" in data:
        return parse_longmemeval(data, source)
    if format == "locomo" and isinstance(data, dict):
        return parse_locomo(data, source)
    raise refuse(source, f"is {type_name(data)} that is not {FORMAT_NAMES[format]}")


# ----------------------------------------------------------------------------------------------------------
# Rendering


def format_turns(turns: Sequence[Turn]) -> list[str]:
    """One "role: text" string per turn; a "[time]" line opens each new time so dates reach the model, and a
    "[conversation: title]" line each new conversation of a file that holds several."""
    lines = []
    previous: str | None = None
    title: str | None = None
    for turn in turns:
        line = f"{turn.role}: {turn.text.strip()}"
        opens = turn.conversation_title is not None and turn.conversation_title != title
        if turn.time is not None and (turn.time != previous or opens):
            line = f"[{turn.time}]\n{line}"
        if opens:
            line = f"[conversation: {turn.conversation_title}]\n{line}"
        previous, title = turn.time, turn.conversation_title
        lines.append(line)
    return lines


def excerpt(text: str, limit: int) -> str:
    """`text` on one line, cut at a word boundary to at most `limit` characters (an ellipsis marks the cut)."""
    return cut_at_word(" ".join(text.split()), limit)


def cut_at_word(line: str, limit: int) -> str:
    """`line` cut at a word boundary to at most `limit` characters (an ellipsis marks the cut)."""
    if len(line) <= limit:
        return line
    cut = line[: limit - 1]
    space = cut.rfind(" ")
    return (cut[:space] if space > limit // 2 else cut).rstrip(" ,;:") + "…"
