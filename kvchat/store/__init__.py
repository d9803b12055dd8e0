"""Where ingested conversations live: a SQLite index plus one safetensors file per episode (and, for a
conversation ingested with `--offload icecache`, each episode's pages file beside it).

Nothing half-written is ever visible. An ingest writes its files and its manifest (`manifest`: the
conversation as one document) into a private temp dir (`caches/.tmp-<pid>-<uuid>`), fsyncs them, renames
the dir to `caches/<name>/<ingest_id>` and only then inserts the rows, all while holding SQLite's write
lock. Readers find conversations through the rows, so they see a conversation only once every one of its
files is complete. Each ingest gets a fresh `ingest_id`, so `--replace` never touches files a running `ask`
may be reading.

Files are checksummed and carry the model fingerprint; loading refuses anything that does not match, and
checks the safetensors header by hand before a single tensor is allocated. Rows carry the digest of their
conversation's document, so a damaged row is refused too (`DamagedDatabase`, exit 2) rather than misread.

Reading takes no lock: opening a home whose schema is current writes nothing, so `list`, `show`, `logs`,
`ask`'s reads and `doctor` never wait behind a writer. A home that cannot be written (a read-only file
system, no permission) opens read-only: it can be listed and asked, and every write is refused in one line.

This module is the store proper (open, lock, conversations, episode loading, the ask log, the doctor's
`diagnose` and `repair`); what it stands on are its submodules: `files` (fsync, verified reads, the header
check), `schema` (opening, tables and migrations), `manifest` (the conversation document and its digest),
`leftovers` (what crashes leave in caches/ and models/) and `recovery` (rebuilding a damaged kvchat.db).

The episode file format (tensor names, metadata, versions) is kvchat.kv.codec's; the store stamps the
version the codec writes on every file and refuses a version it cannot read, before decoding.
"""

from __future__ import annotations

import functools
import hashlib
import json
import mmap
import os
import re
import shlex
import shutil
import sqlite3
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import safetensors.torch
import sqlite_utils
import torch

from kvchat.errors import CacheIntegrityError, KvchatError, UserError
from kvchat.kv.codec import READABLE_FORMAT_VERSIONS, format_version  # stamped and checked here
from kvchat.kv.tensorfile import map_tensors
from kvchat.settings import rebuild_command
from kvchat.store import recovery
from kvchat.store.files import MAX_HEADER_BYTES as MAX_HEADER_BYTES  # part of this module's API
from kvchat.store.files import (
    FileMismatch,
    check_safetensors_header,
    discard,
    disk_full,
    fsync_dir,
    is_disk_full,
    new_temp_path,
    read_verified,
    try_rmdir,
    verify_file,
)
from kvchat.store.files import write_file as _write_file  # looked up here at call time: tests replace it
from kvchat.store.leftovers import (
    ORPHAN_GRACE_S,
    Problem,
    delete_leftovers,
    delete_trees,
    leftovers,
    model_leftovers,
    move_aside_orphans,
    remove_dead_temp_dirs,
    stale_orphans,
)
from kvchat.store.manifest import MANIFEST_NAME, digest, document, document_from_rows, rows_from_document
from kvchat.store.manifest import write_manifest as _write_manifest
from kvchat.store.schema import connect, migrate, pending, utc_timestamp

DB_NAME = "kvchat.db"
CACHES_DIR = "caches"
MODELS_DIR = "models"  # converted models (kvchat.llm.convert_gguf); its dead temp dirs are leftovers
BUSY_TIMEOUT_MS = 30_000

_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,99}")
# Names Windows reserves for devices, with or without an extension: not portable as directory names.
_RESERVED_RE = re.compile(r"(CON|PRN|AUX|NUL|COM[0-9]|LPT[0-9])(\..*)?", re.IGNORECASE)
_SUFFIX = ".safetensors"
_PAGES_SUFFIX = ".pages.safetensors"
_DECODE_RE = re.compile(r"Could not decode to UTF-8 column '([^']*)'")


@dataclass(frozen=True)
class PagesRecord:
    """An episode's pages file (`--offload icecache`, kvchat.kv.pagefile): what eviction dropped, paged."""

    bytes: int
    sha256: str
    path: Path  # absolute path


@dataclass(frozen=True)
class EpisodeRecord:
    index: int
    centroid: list[float]
    medoid_text: str
    budgets: list[int]  # per-layer kept-entry budget
    n_tokens: int  # cached entries (sum over layers and heads); informational
    bytes: int  # file size
    sha256: str
    path: Path  # absolute path of the safetensors file
    pages: PagesRecord | None = None  # its pages file, when the conversation offloads

    def files(self) -> list[tuple[Path, int, str, str]]:
        """(path, bytes, sha256, what) of every file of this episode."""
        out = [(self.path, self.bytes, self.sha256, "cache")]
        if self.pages is not None:
            out.append((self.pages.path, self.pages.bytes, self.pages.sha256, "pages file"))
        return out


@dataclass(frozen=True)
class ConversationRecord:
    name: str
    created_at: str  # ISO 8601 UTC
    model: str  # user-facing model spec, e.g. "default"
    fingerprint: str  # model fingerprint (opaque)
    settings: dict
    stats: dict
    episodes: list[EpisodeRecord]


class DamagedDatabase(UserError):
    """kvchat.db cannot serve as the index: unreadable, corrupt, not kvchat's, or rows that fail their
    digest. `what` says how; the message says what to run."""

    def __init__(self, db_path: Path, what: str) -> None:
        self.what = " ".join(what.split())[:200]
        super().__init__(
            f"{db_path} is damaged ({self.what}); `kvchat doctor` says what can be rebuilt from the cache files, "
            "`kvchat doctor --fix` rebuilds it (keeping the damaged file)"
        )


def _show(name: str) -> str:
    """A name quoted for a one-line message, whatever it contains."""
    return repr(name if len(name) <= 40 else name[:40] + "...")


def validate_name(name: str) -> str:
    """Names become directory names, so only a safe, portable subset is allowed."""
    if (not isinstance(name, str) or not _NAME_RE.fullmatch(name) or name.endswith(".")
            or _RESERVED_RE.fullmatch(name)):
        shown = _show(name) if isinstance(name, str) else repr(name)
        raise UserError(
            f"invalid conversation name {shown}: use 1 to 100 letters, digits, '.', '_' or '-', "
            "starting with a letter, digit or '_', not ending with '.', and not a device name (CON, NUL, ...)"
        )
    return name


def database_error(db_path: Path, e: sqlite3.Error) -> KvchatError | None:
    """What an SQLite error means for the user: a damaged index, a lock held too long, a full disk, a
    store that cannot be written or read. None: an error of ours (a bug), to be raised as it is."""
    name = getattr(e, "sqlite_errorname", None) or ""
    text = str(e)
    if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")):
        return UserError(f"{db_path} stayed locked by another kvchat process for over {BUSY_TIMEOUT_MS / 1000:g} s; "
                         "try again when it is done")  # fmt: skip
    if is_disk_full(e):
        return disk_full(db_path.parent)
    if name.startswith("SQLITE_READONLY"):
        return UserError(f"{db_path} cannot be written ({text})")
    if name.startswith("SQLITE_IOERR"):
        return UserError(f"cannot read or write {db_path}: disk I/O error")
    if name.startswith("SQLITE_CANTOPEN"):
        return UserError(f"cannot open {db_path} ({text})")
    decode = _DECODE_RE.search(text)
    if decode:
        return DamagedDatabase(db_path, f"column {decode.group(1)!r} holds text that is not UTF-8")
    if name.startswith(("SQLITE_CORRUPT", "SQLITE_NOTADB")):
        return DamagedDatabase(db_path, text)
    if text.startswith(("no such table", "no such column")):
        return DamagedDatabase(db_path, f"its tables are not kvchat's: {text}")
    return None


_F = TypeVar("_F", bound=Callable[..., Any])


def _index_errors(method: _F) -> _F:
    """SQLite errors from a method of an object with a `db_path`, as `database_error` words them."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except sqlite3.Error as e:
            meant = database_error(self.db_path, e)
            if meant is None:
                raise
            raise meant from e

    return wrapper  # type: ignore[return-value]


def read_only_reason(home: Path) -> str | None:
    """Why `home` cannot be written (a read-only file system, no permission), or None when it can.
    A home that does not exist yet is writable if it can be created (opening says otherwise if not)."""
    existing = next((p for p in (home, *home.parents) if p.exists()), None)
    if existing is None or existing != home:
        return None
    if hasattr(os, "statvfs") and os.statvfs(home).f_flag & getattr(os, "ST_RDONLY", 1):
        return "read-only file system"
    for path in (home, home / DB_NAME, home / CACHES_DIR):
        if path.exists() and not os.access(path, os.W_OK):
            return f"no permission to write {path}"
    return None


class _LockBusy(Exception):
    """The write lock is held by another process and this caller chose not to wait."""


# --------------------------------------------------------------------------- store


class Store:
    """The on-disk home of kvchat: `kvchat.db`, `caches/` and `models/`. Safe to use from several processes."""

    def __init__(self, home: Path, *, clean_stale: bool = True) -> None:
        """Open (creating if needed) the store at `home`. `clean_stale=False` leaves crash leftovers in
        place, for `check` to report them. Raises DamagedDatabase when kvchat.db cannot be read."""
        self._home = Path(home).expanduser().absolute()
        self.read_only_reason = read_only_reason(self._home)
        if self.read_only_reason is None:
            try:
                self.caches_dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise UserError(f"cannot create kvchat home {self._home}: {e.strerror or e}") from None
        elif not self.db_path.exists():
            raise UserError(f"cannot create {self.db_path}: {self._home} is read-only ({self.read_only_reason})")
        if self.db_path.exists() and not self.db_path.is_file():
            raise DamagedDatabase(self.db_path, "it is a directory or special file, not a database file")
        self._db = self._open()
        if clean_stale and not self.read_only:
            self._clean_stale()

    @_index_errors
    def _open(self) -> sqlite_utils.Database:
        db = connect(self.db_path, read_only=self.read_only, busy_timeout_ms=BUSY_TIMEOUT_MS)
        try:
            todo = pending(db, self.db_path)
            if todo and self.read_only:
                raise UserError(
                    f"{self.db_path} needs an upgrade (schema {', '.join(map(str, todo))}) that a read-only store "
                    f"cannot take ({self.read_only_reason}); open it once where it can be written"
                )
            if todo:
                self._db = db
                with self._write_lock():
                    migrate(db, self.db_path)
        except BaseException:
            db.close()
            raise
        return db

    @property
    def home(self) -> Path:
        return self._home

    @property
    def db_path(self) -> Path:
        return self._home / DB_NAME

    @property
    def caches_dir(self) -> Path:
        return self._home / CACHES_DIR

    @property
    def models_dir(self) -> Path:
        return self._home / MODELS_DIR

    @property
    def read_only(self) -> bool:
        """Whether this home cannot be written: listing and asking work, nothing is logged or changed."""
        return self.read_only_reason is not None

    def close(self) -> None:
        self._db.close()

    # ----- transactions

    @contextmanager
    def _write_lock(self, *, wait: bool = True) -> Iterator[sqlite_utils.Database]:
        """A write transaction taken up front (BEGIN IMMEDIATE), so it waits on busy_timeout; with
        `wait=False`, raises _LockBusy at once when another process holds it.

        It also serialises the file operations that must not interleave between processes:
        renaming an ingest into place, and deleting orphan or empty directories.
        """
        self.check_writable()
        if not wait:
            self._db.execute("PRAGMA busy_timeout=0")
        try:
            self._db.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as e:
            if not wait and getattr(e, "sqlite_errorname", "").startswith("SQLITE_BUSY"):
                raise _LockBusy from e
            raise
        finally:
            if not wait:
                self._db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        try:
            yield self._db
        except BaseException:
            self._db.rollback()
            raise
        try:
            self._db.conn.execute("COMMIT")
        except BaseException:
            self._db.rollback()
            raise

    def check_writable(self) -> None:
        """Raise UserError (one line) when this home cannot be written."""
        if self.read_only:
            raise UserError(
                f"{self._home} is read-only ({self.read_only_reason}): conversations can be listed and asked "
                "there, not ingested, removed, logged or repaired"
            )

    # ----- stale files

    def _clean_stale(self) -> None:
        """Remove what crashed processes left behind; never anything a live process may use.

        Temp dirs of dead ingests and model conversions go at once. Orphan ingest dirs and empty name dirs
        are looked for again, and moved aside, under the write lock, which a committing ingest holds from
        its rename to its row commit, so a dir about to be committed is never taken (see
        `kvchat.store.leftovers`); when another process holds the lock, or a row is damaged, that waits
        for a later open.
        """
        remove_dead_temp_dirs(self.models_dir)
        if not self.caches_dir.is_dir():
            return
        remove_dead_temp_dirs(self.caches_dir)
        if not stale_orphans(self.caches_dir, self._referenced_ingests()):
            return
        try:  # a damaged row may no longer name its ingest dir: never sweep on its word (doctor --fix restores it)
            self.conversations()
        except DamagedDatabase:
            return
        try:
            with self._write_lock(wait=False):
                doomed = move_aside_orphans(self.caches_dir, self._referenced_ingests())
        except _LockBusy:
            return
        delete_trees(doomed)

    @_index_errors
    def _referenced_ingests(self) -> set[str]:
        return {row["ingest_id"] for row in self._db.query("select ingest_id from conversations")}

    # ----- conversations

    @_index_errors
    def begin(self, name: str, replace: bool = False) -> PendingConversation:
        """Start writing a conversation; nothing is visible until `commit`."""
        validate_name(name)
        self.check_writable()
        if not replace and self._row(name) is not None:
            raise UserError(f"conversation {_show(name)} exists; use --replace")
        return PendingConversation(self, name, replace)

    @_index_errors
    def conversations(self) -> list[ConversationRecord]:
        """All committed conversations, newest first."""
        with self._db.atomic():  # one snapshot for both tables
            rows = list(self._db.query("select * from conversations order by created_at desc, name"))
            episodes = list(self._db.query("select * from episodes order by conversation, idx"))
        by_name: dict[str, list[dict]] = {}
        for row in episodes:
            by_name.setdefault(row["conversation"], []).append(row)
        return [self._record(row, by_name.get(row["name"], [])) for row in rows]

    @_index_errors
    def get(self, name: str) -> ConversationRecord:
        with self._db.atomic():
            row = self._row(name)
            if row is None:
                raise UserError(f"unknown conversation {_show(name)} (see `kvchat list`)")
            episodes = self._episode_rows(name)
        return self._record(row, episodes)

    @_index_errors
    def latest(self) -> ConversationRecord:
        with self._db.atomic():
            rows = list(self._db.query("select * from conversations order by created_at desc, name limit 1"))
            if not rows:
                raise UserError("no conversations yet; run `kvchat ingest HISTORY` first")
            episodes = self._episode_rows(rows[0]["name"])
        return self._record(rows[0], episodes)

    @_index_errors
    def remove(self, name: str, *, ingest_id: str | None = None) -> bool:
        """Delete the rows (one transaction), then the files, so no reader sees rows without files.

        With `ingest_id`, only that version: returns False, removing nothing, when the conversation
        was replaced or removed meanwhile.
        """
        with self._write_lock() as db:
            row = self._row(name)
            if row is None and ingest_id is None:
                raise UserError(f"unknown conversation {_show(name)} (see `kvchat list`)")
            if row is None or ingest_id not in (None, row["ingest_id"]):
                return False
            db["episodes"].delete_where("conversation = ?", [name])
            db["conversations"].delete_where("name = ?", [name])
        name_dir = self.caches_dir / name
        discard(name_dir / row["ingest_id"], self.caches_dir)
        with self._write_lock():  # an ingest of the same name may be renaming into name_dir
            try_rmdir(name_dir)
        return True

    def _row(self, name: str) -> dict[str, Any] | None:
        return next(iter(self._db["conversations"].rows_where("name = ?", [name])), None)

    def _episode_rows(self, name: str) -> list[dict[str, Any]]:
        return list(self._db["episodes"].rows_where("conversation = ?", [name], order_by="idx"))

    def _record(self, row: dict[str, Any], episode_rows: list[dict[str, Any]]) -> ConversationRecord:
        """A conversation as its rows say, once they match their digest (DamagedDatabase if not)."""
        shown = _show(str(row.get("name")))
        try:
            doc = document_from_rows(row, episode_rows)
        except (TypeError, ValueError):
            raise DamagedDatabase(self.db_path, f"conversation {shown}: a JSON column does not parse") from None
        if row.get("digest") != digest(doc):
            raise DamagedDatabase(self.db_path, f"conversation {shown}: its rows fail their checksum")
        return _record_of(doc, self._home)

    def _rebuild_hint(self, name: str, *, replace: bool) -> str:
        """The command that builds conversation `name` again, from its stored source and settings."""
        row = self._row(name)
        try:
            record = ConversationRecord(name, row["created_at"], row["model"], row["fingerprint"],
                                        json.loads(row["settings"]), {}, [])  # fmt: skip
        except (TypeError, ValueError, KeyError):  # no row, or a damaged one
            return shlex.join(["kvchat", "ingest", "HISTORY", "--name", name] + (["--replace"] if replace else []))
        return _reingest_command(record, replace=replace)

    # ----- episode files

    @_index_errors
    def load_episode(
        self, record: EpisodeRecord, fingerprint: str
    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Load one episode's tensors and metadata, refusing anything damaged or foreign.

        Checks, in order: the path is inside the store, the file exists, is a regular file (a FIFO would
        block the read forever) and has the recorded size, the sha256 matches, the safetensors header is
        sane (before any tensor is allocated), the format version is known and the model fingerprint
        matches. The bytes are read once, so the file that was checked is the file that is loaded.
        """
        name = record.path.parent.parent.name
        refuse = self._refuser(record, "cache")
        try:
            data = read_verified(record.path, record.bytes, record.sha256, within=self.caches_dir)
        except FileMismatch as e:
            raise refuse(str(e)) from None
        except OSError as e:  # no permission, an I/O error: the environment's, not the file's content
            raise UserError(
                f"cannot read the cache of conversation {_show(name)} episode {record.index} ({record.path}): "
                f"{e.strerror or e}"
            ) from None
        try:
            header = check_safetensors_header(data)
        except ValueError as e:
            raise refuse(f"is not a valid safetensors file: {e}") from None
        metadata: dict[str, str] = header.get("__metadata__", {})
        if metadata.get("format_version") not in READABLE_FORMAT_VERSIONS:
            raise refuse(f"has unsupported format version {metadata.get('format_version')!r}")
        _check_fingerprint(metadata, fingerprint, refuse)
        try:
            tensors = safetensors.torch.load(data)
        except Exception as e:  # the header passed our checks, so this is unexpected
            raise refuse(f"could not be decoded: {e}") from None
        return tensors, dict(metadata)

    @_index_errors
    def load_pages(
        self, record: EpisodeRecord, fingerprint: str
    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """An episode's pages file (kvchat.kv.pagefile) as memory-mapped tensors and its metadata.

        The same checks as `load_episode`, the file hashed in chunks rather than read into memory; then the
        header is checked on the mapped file and the tensors are views of the map: nothing is allocated,
        and keys and values are read from disk only where retrieval gathers them.
        """
        refuse = self._refuser(record, "pages file")
        pages = record.pages
        if pages is None:
            raise refuse("does not exist: the conversation was ingested without --offload")
        try:
            verify_file(pages.path, pages.bytes, pages.sha256, within=self.caches_dir)
            with open(pages.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                header = check_safetensors_header(mapped)
        except FileMismatch as e:
            raise refuse(str(e)) from None
        except ValueError as e:  # a bad header, or an empty file mmap refuses
            raise refuse(f"is not a valid safetensors file: {e}") from None
        except OSError as e:  # no permission, an I/O error: the environment's, not the file's content
            raise UserError(f"cannot read the pages file {pages.path}: {e.strerror or e}") from None
        metadata: dict[str, str] = header.get("__metadata__", {})
        _check_fingerprint(metadata, fingerprint, refuse)
        try:
            return map_tensors(pages.path, header)
        except ValueError as e:  # the header passed our checks, so this is unexpected
            raise refuse(f"could not be mapped: {e}") from None

    def _refuser(self, record: EpisodeRecord, what: str) -> Callable[[str], CacheIntegrityError]:
        """The error for a damaged file of `record`: what is wrong, and the command that rebuilds it."""
        name = record.path.parent.parent.name
        rebuild = self._rebuild_hint(name, replace=True)

        def refuse(problem: str) -> CacheIntegrityError:
            return CacheIntegrityError(
                f"{what} of conversation {_show(name)} episode {record.index} {' '.join(problem.split())}; "
                f"rebuild with `{rebuild}`"
            )

        return refuse

    # ----- doctor

    def database_damage(self) -> str | None:
        """How kvchat.db is damaged (SQLite's integrity check, rows against their digests, the ask log
        read through), or None when it is sound. Reads only: no lock."""
        try:
            result = [row[0] for row in self._db.execute("PRAGMA quick_check").fetchall()]
            if result != ["ok"]:
                return f"integrity check: {result[0]}"
            self.conversations()
            self.asks(limit=2**62)
        except DamagedDatabase as e:
            return e.what
        except sqlite3.DatabaseError as e:
            meant = database_error(self.db_path, e)
            return meant.what if isinstance(meant, DamagedDatabase) else str(e)
        return None

    @_index_errors
    def check(self) -> list[Problem]:
        """Everything wrong with the files of this home, changing nothing (`kvchat doctor`; the database
        itself is `database_damage`'s).

        Damaged conversations: an episode file missing, not a regular file, of the wrong size, or failing
        its checksum (a flipped byte, a truncation, another conversation's file swapped in). Leftovers:
        ingest dirs no row refers to, stray files, temp dirs of dead processes (ingests and model
        conversions). Takes no lock: an ingest dir younger than `ORPHAN_GRACE_S` that no row refers to yet
        may be an ingest committing right now, and is left for a later look.
        """
        problems: list[Problem] = []
        for conversation in self.conversations():
            for episode in conversation.episodes:
                for path, size, sha256, what in episode.files():
                    found = self._file_problem(path, size, sha256)
                    if found is not None:
                        kind, wrong = found
                        shown = "" if what == "cache" else f" {what}"
                        problems.append(Problem(
                            kind, conversation.name, episode.index, path,
                            f"conversation {_show(conversation.name)} episode {episode.index}{shown} {wrong}; "
                            "--fix removes the conversation",
                        ))  # fmt: skip
        if problems:  # an `rm` or `--replace` may have retired those files while we hashed them
            current = {
                (c.name, e.index, path) for c in self.conversations() for e in c.episodes for path, *_ in e.files()
            }
            problems = [p for p in problems if (p.conversation, p.episode, p.path) in current]
        return problems + self._leftovers(grace_s=ORPHAN_GRACE_S)

    @_index_errors
    def fix(self, problems: Iterable[Problem]) -> list[str]:
        """Repair what `check` found; returns one line per action taken.

        A damaged conversation is removed whole (rows first, then files): a partial conversation must
        never be visible, and its history can be ingested again (the line says how). A leftover is
        deleted only if it is still one when looked at again under the write lock.
        """
        problems = [p for p in problems if p.kind not in ("database", "lost")]  # `repair`'s to handle
        done: list[str] = []
        for name in sorted({p.conversation for p in problems if p.conversation is not None}):
            with self._db.atomic():
                row = self._row(name)
                rows = self._episode_rows(name)
                paths = {self._home / p for r in rows for p in (r["path"], r.get("pages_path")) if p}
            damaged = {p.path for p in problems if p.conversation == name}
            if row is None or not paths & damaged:
                continue  # removed, or replaced by a new version, since `check`
            command = self._rebuild_hint(name, replace=False)
            if not self.remove(name, ingest_id=row["ingest_id"]):
                continue
            done.append(
                f"removed conversation {_show(name)} (a damaged conversation is removed whole, never "
                f"kept partial); re-ingest it with `{command}`"
            )
        wanted = {p.path for p in problems if p.conversation is None}
        with self._write_lock():
            found = [p for p in self._leftovers(grace_s=0.0) if p.path in wanted]
            lines, moved = delete_leftovers(self.caches_dir, found)
        done += lines
        delete_trees(moved)
        return done

    def _file_problem(self, path: Path, size: int, sha256: str) -> tuple[str, str] | None:
        """(kind, what is wrong) for one episode file, or None if it is the file that was committed."""
        try:
            verify_file(path, size, sha256, within=self.caches_dir)
        except FileMismatch as e:
            return e.kind, str(e)
        except OSError as e:
            return "unreadable", f"cannot be read ({e.strerror or e})"
        return None

    def _leftovers(self, *, grace_s: float) -> list[Problem]:
        """What lies in caches/ that no row refers to and no live process writes, and models/' dead temp
        dirs. Exact under the write lock; without it, `grace_s` spares dirs an ingest may be committing."""
        with self._db.atomic():
            rows = list(self._db.query("select name, ingest_id from conversations"))
            live_files = {
                self._home / path
                for row in self._db.query("select path, pages_path from episodes")
                for path in (row["path"], row["pages_path"]) if path is not None
            }
        live_dirs = {self.caches_dir / row["name"] / row["ingest_id"] for row in rows}
        live_files |= {d / MANIFEST_NAME for d in live_dirs}
        found = leftovers(self.caches_dir, live_dirs, live_files, grace_s=grace_s) if self.caches_dir.is_dir() else []
        return found + model_leftovers(self.models_dir)

    # ----- ask log

    _ASK_FIELDS = ("created_at", "conversation", "episode", "question", "answer", "similarity", "timings")

    @_index_errors
    def log_ask(self, row: dict) -> None:
        """Record one question and its answer; `timings` (a dict) is stored as JSON. A read-only store
        refuses (UserError): callers check `read_only` first."""
        unknown = set(row) - set(self._ASK_FIELDS)
        if unknown:
            raise ValueError(f"log_ask: unknown fields {sorted(unknown)}; allowed: {self._ASK_FIELDS}")
        record = {field: row.get(field) for field in self._ASK_FIELDS}
        record["created_at"] = record["created_at"] or utc_timestamp()
        record["timings"] = json.dumps(record["timings"] or {}, sort_keys=True)
        with self._write_lock() as db:
            db["asks"].insert(record)

    @_index_errors
    def asks(self, limit: int = 20, conversation: str | None = None) -> list[dict]:
        """The latest `limit` asks (of `conversation`, or all), newest first, with `timings` decoded."""
        if limit <= 0:
            return []
        where, args = ("conversation = ?", [conversation]) if conversation is not None else (None, None)
        rows = self._db["asks"].rows_where(where, args, order_by="id desc", limit=int(limit))
        try:
            return [{**r, "timings": json.loads(r["timings"]) if r["timings"] else {}} for r in rows]
        except ValueError:
            raise DamagedDatabase(self.db_path, "an ask log row does not parse") from None


def _record_of(doc: dict, home: Path) -> ConversationRecord:
    """The record of a conversation document (`manifest`)."""
    return ConversationRecord(
        name=doc["name"],
        created_at=doc["created_at"],
        model=doc["model"],
        fingerprint=doc["fingerprint"],
        settings=doc["settings"],
        stats=doc["stats"],
        episodes=[
            EpisodeRecord(
                index=e["index"], centroid=e["centroid"], medoid_text=e["medoid_text"], budgets=e["budgets"],
                n_tokens=e["n_tokens"], bytes=e["bytes"], sha256=e["sha256"], path=home / e["path"],
                pages=PagesRecord(e["pages"]["bytes"], e["pages"]["sha256"], home / e["pages"]["path"])
                if e.get("pages") else None,
            )  # fmt: skip
            for e in doc["episodes"]
        ],
    )


def is_legacy_fingerprint(fingerprint: str) -> bool:
    """A model fingerprint of a kvchat before dtype and device left it (`name|w=...|torch.float32|...`): its
    weights hash cannot be compared with today's (kvchat.llm.model_fingerprint), so its caches are rebuilt."""
    return "|torch." in fingerprint


def _check_fingerprint(
    metadata: dict[str, str], fingerprint: str, refuse: Callable[[str], CacheIntegrityError]
) -> None:
    stored = str(metadata.get("fingerprint"))
    if is_legacy_fingerprint(stored) and stored != fingerprint:
        raise refuse("carries a model fingerprint of an older kvchat (one that included the dtype)")
    if stored != fingerprint:
        raise refuse(
            f"was built by a different model (cache {str(metadata.get('fingerprint'))[:24]!r}, "
            f"current {fingerprint[:24]!r})"
        )


def _episode_entry(record: EpisodeRecord, home: Path) -> dict:
    """An episode of a conversation document (`manifest.document`): paths relative to the home."""
    entry = {**asdict(record), "path": record.path.relative_to(home).as_posix(), "pages": None}
    if record.pages is not None:
        entry["pages"] = {"path": record.pages.path.relative_to(home).as_posix(), "bytes": record.pages.bytes,
                          "sha256": record.pages.sha256}  # fmt: skip
    return entry


def _reingest_command(record: ConversationRecord, *, replace: bool = False) -> str:
    """The command that builds `record` again from its history, with the settings it was built with."""
    return rebuild_command(record.name, record.model, record.settings, replace=replace)


def _insert(db: sqlite_utils.Database, doc: dict) -> None:
    """The rows of conversation document `doc`. Inside the write lock."""
    conversation, episodes = rows_from_document(doc)
    db["conversations"].insert(conversation)
    db["episodes"].insert_all(episodes)


class PendingConversation:
    """One ingest in progress: episode files in a private temp dir until `commit`.

    Use as a context manager; leaving the block without a commit (exception or not) aborts.
    """

    def __init__(self, store: Store, name: str, replace: bool) -> None:
        self._store = store
        self.name = name
        self.replace = replace
        self.ingest_id = uuid.uuid4().hex
        self._tmp = new_temp_path(store.caches_dir)
        self._tmp.mkdir()
        self._final = store.caches_dir / name / self.ingest_id
        self._episodes: dict[int, tuple[EpisodeRecord, str]] = {}
        self._state = "open"

    def __enter__(self) -> PendingConversation:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._state == "open":
            self.abort()

    def _check_open(self) -> None:
        if self._state != "open":
            raise RuntimeError(f"pending conversation {self.name!r} is already {self._state}")

    def scratch_dir(self, index: int) -> Path:
        """A private dir for episode `index`'s intermediate files (IceCache's spilled entries), inside the
        temp dir: an abort or a crash takes it along, `write_pages` removes it, and it is never committed."""
        self._check_open()
        path = self._tmp / f"scratch-{index}"
        path.mkdir(exist_ok=True)
        return path

    @contextmanager
    def disk_full_guard(self) -> Iterator[None]:
        """A full disk inside: the pending conversation is aborted at once (giving the space back) and the
        user is told in one line (exit 2). Other errors pass through."""
        try:
            yield
        except OSError as e:
            if not is_disk_full(e):
                raise
            self.abort()
            raise disk_full(self._store.caches_dir) from None

    def write_pages(self, index: int, write: Callable[[Path], tuple[int, str]]) -> PagesRecord:
        """Episode `index`'s pages file: `write(path)` writes and fsyncs it at `path` in the temp dir and
        returns (bytes, sha256). Its scratch dir is removed. Pass the record to `write_episode`."""
        self._check_open()
        path = self._tmp / f"{index}{_PAGES_SUFFIX}"
        with self.disk_full_guard():
            size, sha256 = write(path)
        shutil.rmtree(self._tmp / f"scratch-{index}", ignore_errors=True)
        return PagesRecord(int(size), str(sha256), self._final / path.name)

    def write_episode(
        self,
        index: int,
        tensors: dict[str, torch.Tensor],
        metadata: dict[str, str],
        *,
        centroid: list[float],
        medoid_text: str,
        budgets: list[int],
        n_tokens: int,
        pages: PagesRecord | None = None,
    ) -> EpisodeRecord:
        """Write and fsync one episode file. The record's `path` is where it will live once committed.

        `metadata` must hold string values (a safetensors rule) including "fingerprint";
        the store adds "format_version".
        """
        self._check_open()
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"episode index must be a non-negative int, got {index!r}")
        if index in self._episodes:
            raise ValueError(f"episode {index} was already written")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise ValueError("episode metadata keys and values must be str")
        if "fingerprint" not in metadata:
            raise ValueError("episode metadata must include the model 'fingerprint'")
        meta = {**metadata, "format_version": format_version(metadata)}
        path = self._tmp / f"{index}{_SUFFIX}"
        cpu = {key: t.detach().to("cpu").contiguous() for key, t in tensors.items()}
        data = safetensors.torch.save(cpu, metadata=meta)
        with self.disk_full_guard():
            _write_file(path, data)
        size, digest = len(data), hashlib.sha256(data).hexdigest()
        record = EpisodeRecord(
            index=index,
            centroid=[float(x) for x in centroid],
            medoid_text=str(medoid_text),
            budgets=[int(b) for b in budgets],
            n_tokens=int(n_tokens),
            bytes=size,
            sha256=digest,
            path=self._final / path.name,
            pages=pages,
        )
        self._episodes[index] = (record, metadata["fingerprint"])
        return record

    def commit(self, *, model: str, fingerprint: str, settings: dict, stats: dict) -> ConversationRecord:
        """Make the conversation visible: write its manifest, rename the files into place, then insert the rows.

        Rename and row changes happen under one SQLite write transaction, which also replaces the
        old rows of the same name when `replace`. The old ingest's files are deleted afterwards.
        """
        self._check_open()
        if not self._episodes:
            raise ValueError("commit: no episodes were written")
        foreign = sorted(i for i, (_, fp) in self._episodes.items() if fp != fingerprint)
        if foreign:
            raise ValueError(f"commit: episodes {foreign} were written with a different fingerprint")
        settings_json = json.dumps(settings, sort_keys=True)
        stats_json = json.dumps(stats, sort_keys=True)
        records = [self._episodes[i][0] for i in sorted(self._episodes)]
        store, caches, name_dir = self._store, self._store.caches_dir, self._final.parent
        created_at = utc_timestamp()
        doc = document(
            name=self.name, ingest_id=self.ingest_id, created_at=created_at, model=model, fingerprint=fingerprint,
            settings=json.loads(settings_json), stats=json.loads(stats_json),
            episodes=[_episode_entry(r, store.home) for r in records],
        )  # fmt: skip
        old_ingest: str | None = None
        renamed = False
        for scratch in self._tmp.glob("scratch-*"):  # an episode's intermediate files never become visible
            shutil.rmtree(scratch, ignore_errors=True)
        try:
            _write_manifest(self._tmp, doc)
            fsync_dir(self._tmp)
            with store._write_lock() as db:
                row = store._row(self.name)
                if row is not None and not self.replace:
                    raise UserError(f"conversation {_show(self.name)} exists; use --replace")
                old_ingest = row["ingest_id"] if row is not None else None
                name_dir.mkdir(exist_ok=True)
                os.utime(self._tmp)  # fresh mtime: the orphan sweep leaves young dirs alone
                os.rename(self._tmp, self._final)
                renamed = True
                fsync_dir(name_dir)
                fsync_dir(caches)
                db["episodes"].delete_where("conversation = ?", [self.name])
                db["conversations"].delete_where("name = ?", [self.name])
                _insert(db, doc)
        except BaseException as e:
            self._state = "aborted"
            if renamed:
                discard(self._final, caches)
            else:
                shutil.rmtree(self._tmp, ignore_errors=True)
            if is_disk_full(e):
                raise disk_full(caches) from None
            meant = database_error(store.db_path, e) if isinstance(e, sqlite3.Error) else None
            if meant is not None:
                raise meant from e
            raise
        self._state = "committed"
        if old_ingest is not None and old_ingest != self.ingest_id:
            discard(name_dir / old_ingest, caches)
        return _record_of(doc, store.home)

    def abort(self) -> None:
        """Drop everything written so far. Idempotent; a no-op after commit."""
        if self._state == "open":
            self._state = "aborted"
            shutil.rmtree(self._tmp, ignore_errors=True)


# --------------------------------------------------------------------------- doctor


def diagnose(home: Path) -> list[Problem]:
    """Everything wrong in `home`, changing nothing (`kvchat doctor`). A damaged kvchat.db is one
    "database" problem saying what a rebuild would restore, plus one "lost" problem per conversation it
    could not (with the command that builds it again); else the store's `check`."""
    home = Path(home).expanduser().absolute()
    store, damage = _open_for_doctor(home)
    if store is None:
        return _damage_problems(home, damage)
    try:
        return store.check()
    finally:
        store.close()


def repair(home: Path, problems: Iterable[Problem]) -> list[str]:
    """Repair what `diagnose` found (`kvchat doctor --fix`); one line per action taken.

    A damaged kvchat.db is moved aside, kept, and rebuilt from what survives (`recovery`); then, or
    else, the store fixes its files and leftovers (`Store.fix`).
    """
    home = Path(home).expanduser().absolute()
    problems = list(problems)
    done = _rebuild(home) if any(p.kind == "database" for p in problems) else []
    store = Store(home, clean_stale=False)
    try:
        return done + store.fix(store.check() if done else problems)
    finally:
        store.close()


def _open_for_doctor(home: Path) -> tuple[Store | None, str]:
    """The store, or None and how its kvchat.db is damaged."""
    try:
        store = Store(home, clean_stale=False)
    except DamagedDatabase as e:
        return None, e.what
    damage = store.database_damage()
    if damage is None:
        return store, ""
    store.close()
    return None, damage


def _damage_problems(home: Path, damage: str) -> list[Problem]:
    db_path = home / DB_NAME
    plan = recovery.plan_rebuild(home, db_path, home / CACHES_DIR)
    restores = ", ".join(f"{_show(r.document['name'])} (from {r.source})" for r in plan.restorable)
    problems = [Problem(
        "database", None, None, db_path,
        f"{db_path} is damaged ({damage}); --fix moves it aside (kept) and rebuilds it, restoring "
        f"{restores or 'no conversation'}; {_asks_summary(plan)}",
    )]  # fmt: skip
    problems += [
        Problem("lost", item.name, None, item.ingest_dir or home / CACHES_DIR / item.name,
                f"{item.describe()}; --fix keeps its files aside; re-ingest it with `{item.rebuild}`")
        for item in plan.lost
    ]  # fmt: skip
    return problems + model_leftovers(home / MODELS_DIR)


def _asks_summary(plan: recovery.RebuildPlan) -> str:
    if not plan.asks and not plan.asks_complete:
        return "the ask log cannot be read: it is lost"
    kept = f"{len(plan.asks)} logged question{'' if len(plan.asks) == 1 else 's'} of the ask log can be kept"
    return kept + ("" if plan.asks_complete else "; the rest cannot be read")


def _rebuild(home: Path) -> list[str]:
    """Build a new kvchat.db from what survives, then put it in the damaged one's place (moved aside)."""
    reason = read_only_reason(home)
    if reason is not None:
        raise UserError(f"{home} is read-only ({reason}): its damaged database cannot be rebuilt there")
    store, damage = _open_for_doctor(home)
    if store is not None:  # repaired since it was diagnosed
        store.close()
        return []
    db_path, caches_dir = home / DB_NAME, home / CACHES_DIR
    plan = recovery.plan_rebuild(home, db_path, caches_dir)
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
                    _insert(db, item.document)
                fields = ("id", *Store._ASK_FIELDS)
                db["asks"].insert_all({f: row.get(f) for f in fields} for row in plan.asks)
        finally:
            db.close()  # checkpoints: the new database is one file
        aside = recovery.move_aside(home, db_path, plan.lost)
        os.replace(fresh, db_path)
        fsync_dir(home)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    lines = [f"moved the damaged {db_path} ({damage}) aside to {aside / DB_NAME} (kept)"]
    lines += [f"restored conversation {_show(r.document['name'])} ({len(r.document['episodes'])} episodes) "
              f"from {r.source}" for r in plan.restorable]  # fmt: skip
    lines += [f"{item.describe()}; its files are kept in {aside}; re-ingest it with `{item.rebuild}`"
              for item in plan.lost]  # fmt: skip
    lines.append(_asks_summary(plan).replace("can be kept", "kept").replace("cannot be read", "could not be read"))
    return lines
