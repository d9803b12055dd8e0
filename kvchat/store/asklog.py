"""The ask log: every question asked, its answer, the episode that answered and the timings (`kvchat logs`).
The store writes a row under its write lock; reading takes no lock."""

from __future__ import annotations

import json
from pathlib import Path

import sqlite_utils

from kvchat.store.errors import DamagedDatabase
from kvchat.store.schema import utc_timestamp

MAX_LISTED = 2**62  # the most asks read at once (SQLite integers are 64-bit)

ASK_FIELDS = ("created_at", "conversation", "episode", "question", "answer", "similarity", "timings")


def ask_row(row: dict) -> dict:
    """The row that logs one question: unknown fields refused, `created_at` filled in, `timings` (a dict) as JSON."""
    unknown = set(row) - set(ASK_FIELDS)
    if unknown:
        raise ValueError(f"log_ask: unknown fields {sorted(unknown)}; allowed: {ASK_FIELDS}")
    record = {field: row.get(field) for field in ASK_FIELDS}
    record["created_at"] = record["created_at"] or utc_timestamp()
    record["timings"] = json.dumps(record["timings"] or {}, sort_keys=True)
    return record


def read_asks(db: sqlite_utils.Database, db_path: Path, limit: int, conversation: str | None) -> list[dict]:
    """The latest `limit` asks (of `conversation`, or all), newest first, with `timings` decoded."""
    if limit <= 0:
        return []
    where, args = ("conversation = ?", [conversation]) if conversation is not None else (None, None)
    rows = db.table("asks").rows_where(where, args, order_by="id desc", limit=int(limit))
    try:
        return [{**r, "timings": json.loads(r["timings"]) if r["timings"] else {}} for r in rows]
    except ValueError:
        raise DamagedDatabase(db_path, "an ask log row does not parse") from None
