"""What stands between the network and kvchat serve's endpoints (ASGI middleware): the Host allow-list, the body
limit, and the request log.

The Host allow-list is what stops DNS rebinding: a web page whose name an attacker points at 127.0.0.1 reaches
the server under that name, in its `Host` header, so only the loopback names, the address the server is bound to
and the names its operator allows (`ServeConfig.allowed_hosts`) are answered (`allowed_hosts`, which the app
gives Starlette's TrustedHostMiddleware).
The threat model: docs/serve.md.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import time

from fastapi.responses import JSONResponse

from kvchat.config import ServeConfig
from kvchat.serve.protocol import ApiError

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")
_WILDCARDS = ("", "0.0.0.0", "::")
access_log = logging.getLogger("kvchat.serve.requests")


def allowed_hosts(config: ServeConfig) -> list[str]:
    """The `Host` names the server answers to: loopback's, the bound address (and this machine's names when bound
    to every interface), and the operator's own (`ServeConfig.allowed_hosts`; "*" allows any)."""
    hosts = list(LOOPBACK_HOSTS)
    if config.host in _WILDCARDS:
        hosts += [socket.gethostname(), socket.getfqdn()]
    else:
        hosts.append(_host_name(config.host))
    hosts += [_host_name(h) for h in config.allowed_hosts]
    return list(dict.fromkeys(h.lower() for h in hosts if h))


def _host_name(host: str) -> str:
    """A host as a `Host` header names it: an IPv6 address in brackets."""
    try:
        return f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    except ValueError:
        return host


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


class RequestLog:
    """ASGI middleware: one line per request once its response has ended (a stream: its last event), at INFO on
    `kvchat.serve.requests`: method, path, status, the conversation it was about (what the endpoint put in
    `request.state.conversation`) and milliseconds. Never a question's text (that is a DEBUG line of the chat
    endpoints); a path's characters that are not printable are escaped."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, status = time.perf_counter(), [0]

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            conversation = (scope.get("state") or {}).get("conversation") or "-"
            access_log.info("%s %s %s %s %d ms", scope["method"], printable(scope["path"]), status[0] or "-",
                            printable(str(conversation)), round(1000 * (time.perf_counter() - started)))


def printable(text: str, limit: int = 200) -> str:
    """`text` for a log line: at most `limit` characters, every one that is not printable (controls, escapes, bidi
    overrides, line breaks) written as its escape."""
    text = text[:limit] + ("..." if len(text) > limit else "")
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)
