"""A resumable ingest's dir, `caches/.resume-<name>`: its identity, its lock and its journal of completed units.

An ingest that may be resumed (`Store.begin(resumable=...)`) writes into this dir instead of a private temp dir
named by its pid, so that what it finished outlives it: a kill, Ctrl-C or a full disk leaves the dir, and the same
ingest run again (same name, history, resolved settings and model: the identity's `key`) continues from its last
completed unit. Nothing in it is visible: the commit renames it into place as any ingest's temp dir.

- The identity (`resume.json`): the key and the ingest id, written before the dir is renamed into place, so a
  dir without it is one whose creator died before it was whole.
- The lock: an exclusive `flock` on the dir itself, held by the one process writing it (and released by the
  kernel when that process dies, however it dies). The startup sweep and `doctor --fix` take only dirs whose lock
  is free, and never one that has completed a unit unless asked (`doctor --fix`).
- The journal (`journal.jsonl`): one JSON line per completed unit (an episode file, a checkpoint, recall chunks),
  appended and fsync'd once the unit's files are, so a line names only bytes that are on disk. A line cut short by
  a kill is dropped when the journal is read again.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvchat.checked_files import FileMismatch, read_bounded
from kvchat.store.files import crash_point, fsync_dir, new_temp_path, rename, write_file

RESUME_PREFIX = ".resume-"
IDENTITY_NAME = "resume.json"
JOURNAL_NAME = "journal.jsonl"
CHECKPOINT_PREFIX = "checkpoint-"  # checkpoint-<episode>-<sequence>.safetensors: an episode's prefill so far
FORMAT = 1
_MAX_IDENTITY_BYTES = 1 << 16
_MAX_JOURNAL_BYTES = 1 << 30

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; a dir is then never seen as held by another process
    fcntl = None  # type: ignore[assignment]


@dataclass(frozen=True)
class Identity:
    """What an ingest must share with an unfinished one to continue it: `key` (a digest of its history, resolved
    settings and model, kvchat.ingest.units) and its units' totals ("episodes", "chunks"), which say how far it
    got."""

    key: str
    units: dict[str, int]


def resumable_path(caches_dir: Path, name: str) -> Path:
    return caches_dir / f"{RESUME_PREFIX}{name}"


def resumable_name(path: Path) -> str | None:
    """The conversation name of a `.resume-<name>` dir, else None."""
    return path.name[len(RESUME_PREFIX):] or None if path.name.startswith(RESUME_PREFIX) else None


def resumable_dirs(caches_dir: Path) -> list[Path]:
    """Every `.resume-*` dir in caches/ (not links), sorted."""
    try:
        return sorted(p for p in caches_dir.iterdir()
                      if p.name.startswith(RESUME_PREFIX) and p.is_dir() and not p.is_symlink())  # fmt: skip
    except OSError:
        return []


class Claim:
    """A resumable dir held by this process: the lock on it and what its identity file says (None: unreadable)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd
        self.identity = read_identity(path)

    def release(self) -> None:
        """Let go of the lock (closing the dir); idempotent."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def discard(self, caches_dir: Path) -> None:
        """Remove the dir (renamed aside first, so it vanishes at once) and let go of it."""
        target = new_temp_path(caches_dir)
        try:
            rename(self.path, target)
        except OSError:
            target = self.path
        self.release()
        shutil.rmtree(target, ignore_errors=True)


def claim(path: Path) -> Claim | None:
    """Hold the resumable dir at `path`; None when another live process holds it, or it is gone."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return None
    return Claim(path, fd)


def create(caches_dir: Path, name: str, identity: Identity, ingest_id: str) -> Claim | None:
    """A new resumable dir for conversation `name`, held, its identity written: made as a temp dir and renamed into
    place whole, so no other process ever sees it without its identity or its lock. None when another process made
    one meanwhile."""
    temp = new_temp_path(caches_dir)
    temp.mkdir()
    held = claim(temp)
    if held is None:  # cannot happen to a dir just made; it is left for the sweep (a temp dir of this pid)
        return None
    data = json.dumps({"format": FORMAT, "name": name, "key": identity.key, "units": identity.units,
                       "ingest_id": ingest_id}, sort_keys=True).encode()  # fmt: skip
    try:
        write_file(temp / IDENTITY_NAME, data)
        fsync_dir(temp)
        final = resumable_path(caches_dir, name)
        rename(temp, final)  # a dir already there holds its identity: never replaced (ENOTEMPTY)
    except OSError:
        held.release()
        shutil.rmtree(temp, ignore_errors=True)
        if resumable_path(caches_dir, name).exists():
            return None
        raise
    fsync_dir(caches_dir)
    held.path = final
    held.identity = read_identity(final)
    return held


def read_identity(path: Path) -> dict[str, Any] | None:
    """A resumable dir's identity, or None where it is missing or not one this version wrote."""
    try:
        found = json.loads(read_bounded(path / IDENTITY_NAME, _MAX_IDENTITY_BYTES))
    except (OSError, ValueError, FileMismatch):
        return None
    ok = (isinstance(found, dict) and found.get("format") == FORMAT and isinstance(found.get("key"), str)
          and isinstance(found.get("ingest_id"), str) and isinstance(found.get("units"), dict))  # fmt: skip
    return found if ok else None


def idle(path: Path) -> bool:
    """Whether no live process holds the resumable dir at `path` (looked at by taking its lock for a moment)."""
    held = claim(path)
    if held is None:
        return False
    held.release()
    return True


class Journal:
    """A resumable dir's completed units, one JSON object per line. `entries` holds what was read when it was opened
    (a line cut short by a kill, and anything after it, dropped and cut from the file); `append` adds one, fsync'd."""

    def __init__(self, path: Path) -> None:
        self.path = path
        data = b""
        if path.exists():
            data = read_bounded(path, _MAX_JOURNAL_BYTES)
        self.entries: list[dict[str, Any]] = []
        good = 0
        for line in data.split(b"\n")[:-1]:  # the part after the last newline is a line cut short
            try:
                entry = json.loads(line)
            except ValueError:
                break
            if not isinstance(entry, dict):
                break
            self.entries.append(entry)
            good += len(line) + 1
        self._file = open(path, "ab")  # noqa: SIM115 - closed by close()
        if good < len(data):
            self._file.truncate(good)

    def append(self, entry: dict[str, Any]) -> None:
        crash_point(f"journal {self.path.name}")
        self._file.write(json.dumps(entry, sort_keys=True).encode() + b"\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self.entries.append(entry)

    def close(self) -> None:
        self._file.close()


def describe(entries: list[dict[str, Any]], units: dict[str, int]) -> str:
    """What a journal says is done, in words: "3 of 4 episodes done", with recall chunks where there are any and the
    episodes kept partly (checkpoints)."""
    episodes = {e["episode"] for e in entries if isinstance(e.get("episode"), int)}
    partly = {e["checkpoint"] for e in entries if isinstance(e.get("checkpoint"), int)} - episodes
    text = f"{len(episodes)} of {units.get('episodes', '?')} episodes"
    if units.get("chunks"):
        chunks = sum(max(0, e["chunks"][1] - e["chunks"][0]) for e in entries if _is_range(e.get("chunks")))
        text += f" and {chunks} of {units['chunks']} recall chunks"
    return text + " done" + (f", {len(partly)} more episode{'s' * (len(partly) != 1)} partly" if partly else "")


def completed(entries: list[dict[str, Any]]) -> bool:
    """Whether any unit (an episode, a checkpoint, recall chunks) is journaled: else there is nothing to resume."""
    return any(k in e for e in entries for k in ("episode", "checkpoint", "chunks"))


def _is_range(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) for v in value)


def summary(path: Path) -> tuple[str | None, bool]:
    """(what the dir at `path` has done in words, whether it has completed any unit), read without holding it;
    (None, False) where its identity is unreadable."""
    identity = read_identity(path)
    if identity is None:
        return None, False
    entries: list[dict[str, Any]] = []
    try:
        for line in read_bounded(path / JOURNAL_NAME, _MAX_JOURNAL_BYTES).split(b"\n")[:-1]:
            entries.append(json.loads(line))
    except (OSError, ValueError, FileMismatch):
        pass
    entries = [e for e in entries if isinstance(e, dict)]
    return describe(entries, identity["units"]), completed(entries)


def unfinished(caches_dir: Path, name: str) -> str | None:
    """What the unfinished ingest of conversation `name` has done, in words, where one is kept (None: none is)."""
    path = resumable_path(caches_dir, name)
    if not path.is_dir() or path.is_symlink():
        return None
    done, worked = summary(path)
    return done if worked else None
