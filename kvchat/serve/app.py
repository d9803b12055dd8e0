"""The HTTP application of `kvchat serve` (FastAPI): the OpenAI-compatible endpoints and kvchat's own.

- `POST /v1/chat/completions` (streamed as server-sent events with `"stream": true`), `GET /v1/models[/{id}]`
- `POST /kvchat/ask` (the `kvchat ask --json` document), `GET /kvchat/conversations[/{name}]`,
  `DELETE /kvchat/conversations/{name}`, `POST /kvchat/ingest` -> a job, `GET /kvchat/jobs/{id}`,
  `GET /kvchat/health` (the only endpoint open without the API key)

Every error has OpenAI's shape with its HTTP status: 400 malformed, 401 bad key, 404 unknown conversation or
episode, 413 body too large, 429 queue full, 500 internal, 503 shutting down. The store connection here belongs
to the event loop's thread (every endpoint is `async`); the engine's worker has its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvchat import documents
from kvchat.config import IngestConfig, ServeConfig, default_home
from kvchat.errors import CacheIntegrityError, UserError, message
from kvchat.serve.engine import (
    ChatRequest,
    Closed,
    Engine,
    IngestRequest,
    NotFound,
    QueueFull,
    ServingEngine,
    find_conversation,
)
from kvchat.serve.jobs import Job
from kvchat.serve.protocol import (
    FINISH_REASONS,
    ApiError,
    ChatCompletionRequest,
    chunk,
    completion_id,
    kvchat_fields,
    model_entry,
    parse_model,
    response,
    usage,
)
from kvchat.serve.spelling import spell

_log = logging.getLogger(__name__)


def create_app(config: ServeConfig = ServeConfig(), *, home: Path | None = None,
               engine: ServingEngine | None = None) -> FastAPI:
    """The ASGI app over `home`'s store (default: $KVCHAT_HOME); its lifespan starts and closes `engine`
    (default: a new one with `config`). Run it with any ASGI server; `kvchat.serve.server.serve` runs uvicorn."""
    home = Path(home) if home is not None else default_home()
    engine = engine or Engine(home, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        from kvchat.store import Store

        app.state.store = Store(home)
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.close, config.shutdown_grace_s)
            app.state.store.close()

    app = FastAPI(title="kvchat", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine, app.state.config = engine, config
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)
    _handle_errors(app)
    key = Depends(_key_checker(config.api_key))

    @app.get("/kvchat/health")
    async def health() -> dict:
        return documents.document(status="ok" if engine.ready else "loading", **engine.status())

    @app.get("/v1/models", dependencies=[key])
    async def models(request: Request) -> dict:
        return {"object": "list", "data": [model_entry(r) for r in _store(request).conversations()]}

    @app.get("/v1/models/{model:path}", dependencies=[key])
    async def model(model: str, request: Request) -> dict:
        return model_entry(_conversation(request, parse_model(model)[0]))

    @app.post("/v1/chat/completions", dependencies=[key])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        chat = body.to_chat(config.max_tokens, config.max_tokens_limit)
        _check_known(request, chat)
        job = _submit(engine.submit_chat, chat)
        request_id = completion_id()
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_events(job, request, request_id, body.model, include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return response(request_id, body.model, await _result(job, request))

    @app.post("/kvchat/ask", dependencies=[key])
    async def ask(body: AskBody, request: Request) -> dict:
        chat = ChatRequest(body.conversation, body.question.strip(), body.episode,
                           max_tokens=min(body.max_tokens or config.max_tokens, config.max_tokens_limit),
                           sources=body.sources, refuse_off_topic=body.refuse_off_topic)
        _check_known(request, chat)
        completion = await _result(_submit(engine.submit_chat, chat), request)
        answer = documents.answer(chat.question, completion.answer) | {"answer": completion.text}
        return documents.spelled(answer, spell)

    @app.get("/kvchat/conversations", dependencies=[key])
    async def conversations(request: Request) -> dict:
        store = _store(request)
        return documents.conversations(store.conversations(), store.default_name())

    @app.get("/kvchat/conversations/{name}", dependencies=[key])
    async def show(name: str, request: Request) -> dict:
        return documents.show(_conversation(request, name))

    @app.delete("/kvchat/conversations/{name}", dependencies=[key])
    async def remove(name: str, request: Request) -> dict:
        _conversation(request, name)
        _store(request).remove(name)
        engine.forget(name)
        return documents.document(removed=name)

    @app.post("/kvchat/ingest", status_code=202, dependencies=[key])
    async def ingest(body: IngestBody) -> dict:
        from kvchat.history.loading import parse_history
        from kvchat.store import validate_name

        validate_name(body.name)
        turns = parse_history(body.history, "history")
        job = _submit(engine.submit_ingest, IngestRequest(body.name, turns, body.settings(), body.replace, body.append))
        return job_document(job)

    @app.get("/kvchat/jobs/{job_id}", dependencies=[key])
    async def job(job_id: str) -> dict:
        found = engine.job(job_id)
        if found is None:
            raise ApiError(404, f"unknown job {job_id!r}", param="job_id")
        return job_document(found)

    return app


class AskBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    conversation: str
    question: str = Field(min_length=1)
    episode: int | None = Field(None, ge=0)
    max_tokens: int | None = Field(None, ge=1)
    sources: bool = False           # the answer's sources (kvchat.answer.sources)
    refuse_off_topic: bool = False  # no answer when no episode matches well


class IngestBody(BaseModel):
    """POST /kvchat/ingest: a history in any format `kvchat ingest` reads, as JSON."""

    model_config = ConfigDict(extra="forbid")
    name: str
    history: Any
    replace: bool = False
    append: bool = False  # continue the stored conversation `name` with these turns (its own settings)
    model: str | None = None
    budget: int | None = Field(None, ge=1)
    episodes: int | None = Field(None, ge=1)
    method: str | None = None

    def settings(self) -> IngestConfig:
        """`IngestConfig`'s defaults with what the body sets."""
        base = IngestConfig()
        cache: dict[str, Any] = {k: v for k, v in (("budget", self.budget), ("method", self.method)) if v is not None}
        episodes = {"episodes": self.episodes} if self.episodes is not None else {}
        return dataclasses.replace(
            base, model=self.model or base.model, cache=dataclasses.replace(base.cache, **cache),
            episodes=dataclasses.replace(base.episodes, **episodes),
        )


def job_document(job: Job) -> dict:
    error = None if job.error is None else {"message": message(job.error), "type": type(job.error).__name__}
    result = None
    if job.kind == "ingest" and job.result is not None:  # the `kvchat ingest --json` document's fields
        result = {k: v for k, v in documents.ingest(job.result).items() if k != "schema"}
    return documents.spelled(documents.document(id=job.id, kind=job.kind, state=job.state, progress=job.progress,
                                                result=result, error=error), spell)


# ----- answering


def _submit(submit: Callable[..., Job], request: ChatRequest | IngestRequest) -> Job:
    """`engine.submit_chat` or `engine.submit_ingest` of `request`, a full queue answered 429."""
    try:
        return submit(request, asyncio.get_running_loop())
    except QueueFull as exc:
        raise ApiError(429, spell(message(exc)), code="queue_full") from None
    except Closed as exc:
        raise ApiError(503, spell(message(exc))) from None


def _check_known(request: Request, chat: ChatRequest) -> None:
    """An unknown conversation or episode is refused before the request takes a place in the queue."""
    record = _conversation(request, chat.conversation)
    if chat.episode is not None and not 0 <= chat.episode < len(record.episodes):
        raise ApiError(404, f"conversation '{record.name}' has no episode {chat.episode} "
                       f"(it has 0..{len(record.episodes) - 1})", param="model", code="model_not_found")


async def _result(job: Job, request: Request):
    """The job's completion; a client that disconnects meanwhile cancels it."""
    watcher = asyncio.create_task(_cancel_on_disconnect(job, request))
    try:
        while True:
            kind, value = await job.next_event()
            if kind == "done":
                return value
            if kind == "error":
                raise _api_error(value)
    finally:
        watcher.cancel()


async def _events(job: Job, request: Request, request_id: str, model: str, include_usage: bool):
    """The server-sent events of a streamed answer; an error after the stream began is one `error` event."""
    watcher = asyncio.create_task(_cancel_on_disconnect(job, request))
    try:
        yield _sse(chunk(request_id, model, {"role": "assistant", "content": ""}))
        while True:
            kind, value = await job.next_event()
            if kind == "text":
                yield _sse(chunk(request_id, model, {"content": value}))
                continue
            if kind == "done":
                yield _sse(chunk(request_id, model, {}, FINISH_REASONS[value.finish_reason],
                                 kvchat=kvchat_fields(value)))
                if include_usage:
                    yield _sse({"id": request_id, "object": "chat.completion.chunk", "model": model, "choices": [],
                                "usage": usage(value)})
            else:
                yield _sse(_api_error(value).body())
            break
        yield "data: [DONE]\n\n"
    finally:
        job.cancel()  # the client left (or the answer ended: then nothing is left to cancel)
        watcher.cancel()


async def _cancel_on_disconnect(job: Job, request: Request) -> None:
    """Cancel `job` when the client disconnects (the request's body has been read: what follows is that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel()
            return


def _sse(document: dict) -> str:
    return f"data: {json.dumps(document, ensure_ascii=False)}\n\n"


def _api_error(exc: BaseException) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    said = spell(message(exc))
    if isinstance(exc, NotFound):
        return ApiError(404, said, param="model", code="model_not_found")
    if isinstance(exc, Closed):
        return ApiError(503, said)
    if isinstance(exc, QueueFull):  # a replica's queue (a replicated server's): the app's own is refused at submit
        return ApiError(429, said, code="queue_full")
    if isinstance(exc, CacheIntegrityError):  # the server's store is damaged: not the client's to fix
        return ApiError(500, said, code="cache_integrity")
    if isinstance(exc, UserError):
        return ApiError(400, said)
    return ApiError(500, f"internal error ({type(exc).__name__}); the server's log has the details")


# ----- store, auth, limits, errors


def _store(request: Request):
    return request.app.state.store


def _conversation(request: Request, name: str):
    try:
        return find_conversation(_store(request), name)
    except NotFound:
        raise ApiError(404, f"unknown model {name!r}: no conversation of that name (GET /v1/models lists them)",
                       param="model", code="model_not_found") from None


def _key_checker(api_key: str | None):
    async def check(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise ApiError(401, "missing or wrong API key (send `Authorization: Bearer KEY`)", code="invalid_api_key")

    return check


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is refused with 413 before the app sees it (by its
    Content-Length, or, without one, while it arrives)."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await _too_large(self.limit, scope, receive, send)
        if length is not None:
            return await self.app(scope, receive, send)
        messages, size = [], 0
        while True:  # no Content-Length: read the (chunked) body here, up to the limit, then replay it
            message = await receive()
            messages.append(message)
            size += len(message.get("body", b""))
            if size > self.limit:
                return await _too_large(self.limit, scope, receive, send)
            if message["type"] != "http.request" or not message.get("more_body", False):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


async def _too_large(limit: int, scope, receive, send) -> None:
    error = ApiError(413, f"the request body is over {limit} bytes", code="request_too_large")
    await JSONResponse(error.body(), status_code=413, headers={"Connection": "close"})(scope, receive, send)


def _handle_errors(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = [str(part) for part in first.get("loc", ()) if part != "body"]
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            message = "the body is not valid JSON"
        elif where:
            message = f"{'.'.join(where)}: {message}"
        return await api_error(request, ApiError(400, message, param=".".join(where) or None))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return await api_error(request, ApiError(exc.status_code, str(exc.detail)))

    @app.exception_handler(UserError)
    async def user_error(request: Request, exc: UserError) -> JSONResponse:
        return await api_error(request, _api_error(exc))

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        _log.exception("kvchat server: %s %s failed", request.method, request.url.path)
        return await api_error(request, _api_error(exc))
