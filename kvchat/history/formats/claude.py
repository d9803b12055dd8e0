"""Claude's data export (conversations.json): a list of conversations, each with a flat `chat_messages` list.

A message's sender is "human" or "assistant"; its text is the text blocks of `content` when it has them (tool
use, tool results and thinking blocks are not the chat), else its `text`. Attachments' extracted text is left
out: it is the file, not the conversation. Times are the messages' created_at, to the minute, in UTC.
"""

from __future__ import annotations

from datetime import UTC, datetime

from kvchat.history.formats.common import (
    ExportShape,
    Pick,
    Turn,
    check_count,
    quote,
    read_export,
    refuse,
    type_name,
)

_ROLES = {"human": "user", "assistant": "assistant"}
_SHAPE = ExportShape("Claude", "chat_messages", "name", '{"name", "chat_messages", ...}')


def looks_claude(obj: object) -> bool:
    return isinstance(obj, dict) and _SHAPE.marker in obj


def parse_claude(data: list | dict, source: str, pick: Pick = None) -> list[Turn]:
    """The picked conversations (a list: an export; an object: one conversation), oldest first."""
    return read_export(data, source, pick, _SHAPE, _created, _conversation)


def _created(conv: dict) -> str | None:
    """ISO 8601 times sort as times once written alike."""
    return _minute(conv.get("created_at"))


def _minute(value: object) -> str | None:
    """An ISO 8601 time as "YYYY-MM-DD HH:MM UTC" (as written when it has no zone); None if it is not one."""
    if not isinstance(value, str):
        return None
    try:
        time = datetime.fromisoformat(value.strip())
    except ValueError:
        return None
    if time.tzinfo is None:
        return time.strftime("%Y-%m-%d %H:%M")
    return time.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")


def _conversation(conv: dict, where: str, title: str, source: str) -> list[Turn]:
    messages = conv.get("chat_messages")
    if not isinstance(messages, list):
        raise refuse(source, f'{where} has "chat_messages" that is {type_name(messages)} (expected a list of '
                     '{"sender", "text", "content", "created_at"} messages)')
    check_count(len(messages), "messages", source)
    turns = []
    for i, message in enumerate(messages):
        label = f"{where} message {i + 1}"
        if not isinstance(message, dict):
            raise refuse(source, f'{label} is {type_name(message)} (expected {{"sender", "text", ...}})')
        sender = message.get("sender")
        if not isinstance(sender, str) or sender not in _ROLES:
            what = "no" if sender is None else f"the sender {quote(sender, 20)}" if isinstance(sender, str) \
                else f"a sender that is {type_name(sender)}"
            raise refuse(source, f'{label} has {what} (expected "sender": "human" or "assistant")')
        text = _text(message, label, source)
        if text:  # an attachment-only message, or an answer that was only tool use
            turns.append(Turn(_ROLES[sender], text, _minute(message.get("created_at")), conversation_title=title))
    return turns


def _text(message: dict, label: str, source: str) -> str:
    content = message.get("content")
    if isinstance(content, list):
        blocks = [b.get("text") for b in content if isinstance(b, dict) and b.get("type") == "text"]
        text = "\n".join(b.strip() for b in blocks if isinstance(b, str) and b.strip())
        if text or any(isinstance(b, dict) and b.get("type") != "text" for b in content):
            return text
    raw = message.get("text")
    if raw is None:
        return ""
    if not isinstance(raw, str):
        raise refuse(source, f'{label} has a "text" that is {type_name(raw)} (expected a string)')
    return raw.strip()
