"""The answering engine behind `kvchat serve`: one worker thread holding the models, the encoder and recently used
episode caches, running one job (an answer, an ingest) at a time from a bounded queue.

One `ask.Session` is kept per (conversation version, episode), so a question routed to an episode answered
recently reuses its decoded cache; the sessions are dropped least recently used first once their caches add up
to more than `ServeConfig.max_memory` (an episode's resident size is taken as its file's). Everything that
touches torch, the store's worker connection or a session happens on the worker thread.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from kvchat.answer.session import Answer, Session, routing_query
from kvchat.config import AskConfig, IngestConfig, Sampling, ServeConfig
from kvchat.errors import KvchatError, UserError
from kvchat.history.loading import Turn
from kvchat.ingest.pipeline import IngestProgress
from kvchat.serve.jobs import RUNNING, Job
from kvchat.store.files import hold_point

if TYPE_CHECKING:
    from kvchat.store import Store

_log = logging.getLogger(__name__)


class NotFound(UserError):
    """The conversation or episode a request names does not exist (any more)."""


class QueueFull(KvchatError):
    """Every place in the queue is taken."""


class Closed(KvchatError):
    """The engine is shutting down."""


SHUTTING_DOWN = "the server is shutting down"


@dataclass(frozen=True)
class ChatRequest:
    """A question about a stored conversation, following up `earlier` (question, answer) pairs."""

    conversation: str
    question: str
    episode: int | None = None   # None: routed to the nearest episode
    earlier: tuple[tuple[str, str], ...] = ()
    max_tokens: int = AskConfig.max_new_tokens
    stop: tuple[str, ...] = ()
    sources: bool = False        # record the answer's attention per turn (kvchat.answer.sources)
    refuse_off_topic: bool = False  # no answer when no episode matches well (AskConfig.refuse_off_topic)
    sampling: Sampling = Sampling()  # how each token is chosen (AskConfig.sampling)
    system: str | None = None    # the client's system messages: instructions before the question (AskConfig.system)


@dataclass(frozen=True)
class Completion:
    """An answer as a client sees it: `text` up to any stop string, and why it ended."""

    text: str
    finish_reason: str  # stop (the model or a stop string) | length (max_tokens) | cancelled (the client left)
    answer: Answer      # kvchat's own account: episode, similarity, token counts, timings
    replica: str | None = None  # the Ray Serve replica that answered (`kvchat serve --replicas`)


@dataclass(frozen=True)
class IngestRequest:
    """A history to ingest as conversation `name` (or, with `append`, to continue it with)."""

    name: str
    turns: Sequence[Turn]
    config: IngestConfig = IngestConfig()
    replace: bool = False
    append: bool = False


class ServingEngine(Protocol):
    """What the app uses of an engine: an `Engine`, or answers from Ray Serve replicas
    (kvchat.serve.replicas.ReplicaEngine)."""

    @property
    def ready(self) -> bool: ...

    def start(self) -> None: ...

    def close(self, timeout: float | None = None) -> None: ...

    def stop_jobs(self) -> None: ...

    def submit_chat(self, request: ChatRequest, loop=None) -> Job: ...

    def submit_ingest(self, request: IngestRequest, loop=None) -> Job: ...

    def job(self, job_id: str) -> Job | None: ...

    def forget(self, conversation: str) -> None: ...

    def status(self) -> dict[str, Any]: ...


class Engine:
    """Models, encoder and episode caches held warm; `submit_*` queue work for the one worker thread.

    `models` and `encoder` may be given already loaded (by model spec, as conversations record it); others are
    loaded on first use. `step_hook(job)`, when given, runs on the worker before each answer token is taken:
    an observer for metrics and for tests that need an answer held at a known point."""

    def __init__(self, home: Path, config: ServeConfig = ServeConfig(), *, models: dict[str, Any] | None = None,
                 encoder: Any = None, step_hook: Callable[[Job], None] | None = None) -> None:
        self.home, self.config, self.step_hook = Path(home), config, step_hook
        self._models: dict[str, Any] = dict(models or {})
        self._encoder = encoder
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=config.queue_size)
        self._sessions: OrderedDict[tuple[str, str, int], tuple[Session, int]] = OrderedDict()
        self._lock = threading.Lock()  # the session table and the job registry, read from the event loop
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self._running: Job | None = None
        self._finished = {"chat": 0, "ingest": 0}  # jobs that ran to their end, by kind
        self._closing = False
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._store: Store | None = None  # the worker thread's own connection (sqlite connections stay in their thread)

    # ----- lifecycle

    def start(self) -> None:
        # Not a daemon: the interpreter never exits under a job running torch (which would abort the process);
        # a job stops at its next token or block once cancelled (`close`).
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="kvchat-serve-worker")
            self._thread.start()

    def close(self, timeout: float | None = None) -> None:
        """Refuse new work, fail what is queued and what runs ("the server is shutting down": a stream then ends
        with an error event, an ingest removes its temp dir), and wait for the worker to stop."""
        self.stop_jobs()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)

    def stop_jobs(self) -> None:
        """Refuse new work and fail every job, queued or running, with `Closed`; returns at once (the running
        job stops at its next token or ingest block)."""
        with self._lock:
            self._closing = True
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
                job.fail(Closed(SHUTTING_DOWN))
        running = self._running
        if running is not None and not running.cancelled:
            _log.warning("%s stops: %s", running.id, SHUTTING_DOWN)
            running.cancel()

    @property
    def ready(self) -> bool:
        """Whether the preloaded models and encoder are loaded."""
        return self._ready.is_set()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the preloaded models and encoder are loaded (or preloading failed)."""
        return self._ready.wait(timeout)

    # ----- submitting (any thread)

    def submit_chat(self, request: ChatRequest, loop=None) -> Job:
        return self._submit(Job("chat", self._answer, request=request, loop=loop))

    def submit_ingest(self, request: IngestRequest, loop=None) -> Job:
        return self._submit(Job("ingest", self._ingest, request=request, loop=loop))

    def _submit(self, job: Job) -> Job:
        with self._lock:
            if self._closing:
                raise Closed("the server is shutting down")
            try:
                self._queue.put_nowait(job)
            except queue.Full:
                raise QueueFull(f"{self.config.queue_size} requests are already waiting; try again later") from None
            self._jobs[job.id] = job
            while len(self._jobs) > 256:  # keep the recent ones for GET /kvchat/jobs/{id}
                self._jobs.popitem(last=False)
        return job

    def job(self, job_id: str) -> Job | None:
        with self._lock:
            return self._jobs.get(job_id)

    def forget(self, conversation: str) -> None:
        """Drop the sessions of `conversation` (removed, or re-ingested)."""
        with self._lock:
            for key in [k for k in self._sessions if k[0] == conversation]:
                del self._sessions[key]

    def status(self) -> dict[str, Any]:
        with self._lock:
            resident = [{"conversation": k[0], "episode": k[2], "cache_bytes": size}
                        for k, (_, size) in self._sessions.items()]
        running = self._running
        return {
            "ready": self.ready,
            "models": sorted(self._models),
            "queued": self._queue.qsize(),
            "queue_size": self.config.queue_size,
            "running": None if running is None else running.id,
            "finished": dict(self._finished),
            "resident": resident,
            "resident_bytes": sum(r["cache_bytes"] for r in resident),
            "max_memory": self.config.max_memory,
        }

    # ----- the worker thread

    def _work(self) -> None:
        from kvchat.model.llm import use_threads
        from kvchat.store import Store

        try:
            self._store = Store(self.home)
            use_threads(self.config.threads)
            if self.config.preload:
                self._preload()
        except Exception:  # the jobs will say what is wrong, one by one
            _log.exception("kvchat server: preloading failed")
        finally:
            self._ready.set()
        while True:
            job = self._queue.get()
            if job is None:
                break
            if job.cancelled:
                job.fail(Closed("cancelled before it started"))
                continue
            self._running, job.state = job, RUNNING
            try:
                result = job.work(job)
                if job.cancelled and self._closing:  # cut short by the shutdown: its client must not take it whole
                    raise Closed(SHUTTING_DOWN)
                self._finished[job.kind] += 1  # before the client hears of it
                job.succeed(result)
            except Exception as exc:  # the job's failure is its client's to see; the worker goes on
                if not isinstance(exc, UserError | Closed):
                    _log.exception("kvchat server: %s failed", job.id)
                job.fail(exc)
            finally:
                self._running = None
        if self._store is not None:
            self._store.close()

    def _preload(self) -> None:
        self._encoder_()
        for spec in sorted({record.model for record in self._store_().conversations()}):
            try:
                self._model(spec)
            except UserError as exc:
                _log.warning("kvchat server: cannot preload %s: %s", spec, exc)

    def _model(self, spec: str):
        """The model of `spec` with its Linear weights held as `config.weights`: it answers, and it builds the caches
        of ingest and append jobs, as `kvchat ingest --weights` with the same weights builds them."""
        if spec not in self._models:
            from kvchat.model.device import resolve
            from kvchat.model.llm import load_model

            self._models[spec] = load_model(spec, self._store_().models_dir, placement=resolve(self.config.device),
                                            weights=self.config.weights)
        return self._models[spec]

    def _store_(self) -> Store:
        """The worker thread's store, opened as the worker starts."""
        if self._store is None:
            raise KvchatError("the server's store did not open (its log says why)")
        return self._store

    def _encoder_(self):
        if self._encoder is None:
            from kvchat.model.encoder import SentenceEncoder

            self._encoder = SentenceEncoder()
        return self._encoder

    def _record(self, name: str):
        return find_conversation(self._store_(), name)

    def _answer(self, job: Job) -> Completion:
        request: ChatRequest = job.request
        record = self._record(request.conversation)
        lm, encoder = self._model(record.model), self._encoder_()
        if request.episode is None:
            if not request.question.strip():
                raise UserError("the question is empty")
            centroids = np.asarray([e.centroid for e in record.episodes], dtype=np.float32)
            index = int(np.argmax(centroids @ routing_query(encoder, request.question, request.earlier)))
        elif not 0 <= request.episode < len(record.episodes):
            raise NotFound(f"conversation '{record.name}' has no episode {request.episode} "
                           f"(it has 0..{len(record.episodes) - 1})")
        else:
            index = request.episode
        self._check_earlier(request, lm)
        session = self._session(record, index, lm, encoder)
        session.config = dataclasses.replace(session.config, max_new_tokens=request.max_tokens,
                                             refuse_off_topic=request.refuse_off_topic, sampling=request.sampling,
                                             system=request.system)  # fmt: skip

        def on_text(piece: str) -> None:
            job.emit("text", piece)

        def stop() -> bool:
            job.progress["tokens"] = job.progress.get("tokens", 0) + 1
            if self.step_hook is not None:
                self.step_hook(job)
            return job.cancelled

        try:
            answer = session.ask(request.question, episode=index, on_text=on_text, stop=stop, earlier=request.earlier,
                                 log=self.config.log and not self._store_().read_only, sources=request.sources,
                                 stops=request.stop)
        except UserError:
            if request.conversation not in {r.name for r in self._store_().conversations()}:
                raise NotFound(f"conversation '{request.conversation}' was removed while it was being answered")\
                    from None
            raise
        finish = "cancelled" if job.cancelled else answer.finish_reason
        return Completion(answer.text, finish, answer)

    @staticmethod
    def _check_earlier(request: ChatRequest, lm) -> None:
        """Follow-up turns are decoded in one forward with the question: refuse more than half the model's window
        (the question alone is held to a quarter by `Session`)."""
        if not request.earlier:
            return
        limit = max(128, lm.context_window // 2) if lm.context_window else 4096
        text = " ".join(part for pair in request.earlier for part in pair)
        n = len(text) // 32 if len(text) > 32 * limit else int(lm.encode(text).shape[-1])
        if n > limit:
            raise UserError(f"the earlier messages are {n} tokens or more; at most {limit} fit beside the question")

    def _session(self, record, index: int, lm, encoder) -> Session:
        """The session answering from `record`'s episode `index`, kept among the recently used ones."""
        episode = record.episodes[index]
        key = (record.name, str(episode.path.parent), index)  # the ingest's directory: a re-ingest is new
        with self._lock:
            for stale in [k for k in self._sessions if k[0] == record.name and k[1] != key[1]]:
                del self._sessions[stale]
            if key in self._sessions:
                self._sessions.move_to_end(key)
                return self._sessions[key][0]
        config = AskConfig(max_new_tokens=self.config.max_tokens, weights=self.config.weights)
        session = Session(self._store_(), record, lm, encoder, config)
        with self._lock:
            self._sessions[key] = (session, episode.bytes)
            total = sum(size for _, size in self._sessions.values())
            while total > self.config.max_memory and len(self._sessions) > 1:
                _, (_, size) = self._sessions.popitem(last=False)
                total -= size
        return session

    def _ingest(self, job: Job):
        from kvchat.ingest.append import append
        from kvchat.ingest.pipeline import ingest

        request: IngestRequest = job.request
        progress = _JobProgress(job)
        if request.append:  # with the model the conversation was built with
            record = self._record(request.name)
            report = append(request.turns, name=request.name, store=self._store_(), lm=self._model(record.model),
                            encoder=self._encoder_(), progress=progress, source="<kvchat server>")
        else:  # with the model the server's operator chose (`ServeConfig.model`), never one a client names
            report = ingest(request.turns, store=self._store_(), lm=self._model(request.config.model),
                            progress=progress, name=request.name, config=request.config, encoder=self._encoder_(),
                            replace=request.replace, source="<kvchat server>")
        self.forget(request.name)
        return report


def find_conversation(store, name: str):
    """`store`'s conversation `name`; NotFound when there is none (other store errors are raised as they are)."""
    try:
        return store.get(name)
    except UserError:
        if name in {record.name for record in store.conversations()}:
            raise
        raise NotFound(f"unknown conversation {name!r} (GET /v1/models lists them)") from None


class _JobProgress(IngestProgress):
    """An ingest's progress, readable from GET /kvchat/jobs/{id} while it runs; a cancelled job (the server shuts
    down) stops at its next step, unwinding, so its pending conversation's temp dir is removed."""

    def __init__(self, job: Job) -> None:
        self.job = job

    def planning(self, step: str, done: int, total: int) -> None:
        self._go_on()

    def history(self, done: int, total: int) -> None:
        self._go_on()
        self.job.progress.update(stage="history", done=done, total=total)

    def episode(self, index: int, total: int) -> None:
        self._go_on()
        self.job.progress.update(stage="episode", episode=index + 1, episodes=total, done=0, total=0)

    def block(self, done: int, total: int) -> None:
        self._go_on()
        self.job.progress.update(done=done, total=total)
        hold_point("serve-ingest-block")  # a test hook (tests/test_serve_hardening.py): nothing in a real run

    def recall_entries(self, done: int, total: int) -> None:
        self._go_on()

    def _go_on(self) -> None:
        if self.job.cancelled:
            raise Closed(SHUTTING_DOWN)
