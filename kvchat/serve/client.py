"""A client of a running `kvchat serve`, for `kvchat ask --server`: standard library only, so asking through a
warm server costs neither the server's stack nor torch in the asking process.

A slow or dead server never hangs it: connecting and every read have their limits (`ClientConfig`), every answer
is streamed (a live server's stream is never silent longer than its keep-alive, `ServeConfig.keepalive_s`), and a
stream that ends without its final event (the server died, or stopped mid-answer) is an error, never an answer
cut short taken for a whole one.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import urllib.parse
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any

from kvchat.config import ClientConfig
from kvchat.errors import KvchatError, UserError
from kvchat.messages import command


class Unreachable(UserError):
    """Nothing answers at the server's address."""


class ServerFailed(UserError):
    """The server went silent or ended an answer before its end: stopped, dead, or shutting down."""


class Client:
    def __init__(self, url: str, *, api_key: str | None = None, config: ClientConfig = ClientConfig()) -> None:
        self.url, self.api_key, self.config = url.rstrip("/"), api_key, config
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UserError(f"not a server URL: {self.url!r} (expected http://HOST:PORT)")
        self._parts = parts

    def conversations(self) -> list[dict[str, Any]]:
        """The `kvchat list --json` entries, newest first."""
        return self._request("GET", "/kvchat/conversations")["conversations"]

    def ask(self, conversation: str | None, question: str, *, episode: int | None = None, max_tokens: int = 64,
            on_text: Callable[[str], None] | None = None, stop: Callable[[], bool] | None = None,
            earlier: Sequence[tuple[str, str]] = (), sources: bool = False,
            refuse_off_topic: bool = False, system: str | None = None,
            sampling: dict[str, Any] | None = None) -> dict[str, Any]:
        """The `kvchat ask --json` document of one answer; `on_text` gets the text as it streams, and `stop`,
        asked after each piece, ends it (the connection closes, which stops the server's decoding; the
        document's `finish_reason` is then "stopped"). `conversation` None: the server's default (`kvchat use`),
        else the newest. `earlier` (question, answer) pairs are the exchange the question follows up; `system`, the
        user's instructions; `sampling`, the chat request's sampling fields (`temperature`, `seed`, ...). `sources`
        asks for the turns the answer drew on; `refuse_off_topic`, for no answer when no episode matches well
        (`finish_reason` "refused"). Always streamed, so the read limit holds however long the answer takes."""
        if conversation is None:
            listed = self.conversations()
            if not listed:
                raise UserError(f"no conversations yet; run `{command('ingest', 'HISTORY')}` first")
            conversation = default_of(listed)
        options = {key: True for key, on in (("sources", sources), ("refuse_off_topic", refuse_off_topic)) if on}
        model = conversation if episode is None else f"{conversation}/{episode}"
        messages = [{"role": role, "content": text} for pair in earlier
                    for role, text in zip(("user", "assistant"), pair, strict=True)]
        instructions = [{"role": "system", "content": system}] if system else []
        body = {"model": model, "messages": [*instructions, *messages, {"role": "user", "content": question}],
                "max_tokens": max_tokens, **(sampling or {}),
                "stream": True, "stream_options": {"include_usage": True}, **({"kvchat": options} if options else {})}
        with contextlib.closing(self._events("/v1/chat/completions", body)) as events:  # a break hangs up at once
            text, finish, kvchat, usage = self._read(events, on_text or (lambda piece: None), stop)
        answer = "" if kvchat.get("finish_reason") == "refused" else "".join(text)  # its text is the refusal's
        return {"schema": 1, "question": question, "answer": answer, **kvchat,
                "prompt_tokens": usage.get("prompt_tokens", kvchat.get("prompt_tokens")),
                "answer_tokens": usage.get("completion_tokens", kvchat.get("answer_tokens")),
                "finish_reason": finish if finish == "stopped" else kvchat.get("finish_reason", finish)}

    def _read(self, events: Iterator[dict[str, Any] | None], on_text: Callable[[str], None],
              stop: Callable[[], bool] | None) -> tuple[list[str], str, dict, dict]:
        """A streamed answer's pieces, finish reason, `kvchat` fields and usage; `ServerFailed` when the stream ends
        before its `[DONE]` (None from `_events`)."""
        text: list[str] = []
        finish = "stop"
        kvchat: dict[str, Any] = {}
        usage: dict[str, Any] = {}
        for event in events:
            if event is None:
                return text, finish, kvchat, usage
            if "error" in event:
                raise _event_error(event)
            for choice in event.get("choices") or []:
                delta = choice.get("delta") or {}
                piece = delta.get("content")
                if piece and not delta.get("refusal"):
                    text.append(piece)
                    on_text(piece)
                if choice.get("finish_reason"):
                    finish, kvchat = choice["finish_reason"], event.get("kvchat", {})
            usage = event.get("usage") or usage
            if stop is not None and stop():
                return text, "stopped", kvchat, usage
        raise ServerFailed(f"the kvchat server at {self.url} ended the answer before its end (it died, or stopped)")

    def _open(self, method: str, path: str, body: dict | None) -> http.client.HTTPResponse:
        """The response to one request: connected within `connect_timeout_s`, every read within `read_timeout_s`."""
        parts = self._parts
        kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        connection = kind(parts.hostname or "", parts.port, timeout=self.config.connect_timeout_s)
        headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        try:
            connection.connect()
        except OSError as exc:
            connection.close()
            raise Unreachable(f"cannot reach the kvchat server at {self.url}: {_reason(exc)}") from None
        try:
            connection.sock.settimeout(self.config.read_timeout_s)
            connection.request(method, parts.path.rstrip("/") + path, body=data, headers=headers)
            response = connection.getresponse()
        except TimeoutError:
            connection.close()
            raise self._silent() from None
        except OSError as exc:
            connection.close()
            raise ServerFailed(f"the kvchat server at {self.url} failed: {_reason(exc)}") from None
        except http.client.HTTPException as exc:
            connection.close()
            raise ServerFailed(f"the kvchat server at {self.url} sent no valid reply ({type(exc).__name__})") \
                from None
        if response.status >= 400:
            try:
                document = json.loads(response.read(1 << 20) or b"{}")
            except (ValueError, OSError, http.client.HTTPException):
                document = {}
            finally:
                connection.close()
            raise _error(response.status, document if isinstance(document, dict) else {})
        return response

    def _silent(self) -> ServerFailed:
        return ServerFailed(f"the kvchat server at {self.url} sent nothing for {self.config.read_timeout_s:g} s: it "
                            "is stopped or stuck")

    def _request(self, method: str, path: str, body: dict | None = None) -> dict[str, Any]:
        response = self._open(method, path, body)
        try:
            return json.loads(response.read())
        except TimeoutError:
            raise self._silent() from None
        except (OSError, ValueError, http.client.HTTPException) as exc:
            raise ServerFailed(f"the kvchat server at {self.url} sent no valid reply ({type(exc).__name__})") \
                from None
        finally:
            response.close()

    def _events(self, path: str, body: dict) -> Generator[dict[str, Any] | None]:
        """The server-sent events of a streamed response, as documents (comments skipped), then None for its
        `[DONE]`; a stream that ends without it just ends."""
        response = self._open("POST", path, body)
        try:
            while True:
                try:
                    raw = response.readline(1 << 24)
                except TimeoutError:
                    raise self._silent() from None
                except (OSError, http.client.HTTPException) as exc:
                    raise ServerFailed(f"the kvchat server at {self.url} broke off the answer ({_reason(exc)})") \
                        from None
                if not raw:
                    return  # the stream ended without [DONE]: `_read` says so unless the answer was whole
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    yield None
                    return
                try:
                    yield json.loads(data)
                except ValueError:
                    raise ServerFailed(f"the kvchat server at {self.url} sent an event that is not JSON") from None
        finally:
            response.close()


def default_of(listed: list[dict[str, Any]]) -> str:
    """The default conversation of a non-empty listing (`conversations()`): the one marked (`kvchat use`), else
    the newest (a server older than the mark marks none)."""
    return next((c["name"] for c in listed if c.get("default")), listed[0]["name"])


def _reason(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__


def _event_error(event: dict) -> KvchatError:
    """An error event of a stream, as `_error` says its status would: a shutdown is `ServerFailed`, a request the
    server refuses the user's to fix, the rest an internal failure."""
    error = event["error"] if isinstance(event.get("error"), dict) else {}
    if error.get("code") == "shutting_down":
        return _error(503, event)
    return _error(400 if error.get("type") in _CLIENT_ERRORS else 500, event)


_CLIENT_ERRORS = ("invalid_request_error", "authentication_error", "not_found_error", "rate_limit_error")


def _error(status: int, document: dict) -> KvchatError:
    """The server's error as kvchat's: the client's mistakes (4xx) are the user's to fix; a server shutting down
    (503) or failing (5xx) is `ServerFailed`."""
    error = document["error"] if isinstance(document.get("error"), dict) else {}
    message = error.get("message") or f"HTTP {status}"
    if 400 <= status < 500:
        return UserError(f"server: {message}")
    return ServerFailed(f"server: {message}") if status == 503 else KvchatError(f"server: {message}")
