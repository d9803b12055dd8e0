"""The SQLite index: how `kvchat.db` is opened, its tables, and how an existing one is brought up to date.

Kept apart from the store so that a schema change is one function appended to `MIGRATIONS`, and an old
home opened by a new kvchat is upgraded in place while a newer one is refused, not misread. Opening a home
whose schema is current writes nothing (`pending`), so readers never wait for the write lock.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import sqlite_utils

from kvchat.errors import UserError
from kvchat.store.manifest import digest, document_from_rows


def connect(
    db_path: Path, *, read_only: bool, busy_timeout_ms: int, exclusive: bool = False
) -> sqlite_utils.Database:
    """`db_path` opened as every kvchat process opens it: WAL, a busy timeout, foreign keys. Read-only
    (a read-only file system, no write permission) writes nothing, not even the switch to WAL. `exclusive`:
    SQLite's exclusive locking mode, set before the first access, so WAL keeps its index in this process's
    memory instead of the shared-memory file beside the database (a disk too full to create it); other
    processes wait until this connection closes."""
    db = sqlite_utils.Database(connect_read_only(db_path) if read_only else sqlite3.connect(db_path))
    try:
        db.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
        if exclusive:
            db.execute("PRAGMA locking_mode=EXCLUSIVE")
        if not read_only:
            db.enable_wal()
        db.execute("PRAGMA foreign_keys=ON")
    except BaseException:
        db.close()
        raise
    return db


def connect_read_only(db_path: Path) -> sqlite3.Connection:
    """A connection that cannot write `db_path`. Where SQLite cannot create the WAL's shared-memory file
    beside it (a read-only file system), the database is opened as immutable: nothing can change it there."""
    uri = db_path.absolute().as_uri()
    conn = sqlite3.connect(f"{uri}?mode=ro", uri=True)
    try:
        conn.execute("select count(*) from sqlite_master").fetchone()
        return conn
    except sqlite3.Error as e:
        conn.close()
        if getattr(e, "sqlite_errorname", "") != "SQLITE_CANTOPEN":
            raise
    return sqlite3.connect(f"{uri}?immutable=1", uri=True)


def utc_timestamp() -> str:
    """The value of every `*_at` column: ISO 8601 UTC, microseconds, so rows written in order sort in order."""
    return datetime.now(UTC).isoformat(timespec="microseconds")


def _migration_1(db: sqlite_utils.Database) -> None:
    """The initial schema."""
    db.table("conversations").create(
        {
            "name": str, "created_at": str, "model": str, "fingerprint": str,
            "settings": str, "stats": str, "ingest_id": str,
        },
        pk="name",
        not_null={"created_at", "model", "fingerprint", "settings", "stats", "ingest_id"},
    )  # fmt: skip
    db.table("episodes").create(
        {
            "conversation": str, "idx": int, "centroid": str, "medoid_text": str, "budgets": str,
            "n_tokens": int, "bytes": int, "sha256": str, "path": str,
        },
        pk=("conversation", "idx"),
        foreign_keys=[("conversation", "conversations", "name")],
        not_null={"centroid", "medoid_text", "budgets", "n_tokens", "bytes", "sha256", "path"},
    )  # fmt: skip
    db.table("asks").create(
        {
            "id": int, "created_at": str, "conversation": str, "episode": int,
            "question": str, "answer": str, "similarity": float, "timings": str,
        },
        pk="id",
    )  # fmt: skip


def _migration_2(db: sqlite_utils.Database) -> None:
    """Each conversation row carries the digest of its rows (`kvchat.store.manifest`), so damage is found.
    Rows that no longer parse keep none, and read as damaged."""
    db.table("conversations").add_column("digest", str)
    for row in list(db.table("conversations").rows):
        episodes = list(db.table("episodes").rows_where("conversation = ?", [row["name"]], order_by="idx"))
        try:
            value = digest(document_from_rows(row, episodes))
        except ValueError:
            continue
        db.table("conversations").update(row["name"], {"digest": value})


def _migration_3(db: sqlite_utils.Database) -> None:
    """An episode's pages file (`--offload icecache`): its path, size and sha256; NULL when it has none (so
    existing rows and their digests are unchanged)."""
    for column, kind in (("pages_path", str), ("pages_bytes", int), ("pages_sha256", str)):
        db.table("episodes").add_column(column, kind)


def _migration_4(db: sqlite_utils.Database) -> None:
    """A conversation's recall entries file (`--recall-entries stored`): its path, size and sha256; NULL when it has
    none (so existing rows and their digests are unchanged)."""
    for column, kind in (("recall_entries_path", str), ("recall_entries_bytes", int), ("recall_entries_sha256", str)):
        db.table("conversations").add_column(column, kind)


# Append only: (version, fn). Each runs once per database, in order, inside the write lock.
MIGRATIONS: list[tuple[int, Callable[[sqlite_utils.Database], None]]] = [
    (1, _migration_1),
    (2, _migration_2),
    (3, _migration_3),
    (4, _migration_4),
]


def pending(db: sqlite_utils.Database, db_path: Path) -> list[int]:
    """The migrations `db` lacks (a read: no lock taken). A database with versions this kvchat does not
    know was written by a newer one: refused (`db_path` names it)."""
    if "migrations" not in db.table_names():
        return sorted(version for version, _ in MIGRATIONS)
    applied = {row["version"] for row in db.table("migrations").rows}
    known = {version for version, _ in MIGRATIONS}
    if applied - known:
        raise UserError(f"{db_path} was written by a newer kvchat (schema version {max(applied)}); upgrade kvchat")
    return sorted(known - applied)


def migrate(db: sqlite_utils.Database, db_path: Path) -> None:
    """Apply the migrations `db` lacks, in order. Call inside the write lock, so that two processes
    opening a new home at once do not both apply one."""
    db.table("migrations").create({"version": int, "applied_at": str}, pk="version", if_not_exists=True)
    applied = {row["version"] for row in db.table("migrations").rows}
    pending(db, db_path)  # refuses a newer schema
    for version, fn in sorted(MIGRATIONS, key=lambda m: m[0]):
        if version not in applied:
            fn(db)
            db.table("migrations").insert({"version": version, "applied_at": utc_timestamp()})
