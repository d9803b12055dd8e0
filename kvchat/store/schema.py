"""The SQLite index's tables and how an existing `kvchat.db` is brought up to date.

Kept apart from the store so that a schema change is one function appended to `MIGRATIONS`, and an old
home opened by a new kvchat is upgraded in place while a newer one is refused, not misread.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import sqlite_utils

from kvchat.errors import UserError


def utc_timestamp() -> str:
    """The value of every `*_at` column: ISO 8601 UTC, microseconds, so rows written in order sort in order."""
    return datetime.now(UTC).isoformat(timespec="microseconds")


def _migration_1(db: sqlite_utils.Database) -> None:
    """The initial schema."""
    db["conversations"].create(
        {
            "name": str, "created_at": str, "model": str, "fingerprint": str,
            "settings": str, "stats": str, "ingest_id": str,
        },
        pk="name",
        not_null={"created_at", "model", "fingerprint", "settings", "stats", "ingest_id"},
    )  # fmt: skip
    db["episodes"].create(
        {
            "conversation": str, "idx": int, "centroid": str, "medoid_text": str, "budgets": str,
            "n_tokens": int, "bytes": int, "sha256": str, "path": str,
        },
        pk=("conversation", "idx"),
        foreign_keys=[("conversation", "conversations", "name")],
        not_null={"centroid", "medoid_text", "budgets", "n_tokens", "bytes", "sha256", "path"},
    )  # fmt: skip
    db["asks"].create(
        {
            "id": int, "created_at": str, "conversation": str, "episode": int,
            "question": str, "answer": str, "similarity": float, "timings": str,
        },
        pk="id",
    )  # fmt: skip


def _migration_2(db: sqlite_utils.Database) -> None:
    """An episode's pages file (`--offload icecache`): its path, size and sha256; NULL when it has none."""
    for column, kind in (("pages_path", str), ("pages_bytes", int), ("pages_sha256", str)):
        db["episodes"].add_column(column, kind)


# Append only: (version, fn). Each runs once per database, in order, inside the write lock.
MIGRATIONS: list[tuple[int, Callable[[sqlite_utils.Database], None]]] = [
    (1, _migration_1),
    (2, _migration_2),
]


def migrate(db: sqlite_utils.Database, db_path: Path) -> None:
    """Apply the migrations `db` lacks, in order. Call inside the write lock, so that two processes
    opening a new home at once do not both apply one. A database with versions this kvchat does not
    know was written by a newer one: refused (`db_path` names it)."""
    db["migrations"].create({"version": int, "applied_at": str}, pk="version", if_not_exists=True)
    applied = {row["version"] for row in db["migrations"].rows}
    known = {version for version, _ in MIGRATIONS}
    if applied - known:
        raise UserError(f"{db_path} was written by a newer kvchat (schema version {max(applied)}); upgrade kvchat")
    for version, fn in sorted(MIGRATIONS, key=lambda m: m[0]):
        if version not in applied:
            fn(db)
            db["migrations"].insert({"version": version, "applied_at": utc_timestamp()})
