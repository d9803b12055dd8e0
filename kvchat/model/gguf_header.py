"""A GGUF file's header walked without trusting it, before the gguf package reads it.

gguf's reader builds a Python list for every metadata array as long as the count the file claims, so
a 40-byte file claiming 2^40 elements grows memory until the OOM killer. Here every count and length
is checked against the bytes left in the file before it is used, and nothing is allocated from it.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

MAGIC = b"GGUF"
MAX_DIMS = 8  # ggml allows 4; a little room, not 2^32

_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # value type -> bytes
_STRING, _ARRAY = 8, 9
_MIN_SIZE = {**_FIXED, _STRING: 8, _ARRAY: 12}  # the least bytes one value of each type takes


class BadHeader(ValueError):
    """The header claims more than the file holds, or a type GGUF has not."""


def check_gguf_header(path: Path, f) -> None:
    """Walk the header of the open GGUF file `f` (a regular file); BadHeader naming the first problem."""
    size = f.seek(0, 2)
    if size < 24:
        raise BadHeader("the file is too short for a GGUF header")
    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        _Walker(data, size).header()


class _Walker:
    def __init__(self, data, size: int) -> None:
        self.data, self.size, self.at, self.order = data, size, 4, "<"

    def header(self) -> None:
        (version,) = struct.unpack_from("<I", self.data, 4)
        if version & 0xFFFF == 0:  # written on a big-endian machine
            self.order = ">"
        self.at = 8
        tensors, pairs = self.number("Q"), self.number("Q")
        self.bound(pairs, 8 + 4, "metadata entries")
        for _ in range(pairs):
            self.string()
            self.value(self.number("I"))
        self.bound(tensors, 8 + 4 + 4 + 8, "tensors")
        for _ in range(tensors):
            self.string()
            dims = self.number("I")
            if dims > MAX_DIMS:
                raise BadHeader(f"a tensor claims {dims} dimensions")
            self.skip(8 * dims, "tensor dimensions")
            self.skip(4 + 8, "tensor type and offset")

    def number(self, code: str) -> int:
        width = struct.calcsize(code)
        if self.at + width > self.size:
            raise BadHeader("the header runs past the end of the file")
        (value,) = struct.unpack_from(self.order + code, self.data, self.at)
        self.at += width
        return value

    def bound(self, count: int, least: int, what: str) -> None:
        """`count` items of at least `least` bytes each must fit in what is left of the file."""
        if count * least > self.size - self.at:
            raise BadHeader(f"the header claims {count} {what}, more than the file's {self.size} bytes hold")

    def skip(self, n: int, what: str) -> None:
        if n > self.size - self.at:
            raise BadHeader(f"{what} run past the end of the file")
        self.at += n

    def string(self) -> None:
        self.skip(self.number("Q"), "a string")

    def value(self, kind: int) -> None:
        if kind in _FIXED:
            self.skip(_FIXED[kind], "a value")
        elif kind == _STRING:
            self.string()
        elif kind == _ARRAY:
            item, count = self.number("I"), self.number("Q")
            if item not in _MIN_SIZE:
                raise BadHeader(f"an array of unknown value type {item}")
            self.bound(count, _MIN_SIZE[item], "array elements")
            if item in _FIXED:
                self.skip(count * _FIXED[item], "an array")
            else:
                for _ in range(count):
                    self.value(item)
        else:
            raise BadHeader(f"unknown metadata value type {kind}")
