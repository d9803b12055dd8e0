"""An ingest's units of work, and what a resumable ingest keeps of them (kvchat.store.resumable).

The units: each episode's cache, whose block prefill pauses every few blocks (`checkpoint_every`) so its cache can
be checkpointed where nothing but the cache holds state across blocks (no eviction observer, a scorer without
per-entry state), and the recall entries' chunks (`--recall-entries stored`), each computed after the system prompt
and the chunk before it whatever ran before. Each unit runs on its own, in the ingest's process or on a Ray worker
(kvchat.ingest.batch_units), and what it produces (a checkpoint, an episode, a chunk's rows) is written by one
`UnitWriter` either way: a resumed or spread ingest stores the bytes an uninterrupted one does.

`identity` is what an ingest must share with an unfinished one to continue it: a digest of everything that decides
the bytes stored (the tokens, episodes, turn spans and recall chunks, the resolved settings and budgets, the model's
fingerprint, device, dtype and weights). The torch threads are left out: where more or fewer threads sum in another
order, a continued episode's last bits may differ from an uninterrupted one's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvchat.answer import recall_entries
from kvchat.config import CHECKPOINT_MIN_BLOCKS, CHECKPOINTS
from kvchat.kv import codec
from kvchat.kv.cache import EpisodeCache
from kvchat.kv.tensorfile import RowWriter
from kvchat.settings import to_settings
from kvchat.store.files import hold_point
from kvchat.store.resumable import Identity

if TYPE_CHECKING:
    from kvchat.config import CacheConfig
    from kvchat.ingest.plan import IngestPlan
    from kvchat.model.llm import LoadedModel, ModelIdentity
    from kvchat.store import EpisodeRecord, FileRecord, PendingConversation


@dataclass(frozen=True)
class EpisodeStats:
    """What the report needs of a built episode once its cache is written and released."""

    budgets: list[int]        # kept entries per KV head of each layer
    head_entries: list[int]   # kept entries of every (layer, KV head)
    peak_layer_entries: int
    peak_total_entries: int
    offloaded_entries: int = 0  # entries its pages file holds


@dataclass(frozen=True)
class Progressed:
    """An episode's cache after the first `blocks` blocks of its prefill (kvchat.ingest.pipeline.episode_steps)."""

    index: int
    blocks: int
    cache: EpisodeCache


@dataclass(frozen=True)
class Checkpoint:
    """A `Progressed` as it is kept and sent: the cache as the codec encodes it (on the CPU), and its peaks."""

    index: int
    blocks: int
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]
    peaks: tuple[int, int]  # the cache's peak_layer_entries, peak_total_entries so far

    @classmethod
    def of(cls, progressed: Progressed, plan: IngestPlan, fingerprint: str) -> Checkpoint:
        cache, cache_cfg = progressed.cache, plan.config.cache
        meta = codec.meta_of(cache, fingerprint=fingerprint, method=cache_cfg.method, positions=cache_cfg.positions)
        tensors, metadata = codec.encode(cache, meta)
        return cls(progressed.index, progressed.blocks, {k: t.detach().to("cpu") for k, t in tensors.items()},
                   metadata, (cache.peak_layer_entries, cache.peak_total_entries))  # fmt: skip

    def restored(self, lm: LoadedModel) -> Progressed:
        """The cache continued from here: decoded on the model's device and dtype, its original positions tracked
        where it kept them, its peaks as they were."""
        cache, _ = codec.decode(self.tensors, self.metadata, dtype=lm.dtype, device=lm.device, origins=True)
        cache.peak_layer_entries, cache.peak_total_entries = self.peaks
        return Progressed(self.index, self.blocks, cache)

    def note(self) -> dict[str, Any]:
        return {"blocks": self.blocks, "peaks": list(self.peaks)}


@dataclass(frozen=True)
class EpisodeUnit:
    """Build episode `index`'s cache, from `checkpoint` where one was kept."""

    index: int
    checkpoint: Checkpoint | None = None


@dataclass(frozen=True)
class ChunkUnit:
    """Compute the recall entries of chunks `[first, end)`."""

    first: int
    end: int


Unit = EpisodeUnit | ChunkUnit


def identity(plan: IngestPlan, model: ModelIdentity) -> Identity:
    """What an unfinished ingest must share with `plan`, built by `model`, to be continued by it (the module
    docstring says what is in it)."""
    digest = hashlib.sha256()

    def add(part: bytes | str) -> None:
        data = part.encode() if isinstance(part, str) else part
        digest.update(len(data).to_bytes(8, "little") + data)

    add(json.dumps({"settings": to_settings(plan.config, source=None), "prefill": plan.prefill,
                    "budgets": repr(plan.budgets), "heads": repr(plan.heads), "model": [
                        model.fingerprint, model.device, model.dtype, model.weights, model.attention_backend]},
                   sort_keys=True))  # fmt: skip
    for ids in (plan.prefix_ids, plan.context_ids, *plan.episode_ids):
        add(ids.detach().to("cpu", torch.int64).contiguous().numpy().tobytes())
    for episode in plan.episodes:
        add(json.dumps([episode.index, episode.medoid_text, list(episode.segments)]))
        add(episode.centroid.astype("float64").tobytes())
    add(json.dumps(_spans(plan.turn_spans), default=str))
    if plan.recall is not None:
        add(json.dumps([dataclasses.asdict(c) for c in plan.recall.chunks], default=str))
        add(plan.recall.embeddings.astype("float32").tobytes())
        if plan.recall.turns is not None:
            add(plan.recall.turns.starts.astype("int64").tobytes())
            add(plan.recall.turns.embeddings.astype("float32").tobytes())
    if plan.trained is not None:
        trained = plan.trained
        add(json.dumps(trained.metadata(), sort_keys=True))
        for name, tensor in sorted(trained.tensors(torch.float32).items()):
            add(name)
            add(tensor.numpy().tobytes())
    return Identity(digest.hexdigest(), totals(plan))


def _spans(spans: Any) -> Any:
    if isinstance(spans, tuple | list):
        return [_spans(s) for s in spans]
    return dataclasses.asdict(spans)


def stores_recall_entries(plan: IngestPlan) -> bool:
    """Whether the ingest writes a recall entries file (`--recall-entries stored` on a history that recalls)."""
    return plan.recall is not None and plan.config.cache.recall.entries == "stored"


def totals(plan: IngestPlan) -> dict[str, int]:
    """The ingest's units: its episodes, and its recall chunks where it stores their entries."""
    chunks = len(plan.recall.chunks) if plan.recall is not None and stores_recall_entries(plan) else 0
    return {"episodes": len(plan.episodes), "chunks": chunks}


def episode_blocks(plan: IngestPlan, index: int) -> int:
    """The blocks of episode `index`'s prefill (routed: of its own turns)."""
    ids = plan.episode_ids[index] if plan.episode_ids else plan.context_ids
    return -(-int(ids.shape[-1]) // plan.config.cache.block_size)


def checkpoint_every(plan: IngestPlan) -> int:
    """Blocks between two checkpoints of an episode's prefill: the ingest's blocks over `CHECKPOINTS`, at least
    `CHECKPOINT_MIN_BLOCKS` (kvchat.config says why)."""
    blocks = sum(episode_blocks(plan, e.index) for e in plan.episodes) + totals(plan)["chunks"]
    return max(CHECKPOINT_MIN_BLOCKS, -(-blocks // CHECKPOINTS))


def recall_layout(plan: IngestPlan, lm: LoadedModel) -> tuple[recall_entries.Layout, list[torch.Tensor]] | None:
    """The recall entries file's layout and each chunk's token ids, where the ingest stores one."""
    if plan.recall is None or not stores_recall_entries(plan):
        return None
    chunks = plan.recall.chunks
    ids = recall_entries.chunk_ids(lm, chunks)
    return recall_entries.Layout.of(lm, chunks, plan.prefix_ids, storing(plan.config.cache), ids=ids), ids


def storing(cache: CacheConfig) -> recall_entries.Storing:
    """How `--recall-entries stored` keeps a conversation's chunks (RecallConfig's codes, repair and kept share; a
    compressed chunk's entries scored with the caches' pooling)."""
    recalling = cache.recall
    return recall_entries.Storing(recalling.stored_bits, recalling.stored_group, recalling.repair, recalling.kept,
                                  pool_kernel=cache.pool_kernel)  # fmt: skip


def kept(exc: BaseException, pending: PendingConversation) -> None:
    """An ingest stopped by `exc` (Ctrl-C, a kill the process saw, an internal error) whose resumable pending
    conversation kept its completed units: a note on `exc` says so (a user error says it itself)."""
    from kvchat.errors import UserError

    if pending.paused and not isinstance(exc, UserError):
        exc.add_note(f"kept: {pending.done()}; the same ingest run again continues from there")


def note_of(stats: EpisodeStats) -> dict[str, Any]:
    """What an episode's journal line keeps beside its record: its stats, for the report of a resumed ingest."""
    return {"stats": dataclasses.asdict(stats)}


class UnitWriter:
    """The one writer of an ingest's units into its pending conversation, whichever process ran them: checkpoints,
    episodes (written by the caller, `episode`), recall chunks' rows (into the recall entries file, kept open), each
    journaled by a resumable pending conversation once on disk. Opened on a resumed one, it holds what was done
    (`remaining` is the rest). Use as a context manager: the recall entries file is closed, kept, on the way out."""

    def __init__(self, pending: PendingConversation, plan: IngestPlan, layout: recall_entries.Layout | None) -> None:
        self.pending, self.plan, self.layout = pending, plan, layout
        self.records: dict[int, EpisodeRecord] = dict(pending.written_episodes())
        self.stats = {i: EpisodeStats(**pending.episode_note(i)["stats"]) for i in self.records}
        self.recall_file: FileRecord | None = None
        self._starts: dict[int, int] = {}
        self._rows: RowWriter | None = None
        if layout is not None:
            self._rows = RowWriter(pending.recall_entries_path(), layout.shapes, layout.metadata,
                                   resume=pending.resumable)  # fmt: skip
            if self._rows.resumed:
                for (first, end), note in pending.recalled_chunks().items():
                    self._starts |= dict(zip(range(first, end), note.get("starts", ()), strict=False))
            elif pending.recalled_chunks():  # journaled rows the file no longer holds: none of them counts
                pending.reset_chunks()

    def __enter__(self) -> UnitWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._rows is not None:
            self._rows.close()

    @property
    def blocks_done(self) -> int:
        """The blocks (and recall chunks) of the units kept whole: episodes written, chunks written. (A checkpointed
        episode's blocks are reported as its prefill goes on from them.)"""
        return sum(episode_blocks(self.plan, i) for i in self.records) + len(self._starts)

    @property
    def chunks_done(self) -> int:
        return len(self._starts)

    def remaining(self, split: int | None = None) -> list[Unit]:
        """The units left: each episode not written (from its checkpoint, if it has one), then the recall chunks not
        written, as runs of consecutive chunks, each cut into `split` ranges at most (None: whole)."""
        units: list[Unit] = []
        for episode in self.plan.episodes:
            if episode.index not in self.records:
                units.append(EpisodeUnit(episode.index, self._checkpoint(episode.index)))
        if self.layout is None:
            return units
        left = [c for c in range(self.layout.chunks) if c not in self._starts]
        runs: list[list[int]] = []
        for chunk in left:
            if runs and runs[-1][-1] == chunk - 1:
                runs[-1].append(chunk)
            else:
                runs.append([chunk])
        for run in runs:
            size = -(-len(run) // split) if split else len(run)
            units += [ChunkUnit(run[i], run[min(i + size, len(run)) - 1] + 1) for i in range(0, len(run), size)]
        return units

    def _checkpoint(self, index: int) -> Checkpoint | None:
        found = self.pending.checkpoint(index)
        if found is None:
            return None
        tensors, metadata, note = found
        return Checkpoint(index, int(note["blocks"]), tensors, metadata, tuple(note["peaks"]))

    def checkpoint(self, checkpoint: Checkpoint) -> None:
        """Keep an episode's checkpoint (a resumable ingest's; else nothing)."""
        if self.pending.resumable:
            self.pending.write_checkpoint(checkpoint.index, checkpoint.tensors, checkpoint.metadata, checkpoint.note())
            hold_point(f"checkpoint {checkpoint.index} {checkpoint.blocks}")  # a test hook: nothing in a real run

    def episode(self, index: int, record: EpisodeRecord, stats: EpisodeStats) -> None:
        """Episode `index` was written (with `note_of(stats)`)."""
        self.records[index], self.stats[index] = record, stats

    def chunk(self, rows: recall_entries.ChunkRows) -> None:
        """Write one chunk's rows; a resumable ingest makes them durable and journals them."""
        assert self._rows is not None, "the ingest stores no recall entries"
        with self.pending.disk_full_guard():
            rows.write(self._rows)
            if self.pending.resumable:
                self._rows.sync()
        self.pending.note_chunks(rows.chunk, rows.chunk + 1, {"starts": [rows.start]})
        self._starts[rows.chunk] = rows.start

    def finish(self) -> None:
        """Every unit is done: the recall entries file's index written, the file fsync'd and recorded."""
        if self._rows is None or self.layout is None:
            return
        if len(self._starts) != self.layout.chunks:
            raise RuntimeError(f"recall chunks {sorted(set(range(self.layout.chunks)) - set(self._starts))} were "
                               "never written")  # fmt: skip
        with self.pending.disk_full_guard():
            self.layout.index(self._rows, [self._starts[c] for c in range(self.layout.chunks)])
            size, sha256 = self._rows.finish()
        self._rows = None
        self.recall_file = self.pending.recall_entries_written(size, sha256)

    def episode_stats(self) -> list[EpisodeStats]:
        return [self.stats[i] for i in sorted(self.stats)]

    def episode_records(self) -> list[EpisodeRecord]:
        return [self.records[i] for i in sorted(self.records)]
