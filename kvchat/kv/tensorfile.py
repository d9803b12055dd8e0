"""Safetensors files written tensor by tensor and read row by row.

Why not `safetensors.torch.save`: it serialises a dict of tensors held in memory together, and a pages
file holds as many entries as the full KV of its episode. `SafetensorsWriter` streams each tensor's
bytes to a sidecar file as it arrives, then writes the header and the data (the safetensors layout: a
little-endian u64 header length, a JSON header padded with spaces to 8 bytes, the tensors' bytes
tiling the rest). Tensors are laid out by element size, largest first, so every tensor starts at a
multiple of its element size. The result loads with `safetensors.safe_open` and `safetensors.torch.load`.

`open_tensors` reads such a file back as `FileRows`: nothing is read from disk until rows are gathered, and
then only those rows, with bounded reads (`os.pread`) whose length is checked. Not a memory map: a mapped
file truncated by another process kills the reader with SIGBUS when it touches a page past the new end; a
short read raises `ShrunkFile`, which the caller turns into a message.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from kvchat.checked_files import FileMismatch, open_regular, read_safetensors_header

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
_TORCH = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
_COPY_CHUNK = 1 << 20
_GAP_BYTES = 4096  # rows closer than a disk page are read in one call


def safetensors_bytes(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> bytes:
    """A safetensors file of `tensors` and `metadata`, the same bytes for the same tensors and metadata in any
    process: the metadata's keys sorted, the tensors by element size (largest first, so each starts at a multiple of
    it) then name. (safetensors' own `save` writes the metadata in a hash map's order, which changes from call to
    call: an episode written twice would differ, and a resumed or spread ingest could not be compared with one that
    was not.)"""
    header: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}
    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    blobs, offset = [], 0
    for name in sorted(cpu, key=lambda n: (-cpu[n].element_size(), n)):
        tensor = cpu[name]
        data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(data)]}  # fmt: skip
        blobs.append(data)
        offset += len(data)
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)
    return b"".join([struct.pack("<Q", len(encoded)), encoded, *blobs])


class SafetensorsWriter:
    """Write `path` one tensor at a time; `finish(metadata)` makes it whole. Memory: one tensor at a time.

    Until `finish` the data sits in `<path>.<element size>.part` files beside `path`; `discard` (or a
    failed `finish`) removes them. `finish` fsyncs the file and returns its size and sha256.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._parts: dict[int, tuple[Path, BinaryIO]] = {}
        self._tensors: dict[int, list[tuple[str, str, list[int], int]]] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name == "__metadata__" or any(name == t[0] for ts in self._tensors.values() for t in ts):
            raise ValueError(f"tensor name {name!r} is reserved or already written")
        t = tensor.detach().to("cpu").contiguous()
        size = t.element_size()
        if size not in self._parts:
            part = self.path.with_name(f"{self.path.name}.{size}.part")
            self._parts[size] = (part, open(part, "wb"))  # closed in finish/discard
            self._tensors[size] = []
        data = t.reshape(-1).view(torch.uint8).numpy()
        self._parts[size][1].write(data.tobytes())
        self._tensors[size].append((name, SAFETENSORS_DTYPES[t.dtype], list(t.shape), data.nbytes))

    def finish(self, metadata: Mapping[str, str]) -> tuple[int, str]:
        """Write header and data to `path`, fsync it; returns (bytes, sha256 hex)."""
        try:
            header: dict[str, Any] = {"__metadata__": dict(metadata)}
            offset = 0
            for size in sorted(self._tensors, reverse=True):
                for name, dtype, shape, nbytes in self._tensors[size]:
                    header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
                    offset += nbytes
            encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
            encoded += b" " * (-len(encoded) % 8)
            digest = hashlib.sha256()
            with open(self.path, "wb") as out:
                for chunk in (struct.pack("<Q", len(encoded)), encoded):
                    out.write(chunk)
                    digest.update(chunk)
                for size in sorted(self._parts, reverse=True):
                    part, handle = self._parts[size]
                    handle.close()
                    with open(part, "rb") as src:
                        while chunk := src.read(_COPY_CHUNK):
                            out.write(chunk)
                            digest.update(chunk)
                out.flush()
                os.fsync(out.fileno())
            return 8 + len(encoded) + offset, digest.hexdigest()
        finally:
            self.discard(keep_file=True)

    def discard(self, *, keep_file: bool = False) -> None:
        """Remove the part files (and `path` unless `keep_file`)."""
        for part, handle in self._parts.values():
            handle.close()
            part.unlink(missing_ok=True)
        self._parts.clear()
        if not keep_file:
            self.path.unlink(missing_ok=True)


class RowWriter:
    """A safetensors file whose tensors' shapes are known before their rows: the header is written first and the
    file sized, then rows are written in place as they come (`write`), in any order. Memory: the rows in hand,
    whatever the file's size. `finish` fsyncs it and returns its size and sha256 (read back: the rows arrive out
    of the file's order); `discard` (or a failed `finish`) removes it."""

    def __init__(self, path: Path, shapes: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
                 metadata: Mapping[str, str], *, resume: bool = False) -> None:  # fmt: skip
        """A new file at `path` (one there is replaced); with `resume`, the file already there, kept as it is if
        it has this header and size (the rows written into it so far stay), else made new (`resumed` says which)."""
        self.path = Path(path)
        header: dict[str, Any] = {"__metadata__": dict(metadata)}
        self._places: dict[str, tuple[int, torch.dtype, tuple[int, ...]]] = {}
        offset = 0
        for name, (dtype, shape) in sorted(shapes.items(), key=lambda item: -item[1][0].itemsize):  # aligned
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}  # fmt: skip
            self._places[name] = (offset, dtype, tuple(shape))
            offset += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
        encoded += b" " * (-len(encoded) % 8)
        self._data_start, self.size = 8 + len(encoded), 8 + len(encoded) + offset
        head = struct.pack("<Q", len(encoded)) + encoded
        self.resumed = resume and _holds(self.path, head, self.size)
        flags = os.O_RDWR if self.resumed else os.O_RDWR | os.O_CREAT | os.O_TRUNC
        self._fd = os.open(self.path, flags | getattr(os, "O_NOFOLLOW", 0), 0o644)
        if self.resumed:
            return
        try:
            os.pwrite(self._fd, head, 0)
            os.ftruncate(self._fd, self.size)
        except BaseException:
            self.discard()
            raise

    def write(self, name: str, first_row: int, rows: torch.Tensor) -> None:
        """`rows` written as tensor `name`'s rows from `first_row` (along dim 0)."""
        offset, dtype, shape = self._places[name]
        if rows.dtype != dtype or tuple(rows.shape[1:]) != shape[1:] or not 0 <= first_row <= shape[0] - len(rows):
            raise ValueError(f"rows {first_row}..{first_row + len(rows)} {tuple(rows.shape)} {rows.dtype} do not fit "
                             f"tensor {name!r} {list(shape)} {dtype}")  # fmt: skip
        data = rows.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        at = self._data_start + offset + first_row * (math.prod(shape[1:]) * dtype.itemsize)
        while data:
            written = os.pwrite(self._fd, data, at)
            data, at = data[written:], at + written

    def finish(self) -> tuple[int, str]:
        """fsync the file; returns (bytes, sha256 hex)."""
        try:
            os.fsync(self._fd)
            digest = hashlib.sha256()
            at = 0
            while chunk := os.pread(self._fd, _COPY_CHUNK, at):
                digest.update(chunk)
                at += len(chunk)
            os.close(self._fd)
            self._fd = -1
            return self.size, digest.hexdigest()
        except BaseException:
            self.discard()
            raise

    def sync(self) -> None:
        """Make the rows written so far durable (fsync)."""
        os.fsync(self._fd)

    def close(self) -> None:
        """Close the file and keep it as it is (its rows so far: a resumable ingest's, continued later)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def discard(self) -> None:
        """Close and remove the file."""
        self.close()
        self.path.unlink(missing_ok=True)


def _holds(path: Path, head: bytes, size: int) -> bool:
    """Whether `path` is a regular file of `size` bytes beginning with `head` (a `RowWriter`'s header)."""
    try:
        with open_regular(path) as f:
            return os.fstat(f.fileno()).st_size == size and f.read(len(head)) == head
    except (OSError, FileMismatch):
        return False


def open_tensors(path: Path, header: Mapping[str, Any] | None = None) -> tuple[dict[str, FileRows], dict[str, str]]:
    """Every tensor of a safetensors file as `FileRows` over one open read-only descriptor, and the metadata.
    `header`: the file's, already checked (`checked_files.read_safetensors_header`, which reads it when not given).
    Raises ValueError when a tensor's span does not fit the file or its shape."""
    header = read_safetensors_header(path) if header is None else header
    file = open(path, "rb", buffering=0)  # noqa: SIM115 - shared by the FileRows, closed when the last is collected
    try:
        (n,) = struct.unpack("<Q", os.pread(file.fileno(), 8, 0))
        data_start, size = 8 + n, os.fstat(file.fileno()).st_size
        tensors = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            dtype = _TORCH.get(info["dtype"])
            if dtype is None:
                raise ValueError(f"tensor {name!r}: dtype {info['dtype']!r} cannot be read")
            if not 0 <= begin <= end <= size - data_start:
                raise ValueError(f"tensor {name!r} lies outside the file")
            shape = tuple(int(d) for d in info["shape"])
            if math.prod(shape) * dtype.itemsize != end - begin:
                raise ValueError(f"tensor {name!r}: shape {list(shape)} does not fill its {end - begin} bytes")
            tensors[name] = FileRows(file, data_start + begin, shape, dtype)
    except BaseException:
        file.close()
        raise
    return tensors, dict(header.get("__metadata__", {}))


class ShrunkFile(OSError):
    """A file held fewer bytes than its header promised when rows were read: it was truncated after it was
    checked."""


class FileRows:
    """A tensor's rows (along dim 0) in an open file, read only when gathered, with bounded reads.

    `index_select(0, rows)` (and indexing by a tensor) reads just those rows, one `os.pread` per run of nearby
    rows; a slice is another `FileRows`, nothing read. Any other tensor use (`torch.equal`, `.to(...)`,
    `.argsort()`) reads the whole tensor first (`read`). A read that returns fewer bytes than it asked raises
    `ShrunkFile`.
    """

    def __init__(self, file: BinaryIO, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self._file, self._offset, self.shape, self.dtype = file, offset, torch.Size(shape), dtype
        self._row_shape = tuple(shape[1:])
        self._row_bytes = math.prod(self._row_shape) * dtype.itemsize

    device = torch.device("cpu")

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return math.prod(self.shape)

    def dim(self) -> int:
        return self.ndim

    def __len__(self) -> int:
        return self.shape[0]

    def read(self) -> torch.Tensor:
        """The whole tensor, in memory."""
        nbytes = self.numel() * self.dtype.itemsize
        return self._bytes_as_tensor(self._pread(nbytes, self._offset), self.shape)

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` (1-D) as a tensor `[len(index), *row]`; only they are read."""
        if dim != 0 or self.ndim == 0:
            return self.read().index_select(dim, index)
        rows = index.detach().to("cpu", torch.long).numpy()
        if rows.size and (rows.min() < 0 or rows.max() >= self.shape[0]):
            raise IndexError(f"rows {rows.min()}..{rows.max()} outside a tensor of {self.shape[0]} rows")
        wanted, inverse = np.unique(rows, return_inverse=True)
        # Runs of rows less than _GAP_BYTES apart are read as one: fewer calls, a few rows read in vain.
        gap = max(1, _GAP_BYTES // max(1, self._row_bytes))
        breaks = np.flatnonzero(np.diff(wanted) > gap) + 1
        chunks, local, read_rows, done = [], np.empty(wanted.shape[0], dtype=np.int64), 0, 0
        for run in np.split(wanted, breaks) if wanted.size else ():
            first, last = int(run[0]), int(run[-1]) + 1
            chunks.append(self._pread((last - first) * self._row_bytes, self._offset + first * self._row_bytes))
            local[done : done + run.size] = read_rows + run - first
            read_rows, done = read_rows + last - first, done + run.size
        buffer = self._bytes_as_tensor(b"".join(chunks), (read_rows, *self._row_shape))
        return buffer.index_select(0, torch.from_numpy(local[inverse.reshape(-1)]))

    def __getitem__(self, key: Any) -> FileRows | torch.Tensor:
        if isinstance(key, slice) and key.step in (None, 1) and self.ndim:
            first, last, _ = key.indices(self.shape[0])
            last = max(first, last)
            return FileRows(self._file, self._offset + first * self._row_bytes,
                            (last - first, *self._row_shape), self.dtype)  # fmt: skip
        if isinstance(key, torch.Tensor) and key.dtype == torch.long and key.ndim == 1:
            return self.index_select(0, key)
        return self.read()[key]

    def __getattr__(self, name: str) -> Any:  # any other tensor method: on the tensor read whole
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.read(), name)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # torch.equal(rows, t), torch.cat([...]) ...
        return func(*_read_all(args), **{k: _read_all(v) for k, v in (kwargs or {}).items()})

    def __repr__(self) -> str:
        return f"FileRows(shape={list(self.shape)}, dtype={self.dtype}, file={self._file.name!r})"

    def _pread(self, nbytes: int, offset: int) -> bytes:
        data = os.pread(self._file.fileno(), nbytes, offset)
        if len(data) != nbytes:
            raise ShrunkFile(f"{self._file.name} holds fewer bytes than its header says (it was truncated)")
        return data

    def _bytes_as_tensor(self, data: bytes, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
        if not data:
            return torch.zeros(shape, dtype=self.dtype)
        return torch.frombuffer(bytearray(data), dtype=self.dtype).reshape(shape)


def _read_all(value: Any) -> Any:
    if isinstance(value, FileRows):
        return value.read()
    if isinstance(value, list | tuple):
        return type(value)(_read_all(v) for v in value)
    return value

