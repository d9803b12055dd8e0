"""A Slack channel from a workspace export (Workspace settings, Import/Export data): the channel's folder of per-day
files (`general/2023-05-08.json`, ...), or one day's file. Each day is a JSON list of messages:

    [{"type": "message", "user": "U024BE7LH", "text": "hi <@U0G9QF9C6>", "ts": "1683554161.000200",
      "user_profile": {"real_name": "Dana Scully", "display_name": "dana"}}, ...]

Kept: what people (and bots) wrote, in time order, with its author and its time in UTC; mentions, channel links and
links written out as text (`<@U0G9QF9C6>`: "@Sam", `<https://x.org|the page>`: "the page"). A speaker's name is
their profile's (as each message carries it), else the export's `users.json` beside the channel's folder, else
their id. Left out: Slack's notices (joins, leaves, topic and purpose changes, pins) and messages without text.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from kvchat.history.formats.common import MAX_FILE_BYTES, Turn, check_count, load_json, refuse, type_name

SHAPE = '[{"type": "message", "user", "text", "ts"}]'
MAX_DAYS = 100_000  # day files in a channel's folder
_DAY_FILE = re.compile(r"\d{4}-\d{2}-\d{2}\.json")
_SAID = (None, "thread_broadcast", "bot_message", "me_message", "file_share")  # subtypes people write
_LINK = re.compile(r"<([^<>|\n]*)(?:\|([^<>\n]*))?>")


def looks_slack(item: object) -> bool:
    """One message of a Slack day file: typed "message", with a "ts" (OpenAI messages have neither)."""
    return isinstance(item, dict) and item.get("type") == "message" and "ts" in item and "role" not in item


def is_channel_folder(path: Path) -> bool:
    """A folder holding day files (`YYYY-MM-DD.json`): a channel of a Slack export."""
    return path.is_dir() and any(_DAY_FILE.fullmatch(p.name) for p in path.iterdir())


def read_channel(folder: Path, source: str, read_text: Callable[[Path], str]) -> list[Turn]:
    """Every day file of a channel's folder, oldest first, read with `read_text` (the history reader's checks)."""
    days = sorted(p for p in folder.iterdir() if _DAY_FILE.fullmatch(p.name) and p.is_file())
    if len(days) > MAX_DAYS:
        raise refuse(source, f"is a Slack channel of {len(days):,} days, over the limit of {MAX_DAYS:,}")
    size = sum(p.stat().st_size for p in days)
    if size > MAX_FILE_BYTES:
        raise refuse(source, f"is a Slack channel of {size:,} bytes, over the {MAX_FILE_BYTES:,}-byte limit")
    messages: list[object] = []
    for day in days:
        value = _json(read_text(day), f"{source}/{day.name}")
        if not isinstance(value, list):
            raise refuse(source, f"Slack day file {day.name} is {type_name(value)} (expected {SHAPE})")
        messages.extend(value)
    return parse_slack(messages, source, users_beside(folder))


def users_beside(channel: Path) -> dict[str, str]:
    """The names the export's `users.json` (in the folder above the channel's) gives user ids; none when it is not
    there or does not read (each message's own profile usually names its author)."""
    path = channel.absolute().parent / "users.json"
    try:
        if path.stat().st_size > MAX_FILE_BYTES // 8:
            return {}
        users = load_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}
    names = {}
    for user in users if isinstance(users, list) else []:
        if isinstance(user, dict) and isinstance(user.get("id"), str):
            name = _profile_name(user.get("profile")) or user.get("real_name") or user.get("name")
            if isinstance(name, str) and name.strip():
                names[user["id"]] = name.strip()
    return names


def parse_slack(messages: list, source: str, users: dict[str, str] | None = None) -> list[Turn]:
    check_count(len(messages), "messages", source)
    users = dict(users or {})
    for message in messages:  # a message's own profile names its author everywhere, mentions included
        if isinstance(message, dict) and isinstance(message.get("user"), str):
            name = _profile_name(message.get("user_profile"))
            if name:
                users.setdefault(message["user"], name)
    said = []
    for i, message in enumerate(messages):
        label = f"Slack message {i + 1}"
        if not isinstance(message, dict):
            raise refuse(source, f"{label} is {type_name(message)} (expected {SHAPE})")
        if message.get("type") != "message" or message.get("subtype") not in _SAID:
            continue  # a join, a leave, a topic, a pin: Slack's notices
        text = message.get("text", "")
        if not isinstance(text, str):
            raise refuse(source, f'{label} has a "text" that is {type_name(text)} (expected a string)')
        text = _plain(text, users).strip()
        if text:
            said.append((_seconds(message.get("ts"), source, label), i, _speaker(message, users), text))
    said.sort(key=lambda m: (m[0], m[1]))
    return [Turn(speaker, text, datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M UTC"))
            for ts, _, speaker, text in said]


def _json(text: str, source: str) -> object:
    try:
        return load_json(text)
    except RecursionError:
        raise refuse(source, "is nested too deeply to be a Slack day file") from None
    except ValueError as exc:
        raise refuse(source, f"is not valid JSON ({str(exc).split(':')[0]})") from None


def _profile_name(profile: object) -> str | None:
    if not isinstance(profile, dict):
        return None
    for key in ("real_name", "display_name", "name"):
        value = profile.get(key)
        if isinstance(value, str) and value.strip():
            return value.strip()
    return None


def _speaker(message: dict, users: dict[str, str]) -> str:
    user = message.get("user")
    if isinstance(user, str) and user in users:
        return users[user]
    bot = _profile_name(message.get("bot_profile")) or message.get("username")
    if isinstance(bot, str) and bot.strip():
        return bot.strip()
    return user if isinstance(user, str) and user.strip() else "unknown"


def _seconds(ts: object, source: str, label: str) -> float:
    try:
        seconds = float(ts) if isinstance(ts, str | int | float) and not isinstance(ts, bool) else None
    except ValueError:
        seconds = None
    if seconds is None or not 0 <= seconds < 1e11:
        raise refuse(source, f'{label} has a "ts" that is not Slack\'s seconds since 1970 (expected a string like '
                     '"1683554161.000200")')
    return seconds


def _plain(text: str, users: dict[str, str]) -> str:
    """Slack's markup as text: `<@U1>` "@Name", `<#C1|general>` "#general", `<!here>` "@here", `<url|label>` its
    label, `<url>` the url; `&amp;`, `&lt;` and `&gt;` unescaped."""

    def written(m: re.Match[str]) -> str:
        target, label = m.group(1), m.group(2)
        if target.startswith("@"):
            return "@" + (label or users.get(target[1:], target[1:]))
        if target.startswith("#"):
            return "#" + (label or target[1:])
        if target.startswith("!"):
            return "@" + (label or target[1:].split("^")[0])
        return label or target

    return _LINK.sub(written, text).replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")
