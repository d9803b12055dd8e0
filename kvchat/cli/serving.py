"""`kvchat serve`: the OpenAI-compatible server (kvchat.serve, the `serve` extra; docs/serve.md)."""

from __future__ import annotations

import logging
from typing import Annotated

import typer

from kvchat.cli.options import DeviceOpt, DtypeOpt, ThreadsOpt, Weights, open_store
from kvchat.cli.render import err, say
from kvchat.config import DeviceConfig, ServeConfig
from kvchat.errors import UserError


def serve(
    host: Annotated[str, typer.Option(
        help="Address to listen on. The API reads every stored conversation: anything but loopback wants --api-key."
    )] = ServeConfig.host,
    port: Annotated[int, typer.Option(help="Port; 0 picks a free one (the URL is printed and kept in "
                                      "$KVCHAT_HOME/serve.json while serving).")] = ServeConfig.port,
    api_key: Annotated[str | None, typer.Option(
        envvar="KVCHAT_API_KEY", show_envvar=True,
        help="Require `Authorization: Bearer KEY` on every request but /kvchat/health.")] = None,
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

    A model id names a conversation (or NAME/EPISODE). SIGTERM or Ctrl-C stops it."""
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
    store = open_store()  # a home that cannot be opened fails here, in one line
    home, log = store.home, not no_log and not store.read_only
    store.close()
    config = ServeConfig(host=host, port=port, api_key=api_key or None, max_memory=max_memory * 2**20,
                         queue_size=queue_size, max_body_bytes=max_body * 1024, max_tokens=max_tokens,
                         max_tokens_limit=max(max_tokens, ServeConfig.max_tokens_limit), threads=threads,
                         device=DeviceConfig(device, dtype), weights=weights, preload=preload, log=log,
                         replicas=replicas)
    if api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
        say(f"kvchat: warning: serving {host} without --api-key: anyone who reaches it reads every conversation",
            console=err)
    verbose = logging.getLogger("kvchat").isEnabledFor(logging.DEBUG)
    run_server(config, home=home, log_level="info" if verbose else "warning",
               on_ready=lambda url: say(f"kvchat: serving {home} at {url} (OpenAI API at {url}/v1; Ctrl-C stops)",
                                        console=err))
