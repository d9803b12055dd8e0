"""How many CPU cores this process may use: what sets torch's threads, a server's threads per replica, and what
the benchmarks' load check compares the load with. Imports no torch (the benchmarks' load check runs before it)."""

from __future__ import annotations

import os
from pathlib import Path


def usable_cores() -> int:
    """CPU cores this process may run on: its affinity mask, capped by a cgroup v2 CPU quota when one is
    set (a container's `os.cpu_count()` is the host's)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        cores = min(cores, max(1, int(quota) // int(period)))
    except (OSError, ValueError):  # absent, or "max": no quota
        pass
    return cores
