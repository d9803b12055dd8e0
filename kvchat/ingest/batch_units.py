"""One large history's ingest spread over Ray workers (`kvchat ingest --ray`; the optional extra `kvchat[batch]`).

A history of 10^6 tokens is hours of block prefill on one machine's cores, yet most of it is independent: each
episode's cache is its own prefill, and each recall chunk's entries are computed after the system prompt and the
chunk before it alone (kvchat.ingest.units). A worker plans the history (the driver loads no model), the driver
hands the units out, longest episodes first, and writes what comes back (checkpoints, episodes, chunks' rows)
through the same `UnitWriter` as a local ingest, so the store holds the same bytes. The driver alone writes the
store, as in `ingest-batch` (kvchat.ingest.batch): no shared file system, one SQLite writer.

A worker that dies loses at most the blocks since its episode's last checkpoint (every `units.checkpoint_every`
blocks, sent to the driver) or its chunk in progress: the unit goes to another worker from there, once more at most
(`BatchConfig.attempts` tries). A resumable ingest (the default of `kvchat ingest`) keeps what was written, so a run
stopped in any way continues, with or without Ray, from its last completed unit.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvchat.answer.recall_entries import ChunkRows
from kvchat.config import RAY_CHUNK_SPLIT, BatchConfig, IngestConfig
from kvchat.errors import UserError, first_line
from kvchat.history.loading import Turn
from kvchat.ingest import units
from kvchat.ingest.batch import Workers, as_user_error, import_ray, ray_session, workers_for
from kvchat.ingest.batch_worker import EpisodeBuilt, HistoryJob, UnitDone, UnitsPlanned
from kvchat.ingest.pipeline import IngestHooks, IngestProgress, IngestReport, blocks_to_prefill, commit_ingest, validate
from kvchat.messages import option
from kvchat.model.cores import usable_cores
from kvchat.store import PendingConversation, Store

WAIT_S = 0.5  # the driver's longest wait for a worker before it looks at Ctrl-C again


def ingest_spread(
    turns: Sequence[Turn],
    *,
    name: str,
    store: Store,
    config: IngestConfig,
    batch: BatchConfig = BatchConfig(),
    source: str | None = None,
    reads: dict[str, str] | None = None,
    replace: bool = False,
    force: bool = False,
    max_memory: int | None = None,
    trust_remote_code: bool = False,
    progress: IngestHooks | None = None,
    resumable: bool = False,
    resume: bool | None = None,
) -> IngestReport:
    """Ingest `turns` as conversation `name` with its units spread over Ray workers (see the module docstring); the
    arguments are `ingest`'s and `ingest_batch`'s. `batch.workers` workers of `batch.threads` torch threads each, on
    a local Ray (this machine's usable cores) or the cluster at `batch.address`; `max_memory`, the bytes each
    worker's ingest may use (default: the memory available on its node shared among the workers there)."""
    started = time.perf_counter()
    validate(config)
    if batch.threads < 1 or (batch.workers is not None and batch.workers < 1) or batch.attempts < 1:
        raise UserError(f"{option('workers')} and {option('threads')} must be >= 1")
    store.check_writable()
    if not replace and name in {c.name for c in store.conversations()}:
        raise UserError(f"conversation '{name}' exists; use {option('replace')}")
    progress = progress or IngestProgress()
    ray = import_ray()
    if batch.address is None and not ray.is_initialized():
        workers_for(batch, usable_cores())  # before a local Ray is started for nothing
    with ray_session(ray, batch.address):
        workers = Workers(ray, batch)
        try:
            workers.start(config.model, store, trust_remote_code)
            job = HistoryJob(name, source or "", list(turns), config, None, True, force, max_memory,
                             workers.shares.get(workers.handles[0], 1), reads or {})  # fmt: skip
            progress.planning("planning on a worker", 0, 1)
            planned: UnitsPlanned = _get(ray, workers.handles[0].plan_units.remote(job))
            plan = planned.plan
            identity = units.identity(plan, planned.model) if resumable else None
            pending = store.begin(name, replace=replace, resumable=identity, resume=resume if resumable else None)
            try:
                with pending, pending.disk_full_guard(), units.UnitWriter(pending, plan, planned.layout) as writer:
                    progress.method(plan.config.cache.method, int(plan.prefix_ids.shape[-1]) + plan.history_tokens,
                                    planned.context_window)
                    progress.planned(blocks_to_prefill(plan), len(plan.episodes), int(plan.context_ids.shape[-1]))
                    if pending.found:
                        progress.note(pending.found)
                    if pending.resumed:
                        progress.resuming(pending.done(), writer.blocks_done)
                    _Spread(ray, workers, batch, plan, pending, writer, progress).run()
                    writer.finish()
                    return commit_ingest(pending, plan, writer.episode_stats(), writer.episode_records(),
                                         planned.model, time.perf_counter() - started, writer.recall_file)  # fmt: skip
            except BaseException as exc:
                units.kept(exc, pending)
                raise
        finally:
            workers.stop()


def _get(ray: Any, call: Any) -> Any:
    """A call's result; a worker's own exception as a one-line UserError, a dead worker as another."""
    try:
        return ray.get(call)
    except ray.exceptions.RayTaskError as exc:
        raise as_user_error(exc) from None
    except ray.exceptions.RayError as exc:
        raise UserError(f"the worker planning the history died ({first_line(exc)})") from None


@dataclass
class _Running:
    """A unit on a worker: the call awaited, and how far it got (to give the rest to another worker)."""

    unit: units.Unit
    worker: Any
    call: Any = None
    next_chunk: int = 0  # a chunk unit: the first chunk it has not sent yet


class _Spread:
    """Hands the units out to idle workers and writes what they send, one step at a time."""

    def __init__(self, ray: Any, workers: Workers, batch: BatchConfig, plan: Any, pending: PendingConversation,
                 writer: units.UnitWriter, progress: IngestHooks) -> None:  # fmt: skip
        self.ray, self.workers, self.batch, self.plan = ray, workers, batch, plan
        self.pending, self.writer, self.progress = pending, writer, progress
        self.every = units.checkpoint_every(plan)  # also when not resumable: a dead worker loses no more than this
        self.checkpoints: dict[int, units.Checkpoint] = {}  # each episode's latest, to give it to another worker
        self.tries: dict[tuple, int] = {}
        self.waiting: dict[Any, _Running] = {}

    def run(self) -> None:
        ray = self.ray
        self._share_one_cache()
        left = self.writer.remaining(split=len(self.workers.handles) * RAY_CHUNK_SPLIT)
        episodes = sorted((u for u in left if isinstance(u, units.EpisodeUnit)),
                          key=lambda u: -units.episode_blocks(self.plan, u.index))  # longest first
        if self.plan.one_cache:  # every episode's cache is the same: one is built, the others share its file
            episodes = sorted(episodes, key=lambda u: u.index)[:1]
        queue: deque[units.Unit] = deque([*episodes, *(u for u in left if isinstance(u, units.ChunkUnit))])
        if not queue:
            return
        plan_ref = ray.put(self.plan)
        idle = []
        for handle, call in [(h, h.adopt.remote(plan_ref)) for h in list(self.workers.handles)]:
            try:
                ray.get(call)
                idle.append(handle)
            except ray.exceptions.RayError:
                self.workers.lost(handle)
        while queue or self.waiting:
            while queue and idle:
                self._dispatch(queue.popleft(), idle.pop(0))
            if not self.waiting:
                raise UserError("no worker left: every worker died")
            ready, _ = ray.wait(list(self.waiting), num_returns=1, timeout=WAIT_S)
            for call in ready:
                running = self.waiting.pop(call)
                outcome, rest = self._receive(running, call)
                if rest is not None:
                    queue.appendleft(rest)
                if outcome == "done":  # its worker takes the next unit
                    idle.append(running.worker)
        self._share_one_cache()

    def _share_one_cache(self) -> None:
        """`plan.one_cache`, once one episode is written: every other episode's record names its file (as
        `pipeline.run_units` does)."""
        if not self.plan.one_cache or not self.writer.records:
            return
        shared = min(self.writer.records)
        for episode in self.plan.episodes:
            if episode.index not in self.writer.records:
                record = self.pending.share_episode(episode.index, shared, centroid=episode.centroid.tolist(),
                                                    medoid_text=episode.medoid_text)  # fmt: skip
                self.writer.episode(episode.index, record, self.writer.stats[shared])

    def _dispatch(self, unit: units.Unit, worker: Any) -> None:
        key = _key(unit)
        self.tries[key] = self.tries.get(key, 0) + 1
        running = _Running(unit, worker, next_chunk=unit.first if isinstance(unit, units.ChunkUnit) else 0)
        if isinstance(unit, units.EpisodeUnit):
            self.progress.episode(unit.index, len(self.plan.episodes))
        self._await(running, worker.unit.remote(unit, self.every))
        self.progress.running(_part(unit), worker)

    def _await(self, running: _Running, call: Any) -> None:
        running.call = call
        self.waiting[call] = running

    def _receive(self, running: _Running, call: Any) -> tuple[str, units.Unit | None]:
        """Handle one step of `running`: ("done", None) when its unit is, ("step", None) when it goes on, ("died", what
        is left of its unit) when its worker died."""
        errors = self.ray.exceptions
        try:
            step = self.ray.get(call)
        except errors.RayTaskError as exc:  # the unit raised: the ingest's own failure
            raise as_user_error(exc) from None
        except errors.RayError as exc:  # the worker died, or its node
            self.workers.lost(running.worker)
            tries = self.tries[_key(running.unit)]
            if tries >= self.batch.attempts or not self.workers.handles:
                raise UserError(f"a worker died ({first_line(exc)}) on each of {tries} tries of one part of the "
                                "ingest") from None  # fmt: skip
            self.progress.note(f"a worker died ({first_line(exc)}): its part goes to another worker")
            return "died", self._rest(running.unit, running.next_chunk)
        if isinstance(step, UnitDone):
            return "done", None
        self._await(running, running.worker.advance.remote())  # the worker goes on meanwhile
        if isinstance(step, units.Checkpoint):
            self.checkpoints[step.index] = step
            self.writer.checkpoint(step)
            self.progress.checkpoint(step.index, step.blocks, units.episode_blocks(self.plan, step.index))
        elif isinstance(step, EpisodeBuilt):
            stats, index = step.stats, step.encoded.index
            self.writer.episode(index, step.encoded.write(self.pending, note=units.note_of(stats)), stats)
            self.checkpoints.pop(index, None)
        elif isinstance(step, ChunkRows):
            self.writer.chunk(step)
            running.next_chunk = step.chunk + 1
            assert self.writer.layout is not None
            self.progress.recall_entries(self.writer.chunks_done, self.writer.layout.chunks)
        else:
            raise TypeError(f"unexpected step from a worker: {step!r}")
        return "step", None

    def _rest(self, unit: units.Unit, next_chunk: int) -> units.Unit | None:
        """What is left of `unit` (an episode from its latest checkpoint, the chunks not sent) for another worker."""
        if isinstance(unit, units.EpisodeUnit):
            return units.EpisodeUnit(unit.index, self.checkpoints.get(unit.index, unit.checkpoint))
        return units.ChunkUnit(next_chunk, unit.end) if next_chunk < unit.end else None


def _part(unit: units.Unit) -> str:
    if isinstance(unit, units.EpisodeUnit):
        return f"episode {unit.index + 1}"
    return f"recall chunks {unit.first}-{unit.end - 1}"


def _key(unit: units.Unit) -> tuple:
    """A unit's identity across its tries (an episode's index, a chunk range's end)."""
    return ("episode", unit.index) if isinstance(unit, units.EpisodeUnit) else ("chunks", unit.end)
