"""Leftovers in caches/ and models/: what crashed or interrupted processes leave behind, found (every open,
`kvchat doctor`) and removed without ever taking a file a live process may use.

Kept apart from the store proper: no read or write of a conversation needs it. It agrees with the store
on the layout (`caches/<name>/<ingest_id>`, temp dirs from `files.new_temp_path`, `models/.tmp-<pid>-*`,
where `kvchat.model.files.convert_gguf` writes a converted model, and `models/held/`, where
`kvchat.model.held_weights` keeps quantized weights) and on the lock:
a function marked "under the write lock" must run inside the store's write transaction, which a
committing ingest holds from its rename to its row commit, so a dir about to be committed is never taken
for an orphan. What goes is first renamed to a temp dir of this process and deleted after the lock is
released (`delete_trees`), so a crash mid-delete leaves only another stale temp dir.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kvchat.checked_files import read_safetensors_header
from kvchat.messages import option
from kvchat.store.files import new_temp_path, rename, temp_writer, try_rmdir, writer_alive
from kvchat.store.layout import HELD_DIR, HELD_SUFFIX, held_by_torch, held_source, made_from, show
from kvchat.store.manifest import manifest_of
from kvchat.store.resumable import RESUME_PREFIX, claim, idle, resumable_dirs, resumable_name, summary

ORPHAN_GRACE_S = 60.0
FIX = option("fix")  # what repairs a problem: a message's reference (kvchat.messages) to `doctor --fix`


@dataclass(frozen=True)
class Problem:
    """One thing `Store.check` found wrong.

    `conversation` is set when a stored conversation is damaged (`fix` removes it whole); it is None
    for leftovers that no row refers to (`fix` deletes them).
    """

    kind: str  # missing | not-a-file | size | checksum | outside | unreadable | orphan | stray | stale-temp
    #          | stale-held | special-file (a FIFO or device in profiles/) | unfinished (a resumable ingest's dir)
    conversation: str | None
    episode: int | None
    path: Path
    message: str

    def to_dict(self) -> dict:
        return {
            "kind": self.kind, "conversation": self.conversation, "episode": self.episode,
            "path": str(self.path), "message": self.message,
        }  # fmt: skip


def remove_dead_temp_dirs(directory: Path) -> None:
    """Remove `directory/.tmp-<pid>-*` (caches/ or models/) when no process `pid` exists, or one that started at
    another time than the name says (the pid reused); a live writer's temp dir is never touched.

    Pids are per host (and per PID namespace), so a home must not be shared across machines or
    containers mid-ingest.
    """
    for entry in dead_temp_dirs(directory):
        shutil.rmtree(entry, ignore_errors=True)


def remove_idle_unworked(caches_dir: Path) -> None:
    """Remove the resumable ingests' dirs (kvchat.store.resumable) that no live process holds and that completed no
    unit: nothing there to continue. One that did is kept for its ingest to continue (`doctor --fix` deletes it), less
    the scratch dirs of the episode a kill cut short (IceCache's spilled evictions: never continued, maybe large)."""
    for path in resumable_dirs(caches_dir):
        held = claim(path)
        if held is None:
            continue
        if not summary(path)[1]:
            held.discard(caches_dir)
            continue
        for scratch in path.glob("scratch-*"):
            shutil.rmtree(scratch, ignore_errors=True)
        held.release()


def dead_temp_dirs(directory: Path) -> list[Path]:
    """`directory/.tmp-<pid>-*` dirs whose writer no longer exists (`files.writer_alive`)."""
    found = []
    for entry in sorted(real_subdirs(directory)):
        writer = temp_writer(entry)
        if writer is not None and not writer_alive(*writer):
            found.append(entry)
    return found


def model_leftovers(models_dir: Path) -> list[Problem]:
    """Temp dirs of model conversions that died (a first GGUF conversion killed: hundreds of MiB), and held weights
    no process will read again (`stale_held_weights`)."""
    return [
        Problem("stale-temp", None, None, path, f"temp dir of a model conversion that died: {path}; {FIX} deletes it")
        for path in dead_temp_dirs(models_dir)
    ] + stale_held_weights(models_dir)


def stale_held_weights(models_dir: Path) -> list[Problem]:
    """Files in `models/held/` (model.held_weights) that no process will read: made from a float weights file that
    is gone or has changed since, packed by a torch other than the one installed, or not readable as held weights.
    Each is written again where it is next needed, so deleting one costs time, never an answer."""
    try:
        entries = sorted(p for p in (models_dir / HELD_DIR).iterdir() if p.name.endswith(HELD_SUFFIX))
    except OSError:
        return []
    torch_version = _torch_version()
    found = []
    for path in entries:
        if path.is_symlink() or not path.is_file():
            continue
        why = _why_stale(path, torch_version)
        if why is not None:
            found.append(Problem("stale-held", None, None, path, f"held weights {path} {why}; {FIX} deletes them "
                                 "(they are written again when next needed)"))  # fmt: skip
    return found


def _why_stale(path: Path, torch_version: str | None) -> str | None:
    """Why no process will read the held weights at `path`, or None when one may."""
    try:
        meta = read_safetensors_header(path).get("__metadata__") or {}
    except (OSError, ValueError) as e:
        return f"cannot be read ({getattr(e, 'strerror', None) or e})"
    source = meta.get("source")
    if not isinstance(source, str):
        return "do not say which weights they were made from"
    try:
        now = held_source(Path(source))
    except OSError:
        return f"were made from {source}, which is gone"
    if not made_from(meta, now):
        return f"were made from an earlier version of {source}"
    if torch_version is not None and not held_by_torch(path.name, torch_version):
        return f"were packed by another torch than the one installed ({torch_version})"
    return None


def _torch_version() -> str | None:
    """The installed torch's `torch.__version__`, which held files are named by, read without importing torch: from
    the `torch/version.py` its build writes, else its package metadata (which may lack the build's local part,
    "+cu130"), else None."""
    spec = importlib.util.find_spec("torch")
    try:
        text = (Path(spec.origin).parent / "version.py").read_text() if spec and spec.origin else ""
    except OSError:
        text = ""
    found = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
    if found:
        return found.group(1)
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def stale_orphans(caches_dir: Path, referenced: set[str]) -> list[Path]:
    """Ingest dirs that are unreferenced and old enough, plus empty name dirs.

    `caches/<name>/<ingest_id>` is an orphan when no conversation row references `ingest_id`
    (`referenced`: every row's; ingest ids are unique uuids, so any row will do) and its mtime is over
    `ORPHAN_GRACE_S` old, and it holds no valid manifest (`manifest.manifest_of`): a dir that does is a
    conversation, which kvchat.db may lack (`reindex`), never a leftover. An orphan comes from an ingest from
    before manifests, or from a failed delete that got as far as removing the manifest.
    """
    found: list[Path] = []
    cutoff = time.time() - ORPHAN_GRACE_S
    for name_dir in real_subdirs(caches_dir):
        if name_dir.name.startswith("."):
            continue
        try:
            children = list(name_dir.iterdir())
        except OSError:
            continue
        if not children:
            found.append(name_dir)
        for child in children:
            if not child.is_dir() or child.is_symlink() or child.name in referenced:
                continue
            try:
                old = child.stat().st_mtime < cutoff
            except OSError:
                continue
            if old and manifest_of(child) is None:
                found.append(child)
    return found


def move_aside_orphans(caches_dir: Path, referenced: set[str]) -> list[Path]:
    """Under the write lock: remove empty name dirs and move stale orphans aside; returns what to
    `delete_trees` once the lock is released."""
    doomed: list[Path] = []
    for path in stale_orphans(caches_dir, referenced):
        if path.parent == caches_dir:  # an empty name dir
            try_rmdir(path)
            continue
        target = new_temp_path(caches_dir)
        try:
            rename(path, target)
        except OSError:
            continue
        doomed.append(target)
        try_rmdir(path.parent)  # only succeeds once the name dir is empty
    return doomed


def leftovers(caches_dir: Path, live_dirs: set[Path], live_files: set[Path], *, grace_s: float) -> list[Problem]:
    """What lies in caches/ that no row refers to and no live process writes.

    `live_dirs`: every conversation row's `caches/<name>/<ingest_id>`; `live_files`: every file a row
    refers to. An ingest dir with a valid manifest is a conversation, not a leftover, listed or not (`reindex`).
    Exact under the write lock (pass `grace_s=0`). Without it, an ingest may be between its rename and its row
    commit: ingest dirs and empty name dirs younger than `grace_s` are not reported,
    and a dir that vanishes while being looked at (an `rm` deleting it) is skipped.
    """
    found: list[Problem] = []
    cutoff = time.time() - grace_s if grace_s > 0 else None

    def leftover(kind: str, path: Path, what: str) -> None:
        found.append(Problem(kind, None, None, path, f"{what}: {path}; {FIX} deletes it"))

    for entry in _entries(caches_dir):
        if entry.name.startswith(RESUME_PREFIX) and _is_dir(entry):
            if idle(entry):  # a live ingest's is its own
                done, worked = summary(entry)
                name = show(resumable_name(entry) or "")
                leftover("unfinished", entry, f"unfinished ingest of {name} ({done}), which the same ingest run again "
                         "continues" if worked else f"dir of an unfinished ingest of {name} with nothing done")
            continue
        writer = temp_writer(entry)
        if writer is not None and _is_dir(entry):
            if not writer_alive(*writer):
                leftover("stale-temp", entry, "temp dir of an ingest that died")
            continue
        if not _is_dir(entry) or entry.name.startswith("."):
            leftover("stray", entry, "stray file")
            continue
        children = _entries(entry)
        if not children and older_than(entry, cutoff):
            leftover("orphan", entry, "empty conversation dir")
        for child in children:
            if child in live_dirs and _is_dir(child):
                for file in _entries(child):
                    if file not in live_files:
                        leftover("stray", file, "file no episode refers to")
            elif _is_dir(child):
                if older_than(child, cutoff) and manifest_of(child) is None:  # a manifest: a conversation
                    leftover("orphan", child, "ingest dir no conversation refers to (a crashed or replaced ingest)")
            else:
                leftover("stray", child, "stray file")
    return found


def _entries(directory: Path) -> list[Path]:
    """What `directory` holds, sorted; nothing when it is gone or unreadable."""
    try:
        return sorted(directory.iterdir())
    except OSError:
        return []


def older_than(path: Path, cutoff: float | None) -> bool:
    """Whether `path`'s mtime is before `cutoff` (None: no cutoff); False when it is gone."""
    if cutoff is None:
        return True
    try:
        return path.stat().st_mtime < cutoff
    except OSError:
        return False


def delete_leftovers(caches_dir: Path, doomed: Iterable[Problem]) -> tuple[list[str], list[Path]]:
    """Under the write lock, with `doomed` just found by `leftovers`: delete files, move dirs aside.

    Returns one line per action and the dirs to `delete_trees` once the lock is released.
    """
    done: list[str] = []
    moved: list[Path] = []
    for leftover in doomed:
        path = leftover.path
        if leftover.kind == "unfinished":  # unless an ingest has taken it up since
            held = claim(path)
            if held is None:
                done.append(f"left {path} alone: an ingest is continuing it")
                continue
            target = new_temp_path(caches_dir)
            try:
                rename(path, target)
            except OSError as e:
                done.append(f"could not delete {path}: {e.strerror or e}")
                continue
            finally:
                held.release()
            moved.append(target)
            done.append(f"deleted {leftover.kind} {path}")
            continue
        if leftover.kind == "stale-temp":  # its writer is dead: nothing else can take it, no need to move it
            moved.append(path)
            done.append(f"deleted {leftover.kind} {path}")
            continue
        try:
            if _is_dir(path):
                target = new_temp_path(caches_dir)
                rename(path, target)
                moved.append(target)
            else:
                path.unlink()
        except OSError as e:
            done.append(f"could not delete {path}: {e.strerror or e}")
            continue
        done.append(f"deleted {leftover.kind} {path}")
        if path.parent.parent == caches_dir:
            try_rmdir(path.parent)  # a conversation dir left empty
    return done, moved


def delete_trees(paths: Iterable[Path]) -> None:
    """Delete what was moved aside under the lock; best effort (an open at a later time sweeps the rest)."""
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def real_subdirs(directory: Path) -> list[Path]:
    """Subdirs of `directory` that are dirs themselves, not links to one (never followed), sorted."""
    try:
        return sorted(p for p in directory.iterdir() if _is_dir(p))
    except OSError:
        return []


def _is_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()
