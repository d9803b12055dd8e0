"""A conversation as one document: its rows in kvchat.db, also written beside its episode files.

Every ingest writes `conversation.json` (the manifest) into its ingest dir, fsync'd before the dir is renamed
into place, and stores the document's sha256 in its conversation row (`digest`). So a row damaged on disk is
found (the digest no longer matches), and a damaged kvchat.db can be rebuilt from the ingest dirs
(`recovery`): the episode files alone do not say how to route a question (centroids), what each episode is
about (medoid texts), or which model and settings built them.

The document is what the rows hold, parsed: JSON columns as values, episode paths relative to the home.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

from kvchat.store.files import FileMismatch, open_regular, rename, write_file

MANIFEST_NAME = "conversation.json"
RETIRED_NAME = ".conversation.json.retired"  # a removed version's: its dir is an orphan, never listed again
MANIFEST_VERSION = 1
MAX_MANIFEST_BYTES = 64 * 2**20  # far above any real one (centroids of every episode); bounds what is read

_JSON_COLUMNS = {"settings", "stats"}
_EPISODE_JSON_COLUMNS = {"centroid", "budgets"}
_EPISODE_FIELDS = ("centroid", "medoid_text", "budgets", "n_tokens", "bytes", "sha256", "path")
# An episode's pages file (`--offload icecache`), in the document as `pages` {path, bytes, sha256} only when
# it has one, so documents of episodes without one (and their digests) are as before pages files existed.
_PAGES_COLUMNS = {"path": "pages_path", "bytes": "pages_bytes", "sha256": "pages_sha256"}
# A conversation's recall entries file (`--recall-entries stored`), likewise `recall_entries` {path, bytes,
# sha256} at the top level only when it has one, in its conversation row's `recall_entries_*` columns.
_RECALL_COLUMNS = {"path": "recall_entries_path", "bytes": "recall_entries_bytes", "sha256": "recall_entries_sha256"}
_FIELDS = ("name", "ingest_id", "created_at", "model", "fingerprint", "settings", "stats")


def document(
    *, name: str, ingest_id: str, created_at: str, model: str, fingerprint: str, settings: dict, stats: dict,
    episodes: list[dict], recall_entries: dict | None = None,
) -> dict:  # fmt: skip
    """A conversation's document; `episodes` hold `index`, the episode row's fields, parsed, and `pages` (a
    dict of path, bytes and sha256) when the episode has a pages file; `recall_entries` (the same dict) when the
    conversation has a recall entries file."""
    return {
        "name": name, "ingest_id": ingest_id, "created_at": created_at, "model": model,
        "fingerprint": fingerprint, "settings": settings, "stats": stats,
        "episodes": [
            {"index": e["index"], **{f: e[f] for f in _EPISODE_FIELDS},
             **({"pages": e["pages"]} if e.get("pages") else {})}
            for e in episodes
        ],
        **({"recall_entries": recall_entries} if recall_entries else {}),
    }  # fmt: skip


def digest(doc: dict) -> str:
    """sha256 of the document's canonical JSON: what a conversation row stores and a manifest carries."""
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def document_from_rows(conversation: dict, episodes: list[dict]) -> dict:
    """The document of a conversation row and its episode rows (ordered by index), as read from SQLite.

    Raises ValueError when a JSON column does not parse.
    """
    parsed = {key: json.loads(conversation[key]) if key in _JSON_COLUMNS else conversation[key] for key in _FIELDS}
    return document(
        **parsed,
        recall_entries=None if conversation.get("recall_entries_path") is None
        else {k: conversation[c] for k, c in _RECALL_COLUMNS.items()},
        episodes=[
            {"index": row["idx"],
             **{f: json.loads(row[f]) if f in _EPISODE_JSON_COLUMNS else row[f] for f in _EPISODE_FIELDS},
             "pages": None if row.get("pages_path") is None else {k: row[c] for k, c in _PAGES_COLUMNS.items()}}
            for row in episodes
        ],
    )  # fmt: skip


def rows_from_document(doc: dict) -> tuple[dict, list[dict]]:
    """The conversation row (with its `digest`) and episode rows that store `doc`."""
    conversation = {
        **{key: json.dumps(doc[key], sort_keys=True) if key in _JSON_COLUMNS else doc[key] for key in _FIELDS},
        **{c: (doc.get("recall_entries") or {}).get(k) for k, c in _RECALL_COLUMNS.items()},
        "digest": digest(doc),
    }  # fmt: skip
    episodes = [
        {"conversation": doc["name"], "idx": e["index"],
         **{f: json.dumps(e[f]) if f in _EPISODE_JSON_COLUMNS else e[f] for f in _EPISODE_FIELDS},
         **{c: (e.get("pages") or {}).get(k) for k, c in _PAGES_COLUMNS.items()}}
        for e in doc["episodes"]
    ]  # fmt: skip
    return conversation, episodes


def write_manifest(directory: Path, doc: dict) -> None:
    """Write `directory/conversation.json` (a new file, fsync'd): the document and its digest."""
    body = {"kvchat_manifest": MANIFEST_VERSION, "sha256": digest(doc), "conversation": doc}
    write_file(directory / MANIFEST_NAME, json.dumps(body, sort_keys=True, indent=1).encode())


def read_manifest(directory: Path) -> dict:
    """The document in `directory/conversation.json`, if it is one and matches its digest.

    Raises FileNotFoundError when there is none (an ingest from before manifests), ValueError naming the
    problem when it is damaged, FileMismatch when it is not a regular file.
    """
    with open_regular(directory / MANIFEST_NAME) as f:
        if os.fstat(f.fileno()).st_size > MAX_MANIFEST_BYTES:
            raise ValueError("its manifest is implausibly large")
        raw = f.read()
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ValueError("its manifest is not valid JSON") from None
    if not isinstance(body, dict) or body.get("kvchat_manifest") != MANIFEST_VERSION:
        raise ValueError("its manifest is not a kvchat manifest this version reads")
    doc = body.get("conversation")
    if not isinstance(doc, dict):
        raise ValueError("its manifest fails its checksum")
    try:
        ok = digest(doc) == body.get("sha256") and _well_formed(doc)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError("its manifest fails its checksum")
    wrong = inconsistency(doc)
    if wrong is not None:
        raise ValueError(f"its manifest checks out but cannot be right: {wrong}")
    return doc


def inconsistency(doc: dict) -> str | None:
    """What in a well-formed document cannot describe a conversation kvchat built, or None. The digest only
    proves the bytes are the ones written: a hand-edited manifest with a fresh digest must not be restored into
    an index every `ask` then fails on. Episodes are numbered 0..n-1; their centroids are vectors of numbers
    of one length (the encoder's); sizes are not negative."""
    episodes = doc["episodes"]
    if sorted(e["index"] for e in episodes) != list(range(len(episodes))):
        return "its episodes are not numbered 0..n-1"
    lengths = {len(e["centroid"]) for e in episodes}
    if len(lengths) != 1 or 0 in lengths:
        return "its episodes' centroids differ in length"
    for e in episodes:
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in e["centroid"]):
            return f"episode {e['index']}'s centroid is not a list of numbers"
        if e["bytes"] < 0 or not isinstance(e.get("n_tokens", 0), int) or e.get("n_tokens", 0) < 0:
            return f"episode {e['index']} has a negative size"
    if any(f["bytes"] < 0 for f in [doc.get("recall_entries"), *(e.get("pages") for e in episodes)] if f):
        return "a file of it has a negative size"
    return None


def _well_formed(doc: dict) -> bool:
    """The fields a rebuild relies on have the right types (the digest covers accidental damage only)."""
    strings = ("name", "ingest_id", "created_at", "model", "fingerprint")
    episodes = doc.get("episodes")
    return (
        all(isinstance(doc.get(key), str) for key in strings)
        and isinstance(doc.get("settings"), dict) and isinstance(doc.get("stats"), dict)
        and isinstance(episodes, list) and len(episodes) > 0
        and all(isinstance(e, dict) and isinstance(e.get("index"), int) and isinstance(e.get("path"), str)
                and isinstance(e.get("bytes"), int) and isinstance(e.get("sha256"), str)
                and isinstance(e.get("centroid"), list) and isinstance(e.get("budgets"), list)
                and _file_well_formed(e.get("pages", _NO_FILE))
                for e in episodes)
        and _file_well_formed(doc.get("recall_entries", _NO_FILE))
    )  # fmt: skip


_NO_FILE = {"path": "", "bytes": 0, "sha256": ""}  # a file entry that is absent checks as well formed


def _file_well_formed(entry: object) -> bool:
    """A file's entry ({path, bytes, sha256}: an episode's `pages`, the conversation's `recall_entries`)."""
    return (isinstance(entry, dict) and isinstance(entry.get("path"), str)
            and isinstance(entry.get("bytes"), int) and not isinstance(entry.get("bytes"), bool)
            and isinstance(entry.get("sha256"), str))  # fmt: skip


def manifest_of(ingest_dir: Path) -> dict | None:
    """The document of `ingest_dir`'s manifest when it is valid and describes that very dir
    (`caches/<name>/<ingest_id>`); None otherwise. Such a dir is a conversation, whatever kvchat.db says."""
    try:
        doc = read_manifest(ingest_dir)
    except (OSError, ValueError, FileMismatch):
        return None
    return doc if doc["name"] == ingest_dir.parent.name and doc["ingest_id"] == ingest_dir.name else None


def retire_manifest(ingest_dir: Path) -> bool:
    """Rename `ingest_dir`'s manifest out of the way (inside the write transaction that removes its rows), so
    that a crash before its files are deleted leaves an orphan, not a conversation to list again. Whether
    there was one."""
    try:
        rename(ingest_dir / MANIFEST_NAME, ingest_dir / RETIRED_NAME)
    except FileNotFoundError:
        return False
    return True


def restore_manifest(ingest_dir: Path) -> None:
    """Undo `retire_manifest` (the transaction failed), best effort."""
    try:
        rename(ingest_dir / RETIRED_NAME, ingest_dir / MANIFEST_NAME)
    except OSError:
        pass
