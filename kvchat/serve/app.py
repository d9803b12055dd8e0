"""The HTTP application of `kvchat serve` (FastAPI): the OpenAI-compatible endpoints and kvchat's own.

- `POST /v1/chat/completions` (streamed as server-sent events with `"stream": true`), `GET /v1/models[/{id}]`
- `POST /kvchat/ask` (the `kvchat ask --json` document), `GET /kvchat/conversations[/{name}]`,
  `DELETE /kvchat/conversations/{name}`, `POST /kvchat/ingest` -> a job, `GET /kvchat/jobs/{id}`,
  `GET /kvchat/health` (the only endpoint open without the API key: then it says `ok` or `loading`, nothing else),
  `GET /openapi.json` (behind the key when there is one)

Every error has OpenAI's shape with its HTTP status: 400 malformed, 401 bad key, 403 the store is read-only,
404 unknown conversation or episode, 413 body too large, 429 queue full, 500 internal, 503 shutting down; its
message never names a path on the server. A request naming a host the server does not answer to is refused
(400, `guards`). The store connection here belongs to the event loop's thread (every endpoint is `async`); the
engine's worker has its own. The threat model: docs/serve.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path, PurePosixPath
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware

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
from kvchat.serve.guards import BodyLimit, RequestLog, allowed_hosts
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
    refusal,
    response,
    usage,
)
from kvchat.serve.spelling import spell
from kvchat.untrusted_text import valid_text

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

    app = FastAPI(title="kvchat", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine, app.state.config = engine, config
    app.state.redact = _redactor(home, config)
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts(config), www_redirect=False)
    app.add_middleware(RequestLog)
    _handle_errors(app)
    authorized = _key_checker(config.api_key)
    key = Depends(_require(authorized))

    @app.get("/kvchat/health")
    async def health(request: Request) -> dict:
        status = "ok" if engine.ready else "loading"
        if not authorized(request):  # open to anyone who reaches it: whether it runs, nothing about what it holds
            return documents.document(status=status)
        return documents.document(status=status, **engine.status())

    @app.get("/openapi.json", dependencies=[key], include_in_schema=False)
    async def openapi() -> dict:
        return app.openapi()

    @app.get("/v1/models", dependencies=[key])
    async def models(request: Request) -> dict:
        return {"object": "list", "data": [model_entry(r) for r in _store(request).conversations()]}

    @app.get("/v1/models/{model:path}", dependencies=[key])
    async def model(model: str, request: Request) -> dict:
        return model_entry(_conversation(request, parse_model(model)[0]))

    @app.post("/v1/chat/completions", dependencies=[key])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        request.state.conversation = body.model.partition("/")[0]
        chat = body.to_chat(config.max_tokens, config.max_tokens_limit)
        _log.debug("question %r", chat.question)
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
        request.state.conversation = body.conversation
        tokens = body.max_tokens or config.max_tokens
        if tokens > config.max_tokens_limit:  # as chat completions: refused, never silently cut
            raise ApiError(400, f"max_tokens is {tokens}; this server allows at most {config.max_tokens_limit}",
                           param="max_tokens")
        chat = ChatRequest(body.conversation, valid_text(body.question).strip(), body.episode, max_tokens=tokens,
                           sources=body.sources, refuse_off_topic=body.refuse_off_topic)
        _log.debug("question %r", chat.question)
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
        request.state.conversation = name
        return documents.show(_conversation(request, name))

    @app.delete("/kvchat/conversations/{name}", dependencies=[key])
    async def remove(name: str, request: Request) -> dict:
        request.state.conversation = name
        _conversation(request, name)
        _check_writable(request)
        _store(request).remove(name)
        engine.forget(name)
        return documents.document(removed=name)

    @app.post("/kvchat/ingest", status_code=202, dependencies=[key])
    async def ingest(body: IngestBody, request: Request) -> dict:
        from kvchat.store import validate_name

        request.state.conversation = body.name
        validate_name(body.name)
        _check_writable(request)
        turns = await asyncio.to_thread(body.turns, config.history_dir)
        settings = body.settings(config.model)
        job = _submit(engine.submit_ingest, IngestRequest(body.name, turns, settings, body.replace, body.append))
        return job_document(job, app.state.redact)

    @app.get("/kvchat/jobs/{job_id}", dependencies=[key])
    async def job(job_id: str) -> dict:
        found = engine.job(job_id)
        if found is None:
            raise ApiError(404, f"unknown job {job_id!r}", param="job_id")
        return job_document(found, app.state.redact)

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
    """POST /kvchat/ingest: a history inline (a JSON value in any JSON format `kvchat ingest` reads) or a file of the
    directory the server's operator allows (`history_file`, relative to it), and options. The model is the server's
    (`ServeConfig.model`; an append: the conversation's own): a client never names a file the server opens beyond
    that directory."""

    model_config = ConfigDict(extra="forbid")
    name: str
    history: Any = None
    history_file: str | None = Field(None, min_length=1, max_length=4096)
    format: str | None = Field(None, max_length=32)
    pick: int | str | None = None  # which conversation of a file holding several: a number, a title or "all"
    replace: bool = False
    append: bool = False  # continue the stored conversation `name` with these turns (its own settings)
    budget: int | None = Field(None, ge=1)
    episodes: int | None = Field(None, ge=1)
    method: str | None = Field(None, max_length=32)

    @model_validator(mode="before")
    @classmethod
    def _no_model(cls, data: Any) -> Any:
        if isinstance(data, dict) and "model" in data:
            raise ValueError("the server ingests with the model its operator chose; a request cannot name one")
        return data

    def turns(self, history_dir: str | None) -> list:
        """The history's turns (a UserError, naming it as the request does, when it is not one)."""
        from kvchat.history.loading import load_history, parse_history

        minimum = 1 if self.append else 2
        if (self.history is None) == (self.history_file is None):
            raise ApiError(400, "give the history inline (history) or as a file (history_file), one of them",
                           param="history")
        if self.history is not None:
            return parse_history(self.history, "history", format=self.format, pick=self.pick, min_turns=minimum)
        path = history_path(history_dir, self.history_file or "")
        return load_history(path, format=self.format, pick=self.pick, min_turns=minimum,
                            name=f"history_file {self.history_file!r}")

    def settings(self, model: str) -> IngestConfig:
        """`IngestConfig`'s defaults with the server's `model` and what the body sets."""
        base = IngestConfig()
        cache: dict[str, Any] = {k: v for k, v in (("budget", self.budget), ("method", self.method)) if v is not None}
        episodes = {"episodes": self.episodes} if self.episodes is not None else {}
        return dataclasses.replace(
            base, model=model, cache=dataclasses.replace(base.cache, **cache),
            episodes=dataclasses.replace(base.episodes, **episodes),
        )


def history_path(directory: str | None, given: str) -> Path:
    """The file `given` names inside the operator's history `directory` (a relative path; links followed, and the
    file they reach must lie inside it). Every path outside it is refused alike, whether it exists or not."""
    if directory is None:
        raise ApiError(403, "this server reads no history files (its operator allows no directory); send the "
                       "history inline", param="history_file", code="history_file_not_allowed")
    relative = PurePosixPath(given)
    outside = ApiError(403, "history_file must name a file inside the server's history directory, by a relative "
                       "path", param="history_file", code="history_file_not_allowed")
    if relative.is_absolute() or ".." in relative.parts or "\\" in given or "\0" in given or not relative.parts:
        raise outside
    root = Path(directory).resolve()
    path = (root / relative).resolve()
    if not path.is_relative_to(root) or path == root:
        raise outside
    return path


def job_document(job: Job, redact: Callable[[str], str] = str) -> dict:
    error = None if job.error is None else {"message": redact(message(job.error)), "type": type(job.error).__name__}
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
        raise ApiError(503, spell(message(exc)), code="shutting_down") from None


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
                raise _api_error(value, request.app.state.redact)
    finally:
        watcher.cancel()


async def _events(job: Job, request: Request, request_id: str, model: str, include_usage: bool):
    """The server-sent events of a streamed answer. While it waits for the next event, a comment every
    `ServeConfig.keepalive_s`, so a client can tell a slow answer from a stopped server. `data: [DONE]` ends a
    whole answer only: an error after the stream began (the server shutting down, say) is one `error` event, then
    the stream closes without it."""
    keepalive = request.app.state.config.keepalive_s
    watcher = asyncio.create_task(_cancel_on_disconnect(job, request))
    try:
        yield _sse(chunk(request_id, model, {"role": "assistant", "content": ""}))
        while True:
            try:
                kind, value = await asyncio.wait_for(job.next_event(), keepalive)
            except TimeoutError:
                yield ": waiting\n\n"
                continue
            if kind == "text":
                yield _sse(chunk(request_id, model, {"content": value}))
                continue
            if kind == "done":
                refused = refusal(value)
                if refused:
                    yield _sse(chunk(request_id, model, {"content": refused, "refusal": refused}))
                yield _sse(chunk(request_id, model, {}, FINISH_REASONS[value.finish_reason],
                                 kvchat=kvchat_fields(value)))
                if include_usage:
                    yield _sse({"id": request_id, "object": "chat.completion.chunk", "model": model, "choices": [],
                                "usage": usage(value)})
                yield "data: [DONE]\n\n"
            else:
                yield _sse(_api_error(value, request.app.state.redact).body())
            break
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


def _api_error(exc: BaseException, redact: Callable[[str], str] = str) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    said = redact(spell(message(exc)))
    if isinstance(exc, NotFound):
        return ApiError(404, said, param="model", code="model_not_found")
    if isinstance(exc, Closed):
        return ApiError(503, said, code="shutting_down")
    if isinstance(exc, QueueFull):  # a replica's queue (a replicated server's): the app's own is refused at submit
        return ApiError(429, said, code="queue_full")
    if isinstance(exc, CacheIntegrityError):  # the server's store is damaged: not the client's to fix
        return ApiError(500, said, code="cache_integrity")
    if isinstance(exc, UserError):
        return ApiError(400, said)
    return ApiError(500, f"internal error ({type(exc).__name__}); the server's log has the details")


def _redactor(home: Path, config: ServeConfig) -> Callable[[str], str]:
    """What a client's error says in place of the server's own paths (its home, its history directory, a model
    given by path): nothing about the server's file system reaches a client."""
    paths = [(str(home), "the server's store")]
    if config.history_dir is not None:
        paths += [(str(Path(config.history_dir).resolve()), "the history directory"),
                  (str(config.history_dir), "the history directory")]
    if config.model != "default":
        paths.append((config.model, "the server's model"))
    paths.sort(key=lambda pair: -len(pair[0]))  # a path inside another first

    def redact(text: str) -> str:
        for path, name in paths:
            if path and path != ".":
                text = text.replace(path, name)
        return text

    return redact


# ----- store, auth, limits, errors


def _store(request: Request):
    return request.app.state.store


def _conversation(request: Request, name: str):
    try:
        return find_conversation(_store(request), name)
    except NotFound:
        raise ApiError(404, f"unknown model {name!r}: no conversation of that name (GET /v1/models lists them)",
                       param="model", code="model_not_found") from None


def _check_writable(request: Request) -> None:
    """A request that would change the store is refused at once when the store is read-only (not accepted, then
    failed)."""
    if _store(request).read_only:
        raise ApiError(403, "the server's store is read-only: conversations can be listed and asked, not ingested "
                       "or removed", code="read_only")


def _key_checker(api_key: str | None) -> Callable[[Request], bool]:
    """Whether a request carries the API key (every request does when there is none)."""

    def authorized(request: Request) -> bool:
        if api_key is None:
            return True
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())

    return authorized


def _require(authorized: Callable[[Request], bool]):
    async def check(request: Request) -> None:
        if not authorized(request):
            raise ApiError(401, "missing or wrong API key (send `Authorization: Bearer KEY`)", code="invalid_api_key")

    return check


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
        return await api_error(request, _api_error(exc, request.app.state.redact))

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        _log.exception("kvchat server: %s %s failed", request.method, request.url.path)
        return await api_error(request, _api_error(exc))
