"""Episode files on disk: written so a crash or a full disk cannot pass unnoticed, read back only if
they are the bytes that were committed.

The file-level primitives under the store's atomic write (fsync of files and dirs, temp dirs that name
their writer's pid) and under every read (path inside the store, size, sha256, and a safetensors header
checked by hand before anything is allocated). Nothing here knows about SQLite or conversations.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import os
import re
import shutil
import sqlite3
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from kvchat.checked_files import MAX_HEADER_BYTES as MAX_HEADER_BYTES  # re-exported
from kvchat.checked_files import FileMismatch as FileMismatch
from kvchat.checked_files import check_safetensors_header as check_safetensors_header
from kvchat.checked_files import open_regular as open_regular
from kvchat.checked_files import read_bounded as read_bounded
from kvchat.errors import UserError
from kvchat.messages import setting

_TMP_RE = re.compile(r"\.tmp-(\d+)(?:-s(\d+))?-[0-9a-f]+")  # pid, and since pids are reused its start time
_NO_SPACE = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}

# --------------------------------------------------------------------------- writing


CRASH_AT = "KVCHAT_CRASH_AT"
CRASH_LOG = "KVCHAT_CRASH_LOG"
CRASH_EXIT = 77
_crash_points = itertools.count(1)  # the one piece of process state here: a test hook's counter


def crash_point(what: str) -> None:
    """A test hook in the manner of SQLite's crash tests (tests/test_crash_points.py): with KVCHAT_CRASH_AT=N the
    process dies at once (os._exit, no clean-up) at the N-th write, fsync, rename or commit of the store, before
    it happens; KVCHAT_CRASH_LOG=FILE appends each point reached (`what`), so a first run counts them. Neither
    set (every real run): nothing."""
    at, log = os.environ.get(CRASH_AT), os.environ.get(CRASH_LOG)
    if at is None and log is None:
        return
    n = next(_crash_points)
    if log:
        with open(log, "a") as f:
            f.write(f"{n} {what}\n")
    if at is not None and n == int(at):
        os._exit(CRASH_EXIT)


HOLD_AT = "KVCHAT_HOLD_AT"


def hold_point(what: str) -> None:
    """A test hook beside `crash_point`: with KVCHAT_HOLD_AT=WHAT:FILE the process waits at the point named `what`
    until FILE exists, so a test can act while it is held there (tests/test_batch_cluster.py kills a Ray node
    whose worker has sent an episode and holds before its next one). Unset (every real run): nothing."""
    held, _, barrier = os.environ.get(HOLD_AT, "").partition(":")
    if held != what or not barrier:
        return
    while not os.path.exists(barrier):
        time.sleep(0.05)  # polls for the test's file: no timing rides on it


def write_file(path: Path, data: bytes) -> None:
    """Write a new file and fsync it. Our own write, not safetensors' save_file: that one did not
    report a failed write (saving to /dev/full "succeeds"), and a full disk must fail loudly."""
    crash_point(f"write {path.name}")
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        crash_point(f"fsync {path.name}")
        os.fsync(f.fileno())


def rename(source: Path, target: Path) -> None:
    """`os.replace`, a crash point (`crash_point`) first: every rename of the store goes through here."""
    crash_point(f"rename {Path(source).name}")
    os.replace(source, target)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable (a no-op where dirs cannot be opened)."""
    crash_point(f"fsync dir {path.name}")
    if os.name == "nt":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_disk_full(e: BaseException) -> bool:
    """ENOSPC/EDQUOT from a write, or SQLite's SQLITE_FULL from a commit."""
    if isinstance(e, OSError):
        return e.errno in _NO_SPACE
    return isinstance(e, sqlite3.OperationalError) and "disk is full" in str(e)


def disk_full(where: Path) -> UserError:
    """The environment, not a bug: one line (exit 2) that says what to do."""
    return UserError(f"no space left on device while writing caches to {where}: free space or lower "
                     f"{setting('budget')}")


def wal_index_fits(db_path: Path) -> bool:
    """Whether SQLite can open `db_path` in WAL mode the shared way: its shared-memory index file (32 KiB)
    beside it is already whole, or the disk has room for it. Where not, SQLite fails with "disk I/O error"
    and leaves a part of that file behind, taking what room was left."""
    try:
        if os.stat(f"{db_path}-shm").st_size >= WAL_INDEX_BYTES:
            return True
    except OSError:
        pass
    try:
        return shutil.disk_usage(db_path.parent).free >= WAL_INDEX_BYTES + 4096
    except OSError:
        return True  # not ours to judge: SQLite says what is wrong


WAL_INDEX_BYTES = 32 * 1024


def nearly_full(where: Path) -> bool:
    """Whether the file system of `where` has less room than SQLite needs to open a WAL database (its 32 KiB
    shared-memory file): SQLite then says only "disk I/O error"."""
    try:
        return shutil.disk_usage(where).free < NEARLY_FULL_BYTES
    except OSError:
        return False


NEARLY_FULL_BYTES = 1 << 20


# --------------------------------------------------------------------------- temp dirs and deletion


def new_temp_path(caches_dir: Path) -> Path:
    """A fresh `caches/.tmp-<pid>-s<start>-<uuid>` name (`.tmp-<pid>-<uuid>` where the start time is unknown): the
    pid and the process's start time let a later open tell a dead writer's dir, also once its pid is reused."""
    start = process_start(os.getpid())
    return caches_dir / f".tmp-{os.getpid()}{'' if start is None else f'-s{start}'}-{uuid.uuid4().hex}"


def temp_writer(path: Path) -> tuple[int, int | None] | None:
    """The pid and start time (None in names written before kvchat kept it) in a name made by `new_temp_path`, or
    None for any other name."""
    m = _TMP_RE.fullmatch(path.name)
    return (int(m.group(1)), None if m.group(2) is None else int(m.group(2))) if m else None


def process_start(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (Linux's /proc/PID/stat, field 22); None where that
    cannot be read (another system, no such process)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read(4096)
        return int(stat[stat.rindex(b")") + 2:].split()[19])  # after the command name, which may hold spaces
    except (OSError, ValueError, IndexError):
        return None


def writer_alive(pid: int, start: int | None) -> bool:
    """True unless the process that named a temp dir (`temp_writer`) is certainly gone: no process `pid`, or one
    that started at another time than `start` (its pid reused). Windows: always True (os.kill would kill it)."""
    if os.name == "nt" or pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists but belongs to someone else
        pass
    if start is None:
        return True
    now = process_start(pid)
    return now is None or now == start


def discard(path: Path, caches_dir: Path) -> None:
    """Best-effort delete that makes `path` vanish at once (rename), then removes it. A `path` reached
    through a link below `caches_dir` is left alone (`without_links`)."""
    if not without_links(path, caches_dir):
        return
    target = new_temp_path(caches_dir)
    try:
        rename(path, target)
    except OSError:
        target = path
    shutil.rmtree(target, ignore_errors=True)


def without_links(path: Path, root: Path) -> bool:
    """Whether `path` lies below `root` with no symbolic link on the way (`path` itself included): only such
    a path may be renamed or deleted, so nothing outside the home is ever touched, whatever the links."""
    try:
        parts = path.relative_to(root).parts
    except ValueError:
        return False
    current = root
    for part in parts:
        current = current / part
        if current.is_symlink():
            return False
    return bool(parts)


def try_rmdir(path: Path) -> None:
    """Remove `path` if it is an empty directory; anything else is left alone."""
    try:
        path.rmdir()
    except OSError:
        pass


# --------------------------------------------------------------------------- reading


def is_inside(path: Path, directory: Path) -> bool:
    """Whether `path`, links resolved, lies below `directory`."""
    return os.path.realpath(path).startswith(os.path.realpath(directory) + os.sep)


def read_verified(path: Path, size: int, sha256: str, *, within: Path) -> bytes:
    """The bytes of `path`, read once, if it lies inside `within`, is a regular file and holds `size` bytes
    hashing to `sha256`.

    Raises FileMismatch otherwise. Other OSErrors (no permission) propagate: the caller says what they
    mean. Reading once means the bytes that were checked are the bytes the caller gets.
    """
    chunks: list[bytes] = []
    _read_checked(path, size, sha256, within, chunks.append, size + 1)
    return b"".join(chunks)


def verify_file(path: Path, size: int, sha256: str, *, within: Path) -> None:
    """`read_verified` for files too large to hold: hashed in chunks, nothing kept. A pages file is checked
    this way and then read on demand (its ingest dir is never written again, so the bytes stay the ones
    that were hashed unless someone edits the store by hand; a read that finds it shorter raises)."""
    _read_checked(path, size, sha256, within, lambda chunk: None, _HASH_CHUNK)


_HASH_CHUNK = 1 << 22


def _read_checked(
    path: Path, size: int, sha256: str, within: Path, consume: Callable[[bytes], None], chunk_size: int
) -> None:
    """Read `path` in chunks of `chunk_size`, handing each to `consume`, checking place, kind, size and hash."""
    if not is_inside(path, within):
        raise FileMismatch("outside", f"points outside the store ({path})")
    digest, read = hashlib.sha256(), 0
    try:
        with open_regular(path) as f:
            actual = os.fstat(f.fileno()).st_size
            if actual != size:
                raise FileMismatch("size", f"is {actual} bytes, expected {size} (truncated or replaced)")
            while read <= size and (chunk := f.read(chunk_size)):
                digest.update(chunk)
                consume(chunk)
                read += len(chunk)
    except FileNotFoundError:
        raise FileMismatch("missing", f"is missing ({path})") from None
    except IsADirectoryError:  # where a directory cannot be opened at all
        raise FileMismatch("not-a-file", f"is not a regular file but a directory ({path})") from None
    if read != size:
        raise FileMismatch("size", "changed size while being read")
    if digest.hexdigest() != sha256:
        raise FileMismatch("checksum", "failed its checksum (the file changed on disk)")


