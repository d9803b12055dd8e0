"""Running the app on uvicorn: the bound address announced in `$KVCHAT_HOME/serve.json` while it serves.

uvicorn turns SIGTERM and SIGINT into a graceful shutdown: no new connections, answers still streaming get
`ServeConfig.shutdown_grace_s` to finish, then the engine fails what is left (a stream ends with an error event, an
ingest job removes its temp dir), the worker stops and the announcement is removed; uvicorn then raises the signal
again, so the process ends as that signal says (the command: exit 143 for SIGTERM).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path

import uvicorn

from kvchat.config import ServeConfig, default_home
from kvchat.errors import UserError
from kvchat.messages import option
from kvchat.serve.announcement import ANNOUNCEMENT, remove_announcement, write_announcement
from kvchat.serve.app import create_app
from kvchat.serve.engine import ServingEngine

_log = logging.getLogger(__name__)


class Server(uvicorn.Server):
    """uvicorn's server that writes where it listens into `home` once it does, and removes it when it stops;
    `stop_jobs` fails the jobs left once the shutdown's grace has passed."""

    def __init__(self, config: uvicorn.Config, home: Path, on_ready: Callable[[str], None] | None = None, *,
                 grace_s: float = ServeConfig.shutdown_grace_s, stop_jobs: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self.home, self.on_ready, self.grace_s, self.stop_jobs = home, on_ready, grace_s, stop_jobs
        self.url: str | None = None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.should_exit or not self.servers:
            return
        host, port = self.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://{_url_host(host)}:{port}"
        try:
            write_announcement(self.home, self.url)
        except OSError as exc:  # a read-only home still serves; `kvchat ask` just cannot find it by itself
            _log.warning("kvchat server: cannot write %s: %s", self.home / ANNOUNCEMENT, exc)
        if self.on_ready is not None:
            self.on_ready(self.url)

    async def shutdown(self, sockets=None) -> None:
        stopping = None
        if self.stop_jobs is not None:  # answers still streaming then end with an error event, closing their streams
            stopping = asyncio.get_running_loop().call_later(self.grace_s, self.stop_jobs)
        try:
            await super().shutdown(sockets)
        finally:
            if stopping is not None:
                stopping.cancel()
            remove_announcement(self.home, os.getpid())


def build_server(config: ServeConfig, *, home: Path | None = None, engine: ServingEngine | None = None,
                 log_level: str = "warning", on_ready: Callable[[str], None] | None = None) -> Server:
    """uvicorn serving `create_app(config)` on `config.host`:`config.port` (0: a free port); `on_ready(url)` is
    called once it listens."""
    home = Path(home) if home is not None else default_home()
    app = create_app(config, home=home, engine=engine)
    # uvicorn's own limit is a backstop: the engine fails the jobs left at the grace's end, which ends their streams
    uv = uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level, lifespan="on",
                        timeout_graceful_shutdown=int(config.shutdown_grace_s) + 5, access_log=False)
    return Server(uv, home, on_ready, grace_s=config.shutdown_grace_s, stop_jobs=app.state.engine.stop_jobs)


def serve(config: ServeConfig, *, home: Path | None = None, log_level: str = "warning",
          on_ready: Callable[[str], None] | None = None) -> None:
    """Serve until SIGTERM or SIGINT. An address that cannot be listened on is the user's to fix (UserError),
    found before anything loads. With `config.replicas`, the answers come from that many Ray Serve replicas
    (kvchat.serve.replicas), started before the app listens and stopped after it."""
    sock = listen(config.host, config.port)
    try:
        with contextlib.ExitStack() as stack:
            engine = None
            if config.replicas is not None:
                from kvchat.serve.replicas import replica_engine

                engine = stack.enter_context(replica_engine(home or default_home(), config, config.replicas))
            build_server(config, home=home, engine=engine, log_level=log_level, on_ready=on_ready).run(sockets=[sock])
    finally:
        sock.close()


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to `host`:`port` (uvicorn listens on it)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror or exc} ({option('host')}, "
                        f"{option('port')})") from None
    return sock


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
