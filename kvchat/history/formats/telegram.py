"""Telegram Desktop's export (Settings, Advanced, Export Telegram data, "Machine-readable JSON"): `result.json`.

One chat's export is `{"name", "type", "id", "messages": [...]}`; a whole account's holds its chats in
`{"chats": {"list": [...]}}` (`pick` chooses them by number or name; "all" takes them oldest first). A message is
`{"id", "type": "message", "date": "2023-05-08T13:56:01", "from": "Dana", "text": ...}` whose text is a string or a
list of strings and entities (`{"type": "link", "text": "..."}`). Kept: each message's text, its sender and its
date (local time, as the export writes it). Left out: service messages (joins, pins, calls) and messages with no
text (a photo or a sticker without a caption).
"""

from __future__ import annotations

import dataclasses

from kvchat.history.formats.common import (
    Pick,
    Turn,
    check_count,
    choose,
    in_conversation,
    quote,
    refuse,
    type_name,
)

CHAT_KEYS = '{"name", "type", "messages": [{"type": "message", "from", "date", "text"}]}'
_TYPES = ("message", "service")


def looks_telegram(data: dict) -> bool:
    """A chat's export (its messages typed "message" or "service", which OpenAI messages never are), or a whole
    account's (`chats.list`)."""
    chats = data.get("chats")
    if isinstance(chats, dict) and isinstance(chats.get("list"), list):
        return True
    messages = data.get("messages")
    if not isinstance(messages, list) or "role" in data:
        return False
    first = next((m for m in messages if isinstance(m, dict)), None)
    return first is not None and first.get("type") in _TYPES and "role" not in first and "date" in first


def parse_telegram(data: dict, source: str, pick: Pick = None) -> list[Turn]:
    if "messages" in data and looks_telegram({"messages": data["messages"]}):
        chats, whole = [data], False
    else:
        chats, whole = data["chats"]["list"], True
        for k, chat in enumerate(chats):
            if not isinstance(chat, dict) or not isinstance(chat.get("messages"), list):
                what = 'has no "messages" list' if isinstance(chat, dict) else f"is {type_name(chat)}"
                raise refuse(source, f"Telegram chat {k + 1} {what} (expected {CHAT_KEYS})")
    titles = [chat.get("name") if isinstance(chat.get("name"), str) else None for chat in chats]
    chosen = choose(titles, pick, source, "Telegram") if whole else [0]
    turns: list[Turn] = []
    for k in sorted(chosen, key=lambda k: (_first_date(chats[k]["messages"]), k)):  # oldest first
        title = titles[k] or f"#{k + 1}"
        read = _chat(chats[k]["messages"], source, f"chat {k + 1} " if whole else "")
        if len(chosen) > 1:  # receipts name the chat and the message's place in it
            read = in_conversation(read, title)
        elif whole:
            read = [dataclasses.replace(t, conversation_title=title) for t in read]
        turns.extend(read)
        check_count(len(turns), "messages", source)
    return turns


def _first_date(messages: list) -> str:
    """When a chat began: its first message's date ("" for none: first)."""
    first = next((m for m in messages if isinstance(m, dict)), {})
    date = first.get("date")
    return date if isinstance(date, str) else ""


def _chat(messages: list, source: str, where: str) -> list[Turn]:
    check_count(len(messages), "messages", source)
    turns = []
    for i, message in enumerate(messages):
        label = f"{where}message {i + 1}"
        if not isinstance(message, dict):
            raise refuse(source, f"Telegram {label} is {type_name(message)} (expected {CHAT_KEYS})")
        if message.get("type") != "message":  # a service message: a join, a pin, a call
            continue
        text = _text(message.get("text"), source, label)
        if not text:  # a photo, a sticker or a voice message without a caption
            continue
        sender = message.get("from")
        speaker = sender.strip() if isinstance(sender, str) and sender.strip() else "Deleted Account"
        turns.append(Turn(speaker, text, _date(message.get("date"), source, label)))
    return turns


def _text(value: object, source: str, label: str) -> str:
    """A message's text: a string, or a list of strings and entities whose "text" is a string."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value.strip()
    if not isinstance(value, list):
        raise refuse(source, f'Telegram {label} has a "text" that is {type_name(value)} (expected a string or a list '
                     "of strings and entities)")
    parts = []
    for part in value:
        if isinstance(part, str):
            parts.append(part)
        elif isinstance(part, dict) and isinstance(part.get("text"), str):
            parts.append(part["text"])
        else:
            raise refuse(source, f"Telegram {label} has a text part that is {type_name(part)} (expected a string or "
                         '{"type", "text"})')
    return "".join(parts).strip()


def _date(value: object, source: str, label: str) -> str | None:
    """"2023-05-08T13:56:01" as "2023-05-08 13:56:01"."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise refuse(source, f'Telegram {label} has a "date" that is {type_name(value)} (expected a string like '
                     f'{quote("2023-05-08T13:56:01")})')
    return value.strip().replace("T", " ", 1) or None
