"""What an SQLite error means for the user: a damaged index (`DamagedDatabase`), a lock held too long, a
full disk, a store that cannot be written or read, each one line (exit 2); anything else is a bug of ours."""

from __future__ import annotations

import functools
import re
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from kvchat.errors import KvchatError, UserError
from kvchat.messages import command
from kvchat.store.files import is_disk_full, nearly_full

BUSY_TIMEOUT_MS = 30_000
FREES_SPACE = f"`{command('rm', 'NAME')}` and `{command('doctor', fix=True)}` still run on a full disk"

_DECODE_RE = re.compile(r"Could not decode to UTF-8 column '([^']*)'")


class DamagedDatabase(UserError):
    """kvchat.db cannot serve as the index: unreadable, corrupt, not kvchat's, or rows that fail their
    digest. `what` says how; the message says what to run."""

    def __init__(self, db_path: Path, what: str) -> None:
        self.what = " ".join(what.split())[:200]
        super().__init__(
            f"{db_path} is damaged ({self.what}); `{command('doctor')}` says what can be rebuilt from the cache "
            f"files, `{command('doctor', fix=True)}` rebuilds it (keeping the damaged file)"
        )


class ConversationChanged(UserError):
    """Another kvchat process wrote or removed a conversation while this one read or extended it: what this
    one built is dropped, never committed over the other's (no lost update), and the user runs it again."""

    def __init__(self, shown_name: str) -> None:
        super().__init__(
            f"conversation {shown_name} was changed by another kvchat process while this command worked on it; "
            "nothing was written: run the command again"
        )


def database_error(db_path: Path, e: sqlite3.Error) -> KvchatError | None:
    """What an SQLite error means for the user: a damaged index, a lock held too long, a full disk, a
    store that cannot be written or read. None: an error of ours (a bug), to be raised as it is."""
    name = getattr(e, "sqlite_errorname", None) or ""
    text = str(e)
    if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")):
        return UserError(f"{db_path} stayed locked by another kvchat process for over {BUSY_TIMEOUT_MS / 1000:g} s; "
                         "try again when it is done")  # fmt: skip
    if is_disk_full(e):
        return UserError(f"disk full: no room to write {db_path}; free space on the disk of {db_path.parent} "
                         f"({FREES_SPACE})")
    if name.startswith("SQLITE_READONLY"):
        return UserError(f"{db_path} cannot be written ({text})")
    if name.startswith("SQLITE_IOERR"):
        if nearly_full(db_path.parent):  # SQLite could not create its WAL files: it says only "disk I/O error"
            return UserError(f"disk full: cannot open {db_path} (SQLite needs room for its journal); free space "
                             f"on the disk of {db_path.parent} ({FREES_SPACE})")
        return UserError(f"cannot read or write {db_path}: disk I/O error")
    if name.startswith("SQLITE_CANTOPEN"):
        return UserError(f"cannot open {db_path} ({text})")
    decode = _DECODE_RE.search(text)
    if decode:
        return DamagedDatabase(db_path, f"column {decode.group(1)!r} holds text that is not UTF-8")
    if name.startswith(("SQLITE_CORRUPT", "SQLITE_NOTADB")):
        return DamagedDatabase(db_path, text)
    if text.startswith(("no such table", "no such column")):
        return DamagedDatabase(db_path, f"its tables are not kvchat's: {text}")
    return None


_F = TypeVar("_F", bound=Callable[..., Any])


def index_errors(method: _F) -> _F:
    """SQLite errors from a method of an object with a `db_path`, as `database_error` words them."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except sqlite3.Error as e:
            meant = database_error(self.db_path, e)
            if meant is None:
                raise
            raise meant from e

    return wrapper  # type: ignore[return-value]  # functools.wraps: the method's own signature
