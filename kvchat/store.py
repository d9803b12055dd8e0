"""Where ingested conversations live: a SQLite index plus one safetensors file per episode.

Nothing half-written is ever visible. An ingest writes its files into a private temp dir
(`caches/.tmp-<pid>-<uuid>`), fsyncs them, renames the dir to `caches/<name>/<ingest_id>` and only
then inserts the rows, all while holding SQLite's write lock. Readers find conversations through
the rows, so they see a conversation only once every one of its files is complete. Each ingest gets
a fresh `ingest_id`, so `--replace` never touches files a running `ask` may be reading.

Files are checksummed and carry the model fingerprint; loading refuses anything that does not
match, and checks the safetensors header by hand before a single tensor is allocated.

Episode file format (metadata `format_version`), per layer l:
- "1": `k.{l}`, `v.{l}` `[kv_heads, n, head_dim]`, `pos.{l}` `[kv_heads, n]` int32 (every head keeps n).
- "2": as "1", except that a layer whose heads keep different counts (`--head-budgets adaptive`) is
  stored ragged: `k.{l}`, `v.{l}` `[total, head_dim]` with the heads' rows concatenated in head order,
  `pos.{l}` `[total]` int32 and `len.{l}` `[kv_heads]` int32, each head's row count. Only kept entries
  are written. kvchat writes "2" and reads both (a "1" file is a "2" file without ragged layers).
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import sqlite3
import struct
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any

import safetensors.torch
import sqlite_utils
import torch

from kvchat.errors import CacheIntegrityError, KvchatError, UserError

FORMAT_VERSION = "2"  # written; see the module docstring
READABLE_FORMAT_VERSIONS = ("1", "2")
DB_NAME = "kvchat.db"
CACHES_DIR = "caches"
BUSY_TIMEOUT_MS = 30_000
MAX_HEADER_BYTES = 100_000_000
ORPHAN_GRACE_S = 60.0

_NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}")
_TMP_RE = re.compile(r"\.tmp-(\d+)-[0-9a-f]+")
_SUFFIX = ".safetensors"
_NO_SPACE = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}

# Bytes per element of every dtype safetensors' torch loader understands.
_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "C64": 8,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
    "F8_E4M3": 1, "F8_E4M3FNUZ": 1, "F8_E5M2": 1, "F8_E5M2FNUZ": 1,
}  # fmt: skip


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


@dataclass(frozen=True)
class ConversationRecord:
    name: str
    created_at: str  # ISO 8601 UTC
    model: str  # user-facing model spec, e.g. "default"
    fingerprint: str  # model fingerprint (opaque)
    settings: dict
    stats: dict
    episodes: list[EpisodeRecord]


@dataclass(frozen=True)
class Problem:
    """One thing `Store.check` found wrong.

    `conversation` is set when a stored conversation is damaged (`fix` removes it whole); it is None
    for leftovers that no row refers to (`fix` deletes them).
    """

    kind: str  # missing | size | checksum | outside | unreadable | orphan | stray | stale-temp
    conversation: str | None
    episode: int | None
    path: Path
    message: str

    def to_dict(self) -> dict:
        return {
            "kind": self.kind, "conversation": self.conversation, "episode": self.episode,
            "path": str(self.path), "message": self.message,
        }  # fmt: skip


# --------------------------------------------------------------------------- schema


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


# Append only: (version, fn). Each runs once per database, in order, inside the write lock.
MIGRATIONS: list[tuple[int, Callable[[sqlite_utils.Database], None]]] = [
    (1, _migration_1),
]


# --------------------------------------------------------------------------- helpers


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")


def _show(name: str) -> str:
    """A name quoted for a one-line message, whatever it contains."""
    return repr(name if len(name) <= 40 else name[:40] + "...")


def validate_name(name: str) -> str:
    """Names become directory names, so only a safe, portable subset is allowed."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        shown = _show(name) if isinstance(name, str) else repr(name)
        raise UserError(
            f"invalid conversation name {shown}: use 1 to 100 letters, digits, '.', '_' or '-', "
            "not starting with '.'"
        )
    return name


def _fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable (a no-op where dirs cannot be opened)."""
    if os.name == "nt":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _try_rmdir(path: Path) -> None:
    """Remove `path` if it is an empty directory; anything else is left alone."""
    try:
        path.rmdir()
    except OSError:
        pass


def _pid_alive(pid: int) -> bool:
    """True unless `pid` certainly does not exist. Windows: always True (os.kill would kill it)."""
    if os.name == "nt" or pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists but belongs to someone else
        return True
    return True


def _write_file(path: Path, data: bytes) -> None:
    """Write a new file and fsync it. Our own write, not safetensors' save_file: that one did not
    report a failed write (saving to /dev/full "succeeds"), and a full disk must fail loudly."""
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _is_disk_full(e: BaseException) -> bool:
    """ENOSPC/EDQUOT from a write, or SQLite's SQLITE_FULL from a commit."""
    if isinstance(e, OSError):
        return e.errno in _NO_SPACE
    return isinstance(e, sqlite3.OperationalError) and "disk is full" in str(e)


def _disk_full(where: Path) -> UserError:
    """The environment, not a bug: one line (exit 2) that says what to do."""
    return UserError(f"no space left on device while writing caches to {where}: free space or lower --budget")


def check_safetensors_header(data: bytes) -> dict[str, Any]:
    """Parse and validate a safetensors header without trusting it; return the header dict.

    Raises ValueError naming the first problem. A header must not be able to make the loader
    allocate more than the file holds, so every tensor's byte span must lie inside the data
    section, match dtype x shape exactly, and the spans must tile the data section.
    """
    size = len(data)
    if size < 8:
        raise ValueError("file is too short for a safetensors header")
    (n,) = struct.unpack("<Q", data[:8])
    if n > MAX_HEADER_BYTES:
        raise ValueError(f"header claims {n} bytes (limit {MAX_HEADER_BYTES})")
    if 8 + n > size:
        raise ValueError("header extends past the end of the file")
    try:
        header = json.loads(data[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ValueError("header is not valid JSON") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    data_len = size - 8 - n
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError("header metadata is not a string map")
    spans: list[tuple[int, int]] = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise ValueError(f"tensor {key!r} has no description")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in _DTYPE_BYTES:
            raise ValueError(f"tensor {key!r} has unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
            raise ValueError(f"tensor {key!r} has an invalid shape")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_uint(o) for o in offsets):
            raise ValueError(f"tensor {key!r} has invalid data offsets")
        begin, end = offsets
        if not begin <= end <= data_len:
            raise ValueError(f"tensor {key!r} lies outside the file")
        if end - begin != math.prod(shape) * _DTYPE_BYTES[dtype]:
            raise ValueError(f"tensor {key!r} shape {shape} does not match its {end - begin} bytes")
        spans.append((begin, end))
    cursor = 0
    for begin, end in sorted(spans):
        if begin != cursor:
            raise ValueError("tensor data overlaps or leaves gaps")
        cursor = end
    if cursor != data_len:
        raise ValueError("tensor data does not fill the file")
    return header


def _is_uint(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


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
            db["migrations"].create({"version": int, "applied_at": str}, pk="version", if_not_exists=True)
            applied = {row["version"] for row in db["migrations"].rows}
            known = {version for version, _ in MIGRATIONS}
            if applied - known:
                raise UserError(
                    f"{self.db_path} was written by a newer kvchat (schema version {max(applied)}); "
                    "upgrade kvchat"
                )
            for version, fn in sorted(MIGRATIONS, key=lambda m: m[0]):
                if version not in applied:
                    fn(db)
                    db["migrations"].insert({"version": version, "applied_at": _now()})

    # ----- stale files

    def _clean_stale(self) -> None:
        """Remove what crashed processes left behind; never anything a live process may use.

        * `caches/.tmp-<pid>-*`: removed when no process `pid` exists (os.kill(pid, 0) raises
          ProcessLookupError). A live pid's temp dir is never touched. Pids are per host (and per
          PID namespace), so a home must not be shared across machines or containers mid-ingest.
        * `caches/<name>/<ingest_id>`: removed when no conversation row references `ingest_id`
          (ingest ids are unique uuids, so any row will do) and its mtime is over 60 s old. Such a
          dir comes from a crash between rename and row commit, from a `remove` or `--replace`
          that died before deleting files, or from a failed best-effort delete. The check and the
          move out of the way happen under the SQLite write lock, which a committing ingest holds
          from its rename to its row commit, so a dir about to be committed is never taken.
        * Empty `caches/<name>` dirs are removed under the same lock.
        Orphans are first renamed to a temp dir of this process and deleted after the lock is
        released, so a crash mid-delete leaves only another stale temp dir.
        """
        if not self.caches_dir.is_dir():
            return
        for entry in self._scan_caches():
            m = _TMP_RE.fullmatch(entry.name)
            if m and not _pid_alive(int(m.group(1))):
                shutil.rmtree(entry, ignore_errors=True)
        if not self._orphans(self._referenced_ingests()):
            return
        doomed: list[Path] = []
        with self._write_lock():
            for path in self._orphans(self._referenced_ingests()):
                if path.parent == self.caches_dir:  # an empty name dir
                    _try_rmdir(path)
                    continue
                target = self._new_tmp_path()
                try:
                    os.rename(path, target)
                except OSError:
                    continue
                doomed.append(target)
                _try_rmdir(path.parent)  # only succeeds once the name dir is empty
        for target in doomed:
            shutil.rmtree(target, ignore_errors=True)

    def _scan_caches(self) -> list[Path]:
        try:
            return [p for p in self.caches_dir.iterdir() if p.is_dir() and not p.is_symlink()]
        except OSError:
            return []

    def _orphans(self, referenced: set[str]) -> list[Path]:
        """Ingest dirs that are unreferenced and old enough, plus empty name dirs."""
        found: list[Path] = []
        cutoff = time.time() - ORPHAN_GRACE_S
        for name_dir in self._scan_caches():
            if name_dir.name.startswith("."):
                continue
            try:
                children = list(name_dir.iterdir())
            except OSError:
                continue
            if not children:
                found.append(name_dir)
            for child in children:
                if not child.is_dir() or child.is_symlink() or child.name in referenced:
                    continue
                try:
                    if child.stat().st_mtime < cutoff:
                        found.append(child)
                except OSError:
                    continue
        return found

    def _referenced_ingests(self) -> set[str]:
        return {row["ingest_id"] for row in self._db.query("select ingest_id from conversations")}

    def _new_tmp_path(self) -> Path:
        return self.caches_dir / f".tmp-{os.getpid()}-{uuid.uuid4().hex}"

    def _discard(self, path: Path) -> None:
        """Best-effort delete that makes `path` vanish at once (rename), then removes it."""
        target = self._new_tmp_path()
        try:
            os.rename(path, target)
        except OSError:
            target = path
        shutil.rmtree(target, ignore_errors=True)

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
        self._discard(name_dir / row["ingest_id"])
        with self._write_lock():  # an ingest of the same name may be renaming into name_dir
            _try_rmdir(name_dir)
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

        Checks, in order: the path is inside the store, the file exists and has the recorded size,
        the safetensors header is sane (before any tensor is allocated), the sha256 matches, the
        format version is known and the model fingerprint matches. The bytes are read once, so the
        file that was checked is the file that is loaded.
        """
        name = record.path.parent.parent.name

        def refuse(problem: str) -> CacheIntegrityError:
            msg = (
                f"cache of conversation {_show(name)} episode {record.index} {problem}; "
                f"rebuild with `kvchat ingest HISTORY --name {name} --replace`"
            )
            return CacheIntegrityError(" ".join(msg.split()))

        real = os.path.realpath(record.path)
        if not self._inside_caches(record.path):
            raise refuse(f"points outside the store ({record.path})")
        try:
            with open(real, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size != record.bytes:
                    raise refuse(f"is {size} bytes, expected {record.bytes} (truncated or replaced)")
                data = f.read(size + 1)
        except FileNotFoundError:
            raise refuse(f"is missing ({record.path})") from None
        except IsADirectoryError:
            raise refuse(f"is not a file ({record.path})") from None
        if len(data) != record.bytes:
            raise refuse("changed size while being read")
        try:
            header = check_safetensors_header(data)
        except ValueError as e:
            raise refuse(f"is not a valid safetensors file: {e}") from None
        if hashlib.sha256(data).hexdigest() != record.sha256:
            raise refuse("failed its checksum (the file changed on disk)")
        metadata: dict[str, str] = header.get("__metadata__", {})
        if metadata.get("format_version") not in READABLE_FORMAT_VERSIONS:
            raise refuse(f"has unsupported format version {metadata.get('format_version')!r}")
        if metadata.get("fingerprint") != fingerprint:
            raise refuse(
                f"was built by a different model (cache {str(metadata.get('fingerprint'))[:24]!r}, "
                f"current {fingerprint[:24]!r})"
            )
        try:
            tensors = safetensors.torch.load(data)
        except Exception as e:  # the header passed our checks, so this is unexpected
            raise refuse(f"could not be decoded: {e}") from None
        return tensors, dict(metadata)

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
                found = self._file_problem(episode)
                if found is not None:
                    kind, what = found
                    problems.append(Problem(
                        kind, conversation.name, episode.index, episode.path,
                        f"conversation {_show(conversation.name)} episode {episode.index} {what}; "
                        "--fix removes the conversation",
                    ))  # fmt: skip
        if problems:  # an `rm` or `--replace` may have retired those files while we hashed them
            current = {(c.name, e.index): e.path for c in self.conversations() for e in c.episodes}
            problems = [p for p in problems if current.get((p.conversation, p.episode)) == p.path]
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
                paths = {self._home / r["path"] for r in self._episode_rows(name)}
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
        doomed: list[Path] = []
        with self._write_lock():
            for leftover in self._leftovers():
                path = leftover.path
                if path not in wanted:
                    continue
                try:
                    if path.is_dir() and not path.is_symlink():
                        target = self._new_tmp_path()
                        os.rename(path, target)
                        doomed.append(target)
                    else:
                        path.unlink()
                except OSError as e:
                    done.append(f"could not delete {path}: {e.strerror or e}")
                    continue
                done.append(f"deleted {leftover.kind} {path}")
                if path.parent.parent == self.caches_dir:
                    _try_rmdir(path.parent)  # a conversation dir left empty
        for target in doomed:
            shutil.rmtree(target, ignore_errors=True)
        return done

    def _inside_caches(self, path: Path) -> bool:
        return os.path.realpath(path).startswith(os.path.realpath(self.caches_dir) + os.sep)

    def _file_problem(self, record: EpisodeRecord) -> tuple[str, str] | None:
        """(kind, what is wrong) for one episode file, or None if it is the file that was committed."""
        if not self._inside_caches(record.path):
            return "outside", f"points outside the store ({record.path})"
        try:
            with open(record.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size != record.bytes:
                    return "size", f"is {size} bytes, expected {record.bytes} (truncated or replaced)"
                digest = hashlib.file_digest(f, "sha256").hexdigest()
        except FileNotFoundError:
            return "missing", f"is missing ({record.path})"
        except OSError as e:
            return "unreadable", f"cannot be read ({e.strerror or e})"
        if digest != record.sha256:
            return "checksum", "failed its checksum (the file changed on disk)"
        return None

    def _leftovers(self) -> list[Problem]:
        """What lies in caches/ that no row refers to and no live process writes. Call under the lock."""
        rows = list(self._db.query("select name, ingest_id from conversations"))
        live_dirs = {self.caches_dir / row["name"] / row["ingest_id"] for row in rows}
        live_files = {self._home / row["path"] for row in self._db.query("select path from episodes")}
        found: list[Problem] = []

        def leftover(kind: str, path: Path, what: str) -> None:
            found.append(Problem(kind, None, None, path, f"{what}: {path}; --fix deletes it"))

        def is_dir(path: Path) -> bool:
            return path.is_dir() and not path.is_symlink()

        for entry in sorted(self.caches_dir.iterdir()):
            tmp = _TMP_RE.fullmatch(entry.name)
            if tmp and is_dir(entry):
                if not _pid_alive(int(tmp.group(1))):
                    leftover("stale-temp", entry, "temp dir of an ingest that died")
                continue
            if not is_dir(entry) or entry.name.startswith("."):
                leftover("stray", entry, "stray file")
                continue
            children = sorted(entry.iterdir())
            if not children:
                leftover("orphan", entry, "empty conversation dir")
            for child in children:
                if child in live_dirs and is_dir(child):
                    for file in sorted(child.iterdir()):
                        if file not in live_files:
                            leftover("stray", file, "file no episode refers to")
                elif is_dir(child):
                    leftover("orphan", child, "ingest dir no conversation refers to (a crashed or replaced ingest)")
                else:
                    leftover("stray", child, "stray file")
        return found

    # ----- ask log

    _ASK_FIELDS = ("created_at", "conversation", "episode", "question", "answer", "similarity", "timings")

    def log_ask(self, row: dict) -> None:
        """Record one question and its answer; `timings` (a dict) is stored as JSON."""
        unknown = set(row) - set(self._ASK_FIELDS)
        if unknown:
            raise ValueError(f"log_ask: unknown fields {sorted(unknown)}; allowed: {self._ASK_FIELDS}")
        record = {field: row.get(field) for field in self._ASK_FIELDS}
        record["created_at"] = record["created_at"] or _now()
        record["timings"] = json.dumps(record["timings"] or {}, sort_keys=True)
        with self._write_lock() as db:
            db["asks"].insert(record)

    def asks(self, limit: int = 20) -> list[dict]:
        """The latest `limit` asks, newest first, with `timings` decoded."""
        if limit <= 0:
            return []
        rows = self._db["asks"].rows_where(order_by="id desc", limit=int(limit))
        return [{**r, "timings": json.loads(r["timings"]) if r["timings"] else {}} for r in rows]


def _reingest_command(record: ConversationRecord) -> str:
    """The command that builds `record` again from its history, with the settings it was built with."""
    settings = record.settings
    words = ["kvchat", "ingest", settings.get("source") or "HISTORY", "--name", record.name]
    if record.model != "default":
        words += ["--model", record.model]
    options = ("method", "budget", "block_size", "episodes", "window", "positions", "layer_budgets", "alpha",
               "tau1", "tau2", "head_budgets")
    for key in options:
        if key in settings and not (key == "layer_budgets" and settings[key] == "full"):
            words += ["--" + key.replace("_", "-"), str(settings[key])]
    return shlex.join(words)


class PendingConversation:
    """One ingest in progress: episode files in a private temp dir until `commit`.

    Use as a context manager; leaving the block without a commit (exception or not) aborts.
    """

    def __init__(self, store: Store, name: str, replace: bool) -> None:
        self._store = store
        self.name = name
        self.replace = replace
        self.ingest_id = uuid.uuid4().hex
        self._tmp = store._new_tmp_path()
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
        try:
            _write_file(path, data)
        except OSError as e:
            if not _is_disk_full(e):
                raise
            self.abort()  # give the space back at once
            raise _disk_full(self._store.caches_dir) from None
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
        created_at = _now()
        old_ingest: str | None = None
        renamed = False
        try:
            _fsync_dir(self._tmp)
            with store._write_lock() as db:
                row = store._row(self.name)
                if row is not None and not self.replace:
                    raise UserError(f"conversation {_show(self.name)} exists; use --replace")
                old_ingest = row["ingest_id"] if row is not None else None
                name_dir.mkdir(exist_ok=True)
                os.utime(self._tmp)  # fresh mtime: the orphan sweep leaves young dirs alone
                os.rename(self._tmp, self._final)
                renamed = True
                _fsync_dir(name_dir)
                _fsync_dir(caches)
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
                    }
                    for r in records
                )  # fmt: skip
        except BaseException as e:
            self._state = "aborted"
            if renamed:
                store._discard(self._final)
            else:
                shutil.rmtree(self._tmp, ignore_errors=True)
            if _is_disk_full(e):
                raise _disk_full(caches) from None
            raise
        self._state = "committed"
        if old_ingest is not None and old_ingest != self.ingest_id:
            store._discard(name_dir / old_ingest)
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
