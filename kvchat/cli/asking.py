"""`kvchat ask`: one question, stdin lines, or the REPL."""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
from typing import Annotated, Any

import typer
from rich.text import Text

from kvchat import documents
from kvchat.cli.options import (
    DeviceOpt,
    DtypeOpt,
    ThreadsOpt,
    Weights,
    complete_conversation,
    load_encoder,
    load_model,
    open_store,
)
from kvchat.cli.render import counted, emit_json, episode_lines, err, out, say
from kvchat.cli.terminal import StreamCleaner, clean
from kvchat.cli.words import error_text, spell
from kvchat.config import AskConfig, DeviceConfig
from kvchat.errors import UserError


def ask(
    question: Annotated[str | None, typer.Argument(
        metavar="QUESTION",
        help="The question. Omit it to read one question per line from stdin, or on a terminal for a REPL.")] = None,
    conversation: Annotated[str | None, typer.Option(
        help="Conversation name (default: the one `kvchat use` chose, else the latest).",
        autocompletion=complete_conversation)] = None,
    episode: Annotated[int | None, typer.Option(help="Use this episode's cache instead of routing.")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Longest answer in tokens.")] = AskConfig.max_new_tokens,
    retrieve: Annotated[int | None, typer.Option(
        help="Conversations ingested with --offload: entries per layer and KV head read from the pages (R; "
        "default: the conversation's).")] = None,
    threads: ThreadsOpt = None,
    weights: Annotated[Weights, typer.Option(
        help="auto: int4 on a CPU where the decoder's weights already are 4-bit groups (the embedded model's are), "
        "else float; float: as loaded; int8: the Linear weights as int8 (per channel); int4: the decoder's in 4-bit "
        "groups of 32, the lm_head as int8. int8 and int4 answer several times faster on a CPU, at a small cost in "
        "fidelity (docs/benchmarks.md).")] = AskConfig.weights,
    device: DeviceOpt = DeviceConfig.device,
    dtype: DtypeOpt = DeviceConfig.dtype,
    no_log: Annotated[bool, typer.Option("--no-log", help="Do not record this question in `kvchat logs`.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per question (JSON Lines).")] = False,
    sources: Annotated[bool, typer.Option("--sources", help="After the answer, the turns it drew on most (by its "
        "attention), with speaker, time, a quote, their share and how much of each the cache keeps.")] = False,
    refuse_off_topic: Annotated[bool, typer.Option("--refuse-off-topic", help="Do not answer a question no episode "
        "matches well (a line on stderr; exit 3 when any question was refused).")] = False,
    server: Annotated[str | None, typer.Option(
        envvar="KVCHAT_SERVER", help="Ask the `kvchat serve` at this URL. Default: the server running on this "
        "$KVCHAT_HOME, if any, unless --local or an option only this process honours is given (--retrieve, "
        "--weights, --threads, --device, --dtype, --no-log).")] = None,
    local: Annotated[bool, typer.Option("--local", help="Answer in this process even when a server runs.")] = False,
    api_key: Annotated[str | None, typer.Option(envvar="KVCHAT_API_KEY", help="The server's API key.")] = None,
) -> None:
    """Answer a question from the nearest episode's cache (one-shot, stdin lines, or a REPL), in this process or
    through a running `kvchat serve`.

    Every question and answer is recorded in the store (`kvchat logs` shows them) unless --no-log."""
    if question is not None and not question.strip():
        raise UserError("the question is empty")
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1 (got {max_new_tokens})")
    if question is None and (sys.stdin is None or sys.stdin.closed):
        raise UserError("no question: give one as an argument, or one per line on stdin")
    if retrieve is not None and retrieve < 0:
        raise UserError(f"--retrieve must be >= 0 (got {retrieve})")
    given = {"--retrieve": retrieve is not None, "--weights": weights != AskConfig.weights,
             "--threads": threads is not None, "--device": device != DeviceConfig.device,
             "--dtype": dtype != DeviceConfig.dtype, "--no-log": no_log}
    own = [option for option, set_ in given.items() if set_]  # what only this process honours
    if server is not None and (local or own):
        raise UserError(f"--server answers with the server's own settings: drop {', '.join(own) or '--local'}")
    asker: _RemoteAsker | _Asker | None = (
        _remote_asker(server, conversation, max_new_tokens, api_key, refuse_off_topic) if not (local or own) else None
    )
    if asker is None:
        store = open_store()
        if store.read_only and not no_log:
            say(f"kvchat: note: {store.home} is read-only ({store.read_only_reason}); questions are not logged",
                console=err)
        config = AskConfig(max_new_tokens, retrieve=retrieve, weights=weights, refuse_off_topic=refuse_off_topic)
        asker = _Asker(store, conversation, config, log=not no_log and not store.read_only, threads=threads,
                       device=DeviceConfig(device, dtype))
    asker.sources = sources
    if question is not None:
        asker.answer(question, episode, as_json=as_json)
    elif sys.stdin.isatty() and out.is_terminal and not as_json:
        from kvchat.cli.repl import Repl, prompt_reader

        if episode is not None:
            asker.check_episode(episode)
        say((asker.name, "bold"), f": {counted(asker.episode_count(), 'episode')}. /help for help; exit, quit or "
            "Ctrl-D ends.", console=err)
        repl = Repl(prompt_reader(asker.history_file), asker, lambda m: say(m, console=err))
        repl.episode = episode
        repl.run()
    else:
        _answer_lines(asker, sys.stdin, episode, as_json)
    if asker.refused:
        raise typer.Exit(3)


def _answer_lines(asker, lines, episode: int | None, as_json: bool) -> None:
    """One question per line; a question refused (too long, say) is reported with its line number and the others
    go on; exit status 2 at the end when any was refused."""
    failed = asked = 0
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        asked += 1
        try:
            asker.answer(line, episode, as_json=as_json)
        except UserError as exc:
            failed += 1
            say(f"kvchat: error: line {number}: {error_text(exc)}", console=err)
    if failed:
        raise UserError(f"{failed} of {asked} questions failed (each reported above)")


class _Asker:
    """The session `ask` answers from, and how an answer reaches the terminal (the REPL's Actions)."""

    sources = False  # --sources (the REPL's /sources)
    refused = 0      # questions refused as off-topic (--refuse-off-topic)

    def __init__(self, store, conversation: str | None, config: AskConfig, *, log: bool, threads: int | None,
                 device: DeviceConfig = DeviceConfig()) -> None:
        self.store, self.config, self.log = store, config, log
        record = store.get(conversation) if conversation else store.default()  # an unknown name: before torch loads
        from kvchat.answer.session import Session

        self.threads, self.device = threads, device
        lm = load_model(record.model, store, threads=threads, device=device, weights=config.weights)
        self.session = Session(store, record, lm, load_encoder(), config)

    @property
    def name(self) -> str:
        return self.session.conversation.name

    @property
    def history_file(self):
        return None if self.store.read_only else self.store.home / "repl-history"

    def episode_count(self) -> int:
        return len(self.session.conversation.episodes)

    def check_episode(self, episode: int) -> None:
        _check_episode(episode, self.name, self.episode_count())

    def switch(self, name: str) -> int:
        from kvchat.answer.session import Session

        record = self.store.get(name)
        same = record.model == self.session.lm.spec
        lm = self.session.lm if same else load_model(record.model, self.store, threads=self.threads, device=self.device,
                                                     weights=self.config.weights)
        self.session = Session(self.store, record, lm, self.session.encoder, self.config)
        return self.episode_count()

    def episodes(self) -> list[str]:
        return episode_lines(self.session.conversation)

    def settings(self) -> dict[str, object]:
        return dataclasses.asdict(self.session.config)

    def configure(self, field: str, value: int) -> None:
        changes: dict[str, Any] = {field: value}  # one of AskConfig's whole-number fields (the REPL's /set)
        self.config = dataclasses.replace(self.config, **changes)
        self.session.config = self.config

    def answer(self, question: str, episode: int | None, earlier: tuple[tuple[str, str], ...] = (), *,
               as_json: bool = False) -> str:
        """Stream the answer to stdout (cleaned of escape sequences); on a terminal, Ctrl-C stops it."""
        question = question.strip()
        if as_json:
            result = self.session.ask(question, episode=episode, log=self.log, earlier=earlier, **self._receipts())
            self._off_topic(result)
            emit_json(documents.answer(question, result))
            return result.text
        answered = []

        def run(write, stopping) -> dict:
            result = self.session.ask(question, episode=episode, on_text=write, log=self.log, stop=stopping,
                                      earlier=earlier, **self._receipts())
            answered.append(result)
            return {"finish_reason": result.finish_reason, "conversation": result.conversation,
                    "episode": result.episode, "similarity": result.similarity, "reused_cache": result.reused_cache}

        _print_streamed(run, self.config.max_new_tokens)
        result = answered[-1]
        self._off_topic(result)
        if self.sources and result.finish_reason != "refused":
            show_sources(None if result.sources is None else [s.to_dict() for s in result.sources],
                         result.sources_note, result.episode)
        return result.text

    def _receipts(self) -> dict:
        return {"sources": True} if self.sources else {}

    def _off_topic(self, result) -> None:
        """The line that says no episode matched well, and the count of refusals."""
        if result.off_topic:
            self.refused += say_off_topic(result.finish_reason, result.similarity, self.config.off_topic_similarity)


def say_off_topic(finish_reason: str, similarity: float, limit: float | None) -> int:
    """The line under an answer to a question no episode matches well (`limit`: the threshold, where known);
    1 when the question was refused, else 0."""
    under = f"similarity {similarity:.2f}" + (f" < {limit:.2f}" if limit is not None else ", under the threshold")
    if finish_reason == "refused":
        say(f"kvchat: not answered: no episode matches this question ({under}; --refuse-off-topic)", console=err)
        return 1
    say(f"kvchat: note: no episode matches this question well ({under}): the answer may not come from the "
        "conversation", console=err)
    return 0


class _RemoteAsker:
    """`ask` through a running `kvchat serve` (kvchat.serve.client): the same output, and the REPL's Actions."""

    sources = False  # --sources, the REPL's /sources
    refused = 0      # questions the server refused as off-topic (--refuse-off-topic)

    def __init__(self, client, conversation: str | None, max_new_tokens: int, refuse_off_topic: bool = False) -> None:
        from kvchat.serve.client import default_of

        self.client, self.max_new_tokens, self.refuse_off_topic = client, max_new_tokens, refuse_off_topic
        listed = client.conversations()
        self._episodes = {c["name"]: c["episode_count"] for c in listed}
        if not self._episodes:
            raise UserError(f"no conversations yet on the server at {client.url}; run `kvchat ingest HISTORY` first")
        self.name = conversation or default_of(listed)
        self.switch(self.name)

    @property
    def history_file(self):
        from kvchat.config import default_home

        home = default_home()
        return home / "repl-history" if os.access(home, os.W_OK) else None

    def episode_count(self) -> int:
        return self._episodes[self.name]

    def check_episode(self, episode: int) -> None:
        _check_episode(episode, self.name, self.episode_count())

    def switch(self, name: str) -> int:
        if name not in self._episodes:
            self._episodes = {c["name"]: c["episode_count"] for c in self.client.conversations()}
        if name not in self._episodes:
            raise UserError(f"unknown conversation {name!r} on the server at {self.client.url}")
        self.name = name
        return self.episode_count()

    def episodes(self) -> list[str]:
        return [f"{self.name}: {counted(self.episode_count(), 'episode')} (their topics: kvchat show {self.name})"]

    def settings(self) -> dict[str, object]:
        return {"max_new_tokens": self.max_new_tokens, "retrieve": "(the server's)"}

    def configure(self, field: str, value: int) -> None:
        if field != "max_new_tokens":
            raise UserError(f"the server answers with its own {field.replace('_', '-')}; /set it with --local")
        self.max_new_tokens = value

    def answer(self, question: str, episode: int | None, earlier: tuple[tuple[str, str], ...] = (), *,
               as_json: bool = False) -> str:
        question = question.strip()
        options = {"episode": episode, "max_tokens": self.max_new_tokens, "sources": self.sources,
                   "refuse_off_topic": self.refuse_off_topic}
        if as_json:
            document = self.client.ask(self.name, question, **options)
            emit_json(document)
            self._off_topic(document)
            return document.get("answer", "")
        answered = []

        def run(write, stopping) -> dict:
            answered.append(self.client.ask(self.name, question, on_text=write, stop=stopping, earlier=earlier,
                                            **options))
            return answered[-1]

        _print_streamed(run, self.max_new_tokens)
        document = answered[-1]
        self._off_topic(document)
        if self.sources and document.get("finish_reason") != "refused" and "sources" in document:
            show_sources(document["sources"], document.get("sources_note"), document.get("episode"))
        return document.get("answer", "")

    def _off_topic(self, document: dict) -> None:
        if document.get("off_topic"):
            self.refused += say_off_topic(document.get("finish_reason", ""), document.get("similarity", 0.0), None)


def _remote_asker(url: str | None, conversation: str | None, max_new_tokens: int,
                  api_key: str | None, refuse_off_topic: bool = False) -> _RemoteAsker | None:
    """An asker through the server at `url`, else through the one announced in $KVCHAT_HOME (None when none
    runs, or it does not answer: then this process answers)."""
    from kvchat.config import default_home
    from kvchat.serve.announcement import announced_url
    from kvchat.serve.client import Client, Unreachable

    if url is not None:
        return _RemoteAsker(Client(url, api_key=api_key), conversation, max_new_tokens, refuse_off_topic)
    found = announced_url(default_home())
    if found is None:
        return None
    try:
        return _RemoteAsker(Client(found, api_key=api_key), conversation, max_new_tokens, refuse_off_topic)
    except Unreachable:
        return None


def _check_episode(episode: int, name: str, count: int) -> None:
    if not 0 <= episode < count:
        raise UserError(f"--episode {episode} does not exist (conversation '{name}' has episodes 0..{count - 1})")


def _print_streamed(run, max_new_tokens: int) -> str | None:
    """Stream an answer to stdout (cleaned of escape sequences); on a terminal, Ctrl-C stops it. `run(write,
    stopping)` answers, giving text to `write` and asking `stopping()` between tokens; it returns the answer's
    finish_reason, episode, similarity, answer and (where known) reused_cache. Returns the answer's text (None when
    it was refused)."""
    cleaner = StreamCleaner()

    def write(text: str) -> None:
        sys.stdout.write(cleaner.feed(text))
        sys.stdout.flush()

    with _ctrl_c_stops() as stopping:
        result = run(write, stopping)
    if result["finish_reason"] == "refused":  # nothing was said: no empty answer line
        return None
    sys.stdout.write(cleaner.flush() + "\n")
    sys.stdout.flush()
    if result["finish_reason"] == "length":
        say(f"[answer cut at --max-new-tokens {max_new_tokens}]", console=err)
    elif result["finish_reason"] == "stopped":
        say("[stopped]", console=err)
    if sys.stdin is not None and sys.stdin.isatty() and err.is_terminal and result.get("episode") is not None:
        err.print(Text(clean(footer(result), one_line=True), style="dim"))
    return result.get("answer", "")


def footer(result: dict) -> str:
    """The line under an answer on a terminal: the conversation and episode it came from, and how similar the
    question was to that episode."""
    reuse = ", resident" if result.get("reused_cache") else ""
    where = f"{result.get('conversation') or '?'}, episode {result['episode']}"
    return f"{where} (similarity {result['similarity']:.2f}{reuse})"


class _ctrl_c_stops:
    """While an answer streams on a terminal, a first Ctrl-C asks it to stop (the answer ends after the
    current token and the session stays); a second one interrupts at once."""

    def __enter__(self):
        self.requested = False
        self.previous = None
        if sys.stdin is not None and sys.stdin.isatty() and _main_thread():
            self.previous = signal.signal(signal.SIGINT, self._handle)
        return lambda: self.requested

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def show_sources(sources: list[dict] | None, note: str | None, episode: int | None) -> None:
    """An answer's sources under it (`--sources`, the REPL's /sources; as in `ask --json`), or the line saying why
    there are none."""
    if sources is None:
        say(f"kvchat: {spell(note or '')}", console=err)
        return
    say((f"sources (episode {episode}):", "bold"))
    for n, s in enumerate(sources, start=1):
        who = ", ".join(part for part in (s["speaker"], s["time"]) if part)
        held = f"{s['kept_tokens']}/{s['tokens']} tokens kept"
        if s.get("recalled"):  # a server before recalled turns were sources leaves it out
            held = "recalled, " + (held if s["kept_tokens"] else f"{s['tokens']} tokens, not in the cache")
        say(f"  {n}. turn {s['turn']} {who}: \u201c{s['quote']}\u201d ",
            (f"{s['attention_share']:.0%} of attention, {held}", "dim"))
