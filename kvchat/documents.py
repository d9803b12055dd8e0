"""The JSON documents kvchat prints with `--json`: one vocabulary across commands, and a schema version.

Every document is a JSON object with `"schema": SCHEMA`; `kvchat ask --json` prints one such object per
question (JSON Lines). One vocabulary across commands (docs/scripting.md shows every shape).

Design notes (the details and the choices made): docs/internals.md, "kvchat/documents.py".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from kvchat.settings import from_settings, upgraded

SCHEMA = 1


# The fields that hold kvchat's own messages, whose references to settings, options and commands (kvchat.messages)
# each front end spells: never user data (a question, an answer, a name), which is left as it is.
MESSAGE_FIELDS = frozenset({"notes", "error", "message", "sources_note", "fixed"})


def document(**fields: Any) -> dict[str, Any]:
    return {"schema": SCHEMA, **fields}


def spelled(value: Any, spell: Callable[[str], str]) -> Any:
    """`value` (a document, or any part of one) with the messages in its `MESSAGE_FIELDS` spelt by `spell`."""
    if isinstance(value, dict):
        return {key: _messages(item, spell) if key in MESSAGE_FIELDS else spelled(item, spell)
                for key, item in value.items()}  # fmt: skip
    if isinstance(value, list):
        return [spelled(item, spell) for item in value]
    return value


def _messages(value: Any, spell: Callable[[str], str]) -> Any:
    if isinstance(value, str):
        return spell(value)
    if isinstance(value, list):
        return [_messages(item, spell) for item in value]
    return spelled(value, spell)


def ingest(report) -> dict[str, Any]:
    """`kvchat ingest --json`, from an `IngestReport`."""
    return document(**_reported(report.to_dict()))


def _reported(fields: dict[str, Any]) -> dict[str, Any]:
    """An ingest report's fields (`IngestReport.to_dict()`, or the stats stored with a conversation) in the shared
    vocabulary: its count of episodes as `episode_count`, its seconds as `timings_ms`."""
    fields = dict(fields)
    if "episodes" in fields:
        fields["episode_count"] = fields.pop("episodes")
    if "seconds" in fields:
        fields["timings_ms"] = {"total": round(fields.pop("seconds") * 1000, 1)}
    return fields


def batch(report) -> dict[str, Any]:
    """`kvchat ingest-batch --json`, from a `BatchReport`: per history its outcome and, once committed, its
    `ingest` document's fields."""
    histories = []
    for result in report.histories:
        entry: dict[str, Any] = {"name": result.name, "path": str(result.path), "status": result.status,
                                 "attempts": result.attempts, "error": result.error}  # fmt: skip
        if result.report is not None:
            entry |= {key: value for key, value in ingest(result.report).items() if key != "schema"}
        else:
            entry["timings_ms"] = {"total": round(result.seconds * 1000, 1)}
        histories.append(entry)
    return document(
        histories=histories,
        committed=report.count("committed"),
        skipped=report.count("skipped"),
        failed=report.count("failed"),
        workers=report.workers,
        threads=report.threads,
        cache_bytes=report.cache_bytes,
        histories_per_hour=round(report.histories_per_hour, 1),
        timings_ms={"total": round(report.seconds * 1000, 1)},
    )


def answer(question: str, result) -> dict[str, Any]:
    """One line of `kvchat ask --json`, from an `Answer`."""
    fields = dataclasses.asdict(result)
    return document(question=question, answer=fields.pop("text"), **fields)


def conversation(record) -> dict[str, Any]:
    """A conversation in `kvchat list --json`."""
    cache = from_settings(record.settings).cache
    return {
        "name": record.name,
        "created_at": record.created_at,
        "model": record.model,
        "method": cache.method,
        "offload": cache.offload.mode,
        "cache_precision": cache.precision,
        "episode_count": len(record.episodes),
        "turns": record.stats.get("turns"),
        "cache_bytes": sum(e.bytes for e in record.episodes),
        "pages_bytes": sum(e.pages.bytes for e in record.episodes if e.pages is not None),
        "recall_entries_bytes": record.recall_entries.bytes if record.recall_entries is not None else 0,
        "disk_bytes": sum(size for _, size, _, _ in record.files()),  # every file of it
    }


def conversations(records, default: str | None = None) -> dict[str, Any]:
    """`kvchat list --json`; `default`, the conversation `ask` answers from when none is named."""
    return document(conversations=[{**conversation(r), "default": r.name == default} for r in records])


def show(record) -> dict[str, Any]:
    """`kvchat show NAME --json`: the `list` fields, what the ingest reported under the `ingest` document's keys
    (`history_tokens`, `budgets`, `timings_ms`, ...), the settings, and the episodes with their topic labels.
    `stats` is the stored report as recorded (its `episodes` a count, `seconds`): kept for schema 1 only."""
    from kvchat.history.topics import topic_labels

    labels = topic_labels([e.medoid_text for e in record.episodes])
    segments = record.stats.get("episode_segments") or []
    return document(
        **(_reported(record.stats) | conversation(record)),  # the record's own counts where both say
        settings=upgraded(record.settings),  # under today's keys, whichever kvchat saved them
        stats=record.stats,
        episodes=[
            {"index": e.index, "topic": label, "segments": segments[e.index] if e.index < len(segments) else None,
             "budgets": e.budgets, "cache_bytes": e.bytes, "entries": e.n_tokens,
             "pages_bytes": e.pages.bytes if e.pages is not None else 0, "medoid_text": e.medoid_text}
            for e, label in zip(record.episodes, labels, strict=True)
        ],
    )


def asks(rows) -> dict[str, Any]:
    """`kvchat logs --json`, from `Store.asks()` rows (newest first)."""
    return document(asks=[
        {"id": r["id"], "created_at": r["created_at"], "conversation": r["conversation"], "episode": r["episode"],
         "question": r["question"], "answer": r["answer"], "similarity": r["similarity"],
         "timings_ms": r.get("timings") or {}}
        for r in rows
    ])


def eval_rows(rows, gold_rows=(), verdict=()) -> dict[str, Any]:
    """`kvchat eval --json`: one row per variant compared with full KV (`kvchat.eval.evaluate.summarize`) and, for
    histories scored against gold, one per system (`kvchat.eval.gold.summarize_gold`) with the verdict lines."""
    gold = {"gold": {"rows": [_ms(row) for row in gold_rows], "verdict": list(verdict)}} if gold_rows else {}
    return document(rows=[_ms(row) for row in rows], **gold)


def _ms(row: dict) -> dict:
    row = dict(row)
    seconds = row.pop("ingest_seconds", None)
    row["ingest_ms"] = None if seconds is None else round(seconds * 1000, 1)
    return row
