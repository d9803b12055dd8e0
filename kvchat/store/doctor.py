"""The doctor's look at a store it could open (`kvchat doctor`, `--fix`): is kvchat.db sound, does every file of
every conversation verify, and what lies in caches/ and models/ that nothing refers to. `Store.check`,
`Store.fix` and `Store.database_damage` are these functions; a kvchat.db too damaged to open is `recovery`'s.
"""

from __future__ import annotations

import sqlite3
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from kvchat.checked_files import file_type
from kvchat.store.asklog import MAX_LISTED
from kvchat.store.errors import DamagedDatabase, database_error
from kvchat.store.files import FileMismatch, verify_file, without_links
from kvchat.store.layout import show
from kvchat.store.leftovers import (
    FIX,
    ORPHAN_GRACE_S,
    Problem,
    delete_leftovers,
    delete_trees,
    leftovers,
    model_leftovers,
)
from kvchat.store.manifest import MANIFEST_NAME
from kvchat.store.reindex import newer_than_listed, unlisted_versions

if TYPE_CHECKING:
    from kvchat.store import Store


_SHOWN = {"cache": "", "recall entries": " recall entries file"}  # a file's `what` in a problem's message


def database_damage(store: Store) -> str | None:
    """How kvchat.db is damaged (SQLite's integrity check, rows against their digests, the ask log
    read through), or None when it is sound. Reads only: no lock."""
    try:
        result = [row[0] for row in store._db.execute("PRAGMA quick_check").fetchall()]
        if result != ["ok"]:
            return f"integrity check: {result[0]}"
        store.conversations()
        store.asks(limit=MAX_LISTED)
    except DamagedDatabase as e:
        return e.what
    except sqlite3.DatabaseError as e:
        meant = database_error(store.db_path, e)
        return meant.what if isinstance(meant, DamagedDatabase) else str(e)
    return None


def check(store: Store, *, embedding_dimension: int | None = None) -> list[Problem]:
    """Everything wrong with the files of this home, changing nothing (`kvchat doctor`; the database
    itself is `database_damage`'s).

    Damaged conversations: a file of one (an episode's cache or pages file, its recall entries file) missing,
    not a regular file, of the wrong size, or failing its checksum (a flipped byte, a truncation, another
    conversation's file swapped in). Conversations on disk that kvchat.db lacks or lists in an older version
    ("unlisted", `reindex`). Leftovers:
    ingest dirs no row refers to, stray files, temp dirs of dead processes (ingests and model
    conversions). Takes no lock: an ingest dir younger than `ORPHAN_GRACE_S` that no row refers to yet
    may be an ingest committing right now, and is left for a later look.
    """
    problems: list[Problem] = []
    for conversation in store.conversations():
        owner = {path: e.index for e in conversation.episodes for path, *_ in e.files()}
        for path, size, sha256, what in conversation.files():
            found = _file_problem(store.caches_dir, path, size, sha256)
            if found is not None:
                kind, wrong = found
                episode = owner.get(path)
                where = f" episode {episode}" if episode is not None else ""
                shown = _SHOWN.get(what, f" {what}")
                problems.append(Problem(
                    kind, conversation.name, episode, path,
                    f"conversation {show(conversation.name)}{where}{shown} {wrong}; {FIX} removes the conversation",
                ))  # fmt: skip
    if problems:  # an `rm` or `--replace` may have retired those files while we hashed them
        current = {(c.name, path) for c in store.conversations() for path, *_ in c.files()}
        problems = [p for p in problems if (p.conversation, p.path) in current]
    problems += _centroid_problems(store, embedding_dimension) if embedding_dimension is not None else []
    listed = store._listed()
    problems += [
        Problem("unlisted", None, None, v.path,
                f"conversation {show(v.name)} in {v.path} is missing from kvchat.db or listed in an older version (a "
                f"missing, older or restored database); {FIX} lists it again from its manifest, as the next "
                "command does")
        for v in newer_than_listed(unlisted_versions(store.caches_dir, listed, grace_s=ORPHAN_GRACE_S), listed)
    ]  # fmt: skip
    return problems + leftovers_of(store, grace_s=ORPHAN_GRACE_S) + special_profiles(store.home / "profiles")


def special_profiles(directory: Path) -> list[Problem]:
    """FIFOs, sockets and devices where ingest looks for layer profiles and IndexMem weights: ingest refuses
    them (a blocking open would hang it), so they are problems; `fix` removes them (links, not targets)."""
    found = []
    for path in sorted(directory.iterdir()) if directory.is_dir() else []:
        try:
            mode = path.stat().st_mode
        except OSError:
            continue
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            found.append(Problem("special-file", None, None, path,
                                 f"{path} is not a regular file but a {file_type(mode)}: ingest refuses it; "
                                 f"{FIX} removes it"))  # fmt: skip
    return found


def fix(store: Store, problems: Iterable[Problem]) -> list[str]:
    """Repair what `check` found; returns one line per action taken.

    A damaged conversation is removed whole (rows first, then files): a partial conversation must
    never be visible, and its history can be ingested again (the line says how). A conversation kvchat.db
    lacks is listed again from its manifest. A leftover is deleted only if it is still one when looked at
    again under the write lock; nothing reached through a symbolic link is deleted.
    """
    problems = [p for p in problems if p.kind not in ("database", "lost")]  # `repair`'s to handle
    done: list[str] = []
    for name in sorted({p.conversation for p in problems if p.conversation is not None}):
        with store._db.atomic():
            row = store._row(name)
            named = [r.get(c) for r in store._episode_rows(name) for c in ("path", "pages_path")]
            paths = {store.home / p for p in [*named, (row or {}).get("recall_entries_path")] if p}
        damaged = {p.path for p in problems if p.conversation == name}
        if row is None or not paths & damaged:
            continue  # removed, or replaced by a new version, since `check`
        command = store._rebuild_hint(name, replace=False)
        if not store.remove(name, ingest_id=row["ingest_id"]):
            continue
        done.append(
            f"removed conversation {show(name)} (a damaged conversation is removed whole, never "
            f"kept partial); re-ingest it with `{command}`"
        )
    unlisted = {p.path for p in problems if p.kind == "unlisted"}
    wanted = {p.path for p in problems if p.conversation is None and p.kind != "unlisted"}
    for special in special_profiles(store.home / "profiles"):
        if special.path in wanted and without_links(special.path.parent, store.home):
            special.path.unlink(missing_ok=True)  # the entry itself: a link's target is left alone
            done.append(f"removed {special.path} (not a regular file)")
    with store._write_lock():
        done += [f"listed conversation {show(v.name)} again from its manifest ({v.path})"
                 for v in store._list_again(grace_s=0.0, only=unlisted)]  # fmt: skip
        found = [p for p in leftovers_of(store, grace_s=0.0) if p.path in wanted]
        lines, moved = delete_leftovers(store.caches_dir, found)
    done += lines
    delete_trees(moved)
    return done


def _centroid_problems(store: Store, dimension: int) -> list[Problem]:
    """Conversations whose centroids are not of the encoder's length `dimension` (a manifest re-signed after an
    edit, rows written by something else): every question would fail to route. Their digests check out, so only
    the length tells."""
    problems = []
    for c in store.conversations():
        lengths = sorted({len(e.centroid) for e in c.episodes})
        if c.episodes and lengths != [dimension]:
            problems.append(Problem(
                "centroids", c.name, 0, c.episodes[0].path,
                f"conversation {show(c.name)} has episode centroids of {'/'.join(map(str, lengths))} numbers where "
                f"the encoder's embeddings have {dimension}: no question can be routed; {FIX} removes the "
                "conversation",
            ))  # fmt: skip
    return problems


def _file_problem(caches_dir: Path, path: Path, size: int, sha256: str) -> tuple[str, str] | None:
    """(kind, what is wrong) for one file of a conversation, or None if it is the file that was committed."""
    try:
        verify_file(path, size, sha256, within=caches_dir)
    except FileMismatch as e:
        return e.kind, str(e)
    except OSError as e:
        return "unreadable", f"cannot be read ({e.strerror or e})"
    return None


def leftovers_of(store: Store, *, grace_s: float) -> list[Problem]:
    """What lies in caches/ that no row refers to and no live process writes, and models/' dead temp
    dirs. Exact under the write lock; without it, `grace_s` spares dirs an ingest may be committing."""
    with store._db.atomic():
        rows = list(store._db.query("select name, ingest_id from conversations"))
        live_files = {store.home / path for path in _listed_files(store)}
    live_dirs = {store.caches_dir / row["name"] / row["ingest_id"] for row in rows}
    live_files |= {d / MANIFEST_NAME for d in live_dirs}
    found = leftovers(store.caches_dir, live_dirs, live_files, grace_s=grace_s) if store.caches_dir.is_dir() else []
    return found + model_leftovers(store.models_dir)


_LISTED_FILES = ("select path from episodes union all select pages_path from episodes "
                 "union all select recall_entries_path from conversations")  # fmt: skip


def _listed_files(store: Store) -> list[str]:
    """Every file a row names (relative to the home): episode files, pages files, recall entries files."""
    return [row[0] for row in store._db.execute(_LISTED_FILES).fetchall() if row[0] is not None]


def lists(store: Store, path: Path) -> bool:
    """Whether a row still names `path` (else its version was replaced or removed)."""
    try:
        relative = path.relative_to(store.home).as_posix()
    except ValueError:
        return True
    query = ("select 1 from episodes where path = ? or pages_path = ? "
             "union all select 1 from conversations where recall_entries_path = ? limit 1")  # fmt: skip
    return bool(store._db.execute(query, [relative] * 3).fetchall())
