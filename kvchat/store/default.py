"""The conversation `kvchat use NAME` chose: the name in a one-line file in the home, beside `kvchat.db`.

A file, not a table: choosing a default is no change to any conversation, needs no schema version (an older
kvchat ignores the file), and a rebuilt database keeps it. A name that no longer names a stored conversation
is no choice: the store then falls back to the latest ingested (`Store.default`).
"""

from __future__ import annotations

import os
from pathlib import Path

from kvchat.checked_files import FileMismatch, read_bounded
from kvchat.errors import UserError
from kvchat.store.files import fsync_dir, rename, write_file
from kvchat.store.layout import validate_name

DEFAULT_NAME = "default-conversation"
_MAX_BYTES = 256  # a name is at most 100 characters; anything longer is not one of ours


def read_default(home: Path) -> str | None:
    """The chosen name, or None when none was chosen (or the file is not a name kvchat wrote)."""
    try:
        return validate_name(read_bounded(home / DEFAULT_NAME, _MAX_BYTES).decode("utf-8").strip())
    except (OSError, FileMismatch, UnicodeDecodeError, UserError):  # a FIFO in its place is not read, never waited on
        return None


def write_default(home: Path, name: str) -> None:
    """Choose `name` (a stored conversation's, checked by the caller), atomically: a reader sees the old or new."""
    temp = home / f".{DEFAULT_NAME}.{os.getpid()}"
    temp.unlink(missing_ok=True)  # a leftover of a crashed choice by a process of the same id
    try:
        write_file(temp, (validate_name(name) + "\n").encode("utf-8"))
        rename(temp, home / DEFAULT_NAME)
    finally:
        temp.unlink(missing_ok=True)
    fsync_dir(home)


def forget_default(home: Path, name: str) -> None:
    """No default any more if it was `name` (a removed conversation: a later one of that name is not chosen)."""
    if read_default(home) == name:
        (home / DEFAULT_NAME).unlink(missing_ok=True)
