"""A stored conversation as the library sees it (`ConversationRecord`, `EpisodeRecord`, `FileRecord`), and
the conversions between those records, their document (`manifest`) and their rows in kvchat.db."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import sqlite_utils

from kvchat.store.manifest import rows_from_document


@dataclass(frozen=True)
class FileRecord:
    """A file beside the episode caches, committed and checked as they are: an episode's pages file
    (`--offload icecache`, kvchat.kv.pagefile: what eviction dropped, paged), or a conversation's recall entries
    file (`--recall-entries stored`: the KV entries of every chunk of the history, `layout.RECALL_ENTRIES_NAME`)."""

    bytes: int
    sha256: str
    path: Path  # absolute path


PagesRecord = FileRecord  # an episode's pages file


@dataclass(frozen=True)
class EpisodeRecord:
    index: int
    centroid: list[float]
    medoid_text: str
    budgets: list[int]  # per-layer kept-entry budget
    n_tokens: int  # cached entries (sum over layers and heads); informational
    bytes: int  # file size
    sha256: str
    path: Path  # absolute path of the safetensors file
    pages: FileRecord | None = None  # its pages file, when the conversation offloads

    def files(self) -> list[tuple[Path, int, str, str]]:
        """(path, bytes, sha256, what) of every file of this episode."""
        out = [(self.path, self.bytes, self.sha256, "cache")]
        if self.pages is not None:
            out.append((self.pages.path, self.pages.bytes, self.pages.sha256, "pages file"))
        return out


@dataclass(frozen=True)
class ConversationRecord:
    name: str
    created_at: str  # ISO 8601 UTC
    model: str  # user-facing model spec, e.g. "default"
    fingerprint: str  # model fingerprint (opaque)
    settings: dict
    stats: dict
    episodes: list[EpisodeRecord]
    ingest_id: str = ""  # this version of the conversation (every ingest or append makes a new one)
    recall_entries: FileRecord | None = None  # the KV entries of every chunk of the history, when it keeps them

    def files(self) -> list[tuple[Path, int, str, str]]:
        """(path, bytes, sha256, what) of every file of this conversation: each episode's, then its recall
        entries file (what: "recall entries")."""
        out = [f for episode in self.episodes for f in episode.files()]
        if self.recall_entries is not None:
            entries = self.recall_entries
            out.append((entries.path, entries.bytes, entries.sha256, "recall entries"))
        return out


def record_of(doc: dict, home: Path) -> ConversationRecord:
    """The record of a conversation document (`manifest`)."""
    return ConversationRecord(
        name=doc["name"],
        created_at=doc["created_at"],
        model=doc["model"],
        fingerprint=doc["fingerprint"],
        settings=doc["settings"],
        stats=doc["stats"],
        ingest_id=doc["ingest_id"],
        episodes=[
            EpisodeRecord(
                index=e["index"], centroid=e["centroid"], medoid_text=e["medoid_text"], budgets=e["budgets"],
                n_tokens=e["n_tokens"], bytes=e["bytes"], sha256=e["sha256"], path=home / e["path"],
                pages=file_record(e["pages"], home) if e.get("pages") else None,
            )  # fmt: skip
            for e in doc["episodes"]
        ],
        recall_entries=file_record(doc["recall_entries"], home) if doc.get("recall_entries") else None,
    )


def file_record(entry: dict, home: Path) -> FileRecord:
    """The record of a file's entry in a conversation document ({path relative to the home, bytes, sha256})."""
    return FileRecord(entry["bytes"], entry["sha256"], home / entry["path"])


def file_entry(record: FileRecord, home: Path) -> dict:
    """A file's entry in a conversation document (`file_record`'s inverse)."""
    return {"path": record.path.relative_to(home).as_posix(), "bytes": record.bytes, "sha256": record.sha256}


def episode_entry(record: EpisodeRecord, home: Path) -> dict:
    """An episode of a conversation document (`manifest.document`): paths relative to the home."""
    entry = {**asdict(record), "path": record.path.relative_to(home).as_posix(), "pages": None}
    if record.pages is not None:
        entry["pages"] = file_entry(record.pages, home)
    return entry


def insert_document(db: sqlite_utils.Database, doc: dict) -> None:
    """The rows of conversation document `doc`. Inside the write lock."""
    conversation, episodes = rows_from_document(doc)
    db.table("conversations").insert(conversation)
    db.table("episodes").insert_all(episodes)
