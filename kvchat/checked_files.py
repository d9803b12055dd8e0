"""Reading a file kvchat did not write, or may find damaged, without trusting it: opened only if it is a
regular file (a FIFO in its place would block a plain open forever), read only up to a bound, and a
safetensors header checked by hand before anything is allocated by what it claims.

Below every layer that opens files (the store, model loading, layer profiles, IndexMem weights).
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from pathlib import Path
from typing import Any

MAX_HEADER_BYTES = 100_000_000

# Bytes per element of every dtype safetensors' torch loader understands.
_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "C64": 8,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
    "F8_E4M3": 1, "F8_E4M3FNUZ": 1, "F8_E5M2": 1, "F8_E5M2FNUZ": 1,
}  # fmt: skip



class FileMismatch(Exception):
    """A stored file is not the one that was committed. `kind` is the doctor's name for how
    (outside | missing | not-a-file | size | checksum); the message says it, to follow "episode N"."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def open_regular(path: Path):
    """`path` opened for reading if it is a regular file; FileMismatch("not-a-file") otherwise.

    Opened without blocking and checked on the open descriptor: a FIFO put in a file's place would block a
    plain open forever (until something writes to it), and checking before opening leaves a window for the swap.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise FileMismatch("not-a-file", f"is not a regular file but a {file_type(mode)} ({path})")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bounded(path: Path, limit: int) -> bytes:
    """The bytes of `path` if it is a regular file of at most `limit` bytes: FileMismatch ("not-a-file",
    "size") otherwise, before anything blocks or is allocated by the file's size."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise FileMismatch("size", f"is {size} bytes, more than the {limit} such a file can hold ({path})")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise FileMismatch("size", f"grew past {limit} bytes while being read ({path})")
    return data


def file_type(mode: int) -> str:
    """What a non-regular file is, in words."""
    kinds = ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
             (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"))  # fmt: skip
    return next((name for test, name in kinds if test(mode)), "special file")


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The checked header (`check_safetensors_header`) of the safetensors file `path`, read with bounded reads
    of its first bytes (a regular file only): the file is neither read whole nor memory-mapped."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        if len(prefix) == 8 and (n := struct.unpack("<Q", prefix)[0]) <= min(size, MAX_HEADER_BYTES):
            prefix += f.read(n)
    return check_safetensors_header(prefix, size=size)


def check_safetensors_header(data: bytes, *, size: int | None = None) -> dict[str, Any]:
    """Parse and validate a safetensors header without trusting it; return the header dict. `data` is the
    file's bytes, or at least its header's when `size` gives the file's size.

    Raises ValueError naming the first problem. A header must not be able to make the loader
    allocate more than the file holds, so every tensor's byte span must lie inside the data
    section, match dtype x shape exactly, and the spans must tile the data section.
    """
    size = len(data) if size is None else size
    if size < 8 or len(data) < 8:
        raise ValueError("file is too short for a safetensors header")
    (n,) = struct.unpack("<Q", data[:8])
    if n > MAX_HEADER_BYTES:
        raise ValueError(f"header claims {n} bytes (limit {MAX_HEADER_BYTES})")
    if 8 + n > min(size, len(data)):
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
