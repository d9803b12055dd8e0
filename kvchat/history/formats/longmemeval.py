"""LongMemEval: one instance's haystack_sessions, each a list of OpenAI messages, dated by haystack_dates."""

from __future__ import annotations

from kvchat.history.formats.common import Turn, check_count, refuse, type_name
from kvchat.history.formats.openai import Label, parse_messages


def parse_longmemeval(inst: dict, source: str) -> list[Turn]:
    """Sessions in order, session i dated by haystack_dates[i] when given."""
    sessions = inst["haystack_sessions"]
    if not isinstance(sessions, list):
        raise refuse(source, f'"haystack_sessions" is {type_name(sessions)} (expected a list of sessions, '
                     'each a list of {"role", "content"} messages)')
    dates = inst.get("haystack_dates")
    if dates is not None:
        if not isinstance(dates, list):
            raise refuse(source, f'"haystack_dates" is {type_name(dates)} (expected a list of date strings)')
        if len(dates) != len(sessions):
            raise refuse(source, f'"haystack_dates" has {len(dates)} entries but "haystack_sessions" has '
                         f"{len(sessions)} (expected one date per session)")
    check_count(sum(len(s) for s in sessions if isinstance(s, list)), "turns", source)
    turns: list[Turn] = []
    for k, session in enumerate(sessions):
        if not isinstance(session, list):
            raise refuse(source, f"haystack_sessions[{k}] is {type_name(session)} (expected a list of "
                         '{"role", "content"} messages)')
        date = None
        if dates is not None:
            date = dates[k]
            if date is not None and not isinstance(date, str):
                raise refuse(source, f"haystack_dates[{k}] is {type_name(date)} (expected a string)")
            date = date.strip() or None if isinstance(date, str) else None
        turns.extend(parse_messages(session, source, _session_label(k), date))
    return turns


def _session_label(k: int) -> Label:
    return lambda i: f"haystack_sessions[{k}] message {i + 1}"
