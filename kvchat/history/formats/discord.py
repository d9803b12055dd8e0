"""A Discord channel exported by DiscordChatExporter as JSON (`--format Json`).

    {"guild": {...}, "channel": {"name": "general", ...}, "messages": [
      {"id": "...", "type": "Default", "timestamp": "2023-05-08T13:56:01.123+00:00", "content": "hi",
       "author": {"name": "dana", "nickname": "Dana", ...}, "attachments": [...], ...}]}

Kept: the text of every message a person wrote ("Default" and "Reply"), its author (the nickname shown in the
server, else the user name) and its time in UTC. Left out: Discord's own messages (a member joined, a message was
pinned, a call, a thread created) and messages with no text (an attachment or an embed alone).
"""

from __future__ import annotations

from datetime import UTC, datetime

from kvchat.history.formats.common import Turn, check_count, quote, refuse, type_name

SHAPE = '{"guild", "channel", "messages": [{"type", "timestamp", "content", "author": {"name"}}]}'
_SAID = ("Default", "Reply")  # the message types a person writes; the others are Discord's notices


def looks_discord(data: dict) -> bool:
    return "guild" in data and "channel" in data and "messages" in data


def parse_discord(data: dict, source: str) -> list[Turn]:
    messages = data["messages"]
    if not isinstance(messages, list):
        raise refuse(source, f'Discord export\'s "messages" is {type_name(messages)} (expected {SHAPE})')
    check_count(len(messages), "messages", source)
    turns = []
    for i, message in enumerate(messages):
        label = f"Discord message {i + 1}"
        if not isinstance(message, dict):
            raise refuse(source, f"{label} is {type_name(message)} (expected {SHAPE})")
        if message.get("type", "Default") not in _SAID:
            continue
        content = message.get("content")
        if not isinstance(content, str):
            raise refuse(source, f'{label} has a "content" that is {type_name(content)} (expected a string)')
        if not content.strip():  # an attachment, an embed or a sticker alone
            continue
        turns.append(Turn(_author(message.get("author"), source, label), content.strip(),
                          _utc(message.get("timestamp"), source, label)))
    return turns


def _author(author: object, source: str, label: str) -> str:
    if not isinstance(author, dict):
        raise refuse(source, f'{label} has an "author" that is {type_name(author)} (expected {{"name", ...}})')
    for key in ("nickname", "name"):
        value = author.get(key)
        if isinstance(value, str) and value.strip():
            return value.strip()
    raise refuse(source, f'{label} has an author without a "name" (expected {SHAPE})')


def _utc(value: object, source: str, label: str) -> str | None:
    """An ISO 8601 timestamp with its offset, as "2023-05-08 13:56 UTC"; one without an offset as written."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise refuse(source, f'{label} has a "timestamp" that is {type_name(value)} (expected a string)')
    try:
        moment = datetime.fromisoformat(value.strip())
    except ValueError:
        raise refuse(source, f"{label} has a timestamp {quote(value)} that is not ISO 8601 (expected "
                     f'{quote("2023-05-08T13:56:01+00:00")})') from None
    if moment.tzinfo is None:
        return moment.strftime("%Y-%m-%d %H:%M")
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")
