"""One ingest in progress (`PendingConversation`): its files written into a private temp dir, invisible
until `commit` renames the dir into place and inserts its rows, both under the store's write lock.

Nothing half-written is ever visible: episode files and the manifest (`manifest`: the conversation as one
document) are fsync'd in `caches/.tmp-<pid>-<uuid>`, which a crash leaves for the leftovers sweep; the dir is
renamed to `caches/<name>/<ingest_id>` and only then are the rows inserted. Each ingest gets a fresh
`ingest_id`, so `--replace` never touches files a running `ask` may be reading.

A resumable ingest (`Store.begin(resumable=...)`) writes into `caches/.resume-<name>` instead (kvchat.store.resumable):
each completed unit (an episode file, a checkpoint of an episode's prefill, recall chunks) is journaled once its
files are fsync'd, and a failure after one (a kill, Ctrl-C, a full disk) leaves the dir for the same ingest to
continue (`pause`) rather than deleting it. Its commit is the same rename and transaction, the journal and
checkpoints removed first.
"""

from __future__ import annotations

import contextlib
import dataclasses
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
    FileMismatch,
    check_safetensors_header,
    crash_point,
    discard,
    disk_full,
    fsync_dir,
    is_disk_full,
    new_temp_path,
    read_verified,
    rename,
)
from kvchat.store.layout import EPISODE_SUFFIX, PAGES_SUFFIX, RECALL_ENTRIES_NAME, show
from kvchat.store.manifest import MANIFEST_NAME, document, write_manifest
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
from kvchat.store.resumable import CHECKPOINT_PREFIX, IDENTITY_NAME, JOURNAL_NAME, Claim, Journal, completed, describe
from kvchat.store.schema import utc_timestamp

if TYPE_CHECKING:
    import torch

    from kvchat.store import Store


class PendingConversation:
    """One ingest in progress: episode files in a private temp dir until `commit`.

    Use as a context manager; leaving the block without a commit aborts, except a resumable one (`claim`) that has
    completed a unit and leaves by an exception: that one is kept for the same ingest to continue (`pause`).
    """

    def __init__(
        self, store: Store, name: str, replace: bool, *, write_file: Callable[[Path, bytes], None],
        expect: str | None = None, claim: Claim | None = None, found: str | None = None,
    ) -> None:  # fmt: skip
        """`write_file` writes and fsyncs one new episode file (`files.write_file`; tests pass one that fails).
        `expect`: the version (ingest id) this one continues; `commit` refuses when another has replaced it.
        `claim`: a resumable dir this process holds (kvchat.store.resumable), written instead of a temp dir and
        continued from its journal; `found`, what `Store.begin` found there to tell the user (or None)."""
        self._store = store
        self.expect = expect
        self._write_file = write_file
        self.name = name
        self.replace = replace
        self.found = found
        self._claim = claim
        self._journal: Journal | None = None
        self._episodes: dict[int, tuple[EpisodeRecord, str]] = {}
        self._notes: dict[int, dict] = {}  # episode index -> what its writer journaled with it
        self._chunks: dict[tuple[int, int], dict] = {}  # recall chunks [first, end) journaled -> their note
        self._checkpoints: dict[int, dict] = {}  # episode index -> its latest journaled checkpoint
        self._recall_entries: FileRecord | None = None
        self._state = "open"
        if claim is None:
            self.ingest_id = uuid.uuid4().hex
            self._tmp = new_temp_path(store.caches_dir)
            self._tmp.mkdir()
        else:
            assert claim.identity is not None, "a claimed resumable dir has an identity"
            self.ingest_id = claim.identity["ingest_id"]
            self._units: dict[str, int] = dict(claim.identity["units"])
            self._tmp = claim.path
        self._final = store.caches_dir / name / self.ingest_id
        if claim is not None:
            self._journal = Journal(self._tmp / JOURNAL_NAME)
            self._restore()
        self.resumed = self._journal is not None and completed(self._journal.entries)

    def __enter__(self) -> PendingConversation:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._state == "open":
            if exc_type is not None and self._keeps_work():
                self.pause()
            else:
                self.abort()

    def _check_open(self) -> None:
        if self._state != "open":
            raise RuntimeError(f"pending conversation {self.name!r} is already {self._state}")

    @property
    def resumable(self) -> bool:
        """Whether what this ingest completes outlives it (journaled in its resumable dir)."""
        return self._journal is not None

    @property
    def paused(self) -> bool:
        """Whether this ingest stopped with its completed units kept for the same ingest to continue (`pause`)."""
        return self._state == "paused"

    def done(self) -> str:
        """What the journal says is done, in words ("3 of 4 episodes done"); "" for an ingest that is not resumable."""
        return describe(self._journal.entries, self._units) if self._journal is not None else ""

    def _keeps_work(self) -> bool:
        return self._journal is not None and completed(self._journal.entries)

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
        user is told in one line (exit 2); a resumable one that has completed a unit keeps it and says so. Other
        errors pass through."""
        try:
            yield
        except OSError as e:
            if not is_disk_full(e):
                raise
            if self._state == "open" and self._keeps_work():
                self.pause()
                raise UserError(f"no space left on device while writing caches to {self._store.caches_dir}: kept: "
                                f"{self.done()}; free space and run the same ingest again to continue from "
                                "there") from None  # fmt: skip
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
        and returns (bytes, sha256). `commit` lists it with the conversation. A resumable ingest's file stays
        when `write` fails (the chunks journaled in it, `note_chunks`, are kept); another's is removed."""
        path = self.recall_entries_path()
        with self.disk_full_guard(), contextlib.nullcontext() if self.resumable else _removed_on_failure(path):
            size, sha256 = write(path)
        self._recall_entries = FileRecord(int(size), str(sha256), self._final / path.name)
        return self._recall_entries

    def recall_entries_path(self) -> Path:
        """Where the recall entries file is written (in the temp dir)."""
        self._check_open()
        if self._recall_entries is not None:
            raise ValueError("the recall entries file was already written")
        return self._tmp / RECALL_ENTRIES_NAME

    def recall_entries_written(self, size: int, sha256: str) -> FileRecord:
        """The recall entries file at `recall_entries_path` is whole and fsync'd (written in place, row by row, by
        its caller): `commit` lists it with the conversation."""
        path = self.recall_entries_path()
        self._recall_entries = FileRecord(int(size), str(sha256), self._final / path.name)
        return self._recall_entries

    def reset_chunks(self) -> None:
        """The recall chunks journaled so far no longer count (their file was made anew)."""
        self._check_open()
        if self._journal is not None:
            with self.disk_full_guard():
                self._journal.append({"chunks_reset": True})
        self._chunks.clear()

    def recalled_chunks(self) -> dict[tuple[int, int], dict]:
        """The recall chunks `[first, end)` whose rows the recall entries file holds (journaled), with their notes."""
        return dict(self._chunks)

    def note_chunks(self, first: int, end: int, note: dict) -> None:
        """Recall chunks `[first, end)` are written in the recall entries file and fsync'd: journal them (a
        resumable ingest's; else nothing)."""
        self._check_open()
        if self._journal is not None:
            with self.disk_full_guard():
                self._journal.append({"chunks": [first, end], "note": note})
            self._chunks[(first, end)] = note

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
        note: dict | None = None,
    ) -> EpisodeRecord:
        """Write and fsync one episode file. The record's `path` is where it will live once committed.

        `metadata` must hold string values (a safetensors rule) including "fingerprint";
        the store adds "format_version". A resumable ingest journals the episode with `note` (its writer's, JSON;
        `episode_note` gives it back) and drops its checkpoints.
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
        meta = {**metadata, "format_version": _format_version(metadata)}
        path = self._tmp / f"{index}{EPISODE_SUFFIX}"
        size, digest = self._write_tensors(path, tensors, meta)
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
        if self._journal is not None:
            with self.disk_full_guard():
                fsync_dir(self._tmp)
                self._journal.append({"episode": index, "record": _journaled(record), "fingerprint":
                                      metadata["fingerprint"], "note": note or {}})  # fmt: skip
            self._notes[index] = note or {}
            self._drop_checkpoints(index)
        self._episodes[index] = (record, metadata["fingerprint"])
        return record

    def _write_tensors(self, path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[int, str]:
        """A safetensors file written and fsync'd, the same bytes for the same tensors whatever the process."""
        from kvchat.kv.tensorfile import safetensors_bytes  # torch only when a cache is written

        data = safetensors_bytes(tensors, metadata)
        with self.disk_full_guard():
            self._write_file(path, data)
        return len(data), hashlib.sha256(data).hexdigest()

    def written_episodes(self) -> dict[int, EpisodeRecord]:
        """The episodes written so far (a resumed ingest: those its journal kept), by index."""
        return {i: record for i, (record, _) in self._episodes.items()}

    def episode_note(self, index: int) -> dict:
        """What was journaled with episode `index` (`write_episode(note=)`)."""
        return self._notes.get(index, {})

    def write_checkpoint(self, index: int, tensors: dict[str, torch.Tensor], metadata: dict[str, str],
                         note: dict) -> None:  # fmt: skip
        """A resumable ingest's checkpoint of episode `index` (its unfinished cache as the codec encodes it, and
        `note`, its writer's JSON), written, fsync'd and journaled; the episode's older one is dropped."""
        self._check_open()
        if self._journal is None:
            return
        sequence = sum("checkpoint" in e for e in self._journal.entries) + 1
        path = self._tmp / f"{CHECKPOINT_PREFIX}{index}-{sequence}{EPISODE_SUFFIX}"
        size, digest = self._write_tensors(path, tensors, metadata)
        entry = {"checkpoint": index, "file": path.name, "bytes": size, "sha256": digest, "note": note}
        with self.disk_full_guard():
            fsync_dir(self._tmp)
            self._journal.append(entry)
        self._drop_checkpoints(index, keep=path.name)
        self._checkpoints[index] = entry

    def checkpoint_note(self, index: int) -> dict | None:
        """The note of episode `index`'s latest checkpoint, its file unread; None where it has none."""
        entry = self._checkpoints.get(index)
        return None if entry is None else entry["note"]

    def checkpoint(self, index: int) -> tuple[dict[str, torch.Tensor], dict[str, str], dict] | None:
        """Episode `index`'s latest checkpoint: (tensors, metadata, note), or None where there is none, or its file
        no longer holds what was journaled."""
        entry = self._checkpoints.get(index)
        if entry is None:
            return None
        import safetensors.torch

        try:
            data = read_verified(self._tmp / entry["file"], entry["bytes"], entry["sha256"], within=self._tmp)
            metadata = check_safetensors_header(data, size=len(data)).get("__metadata__") or {}
            tensors = safetensors.torch.load(data)
        except (OSError, FileMismatch, ValueError):
            return None
        return tensors, metadata, entry["note"]

    def _drop_checkpoints(self, index: int, keep: str | None = None) -> None:
        """Delete episode `index`'s checkpoint files but `keep` (a newer one, or its episode file, is journaled)."""
        for path in self._tmp.glob(f"{CHECKPOINT_PREFIX}{index}-*"):
            if path.name != keep:
                path.unlink(missing_ok=True)
        self._checkpoints.pop(index, None)

    def _restore(self) -> None:
        """What the journal of a resumable dir says was completed, checked against the files (an episode whose file
        is not the one journaled is done again), and the files it does not name deleted (a unit cut short)."""
        assert self._journal is not None
        kept = {IDENTITY_NAME, JOURNAL_NAME}
        for entry in self._journal.entries:
            if "episode" in entry:
                record = _restored(entry, self._tmp, self._final)
                if record is not None:
                    self._episodes[record.index] = (record, str(entry.get("fingerprint")))
                    self._notes[record.index] = entry.get("note") or {}
            elif "checkpoint" in entry:
                self._checkpoints[entry["checkpoint"]] = entry
            elif "chunks" in entry:
                self._chunks[tuple(entry["chunks"])] = entry.get("note") or {}
            elif entry.get("chunks_reset"):
                self._chunks.clear()
        for index in self._episodes:
            self._checkpoints.pop(index, None)
        for record, _ in self._episodes.values():
            kept |= {f.name for f, *_ in record.files()}
        kept |= {entry["file"] for entry in self._checkpoints.values()}
        if self._chunks:
            kept.add(RECALL_ENTRIES_NAME)
        for path in list(self._tmp.iterdir()):
            if path.name not in kept:
                _remove(path)

    def commit(self, *, model: str, fingerprint: str, settings: dict, stats: dict) -> ConversationRecord:
        """Make the conversation visible: write its manifest, rename the files into place, then insert the rows.

        Rename and row changes happen under one SQLite write transaction, which also replaces the
        old rows of the same name when `replace` (and refuses, ConversationChanged, when they are no longer
        the version `expect` names). The old ingest's files are deleted afterwards. A resumable ingest refused
        before its rename (another conversation took the name meanwhile) is kept, to commit at its next run.
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
                if row is None:  # again under the lock: another process may have committed its twin meanwhile
                    store.check_case_twin(self.name)
                old_ingest = row["ingest_id"] if row is not None else None
                if self.expect is not None and old_ingest != self.expect:  # compare-and-swap: no lost update
                    raise ConversationChanged(show(self.name))
                if name_dir.is_symlink():
                    raise UserError(f"{name_dir} is a symbolic link: kvchat writes conversations only inside "
                                    f"{caches}; remove the link")  # fmt: skip
                name_dir.mkdir(exist_ok=True)
                self._drop_bookkeeping()
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
            if renamed:
                self._state = "aborted"
                discard(self._final, caches)
                self._release()
            elif self._journal is not None and not self._journal_dropped:
                (self._tmp / MANIFEST_NAME).unlink(missing_ok=True)
                self.pause()
            else:
                self._state = "aborted"
                shutil.rmtree(self._tmp, ignore_errors=True)
                self._release()
            if is_disk_full(e):
                raise disk_full(caches) from None
            meant = database_error(store.db_path, e) if isinstance(e, sqlite3.Error) else None
            if meant is not None:
                raise meant from e
            raise
        self._state = "committed"
        self._release()
        if old_ingest is not None and old_ingest != self.ingest_id:
            discard(name_dir / old_ingest, caches)
        return record_of(doc, store.home)

    _journal_dropped = False  # set once the journal is removed, just before the commit's rename

    def _drop_bookkeeping(self) -> None:
        """A resumable ingest about to be renamed into place: its journal, identity and checkpoints are not part of
        the conversation."""
        if self._journal is None:
            return
        self._journal.close()
        self._journal_dropped = True
        for path in self._tmp.iterdir():
            if path.name in (JOURNAL_NAME, IDENTITY_NAME) or path.name.startswith(CHECKPOINT_PREFIX):
                path.unlink(missing_ok=True)
        fsync_dir(self._tmp)

    def pause(self) -> None:
        """Keep what a resumable ingest completed for its next run: the unit cut short is deleted, the journal
        closed and the dir let go. An ingest that is not resumable is aborted."""
        if self._state != "open":
            return
        if self._journal is None:
            self.abort()
            return
        self._state = "paused"
        self._journal.close()
        for scratch in self._tmp.glob("scratch-*"):
            shutil.rmtree(scratch, ignore_errors=True)
        self._release()

    def abort(self) -> None:
        """Drop everything written so far (a resumable ingest's dir too). Idempotent; a no-op after commit."""
        if self._state == "open":
            self._state = "aborted"
            if self._journal is not None:
                self._journal.close()
            if self._claim is not None:
                self._claim.discard(self._store.caches_dir)
                self._claim = None
            else:
                shutil.rmtree(self._tmp, ignore_errors=True)

    def _release(self) -> None:
        if self._claim is not None:
            self._claim.release()
            self._claim = None


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


def _format_version(metadata: dict[str, str]) -> str:
    from kvchat.kv.codec import format_version  # stamped on every file here; the codec only when one is written

    return format_version(metadata)


def _journaled(record: EpisodeRecord) -> dict:
    """An episode's record as its journal line holds it: file names, not paths (the ingest dir's is known)."""
    entry = {**dataclasses.asdict(record), "path": record.path.name, "pages": None}
    if record.pages is not None:
        entry["pages"] = {"path": record.pages.path.name, "bytes": record.pages.bytes, "sha256": record.pages.sha256}
    return entry


def _restored(entry: dict, directory: Path, final: Path) -> EpisodeRecord | None:
    """The record of a journaled episode whose files in `directory` are the ones journaled (the episode file by
    sha256, a pages file by size), with its paths once committed in `final`; None otherwise."""
    try:
        fields = dict(entry["record"])
        pages = fields.pop("pages")
        record = EpisodeRecord(**{**fields, "path": final / Path(fields["path"]).name, "pages": None if pages is None
                                  else FileRecord(int(pages["bytes"]), str(pages["sha256"]),
                                                  final / Path(pages["path"]).name)})  # fmt: skip
        read_verified(directory / record.path.name, record.bytes, record.sha256, within=directory)
    except (KeyError, TypeError, ValueError, OSError, FileMismatch):
        return None
    if record.pages is not None and not _holds(directory / record.pages.path.name, record.pages):
        return None
    return record


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
