"""Where ingested conversations live: a SQLite index plus one safetensors file per episode (and, for a
conversation ingested with `--offload icecache`, each episode's pages file beside it; for one that keeps them,
its recall entries file).

Nothing half-written is ever visible: an ingest's files and manifest are fsync'd in a private temp dir,
renamed into `caches/<name>/<ingest_id>`, and only then are its rows inserted, under SQLite's write lock
(`pending`). Readers find conversations through the rows, so they see one only once every file is complete.

Design notes (the details and the choices made): docs/internals.md, "kvchat/store/__init__.py".
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sqlite_utils

from kvchat.errors import CacheIntegrityError as CacheIntegrityError  # raised by `loading`, named here too
from kvchat.errors import UserError
from kvchat.messages import command, option
from kvchat.settings import rebuild_command
from kvchat.store import doctor, loading, recovery
from kvchat.store.asklog import MAX_LISTED, AskEntry, LoggedAsk, ask_row, read_asks
from kvchat.store.default import forget_default, read_default, write_default
from kvchat.store.errors import BUSY_TIMEOUT_MS, FREES_SPACE, ConversationChanged, DamagedDatabase, database_error
from kvchat.store.errors import index_errors as _index_errors
from kvchat.store.files import MAX_HEADER_BYTES as MAX_HEADER_BYTES  # part of this module's API
from kvchat.store.files import check_safetensors_header as check_safetensors_header
from kvchat.store.files import crash_point, discard, is_disk_full, try_rmdir, wal_index_fits, without_links
from kvchat.store.files import write_file as _write_file  # looked up here when an ingest begins: tests replace it
from kvchat.store.layout import CACHES_DIR, DB_NAME, MODELS_DIR, name_from_file, read_only_reason, validate_name
from kvchat.store.layout import show as _show
from kvchat.store.leftovers import (
    ORPHAN_GRACE_S,
    Problem,
    delete_trees,
    move_aside_orphans,
    real_subdirs,
    remove_dead_temp_dirs,
    remove_idle_unworked,
    stale_orphans,
)
from kvchat.store.loading import check_fingerprint as _check_fingerprint  # noqa: F401 (tests import it here)
from kvchat.store.loading import is_legacy_fingerprint
from kvchat.store.manifest import (
    MANIFEST_NAME,
    RETIRED_NAME,
    digest,
    document_from_rows,
    restore_manifest,
    retire_manifest,
)
from kvchat.store.pending import PendingConversation
from kvchat.store.records import (
    ConversationRecord,
    EpisodeRecord,
    FileRecord,
    PagesRecord,
    insert_document,
    record_of,
)
from kvchat.store.reindex import Version, newer_than_listed, unlisted_versions
from kvchat.store.resumable import Identity
from kvchat.store.resuming import begin_resumable
from kvchat.store.schema import connect, migrate, pending

if TYPE_CHECKING:
    import torch

    from kvchat.kv.tensorfile import FileRows

__all__ = [
    "CACHES_DIR", "DB_NAME", "MAX_HEADER_BYTES", "MODELS_DIR", "ConversationChanged", "ConversationRecord",
    "DamagedDatabase", "EpisodeRecord", "FileRecord", "PagesRecord", "PendingConversation", "Problem", "Store",
    "check_safetensors_header",
    "database_error", "diagnose", "is_legacy_fingerprint", "name_from_file", "read_only_reason", "repair",
    "validate_name",
]  # fmt: skip


class _LockBusy(Exception):
    """The write lock is held by another process and this caller chose not to wait."""


# --------------------------------------------------------------------------- store


class Store:
    """The on-disk home of kvchat: `kvchat.db`, `caches/` and `models/`. Safe to use from several processes."""

    def __init__(self, home: Path, *, clean_stale: bool = True, frees_space: bool = False) -> None:
        """Open (creating if needed) the store at `home`. `clean_stale=False` leaves crash leftovers in
        place, for `check` to report them. Raises DamagedDatabase when kvchat.db cannot be read.

        On a disk too full for SQLite's WAL index (`wal_index_fits`) only a caller that `frees_space` (`rm`,
        `doctor`) opens the store, holding kvchat.db in exclusive locking mode while it is open; any other
        is refused, saying the disk is full, before SQLite creates anything."""
        self._home = Path(home).expanduser().absolute()
        self.read_only_reason = read_only_reason(self._home)
        self._exclusive = False
        if self.read_only_reason is None:
            try:
                self.caches_dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise UserError(f"cannot create kvchat home {self._home}: {e.strerror or e}") from None
        elif not self.db_path.exists() and not self.db_path.is_symlink():
            self._db = self._index_in_memory()
            return
        if self.db_path.exists() and not self.db_path.is_file():
            raise DamagedDatabase(self.db_path, "it is a directory or special file, not a database file")
        if not self.read_only and not wal_index_fits(self.db_path):
            if not frees_space:
                raise UserError(f"disk full: no room to open {self.db_path} (SQLite needs 32 KiB beside it); free "
                                f"space on the disk of {self._home} ({FREES_SPACE})")
            self._exclusive = True
        self._db = self._open()
        if clean_stale and not self.read_only:
            self._clean_stale()

    @_index_errors
    def _open(self) -> sqlite_utils.Database:
        db = connect(self.db_path, read_only=self.read_only, busy_timeout_ms=BUSY_TIMEOUT_MS,
                     exclusive=self._exclusive)  # fmt: skip
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

    def _index_in_memory(self) -> sqlite_utils.Database:
        """A read-only home without kvchat.db: its conversations listed from their manifests (`reindex`), in a
        database in this process's memory, since none can be written there; the files are the truth."""
        db = sqlite_utils.Database(memory=True)
        migrate(db, self.db_path)
        for version in newer_than_listed(unlisted_versions(self.caches_dir, {}, grace_s=0.0), {}):
            insert_document(db, version.document)
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

        Temp dirs of dead ingests and model conversions go at once. Conversations on disk that kvchat.db
        lacks (a missing, older or restored database: `reindex`) are listed again, and orphan ingest dirs
        (no manifest) and empty name dirs are moved aside, both decided again under the write lock, which a
        committing ingest holds from its rename to its row commit, so a dir about to be committed is never
        taken (see `kvchat.store.leftovers`); when another process holds the lock, or a row is damaged, that
        waits for a later open.
        """
        remove_dead_temp_dirs(self.models_dir)
        if not self.caches_dir.is_dir():
            return
        remove_dead_temp_dirs(self.caches_dir)
        remove_idle_unworked(self.caches_dir)
        listed = self._listed()
        self._restore_retired(listed)
        unlisted = newer_than_listed(unlisted_versions(self.caches_dir, listed, grace_s=ORPHAN_GRACE_S), listed)
        if not unlisted and not stale_orphans(self.caches_dir, {ingest_id for ingest_id, _ in listed.values()}):
            return
        try:  # a damaged row may no longer name its ingest dir: never sweep on its word (doctor --fix restores it)
            self.conversations()
        except DamagedDatabase:
            return
        try:
            with self._write_lock(wait=False):
                self._list_again(grace_s=ORPHAN_GRACE_S)
                doomed = move_aside_orphans(self.caches_dir, self._referenced_ingests())
        except _LockBusy:
            return
        delete_trees(doomed)

    def _list_again(self, *, grace_s: float, only: set[Path] | None = None) -> list[Version]:
        """Under the write lock: put the conversations on disk that kvchat.db lacks (`reindex`; of them those
        in `only`) back into it, from their manifests, in place of an older version's rows. Returns them."""
        listed = self._listed()
        found = newer_than_listed(unlisted_versions(self.caches_dir, listed, grace_s=grace_s), listed)
        found = [v for v in found if only is None or v.path in only]
        for version in found:
            self._db.table("episodes").delete_where("conversation = ?", [version.name])
            self._db.table("conversations").delete_where("name = ?", [version.name])
            insert_document(self._db, version.document)
        return found

    @_index_errors
    def _listed(self) -> dict[str, tuple[str, str]]:
        """Every conversation row's name -> (ingest_id, created_at)."""
        rows = self._db.query("select name, ingest_id, created_at from conversations")
        return {row["name"]: (row["ingest_id"], row["created_at"]) for row in rows}

    def _restore_retired(self, listed: dict[str, tuple[str, str]]) -> None:
        """Put back the manifest of a listed conversation that an `rm` retired before it died uncommitted (its
        rows stayed): decided again under the write lock, since a live `rm` retires before it commits."""
        suspects = [name for name, (ingest_id, _) in listed.items()
                    if (self.caches_dir / name / ingest_id / RETIRED_NAME).exists()]
        if not suspects:
            return
        try:
            with self._write_lock(wait=False):
                for name in suspects:
                    row = self._row(name)
                    ingest_dir = self.caches_dir / name / row["ingest_id"] if row is not None else None
                    if ingest_dir is not None and not (ingest_dir / MANIFEST_NAME).exists():
                        restore_manifest(ingest_dir)
        except _LockBusy:
            pass  # a later open

    @_index_errors
    def _referenced_ingests(self) -> set[str]:
        return {row["ingest_id"] for row in self._db.query("select ingest_id from conversations")}

    # ----- conversations

    @_index_errors
    def begin(
        self, name: str, replace: bool = False, *, expect: str | None = None, resumable: Identity | None = None,
        resume: bool | None = None,
    ) -> PendingConversation:  # fmt: skip
        """Start writing a conversation; nothing is visible until `commit`.

        `expect`: the version (`ConversationRecord.ingest_id`) the new one continues (an append). Writers of
        one conversation serialise on it: the commit is refused (`ConversationChanged`, exit 2) when another
        process has replaced or removed that version since, so neither write is lost without a word.

        `resumable`: what the ingest is (kvchat.store.resumable): its completed units outlive it, and an unfinished
        ingest of `name` with the same identity is continued (`PendingConversation.resumed`); one with another is
        discarded. `resume` True requires one to continue (UserError where there is none), False discards it
        whatever it is; None continues one that matches. What was found is `PendingConversation.found`, a line to
        tell the user.
        """
        validate_name(name)
        self.check_writable()
        row = self._row(name)
        if not replace and row is not None:
            raise UserError(f"conversation {_show(name)} exists; use {option('replace')}")
        if row is None:
            self.check_case_twin(name)
        if expect is not None and (row is None or row["ingest_id"] != expect):
            raise ConversationChanged(_show(name))
        if resumable is None:
            return PendingConversation(self, name, replace, write_file=_write_file, expect=expect)
        return begin_resumable(self, name, replace, resumable, resume, write_file=_write_file)

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
                raise UserError(f"unknown conversation {_show(name)} (see `{command('list')}`)")
            episodes = self._episode_rows(name)
        return self._record(row, episodes)

    @_index_errors
    def latest(self) -> ConversationRecord:
        with self._db.atomic():
            rows = list(self._db.query("select * from conversations order by created_at desc, name limit 1"))
            if not rows:
                raise UserError(f"no conversations yet; run `{command('ingest', 'HISTORY')}` first")
            episodes = self._episode_rows(rows[0]["name"])
        return self._record(rows[0], episodes)

    @_index_errors
    def chosen(self) -> str | None:
        """The conversation `kvchat use` chose, while it is stored (kvchat.store.default)."""
        name = read_default(self.home)
        return name if name is not None and self._row(name) is not None else None

    @_index_errors
    def default_name(self) -> str | None:
        """The name `default` answers from, or None when no conversation is stored."""
        latest = next(iter(self._db.query("select name from conversations order by created_at desc, name limit 1")),
                      None)  # fmt: skip
        return self.chosen() or (latest["name"] if latest else None)

    def default(self) -> ConversationRecord:
        """The conversation a command answers from when none is named: the chosen one, else the latest."""
        name = self.chosen()
        return self.get(name) if name is not None else self.latest()

    def use(self, name: str) -> ConversationRecord:
        """Choose stored conversation `name` as the default (`kvchat use NAME`)."""
        record = self.get(name)
        self.check_writable()
        write_default(self.home, name)
        return record

    @_index_errors
    def remove(self, name: str, *, ingest_id: str | None = None) -> bool:
        """Delete the rows and retire the manifests (one transaction), then the files, so no reader sees rows
        without files and a crash cannot leave a dir whose manifest would list it again (`reindex`). Every
        version of the name goes; with `ingest_id`, only that version, and False, removing nothing, when the
        conversation was replaced or removed meanwhile. Nothing reached through a symbolic link is touched.
        """
        name_dir = self.caches_dir / name
        try:
            versions = self._remove_rows(name, ingest_id)
        except sqlite3.OperationalError as e:
            if not is_disk_full(e):
                raise
            versions = self._remove_rows(name, ingest_id, make_room=True)
        if versions is None:
            return False
        if ingest_id is None:
            forget_default(self.home, name)
        for ingest_dir in versions:
            discard(ingest_dir, self.caches_dir)
        with self._write_lock():  # an ingest of the same name may be renaming into name_dir
            try_rmdir(name_dir)
        return True

    def _remove_rows(self, name: str, ingest_id: str | None, *, make_room: bool = False) -> list[Path] | None:
        """`remove`'s transaction: the rows deleted, the manifests retired; the version dirs, or None when
        `ingest_id` is no longer the conversation's. `make_room` (the disk was too full to record the deletion):
        the versions' files are deleted first, inside the write lock, so a crash before the commit leaves rows
        whose files are missing (`doctor --fix` removes them), never a conversation listed again."""
        name_dir = self.caches_dir / name
        retired: list[Path] = []
        try:
            with self._write_lock() as db:
                row = self._row(name)
                if row is None and ingest_id is None:
                    raise UserError(f"unknown conversation {_show(name)} (see `{command('list')}`)")
                if row is None or ingest_id not in (None, row["ingest_id"]):
                    return None
                versions = [name_dir / row["ingest_id"]] if ingest_id is not None else _version_dirs(name_dir)
                for ingest_dir in versions if make_room else ():
                    if without_links(ingest_dir, self.caches_dir):
                        retire_manifest(ingest_dir)
                        discard(ingest_dir, self.caches_dir)
                db.table("episodes").delete_where("conversation = ?", [name])
                db.table("conversations").delete_where("name = ?", [name])
                retired = [d for d in versions if without_links(d, self.caches_dir) and retire_manifest(d)]
                crash_point("commit")
        except BaseException:
            for ingest_dir in retired:
                restore_manifest(ingest_dir)
            raise
        return versions

    def _row(self, name: str) -> dict[str, Any] | None:
        return next(iter(self._db.table("conversations").rows_where("name = ?", [name])), None)

    def check_case_twin(self, name: str) -> None:
        """Refuse a new conversation `name` when one stored differs from it in case only: on a case-insensitive
        file system (macOS's, Windows') the two would share `caches/<name>/`. A pair stored before kvchat checked
        keeps working, each by its exact name."""
        twin = next(iter(self._db.execute("select name from conversations where name = ? collate nocase "
                                          "and name != ? limit 1", [name, name]).fetchall()), None)
        if twin is not None:
            raise UserError(f"conversation {_show(twin[0])} exists, and {_show(name)} differs from it in case only: "
                            "names are told apart without case (a case-insensitive file system would hold both in one "
                            "directory); choose another name")

    def _episode_rows(self, name: str) -> list[dict[str, Any]]:
        return list(self._db.table("episodes").rows_where("conversation = ?", [name], order_by="idx"))

    def _record(self, row: dict[str, Any], episode_rows: list[dict[str, Any]]) -> ConversationRecord:
        """A conversation as its rows say, once they match their digest (DamagedDatabase if not)."""
        shown = _show(str(row.get("name")))
        try:
            doc = document_from_rows(row, episode_rows)
        except (TypeError, ValueError):
            raise DamagedDatabase(self.db_path, f"conversation {shown}: a JSON column does not parse") from None
        if row.get("digest") != digest(doc):
            raise DamagedDatabase(self.db_path, f"conversation {shown}: its rows fail their checksum")
        return record_of(doc, self._home)

    def _rebuild_hint(self, name: str, *, replace: bool) -> str:
        """The command that builds conversation `name` again, from its stored source and settings."""
        row = self._row(name)
        try:
            if row is None:
                raise KeyError(name)
            record = ConversationRecord(name, row["created_at"], row["model"], row["fingerprint"],
                                        json.loads(row["settings"]), {}, [])  # fmt: skip
        except (TypeError, ValueError, KeyError):  # no row, or a damaged one
            return command("ingest", "HISTORY", name=name, **({"replace": True} if replace else {}))
        return _reingest_command(record, replace=replace)

    # ----- a conversation's files

    @_index_errors
    def load_episode(
        self, record: EpisodeRecord, fingerprint: str
    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Load one episode's tensors and metadata, refusing anything damaged or foreign (`loading`)."""
        return loading.load_episode(record, fingerprint, caches_dir=self.caches_dir,
                                    refuse=self._refuser(record.path, "cache", record.index))  # fmt: skip

    @_index_errors
    def load_pages(
        self, record: EpisodeRecord, fingerprint: str
    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """An episode's pages file as tensors read on demand (`FileRows`) and its metadata, after the same checks
        (`loading`)."""
        return loading.load_pages(record, fingerprint, caches_dir=self.caches_dir,
                                  refuse=self._refuser(record.path, "pages file", record.index))  # fmt: skip

    @_index_errors
    def load_recall_entries(
        self, conversation: ConversationRecord, fingerprint: str
    ) -> tuple[dict[str, FileRows], dict[str, str]]:
        """A conversation's recall entries file as tensors read on demand (`FileRows`) and its metadata, after the
        same checks (`loading`). UserError when it keeps none."""
        file = conversation.recall_entries
        if file is None:
            raise UserError(f"conversation {_show(conversation.name)} keeps no recall entries file; rebuild with "
                            f"`{self._rebuild_hint(conversation.name, replace=True)}`")  # fmt: skip
        return loading.open_side_file(file, fingerprint, caches_dir=self.caches_dir, what="recall entries file",
                                      refuse=self._refuser(file.path, "recall entries file"))  # fmt: skip

    def _refuser(self, path: Path, what: str, episode: int | None = None) -> Callable[[str], UserError]:
        """The error for a damaged file of a conversation (`path`; of its episode `episode`, if one): what is
        wrong, and the command that rebuilds it; or, when another process has replaced or removed that version
        meanwhile (its files retired), that."""
        name = path.parent.parent.name
        rebuild = self._rebuild_hint(name, replace=True)
        of = f"{what} of conversation {_show(name)}" + ("" if episode is None else f" episode {episode}")

        def refuse(problem: str) -> UserError:
            if not doctor.lists(self, path):
                return ConversationChanged(_show(name))
            return CacheIntegrityError(f"{of} {' '.join(problem.split())}; rebuild with `{rebuild}`")

        return refuse

    # ----- doctor

    def database_damage(self) -> str | None:
        """How kvchat.db is damaged, or None when it is sound (`doctor`). Reads only: no lock."""
        return doctor.database_damage(self)

    @_index_errors
    def check(self, *, embedding_dimension: int | None = None) -> list[Problem]:
        """Everything wrong with the files of this home, changing nothing (`kvchat doctor`; see `doctor.check`);
        with `embedding_dimension`, conversations whose centroids are of another length too."""
        return doctor.check(self, embedding_dimension=embedding_dimension)

    @_index_errors
    def fix(self, problems: Iterable[Problem]) -> list[str]:
        """Repair what `check` found; returns one line per action taken (see `doctor.fix`)."""
        return doctor.fix(self, problems)

    @_index_errors
    def log_ask(self, row: AskEntry) -> None:
        """Record one question and its answer (`asklog`); `timings` (a dict) is stored as JSON. A read-only
        store refuses (UserError): callers check `read_only` first."""
        record = ask_row(row)
        with self._write_lock() as db:
            db.table("asks").insert(record)

    @_index_errors
    def asks(self, limit: int = 20, conversation: str | None = None) -> list[LoggedAsk]:
        """The latest `limit` asks (of `conversation`, or all), newest first, with `timings` decoded."""
        if not 0 <= limit <= MAX_LISTED:  # SQLite's integers are 64-bit
            raise UserError(f"-n must be within 1..{MAX_LISTED} (got {limit})")
        return read_asks(self._db, self.db_path, limit, conversation)


def _version_dirs(name_dir: Path) -> list[Path]:
    """The ingest dirs of one name (none when `name_dir` is a link, which is never followed)."""
    return [] if name_dir.is_symlink() else real_subdirs(name_dir)


def _reingest_command(record: ConversationRecord, *, replace: bool = False) -> str:
    """The command that builds `record` again from its history, with the settings it was built with."""
    return rebuild_command(record.name, record.model, record.settings, replace=replace)


# --------------------------------------------------------------------------- doctor


def diagnose(home: Path, *, embedding_dimension: int | None = None) -> list[Problem]:
    """Everything wrong in `home`, changing nothing (`kvchat doctor`). A damaged kvchat.db is one
    "database" problem saying what a rebuild would restore, plus one "lost" problem per conversation it
    could not (with the command that builds it again); else the store's `check` (`embedding_dimension`: the
    encoder's, which every centroid must have; kvchat.model.encoder.embedding_dimension)."""
    home = Path(home).expanduser().absolute()
    store, damage = _open_for_doctor(home)
    if store is None:
        return recovery.damage_problems(home, damage)
    try:
        return store.check(embedding_dimension=embedding_dimension)
    finally:
        store.close()


def repair(home: Path, problems: Iterable[Problem], *, embedding_dimension: int | None = None) -> list[str]:
    """Repair what `diagnose` found (`kvchat doctor --fix`); one line per action taken.

    A damaged kvchat.db is moved aside, kept, and rebuilt from what survives (`recovery`); then, or
    else, the store fixes its files and leftovers (`Store.fix`). A conversation listed again from its
    manifest (the rebuild, an unlisted one) is checked as every other (`embedding_dimension`, as `diagnose`'s)
    before it counts as restored: a manifest re-signed with centroids of another length is removed, not listed.
    """
    home = Path(home).expanduser().absolute()
    problems = list(problems)
    done = _rebuild(home) if any(p.kind == "database" for p in problems) else []
    store = Store(home, clean_stale=False, frees_space=True)
    try:
        done += store.fix(store.check(embedding_dimension=embedding_dimension) if done else problems)
        if any(p.kind == "unlisted" for p in problems):  # listed again from their manifests: their files (and
            # centroids) checked now, so one run leaves the store healthy
            done += store.fix([p for p in store.check(embedding_dimension=embedding_dimension)
                               if p.conversation is not None])  # fmt: skip
        return done
    finally:
        store.close()


def _open_for_doctor(home: Path) -> tuple[Store | None, str]:
    """The store, or None and how its kvchat.db is damaged."""
    try:
        store = Store(home, clean_stale=False, frees_space=True)
    except DamagedDatabase as e:
        return None, e.what
    damage = store.database_damage()
    if damage is None:
        return store, ""
    store.close()
    return None, damage


def _rebuild(home: Path) -> list[str]:
    """Build a new kvchat.db from what survives, then put it in the damaged one's place (`recovery`)."""
    reason = read_only_reason(home)
    if reason is not None:
        raise UserError(f"{home} is read-only ({reason}): its damaged database cannot be rebuilt there")
    with recovery.one_rebuild_at_a_time(home):  # a second `doctor --fix` waits, then finds it rebuilt
        store, damage = _open_for_doctor(home)
        if store is not None:  # repaired since it was diagnosed
            store.close()
            return []
        return recovery.rebuild(home, damage)
