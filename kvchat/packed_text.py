"""Long values of an episode file's metadata, which safetensors keeps as strings: deflated, then base85.

Turn spans (kvchat.history.spans) and the recall index (kvchat.answer.recall) repeat keys and text; deflated they cost a
small share of a cache file. A packed value starts with `PREFIX`, so a reader tells it from plain JSON written
before packing existed.
"""

from __future__ import annotations

import base64
import zlib

PREFIX = "zlib85:"


def pack(raw: bytes) -> str:
    return PREFIX + base64.b85encode(zlib.compress(raw, 9)).decode("ascii")


def unpack(value: str, limit: int) -> bytes:
    """The bytes `pack` stored (a value without the prefix: its UTF-8), at most `limit` of them inflated: a
    damaged or hostile value cannot inflate without bound. ValueError when it does not decode."""
    if not value.startswith(PREFIX):
        return value.encode()
    try:
        inflater = zlib.decompressobj()
        raw = inflater.decompress(base64.b85decode(value[len(PREFIX):]), limit)
    except (ValueError, zlib.error) as e:
        raise ValueError(f"packed metadata does not decode ({e})") from None
    if inflater.unconsumed_tail:
        raise ValueError(f"packed metadata inflates beyond {limit} bytes")
    return raw
