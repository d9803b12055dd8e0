"""LoCoMo: one conversation of session_1..session_N lists of {"speaker", "dia_id", "text"} turns.

Sessions are read in numeric order (session_10 after session_9, whatever the key order), each turn dated by
its session's session_N_date_time and identified by its dia_id, so answers can cite "D3:7".
"""

from __future__ import annotations

import dataclasses
import re

from kvchat.history.formats.common import Pick, Turn, check_count, choose, quote, refuse, type_name

_SESSION_KEY = re.compile(r"session_([1-9][0-9]{0,8})")


def looks_locomo(obj: dict) -> bool:
    if "speaker_a" in obj or "speaker_b" in obj:
        return True
    return any(isinstance(k, str) and k.startswith("session_") and _SESSION_KEY.fullmatch(k) for k in obj)


def parse_locomo_samples(data: list, source: str, pick: Pick) -> list[Turn]:
    """The picked samples of a file holding several (the official `locomo10.json`), chosen by number or
    `sample_id`; with more than one, each turn carries its sample's id as its conversation's title."""
    titles = [item.get("sample_id") if isinstance(item.get("sample_id"), str) else None for item in data]
    chosen = choose(titles, pick, source, "LoCoMo")
    turns: list[Turn] = []
    for k in chosen:
        own = parse_locomo(data[k], source)
        if len(chosen) > 1:
            own = [dataclasses.replace(turn, conversation_title=titles[k] or f"#{k + 1}") for turn in own]
        turns.extend(own)
        check_count(len(turns), "turns", source)
    return turns


def parse_locomo(data: dict, source: str) -> list[Turn]:
    """A LoCoMo sample ({"conversation": {...}, "qa": [...]}) or its conversation object."""
    if "conversation" in data:
        conversation = data["conversation"]
        if not isinstance(conversation, dict):
            raise refuse(source, f'"conversation" is {type_name(conversation)} '
                         "(expected a LoCoMo conversation object with session_N lists)")
        return _sessions(conversation, source)
    return _sessions(data, source)


def _sessions(conv: dict, source: str) -> list[Turn]:
    sessions: dict[int, object] = {}
    for key, value in conv.items():
        m = _SESSION_KEY.fullmatch(key) if isinstance(key, str) else None
        if m:
            sessions[int(m.group(1))] = value
    if not sessions:
        raise refuse(source, 'LoCoMo conversation has no session lists (expected "session_1": '
                     '[{"speaker", "dia_id", "text"}, ...])')
    numbers = sorted(sessions)
    for expected, n in enumerate(numbers, 1):
        if n != expected:
            raise refuse(source, f"LoCoMo conversation has session_{n} but no session_{expected} "
                         "(expected sessions numbered 1, 2, 3, ... without gaps)")
    check_count(sum(len(s) for s in sessions.values() if isinstance(s, list)), "turns", source)
    turns = []
    for n in numbers:
        session = sessions[n]
        if not isinstance(session, list):
            raise refuse(source, f"session_{n} is {type_name(session)} (expected a list of "
                         '{"speaker", "dia_id", "text"} turns)')
        time = _date(conv, n, source)
        for j, turn in enumerate(session):
            turns.append(_turn(turn, f"session_{n} turn {j + 1}", time, source))
    return turns


def _date(conv: dict, n: int, source: str) -> str | None:
    value = conv.get(f"session_{n}_date_time")
    if value is None:
        return None
    if not isinstance(value, str):
        raise refuse(source, f"session_{n}_date_time is {type_name(value)} (expected a string)")
    return value.strip() or None


def _turn(turn: object, where: str, time: str | None, source: str) -> Turn:
    if not isinstance(turn, dict):
        raise refuse(source, f"{where} is {type_name(turn)} (expected a {{\"speaker\", \"dia_id\", \"text\"}} object)")
    dia_id = turn.get("dia_id")
    if dia_id is not None and not isinstance(dia_id, str):
        raise refuse(source, f'{where} has a "dia_id" that is {type_name(dia_id)} (expected a string like "D1:3")')
    if dia_id:
        where = f"{where} ({quote(dia_id, 20)})"
    speaker = turn.get("speaker")
    if not isinstance(speaker, str) or not speaker.strip():
        what = "no" if speaker is None else ("an empty" if isinstance(speaker, str) else type_name(speaker))
        raise refuse(source, f'{where} has {what} "speaker" (expected a speaker name string)')
    text = turn.get("text")
    if not isinstance(text, str) or not text.strip():
        what = "no text" if text is None or isinstance(text, str) else f'a "text" that is {type_name(text)}'
        raise refuse(source, f'{where} has {what} (expected a non-empty "text" string)')
    return Turn(speaker.strip(), text.strip(), time, dia_id or None)
