"""`kvchat serve`: the OpenAI-compatible server (kvchat.serve, the `serve` extra; docs/serve.md)."""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path
from typing import Annotated

import typer
from typer._click.core import ParameterSource

from kvchat.cli.options import DeviceOpt, DtypeOpt, ModelOpt, ThreadsOpt, Weights, open_store
from kvchat.cli.render import err, say
from kvchat.config import DeviceConfig, ServeConfig
from kvchat.errors import UserError

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def serve(
    ctx: typer.Context,
    host: Annotated[str, typer.Option(
        help="Address to listen on. The API reads every stored conversation: anything but loopback wants an API key."
    )] = ServeConfig.host,
    port: Annotated[int, typer.Option(help="Port; 0 picks a free one (the URL is printed and kept in "
                                      "$KVCHAT_HOME/serve.json while serving).")] = ServeConfig.port,
    api_key: Annotated[str | None, typer.Option(
        envvar="KVCHAT_API_KEY", show_envvar=True,
        help="Require `Authorization: Bearer KEY` on every request but a bare /kvchat/health. On the command line it "
        "shows in the process list: prefer $KVCHAT_API_KEY or --api-key-file.")] = None,
    api_key_file: Annotated[Path | None, typer.Option(
        help="Read the API key from this file (its first line).", dir_okay=False)] = None,
    allowed_host: Annotated[list[str] | None, typer.Option(
        "--allowed-host", help="Also answer requests naming this host (a name the server is reached by, behind a "
        "proxy or DNS); repeatable. Other names are refused (DNS rebinding). '*' answers any.")] = None,
    model: ModelOpt = ServeConfig.model,
    history_dir: Annotated[Path | None, typer.Option(
        help="POST /kvchat/ingest may read history files from this directory (history_file, a relative path); "
        "without it, histories come inline only.", file_okay=False)] = None,
    max_memory: Annotated[int, typer.Option(help="MiB of episode caches kept resident; the least recently used "
                                            "go first.")] = ServeConfig.max_memory // 2**20,
    queue_size: Annotated[int, typer.Option(help="Requests waiting behind the one being answered; one more is "
                                            "refused with 429.")] = ServeConfig.queue_size,
    max_body: Annotated[int, typer.Option(
        help="KiB a request body may have (413 beyond).")] = ServeConfig.max_body_bytes // 1024,
    max_tokens: Annotated[int, typer.Option(
        help="Answer length when a request names none.")] = ServeConfig.max_tokens,
    threads: ThreadsOpt = None,
    weights: Annotated[Weights, typer.Option(
        help="auto, float, int8 or int4 Linear weights, for answers and ingest jobs alike (as `kvchat ask "
        "--weights`).")] = ServeConfig.weights,
    device: DeviceOpt = DeviceConfig.device,
    dtype: DtypeOpt = DeviceConfig.dtype,
    preload: Annotated[bool, typer.Option(
        help="Load the stored conversations' models and the encoder at start, not at the first question.")] = True,
    no_log: Annotated[bool, typer.Option("--no-log", help="Do not record answers in `kvchat logs`.")] = False,
    replicas: Annotated[int | None, typer.Option(
        help="Answer from N Ray Serve replicas, each holding the model; a conversation's requests all go to the "
             "replica holding its caches (needs `kvchat[replicas]`). --threads is then per replica.")] = None,
) -> None:
    """Serve the stored conversations over the OpenAI chat API, model and caches kept warm (docs/serve.md).

    A model id names a conversation (or NAME/EPISODE); --model is what HTTP ingests build with. SIGTERM or Ctrl-C
    stops it."""
    key = _api_key(ctx, api_key, api_key_file)
    for option, value, least in (("--port", port, 0), ("--max-memory", max_memory, 1), ("--queue-size", queue_size, 1),
                                 ("--max-body", max_body, 1), ("--max-tokens", max_tokens, 1),
                                 ("--replicas", replicas if replicas is not None else 1, 1)):
        if value < least:
            raise UserError(f"{option} must be >= {least} (got {value})")
    if port > 65535:
        raise UserError(f"--port must be <= 65535 (got {port})")
    try:
        from kvchat.serve.server import serve as run_server
    except ImportError as exc:
        raise UserError(f"kvchat serve needs the serve extra ({exc.name} is missing): pip install 'kvchat[serve]'") \
            from None
    if model != ServeConfig.model and not Path(model).exists():
        raise UserError(f"--model {model}: no such model directory or file")
    if history_dir is not None and not history_dir.is_dir():
        raise UserError(f"--history-dir {history_dir}: no such directory")
    store = open_store()  # a home that cannot be opened fails here, in one line
    home, log = store.home, not no_log and not store.read_only
    store.close()
    config = ServeConfig(host=host, port=port, api_key=key, allowed_hosts=tuple(allowed_host or ()),
                         model=str(Path(model).absolute()) if model != ServeConfig.model else model,
                         history_dir=None if history_dir is None else str(history_dir.absolute()),
                         max_memory=max_memory * 2**20,
                         queue_size=queue_size, max_body_bytes=max_body * 1024, max_tokens=max_tokens,
                         max_tokens_limit=max(max_tokens, ServeConfig.max_tokens_limit), threads=threads,
                         device=DeviceConfig(device, dtype), weights=weights, preload=preload, log=log,
                         replicas=replicas)
    if key is None and host not in LOOPBACK:
        say(f"kvchat: warning: serving {host} without an API key: anyone who reaches it reads every conversation",
            console=err)
    if hasattr(signal, "SIGPIPE"):  # main() makes a closed pipe end a command; a client that hangs up must not
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # end the server (uvicorn handles EPIPE itself)
    _log_requests()
    verbose = logging.getLogger("kvchat").isEnabledFor(logging.DEBUG)
    run_server(config, home=home, log_level="info" if verbose else "warning",
               on_ready=lambda url: say(f"kvchat: serving {home} at {url} (OpenAI API at {url}/v1; Ctrl-C stops)",
                                        console=err))


def _api_key(ctx: typer.Context, given: str | None, path: Path | None) -> str | None:
    """The key from --api-key-file, $KVCHAT_API_KEY or --api-key (warned: argv shows in the process list). An empty
    or blank key is refused: it would have turned authentication off without a word."""
    if path is not None and given is not None:
        raise UserError("--api-key-file and --api-key (or $KVCHAT_API_KEY) both give the key: keep one")
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.read(4096).splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"--api-key-file {path}: cannot be read ({getattr(exc, 'strerror', None) or exc})") \
                from None
        given = lines[0] if lines else ""
    if given is None:
        return None
    where = "--api-key-file" if path is not None else "--api-key or $KVCHAT_API_KEY"
    if not given.strip():
        raise UserError(f"the API key ({where}) is empty: give a key, or none to serve loopback without one")
    if not given.isascii() or not given.isprintable() or " " in given:
        raise UserError(f"the API key ({where}) must be printable ASCII without spaces (it travels in a header)")
    if path is None and ctx.get_parameter_source("api_key") == ParameterSource.COMMANDLINE:
        say("kvchat: warning: --api-key on the command line shows in the process list; use $KVCHAT_API_KEY or "
            "--api-key-file", console=err)
    return given


def _log_requests() -> None:
    """One line on stderr per request answered (kvchat.serve.guards.RequestLog), for the server's operator."""
    logger = logging.getLogger("kvchat.serve.requests")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("kvchat serve: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
