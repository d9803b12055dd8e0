"""One ingest in progress (`PendingConversation`): its files written into a private temp dir, invisible
until `commit` renames the dir into place and inserts its rows, both under the store's write lock.

Nothing half-written is ever visible: episode files and the manifest (`manifest`: the conversation as one
document) are fsync'd in `caches/.tmp-<pid>-<uuid>`, which a crash leaves for the leftovers sweep; the dir is
renamed to `caches/<name>/<ingest_id>` and only then are the rows inserted. Each ingest gets a fresh
`ingest_id`, so `--replace` never touches files a running `ask` may be reading.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import stat
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from kvchat.errors import UserError
from kvchat.messages import option
from kvchat.store.errors import ConversationChanged, database_error
from kvchat.store.files import (
    crash_point,
    discard,
    disk_full,
    fsync_dir,
    is_disk_full,
    new_temp_path,
    rename,
)
from kvchat.store.layout import EPISODE_SUFFIX, PAGES_SUFFIX, RECALL_ENTRIES_NAME, show
from kvchat.store.manifest import document, write_manifest
from kvchat.store.records import (
    ConversationRecord,
    EpisodeRecord,
    FileRecord,
    PagesRecord,
    episode_entry,
    file_entry,
    insert_document,
    record_of,
)
from kvchat.store.schema import utc_timestamp

if TYPE_CHECKING:
    import torch

    from kvchat.store import Store


class PendingConversation:
    """One ingest in progress: episode files in a private temp dir until `commit`.

    Use as a context manager; leaving the block without a commit (exception or not) aborts.
    """

    def __init__(
        self, store: Store, name: str, replace: bool, *, write_file: Callable[[Path, bytes], None],
        expect: str | None = None,
    ) -> None:  # fmt: skip
        """`write_file` writes and fsyncs one new episode file (`files.write_file`; tests pass one that fails).
        `expect`: the version (ingest id) this one continues; `commit` refuses when another has replaced it."""
        self._store = store
        self.expect = expect
        self._write_file = write_file
        self.name = name
        self.replace = replace
        self.ingest_id = uuid.uuid4().hex
        self._tmp = new_temp_path(store.caches_dir)
        self._tmp.mkdir()
        self._final = store.caches_dir / name / self.ingest_id
        self._episodes: dict[int, tuple[EpisodeRecord, str]] = {}
        self._recall_entries: FileRecord | None = None
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
        path = self._tmp / f"{index}{PAGES_SUFFIX}"
        with self.disk_full_guard():
            size, sha256 = write(path)
        shutil.rmtree(self._tmp / f"scratch-{index}", ignore_errors=True)
        return PagesRecord(int(size), str(sha256), self._final / path.name)

    def write_recall_entries(self, write: Callable[[Path], tuple[int, str]]) -> FileRecord:
        """The conversation's recall entries file: `write(path)` writes and fsyncs it at `path` in the temp dir
        and returns (bytes, sha256). `commit` lists it with the conversation."""
        path = self._recall_entries_path()
        with self.disk_full_guard(), _removed_on_failure(path):
            size, sha256 = write(path)
        self._recall_entries = FileRecord(int(size), str(sha256), self._final / path.name)
        return self._recall_entries

    def _recall_entries_path(self) -> Path:
        self._check_open()
        if self._recall_entries is not None:
            raise ValueError("the recall entries file was already written")
        return self._tmp / RECALL_ENTRIES_NAME

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
        import safetensors.torch  # torch only when a cache is written, not for every store command

        from kvchat.kv.codec import format_version  # stamped on every file here

        meta = {**metadata, "format_version": format_version(metadata)}
        path = self._tmp / f"{index}{EPISODE_SUFFIX}"
        cpu = {key: t.detach().to("cpu").contiguous() for key, t in tensors.items()}
        data = safetensors.torch.save(cpu, metadata=meta)
        with self.disk_full_guard():
            self._write_file(path, data)
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
        old rows of the same name when `replace` (and refuses, ConversationChanged, when they are no longer
        the version `expect` names). The old ingest's files are deleted afterwards.
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
        entries = self._recall_entries
        if entries is not None and not _holds(self._tmp / entries.path.name, entries):
            raise ValueError("commit: the recall entries file is not in this ingest's temp dir as recorded")
        created_at = utc_timestamp()
        doc = document(
            name=self.name, ingest_id=self.ingest_id, created_at=created_at, model=model, fingerprint=fingerprint,
            settings=json.loads(settings_json), stats=json.loads(stats_json),
            episodes=[episode_entry(r, store.home) for r in records],
            recall_entries=file_entry(entries, store.home) if entries is not None else None,
        )  # fmt: skip
        old_ingest: str | None = None
        renamed = False
        for scratch in self._tmp.glob("scratch-*"):  # an episode's intermediate files never become visible
            shutil.rmtree(scratch, ignore_errors=True)
        try:
            write_manifest(self._tmp, doc)
            fsync_dir(self._tmp)
            with store._write_lock() as db:
                row = store._row(self.name)
                if row is not None and not self.replace:
                    raise UserError(f"conversation {show(self.name)} exists; use {option('replace')}")
                old_ingest = row["ingest_id"] if row is not None else None
                if self.expect is not None and old_ingest != self.expect:  # compare-and-swap: no lost update
                    raise ConversationChanged(show(self.name))
                if name_dir.is_symlink():
                    raise UserError(f"{name_dir} is a symbolic link: kvchat writes conversations only inside "
                                    f"{caches}; remove the link")  # fmt: skip
                name_dir.mkdir(exist_ok=True)
                os.utime(self._tmp)  # fresh mtime: the orphan sweep leaves young dirs alone
                rename(self._tmp, self._final)
                renamed = True
                fsync_dir(name_dir)
                fsync_dir(caches)
                db.table("episodes").delete_where("conversation = ?", [self.name])
                db.table("conversations").delete_where("name = ?", [self.name])
                insert_document(db, doc)
                crash_point("commit")
            crash_point("committed")
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
        return record_of(doc, store.home)

    def abort(self) -> None:
        """Drop everything written so far. Idempotent; a no-op after commit."""
        if self._state == "open":
            self._state = "aborted"
            shutil.rmtree(self._tmp, ignore_errors=True)


@contextmanager
def _removed_on_failure(path: Path) -> Iterator[None]:
    """What was written at `path` is removed when the block fails, so a part of a file is never committed."""
    try:
        yield
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def _holds(path: Path, record: FileRecord) -> bool:
    """Whether `path` is a regular file (not a link) of the record's size."""
    try:
        found = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(found.st_mode) and found.st_size == record.bytes
