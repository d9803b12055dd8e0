"""The ask log: every question asked, its answer, the episode that answered and the timings (`kvchat logs`).
The store writes a row under its write lock; reading takes no lock."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TypedDict

import sqlite_utils

from kvchat.store.errors import DamagedDatabase
from kvchat.store.schema import utc_timestamp

MAX_LISTED = 2**62  # the most asks read at once (SQLite integers are 64-bit)

ASK_FIELDS = ("created_at", "conversation", "episode", "question", "answer", "similarity", "timings")


class AskEntry(TypedDict, total=False):
    """One question to log (`Store.log_ask`): any of `ASK_FIELDS`; what is left out is stored as NULL (`created_at`:
    now)."""

    created_at: str  # ISO 8601 UTC
    conversation: str
    episode: int
    question: str
    answer: str
    similarity: float
    timings: dict[str, float]  # milliseconds by step (kvchat.answer.session.Answer.timings_ms)


class LoggedAsk(TypedDict):
    """A logged question as `Store.asks` reads it back (`timings` decoded; a field never logged is None)."""

    id: int
    created_at: str
    conversation: str | None
    episode: int | None
    question: str | None
    answer: str | None
    similarity: float | None
    timings: dict[str, float]


def ask_row(row: AskEntry) -> dict:
    """The row that logs one question: unknown fields refused, `created_at` filled in, `timings` (a dict) as JSON."""
    unknown = set(row) - set(ASK_FIELDS)
    if unknown:
        raise ValueError(f"log_ask: unknown fields {sorted(unknown)}; allowed: {ASK_FIELDS}")
    record = {field: row.get(field) for field in ASK_FIELDS}
    record["created_at"] = record["created_at"] or utc_timestamp()
    record["timings"] = json.dumps(record["timings"] or {}, sort_keys=True)
    return record


def read_asks(db: sqlite_utils.Database, db_path: Path, limit: int, conversation: str | None) -> list[LoggedAsk]:
    """The latest `limit` asks (of `conversation`, or all), newest first, with `timings` decoded."""
    if limit <= 0:
        return []
    where, args = ("conversation = ?", [conversation]) if conversation is not None else (None, None)
    rows = db.table("asks").rows_where(where, args, order_by="id desc", limit=int(limit))
    try:
        return [LoggedAsk(id=r["id"], created_at=r["created_at"], conversation=r["conversation"], episode=r["episode"],
                          question=r["question"], answer=r["answer"], similarity=r["similarity"],
                          timings=json.loads(r["timings"]) if r["timings"] else {})
                for r in rows]  # fmt: skip
    except ValueError:
        raise DamagedDatabase(db_path, "an ask log row does not parse") from None
