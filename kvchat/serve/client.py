"""A client of a running `kvchat serve`, for `kvchat ask --server`: standard library only, so asking through a
warm server costs neither the server's stack nor torch in the asking process."""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.request
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any

from kvchat.errors import KvchatError, UserError
from kvchat.messages import command


class Unreachable(UserError):
    """Nothing answers at the server's address."""


class Client:
    def __init__(self, url: str, *, api_key: str | None = None, timeout: float = 600.0) -> None:
        self.url, self.api_key, self.timeout = url.rstrip("/"), api_key, timeout

    def conversations(self) -> list[dict[str, Any]]:
        """The `kvchat list --json` entries, newest first."""
        return self._request("GET", "/kvchat/conversations")["conversations"]

    def ask(self, conversation: str | None, question: str, *, episode: int | None = None, max_tokens: int = 64,
            on_text: Callable[[str], None] | None = None, stop: Callable[[], bool] | None = None,
            earlier: Sequence[tuple[str, str]] = (), sources: bool = False,
            refuse_off_topic: bool = False) -> dict[str, Any]:
        """The `kvchat ask --json` document of one answer; `on_text` gets the text as it streams, and `stop`,
        asked after each piece, ends it (the connection closes, which stops the server's decoding; the
        document's `finish_reason` is then "stopped"). `conversation` None: the server's default (`kvchat use`),
        else the newest. `earlier` (question, answer) pairs are the exchange the question follows up (streamed
        answers only). `sources` asks for the turns the answer drew on; `refuse_off_topic`, for no answer when no
        episode matches well (`finish_reason` "refused")."""
        if conversation is None:
            listed = self.conversations()
            if not listed:
                raise UserError(f"no conversations yet; run `{command('ingest', 'HISTORY')}` first")
            conversation = default_of(listed)
        options = {key: True for key, on in (("sources", sources), ("refuse_off_topic", refuse_off_topic)) if on}
        body: dict[str, Any]
        if on_text is None:
            body = {"conversation": conversation, "question": question, "episode": episode, "max_tokens": max_tokens,
                    **options}
            return self._request("POST", "/kvchat/ask", body)
        model = conversation if episode is None else f"{conversation}/{episode}"
        messages = [{"role": role, "content": text} for pair in earlier
                    for role, text in zip(("user", "assistant"), pair, strict=True)]
        body = {"model": model, "messages": [*messages, {"role": "user", "content": question}],
                "max_tokens": max_tokens,
                "stream": True, "stream_options": {"include_usage": True}, **({"kvchat": options} if options else {})}
        with contextlib.closing(self._events("/v1/chat/completions", body)) as events:  # a break hangs up at once
            text, finish, kvchat, usage = self._read(events, on_text, stop)
        return {"schema": 1, "question": question, "answer": "".join(text), **kvchat,
                "prompt_tokens": usage.get("prompt_tokens"), "answer_tokens": usage.get("completion_tokens"),
                "finish_reason": finish if finish == "stopped" else kvchat.get("finish_reason", finish)}

    @staticmethod
    def _read(events: Iterator[dict[str, Any]], on_text: Callable[[str], None],
              stop: Callable[[], bool] | None) -> tuple[list[str], str, dict, dict]:
        """A streamed answer's pieces, finish reason, `kvchat` fields and usage."""
        text: list[str] = []
        finish = "stop"
        kvchat: dict[str, Any] = {}
        usage: dict[str, Any] = {}
        for event in events:
            if "error" in event:
                raise _error(500, event)
            for choice in event.get("choices") or []:
                piece = choice.get("delta", {}).get("content")
                if piece:
                    text.append(piece)
                    on_text(piece)
                if choice.get("finish_reason"):
                    finish, kvchat = choice["finish_reason"], event.get("kvchat", {})
            usage = event.get("usage") or usage
            if stop is not None and stop():
                return text, "stopped", kvchat, usage
        return text, finish, kvchat, usage

    def _open(self, method: str, path: str, body: dict | None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method)
        request.add_header("Content-Type", "application/json")
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            return urllib.request.urlopen(request, timeout=self.timeout)
        except urllib.error.HTTPError as exc:
            try:
                document = json.loads(exc.read() or b"{}")
            except ValueError:
                document = {}
            raise _error(exc.code, document) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise Unreachable(f"cannot reach the kvchat server at {self.url}: {reason}") from None

    def _request(self, method: str, path: str, body: dict | None = None) -> dict[str, Any]:
        with self._open(method, path, body) as response:
            return json.loads(response.read())

    def _events(self, path: str, body: dict) -> Generator[dict[str, Any]]:
        """The server-sent events of a streamed response, as documents, up to `[DONE]`."""
        with self._open("POST", path, body) as response:
            for raw in response:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    return
                yield json.loads(data)


def default_of(listed: list[dict[str, Any]]) -> str:
    """The default conversation of a non-empty listing (`conversations()`): the one marked (`kvchat use`), else
    the newest (a server older than the mark marks none)."""
    return next((c["name"] for c in listed if c.get("default")), listed[0]["name"])


def _error(status: int, document: dict) -> KvchatError:
    """The server's error as kvchat's: the client's mistakes (4xx) are the user's to fix."""
    message = (document.get("error") or {}).get("message") or f"HTTP {status}"
    return UserError(f"server: {message}") if 400 <= status < 500 else KvchatError(f"server: {message}")
