"""Running kvchat as users do: a real process (`run`), or main() inside the test process (`run_main`,
which skips the 5-10 s of interpreter and import start-up per call)."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

KVCHAT = [sys.executable, "-m", "kvchat"]


def cli_env(home: Path) -> dict[str, str]:
    return {**os.environ, "KVCHAT_HOME": str(home), "HF_HUB_OFFLINE": "1"}


def run(home: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*KVCHAT, *args], input=stdin, capture_output=True, text=True, env=cli_env(home), timeout=300
    )


def run_main(home: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """`kvchat ARGS` through kvchat.cli.run() (main() less its process-wide SIGPIPE setting) in this
    process: same exit codes and output streams."""
    from transformers.utils import logging

    from kvchat.cli import run as main

    # The CLI silences load-time progress bars through environment variables read at import time,
    # which in this process is long past.
    logging.disable_progress_bar()

    saved_env, saved_argv, saved_stdin = dict(os.environ), sys.argv, sys.stdin
    stdout, stderr = io.StringIO(), io.StringIO()
    os.environ["KVCHAT_HOME"] = str(home)
    sys.argv = ["kvchat", *args]
    if stdin is not None:
        sys.stdin = io.StringIO(stdin)
    code = 0
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.argv, sys.stdin = saved_argv, saved_stdin
        os.environ.clear()
        os.environ.update(saved_env)
    return subprocess.CompletedProcess(["kvchat", *args], code, stdout.getvalue(), stderr.getvalue())
