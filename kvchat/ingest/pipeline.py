"""The ingest pipeline as library calls: plan -> build each episode's cache -> commit; `ingest` runs all three.

- `plan_ingest` (kvchat.ingest.plan): validate the settings, load and tokenize the history, resolve budgets, check
  memory before anything runs, and cut the history into episodes. Nothing is written.
- `build_episodes`: the one episode loop, which `ingest`, an append (kvchat.ingest.append) and a batch worker
  (kvchat.ingest.batch) all run; `build_episode` is one episode's block prefill, the expensive step, with the cache
  features (kvchat.features) taking part.
- `write_episode` and `commit_ingest`: encode each cache to its file (kvchat.kv.codec) in the store's
  pending conversation, then make the conversation visible at once with its resolved settings. A batch
  worker encodes where it builds (`encode_episode`) and its driver writes and commits.
One episode cache is held at a time, so peak memory stays at one prefill's bound.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kvchat import features
from kvchat.answer import recall, recall_entries
from kvchat.features import EpisodeParts, EpisodeSetup
from kvchat.history import spans as turn_spans
from kvchat.history.episodes import Episode
from kvchat.history.loading import Turn
from kvchat.ingest import units
from kvchat.ingest.plan import IngestPlan as IngestPlan
from kvchat.ingest.plan import episode_scorer as episode_scorer
from kvchat.ingest.plan import plan_ingest as plan_ingest
from kvchat.ingest.plan import validate as validate
from kvchat.ingest.units import EpisodeStats as EpisodeStats  # part of this module's API
from kvchat.ingest.units import Progressed
from kvchat.kv import codec
from kvchat.kv.cache import EpisodeCache
from kvchat.kv.cascade import CakeBudgets
from kvchat.kv.prefill import block_prefill, select_from
from kvchat.model.llm import LoadedModel, ModelIdentity
from kvchat.settings import to_settings
from kvchat.store import EpisodeRecord, FileRecord, PagesRecord, PendingConversation, Store
from kvchat.store.files import write_file

if TYPE_CHECKING:
    from kvchat.features.feature import StoredFile


class IngestHooks(Protocol):
    """What an ingest tells a progress display (kvchat.cli.progress's, `IngestProgress`, a server job's)."""

    def planning(self, step: str, done: int, total: int) -> None:
        """A step of planning, before the first block (ingest.plan: reading, tokenizing, embedding, clustering)."""

    def method(self, name: str, history_tokens: int, window: int) -> None:
        """The method the caches are built with (`auto` resolved: kvchat.ingest.plan), said before the first block,
        with what decided `auto`: the history's tokens (the system prompt's included) and the model's window."""

    def planned(self, blocks: int, episodes: int, tokens: int) -> None:
        """The work ahead, before any of it: `blocks` steps (block forwards; `blocks_to_prefill`) in all,
        over `episodes` episodes and `tokens` history tokens, so a display can give an overall ETA."""

    def history(self, done: int, total: int) -> None:
        """Blocks of the one full prefill that `--prefill full` shares among the episodes."""

    def episode(self, index: int, total: int) -> None: ...

    def block(self, done: int, total: int) -> None: ...

    def recall_entries(self, done: int, total: int) -> None:
        """Chunks whose entries are computed (or copied) into the recall entries file (`--recall-entries stored`)."""

    def resuming(self, done: str, blocks: int) -> None:
        """An unfinished ingest of the same history, settings and model continues: `done` says what it had done
        ("3 of 4 episodes done"), `blocks` of the planned blocks behind it (`planned` came first)."""

    def note(self, text: str) -> None:
        """Something to tell the user at once (an unfinished ingest discarded, one that cannot be resumed)."""

    def checkpoint(self, index: int, blocks: int, total: int) -> None:
        """Episode `index`'s prefill was kept after `blocks` of its `total` blocks (a resumable ingest's; on Ray
        workers, every episode's, kvchat.ingest.batch_units)."""

    def running(self, part: str, worker: Any) -> None:
        """On Ray workers: `part` of the ingest ("episode 3", "recall chunks 0-39") went to Ray actor `worker`."""


class IngestProgress:
    """The `IngestHooks` that do nothing: the default, and a base for displays that want a few of them."""

    def planning(self, step: str, done: int, total: int) -> None: ...

    def method(self, name: str, history_tokens: int, window: int) -> None: ...

    def planned(self, blocks: int, episodes: int, tokens: int) -> None: ...

    def history(self, done: int, total: int) -> None: ...

    def episode(self, index: int, total: int) -> None: ...

    def block(self, done: int, total: int) -> None: ...

    def recall_entries(self, done: int, total: int) -> None: ...

    def resuming(self, done: str, blocks: int) -> None: ...

    def note(self, text: str) -> None: ...

    def checkpoint(self, index: int, blocks: int, total: int) -> None: ...

    def running(self, part: str, worker: Any) -> None: ...


@dataclass(frozen=True)
class IngestReport:
    name: str
    method: str
    positions: str
    turns: int
    history_tokens: int
    episodes: int
    budgets: list[int]   # kept entries per KV head of each layer of an episode cache
    layer_budgets: str
    peak_layer_entries: int   # most entries one layer held at once during any episode's prefill
    peak_total_entries: int  # most entries all layers held together at once (per KV head), same counting
    estimated_peak_bytes: int  # the pre-flight memory estimate (kvchat.ingest.preflight)
    cache_bytes: int
    seconds: float
    head_budgets: str = "uniform"
    head_entries: list[int] = dataclasses.field(default_factory=list)  # [fewest, most] entries one KV head kept
    prefill: str = "block"  # how the caches were built: block by block, or selected from the full history
    episode_segments: list[int] = dataclasses.field(default_factory=list)  # history segments in each episode
    notes: list[str] = dataclasses.field(default_factory=list)  # things the user should know, said once
    offload: str = "none"       # none | icecache (evicted entries kept in each episode's pages file)
    offloaded_entries: int = 0  # entries written to the pages files, over episodes, layers and KV heads
    pages_bytes: int = 0        # the pages files' size on disk, over episodes
    cache_precision: str = "full"  # full | int8 | int4 (caches held in 8 or 4 bits, kvchat.features.precision)
    device: str = "cpu"         # where the model ran (--device) and its dtype, which the caches are stored in
    dtype: str = "float32"
    attention_backend: str = "torch"  # decode attention's kernel on that device: torch | flashinfer (kv.backends)
    weights: str = "float"      # how the model's Linear weights were held while it built the caches (--weights)
    budget: int = 0             # M per layer and KV head while answering (--budget): the caches' entries, and with
                                # --method recall the question's recalled chunks (`recalled_entries`) on top
    recalled_entries: int = 0   # --method recall: entries per layer and KV head recalled at each question
    recall_entries_bytes: int = 0  # --recall-entries stored: the recall entries file's size on disk
    skipped_turns: int = 0      # an append of a re-export: its first turns, which the conversation held already

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class BuiltEpisode:
    episode: Episode
    cache: EpisodeCache
    peak_layer_entries: int
    peak_total_entries: int
    parts: EpisodeParts | None = None  # the cache features' parts (IceCache's spilled evictions, ...)
    same_as: int | None = None  # the episode whose cache this one's is (`IngestPlan.one_cache`): its file is named

    def stats(self) -> EpisodeStats:
        heads = [n for layer in self.cache.layers for n in layer.lengths]
        offloaded = self.parts.offloaded if self.parts is not None else 0
        return EpisodeStats(self.cache.sizes, heads, self.peak_layer_entries, self.peak_total_entries, offloaded)


def prefill_history(
    plan: IngestPlan, lm: LoadedModel, *, on_block: Callable[[int, int], None] | None = None
) -> EpisodeCache:
    """The whole history's KV, fed block by block and kept whole: what `--prefill full` selects from."""
    return block_prefill(
        lm.model, plan.prefix_ids, plan.context_ids, block_size=plan.config.cache.block_size, budgets=None,
        scorer=None, on_block=on_block,
    ).cache


def build_episode(
    plan: IngestPlan,
    episode: Episode,
    lm: LoadedModel,
    *,
    on_block: Callable[[int, int], None] | None = None,
    full: EpisodeCache | None = None,
    scratch: Path | None = None,
    resume: EpisodeCache | None = None,
    stored: StoredFile | None = None,
) -> BuiltEpisode:
    """`episode`'s cache: block prefill of the history, or with `plan.prefill == "full"` a selection from
    `full` (`prefill_history`), scored once by the episode's patched prompt; an append continues `resume`, a
    stored cache (`stored`: its side file). The cache features take part (kvchat.features): they observe every
    eviction (IceCache spills what is dropped into `scratch`, IndexMem writes its memory), then finish the
    cache as it is stored (quantized with `--cache-precision`)."""
    *_, built = episode_steps(plan, episode, lm, on_block=on_block, full=full, scratch=scratch, resume=resume,
                              stored=stored)  # fmt: skip
    assert isinstance(built, BuiltEpisode)
    return built


def episode_steps(
    plan: IngestPlan,
    episode: Episode,
    lm: LoadedModel,
    *,
    on_block: Callable[[int, int], None] | None = None,
    full: EpisodeCache | None = None,
    scratch: Path | None = None,
    resume: EpisodeCache | None = None,
    stored: StoredFile | None = None,
    start: Progressed | None = None,
    every: int | None = None,
) -> Iterator[Progressed | BuiltEpisode]:
    """`build_episode` in steps, the last one the BuiltEpisode. With `every`, the block prefill pauses after every
    `every` blocks and yields how far it got (a `Progressed`: a caller may checkpoint it, kvchat.ingest.units) where
    the cache is all its state (no eviction observer, a scorer without per-entry state); `start` continues from
    such a step. Paused or not, the blocks and so the cache are the same (`block_prefill` continues a cache exactly
    from a block boundary)."""
    cache_cfg = plan.config.cache
    scorer = episode_scorer(plan.config, episode, lm, plan.layout, plan.trained)
    compact = cache_cfg.positions == "compact"
    parts = EpisodeParts(EpisodeSetup(cache_cfg, lm.model, plan.trained, scratch, stored))
    recent = features.resident_recent(cache_cfg) if scorer is not None else 0
    # every compacted cache keeps its entries' original positions (receipts, IceCache's placement), but one stored
    # compacted without them cannot get them back
    origins = compact and scorer is not None and (resume is None or resume.origins is not None)
    pausable = every is not None and resume is None and parts.on_evict is None and getattr(scorer, "kept", None) is None
    if start is not None and not (pausable and plan.prefill == "block"):
        raise ValueError("an episode continues from a step only where its prefill pauses (every=, block prefill)")
    if plan.prefill == "full":
        if full is None:
            raise ValueError("a plan with prefill 'full' builds episodes from prefill_history(plan, lm)")
        if scorer is None or plan.budgets is None or isinstance(plan.budgets, CakeBudgets):
            raise ValueError("a plan with prefill 'full' selects with a scorer and fixed budgets")
        last_block = plan.context_ids.split(cache_cfg.block_size, dim=-1)[-1]
        # EpisodeParts.on_evict (kvchat/features) is not annotated: inferred wider than an EvictionObserver
        cache = select_from(lm.model, full, last_block, budgets=plan.budgets, scorer=scorer, heads=plan.heads,
                            compact=compact, on_evict=parts.on_evict,  # type: ignore[arg-type]
                            recent=recent, origins=origins)  # fmt: skip
        if on_block is not None:
            on_block(1, 1)
    else:
        ids = plan.episode_ids[episode.index] if plan.episode_ids else plan.context_ids  # routed: its own turns
        block = cache_cfg.block_size
        total = -(-int(ids.shape[-1]) // block)
        done, held = (start.blocks, start.cache) if start is not None else (0, resume)
        while True:
            end = min(total, done + every) if pausable and every else total
            report = None if on_block is None else (lambda d, _, first=done: on_block(first + d, total))
            held = block_prefill(
                lm.model, plan.prefix_ids if held is None else None, ids[..., done * block : end * block],
                block_size=block, budgets=plan.budgets, scorer=scorer, compact=compact, on_block=report,
                heads=plan.heads, on_evict=parts.on_evict,  # type: ignore[arg-type]  # as in select_from above
                recent=recent, resume=held, origins=origins,
            ).cache  # fmt: skip
            done = end
            if done >= total:
                break
            yield Progressed(episode.index, done, held)
        cache = held
    parts.finish(cache, evicted=scorer is not None)
    yield BuiltEpisode(episode, cache, cache.peak_layer_entries, cache.peak_total_entries, parts)


def blocks_to_prefill(plan: IngestPlan) -> int:
    """Steps the plan's episode loop reports: with `--prefill full` the history's blocks once and one selection
    per episode; else each episode's history (routed: its own turns) in blocks of B."""
    block = plan.config.cache.block_size
    built = 1 if plan.one_cache else len(plan.episodes)
    if plan.prefill == "full":
        return -(-int(plan.context_ids.shape[-1]) // block) + built
    lengths = [int(ids.shape[-1]) for ids in plan.episode_ids] or [int(plan.context_ids.shape[-1])] * built
    return sum(-(-n // block) for n in lengths)


def build_episodes(
    plan: IngestPlan,
    lm: LoadedModel,
    *,
    scratch: Callable[[int], Path],
    progress: IngestHooks | None = None,
    resume: Callable[[Episode], tuple[EpisodeCache, StoredFile | None]] | None = None,
) -> Iterator[BuiltEpisode]:
    """The episode loop that `ingest`, an append (ingest.append) and a batch worker (ingest.batch) all run:
    each episode's cache in turn, one in memory at a time (the caller writes or sends it before asking for
    the next). `scratch(index)` is a private dir for episode `index`'s intermediate files; `resume(episode)`
    gives an append's stored cache and its side file. Where the episodes' caches would all be the same
    (`IngestPlan.one_cache`), the first is built and every other episode is given as the same cache (`same_as`)."""
    progress = progress or IngestProgress()
    progress.method(plan.config.cache.method, int(plan.prefix_ids.shape[-1]) + plan.history_tokens, lm.context_window)
    progress.planned(blocks_to_prefill(plan), len(plan.episodes), int(plan.context_ids.shape[-1]))
    with lm.prefill_weights():  # many-token products by the fastest kernel for the weights held (LoadedModel)
        full = prefill_history(plan, lm, on_block=progress.history) if plan.prefill == "full" else None
        first: BuiltEpisode | None = None
        for episode in plan.episodes:
            progress.episode(episode.index, len(plan.episodes))
            if first is not None:
                yield dataclasses.replace(first, episode=episode, same_as=first.episode.index)
                continue
            cache, stored = resume(episode) if resume is not None else (None, None)
            built = build_episode(plan, episode, lm, on_block=progress.block, full=full, scratch=scratch(episode.index),
                                  resume=cache, stored=stored)  # fmt: skip
            first = built if plan.one_cache else None
            yield built


@dataclass(frozen=True)
class EncodedEpisode:
    """One built episode as its file's tensors and metadata plus its index row: what a batch worker sends
    its driver, which writes it into the pending conversation."""

    index: int
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]
    centroid: list[float]
    medoid_text: str
    budgets: list[int]
    n_tokens: int
    side_file: bytes | None = None  # its side file (IceCache's pages), when a batch worker sends one
    same_as: int | None = None  # the episode whose file holds this one's cache (no tensors of its own then)

    def write(self, pending: PendingConversation, pages: PagesRecord | None = None, note: dict | None = None
              ) -> EpisodeRecord:  # fmt: skip
        """Write and fsync the file in `pending` (not visible until commit); `pages`, its pages file's
        record when the episode offloads (written first: the episode's record refers to it), else the
        record of the `side_file` it carries. `note`: what a resumable ingest journals with it (units.note_of). An
        episode `same_as` another names that one's files."""
        if self.same_as is not None:
            return pending.share_episode(self.index, self.same_as, centroid=self.centroid,
                                         medoid_text=self.medoid_text)  # fmt: skip
        if pages is None and self.side_file is not None:
            data = self.side_file
            pages = pending.write_pages(self.index, lambda path: _write_bytes(path, data))
        return pending.write_episode(
            self.index, self.tensors, self.metadata, centroid=self.centroid, medoid_text=self.medoid_text,
            budgets=self.budgets, n_tokens=self.n_tokens, pages=pages, note=note,
        )


def encode_episode(
    plan: IngestPlan, built: BuiltEpisode, lm: LoadedModel, *, side_file_at: Path | None = None
) -> EncodedEpisode:
    """Encode one episode's cache (kvchat.kv.codec) with its routing data; with `side_file_at`, its side file
    too (written there, then read back into the result: a batch worker's, whose driver writes it). An episode whose
    cache is another's (`same_as`) is encoded as a reference to it."""
    cache = built.cache
    if built.same_as is not None:
        return EncodedEpisode(built.episode.index, {}, {}, centroid=built.episode.centroid.tolist(),
                              medoid_text=built.episode.medoid_text, budgets=list(cache.sizes),
                              n_tokens=cache.entries, same_as=built.same_as)  # fmt: skip
    cache_cfg = plan.config.cache
    meta = codec.meta_of(cache, fingerprint=lm.fingerprint, method=cache_cfg.method, positions=cache_cfg.positions,
                         storage=cache_cfg.storage)  # fmt: skip
    tensors, metadata = codec.encode(cache, meta)
    # the history's turn spans, or (routed) each episode's own turns' (plan.turn_spans types both as one union)
    spans = plan.turn_spans[built.episode.index] if plan.episode_ids and plan.turn_spans else plan.turn_spans
    if spans:  # what `ask --sources` maps cached positions to
        metadata[turn_spans.METADATA_KEY] = turn_spans.to_metadata(spans)  # type: ignore[arg-type]
    if plan.recall is not None:  # the chunks each question recalls turns from (--method recall)
        metadata[recall.METADATA_KEY] = recall.to_metadata(plan.recall)
    side_file = None
    writer = built.parts.side_file(lm.fingerprint) if built.parts is not None and side_file_at is not None else None
    if writer is not None and side_file_at is not None:
        writer(side_file_at)
        side_file = side_file_at.read_bytes()
        side_file_at.unlink()
    return EncodedEpisode(
        built.episode.index, tensors, metadata, centroid=built.episode.centroid.tolist(),
        medoid_text=built.episode.medoid_text, budgets=list(meta.budgets), n_tokens=cache.entries,
        side_file=side_file,
    )


def write_episode(
    pending: PendingConversation, plan: IngestPlan, built: BuiltEpisode, lm: LoadedModel, note: dict | None = None
) -> EpisodeRecord:
    """Encode one episode's cache into its file in the pending conversation (not visible until commit), its
    side file first when a feature writes one (IceCache's pages, streamed from its spill files). `note`: what a
    resumable ingest journals with it; an episode whose cache is another's names that one's files."""
    if built.same_as is not None:
        return encode_episode(plan, built, lm).write(pending)
    writer = built.parts.side_file(lm.fingerprint) if built.parts is not None else None
    pages = pending.write_pages(built.episode.index, writer) if writer is not None else None
    return encode_episode(plan, built, lm).write(pending, pages, note)


def _write_bytes(path: Path, data: bytes) -> tuple[int, str]:
    write_file(path, data)
    return len(data), hashlib.sha256(data).hexdigest()


def recall_entries_writer(
    plan: IngestPlan,
    lm: LoadedModel,
    progress: IngestHooks | None = None,
    previous: recall_entries.StoredEntries | None = None,
) -> Callable[[Path], tuple[int, str]] | None:
    """`--recall-entries stored`: what writes every recall chunk's entries (kvchat.answer.recall_entries) at a path and
    returns (bytes, sha256); `previous`, the stored version's file (an append: its chunks are copied). None where
    the conversation prefills its chunks."""
    recalling = plan.config.cache.recall
    if plan.recall is None or recalling.entries != "stored":
        return None
    on_chunk = progress.recall_entries if progress is not None else None
    chunks = plan.recall.chunks

    def write(path: Path) -> tuple[int, str]:
        with lm.prefill_weights():
            return recall_entries.write(path, lm, chunks, plan.prefix_ids, units.storing(plan.config.cache),
                                        previous=previous, on_chunk=on_chunk)

    return write


def write_recall_entries(
    pending: PendingConversation,
    plan: IngestPlan,
    lm: LoadedModel,
    progress: IngestHooks | None = None,
    previous: recall_entries.StoredEntries | None = None,
) -> FileRecord | None:
    """The conversation's recall entries file (`recall_entries_writer`) written in `pending`; None without one."""
    writer = recall_entries_writer(plan, lm, progress, previous)
    return pending.write_recall_entries(writer) if writer is not None else None


def write_recall_entries_bytes(pending: PendingConversation, data: bytes) -> FileRecord:
    """A recall entries file a batch worker wrote and sent, written in `pending`."""
    return pending.write_recall_entries(lambda path: _write_bytes(path, data))


def commit_ingest(
    pending: PendingConversation,
    plan: IngestPlan,
    built: Sequence[EpisodeStats],
    records: Sequence[EpisodeRecord],
    lm: LoadedModel | ModelIdentity,
    seconds: float,
    recall_file: FileRecord | None = None,
) -> IngestReport:
    """Make the conversation visible with its resolved settings; returns what the ingest did. `lm` is the
    model that built the caches, or its identity where it was loaded elsewhere (a batch worker); `recall_file`,
    its recall entries file (`write_recall_entries`)."""
    cache_cfg = plan.config.cache
    settings = to_settings(plan.config, source=plan.source, appended=plan.appended, reads=plan.reads)
    head_entries = [n for b in built for n in b.head_entries]
    identity = lm.identity if isinstance(lm, LoadedModel) else lm
    report = IngestReport(
        name=plan.name,
        method=cache_cfg.method,
        positions=cache_cfg.positions,
        turns=plan.turns,
        history_tokens=plan.history_tokens,
        episodes=len(built),
        budgets=list(built[-1].budgets),
        layer_budgets=settings["layer_budgets"],
        peak_layer_entries=max(b.peak_layer_entries for b in built),
        peak_total_entries=max(b.peak_total_entries for b in built),
        estimated_peak_bytes=plan.estimated_peak_bytes,
        cache_bytes=sum({r.path: r.bytes for r in records}.values()),  # a file episodes share counted once
        seconds=round(seconds, 2),
        head_budgets=cache_cfg.head_budgets,
        head_entries=[min(head_entries), max(head_entries)] if head_entries else [],
        prefill=plan.prefill,
        episode_segments=list(plan.episode_segments),
        notes=plan.notes,
        offload=cache_cfg.offload.mode,
        offloaded_entries=sum(b.offloaded_entries for b in built),
        pages_bytes=sum({r.pages.path: r.pages.bytes for r in records if r.pages is not None}.values()),
        cache_precision=cache_cfg.precision,
        device=identity.device,
        dtype=identity.dtype,
        attention_backend=identity.attention_backend,
        weights=identity.weights,
        budget=cache_cfg.budget,
        recalled_entries=split.recalled if (split := recall.split_for(cache_cfg)) else 0,
        recall_entries_bytes=recall_file.bytes if recall_file is not None else 0,
    )
    pending.commit(
        model=lm.spec,
        fingerprint=lm.fingerprint,
        settings=settings,
        stats=report.to_dict(),
    )
    return report


def ingest(
    history: str | os.PathLike | Sequence[Turn],
    *,
    store: Store,
    lm: LoadedModel,
    progress: IngestHooks | None = None,
    resumable: bool = False,
    resume: bool | None = None,
    **plan_options: Any,
) -> IngestReport:
    """Build and store the episode caches of one history (a file, or turns already loaded from one).
    Nothing is visible in the store until all is written.

    `plan_options` are `plan_ingest`'s: `name` (required for turns; default: made from the file's name), `config`,
    `encoder`, `replace` an existing conversation, `source` (the history's path to record when turns are
    passed) and `reads` (how it was read: `--format`, `--pick`), `force` past the memory estimate (an ingest
    whose estimate exceeds the available memory is refused by default), `profile_dirs` where layer profiles are
    looked up (default: the store's `profiles/`) before the shipped ones.

    `resumable`: what the ingest completes outlives it (kvchat.ingest.units): stopped (a kill, Ctrl-C, a full disk),
    the same ingest run again continues from its last completed unit, and stores what an uninterrupted one would.
    `resume` (with `resumable`): True requires an unfinished ingest to continue, False starts over, None continues
    one of the same history, settings and model (`Store.begin`)."""
    started = time.perf_counter()
    progress = progress or IngestProgress()
    plan = plan_ingest(history, store=store, lm=lm, on_step=progress.planning, **plan_options)
    identity = units.identity(plan, lm.identity) if resumable else None
    pending = store.begin(plan.name, replace=plan_options.get("replace", False), resumable=identity,
                          resume=resume if resumable else None)
    try:
        with pending:
            recalling = units.recall_layout(plan, lm)
            with pending.disk_full_guard(), units.UnitWriter(pending, plan, recalling and recalling[0]) as writer:
                run_units(plan, lm, pending, writer, progress, recalling[1] if recalling else [])
            return commit_ingest(pending, plan, writer.episode_stats(), writer.episode_records(), lm,
                                 time.perf_counter() - started, writer.recall_file)  # fmt: skip
    except BaseException as exc:
        units.kept(exc, pending)
        raise


def run_units(
    plan: IngestPlan,
    lm: LoadedModel,
    pending: PendingConversation,
    writer: units.UnitWriter,
    progress: IngestHooks,
    chunk_ids: Sequence[torch.Tensor] = (),
) -> None:
    """Every unit the ingest has left (`writer.remaining`), in this process, one episode cache in memory at a time;
    a resumable ingest's episode checkpointed every `units.checkpoint_every` blocks. `chunk_ids`: the recall chunks'
    token ids, where it stores their entries."""
    progress.method(plan.config.cache.method, int(plan.prefix_ids.shape[-1]) + plan.history_tokens, lm.context_window)
    progress.planned(blocks_to_prefill(plan), len(plan.episodes), int(plan.context_ids.shape[-1]))
    if pending.found:
        progress.note(pending.found)
    if pending.resumed:
        progress.resuming(pending.done(), writer.blocks_done)
    every = units.checkpoint_every(plan) if pending.resumable else None
    full = None
    # `plan.one_cache`: every episode's cache is the same, so the first written is every other one's file
    shared = min(writer.records) if plan.one_cache and writer.records else None
    with lm.prefill_weights():  # many-token products by the fastest kernel for the weights held (LoadedModel)
        for unit in writer.remaining():
            if isinstance(unit, units.ChunkUnit):
                assert writer.layout is not None
                rows_of = recall_entries.chunk_rows(lm, writer.layout, chunk_ids, plan.prefix_ids, unit.first, unit.end)
                for rows in rows_of:
                    writer.chunk(rows)
                    progress.recall_entries(rows.chunk + 1, writer.layout.chunks)
                continue
            episode = plan.episodes[unit.index]
            if shared is not None:
                record = pending.share_episode(unit.index, shared, centroid=episode.centroid.tolist(),
                                               medoid_text=episode.medoid_text)  # fmt: skip
                writer.episode(unit.index, record, writer.stats[shared])
                continue
            if plan.prefill == "full" and full is None:
                full = prefill_history(plan, lm, on_block=progress.history)
            progress.episode(unit.index, len(plan.episodes))
            start = unit.checkpoint.restored(lm) if unit.checkpoint is not None else None
            for step in episode_steps(plan, episode, lm, on_block=progress.block, full=full,
                                      scratch=pending.scratch_dir(unit.index), start=start, every=every):  # fmt: skip
                if isinstance(step, Progressed):
                    writer.checkpoint(units.Checkpoint.of(step, plan, lm.fingerprint))
                    progress.checkpoint(unit.index, step.blocks, units.episode_blocks(plan, unit.index))
                else:
                    stats = step.stats()
                    writer.episode(unit.index, write_episode(pending, plan, step, lm, units.note_of(stats)), stats)
                    shared = unit.index if plan.one_cache else None
    writer.finish()
