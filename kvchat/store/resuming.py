"""Beginning an ingest that may be resumed: the unfinished ingest of its name continued when it is the same ingest,
else discarded (saying so), and a resumable dir made (kvchat.store.resumable holds the dir's parts)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kvchat.errors import UserError
from kvchat.store.layout import show
from kvchat.store.pending import PendingConversation
from kvchat.store.resumable import Identity, claim, create, resumable_path, summary

if TYPE_CHECKING:
    from kvchat.store import Store

_OTHER = "it was made from another history, with other settings or by another model"


def begin_resumable(
    store: Store, name: str, replace: bool, identity: Identity, resume: bool | None, *,
    write_file: Callable[[Path, bytes], None],
) -> PendingConversation:  # fmt: skip
    """`Store.begin` of an ingest that may be resumed (see there): its dir continued, replaced or made. Another
    process writing that dir leaves this ingest a private temp dir, not resumable, as any other ingest's."""
    path, found = resumable_path(store.caches_dir, name), None
    if path.is_dir() and not path.is_symlink():
        held = claim(path)
        if held is None:  # another process is writing it: this one cannot share it
            if resume:
                raise UserError(f"the unfinished ingest of {show(name)} is being continued by another process")
            return _apart(store, name, replace, write_file)
        done, worked = summary(path)
        same = held.identity is not None and held.identity["key"] == identity.key
        if same and resume is not False:
            return PendingConversation(store, name, replace, write_file=write_file, claim=held)
        if resume:
            held.release()
            raise UserError(f"the unfinished ingest of {show(name)} ({done}) cannot be continued: {_OTHER}")
        held.discard(store.caches_dir)
        if worked:
            found = f"discarded the unfinished ingest of {show(name)} ({done}): " + ("asked to start over" if same
                                                                                      else _OTHER)  # fmt: skip
    elif resume:
        raise UserError(f"no unfinished ingest of {show(name)} to continue")
    held = create(store.caches_dir, name, identity, uuid.uuid4().hex)
    if held is None:  # another process made one meanwhile
        return _apart(store, name, replace, write_file)
    return PendingConversation(store, name, replace, write_file=write_file, claim=held, found=found)


def _apart(store: Store, name: str, replace: bool, write_file: Callable[[Path, bytes], None]) -> PendingConversation:
    return PendingConversation(store, name, replace, write_file=write_file,
                               found=f"another ingest of {show(name)} is running: this one is not resumable")
