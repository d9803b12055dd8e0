"""Where ingested conversations live: a SQLite index plus one safetensors file per episode (and, for a
conversation ingested with `--offload icecache`, each episode's pages file beside it).

Nothing half-written is ever visible. An ingest writes its files into a private temp dir
(`caches/.tmp-<pid>-<uuid>`), fsyncs them, renames the dir to `caches/<name>/<ingest_id>` and only
then inserts the rows, all while holding SQLite's write lock. Readers find conversations through
the rows, so they see a conversation only once every one of its files is complete. Each ingest gets
a fresh `ingest_id`, so `--replace` never touches files a running `ask` may be reading.

Files are checksummed and carry the model fingerprint; loading refuses anything that does not
match, and checks the safetensors header by hand before a single tensor is allocated.

This module is the store proper (open, lock, conversations, episode loading, the ask log); what it
stands on are its submodules: `files` (fsync, verified reads, the header check), `schema` (tables and
migrations) and `leftovers` (what crashes leave in caches/, and `doctor`'s sweep of it).

The episode file format (tensor names, metadata, versions) is kvchat.kv.codec's; the store stamps the
version the codec writes on every file and refuses a version it cannot read, before decoding.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import shutil
import sqlite3
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import safetensors.torch
import sqlite_utils
import torch

from kvchat.errors import CacheIntegrityError, KvchatError, UserError
from kvchat.kv.codec import FORMAT_VERSION, READABLE_FORMAT_VERSIONS  # stamped and checked here
from kvchat.kv.tensorfile import map_tensors
from kvchat.settings import rebuild_command
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
    Problem,
    delete_leftovers,
    delete_trees,
    leftovers,
    move_aside_orphans,
    remove_dead_temp_dirs,
    stale_orphans,
)
from kvchat.store.schema import migrate, utc_timestamp

DB_NAME = "kvchat.db"
CACHES_DIR = "caches"
BUSY_TIMEOUT_MS = 30_000

_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,99}")
# Names Windows reserves for devices, with or without an extension: not portable as directory names.
_RESERVED_RE = re.compile(r"(CON|PRN|AUX|NUL|COM[0-9]|LPT[0-9])(\..*)?", re.IGNORECASE)
_SUFFIX = ".safetensors"
_PAGES_SUFFIX = ".pages.safetensors"


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


# --------------------------------------------------------------------------- store


class Store:
    """The on-disk home of kvchat: `kvchat.db` and `caches/`. Safe to use from several processes."""

    def __init__(self, home: Path, *, clean_stale: bool = True) -> None:
        """Open (creating if needed) the store at `home`. `clean_stale=False` leaves crash leftovers in
        place, for `check` to report them."""
        self._home = Path(home).expanduser().absolute()
        try:
            self.caches_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"cannot create kvchat home {self._home}: {e.strerror or e}") from None
        try:
            self._db = sqlite_utils.Database(self.db_path)
            self._db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            self._db.enable_wal()
            self._db.execute("PRAGMA foreign_keys=ON")
            self._migrate()
        except sqlite3.DatabaseError as e:
            raise KvchatError(f"cannot open {self.db_path}: {e}") from e
        if clean_stale:
            self._clean_stale()

    @property
    def home(self) -> Path:
        return self._home

    @property
    def db_path(self) -> Path:
        return self._home / DB_NAME

    @property
    def caches_dir(self) -> Path:
        return self._home / CACHES_DIR

    def close(self) -> None:
        self._db.close()

    # ----- transactions

    @contextmanager
    def _write_lock(self) -> Iterator[sqlite_utils.Database]:
        """A write transaction taken up front (BEGIN IMMEDIATE), so it waits on busy_timeout.

        It also serialises the file operations that must not interleave between processes:
        renaming an ingest into place, and deleting orphan or empty directories.
        """
        try:
            self._db.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as e:
            if "locked" in str(e) or "busy" in str(e):
                raise KvchatError(
                    f"{self.db_path} stayed locked by another kvchat process for over "
                    f"{BUSY_TIMEOUT_MS // 1000} s"
                ) from e
            raise
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

    def _migrate(self) -> None:
        with self._write_lock() as db:
            migrate(db, self.db_path)

    # ----- stale files

    def _clean_stale(self) -> None:
        """Remove what crashed processes left behind; never anything a live process may use.

        Temp dirs of dead ingests go at once. Orphan ingest dirs and empty name dirs are looked for again,
        and moved aside, under the write lock, which a committing ingest holds from its rename to its row
        commit, so a dir about to be committed is never taken (see `kvchat.store.leftovers`).
        """
        if not self.caches_dir.is_dir():
            return
        remove_dead_temp_dirs(self.caches_dir)
        if not stale_orphans(self.caches_dir, self._referenced_ingests()):
            return
        with self._write_lock():
            doomed = move_aside_orphans(self.caches_dir, self._referenced_ingests())
        delete_trees(doomed)

    def _referenced_ingests(self) -> set[str]:
        return {row["ingest_id"] for row in self._db.query("select ingest_id from conversations")}

    # ----- conversations

    def begin(self, name: str, replace: bool = False) -> PendingConversation:
        """Start writing a conversation; nothing is visible until `commit`."""
        validate_name(name)
        if not replace and self._row(name) is not None:
            raise UserError(f"conversation {_show(name)} exists; use --replace")
        return PendingConversation(self, name, replace)

    def conversations(self) -> list[ConversationRecord]:
        """All committed conversations, newest first."""
        with self._db.atomic():  # one snapshot for both tables
            rows = list(self._db.query("select * from conversations order by created_at desc, name"))
            episodes = list(self._db.query("select * from episodes order by conversation, idx"))
        by_name: dict[str, list[EpisodeRecord]] = {}
        for row in episodes:
            by_name.setdefault(row["conversation"], []).append(self._episode(row))
        return [self._conversation(row, by_name.get(row["name"], [])) for row in rows]

    def get(self, name: str) -> ConversationRecord:
        with self._db.atomic():
            row = self._row(name)
            if row is None:
                raise UserError(f"unknown conversation {_show(name)} (see `kvchat list`)")
            episodes = [self._episode(r) for r in self._episode_rows(name)]
        return self._conversation(row, episodes)

    def latest(self) -> ConversationRecord:
        with self._db.atomic():
            rows = list(self._db.query("select * from conversations order by created_at desc, name limit 1"))
            if not rows:
                raise UserError("no conversations yet; run `kvchat ingest HISTORY` first")
            episodes = [self._episode(r) for r in self._episode_rows(rows[0]["name"])]
        return self._conversation(rows[0], episodes)

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

    def _episode(self, row: dict[str, Any]) -> EpisodeRecord:
        return EpisodeRecord(
            index=row["idx"],
            centroid=json.loads(row["centroid"]),
            medoid_text=row["medoid_text"],
            budgets=json.loads(row["budgets"]),
            n_tokens=row["n_tokens"],
            bytes=row["bytes"],
            sha256=row["sha256"],
            path=self._home / row["path"],
            pages=None if row.get("pages_path") is None else PagesRecord(
                row["pages_bytes"], row["pages_sha256"], self._home / row["pages_path"]
            ),
        )

    @staticmethod
    def _conversation(row: dict[str, Any], episodes: list[EpisodeRecord]) -> ConversationRecord:
        return ConversationRecord(
            name=row["name"],
            created_at=row["created_at"],
            model=row["model"],
            fingerprint=row["fingerprint"],
            settings=json.loads(row["settings"]),
            stats=json.loads(row["stats"]),
            episodes=episodes,
        )

    # ----- episode files

    def load_episode(
        self, record: EpisodeRecord, fingerprint: str
    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Load one episode's tensors and metadata, refusing anything damaged or foreign.

        Checks, in order: the path is inside the store, the file exists and has the recorded size, the
        sha256 matches, the safetensors header is sane (before any tensor is allocated), the format
        version is known and the model fingerprint matches. The bytes are read once, so the
        file that was checked is the file that is loaded.
        """
        refuse = self._refuser(record, "cache")
        try:
            data = read_verified(record.path, record.bytes, record.sha256, within=self.caches_dir)
        except FileMismatch as e:
            raise refuse(str(e)) from None
        except IsADirectoryError:
            raise refuse(f"is not a file ({record.path})") from None
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
        except IsADirectoryError:
            raise refuse(f"is not a file ({pages.path})") from None
        except ValueError as e:  # a bad header, or an empty file mmap refuses
            raise refuse(f"is not a valid safetensors file: {e}") from None
        metadata: dict[str, str] = header.get("__metadata__", {})
        _check_fingerprint(metadata, fingerprint, refuse)
        try:
            return map_tensors(pages.path, header)
        except ValueError as e:  # the header passed our checks, so this is unexpected
            raise refuse(f"could not be mapped: {e}") from None

    def _refuser(self, record: EpisodeRecord, what: str) -> Callable[[str], CacheIntegrityError]:
        """The error for a damaged file of `record`: what is wrong, and the command that rebuilds it."""
        name = record.path.parent.parent.name
        row = self._row(name)
        rebuild = (
            _reingest_command(self._conversation(row, []), replace=True) if row is not None
            else f"kvchat ingest HISTORY --name {name} --replace"
        )

        def refuse(problem: str) -> CacheIntegrityError:
            return CacheIntegrityError(
                f"{what} of conversation {_show(name)} episode {record.index} {' '.join(problem.split())}; "
                f"rebuild with `{rebuild}`"
            )

        return refuse

    # ----- doctor

    def check(self) -> list[Problem]:
        """Everything wrong in this home, changing nothing (`kvchat doctor`).

        Damaged conversations: an episode file missing, of the wrong size, or failing its checksum (a
        flipped byte, a truncation, another conversation's file swapped in). Leftovers: ingest dirs no
        row refers to, stray files, temp dirs of dead processes. Files are hashed without holding the
        lock (that may take a while); leftovers are listed under it, so an ingest between its rename
        and its row commit is never mistaken for an orphan.
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
        with self._write_lock():
            problems += self._leftovers()
        return problems

    def fix(self, problems: Iterable[Problem]) -> list[str]:
        """Repair what `check` found; returns one line per action taken.

        A damaged conversation is removed whole (rows first, then files): a partial conversation must
        never be visible, and its history can be ingested again (the line says how). A leftover is
        deleted only if it is still one when looked at again under the write lock.
        """
        problems = list(problems)
        done: list[str] = []
        for name in sorted({p.conversation for p in problems if p.conversation is not None}):
            with self._db.atomic():
                row = self._row(name)
                paths = {path for r in self._episode_rows(name) for path, *_ in self._episode(r).files()}
            damaged = {p.path for p in problems if p.conversation == name}
            if row is None or not paths & damaged:
                continue  # removed, or replaced by a new version, since `check`
            record = self._conversation(row, [])
            if not self.remove(name, ingest_id=row["ingest_id"]):
                continue
            done.append(
                f"removed conversation {_show(name)} (a damaged conversation is removed whole, never "
                f"kept partial); re-ingest it with `{_reingest_command(record)}`"
            )
        wanted = {p.path for p in problems if p.conversation is None}
        with self._write_lock():
            lines, moved = delete_leftovers(self.caches_dir, [p for p in self._leftovers() if p.path in wanted])
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

    def _leftovers(self) -> list[Problem]:
        """What lies in caches/ that no row refers to and no live process writes. Call under the lock."""
        rows = list(self._db.query("select name, ingest_id from conversations"))
        live_dirs = {self.caches_dir / row["name"] / row["ingest_id"] for row in rows}
        live_files = {
            self._home / path
            for row in self._db.query("select path, pages_path from episodes")
            for path in (row["path"], row["pages_path"]) if path is not None
        }
        return leftovers(self.caches_dir, live_dirs, live_files)

    # ----- ask log

    _ASK_FIELDS = ("created_at", "conversation", "episode", "question", "answer", "similarity", "timings")

    def log_ask(self, row: dict) -> None:
        """Record one question and its answer; `timings` (a dict) is stored as JSON."""
        unknown = set(row) - set(self._ASK_FIELDS)
        if unknown:
            raise ValueError(f"log_ask: unknown fields {sorted(unknown)}; allowed: {self._ASK_FIELDS}")
        record = {field: row.get(field) for field in self._ASK_FIELDS}
        record["created_at"] = record["created_at"] or utc_timestamp()
        record["timings"] = json.dumps(record["timings"] or {}, sort_keys=True)
        with self._write_lock() as db:
            db["asks"].insert(record)

    def asks(self, limit: int = 20, conversation: str | None = None) -> list[dict]:
        """The latest `limit` asks (of `conversation`, or all), newest first, with `timings` decoded."""
        if limit <= 0:
            return []
        where, args = ("conversation = ?", [conversation]) if conversation is not None else (None, None)
        rows = self._db["asks"].rows_where(where, args, order_by="id desc", limit=int(limit))
        return [{**r, "timings": json.loads(r["timings"]) if r["timings"] else {}} for r in rows]


def _check_fingerprint(
    metadata: dict[str, str], fingerprint: str, refuse: Callable[[str], CacheIntegrityError]
) -> None:
    if metadata.get("fingerprint") != fingerprint:
        raise refuse(
            f"was built by a different model (cache {str(metadata.get('fingerprint'))[:24]!r}, "
            f"current {fingerprint[:24]!r})"
        )


def _reingest_command(record: ConversationRecord, *, replace: bool = False) -> str:
    """The command that builds `record` again from its history, with the settings it was built with."""
    return rebuild_command(record.name, record.model, record.settings, replace=replace)


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
        temp dir: an abort or a crash takes it along, and `write_pages` removes it."""
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
            size, digest = write(path)
        shutil.rmtree(self._tmp / f"scratch-{index}", ignore_errors=True)
        return PagesRecord(int(size), str(digest), self._final / path.name)

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
        meta = {**metadata, "format_version": FORMAT_VERSION}
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
        """Make the conversation visible: rename the files into place, then insert the rows.

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
        old_ingest: str | None = None
        renamed = False
        for scratch in self._tmp.glob("scratch-*"):  # an episode's intermediate files never become visible
            shutil.rmtree(scratch, ignore_errors=True)
        try:
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
                db["conversations"].insert(
                    {
                        "name": self.name, "created_at": created_at, "model": model,
                        "fingerprint": fingerprint, "settings": settings_json, "stats": stats_json,
                        "ingest_id": self.ingest_id,
                    }
                )  # fmt: skip
                db["episodes"].insert_all(
                    {
                        "conversation": self.name, "idx": r.index, "centroid": json.dumps(r.centroid),
                        "medoid_text": r.medoid_text, "budgets": json.dumps(r.budgets),
                        "n_tokens": r.n_tokens, "bytes": r.bytes, "sha256": r.sha256,
                        "path": r.path.relative_to(store.home).as_posix(),
                        "pages_path": None if r.pages is None else r.pages.path.relative_to(store.home).as_posix(),
                        "pages_bytes": None if r.pages is None else r.pages.bytes,
                        "pages_sha256": None if r.pages is None else r.pages.sha256,
                    }
                    for r in records
                )  # fmt: skip
        except BaseException as e:
            self._state = "aborted"
            if renamed:
                discard(self._final, caches)
            else:
                shutil.rmtree(self._tmp, ignore_errors=True)
            if is_disk_full(e):
                raise disk_full(caches) from None
            raise
        self._state = "committed"
        if old_ingest is not None and old_ingest != self.ingest_id:
            discard(name_dir / old_ingest, caches)
        return ConversationRecord(
            name=self.name,
            created_at=created_at,
            model=model,
            fingerprint=fingerprint,
            settings=json.loads(settings_json),
            stats=json.loads(stats_json),
            episodes=records,
        )

    def abort(self) -> None:
        """Drop everything written so far. Idempotent; a no-op after commit."""
        if self._state == "open":
            self._state = "aborted"
            shutil.rmtree(self._tmp, ignore_errors=True)
