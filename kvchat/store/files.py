"""Episode files on disk: written so a crash or a full disk cannot pass unnoticed, read back only if
they are the bytes that were committed.

The file-level primitives under the store's atomic write (fsync of files and dirs, temp dirs that name
their writer's pid) and under every read (path inside the store, size, sha256, and a safetensors header
checked by hand before anything is allocated). Nothing here knows about SQLite or conversations.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import shutil
import sqlite3
import stat
import struct
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvchat.errors import UserError

MAX_HEADER_BYTES = 100_000_000

_TMP_RE = re.compile(r"\.tmp-(\d+)-[0-9a-f]+")
_NO_SPACE = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}

# Bytes per element of every dtype safetensors' torch loader understands.
_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "C64": 8,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
    "F8_E4M3": 1, "F8_E4M3FNUZ": 1, "F8_E5M2": 1, "F8_E5M2FNUZ": 1,
}  # fmt: skip


# --------------------------------------------------------------------------- writing


def write_file(path: Path, data: bytes) -> None:
    """Write a new file and fsync it. Our own write, not safetensors' save_file: that one did not
    report a failed write (saving to /dev/full "succeeds"), and a full disk must fail loudly."""
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable (a no-op where dirs cannot be opened)."""
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
    return UserError(f"no space left on device while writing caches to {where}: free space or lower --budget")


# --------------------------------------------------------------------------- temp dirs and deletion


def new_temp_path(caches_dir: Path) -> Path:
    """A fresh `caches/.tmp-<pid>-<uuid>` name: the pid lets a later open tell a dead writer's dir."""
    return caches_dir / f".tmp-{os.getpid()}-{uuid.uuid4().hex}"


def temp_writer_pid(path: Path) -> int | None:
    """The pid in a name made by `new_temp_path`, or None for any other name."""
    m = _TMP_RE.fullmatch(path.name)
    return int(m.group(1)) if m else None


def discard(path: Path, caches_dir: Path) -> None:
    """Best-effort delete that makes `path` vanish at once (rename), then removes it. A `path` reached
    through a link below `caches_dir` is left alone (`without_links`)."""
    if not without_links(path, caches_dir):
        return
    target = new_temp_path(caches_dir)
    try:
        os.rename(path, target)
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


class FileMismatch(Exception):
    """A stored file is not the one that was committed. `kind` is the doctor's name for how
    (outside | missing | not-a-file | size | checksum); the message says it, to follow "episode N"."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def is_inside(path: Path, directory: Path) -> bool:
    """Whether `path`, links resolved, lies below `directory`."""
    return os.path.realpath(path).startswith(os.path.realpath(directory) + os.sep)


def open_regular(path: Path):
    """`path` opened for reading if it is a regular file; FileMismatch("not-a-file") otherwise.

    Opened without blocking and checked on the open descriptor: a FIFO put in a file's place would block a
    plain open forever (until something writes to it), and checking before opening leaves a window for the swap.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise FileMismatch("not-a-file", f"is not a regular file but a {_file_type(mode)} ({path})")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _file_type(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
             (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"))  # fmt: skip
    return next((name for test, name in kinds if test(mode)), "special file")


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
    this way and then memory-mapped (its ingest dir is never written again, so the bytes stay the ones
    that were hashed unless someone edits the store by hand)."""
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
