"""`$KVCHAT_HOME/serve.json`: where a running `kvchat serve` listens, so `kvchat ask` finds it. Standard library
only: reading it must not cost the import of the server's stack (or of torch)."""

from __future__ import annotations

import json
import os
from pathlib import Path

ANNOUNCEMENT = "serve.json"


def write_announcement(home: Path, url: str) -> None:
    """The URL and pid of this server, written atomically."""
    home.mkdir(parents=True, exist_ok=True)
    tmp = home / f".{ANNOUNCEMENT}.{os.getpid()}"
    tmp.write_text(json.dumps({"url": url, "pid": os.getpid()}))
    os.replace(tmp, home / ANNOUNCEMENT)


def remove_announcement(home: Path, pid: int) -> None:
    """Remove the announcement if it is `pid`'s (another server may have started since)."""
    path = home / ANNOUNCEMENT
    try:
        if json.loads(path.read_text()).get("pid") == pid:
            path.unlink()
    except (OSError, ValueError, AttributeError):
        pass


def announced_url(home: Path) -> str | None:
    """The URL of the server announced in `home`, if its process is still alive."""
    try:
        found = json.loads((home / ANNOUNCEMENT).read_text())
        os.kill(int(found["pid"]), 0)
        return str(found["url"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def stale_announcement(home: Path) -> str | None:
    """What is wrong with `home`'s announcement when no server it names runs (its process died without removing
    it, `kill -9` say; or it cannot be read), else None (none there, or its server runs). `kvchat doctor` reports
    it and removes it with `remove_stale_announcement`."""
    path = home / ANNOUNCEMENT
    try:
        found = json.loads(path.read_text())
        pid = int(found["pid"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return "cannot be read as a server's announcement"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"names a server (pid {pid}) that no longer runs"
    except OSError:  # it exists, another user's
        return None
    return None


def remove_stale_announcement(home: Path) -> bool:
    """Remove `home`'s announcement if it is still stale (`stale_announcement`); whether it did."""
    if stale_announcement(home) is None:
        return False
    try:
        (home / ANNOUNCEMENT).unlink()
    except FileNotFoundError:
        return False
    return True
