"""Running the app on uvicorn: the bound address announced in `$KVCHAT_HOME/serve.json` while it serves.

uvicorn turns SIGTERM and SIGINT into a graceful shutdown: no new connections, answers still streaming get
`ServeConfig.shutdown_grace_s` to finish, then the engine cancels what is left and the announcement is removed.
"""

from __future__ import annotations

import os
from pathlib import Path

import uvicorn

from kvchat.config import ServeConfig, default_home
from kvchat.serve.announcement import remove_announcement, write_announcement
from kvchat.serve.app import create_app
from kvchat.serve.engine import Engine


class Server(uvicorn.Server):
    """uvicorn's server that writes where it listens into `home` once it does, and removes it when it stops."""

    def __init__(self, config: uvicorn.Config, home: Path) -> None:
        super().__init__(config)
        self.home = home
        self.url: str | None = None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.should_exit or not self.servers:
            return
        host, port = self.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://{_url_host(host)}:{port}"
        write_announcement(self.home, self.url)

    async def shutdown(self, sockets=None) -> None:
        try:
            await super().shutdown(sockets)
        finally:
            remove_announcement(self.home, os.getpid())


def build_server(config: ServeConfig, *, home: Path | None = None, engine: Engine | None = None,
                 log_level: str = "warning") -> Server:
    home = Path(home) if home is not None else default_home()
    app = create_app(config, home=home, engine=engine)
    uv = uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level, lifespan="on",
                        timeout_graceful_shutdown=int(config.shutdown_grace_s) or None, access_log=False)
    return Server(uv, home)


def serve(config: ServeConfig, *, home: Path | None = None, log_level: str = "warning") -> None:
    """Serve until SIGTERM or SIGINT."""
    build_server(config, home=home, log_level=log_level).run()


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
