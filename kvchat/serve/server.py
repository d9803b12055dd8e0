"""Running the app on uvicorn: the bound address announced in `$KVCHAT_HOME/serve.json` while it serves.

uvicorn turns SIGTERM and SIGINT into a graceful shutdown: no new connections, answers still streaming get
`ServeConfig.shutdown_grace_s` to finish, then the engine cancels what is left and the announcement is removed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import uvicorn

from kvchat.config import ServeConfig, default_home
from kvchat.serve.app import create_app
from kvchat.serve.engine import Engine

ANNOUNCEMENT = "serve.json"


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


def write_announcement(home: Path, url: str) -> None:
    """`serve.json`: the URL and pid of this server, written atomically (`kvchat ask --server` finds it)."""
    home.mkdir(parents=True, exist_ok=True)
    tmp = home / f".{ANNOUNCEMENT}.{os.getpid()}"
    tmp.write_text(json.dumps({"url": url, "pid": os.getpid()}))
    os.replace(tmp, home / ANNOUNCEMENT)


def remove_announcement(home: Path, pid: int) -> None:
    """Remove `serve.json` if it is this server's (another server may have started since)."""
    path = home / ANNOUNCEMENT
    try:
        if json.loads(path.read_text()).get("pid") == pid:
            path.unlink()
    except (OSError, ValueError):
        pass


def announced_url(home: Path) -> str | None:
    """The URL of the server announced in `home`, if its process is still alive."""
    try:
        found = json.loads((home / ANNOUNCEMENT).read_text())
        os.kill(int(found["pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return str(found["url"])


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
