"""Load a chat history file into a flat list of turns, rejecting every malformed input with one clear line.

Four shapes are accepted (an OpenAI messages list, JSONL of messages, a LoCoMo conversation, a LongMemEval
instance) so users can point kvchat at what they already have; everything downstream sees only `Turn`s.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvchat.errors import UserError

# Sanity limits, not model limits (the caller handles token budgets): they keep a wrong file
# (a disk image, a log dump) from eating all memory before we can say what is wrong.
MAX_TURNS = 1_000_000
MAX_FILE_BYTES = 512 * 1024 * 1024

FORMATS = (
    'an OpenAI messages list or {"messages": [...]}, JSONL of messages, '
    "a LoCoMo conversation, or a LongMemEval instance"
)
MESSAGE_SHAPE = 'expected {"role", "content"} objects'

_SESSION_KEY = re.compile(r"session_([1-9][0-9]{0,8})")
_SESSION_DATE_KEY = re.compile(r"session_([1-9][0-9]{0,8})_date_time")
_LINE_BREAKS = re.compile(r"[\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")


@dataclass(frozen=True)
class Turn:
    """One utterance; `time` and `turn_id` carry what the source format knows, so answers can cite them."""

    role: str  # "user"/"assistant"/"system"/... or a speaker name (LoCoMo)
    text: str
    time: str | None = None  # session date/time when the format gives one
    turn_id: str | None = None  # e.g. LoCoMo dia_id "D1:3"; None otherwise


def _fail(source: str, what: str) -> UserError:
    """A UserError on one line: file names and quoted values may hold line breaks, which would split it."""
    message = f"{source}: {what}"
    return UserError(_LINE_BREAKS.sub(lambda m: ascii(m.group())[1:-1], message))


def _type_name(value: object) -> str:
    """JSON's names for Python values, since the user wrote JSON."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _quote(value: str, limit: int = 40) -> str:
    """A short JSON-quoted excerpt of a user string for error messages."""
    text = json.dumps(value[:limit], ensure_ascii=True)
    return text if len(value) <= limit else text[:-1] + '..."'


# ----------------------------------------------------------------------------------------------------------
# Reading the file


def load_history(path: str | os.PathLike[str]) -> list[Turn]:
    """Read and validate a history file; every problem with the file is a UserError naming it."""
    source = os.fspath(path)
    text = _read_text(Path(source), source)
    try:
        data = json.loads(text)
    except RecursionError:
        raise _fail(source, "is nested too deeply to be a chat history (expected " + FORMATS + ")") from None
    except ValueError as exc:
        return _parse_jsonl_or_fail(text, source, exc)
    return parse_history(data, source)


def _read_text(path: Path, source: str) -> str:
    """The file's text, decoded as UTF-8 with an optional BOM; size is checked before reading."""
    try:
        info = path.stat()
    except (FileNotFoundError, NotADirectoryError):
        raise _fail(source, "no such file (expected a chat history JSON or JSONL file)") from None
    except PermissionError:
        raise _fail(source, "cannot be read: permission denied") from None
    except (OSError, ValueError) as exc:
        raise _fail(source, f"cannot be read: {getattr(exc, 'strerror', None) or exc}") from None
    if stat.S_ISDIR(info.st_mode):
        raise _fail(source, "is a directory (expected a chat history JSON or JSONL file)")
    if stat.S_ISREG(info.st_mode) and info.st_size > MAX_FILE_BYTES:
        raise _fail(source, f"is {info.st_size:,} bytes, over the {MAX_FILE_BYTES:,}-byte limit "
                    "for a history")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)  # pipes and devices have no size to stat
    except PermissionError:
        raise _fail(source, "cannot be read: permission denied") from None
    except IsADirectoryError:
        raise _fail(source, "is a directory (expected a chat history JSON or JSONL file)") from None
    except OSError as exc:
        raise _fail(source, f"cannot be read: {exc.strerror or exc}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise _fail(source, f"is over the {MAX_FILE_BYTES:,}-byte limit for a history")
    if not raw:
        raise _fail(source, "is empty (expected " + FORMATS + ")")
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise _fail(source, "is UTF-16 encoded (expected UTF-8; re-save the file as UTF-8)")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        bad = f"0x{raw[exc.start]:02x} at offset {exc.start}"
        raise _fail(source, f"is not valid UTF-8 (byte {bad}; re-save the file as UTF-8)") from None
    if not text.strip():
        raise _fail(source, "is empty, only whitespace (expected " + FORMATS + ")")
    return text


def _parse_jsonl_or_fail(text: str, source: str, error: ValueError) -> list[Turn]:
    """Not one JSON document: JSONL if the first line is an object, else report the JSON error."""
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    first = _try_json(lines[0][1]) if len(lines) > 1 else None
    if not isinstance(first, dict):
        raise _fail(source, _json_error(text, error))
    if len(lines) > MAX_TURNS:
        raise _fail(source, f"has {len(lines):,} lines, over the limit of {MAX_TURNS:,} turns")
    items: list[object] = []
    for n, line in lines:
        try:
            item = json.loads(line)
        except RecursionError:
            raise _fail(source, f"line {n} is nested too deeply (expected one message object "
                        "per line)") from None
        except ValueError as exc:
            raise _fail(source, f"line {n} is not valid JSON: {_decode_message(exc)} "
                        '(JSONL expects one {"role", "content"} object per line)') from None
        items.append(item)
    numbers = [n for n, _ in lines]
    return _at_least_two(_messages(items, source, lambda i: f"line {numbers[i]}"), source)


def _try_json(line: str) -> object:
    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        return None


def _decode_message(error: ValueError) -> str:
    if isinstance(error, json.JSONDecodeError):
        return f"{error.msg} at column {error.colno}"
    return str(error).split(";")[0]


def _json_error(text: str, error: ValueError) -> str:
    if not isinstance(error, json.JSONDecodeError):  # e.g. an integer too long to convert
        return f"is not valid JSON: {str(error).split(';')[0]}"
    if error.msg.startswith("Unterminated string") or error.pos >= len(text.rstrip()):
        return f"is not valid JSON: it ends early at line {error.lineno} (truncated file?)"
    return f"is not valid JSON: {error.msg} at line {error.lineno} column {error.colno}"


# ----------------------------------------------------------------------------------------------------------
# Recognising the shape


def parse_history(data: object, source: str = "<input>") -> list[Turn]:
    """Validate an already-parsed JSON value; `source` names it in error messages."""
    if isinstance(data, list):
        turns = _parse_list(data, source)
    elif isinstance(data, dict):
        turns = _parse_object(data, source)
    else:
        raise _fail(source, f"top level is {_type_name(data)} (expected {FORMATS})")
    return _at_least_two(turns, source)


def _at_least_two(turns: list[Turn], source: str) -> list[Turn]:
    if len(turns) < 2:
        raise _fail(source, f"needs at least 2 turns to be a chat history, found {len(turns)}")
    return turns


def _looks_locomo(obj: dict) -> bool:
    if "speaker_a" in obj or "speaker_b" in obj:
        return True
    return any(isinstance(k, str) and k.startswith("session_") and _SESSION_KEY.fullmatch(k) for k in obj)


def _item_kind(item: object) -> str:
    """What a top-level list element looks like, to spot files that mix formats."""
    if not isinstance(item, dict):
        return _type_name(item)
    if "haystack_sessions" in item:
        return "a LongMemEval instance"
    if "role" in item or "content" in item:
        return "a message object"
    if "conversation" in item or _looks_locomo(item):
        return "a LoCoMo conversation"
    return "a message object"  # the message checks then say which key is missing


def _parse_list(data: list, source: str) -> list[Turn]:
    if not data:
        raise _fail(source, f"is an empty list (expected {FORMATS})")
    first = _item_kind(data[0])
    for i, item in enumerate(data):
        kind = _item_kind(item)
        if kind != first:
            raise _fail(source, f"mixes formats: item 1 is {first} but item {i + 1} is {kind} "
                        f"(expected one format per file: {FORMATS})")
    if first == "a message object":
        return _messages(data, source, lambda i: f"message {i + 1}")
    if first in ("a LongMemEval instance", "a LoCoMo conversation"):
        if len(data) > 1:
            raise _fail(source, f"holds {len(data)} {first.removeprefix('a ')}s; "
                        "split it into one file per conversation")
        return _parse_object(data[0], source)
    plural = {"null": "nulls", "a boolean": "booleans", "a number": "numbers", "a string": "strings",
              "a list": "lists"}.get(first, first)
    raise _fail(source, f"is a list of {plural}, not messages (expected {FORMATS})")


def _parse_object(data: dict, source: str) -> list[Turn]:
    markers = [name for name, present in (
        ('"messages"', "messages" in data),
        ('"haystack_sessions" (LongMemEval)', "haystack_sessions" in data),
        ('"conversation"/"session_N" (LoCoMo)', "conversation" in data or _looks_locomo(data)),
    ) if present]
    if len(markers) > 1:
        raise _fail(source, f"mixes formats: it has both {markers[0]} and {markers[1]} keys "
                    f"(expected one format per file: {FORMATS})")
    if "messages" in data:
        messages = data["messages"]
        if not isinstance(messages, list):
            raise _fail(source, f'"messages" is {_type_name(messages)} (expected a list of {{"role", '
                        '"content"} objects)')
        return _messages(messages, source, lambda i: f"message {i + 1}")
    if "haystack_sessions" in data:
        return _longmemeval(data, source)
    if "conversation" in data:
        conversation = data["conversation"]
        if not isinstance(conversation, dict):
            raise _fail(source, f'"conversation" is {_type_name(conversation)} '
                        "(expected a LoCoMo conversation object with session_N lists)")
        return _locomo(conversation, source)
    if _looks_locomo(data):
        return _locomo(data, source)
    if "role" in data or "content" in data:
        raise _fail(source, "is a single message object (expected a list of at least 2 messages, or "
                    f"{FORMATS})")
    keys = ", ".join(_quote(str(k), 20) for k in list(data)[:5])
    found = f"an object with keys {keys}{', ...' if len(data) > 5 else ''}" if data else "an empty object"
    raise _fail(source, f"is {found}, not a known history format (expected {FORMATS})")


# ----------------------------------------------------------------------------------------------------------
# The formats


def _messages(
    items: Sequence[object], source: str, label: Callable[[int], str], time: str | None = None
) -> list[Turn]:
    """OpenAI-style {"role", "content"} messages; `label(i)` names item i in errors."""
    if len(items) > MAX_TURNS:
        raise _fail(source, f"has {len(items):,} messages, over the limit of {MAX_TURNS:,} turns")
    turns = []
    for i, msg in enumerate(items):
        if not isinstance(msg, dict):
            raise _fail(source, f"{label(i)} is {_type_name(msg)} ({MESSAGE_SHAPE})")
        role = _role(msg, source, label, i)
        text = _content_text(msg.get("content"), "content" in msg, source, label, i)
        turns.append(Turn(role, text, _message_time(msg, source, label, i) or time))
    return turns


def _role(msg: dict, source: str, label: Callable[[int], str], i: int) -> str:
    if "role" not in msg:
        raise _fail(source, f'{label(i)} has no "role" ({MESSAGE_SHAPE})')
    role = msg["role"]
    if not isinstance(role, str):
        raise _fail(source, f'{label(i)} has a role that is {_type_name(role)} (expected a string '
                    'like "user")')
    role = role.strip()
    if not role:
        raise _fail(source, f'{label(i)} has an empty role (expected a string like "user")')
    return role


def _content_text(content: object, present: bool, source: str, label: Callable[[int], str], i: int) -> str:
    """A string, or the text parts of a content-parts list joined by spaces."""
    if isinstance(content, str):
        text = content.strip()
    elif isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                raise _fail(source, f"{label(i)} content part {j + 1} is {_type_name(part)} "
                            '(expected {"type": "text", "text": ...} objects)')
            if part.get("type") == "text":
                value = part.get("text")
                if not isinstance(value, str):
                    raise _fail(source, f'{label(i)} content part {j + 1} has a "text" that is '
                                f"{_type_name(value)} (expected a string)")
                parts.append(value.strip())
        text = " ".join(p for p in parts if p)
        if not text:
            raise _fail(source, f"{label(i)} has no text parts (expected at least one "
                        '{"type": "text", "text": ...} part)')
    elif not present:
        raise _fail(source, f'{label(i)} has no text: no "content" ({MESSAGE_SHAPE})')
    else:
        raise _fail(source, f'{label(i)} has no text: "content" is {_type_name(content)} '
                    "(expected a string or a list of text parts)")
    if not text:
        raise _fail(source, f"{label(i)} has no text: content is empty ({MESSAGE_SHAPE})")
    return text


def _message_time(msg: dict, source: str, label: Callable[[int], str], i: int) -> str | None:
    for key in ("time", "timestamp"):
        value = msg.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise _fail(source, f'{label(i)} has a "{key}" that is {_type_name(value)} (expected a string)')
        if value.strip():
            return value.strip()
    return None


def _locomo(conv: dict, source: str) -> list[Turn]:
    """LoCoMo: session_1..session_N lists in numeric order, each turn dated by session_N_date_time."""
    sessions: dict[int, object] = {}
    for key, value in conv.items():
        m = _SESSION_KEY.fullmatch(key) if isinstance(key, str) else None
        if m:
            sessions[int(m.group(1))] = value
    if not sessions:
        raise _fail(source, 'LoCoMo conversation has no session lists (expected "session_1": '
                    '[{"speaker", "dia_id", "text"}, ...])')
    numbers = sorted(sessions)
    for expected, n in enumerate(numbers, 1):
        if n != expected:
            raise _fail(source, f"LoCoMo conversation has session_{n} but no session_{expected} "
                        "(expected sessions numbered 1, 2, 3, ... without gaps)")
    total = sum(len(s) for s in sessions.values() if isinstance(s, list))
    if total > MAX_TURNS:
        raise _fail(source, f"has {total:,} turns, over the limit of {MAX_TURNS:,}")
    turns = []
    for n in numbers:
        session = sessions[n]
        if not isinstance(session, list):
            raise _fail(source, f"session_{n} is {_type_name(session)} (expected a list of "
                        '{"speaker", "dia_id", "text"} turns)')
        time = _locomo_date(conv, n, source)
        for j, turn in enumerate(session):
            turns.append(_locomo_turn(turn, f"session_{n} turn {j + 1}", time, source))
    return turns


def _locomo_date(conv: dict, n: int, source: str) -> str | None:
    value = conv.get(f"session_{n}_date_time")
    if value is None:
        return None
    if not isinstance(value, str):
        raise _fail(source, f"session_{n}_date_time is {_type_name(value)} (expected a string)")
    return value.strip() or None


def _locomo_turn(turn: object, where: str, time: str | None, source: str) -> Turn:
    if not isinstance(turn, dict):
        raise _fail(source, f"{where} is {_type_name(turn)} "
                    '(expected a {"speaker", "dia_id", "text"} object)')
    dia_id = turn.get("dia_id")
    if dia_id is not None and not isinstance(dia_id, str):
        raise _fail(source, f'{where} has a "dia_id" that is {_type_name(dia_id)} '
                    '(expected a string like "D1:3")')
    if dia_id:
        where = f"{where} ({_quote(dia_id, 20)})"
    speaker = turn.get("speaker")
    if not isinstance(speaker, str) or not speaker.strip():
        what = "no" if speaker is None else ("an empty" if isinstance(speaker, str) else _type_name(speaker))
        raise _fail(source, f'{where} has {what} "speaker" (expected a speaker name string)')
    text = turn.get("text")
    if not isinstance(text, str) or not text.strip():
        what = "no text" if text is None or isinstance(text, str) else f'a "text" that is {_type_name(text)}'
        raise _fail(source, f'{where} has {what} (expected a non-empty "text" string)')
    return Turn(speaker.strip(), text.strip(), time, dia_id or None)


def _longmemeval(inst: dict, source: str) -> list[Turn]:
    """LongMemEval: haystack_sessions in order, session i dated by haystack_dates[i] when given."""
    sessions = inst["haystack_sessions"]
    if not isinstance(sessions, list):
        raise _fail(source, f'"haystack_sessions" is {_type_name(sessions)} (expected a list of sessions, '
                    'each a list of {"role", "content"} messages)')
    dates = inst.get("haystack_dates")
    if dates is not None:
        if not isinstance(dates, list):
            raise _fail(source, f'"haystack_dates" is {_type_name(dates)} (expected a list of date strings)')
        if len(dates) != len(sessions):
            raise _fail(source, f'"haystack_dates" has {len(dates)} entries but "haystack_sessions" has '
                        f"{len(sessions)} (expected one date per session)")
    total = sum(len(s) for s in sessions if isinstance(s, list))
    if total > MAX_TURNS:
        raise _fail(source, f"has {total:,} turns, over the limit of {MAX_TURNS:,}")
    turns: list[Turn] = []
    for k, session in enumerate(sessions):
        if not isinstance(session, list):
            raise _fail(source, f"haystack_sessions[{k}] is {_type_name(session)} (expected a list of "
                        '{"role", "content"} messages)')
        date = None
        if dates is not None:
            date = dates[k]
            if date is not None and not isinstance(date, str):
                raise _fail(source, f"haystack_dates[{k}] is {_type_name(date)} (expected a string)")
            date = date.strip() or None if isinstance(date, str) else None
        label = _session_label(k)
        turns.extend(_messages(session, source, label, date))
    return turns


def _session_label(k: int) -> Callable[[int], str]:
    return lambda i: f"haystack_sessions[{k}] message {i + 1}"


# ----------------------------------------------------------------------------------------------------------
# Rendering


def format_turns(turns: Sequence[Turn]) -> list[str]:
    """One "role: text" string per turn; a "[time]" line opens each new time so dates reach the model."""
    lines = []
    previous: str | None = None
    for turn in turns:
        line = f"{turn.role}: {turn.text.strip()}"
        if turn.time is not None and turn.time != previous:
            line = f"[{turn.time}]\n{line}"
        previous = turn.time
        lines.append(line)
    return lines
