"""The histories people have (issue 45, item 7): Telegram, Slack, Discord and markdown chat logs, WhatsApp chats read
well (the app's lines left out, dates in ISO with the day/month order the file shows), fine-tune JSONL without its
system prompts, and turns of several conversations named for receipts. Each sample under tests/data/good is made
like the real export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvchat.errors import UserError
from kvchat.history.formats.common import EXAMPLES
from kvchat.history.formats.whatsapp import day_first, iso_time
from kvchat.history.loading import FORMAT_NAMES, load_history
from kvchat.history.reexport import already_stored
from kvchat.history.spans import span_of

GOOD = Path(__file__).parent / "data" / "good"
DOOR = "The door code for the cabin is 4821."


def _said(path: Path, **options) -> list[tuple[str, str, str | None]]:
    return [(t.role, t.text, t.time) for t in load_history(path, **options)]


def _refusal(exc: pytest.ExceptionInfo[UserError], fragment: str) -> None:
    text = str(exc.value)
    assert text.splitlines() == [text] and fragment in text, text
    assert "Telegram" in text and "markdown chat log" in text and EXAMPLES in text  # it names what kvchat reads


# ---------------------------------------------------------------------------------------------------------
# Telegram


def test_telegram_chat_keeps_what_people_wrote() -> None:
    assert _said(GOOD / "telegram_chat.json") == [
        ("Dana", DOOR, "2023-05-08 13:56:01"),
        ("Sam Park", "Got it. Directions are on https://maps.example.org/cabin, right?", "2023-05-08 13:58:12"),
        ("Dana", "Yes. Park behind the barn.", "2023-05-08 14:01:09"),  # bold entity and plain text joined
    ]  # the call (a service message) and the photo without a caption are left out


def test_telegram_account_export_picks_chats_and_names_them_in_receipts() -> None:
    path = GOOD / "telegram_export.json"
    with pytest.raises(UserError, match="holds 2 Telegram conversations"):
        load_history(path)
    assert [t.text for t in load_history(path, pick="dana")] == [DOOR, "Thanks!"]
    every = load_history(path, pick="all")
    assert [t.turn_id for t in every] == ["Book club, turn 1", "Book club, turn 2", "Dana, turn 1", "Dana, turn 2"]
    assert every[1].role == "Deleted Account"  # "from": null


def test_telegram_refusals_name_the_format(tmp_path: Path) -> None:
    chat = json.loads((GOOD / "telegram_chat.json").read_text())
    chat["messages"][1]["text"] = 4821
    path = tmp_path / "result.json"
    path.write_text(json.dumps(chat))
    with pytest.raises(UserError) as exc:
        load_history(path)
    _refusal(exc, 'Telegram message 2 has a "text" that is a number')


# ---------------------------------------------------------------------------------------------------------
# Slack


def test_slack_channel_folder_reads_every_day_with_names_and_links() -> None:
    assert _said(GOOD / "slack_export" / "cabin-trip") == [
        ("Dana Reyes", f"{DOOR} @Sam Park can you bring the key & the map?", "2023-05-08 13:56 UTC"),
        ("Sam Park", "Sure. Directions: the cabin on the map", "2023-05-09 09:00 UTC"),
        ("Dana Reyes", "Park behind the barn.", "2023-05-09 09:01 UTC"),  # a thread's reply, in time order
    ]  # the join, the purpose and the file without text are left out


def test_slack_day_file_alone_names_users_from_the_export(tmp_path: Path) -> None:
    day = GOOD / "slack_export" / "cabin-trip" / "2023-05-09.json"
    assert [t.role for t in load_history(day)] == ["Sam Park", "Dana Reyes"]  # users.json beside the channel
    alone = tmp_path / "2023-05-09.json"
    alone.write_text(day.read_text())
    assert [t.role for t in load_history(alone)] == ["U02SAM", "U01DANA"]  # no users.json: their ids


def test_slack_refusals_name_the_format(tmp_path: Path) -> None:
    messages = json.loads((GOOD / "slack_export" / "cabin-trip" / "2023-05-09.json").read_text())
    messages[0]["ts"] = "yesterday"
    path = tmp_path / "2023-05-09.json"
    path.write_text(json.dumps(messages))
    with pytest.raises(UserError) as exc:
        load_history(path)
    _refusal(exc, "Slack message 1 has a \"ts\" that is not Slack's seconds since 1970")


# ---------------------------------------------------------------------------------------------------------
# Discord


def test_discord_export_keeps_messages_people_wrote_in_utc() -> None:
    assert _said(GOOD / "discord.json") == [
        ("Dana", DOOR, "2023-05-08 13:56 UTC"),  # 15:56 at +02:00; the server nickname, not the user name
        ("sampark", "Got it. Where do we park?", "2023-05-08 13:58 UTC"),  # a reply; no nickname: the name
        ("Dana", "Behind the barn, next to the red tractor.", "2023-05-08 14:01 UTC"),
    ]  # the join, the pin notice and the attachment alone are left out


def test_discord_refusals_name_the_format(tmp_path: Path) -> None:
    export = json.loads((GOOD / "discord.json").read_text())
    export["messages"][1]["timestamp"] = "last Tuesday"
    path = tmp_path / "cabin.json"
    path.write_text(json.dumps(export))
    with pytest.raises(UserError) as exc:
        load_history(path)
    _refusal(exc, 'Discord message 2 has a timestamp "last Tuesday" that is not ISO 8601')


# ---------------------------------------------------------------------------------------------------------
# Markdown


def test_markdown_bold_names_open_turns_outside_code() -> None:
    assert _said(GOOD / "markdown_bold.md") == [
        ("Dana", DOOR, None),
        ("Sam", "Got it. Where do we park?\nAnd is there firewood?", None),  # the rule after it is dropped
        ("Dana", "Behind the barn. Firewood is in the shed:\n\n```\nshed lock: **Code:** 1066\n```", None),
    ]  # the title is left out; **Code:** inside the fence opens no turn


def test_markdown_headings_name_speakers_at_their_level() -> None:
    turns = load_history(GOOD / "markdown_headings.md")
    assert [t.role for t in turns] == ["User", "Assistant", "User"]
    assert "### Steps\n\n1. Discard half." in turns[1].text  # a deeper heading is the turn's text


def test_markdown_refusals_name_the_format(tmp_path: Path) -> None:
    path = tmp_path / "log.md"
    path.write_text("## " + "a very long heading that no speaker would have as a name\n\ntext\n" * 2)
    with pytest.raises(UserError) as exc:
        load_history(path)
    _refusal(exc, "is not a markdown chat log: the heading at line 1")


# ---------------------------------------------------------------------------------------------------------
# WhatsApp


def test_whatsapp_android_drops_the_apps_lines_and_reads_us_dates_month_first() -> None:
    assert _said(GOOD / "whatsapp_android_us.txt") == [
        ("Dana", DOOR, "2023-05-08 13:57"),
        ("Sam", "Got it. Where do we park?", "2023-05-08 13:58"),  # "<Media omitted>" before it: left out
        ("Dana", "Behind the barn, next to the red tractor.", "2023-05-13 09:15"),  # 5/13: month first; edit mark
        ("Lee", "Thanks!\nSee you all on Friday.", "2023-05-13 00:05"),  # 12:05 AM
    ]  # the encryption notice, "created group", "added you", "joined" and "This message was deleted" left out


def test_whatsapp_ios_drops_its_notices_and_attachments_and_reads_dates_day_first() -> None:
    assert _said(GOOD / "whatsapp_ios.txt") == [
        ("Dana", DOOR, "2023-05-08 13:57:12"),
        ("Sam", "Got it.\nWhere do we park?", "2023-05-08 13:59:02"),
        ("Dana", "Behind the barn, next to the red tractor.", "2023-05-25 09:15:00"),  # 25/05: day first
    ]


@pytest.mark.parametrize(("stamps", "expected"), [
    (["08/05/2023, 13:56", "25/05/2023, 09:00"], True),   # a first field over 12: day first
    (["5/8/23, 1:56 PM", "5/13/23, 9:15 AM"], False),     # a second field over 12: month first
    (["08/05/2023, 13:56", "09/05/2023, 08:00"], True),   # undecided, 24-hour: day first
    (["5/8/23, 1:56 PM", "5/9/23, 9:15 AM"], False),      # undecided, every time AM/PM: a US phone, month first
    (["13/05/2023, 13:56", "05/13/2023, 08:00"], None),   # both: not one phone's; kept as written
])
def test_whatsapp_day_or_month_first_is_decided_by_the_whole_file(stamps, expected) -> None:
    assert day_first(stamps) is expected


def test_whatsapp_dates_become_iso_and_impossible_ones_stay_as_written() -> None:
    assert iso_time("08.05.23, 13:56", True) == "2023-05-08 13:56"
    assert iso_time("5/8/23, 12:05\u202fAM", False) == "2023-05-08 00:05"
    assert iso_time("31/02/2023, 10:00", True) is None  # no 31 February: the reader keeps the stamp


# ---------------------------------------------------------------------------------------------------------
# Every new format: detected as forced, in the refusal's list


@pytest.mark.parametrize(("path", "format", "pick"), [
    ("telegram_chat.json", "telegram", None), ("telegram_export.json", "telegram", "all"),
    ("slack_export/cabin-trip", "slack", None), ("discord.json", "discord", None),
    ("markdown_bold.md", "markdown", None), ("markdown_headings.md", "markdown", None),
    ("whatsapp_ios.txt", "transcript", None),
])
def test_detection_agrees_with_the_forced_format(path: str, format: str, pick: str | None) -> None:
    assert format in FORMAT_NAMES
    assert load_history(GOOD / path, pick=pick) == load_history(GOOD / path, format=format, pick=pick)


# ---------------------------------------------------------------------------------------------------------
# A re-export's turns already stored


def test_a_re_export_begins_with_the_turns_already_stored() -> None:
    first = load_history(GOOD / "whatsapp_ios.txt")
    stored = [span_of(t, 0, 1, i) for i, t in enumerate(first[:2])]  # what an ingest of the first two kept
    assert already_stored(first, stored) == 2
    assert already_stored(first[2:], stored) == 0  # only new turns: nothing to skip
    assert already_stored(first, [span_of(first[1], 0, 1, 0)]) == 2  # the tail's last occurrence counts
