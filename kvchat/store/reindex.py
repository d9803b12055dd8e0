"""The files are the truth, kvchat.db an index of them: conversations on disk that the database does not list.

Every ingest dir carries its manifest (`conversation.json`: the conversation as one document, `manifest`).
A dir whose manifest is valid is a conversation, never a leftover: when kvchat.db is missing, restored from a
backup or copied from an older home, the newest such dir of each name that the database does not list, or
lists in an older version, goes back into it (`Store` on open, `doctor --fix`). Nothing carrying a valid
manifest is ever deleted automatically; an older version of a conversation that a crashed `--replace` left
beside the new one stays where it is.

A dir is looked at only once it is older than the grace the caller gives (0 under the write lock): an
ingest renames its dir into place and inserts its rows in one write transaction, so under the lock no dir is
between the two, and outside it a young dir may be one that is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from kvchat.store.leftovers import older_than, real_subdirs
from kvchat.store.manifest import manifest_of


@dataclass(frozen=True)
class Version:
    """One ingest dir of a conversation that kvchat.db does not list, and its document."""

    path: Path
    document: dict

    @property
    def name(self) -> str:
        return self.document["name"]


def unlisted_versions(caches_dir: Path, listed: dict[str, tuple[str, str]], *, grace_s: float) -> list[Version]:
    """Ingest dirs with a valid manifest that no row lists, older than `grace_s`. `listed`: name -> the
    (ingest_id, created_at) of its row."""
    cutoff = time.time() - grace_s if grace_s > 0 else None
    referenced = {ingest_id for ingest_id, _ in listed.values()}
    found = []
    for name_dir in real_subdirs(caches_dir):
        if name_dir.name.startswith("."):
            continue
        for child in real_subdirs(name_dir):
            if child.name in referenced or not older_than(child, cutoff):
                continue
            doc = manifest_of(child)
            if doc is not None:
                found.append(Version(child, doc))
    return found


def newer_than_listed(versions: list[Version], listed: dict[str, tuple[str, str]]) -> list[Version]:
    """Of `versions`, the newest of each name, where kvchat.db lists none of that name or an older one:
    what the database lacks."""
    newest: dict[str, Version] = {}
    for version in versions:
        best = newest.get(version.name)
        if best is None or version.document["created_at"] > best.document["created_at"]:
            newest[version.name] = version
    return sorted(
        (v for name, v in newest.items() if name not in listed or v.document["created_at"] > listed[name][1]),
        key=lambda v: v.name,
    )
