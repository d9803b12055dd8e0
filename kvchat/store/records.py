"""A stored conversation as the library sees it (`ConversationRecord`, `EpisodeRecord`, `PagesRecord`), and
the conversions between those records, their document (`manifest`) and their rows in kvchat.db."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import sqlite_utils

from kvchat.store.manifest import rows_from_document


@dataclass(frozen=True)
class PagesRecord:
    """An episode's pages file (`--offload icecache`, kvchat.kv.pagefile): what eviction dropped, paged."""

    bytes: int
    sha256: str
    path: Path  # absolute path


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
    pages: PagesRecord | None = None  # its pages file, when the conversation offloads

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
                pages=PagesRecord(e["pages"]["bytes"], e["pages"]["sha256"], home / e["pages"]["path"])
                if e.get("pages") else None,
            )  # fmt: skip
            for e in doc["episodes"]
        ],
    )


def episode_entry(record: EpisodeRecord, home: Path) -> dict:
    """An episode of a conversation document (`manifest.document`): paths relative to the home."""
    entry = {**asdict(record), "path": record.path.relative_to(home).as_posix(), "pages": None}
    if record.pages is not None:
        entry["pages"] = {"path": record.pages.path.relative_to(home).as_posix(), "bytes": record.pages.bytes,
                          "sha256": record.pages.sha256}  # fmt: skip
    return entry


def insert_document(db: sqlite_utils.Database, doc: dict) -> None:
    """The rows of conversation document `doc`. Inside the write lock."""
    conversation, episodes = rows_from_document(doc)
    db["conversations"].insert(conversation)
    db["episodes"].insert_all(episodes)
