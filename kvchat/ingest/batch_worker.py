"""A batch ingest's worker (kvchat.ingest.batch): one Ray actor's state and the steps it sends its driver.

The worker loads the model and the encoder once, then ingests the histories it is given one at a time
with the pipeline's own steps (`plan_ingest`, `build_episodes`, `encode_episode`), sending each episode as
soon as it is built; it never touches the store, whose only writer is the driver. IceCache's evictions are
spilled into a temp dir of the worker's own and its pages file travels with the episode.

For one large history spread over the workers (kvchat.ingest.batch_units) a worker plans it (`plan_units`), then
runs the units the driver hands it (`adopt` the plan once, `unit` per unit): an episode's cache, sending a
checkpoint every few blocks and the encoded episode, or a range of recall chunks, sending each chunk's rows.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvchat.answer.recall_entries import Layout, chunk_rows
from kvchat.config import WEIGHTS, DeviceConfig, IngestConfig
from kvchat.errors import UserError
from kvchat.history.loading import Turn
from kvchat.ingest import preflight
from kvchat.ingest.pipeline import (
    EncodedEpisode,
    EpisodeStats,
    IngestPlan,
    build_episodes,
    encode_episode,
    episode_steps,
    plan_ingest,
    prefill_history,
    recall_entries_writer,
)
from kvchat.ingest.units import Checkpoint, ChunkUnit, Progressed, Unit, recall_layout
from kvchat.messages import option
from kvchat.model.device import resolve
from kvchat.model.encoder import SentenceEncoder
from kvchat.model.llm import LoadedModel, ModelIdentity, load_model, use_threads
from kvchat.settings import to_settings, upgraded
from kvchat.store.files import hold_point


@dataclass(frozen=True)
class StoredIngest:
    """What the store holds of a conversation, to tell whether a re-run may skip its history."""

    settings: dict
    fingerprint: str
    turns: int | None
    history_tokens: int | None


@dataclass(frozen=True)
class HistoryJob:
    """One history as the driver hands it to a worker."""

    name: str
    source: str  # the history's path, recorded for rebuild commands
    turns: list[Turn]
    config: IngestConfig
    stored: StoredIngest | None
    replace: bool
    force: bool
    max_memory: int | None  # bytes this ingest may use; None: the memory available / workers on the node
    workers_on_node: int
    read: dict[str, str] = dataclasses.field(default_factory=dict)  # how it was read (settings.read_options)


# A worker's steps through one history: Skipped, or Planned, one EncodedEpisode per episode, its RecallEntries
# (`--recall-entries stored`), then Finished.


@dataclass(frozen=True)
class Planned:
    """The history will be ingested: the driver opens its pending conversation."""

    episodes: int


@dataclass(frozen=True)
class Skipped:
    """Stored already with the same settings, model and history."""


@dataclass(frozen=True)
class RecallEntries:
    """The history's recall entries file (kvchat.answer.recall_entries), for the driver to write."""

    data: bytes


@dataclass(frozen=True)
class Finished:
    """Every episode was sent: what the driver needs to commit."""

    plan: IngestPlan
    stats: list[EpisodeStats]
    model: ModelIdentity


@dataclass(frozen=True)
class UnitsPlanned:
    """One history planned for its units to be spread (kvchat.ingest.batch_units): the plan, the recall entries
    file's layout where it stores one, the model that planned it and its context window (the driver announces the
    method with it, as a local ingest does)."""

    plan: IngestPlan
    layout: Layout | None
    model: ModelIdentity
    context_window: int = 0


@dataclass(frozen=True)
class EpisodeBuilt:
    """An episode unit's result: the episode encoded, and its stats for the report."""

    encoded: EncodedEpisode
    stats: EpisodeStats


@dataclass(frozen=True)
class UnitDone:
    """The unit has sent all it had."""


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker tells the driver once loaded."""

    fingerprint: str
    node: str  # Ray node id: workers on one node share its memory


class HistoryWorker:
    """The state of one Ray actor: the model and encoder, loaded once, and the history in progress.

    The driver calls `start(job)` and then `advance()` until it returns `Finished` (or `Skipped`); each
    call returns one step (`Planned`, an `EncodedEpisode`, ...), so an episode reaches the driver as soon
    as it is built and a worker holds one episode cache at a time, as `kvchat ingest` does.
    """

    def __init__(self) -> None:
        self._lm: LoadedModel | None = None
        self._encoder: SentenceEncoder | None = None
        self._profiles: dict[str, str] | None = None
        self._steps: Iterator[Any] = iter(())
        self._plan: IngestPlan | None = None  # the history whose units this worker runs (`adopt`)
        self._recall: tuple[Layout, list] | None = None
        self._full: Any = None  # a plan with prefill "full": the whole history's KV, once

    def load(
        self, spec: str, models_dir: str, threads: int, trust_remote_code: bool, profiles: dict[str, str],
        device: DeviceConfig = DeviceConfig(), weights: str = WEIGHTS,
    ) -> WorkerInfo:
        """Load the model and encoder with `threads` torch threads, on the device `device` resolves to here (Ray
        shows an actor only the GPUs it was given, `gpu_share`), its Linear weights held as `weights` (`ingest
        --weights`). `profiles` are the driver's own layer profiles (file name -> JSON), so a worker on another
        machine resolves budgets as the driver would."""
        import ray

        use_threads(threads)
        self._lm = load_model(spec, Path(models_dir), trust_remote_code=trust_remote_code, placement=resolve(device),
                              weights=weights)
        self._encoder = SentenceEncoder()
        self._profiles = dict(profiles)  # written out only while a history is planned: a killed actor leaves no dir
        return WorkerInfo(self._lm.fingerprint, ray.get_runtime_context().get_node_id())

    def start(self, job: HistoryJob) -> Any:
        """Begin `job` (dropping any unfinished one) and return its first step."""
        self._steps = self._ingest(job)
        return self.advance()

    def advance(self) -> Any:
        step = next(self._steps)
        if isinstance(step, (Finished, Skipped, UnitDone)):
            self._steps = iter(())  # release the history's tensors now, not at the next start
        return step

    def plan_units(self, job: HistoryJob) -> UnitsPlanned:
        """Plan `job`'s history for its units to be spread over the workers (checked against the memory there is
        unless `job.force`)."""
        plan, available = self._plan_job(job)
        if not job.force:
            self._check_fits(plan, available)
        assert self._lm is not None
        found = recall_layout(plan, self._lm)
        return UnitsPlanned(plan, found[0] if found else None, self._lm.identity, self._lm.context_window)

    def adopt(self, plan: IngestPlan) -> None:
        """The history whose units come next (the driver's `ray.put` of the plan `plan_units` made)."""
        self._plan, self._recall, self._full = plan, None, None
        self._steps = iter(())

    def unit(self, unit: Unit, every: int | None) -> Any:
        """Begin `unit` of the adopted plan, an episode's prefill pausing every `every` blocks; its first step."""
        self._steps = self._unit_steps(unit, every)
        return self.advance()

    def _unit_steps(self, unit: Unit, every: int | None) -> Iterator[Any]:
        plan, lm = self._plan, self._lm
        if plan is None or lm is None:
            raise RuntimeError("HistoryWorker.adopt must run first")
        with lm.prefill_weights():  # held while the unit runs (a dropped unit's generator releases them on close)
            yield from self._unit_parts(plan, lm, unit, every)
        yield UnitDone()

    def _unit_parts(self, plan: IngestPlan, lm: LoadedModel, unit: Unit, every: int | None) -> Iterator[Any]:
        if isinstance(unit, ChunkUnit):
            if self._recall is None:
                self._recall = recall_layout(plan, lm)
            assert self._recall is not None, "the plan stores no recall entries"
            layout, ids = self._recall
            yield from chunk_rows(lm, layout, ids, plan.prefix_ids, unit.first, unit.end)
            return
        if plan.prefill == "full" and self._full is None:
            self._full = prefill_history(plan, lm)
        start = unit.checkpoint.restored(lm) if unit.checkpoint is not None else None
        with tempfile.TemporaryDirectory(prefix="kvchat-episode-") as scratch:  # IceCache's spilled evictions
            steps = episode_steps(plan, plan.episodes[unit.index], lm, full=self._full, scratch=Path(scratch),
                                  start=start, every=every)  # fmt: skip
            for step in steps:
                if isinstance(step, Progressed):
                    yield Checkpoint.of(step, plan, lm.fingerprint)
                    hold_point("batch-episode-sent")  # a test hook (the driver has it): nothing in a real run
                    continue
                stats = step.stats()
                encoded = encode_episode(plan, step, lm, side_file_at=Path(scratch) / "side")
                del step  # one episode cache at a time
                yield EpisodeBuilt(encoded, stats)

    def _plan_job(self, job: HistoryJob) -> tuple[IngestPlan, int | None]:
        """`job`'s plan, and the bytes its ingest may use (None: unknown)."""
        lm, encoder = self._lm, self._encoder
        if lm is None or encoder is None or self._profiles is None:
            raise RuntimeError("HistoryWorker.load must run first")
        available = job.max_memory
        if available is None:
            free = preflight.available_bytes(lm.device)
            available = None if free is None else free // job.workers_on_node
        with tempfile.TemporaryDirectory(prefix="kvchat-profiles-") as profile_dir:
            for file_name, text in self._profiles.items():
                (Path(profile_dir) / Path(file_name).name).write_text(text)
            plan = plan_ingest(
                job.turns, name=job.name, config=job.config, store=None, lm=lm, encoder=encoder, replace=True,
                source=job.source, force=True, profile_dirs=[Path(profile_dir)], max_memory=available,
                reads={job.source: job.read} if job.read else None,
            )  # fmt: skip
        return plan, available

    def _check_fits(self, plan: IngestPlan, available: int | None) -> None:
        assert self._lm is not None
        shape = preflight.ModelShape.of(self._lm.model)
        preflight.check_fits(plan.estimated_peak_bytes, resident=shape.weight_bytes, available=available)

    def _ingest(self, job: HistoryJob) -> Iterator[Any]:
        plan, available = self._plan_job(job)
        lm = self._lm
        assert lm is not None
        if job.stored is not None:
            differences = stored_differences(job.stored, plan, lm.fingerprint, job.config)
            if not differences:
                yield Skipped()
                return
            if not job.replace:
                raise UserError(f"conversation {job.name!r} exists with other {', '.join(differences)}; use "
                                f"{option('replace')}")
        if not job.force:
            self._check_fits(plan, available)
        yield Planned(len(plan.episodes))
        stats: list[EpisodeStats] = []
        with tempfile.TemporaryDirectory(prefix="kvchat-episode-") as scratch:  # IceCache's spilled evictions

            def episode_dir(index: int) -> Path:
                (Path(scratch) / str(index)).mkdir(exist_ok=True)
                return Path(scratch) / str(index)

            for built in build_episodes(plan, lm, scratch=episode_dir):
                stats.append(built.stats())
                encoded = encode_episode(plan, built, lm, side_file_at=Path(scratch) / f"{built.episode.index}.side")
                del built  # one episode cache at a time
                yield encoded
                hold_point("batch-episode-sent")  # a test hook (the driver has the episode): nothing in a real run
            writer = recall_entries_writer(plan, lm)
            if writer is not None:
                path = Path(scratch) / "recall-entries"
                writer(path)
                data = path.read_bytes()
                path.unlink()
                yield RecallEntries(data)
        yield Finished(plan, stats, lm.identity)


def stored_differences(stored: StoredIngest, plan: IngestPlan, fingerprint: str, requested: IngestConfig) -> list[str]:
    """What differs between a stored conversation and `plan` (empty: the same ingest), in words."""
    settings = json.loads(json.dumps(to_settings(plan.config, source=plan.source, reads=plan.reads)))  # as stored
    before = upgraded(stored.settings)  # under today's keys
    if requested.cache.prefill == "auto" and before.get("prefill") in ("block", "full"):
        settings["prefill"] = before["prefill"]
    keys = sorted(k for k in set(settings) | set(before) if settings.get(k) != before.get(k))
    differences = [f"settings ({', '.join(keys)})"] if keys else []
    if stored.fingerprint != fingerprint:
        differences.append("model")
    if (stored.turns, stored.history_tokens) != (plan.turns, plan.history_tokens):
        differences.append(f"history ({stored.turns} turns stored, {plan.turns} now)")
    return differences
