"""A damaged kvchat.db: what can be rebuilt, from where, and what is lost.

Design notes (the details and the choices made): docs/internals.md, "kvchat/store/recovery.py".
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from kvchat.messages import command, option
from kvchat.settings import rebuild_command
from kvchat.store.asklog import ASK_FIELDS
from kvchat.store.errors import BUSY_TIMEOUT_MS
from kvchat.store.files import FileMismatch, fsync_dir, hold_point, new_temp_path, rename, try_rmdir, verify_file
from kvchat.store.layout import CACHES_DIR, DB_NAME, MODELS_DIR, is_episode_file, show
from kvchat.store.leftovers import Problem, model_leftovers
from kvchat.store.manifest import digest, document_from_rows, read_manifest
from kvchat.store.records import insert_document
from kvchat.store.schema import connect, connect_read_only, migrate

REBUILD_LOCK = ".kvchat.db.rebuild-lock"
FROM_ROWS = "its rows in the damaged database"
FROM_MANIFEST = "its manifest"
ASIDE_PREFIX = "damaged-"
_DB_SUFFIXES = ("", "-wal", "-shm", "-journal")


@dataclass(frozen=True)
class Restorable:
    """A conversation the new database gets back whole: its document and where it came from."""

    document: dict
    source: str  # FROM_ROWS | FROM_MANIFEST


@dataclass(frozen=True)
class Lost:
    """A conversation that cannot be rebuilt; `ingest_dir` (None when gone too) is kept aside."""

    name: str
    ingest_dir: Path | None
    episode_files: int
    why: str
    rebuild: str  # the command that builds it again

    def describe(self) -> str:
        files = f" ({self.episode_files} episode files)" if self.episode_files else ""
        return f"conversation {self.name!r}{files} cannot be rebuilt: {self.why}"


@dataclass(frozen=True)
class RebuildPlan:
    """What a rebuild of kvchat.db restores and loses."""

    restorable: list[Restorable]
    lost: list[Lost]
    asks: list[dict]  # ask log rows that still read
    asks_complete: bool  # False: some could not be read

    def asks_line(self) -> str:
        kept = f"{len(self.asks)} logged question{'s' if len(self.asks) != 1 else ''}"
        return f"keeps {kept}" + ("" if self.asks_complete else "; the rest of the ask log cannot be read")


@dataclass
class _Salvage:
    """What still reads in the damaged database."""

    documents: dict[str, dict] = field(default_factory=dict)  # ingest_id -> verified document
    commands: dict[str, str] = field(default_factory=dict)  # name -> rebuild command, from its row's settings
    asks: list[dict] = field(default_factory=list)
    asks_complete: bool = False


def plan_rebuild(home: Path, db_path: Path, caches_dir: Path) -> RebuildPlan:
    """Look at the damaged `db_path` and every ingest dir in `caches_dir`; change nothing.

    Files are hashed (every episode of every conversation), so this takes as long as `kvchat doctor`.
    Of several ingest dirs of one name (a replaced or crashed ingest left behind), the newest that
    verifies is restored; the others stay orphans for the usual leftovers sweep.
    """
    salvage = _salvage(db_path)
    restorable: dict[str, Restorable] = {}
    unusable: dict[str, list[tuple[Path, int, str]]] = {}
    for ingest_dir in _ingest_dirs(caches_dir):
        name = ingest_dir.parent.name
        doc, source, why = salvage.documents.get(ingest_dir.name), FROM_ROWS, ""
        if doc is None or doc["name"] != name:
            doc, source, why = _manifest(ingest_dir)
        if doc is not None:
            why = _files_problem(home, caches_dir, ingest_dir, doc) or ""
            doc = None if why else doc
        if doc is None:
            unusable.setdefault(name, []).append((ingest_dir, _episode_files(ingest_dir), why))
        elif name not in restorable or doc["created_at"] > restorable[name].document["created_at"]:
            restorable[name] = Restorable(doc, source)
    lost = [
        Lost(name, ingest_dir, files, why, salvage.commands.get(name) or _generic_command(name))
        for name, dirs in sorted(unusable.items()) if name not in restorable
        for ingest_dir, files, why in dirs
    ]  # fmt: skip
    gone = sorted({doc["name"] for doc in salvage.documents.values()} - set(restorable) - set(unusable))
    lost += [Lost(name, None, 0, "its cache files are missing", salvage.commands[name]) for name in gone]
    return RebuildPlan(sorted(restorable.values(), key=lambda r: r.document["name"]), lost, salvage.asks,
                       salvage.asks_complete)  # fmt: skip


def move_aside(home: Path, db_path: Path, lost: list[Lost]) -> Path:
    """Move the lost conversations' ingest dirs, then the damaged database (with its WAL), into a new
    `home/damaged-<timestamp>/`; return it.

    Dirs first: a new database would take them for orphans and sweep them away. The database file is
    hard-linked (copied where links are not supported), so `kvchat.db` stays in place until the new one
    replaces it in one rename; its WAL and shared memory are moved, so SQLite never applies an old WAL to
    the new file. A directory in the database's place is moved whole.
    """
    aside = _new_aside_dir(home)
    for item in lost:
        if item.ingest_dir is None:
            continue
        target = aside / item.ingest_dir.parent.parent.name / item.ingest_dir.parent.name / item.ingest_dir.name
        target.parent.mkdir(parents=True, exist_ok=True)
        rename(item.ingest_dir, target)
        try_rmdir(item.ingest_dir.parent)
    if db_path.is_dir() and not db_path.is_symlink():
        rename(db_path, aside / db_path.name)
    elif db_path.exists():
        try:
            os.link(db_path, aside / db_path.name)
        except OSError:
            shutil.copy2(db_path, aside / db_path.name)
    for suffix in _DB_SUFFIXES[1:]:
        companion = Path(f"{db_path}{suffix}")
        if companion.exists():
            rename(companion, aside / companion.name)
    fsync_dir(aside)
    fsync_dir(home)
    return aside


def damage_problems(home: Path, damage: str) -> list[Problem]:
    """A damaged kvchat.db as `kvchat doctor` reports it: one "database" problem saying what a rebuild
    restores, one "lost" problem per conversation it cannot (with the command that builds it again)."""
    db_path = home / DB_NAME
    plan = plan_rebuild(home, db_path, home / CACHES_DIR)
    restores = ", ".join(f"{show(r.document['name'])} (from {r.source})" for r in plan.restorable)
    problems = [Problem(
        "database", None, None, db_path,
        f"{db_path} is damaged ({damage}); {option('fix')} moves it aside (kept) and rebuilds it, restoring "
        f"{restores or 'no conversation'}; {_asks_summary(plan)}",
    )]  # fmt: skip
    problems += [
        Problem("lost", item.name, None, item.ingest_dir or home / CACHES_DIR / item.name,
                f"{item.describe()}; {option('fix')} keeps its files aside; re-ingest it with `{item.rebuild}`")
        for item in plan.lost
    ]  # fmt: skip
    return problems + model_leftovers(home / MODELS_DIR)


def _asks_summary(plan: RebuildPlan) -> str:
    if not plan.asks and not plan.asks_complete:
        return "the ask log cannot be read: it is lost"
    kept = f"{len(plan.asks)} logged question{'' if len(plan.asks) == 1 else 's'} of the ask log can be kept"
    return kept + ("" if plan.asks_complete else "; the rest cannot be read")


@contextmanager
def one_rebuild_at_a_time(home: Path) -> Iterator[None]:
    """Hold the home's rebuild lock (an advisory lock on `REBUILD_LOCK`, kept in place: removing it would let a
    third process lock a new file while a second waits on the old one). The damaged database cannot serialise
    two `doctor --fix`, so this does: the second waits, then finds the database rebuilt. Where there is no
    `fcntl` (Windows), nothing is held."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(home / REBUILD_LOCK, "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def rebuild(home: Path, damage: str) -> list[str]:
    """Build a new kvchat.db from what survives of the damaged one (`damage` says how) and the manifests,
    then put it in the damaged one's place (moved aside, kept); one line per action."""
    db_path, caches_dir = home / DB_NAME, home / CACHES_DIR
    plan = plan_rebuild(home, db_path, caches_dir)
    hold_point("rebuild-planned")  # a test hook (tests/test_store_hardening.py): nothing in a real run
    caches_dir.mkdir(parents=True, exist_ok=True)
    building = new_temp_path(caches_dir)  # a dead rebuild's leftovers are swept like an ingest's
    building.mkdir()
    try:
        fresh = building / DB_NAME
        db = connect(fresh, read_only=False, busy_timeout_ms=BUSY_TIMEOUT_MS)
        try:
            migrate(db, fresh)
            with db.atomic():
                for item in plan.restorable:
                    insert_document(db, item.document)
                fields = ("id", *ASK_FIELDS)
                db.table("asks").insert_all({f: row.get(f) for f in fields} for row in plan.asks)
        finally:
            db.close()  # checkpoints: the new database is one file
        aside = move_aside(home, db_path, plan.lost)
        rename(fresh, db_path)
        fsync_dir(home)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    lines = [f"moved the damaged {db_path} ({damage}) aside to {aside / DB_NAME} (kept)"]
    lines += [f"restored conversation {show(r.document['name'])} ({len(r.document['episodes'])} episodes) "
              f"from {r.source}" for r in plan.restorable]  # fmt: skip
    lines += [f"{item.describe()}; its files are kept in {aside}; re-ingest it with `{item.rebuild}`"
              for item in plan.lost]  # fmt: skip
    lines.append(_asks_summary(plan).replace("can be kept", "kept").replace("cannot be read", "could not be read"))
    return lines


def _new_aside_dir(home: Path) -> Path:
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    for attempt in range(1000):
        aside = home / f"{ASIDE_PREFIX}{stamp}{f'-{attempt}' if attempt else ''}"
        try:
            aside.mkdir()
            return aside
        except FileExistsError:
            continue
    raise FileExistsError(f"{home}: too many {ASIDE_PREFIX}{stamp}* dirs")


def _salvage(db_path: Path) -> _Salvage:
    """Every row of the damaged database that still reads (decoded by hand: a byte that is not UTF-8 costs
    its row, not the table), and the conversations among them that match their digests."""
    found = _Salvage()
    if not db_path.is_file():
        return found
    try:
        conn = connect_read_only(db_path)
    except sqlite3.Error:
        return found
    conn.text_factory = bytes
    try:
        conversations, _ = _readable_rows(conn, "select * from conversations")
        episodes, _ = _readable_rows(conn, "select * from episodes order by conversation, idx")
        found.asks, found.asks_complete = _readable_rows(conn, "select * from asks order by id")
    finally:
        conn.close()
    by_name: dict[object, list[dict]] = {}  # by the rows' conversation column, whatever it holds
    for row in episodes:
        by_name.setdefault(row.get("conversation"), []).append(row)
    for row in conversations:
        try:
            doc = document_from_rows(row, by_name.get(row["name"], []))
        except (KeyError, TypeError, ValueError):
            doc = None
        command = _command_from_row(row)
        if command is not None:
            found.commands[row["name"]] = command
        # a database from before digests (schema 1) has no digest to check; its files still are checked
        if doc is not None and doc["episodes"] and row.get("digest", digest(doc)) == digest(doc):
            found.documents[doc["ingest_id"]] = doc
    return found


def _readable_rows(conn: sqlite3.Connection, sql: str) -> tuple[list[dict], bool]:
    """The rows of `sql` that read: all but those holding text that is not UTF-8, up to the first page
    SQLite cannot read; whether all could."""
    rows: list[dict] = []
    complete = True
    try:
        cursor = conn.execute(sql)
        columns = [c[0] for c in cursor.description]
        for values in cursor:
            try:
                rows.append({c: v.decode("utf-8") if isinstance(v, bytes) else v
                             for c, v in zip(columns, values, strict=True)})  # fmt: skip
            except UnicodeDecodeError:
                complete = False
    except sqlite3.DatabaseError:
        return rows, False
    return rows, complete


def _command_from_row(row: dict) -> str | None:
    try:
        return rebuild_command(row["name"], row["model"], json.loads(row["settings"]))
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def _generic_command(name: str) -> str:
    return command("ingest", "HISTORY", name=name) + " (with the settings you built it with)"


def _ingest_dirs(caches_dir: Path) -> list[Path]:
    """`caches/<name>/<ingest_id>` dirs (temp dirs and stray files are the leftovers sweep's)."""
    found = []
    for name_dir in sorted(caches_dir.iterdir()) if caches_dir.is_dir() else []:
        if name_dir.name.startswith(".") or not name_dir.is_dir() or name_dir.is_symlink():
            continue
        found += [d for d in sorted(name_dir.iterdir()) if d.is_dir() and not d.is_symlink()]
    return found


def _manifest(ingest_dir: Path) -> tuple[dict | None, str, str]:
    try:
        doc = read_manifest(ingest_dir)
    except FileNotFoundError:
        return None, "", "no row of it survives, and it has no manifest (ingested before kvchat kept one)"
    except (ValueError, FileMismatch) as e:
        return None, "", f"no row of it survives, and {e}"
    except OSError as e:
        return None, "", f"no row of it survives, and its manifest cannot be read ({e.strerror or e})"
    if doc["name"] != ingest_dir.parent.name or doc["ingest_id"] != ingest_dir.name:
        return None, "", "no row of it survives, and its manifest describes another ingest dir"
    return doc, FROM_MANIFEST, ""


def _files_problem(home: Path, caches_dir: Path, ingest_dir: Path, doc: dict) -> str | None:
    """What is wrong with the files `doc` lists (episode files, pages files, the recall entries file), or None
    when each is the file it committed."""
    files = [(f"episode {episode['index']}{what}", file) for episode in doc["episodes"]
             for what, file in [("", episode), *([(" pages file", episode["pages"])] if episode.get("pages") else [])]]
    if doc.get("recall_entries"):
        files.append(("its recall entries file", doc["recall_entries"]))
    for what, file in files:
        path = home / file["path"]
        if path.parent != ingest_dir:
            return f"{what} lies outside its ingest dir"
        try:
            verify_file(path, file["bytes"], file["sha256"], within=caches_dir)
        except FileMismatch as e:
            return f"{what} {e}"
        except OSError as e:
            return f"{what} cannot be read ({e.strerror or e})"
    return None


def _episode_files(ingest_dir: Path) -> int:
    try:
        return sum(1 for p in ingest_dir.iterdir() if is_episode_file(p.name))
    except OSError:
        return 0
