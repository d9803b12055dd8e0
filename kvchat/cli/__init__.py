"""kvchat's command line: parses options, calls the library, renders with rich.

This module holds the Typer app, the command table and `main` (exit codes, signals); each command group
lives in its own module, and the commands that need no model import none of torch or transformers.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
from collections.abc import Sequence
from typing import Annotated

import typer

from kvchat.cli import asking, calibration, evaluating, ingesting, serving, stored
from kvchat.cli.helptext import HelpCommand, HelpGroup
from kvchat.cli.render import err, say
from kvchat.cli.words import error_text
from kvchat.errors import UserError

app = typer.Typer(
    help="Answer questions about chat histories far longer than your KV-cache budget.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    cls=HelpGroup,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            number = version("kvchat")
        except PackageNotFoundError:
            number = "unknown"
        sys.stdout.write(f"kvchat {number}\n")
        raise typer.Exit()


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks of internal errors, and what kvchat's "
                                        "library logs (where the model runs, its decode attention backend).")] = False,
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print kvchat's version and exit.")] = False,
) -> None:
    """kvchat keeps one compressed KV cache per topical episode of a conversation, on disk
    ($KVCHAT_HOME, default: the platform's user data dir), and answers from the nearest one."""


# The commands, in the order --help lists them.
app.command(cls=HelpCommand, epilog=ingesting.INGEST_EXAMPLES)(ingesting.ingest)
app.command("ingest-batch", cls=HelpCommand)(ingesting.ingest_batch)
app.command(cls=HelpCommand)(asking.ask)
app.command(cls=HelpCommand)(serving.serve)
app.command("profile-layers", cls=HelpCommand)(calibration.profile_layers_command)
app.command("train-indexer", cls=HelpCommand)(calibration.train_indexer_command)
app.command("eval", cls=HelpCommand)(evaluating.eval_command)
app.command("list", cls=HelpCommand)(stored.list_conversations)
app.command(cls=HelpCommand)(stored.use)
app.command(cls=HelpCommand)(stored.show)
app.command(cls=HelpCommand)(stored.rm)
app.command(cls=HelpCommand)(stored.path)
app.command(cls=HelpCommand)(stored.logs)
app.command(cls=HelpCommand)(stored.doctor)


def main() -> None:
    """Entry point: usage errors and user mistakes exit 2 with one line (usage errors with click's usage
    line); internal failures exit 1 and point to --debug; a closed pipe ends quietly, as in git."""
    if hasattr(signal, "SIGPIPE"):  # `kvchat ask ... | head -c1`: die of SIGPIPE like any Unix filter
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    for name in ("SIGTERM", "SIGHUP"):  # unwind, so an ingest or a model conversion removes its temp dir
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), _terminate)
    closed = _occupy_closed_streams()
    if closed:
        say(f"kvchat: error: standard {closed} is closed; redirect it to /dev/null to discard it", console=err)
        sys.exit(2)
    sys.stdout = _CheckedOutput(sys.stdout)
    try:
        run()
    finally:
        try:  # what is still buffered fails here, as one line, not in the interpreter's shutdown
            sys.stdout.flush()
        except UserError as exc:
            say(f"kvchat: error: {error_text(exc)}", console=err)
            sys.exit(2)


def _occupy_closed_streams() -> str | None:
    """Put /dev/null on a closed stdout or stderr (`kvchat ask q >&-`): else the next file kvchat opens, the
    database included, would get that descriptor and output would be written into it. Returns "output" when
    stdout was closed (a command whose output goes nowhere is refused), else None."""
    import os

    closed = None
    for fd, name in ((1, "output"), (2, "error")):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_WRONLY)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            closed = closed or (name if fd == 1 else None)
    return closed


class _CheckedOutput:
    """sys.stdout whose failed write or flush (a full disk, an I/O error) is one UserError line (exit 2), not an
    internal error; stdout then goes to /dev/null so the interpreter's last flush does not fail again."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as exc:
            raise self._failed(exc) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            raise self._failed(exc) from None

    def __getattr__(self, name: str):
        return getattr(self._stream, name)

    def _failed(self, exc: OSError) -> UserError:
        import errno
        import os

        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, self._stream.fileno())
        os.close(null)
        full = " (disk full)" if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)) else ""
        return UserError(f"cannot write standard output: {exc.strerror or exc}{full}")


class _Terminated(SystemExit):
    """SIGTERM or SIGHUP: leave through every `finally` and context manager, then exit 128 + signal."""


def _terminate(signum: int, frame) -> None:
    signal.signal(signum, signal.SIG_IGN)  # a second one must not cut the clean-up short
    raise _Terminated(128 + signum)


def run(argv: Sequence[str] | None = None) -> None:
    """main() without the process-wide signal setup (tests call this in-process)."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    _quiet_libraries()
    with _debug_log(debug):
        _run(args, debug)


@contextlib.contextmanager
def _debug_log(enabled: bool):
    """With --debug, the `kvchat` loggers' debug records go to stderr as `kvchat: debug: ...` lines."""
    if not enabled:
        yield
        return
    logger = logging.getLogger("kvchat")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("kvchat: debug: %(message)s"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _run(args: list[str], debug: bool) -> None:
    try:
        status = app(args=args, prog_name="kvchat", standalone_mode=False)  # returns typer.Exit's code
    except _Terminated as exc:
        err.print("kvchat: terminated", markup=False)
        _say_notes(exc)
        sys.exit(exc.code)
    except UserError as exc:
        say(f"kvchat: error: {error_text(exc)}", console=err)
        sys.exit(2)
    except typer.TyperException as exc:  # click's (vendored in typer) usage errors: exit 2, usage line
        # typer types its exceptions' base bare; the usage errors caught here carry ctx and show()
        if getattr(exc, "ctx", False) is None:  # raised by the parser before it had a context
            exc.ctx = _usage_context(args)  # type: ignore[attr-defined]
        _name_the_setting(exc)
        exc.show()  # type: ignore[attr-defined]
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        status = 130
    except Exception as exc:  # an internal failure: say so, traceback only on request
        if debug:
            raise
        say(f"kvchat: internal error: {type(exc).__name__}: {error_text(exc)} (rerun with --debug for the traceback)",
            console=err)
        _say_notes(exc)
        sys.exit(1)
    if status == 130:  # typer turns Ctrl-C into Exit(130); a command says what it kept (`say_notes`)
        err.print("kvchat: interrupted", markup=False)
    if isinstance(status, int) and status:
        sys.exit(status)


def _say_notes(exc: BaseException | None) -> None:
    """What the library noted on an exception that stopped a command (an ingest's work kept for its next run); Ctrl-C,
    which typer turns into an exit status, is said by the command (`render.said_notes`)."""
    for note in getattr(exc, "__notes__", None) or ():
        err.print(f"kvchat: note: {note}", markup=False, soft_wrap=True)


def _name_the_setting(exc: typer.TyperException) -> None:
    """An option older versions had, now a saved setting without one: the usage error says how to give it."""
    from typer._click.exceptions import NoSuchOption

    from kvchat.settings_table import former_option

    if not isinstance(exc, NoSuchOption):
        return
    row = former_option(exc.option_name)
    if row is not None:
        exc.message += f" ({exc.option_name} is `--setting {row.key}=VALUE` now: docs/commands.md)"
        exc.possibilities = None


def _usage_context(args: Sequence[str]):
    """A context for the command `args` name (or the root), so a usage error shows that command's usage."""
    root = typer.main.get_command(app)
    context = root.make_context("kvchat", [], resilient_parsing=True)
    name = next((a for a in args if not a.startswith("-")), None)
    # typer types the root as a Command; kvchat's, with its many commands, is a group
    command = root.get_command(context, name) if name else None  # type: ignore[attr-defined]
    if command is None:
        return context
    return command.make_context(name, [], parent=context, resilient_parsing=True)


def _quiet_libraries() -> None:
    """transformers' load-time progress bars and advice belong in logs, not in a CLI's output."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF loader draws its own bar
