"""A unit of the answering worker's work (an answer, an ingest) and the channel its events take to the event loop.

The worker thread runs one job at a time; the HTTP side waits on the job's events from asyncio. Events cross
threads through `loop.call_soon_threadsafe`, so the worker never blocks on a slow client: a client that reads
slowly gets its text later, and one that leaves cancels the job, which the worker sees before its next token.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

QUEUED, RUNNING, DONE, FAILED, CANCELLED = "queued", "running", "done", "failed", "cancelled"

_ids = itertools.count(1)


class Job:
    """What a client submitted: `work(job)` runs on the worker thread and returns the result.

    Events, in order: ("text", str) while an answer streams, then one ("done", result) or ("error", exception).
    `progress` is what a long job (an ingest) says about itself while it runs."""

    def __init__(self, kind: str, work: Callable[[Job], Any], *, request: Any = None,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.id = f"{kind}-{next(_ids)}"
        self.kind, self.work, self.request = kind, work, request
        self.state = QUEUED
        self.progress: dict[str, Any] = {}
        self.result: Any = None
        self.error: BaseException | None = None
        self.created = time.time()
        self._loop = loop
        self._events: asyncio.Queue | None = asyncio.Queue() if loop is not None else None
        self._cancel = threading.Event()
        self._finished = threading.Event()

    # ----- either thread

    def cancel(self) -> None:
        """Ask the job to stop: a queued job never starts, a running answer ends before its next token."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the job has finished (for callers outside the event loop)."""
        return self._finished.wait(timeout)

    # ----- the worker thread

    def emit(self, kind: str, value: Any) -> None:
        if self._loop is None or self._events is None:
            return
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop has closed (shutdown): nobody is listening any more
            pass

    def succeed(self, result: Any) -> None:
        self.result, self.state = result, CANCELLED if self.cancelled else DONE
        self._finished.set()
        self.emit("done", result)

    def fail(self, error: BaseException) -> None:
        self.error, self.state = error, CANCELLED if self.cancelled else FAILED
        self._finished.set()
        self.emit("error", error)

    # ----- the event loop

    async def next_event(self) -> tuple[str, Any]:
        if self._events is None:
            raise RuntimeError("this job was submitted without an event loop")
        return await self._events.get()
