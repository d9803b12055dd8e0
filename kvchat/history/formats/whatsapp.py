"""WhatsApp's exported chats ("Export chat" on Android and iOS), which kvchat reads as transcripts: what is the app's
rather than a person's, and its dates written in the phone's locale turned into ISO dates.

    08/05/2023, 13:56 - Dana: hi                 (Android)
    5/8/23, 1:56 PM - Dana: hi                   (Android, a US phone)
    [08/05/2023, 13:56:01] Dana: hi              (iOS)

The app's lines: its notices without a speaker ("Messages and calls are end-to-end encrypted", "Dana added Bob") are
left out by the transcript reader; here, a message that is a placeholder ("<Media omitted>", "This message was
deleted", iOS's "image omitted" or "<attached: ...>", which iOS opens with an invisible U+200E) is left out, and an
edit mark ("<This message was edited>") dropped from the text it ends.

Day or month first: a file does not say. A date whose first field is over 12 decides day first for the whole file,
one whose second is over 12 month first; a file where no date decides (every day of it the 12th or before) is read
month first when all its times have AM/PM (a US phone's) and day first otherwise; a file where both happen is not a
WhatsApp export and its times are kept as written.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_DATE_TIME = re.compile(
    r"(?P<a>\d{1,4})[./-](?P<b>\d{1,2})[./-](?P<c>\d{1,4}),?\s+(?P<hour>\d{1,2})[:.](?P<minute>\d{2})"
    r"(?:[:.](?P<second>\d{2}))?\s?(?:(?P<half>[AaPp])\.?\s?[Mm]\.?)?"
)
LRM = "\u200e"  # iOS opens its notices and attachments with it
_PLACEHOLDERS = {
    "<media omitted>", "this message was deleted", "you deleted this message", "missed voice call",
    "missed video call", "waiting for this message. this may take a while.",
    "image omitted", "video omitted", "audio omitted", "sticker omitted", "gif omitted", "document omitted",
    "contact card omitted", "<view once voice message omitted>",
}  # fmt: skip
_ATTACHED = re.compile(r"<attached: [^>\n]*>")
_EDITED = re.compile(r"\s*<This message was edited>\s*$")


def is_whatsapp(stamps: Sequence[str]) -> bool:
    """Whether a transcript's timestamps are WhatsApp's: every one a date, a comma and a time."""
    return bool(stamps) and all(_DATE_TIME.fullmatch(s) and "," in s for s in stamps)


def message_text(text: str) -> str | None:
    """A message's text without WhatsApp's edit mark; None for a placeholder of media, a deleted message or a call,
    and for iOS's notices (they open with U+200E)."""
    if text.startswith(LRM):
        return None
    text = _EDITED.sub("", text)
    if text.strip().lower() in _PLACEHOLDERS or _ATTACHED.fullmatch(text.strip()):
        return None
    return text


def day_first(stamps: Sequence[str]) -> bool | None:
    """Whether the file's dates are day first (True), month first (False), or mixed (None): see the module."""
    days = months = False
    half = True
    for stamp in stamps:
        m = _DATE_TIME.fullmatch(stamp)
        if m is None or len(m["a"]) == 4:  # year first: ISO's order already
            continue
        days |= int(m["a"]) > 12
        months |= int(m["b"]) > 12
        half &= m["half"] is not None
    if days and months:
        return None
    return days or not (months or half)


def iso_time(stamp: str, day_is_first: bool) -> str | None:
    """`stamp` as "YYYY-MM-DD HH:MM[:SS]", or None when it is not a valid date and time in that order."""
    m = _DATE_TIME.fullmatch(stamp)
    if m is None:
        return None
    a, b, c = m["a"], m["b"], m["c"]
    if len(a) == 4:
        year, month, day = int(a), int(b), int(c)
    else:
        day, month = (int(a), int(b)) if day_is_first else (int(b), int(a))
        year = int(c) + (2000 if len(c) <= 2 else 0)
    hour, minute = int(m["hour"]), int(m["minute"])
    if m["half"] is not None:
        if not 1 <= hour <= 12:
            return None
        hour = hour % 12 + (12 if m["half"] in "Pp" else 0)
    if not (1 <= month <= 12 and 1 <= day <= _days_in(month, year) and hour < 24 and minute < 60):
        return None
    second = f":{int(m['second']):02d}" if m["second"] is not None else ""
    if second and int(m["second"]) >= 60:
        return None
    return f"{year:04d}-{month:02d}-{day:02d} {hour:02d}:{minute:02d}{second}"


def _days_in(month: int, year: int) -> int:
    if month == 2:
        return 29 if year % 4 == 0 and (year % 100 != 0 or year % 400 == 0) else 28
    return 30 if month in (4, 6, 9, 11) else 31
