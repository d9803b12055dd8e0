"""Safetensors files written tensor by tensor and read memory-mapped.

Why not `safetensors.torch.save`: it serialises a dict of tensors held in memory together, and a pages
file holds as many entries as the full KV of its episode. `SafetensorsWriter` streams each tensor's
bytes to a sidecar file as it arrives, then writes the header and the data (the safetensors layout: a
little-endian u64 header length, a JSON header padded with spaces to 8 bytes, the tensors' bytes
tiling the rest). Tensors are laid out by element size, largest first, so every tensor starts at a
multiple of its element size. The result loads with `safetensors.safe_open` and `safetensors.torch.load`.

`map_tensors` reads such a file back as zero-copy tensors over a private memory map: nothing is read
from disk until a tensor's elements are touched, and nothing can write to the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
_NUMPY = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
          "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_COPY_CHUNK = 1 << 20


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


def read_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (the caller validates it, e.g. against the file's size)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n).decode("utf-8"))


def map_tensors(path: Path, header: Mapping[str, Any] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of a safetensors file as a view of a private read-only-in-effect memory map
    (copy-on-write, so the file is never written), and the metadata. Raises ValueError when a tensor's
    span does not fit the file or its shape."""
    header = read_header(path) if header is None else header
    mapped = np.memmap(path, dtype=np.uint8, mode="c")
    (n,) = struct.unpack("<Q", bytes(mapped[:8]))
    data = mapped[8 + n :]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        dtype = _NUMPY.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"tensor {name!r}: dtype {info['dtype']!r} cannot be memory-mapped")
        if not 0 <= begin <= end <= data.shape[0]:
            raise ValueError(f"tensor {name!r} lies outside the file")
        tensors[name] = torch.from_numpy(data[begin:end].view(dtype).reshape(info["shape"]))
    return tensors, dict(header.get("__metadata__", {}))

