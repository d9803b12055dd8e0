"""`kvchat serve --replicas N`: the same HTTP app, answered by N Ray Serve replicas instead of one worker thread.

Each replica (`Replica`) is an `Engine` of its own in its own process: the model, the encoder and the episode
caches it answered from recently. The app's process keeps the HTTP side (uvicorn, the API key, limits, the
OpenAI documents) and a `ReplicaEngine` in the engine's place, which sends every request through a Ray Serve
deployment handle with the conversation's name as the session: Ray Serve's consistent-hash router
(`ConsistentHashRouter`, no fallback) sends every request about one conversation to the same replica, the
one that holds its caches, and a replica that dies is restarted by Ray Serve (its caches then load again).

Answers come back as streams of the engine's events (text, then done or error); a client that leaves cancels
the stream, which cancels the replica's job before its next token. Ray runs locally, started and shut down
here (`replica_engine`); the replicas open the same `$KVCHAT_HOME` as the app. Ray is imported lazily: the
`batch` extra brings Ray, `serve` the web stack, and Ray Serve needs `ray[serve]` (the `replicas` extra).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvchat.config import ServeConfig
from kvchat.errors import UserError
from kvchat.ingest.batch import import_ray, ray_session
from kvchat.messages import option
from kvchat.serve.engine import SHUTTING_DOWN, ChatRequest, Closed, Completion, Engine, IngestRequest, QueueFull
from kvchat.serve.jobs import RUNNING, Job

_log = logging.getLogger(__name__)

APP_NAME = "kvchat"
ROUTER = "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter"
PROGRESS_S = 0.5  # how often a replica reports a running ingest's progress
INSTALL_HINT = "pip install 'kvchat[replicas]'"
RAY_LOOPBACK_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": no cluster, loopback only (ray_constants)


class Replica:
    """One Ray Serve replica: an `Engine` over the store at `home`, loaded before the replica reports ready."""

    def __init__(self, home: str, config: ServeConfig) -> None:
        from ray import serve

        self.name = serve.get_replica_context().replica_tag
        self.engine = Engine(Path(home), config)
        self.engine.start()
        self.engine.wait_ready()

    async def chat(self, request: ChatRequest):
        """The answer's events: ("text", str)..., then ("done", Completion) or ("error", exception)."""
        job = self.engine.submit_chat(request, asyncio.get_running_loop())
        try:
            while True:
                kind, value = await job.next_event()
                if kind == "done":
                    value = dataclasses.replace(value, replica=self.name)
                yield kind, value
                if kind != "text":
                    return
        finally:
            job.cancel()  # the stream was cancelled (the client left), or it ended: nothing left to cancel

    async def ingest(self, request: IngestRequest):
        """("progress", dict) every `PROGRESS_S` while the ingest runs, then ("done", IngestReport) or ("error", e)."""
        job = self.engine.submit_ingest(request, asyncio.get_running_loop())
        try:
            while True:
                try:
                    kind, value = await asyncio.wait_for(job.next_event(), PROGRESS_S)
                except TimeoutError:
                    yield "progress", dict(job.progress)
                    continue
                yield kind, value
                if kind != "text":
                    return
        finally:
            job.cancel()

    def forget(self, conversation: str) -> None:
        self.engine.forget(conversation)

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close(timeout=1.0)


class ReplicaEngine:
    """The `Engine` interface the app uses, over a Ray Serve deployment handle: jobs in this process whose events
    arrive from the replica that answers them. At most `replicas x (queue_size + 1)` requests are in flight; one
    more is refused (429), as a single engine's full queue is."""

    def __init__(self, handle: Any, config: ServeConfig, replicas: int) -> None:
        self.handle, self.config, self.replicas = handle, config, replicas
        self.limit = replicas * (config.queue_size + 1)
        self._lock = threading.Lock()
        self._jobs: dict[str, Job] = {}
        self._in_flight: set[str] = set()
        self._finished = {"chat": 0, "ingest": 0}
        self._closing = False

    def start(self) -> None:
        """The replicas are running already (`replica_engine` deployed them)."""

    def close(self, timeout: float | None = None) -> None:
        """Refuse new work and fail what is in flight; the replicas stop with Ray Serve (`replica_engine`)."""
        self.stop_jobs()

    def stop_jobs(self) -> None:
        """Refuse new work and fail what is in flight ("the server is shutting down"); returns at once."""
        with self._lock:
            self._closing = True
            running = [self._jobs[i] for i in self._in_flight]
        for job in running:
            job.cancel()

    @property
    def ready(self) -> bool:
        return True

    def submit_chat(self, request: ChatRequest, loop=None) -> Job:
        return self._submit("chat", request, request.conversation, loop)

    def submit_ingest(self, request: IngestRequest, loop=None) -> Job:
        return self._submit("ingest", request, request.name, loop)

    def _submit(self, kind: str, request: Any, conversation: str, loop) -> Job:
        loop = loop or asyncio.get_running_loop()
        job = _RemoteJob(kind, request=request, loop=loop)
        with self._lock:
            if self._closing:
                raise Closed("the server is shutting down")
            if len(self._in_flight) >= self.limit:
                raise QueueFull(f"{self.limit} requests are already in flight; try again later")
            self._in_flight.add(job.id)
            self._jobs[job.id] = job
            for old in [i for i in self._jobs if i not in self._in_flight][: max(0, len(self._jobs) - 256)]:
                del self._jobs[old]
        stream = self.handle.options(stream=True, session_id=conversation)
        call = stream.chat.remote(request) if kind == "chat" else stream.ingest.remote(request)
        job.task = loop.create_task(self._pump(job, call))
        return job

    async def _pump(self, job: _RemoteJob, call: Any) -> None:
        """The replica's events into `job`; cancelled (the client left), the replica's stream is cancelled too."""
        job.state = RUNNING
        try:
            async for kind, value in call:
                if kind == "progress":
                    job.progress = value
                elif kind == "text":
                    job.emit(kind, value)
                elif kind == "done":
                    with self._lock:
                        self._finished[job.kind] += 1
                    job.succeed(value)
                else:
                    job.fail(value)
            if not job.finished:
                job.fail(RuntimeError("the replica's answer ended without a result"))
        except asyncio.CancelledError:
            call.cancel()
            job.fail(Closed(SHUTTING_DOWN if self._closing else "cancelled"))
        except Exception as exc:  # the replica died or Ray failed: the client sees a 500, the log says why
            _log.exception("kvchat server: %s failed on its replica", job.id)
            job.fail(exc)
        finally:
            with self._lock:
                self._in_flight.discard(job.id)

    def job(self, job_id: str) -> Job | None:
        with self._lock:
            return self._jobs.get(job_id)

    def forget(self, conversation: str) -> None:
        """Drop the sessions of `conversation` on the replica that holds them."""
        self.handle.options(session_id=conversation).forget.remote(conversation)

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {"ready": True, "replicas": self.replicas, "in_flight": len(self._in_flight),
                    "queue_size": self.limit, "finished": dict(self._finished)}


class _RemoteJob(Job):
    """A job answered by a replica: cancelling it cancels the task that streams the replica's events."""

    task: asyncio.Task | None = None

    def __init__(self, kind: str, *, request: Any, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(kind, _runs_remotely, request=request, loop=loop)

    def cancel(self) -> None:
        super().cancel()
        if self.task is not None and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: the task went with it
                self._loop.call_soon_threadsafe(self.task.cancel)


def _runs_remotely(job: Job) -> Completion:
    raise RuntimeError("a replica's job runs on its replica")


@contextlib.contextmanager
def replica_engine(home: Path, config: ServeConfig, replicas: int) -> Iterator[ReplicaEngine]:
    """A local Ray running `replicas` replicas of the engine over `home`, each with `config.threads` torch
    threads (default: the cores shared out); Ray Serve and Ray are shut down when the block ends, whatever ends it."""
    if replicas < 1:
        raise UserError(f"{option('replicas')} must be >= 1 (got {replicas})")
    # Ray's own switch for a machine that is no cluster: its node address is then loopback, and every Ray process
    # listens there alone (by default they listen on every interface). Read when Ray is imported, here or in its
    # processes, which inherit it; a Ray this process imported before keeps the setting it had.
    os.environ.setdefault(RAY_LOOPBACK_ONLY, "0")
    ray = import_ray()
    try:
        from ray import serve
        from ray.serve.config import RequestRouterConfig
    except ImportError:
        raise UserError(f"{option('replicas')} needs Ray Serve: {INSTALL_HINT}") from None
    from kvchat.model.cores import usable_cores

    threads = config.threads or max(1, usable_cores() // replicas)
    config = dataclasses.replace(config, threads=threads, preload=True)
    with ray_session(ray, None, cpus=replicas * threads):
        try:
            serve.start(proxy_location="Disabled")
            # Ray's typing: serve.deployment is typed as the decorator factory only (given the class, it returns the
            # Deployment), and mypy misreads RequestRouterConfig's fields (a pydantic model through Ray's compat layer)
            deployment = serve.deployment(Replica, name="replica").options(  # type: ignore[attr-defined]
                num_replicas=replicas, max_ongoing_requests=config.queue_size + 4,
                ray_actor_options={"num_cpus": threads},
                request_router_config=RequestRouterConfig(
                    request_router_class=ROUTER,  # type: ignore[arg-type]
                    request_router_kwargs={"num_fallback_replicas": 0}),
            )
            handle = serve.run(deployment.bind(str(home), config), name=APP_NAME, route_prefix=None)
            yield ReplicaEngine(handle, config, replicas)
        finally:
            serve.shutdown()
