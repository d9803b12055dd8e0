"""New turns for a stored conversation without ingesting its past again (`kvchat ingest --append`).

Every episode cache covers the whole history (its patched prompt decides what it keeps), so each one
continues block prefill with the new turns from where it stopped (`block_prefill(resume=...)`), with the
settings the conversation was built with (kvchat.settings). The new turns' segments join their nearest
episode, whose centroid moves to the mean of its members' embeddings; when they are far from every
episode, a note says that `--reingest` (cluster everything again) would route them better. With
`--method routed` (and `recall`) a cache holds its episode's turns only, so each one continues with the new turns of the
segments that joined it (and one that got none is kept as it was). A history that now outgrows the model's
window continues at compact positions (kvchat.ingest.plan). The new version is committed atomically: until then
questions are answered from the old one.

Design notes (the details and the choices made): docs/internals.md, "kvchat/ingest/append.py".
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np

from kvchat import features
from kvchat.answer import recall
from kvchat.answer.rag import RagIndex
from kvchat.answer.recall_entries import StoredEntries
from kvchat.config import APPEND_FAR_SIMILARITY
from kvchat.errors import UserError, message
from kvchat.history import spans as turn_spans
from kvchat.history.episodes import Episode
from kvchat.history.loading import Turn, load_history
from kvchat.history.reexport import already_stored
from kvchat.history.spans import TurnSpan
from kvchat.ingest.pipeline import (
    IngestProgress,
    IngestReport,
    build_episodes,
    commit_ingest,
    ingest,
    write_episode,
    write_recall_entries,
)
from kvchat.ingest.plan import Continuation, plan_ingest
from kvchat.kv import codec
from kvchat.kv.cache import EpisodeCache
from kvchat.kv.methods import method
from kvchat.messages import command, option
from kvchat.model.encoder import SentenceEncoder
from kvchat.model.llm import LoadedModel
from kvchat.settings import from_settings, rebuild_command
from kvchat.settings_table import given
from kvchat.store import ConversationRecord, Store, is_legacy_fingerprint

if TYPE_CHECKING:
    from kvchat.features.feature import StoredFile

_REINGEST = f"{option('append')} {option('reingest')}"  # an append that clusters everything again


def append(
    history: str | os.PathLike | Sequence[Turn],
    *,
    name: str,
    store: Store,
    lm: LoadedModel,
    encoder: SentenceEncoder,
    progress: IngestProgress | None = None,
    source: str | None = None,
    force: bool = False,
    profile_dirs: Sequence[Path] | None = None,
    read: dict[str, str] | None = None,
) -> IngestReport:
    """Continue conversation `name` with the turns of `history` (a file, or turns loaded from `source`, read with
    `read`'s `format` and `pick`: kept, so `--append --reingest` reads it the same way)."""
    started = time.perf_counter()
    record = _record(store, name, lm)
    config = from_settings(record.settings, record.model)
    features.check_append(config.cache, name)
    if method(config.cache.method).trained:
        raise UserError(f"conversation '{name}' was built with {given('method', config.cache.method)}, whose caches "
                        "cannot be continued (the indexer's keys of stored entries are not kept); use "
                        f"{_REINGEST}")
    source_now = str(Path(history).resolve()) if isinstance(history, (str, os.PathLike)) else source
    earlier = (record.settings.get("source"), *record.settings.get("appended", []))
    appended = (*earlier[1:], *([source_now] if source_now else []))
    routed = method(config.cache.method).routed
    # what each stored episode file says (routed: each one's; else the first's): its turns' spans (receipts), how
    # much history it holds
    stored_metadata = [store.load_episode(e, lm.fingerprint)[1] for e in record.episodes[: None if routed else 1]]
    extents = [_stored_extent(metadata) for metadata in stored_metadata]
    history, skipped = _new_turns(history, read, [s for spans, _ in extents for s in spans])
    continuing = Continuation(
        turns=int(record.stats.get("turns", 0)), history_tokens=int(record.stats.get("history_tokens", 0)),
        source=record.settings.get("source"),
        place=lambda segments, notes: _moved_episodes(record, segments, encoder, notes),
        episode_tokens=tuple(tokens for _, tokens in extents) if routed else (),
    )  # fmt: skip
    reads = dict(record.settings.get("reads") or {}) | ({source_now: read} if source_now and read else {})
    plan = plan_ingest(
        history, name=name, config=config, store=store, lm=lm, encoder=encoder, replace=True, force=force,
        profile_dirs=profile_dirs, appended=appended, continuing=continuing, reads=reads,
        on_step=None if progress is None else progress.planning,
    )  # fmt: skip
    if skipped:
        plan.notes.append(f"{skipped} of the file's turns were in '{name}' already (a re-export?): appended the "
                          f"{plan.turns - continuing.turns} after them")
    elif source_now and source_now in earlier:
        plan.notes.append(f"{source_now} was ingested into '{name}' before: its turns are now in it twice "
                          f"(`{_REINGEST}` of the files you mean rebuilds it without "
                          "them)")
    side_file = features.side_file_name(config.cache)
    # receipts need every turn's span: none when the stored caches predate them (routed: one list per episode)
    both: tuple[TurnSpan, ...] | tuple[tuple[TurnSpan, ...], ...]
    if routed:  # the plan's spans are per episode
        per_episode = cast(tuple[tuple[TurnSpan, ...], ...], plan.turn_spans)
        both = tuple((*spans, *new) for (spans, _), new in zip(extents, per_episode, strict=True)) if (
            per_episode and all(spans for spans, _ in extents)) else ()  # fmt: skip
    else:
        both = (*extents[0][0], *cast(tuple[TurnSpan, ...], plan.turn_spans)) if extents[0][0] else ()
    plan = dataclasses.replace(plan, turn_spans=both)
    if plan.recall is not None:  # questions recall from the stored turns' chunks and the new ones'
        stored_recall = _stored_recall(store, record, stored_metadata[0])
        plan = dataclasses.replace(plan, recall=recall.joined(stored_recall, plan.recall))

    def resume(episode: Episode) -> tuple[EpisodeCache, StoredFile | None]:
        stored = record.episodes[episode.index]
        cache, meta = codec.decode(*store.load_episode(stored, lm.fingerprint), dtype=lm.dtype, device=lm.device,
                                   origins=True)  # fmt: skip
        if meta.positions == "original" and plan.config.cache.positions == "compact":
            cache.track_origins()  # its positions are the original ones until it is compacted
        cache.dequantize()  # a quantized cache continues in full precision, and is quantized again when done
        return cache, (lambda: store.load_pages(stored, lm.fingerprint)) if side_file else None

    stats, records = [], []
    with store.begin(name, replace=True, expect=record.ingest_id) as pending:  # no lost update
        with pending.disk_full_guard():  # with --offload: the stored pages and the new evictions, spilled
            for built in build_episodes(plan, lm, scratch=pending.scratch_dir, progress=progress, resume=resume):
                records.append(write_episode(pending, plan, built, lm))
                stats.append(built.stats())
            recall_file = write_recall_entries(pending, plan, lm, progress, _stored_entries(store, record, lm))
        report = commit_ingest(pending, plan, stats, records, lm, time.perf_counter() - started, recall_file)
    return dataclasses.replace(report, skipped_turns=skipped)


def reingest(
    history: str | os.PathLike,
    *,
    name: str,
    store: Store,
    lm: LoadedModel,
    encoder: SentenceEncoder,
    progress: IngestProgress | None = None,
    force: bool = False,
    read: dict[str, str] | None = None,
) -> IngestReport:
    """`--append --reingest`: the stored history, what was appended to it and `history` (read with `read`'s
    `format` and `pick`), ingested again from the start with the conversation's settings (episodes clustered
    anew). Each stored history is read as it was (`--format`, `--pick` kept in the settings' `reads`)."""
    record = _record(store, name, lm)
    settings = record.settings
    sources = [settings.get("source"), *settings.get("appended", [])]
    missing = [s for s in sources if not s or not Path(s).is_file()]
    if missing:
        raise UserError(
            f"{option('reingest')} needs the histories conversation '{name}' was built from; missing: "
            f"{', '.join(str(m) for m in missing)}"
        )
    new = str(Path(history).resolve())
    reads = dict(settings.get("reads") or {}) | ({new: read} if read else {})
    turns = [turn for path in [*sources, new] for turn in _read_again(path, reads.get(path) or {})]
    return ingest(
        turns, name=name, config=from_settings(settings, record.model), store=store, lm=lm, encoder=encoder,
        progress=progress, replace=True, source=sources[0], force=force, appended=[*sources[1:], new], reads=reads,
    )


def _new_turns(history: str | os.PathLike | Sequence[Turn], read: dict[str, str] | None,
               stored: Sequence[TurnSpan]) -> tuple[list[Turn], int]:
    """The turns of `history` the conversation does not hold yet, and how many it does (a re-export begins with
    them: kvchat.history.reexport); `stored`: its turns' spans, routed episodes' merged back into history order.
    Refused when every turn is stored already."""
    turns = list(history) if not isinstance(history, (str, os.PathLike)) else load_history(
        history, min_turns=1, **(read or {}))  # fmt: skip
    ordered = sorted({s.index: s for s in stored}.values(), key=lambda s: s.index)
    skipped = already_stored(turns, ordered)
    if skipped == len(turns):
        raise NothingNew(skipped)
    return turns[skipped:], skipped


class NothingNew(UserError):
    """An append whose every turn the conversation holds already: nothing is written."""

    def __init__(self, turns: int) -> None:
        super().__init__(f"nothing to append: the conversation holds all {turns} of the file's turns already")
        self.turns = turns


def _stored_entries(store: Store, record: ConversationRecord, lm: LoadedModel) -> StoredEntries | None:
    """The stored version's recall entries file (`--recall-entries stored`), whose chunks the new file copies; None
    where it has none or it does not read (the new file then computes every chunk)."""
    if record.recall_entries is None:
        return None
    try:
        return StoredEntries.opened(*store.load_recall_entries(record, lm.fingerprint))
    except ValueError:
        return None


def _stored_recall(store: Store, record: ConversationRecord, metadata: dict[str, str]) -> RagIndex:
    """The chunk index the stored caches recall from (`--method recall`)."""
    rebuild = f"`{command('ingest', 'HISTORY', name=record.name, append=True, reingest=True)}`"
    try:
        index = recall.from_metadata(metadata)
    except ValueError as e:
        raise UserError(f"conversation '{record.name}' episode 0: {message(e)}; rebuild it with {rebuild}") from None
    if index is None:
        raise UserError(f"conversation '{record.name}' has no recall index to extend; rebuild it with {rebuild}")
    return index


def _record(store: Store, name: str, lm: LoadedModel) -> ConversationRecord:
    record = store.get(name)
    if is_legacy_fingerprint(record.fingerprint):
        rebuild = rebuild_command(name, record.model, record.settings, replace=True)
        raise UserError(f"conversation '{name}' was built by an older kvchat (its model fingerprint included the "
                        f"dtype); rebuild it with `{rebuild}`")
    if record.fingerprint != lm.fingerprint:
        raise UserError(
            f"conversation '{name}' was built with model {record.model!r}; append with {option('model', record.model)}"
        )
    return record


def _read_again(path: str, read: Mapping[str, str]) -> list[Turn]:
    """A history the conversation was built from, read with the format and pick it was read with."""
    return load_history(path, format=read.get("format"), pick=read.get("pick"))


def _stored_extent(metadata: dict[str, str]) -> tuple[tuple[TurnSpan, ...], int]:
    """A stored episode file's turn spans and the history tokens its cache holds (a routed episode's: its own)."""
    spans, meta = tuple(turn_spans.from_metadata(metadata) or ()), codec.EpisodeMeta.from_metadata(metadata)
    end = spans[-1].end if spans else meta.next_origin if meta.next_origin is not None else meta.next_position
    return spans, end - meta.protected


def _moved_episodes(
    record: ConversationRecord, segments: list[str], encoder: SentenceEncoder, notes: list[str]
) -> tuple[list[Episode], list[int], list[int]]:
    """The stored episodes with the new segments joined to their nearest one, each one's segment count, and the
    episode each new segment joined: centroids move to the mean of their members (stored counts; an older
    store's are taken as equal shares). Medoids, hence patched prompts, stay: they decided what the stored caches
    kept."""
    centroids = np.asarray([e.centroid for e in record.episodes], dtype=np.float64)
    counts = record.stats.get("episode_segments") or []
    if len(counts) != len(centroids):
        turns, window = int(record.stats.get("turns", 0)), from_settings(record.settings).episodes.segment_turns
        counts = [max(1, -(-turns // window) // len(centroids))] * len(centroids)
    sums = centroids * np.asarray(counts, dtype=np.float64)[:, None]
    members = [int(n) for n in counts]
    joined: list[int] = []
    if segments:
        embeddings = np.asarray(encoder.embed(segments), dtype=np.float64)
        similarity = embeddings @ centroids.T
        nearest = similarity.argmax(axis=1)
        joined = [int(e) for e in nearest]
        for row, episode in zip(embeddings, nearest, strict=True):
            sums[episode] += row
            members[episode] += 1
        best = float(similarity.max(axis=1).mean())
        if best < APPEND_FAR_SIMILARITY:
            notes.append(
                f"the new turns are far from every episode (mean similarity {best:.2f} to the nearest): "
                f"questions about them route poorly; `{_REINGEST}` clusters everything again"
            )
    moved = sums / np.linalg.norm(sums, axis=1, keepdims=True)
    episodes = [Episode(e.index, moved[i].astype(np.float32), (), e.medoid_text) for i, e in enumerate(record.episodes)]
    return episodes, members, joined
