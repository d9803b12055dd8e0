"""Batch ingest of many histories on Ray (`kvchat ingest-batch`; the optional extra `kvchat[batch]`).

One kvchat process per history stops scaling when an assistant has many users; Ray spreads the histories
over workers, on this machine or on a cluster, and kvchat does no scheduling of its own.

Design notes (the details and the choices made): docs/internals.md, "kvchat/ingest/batch.py".
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvchat.config import BatchConfig, DeviceConfig, IngestConfig
from kvchat.errors import UserError, first_line, message
from kvchat.history.loading import load_history
from kvchat.ingest.batch_sources import HistorySource as HistorySource  # part of this module's API
from kvchat.ingest.batch_sources import histories as histories
from kvchat.ingest.batch_sources import read_manifest as read_manifest
from kvchat.ingest.batch_worker import (
    Finished,
    HistoryJob,
    HistoryWorker,
    Planned,
    RecallEntries,
    Skipped,
    StoredIngest,
    WorkerInfo,
)
from kvchat.ingest.batch_worker import stored_differences as stored_differences  # part of this module's API
from kvchat.ingest.layer_profiles import profile_texts
from kvchat.ingest.pipeline import (
    EncodedEpisode,
    IngestReport,
    commit_ingest,
    validate,
    write_recall_entries_bytes,
)
from kvchat.messages import option
from kvchat.model.cores import usable_cores
from kvchat.settings import read_options
from kvchat.store import DamagedDatabase, EpisodeRecord, FileRecord, PendingConversation, Store

INSTALL_HINT = "pip install 'kvchat[batch]'"
WAIT_S = 0.5  # the driver's longest wait for a worker before it looks at Ctrl-C again
# Set in every worker on a cluster: no network (kvchat's guarantee) and no library chatter.
WORKER_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "TQDM_DISABLE": "1",
}


def import_ray() -> Any:
    """Ray, or a one-line UserError saying how to install it. Ray's usage statistics, which would be
    sent over the network, are switched off first."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        import ray
    except ImportError:
        raise UserError(f"batch ingest needs Ray: {INSTALL_HINT}") from None
    return ray


# --------------------------------------------------------------------------- the driver's side


@dataclass(frozen=True)
class HistoryResult:
    """What became of one history of a batch."""

    name: str
    path: Path
    status: str  # committed | skipped | failed
    attempts: int  # times given to a worker (0: failed before, e.g. an unreadable file)
    seconds: float
    error: str | None = None
    report: IngestReport | None = None


@dataclass(frozen=True)
class BatchReport:
    """What `ingest_batch` did: every history's result, in the order given."""

    histories: list[HistoryResult]
    workers: int
    threads: int
    seconds: float

    def count(self, status: str) -> int:
        return sum(h.status == status for h in self.histories)

    @property
    def cache_bytes(self) -> int:
        return sum(h.report.cache_bytes for h in self.histories if h.report is not None)

    @property
    def histories_per_hour(self) -> float:
        return self.count("committed") * 3600 / self.seconds if self.seconds > 0 else 0.0


class BatchProgress:
    """Hooks for a progress display; the default does nothing."""

    def start(self, total: int, workers: int) -> None:
        """Before the workers load their models."""

    def running(self, name: str, attempt: int, worker: Any) -> None:
        """`name` was given to `worker` (a Ray actor handle: `ray.kill(worker)` is what a lost node does)."""

    def episode(self, name: str, done: int, total: int) -> None:
        """`done` of `name`'s `total` episodes are written to the store's temp dir (0: planned)."""

    def retrying(self, name: str, why: str) -> None: ...

    def finished(self, result: HistoryResult) -> None: ...


def ingest_batch(
    sources: Sequence[HistorySource],
    *,
    store: Store,
    config: IngestConfig,
    batch: BatchConfig = BatchConfig(),
    replace: bool = False,
    force: bool = False,
    max_memory: int | None = None,
    trust_remote_code: bool = False,
    progress: BatchProgress | None = None,
) -> BatchReport:
    """Ingest `sources` on Ray workers into `store` (see the module docstring). A history that fails is
    reported in its `HistoryResult` and the others go on; mistakes in the options raise UserError.

    With `batch.address` None a local Ray is started with this machine's usable cores (unless this process
    already runs one, which is used as it is); otherwise that cluster is joined. `max_memory`: bytes each
    worker's ingest may use (default: the memory available on its node shared among the workers there)."""
    validate(config)
    if batch.threads < 1 or (batch.workers is not None and batch.workers < 1) or batch.attempts < 1:
        raise UserError(f"{option('workers')} and {option('threads')} must be >= 1")
    if max_memory is not None and max_memory < 1:
        raise UserError(f"{option('max_memory')} must be >= 1 MiB (got {max_memory})")
    progress = progress or BatchProgress()
    if not sources:
        return BatchReport([], 0, batch.threads, 0.0)
    store.check_writable()
    ray = import_ray()
    if batch.address is None and not ray.is_initialized():
        workers_for(batch, usable_cores())  # before a local Ray is started for nothing
    started = time.perf_counter()
    with ray_session(ray, batch.address):
        workers = Workers(ray, batch, len(sources))
        try:
            progress.start(len(sources), workers.count)
            workers.start(config.model, store, trust_remote_code)
            driver = _Driver(ray, store, config, batch, workers, progress, replace=replace, force=force,
                             max_memory=max_memory)  # fmt: skip
            results = driver.run(sources)
        finally:
            workers.stop()
    return BatchReport(results, workers.count, batch.threads, time.perf_counter() - started)


def gpu_share(device: DeviceConfig, gpus: float, workers: int) -> float:
    """The GPUs each worker asks Ray for: the cluster's GPUs shared among the workers (at most one each) when
    the model is to run on CUDA (`cuda`, or `auto` on a cluster with GPUs), else none; `cuda` on a cluster
    without GPUs is refused."""
    if device.device == "cpu" or (device.device == "auto" and not gpus):
        return 0
    if not gpus:
        raise UserError(f"{option('device', 'cuda')}: the Ray cluster has no GPU")
    return min(1.0, gpus / workers)


def workers_for(batch: BatchConfig, cpus: int) -> int:
    """How many workers `batch` asks for on `cpus` CPUs; more threads than CPUs are refused, since every worker
    would then wait on the others."""
    wanted = batch.workers or max(1, cpus // batch.threads)
    if wanted * batch.threads > cpus:
        raise UserError(f"{option('workers', wanted)} x {option('threads', batch.threads)} needs "
                        f"{wanted * batch.threads} CPUs but "
                        f"{'Ray has' if batch.address else 'this machine has'} {cpus}: more threads than cores make "
                        "every worker wait on the others")  # fmt: skip
    return wanted


@contextmanager
def ray_session(ray: Any, address: str | None, cpus: int | None = None) -> Iterator[None]:
    """Ray for the batch (or `kvchat serve --replicas`): the one this process already runs, else a new one it
    shuts down afterwards; a local one gets `cpus` CPUs (default: the cores this process may use)."""
    if ray.is_initialized():
        yield
        return
    options: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, "logging_level": logging.ERROR}
    session_dir = None  # a local Ray's session files (sockets, logs): its own dir, removed afterwards; under /tmp
    # as Ray's own default is, since a socket's path has at most 107 bytes
    try:
        if address is None:  # "local": a new instance, never a cluster someone else started on this machine
            session_dir = tempfile.mkdtemp(prefix="kvchat-ray-", dir="/tmp" if os.path.isdir("/tmp") else None)
            ray.init(address="local", num_cpus=cpus or usable_cores(), _temp_dir=session_dir, **options)
        else:
            ray.init(address=address, **options)
    except (ConnectionError, ValueError, RuntimeError) as exc:
        if session_dir is not None:
            shutil.rmtree(session_dir, ignore_errors=True)
        where = f"the Ray cluster at {address}" if address else "a local Ray"
        raise UserError(f"cannot start {where}: {first_line(exc)}") from None
    try:
        yield
    finally:
        ray.shutdown()
        if session_dir is not None:
            shutil.rmtree(session_dir, ignore_errors=True)


class Workers:
    """The batch's Ray actors: created with one CPU per torch thread, loaded once, killed at the end."""

    def __init__(self, ray: Any, batch: BatchConfig, histories: int | None = None) -> None:
        """Up to one worker per history (`histories`; None: as many as `batch` asks for)."""
        self.ray = ray
        self.threads = batch.threads
        self.start_timeout_s = batch.start_timeout_s
        wanted = workers_for(batch, int(ray.cluster_resources().get("CPU", 0)))
        self.count = max(1, min(wanted, histories) if histories is not None else wanted)
        # A local Ray's workers inherit this process's environment; a cluster's get WORKER_ENV set (which costs
        # each worker a fresh process, a few seconds once per batch).
        env = {} if batch.address is None else {"runtime_env": {"env_vars": WORKER_ENV}}
        self.device, self.weights = batch.device, batch.weights
        self.actor = ray.remote(HistoryWorker).options(
            num_cpus=batch.threads, num_gpus=gpu_share(batch.device, ray.cluster_resources().get("GPU", 0), self.count),
            **env,
        )
        self.handles: list[Any] = []
        self.shares: dict[Any, int] = {}  # handle -> workers on its node

    def start(self, spec: str, store: Store, trust_remote_code: bool) -> None:
        """Start the workers and load the model in each; refuse workers that would build different caches."""
        self.handles = [self.actor.remote() for _ in range(self.count)]
        profiles = profile_texts(store.home / "profiles")
        calls = [h.load.remote(spec, str(store.models_dir), self.threads, trust_remote_code, profiles, self.device,
                               self.weights) for h in self.handles]  # fmt: skip
        try:
            infos: list[WorkerInfo] = self.ray.get(calls, timeout=self.start_timeout_s)
        except self.ray.exceptions.GetTimeoutError:
            raise UserError(f"the workers did not start within {self.start_timeout_s:.0f} s: Ray could not start "
                            "their processes (too little memory, or CPUs taken by other jobs?)") from None
        except self.ray.exceptions.RayTaskError as exc:
            raise as_user_error(exc) from None
        except self.ray.exceptions.RayError as exc:
            raise UserError(f"a worker died while loading the model ({first_line(exc)})") from None
        fingerprints = sorted({info.fingerprint for info in infos})
        if len(fingerprints) > 1:
            raise UserError(f"workers loaded different models for {option('model', spec)} ({', '.join(fingerprints)}): "
                            "install the same kvchat, transformers and model on every node")  # fmt: skip
        per_node = Counter(info.node for info in infos)
        self.shares = {h: per_node[info.node] for h, info in zip(self.handles, infos, strict=True)}

    def lost(self, handle: Any) -> None:
        """A worker that failed a call: make sure it is gone, and give it nothing more."""
        self._kill(handle)
        self.handles.remove(handle)

    def stop(self) -> None:
        for handle in self.handles:
            self._kill(handle)
        self.handles = []

    def _kill(self, handle: Any) -> None:
        try:
            self.ray.kill(handle)
        except Exception:  # already gone, or Ray itself is going down: nothing left to stop
            pass


@dataclass
class _Running:
    """A history on a worker: the pending conversation its episodes go to, and the call awaited."""

    index: int
    source: HistorySource
    attempt: int
    worker: Any
    started: float
    call: Any = None  # the ObjectRef of the step awaited
    pending: PendingConversation | None = None
    episodes: int = 0
    records: list[EpisodeRecord] = field(default_factory=list)
    recall_file: FileRecord | None = None  # its recall entries file, written (`--recall-entries stored`)


class _Driver:
    """Hands histories to idle workers and turns what they send into store writes, one step at a time."""

    def __init__(self, ray: Any, store: Store, config: IngestConfig, batch: BatchConfig, workers: Workers,
                 progress: BatchProgress, *, replace: bool, force: bool, max_memory: int | None) -> None:
        self.ray, self.store, self.config, self.batch, self.workers = ray, store, config, batch, workers
        self.progress = progress
        self.replace, self.force, self.max_memory = replace, force, max_memory
        self.idle = list(workers.handles)
        self.waiting: dict[Any, _Running] = {}  # ObjectRef -> its history
        self.results: dict[int, HistoryResult] = {}

    def run(self, sources: Sequence[HistorySource]) -> list[HistoryResult]:
        queue: deque[tuple[int, HistorySource, int]] = deque((i, s, 1) for i, s in enumerate(sources))
        try:
            while queue or self.waiting:
                while queue and self.idle:
                    self._dispatch(*queue.popleft())
                if queue and not self.workers.handles:
                    while queue:
                        index, source, attempt = queue.popleft()
                        self._finish(index, source, "failed", attempt - 1, time.perf_counter(),
                                     error="no worker left: every worker died")  # fmt: skip
                if not self.waiting:
                    continue
                ready, _ = self.ray.wait(list(self.waiting), num_returns=1, timeout=WAIT_S)
                for call in ready:
                    running = self.waiting.pop(call)
                    try:
                        retry = self._receive(running, call)
                    except BaseException:  # Ctrl-C or a bug mid-write: no temp dir outlives the batch
                        self._abort(running)
                        raise
                    if retry is not None:
                        queue.appendleft(retry)
        finally:
            for running in self.waiting.values():
                if running.pending is not None:
                    running.pending.abort()
        return [self.results[i] for i in sorted(self.results)]

    def _dispatch(self, index: int, source: HistorySource, attempt: int) -> None:
        started = time.perf_counter()
        try:
            turns = load_history(source.path, format=source.format, pick=source.pick)
        except UserError as exc:
            self._finish(index, source, "failed", 0, started, error=message(exc))
            return
        worker = self.idle.pop(0)
        job = HistoryJob(
            source.name, str(source.path.resolve()), turns, self.config, self._stored(source.name), self.replace,
            self.force, self.max_memory, self.workers.shares.get(worker, 1), read_options(source.format, source.pick),
        )  # fmt: skip
        running = _Running(index, source, attempt, worker, started)
        self._await(running, worker.start.remote(job))
        self.progress.running(source.name, attempt, worker)

    def _stored(self, name: str) -> StoredIngest | None:
        try:
            record = self.store.get(name)
        except DamagedDatabase:  # the whole batch's problem: stop (`kvchat doctor` says what to do)
            raise
        except UserError:  # not stored
            return None
        return StoredIngest(record.settings, record.fingerprint, record.stats.get("turns"),
                            record.stats.get("history_tokens"))  # fmt: skip

    def _await(self, running: _Running, call: Any) -> None:
        running.call = call
        self.waiting[call] = running

    def _receive(self, running: _Running, call: Any) -> tuple[int, HistorySource, int] | None:
        """Handle one step of `running`; returns the history to queue again when its worker died."""
        errors = self.ray.exceptions
        try:
            step = self.ray.get(call)
        except errors.RayTaskError as exc:  # the ingest raised: the history's own failure
            self._fail(running, message(as_user_error(exc)))
            return None
        except errors.RayError as exc:  # the worker died, or its node, or what it sent was lost
            self._abort(running)
            self.workers.lost(running.worker)
            why = f"its worker died ({first_line(exc)})"
            if running.attempt < self.batch.attempts and self.workers.handles:
                self.progress.retrying(running.source.name, why)
                return running.index, running.source, running.attempt + 1
            self._finish(running.index, running.source, "failed", running.attempt, running.started,
                         error=why if running.attempt == 1 else f"{why}, on each of {running.attempt} tries")
            return None
        try:
            self._step(running, step)
        except UserError as exc:  # the store refused: a name taken meanwhile, a full disk
            self._fail(running, message(exc))
        return None

    def _step(self, running: _Running, step: Any) -> None:
        name = running.source.name
        if isinstance(step, Skipped):
            self._finish(running.index, running.source, "skipped", running.attempt, running.started, error=None)
            self.idle.append(running.worker)
        elif isinstance(step, Planned):
            running.pending = self.store.begin(name, replace=self.replace)
            running.episodes = step.episodes
            self._await(running, running.worker.advance.remote())
            self.progress.episode(name, 0, step.episodes)
        elif isinstance(step, EncodedEpisode):
            self._await(running, running.worker.advance.remote())  # the worker builds the next one meanwhile
            assert running.pending is not None
            running.records.append(step.write(running.pending))
            self.progress.episode(name, len(running.records), running.episodes)
        elif isinstance(step, RecallEntries):
            self._await(running, running.worker.advance.remote())
            assert running.pending is not None
            running.recall_file = write_recall_entries_bytes(running.pending, step.data)
        elif isinstance(step, Finished):
            assert running.pending is not None
            report = commit_ingest(running.pending, step.plan, step.stats, running.records, step.model,
                                   time.perf_counter() - running.started, running.recall_file)  # fmt: skip
            self._finish(running.index, running.source, "committed", running.attempt, running.started,
                         report=report)  # fmt: skip
            self.idle.append(running.worker)
        else:
            raise TypeError(f"unexpected step from a worker: {step!r}")

    def _fail(self, running: _Running, error: str) -> None:
        """`running` failed but its worker lives: drop what it may still send, and give it the next one."""
        self._abort(running)
        self.waiting.pop(running.call, None)
        self._finish(running.index, running.source, "failed", running.attempt, running.started, error=error)
        self.idle.append(running.worker)

    @staticmethod
    def _abort(running: _Running) -> None:
        if running.pending is not None:
            running.pending.abort()

    def _finish(self, index: int, source: HistorySource, status: str, attempts: int, started: float, *,
                error: str | None = None, report: IngestReport | None = None) -> None:
        result = HistoryResult(source.name, source.path, status, attempts, time.perf_counter() - started, error,
                               report)  # fmt: skip
        self.results[index] = result
        self.progress.finished(result)


def as_user_error(exc: BaseException) -> UserError:
    """A worker's exception as one line: its own message for a user mistake, else named as internal."""
    cause = getattr(exc, "cause", None) or exc
    if isinstance(cause, UserError):
        return UserError(message(cause))
    return UserError(f"internal error: {type(cause).__name__}: {first_line(cause)}")


