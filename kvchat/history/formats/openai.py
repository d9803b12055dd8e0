"""OpenAI-style messages: a list of {"role", "content"} objects, or {"messages": [...]} around one.

Content is a string or a list of parts of which the text parts count; a message's "time" or "timestamp"
string, when given, becomes its turn's time. The other message formats (JSONL, fine-tune JSONL, LongMemEval
sessions) are made of these messages and read them here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvchat.history.formats.common import MESSAGE_SHAPE, Turn, check_count, refuse, type_name

Label = Callable[[int], str]


def parse_wrapper(data: dict, source: str) -> list[Turn]:
    """{"messages": [...]}: the shape of one fine-tune example and of many API logs."""
    messages = data["messages"]
    if not isinstance(messages, list):
        raise refuse(source, f'"messages" is {type_name(messages)} (expected a list of {{"role", '
                     '"content"} objects)')
    return parse_messages(messages, source, lambda i: f"message {i + 1}")


def parse_messages(items: Sequence[object], source: str, label: Label, time: str | None = None,
                   conversation_title: str | None = None) -> list[Turn]:
    """{"role", "content"} messages; `label(i)` names item i in errors, `time` dates messages that have none."""
    check_count(len(items), "messages", source)
    turns = []
    for i, msg in enumerate(items):
        if not isinstance(msg, dict):
            raise refuse(source, f"{label(i)} is {type_name(msg)} ({MESSAGE_SHAPE})")
        role = _role(msg, source, label(i))
        text = _content_text(msg.get("content"), "content" in msg, source, label(i))
        turns.append(Turn(role, text, _message_time(msg, source, label(i)) or time,
                          conversation_title=conversation_title))
    return turns


def _role(msg: dict, source: str, where: str) -> str:
    if "role" not in msg:
        raise refuse(source, f'{where} has no "role" ({MESSAGE_SHAPE})')
    role = msg["role"]
    if not isinstance(role, str):
        raise refuse(source, f'{where} has a role that is {type_name(role)} (expected a string like "user")')
    role = role.strip()
    if not role:
        raise refuse(source, f'{where} has an empty role (expected a string like "user")')
    return role


def _content_text(content: object, present: bool, source: str, where: str) -> str:
    """A string, or the text parts of a content-parts list joined by spaces."""
    if isinstance(content, str):
        text = content.strip()
    elif isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                raise refuse(source, f"{where} content part {j + 1} is {type_name(part)} "
                             '(expected {"type": "text", "text": ...} objects)')
            if part.get("type") == "text":
                value = part.get("text")
                if not isinstance(value, str):
                    raise refuse(source, f'{where} content part {j + 1} has a "text" that is '
                                 f"{type_name(value)} (expected a string)")
                parts.append(value.strip())
        text = " ".join(p for p in parts if p)
        if not text:
            raise refuse(source, f"{where} has no text parts (expected at least one "
                         '{"type": "text", "text": ...} part)')
    elif not present:
        raise refuse(source, f'{where} has no text: no "content" ({MESSAGE_SHAPE})')
    else:
        raise refuse(source, f'{where} has no text: "content" is {type_name(content)} '
                     "(expected a string or a list of text parts)")
    if not text:
        raise refuse(source, f"{where} has no text: content is empty ({MESSAGE_SHAPE})")
    return text


def _message_time(msg: dict, source: str, where: str) -> str | None:
    for key in ("time", "timestamp"):
        value = msg.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise refuse(source, f'{where} has a "{key}" that is {type_name(value)} (expected a string)')
        if value.strip():
            return value.strip()
    return None
