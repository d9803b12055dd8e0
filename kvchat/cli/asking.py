"""`kvchat ask`: one question, stdin lines, or the REPL."""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
from dataclasses import dataclass
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
from kvchat.config import AskConfig, DeviceConfig, Sampling
from kvchat.errors import UserError
from kvchat.untrusted_text import valid_text


def ask(
    question: Annotated[str | None, typer.Argument(
        metavar="QUESTION",
        help="The question. Omit it to read one question per line from stdin (an answer per line, docs/scripting.md), "
        "or on a terminal for a REPL.")] = None,
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
    follow_up: Annotated[bool, typer.Option("--continue", "-c", help="Follow up the last question asked about the "
        "conversation (its question and answer from `kvchat logs`; without --conversation, the conversation it "
        "was about).")] = False,
    system: Annotated[str | None, typer.Option(help="Your own instructions for the answer (\"Answer in French.\"), "
        "given before the question.")] = None,
    temperature: Annotated[float, typer.Option(help="0 answers greedily (the same answer every time); above 0 "
        "samples, more varied as it grows (at most 2).")] = Sampling.temperature,
    top_p: Annotated[float, typer.Option(help="When sampling, draw from the likeliest tokens holding this share of "
        "the probability.")] = Sampling.top_p,
    seed: Annotated[int | None, typer.Option(help="When sampling, the seed: the same seed gives the same answer "
        "(default: a new one each answer).")] = None,
    repetition_penalty: Annotated[float, typer.Option(help="Divides the scores of tokens the answer already holds "
        "(1: off), so answers do not loop.")] = Sampling.repetition_penalty,
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
    question = None if question is None else valid_text(question)  # bytes that are not UTF-8: U+FFFD
    if question is None and hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="replace")  # so are stdin's, line by line, rather than an internal error
    if question is not None and not question.strip():
        raise UserError("the question is empty")
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1 (got {max_new_tokens})")
    if question is None and (sys.stdin is None or sys.stdin.closed):
        raise UserError("no question: give one as an argument, or one per line on stdin")
    if retrieve is not None and retrieve < 0:
        raise UserError(f"--retrieve must be >= 0 (got {retrieve})")
    if follow_up and question is None:
        raise UserError("--continue follows up one question: give it as an argument")
    sampling = Sampling(temperature=temperature, top_p=top_p, seed=seed, repetition_penalty=repetition_penalty)
    answering = _Answering(max_new_tokens, sampling, system or None)
    given = {"--retrieve": retrieve is not None, "--weights": weights != AskConfig.weights,
             "--threads": threads is not None, "--device": device != DeviceConfig.device,
             "--dtype": dtype != DeviceConfig.dtype, "--no-log": no_log}
    own = [option for option, set_ in given.items() if set_]  # what only this process honours
    if server is not None and (local or own):
        raise UserError(f"--server answers with the server's own settings: drop {', '.join(own) or '--local'}")
    if own and not local:
        _say_answering_here(own)
    earlier: tuple[tuple[str, str], ...] = ()
    if follow_up:
        conversation, earlier = _last_exchange(conversation)
    asker: _RemoteAsker | _Asker | None = (
        _remote_asker(server, conversation, answering, api_key, refuse_off_topic) if not (local or own) else None
    )
    if asker is None:
        store = open_store()
        if store.read_only and not no_log:
            say(f"kvchat: note: {store.home} is read-only ({store.read_only_reason}); questions are not logged",
                console=err)
        config = AskConfig(max_new_tokens, retrieve=retrieve, weights=weights, refuse_off_topic=refuse_off_topic,
                           sampling=sampling, system=answering.system)  # fmt: skip
        asker = _Asker(store, conversation, config, log=not no_log and not store.read_only, threads=threads,
                       device=DeviceConfig(device, dtype), episode=episode)
    asker.sources = sources
    if question is not None:
        asker.answer(question, episode, earlier, as_json=as_json)
    elif sys.stdin.isatty() and out.is_terminal and not as_json:
        from kvchat.cli.repl import Repl, prompt_reader

        if episode is not None:
            asker.check_episode(episode)
        say((asker.name, "bold"), f": {counted(asker.episode_count(), 'episode')}. /help for help; exit, quit or "
            "Ctrl-D ends.", console=err)
        asker.stoppable = True  # a first Ctrl-C stops the answer and keeps the session
        repl = Repl(prompt_reader(asker.history_file), asker, lambda m: say(m, console=err))
        repl.episode = episode
        repl.run()
    else:
        _answer_lines(asker, sys.stdin, episode, as_json)
    if asker.refused:
        raise typer.Exit(3)


NO_ANSWER = "[no answer]"  # a batch's output line for a question not answered (the reason: stderr, `line N:`)


def _answer_lines(asker, lines, episode: int | None, as_json: bool) -> None:
    """One question per line. As text, line N of the output answers line N of the input: each answer on one line
    (`escaped_line`), a blank line for a blank one, NO_ANSWER for a question refused (too long, say; its line number
    and reason on stderr) while the others go on; exit status 2 at the end when any was refused. As JSON, one
    object per question (blank lines asked nothing)."""
    failed = asked = 0
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            if not as_json:
                _write_line("")
            continue
        asked += 1
        try:
            if as_json:
                asker.answer(line, episode, as_json=True)
            else:
                asker.answer(line, episode, line=number)
        except UserError as exc:
            failed += 1
            if not as_json:
                _write_line(NO_ANSWER)
            say(f"kvchat: error: line {number}: {error_text(exc)}", console=err)
    if failed:
        raise UserError(f"{failed} of {asked} questions failed (each reported above)")


def escaped_line(text: str) -> str:
    """An answer as one line of a batch's output: its backslashes doubled, its newlines written `\\n`, so
    that a script can read it back (as a C or Python string literal's escapes)."""
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _write_line(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _last_exchange(conversation: str | None) -> tuple[str, tuple[tuple[str, str]]]:
    """For --continue: the conversation the last question logged was about (or `conversation`'s last one), and
    that question and its answer."""
    store = open_store()
    try:
        last = store.asks(1, conversation)
    finally:
        store.close()
    if not last or not last[0]["answer"]:
        about = f" about conversation '{conversation}'" if conversation else ""
        raise UserError(f"--continue: no answered question{about} in `kvchat logs` to follow up (questions asked with "
                        "--no-log are not kept)")
    return last[0]["conversation"], ((last[0]["question"], last[0]["answer"]),)


@dataclass(frozen=True)
class _Answering:
    """What a remote asker sends with each question: the answer's length, sampling and instructions."""

    max_new_tokens: int
    sampling: Sampling = Sampling()
    system: str | None = None


class _Asker:
    """The session `ask` answers from, and how an answer reaches the terminal (the REPL's Actions)."""

    sources = False  # --sources (the REPL's /sources)
    refused = 0      # questions refused as off-topic (--refuse-off-topic)
    stoppable = False  # the REPL: a first Ctrl-C stops the answer (elsewhere it interrupts kvchat, exit 130)

    def __init__(self, store, conversation: str | None, config: AskConfig, *, log: bool, threads: int | None,
                 device: DeviceConfig = DeviceConfig(), episode: int | None = None) -> None:
        self.store, self.config, self.log = store, config, log
        record = store.get(conversation) if conversation else store.default()  # an unknown name: before torch loads
        if episode is not None:  # so is an episode it does not have
            _check_episode(episode, record.name, len(record.episodes))
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
        return _flat(self.session.config)

    def configure(self, field: str, value: object) -> None:
        self.config = _configured(self.config, field, value)
        self.session.config = self.config

    def answer(self, question: str, episode: int | None, earlier: tuple[tuple[str, str], ...] = (), *,
               as_json: bool = False, line: int | None = None) -> str:
        """Stream the answer to stdout (cleaned of escape sequences); in the REPL, Ctrl-C stops it. `line`: the
        question is line `line` of a batch, answered on one line (`_print_streamed`)."""
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

        _print_streamed(run, self.config.max_new_tokens, line=line, stoppable=self.stoppable)
        result = answered[-1]
        self._off_topic(result, line)
        if self.sources and result.finish_reason != "refused":
            show_sources(None if result.sources is None else [s.to_dict() for s in result.sources],
                         result.sources_note, result.episode, line=line)
        return result.text

    def _receipts(self) -> dict:
        return {"sources": True} if self.sources else {}

    def _off_topic(self, result, line: int | None = None) -> None:
        """The line that says no episode matched well, and the count of refusals."""
        if result.off_topic:
            self.refused += say_off_topic(result.finish_reason, result.similarity, self.config.off_topic_similarity,
                                          line)


def _flat(config) -> dict[str, object]:
    """`config`'s fields as the REPL's /set names them: sampling's as `sampling.NAME`."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "sampling"}
    return fields | {f"sampling.{name}": value for name, value in dataclasses.asdict(config.sampling).items()}


def _configured(config: Any, field: str, value: object) -> Any:
    """`config` with `field` (a /set name's field: `sampling.NAME` for sampling's) set to `value`."""
    if field.startswith("sampling."):
        changes: dict[str, Any] = {field.removeprefix("sampling."): value}
        return dataclasses.replace(config, sampling=dataclasses.replace(config.sampling, **changes))
    return dataclasses.replace(config, **{field: value})


def say_off_topic(finish_reason: str, similarity: float, limit: float | None, line: int | None = None) -> int:
    """The line under an answer to a question no episode matches well (`limit`: the threshold, where known; `line`:
    the question's line in a batch); 1 when the question was refused, else 0."""
    under = f"similarity {similarity:.2f}" + (f" < {limit:.2f}" if limit is not None else ", under the threshold")
    where = "" if line is None else f"line {line}: "
    if finish_reason == "refused":
        say(f"kvchat: {where}not answered: no episode matches this question ({under}; --refuse-off-topic)",
            console=err)
        return 1
    say(f"kvchat: {where}note: no episode matches this question well ({under}): the answer may not come from the "
        "conversation", console=err)
    return 0


class _RemoteAsker:
    """`ask` through a running `kvchat serve` (kvchat.serve.client): the same output, and the REPL's Actions."""

    sources = False  # --sources, the REPL's /sources
    refused = 0      # questions the server refused as off-topic (--refuse-off-topic)
    stoppable = False  # the REPL: a first Ctrl-C stops the answer

    def __init__(self, client, conversation: str | None, answering: _Answering, refuse_off_topic: bool = False) -> None:
        from kvchat.serve.client import default_of

        self.client, self.answering, self.refuse_off_topic = client, answering, refuse_off_topic
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
        return _flat(self.answering) | {"retrieve": "(the server's)"}

    def configure(self, field: str, value: object) -> None:
        if field not in _flat(self.answering):
            raise UserError(f"the server answers with its own {field.replace('_', '-')}; /set it with --local")
        self.answering = _configured(self.answering, field, value)

    @property
    def max_new_tokens(self) -> int:
        return self.answering.max_new_tokens

    def answer(self, question: str, episode: int | None, earlier: tuple[tuple[str, str], ...] = (), *,
               as_json: bool = False, line: int | None = None) -> str:
        question = question.strip()
        a = self.answering
        options = {"episode": episode, "max_tokens": a.max_new_tokens, "sources": self.sources,
                   "refuse_off_topic": self.refuse_off_topic, "earlier": earlier, "system": a.system,
                   "sampling": _sampling_fields(a.sampling)}
        if as_json:
            document = self.client.ask(self.name, question, **options)
            emit_json(document)
            self._off_topic(document)
            return document.get("answer", "")
        answered = []

        def run(write, stopping) -> dict:
            answered.append(self.client.ask(self.name, question, on_text=write, stop=stopping, **options))
            return answered[-1]

        _print_streamed(run, self.max_new_tokens, line=line, stoppable=self.stoppable)
        document = answered[-1]
        self._off_topic(document, line)
        if self.sources and document.get("finish_reason") != "refused" and "sources" in document:
            show_sources(document["sources"], document.get("sources_note"), document.get("episode"), line=line)
        return document.get("answer", "")

    def _off_topic(self, document: dict, line: int | None = None) -> None:
        if document.get("off_topic"):
            self.refused += say_off_topic(document.get("finish_reason", ""), document.get("similarity", 0.0), None,
                                          line)


def _sampling_fields(sampling: Sampling) -> dict[str, object]:
    """The request fields that ask a server for `sampling` (those that differ from its defaults)."""
    return {name: value for name, value in dataclasses.asdict(sampling).items()
            if value != getattr(Sampling, name)}  # fmt: skip


def _remote_asker(url: str | None, conversation: str | None, answering: _Answering,
                  api_key: str | None, refuse_off_topic: bool = False) -> _RemoteAsker | None:
    """An asker through the server at `url`, else through the one announced in $KVCHAT_HOME (None when none
    runs, or it does not answer: then this process answers)."""
    from kvchat.config import default_home
    from kvchat.serve.announcement import announced_url
    from kvchat.serve.client import Client, Unreachable

    if url is not None:
        return _RemoteAsker(Client(url, api_key=api_key), conversation, answering, refuse_off_topic)
    found = announced_url(default_home())
    if found is None:
        return None
    try:
        return _RemoteAsker(Client(found, api_key=api_key), conversation, answering, refuse_off_topic)
    except Unreachable:
        return None


def _say_answering_here(own: list[str]) -> None:
    """One line when a server runs on this home but an option only this process honours keeps the question here."""
    from kvchat.config import default_home
    from kvchat.serve.announcement import announced_url

    url = announced_url(default_home())
    if url is not None:
        say(f"kvchat: note: answering in this process, not through the server at {url} ({', '.join(own)} "
            f"{'is' if len(own) == 1 else 'are'} honoured only here)", console=err)


def _check_episode(episode: int, name: str, count: int) -> None:
    if not 0 <= episode < count:
        raise UserError(f"--episode {episode} does not exist (conversation '{name}' has episodes 0..{count - 1})")


def _print_streamed(run, max_new_tokens: int, *, line: int | None = None, stoppable: bool = False) -> str | None:
    """Stream an answer to stdout (cleaned of escape sequences). `run(write, stopping)` answers, giving text to
    `write` and asking `stopping()` between tokens; it returns the answer's finish_reason, episode, similarity,
    answer and (where known) reused_cache. Returns the answer's text (None when it was refused).

    `line`: the question is line `line` of a batch, whose output holds one line per question: the answer is written
    whole, on one line (`escaped_line`), or NO_ANSWER when it was refused; what is said beside it names the line.
    `stoppable` (the REPL): a first Ctrl-C on a terminal stops the answer and the session goes on; elsewhere Ctrl-C
    interrupts kvchat (exit 130)."""
    cleaner = StreamCleaner()
    pieces: list[str] = []

    def write(text: str) -> None:
        if line is not None:
            pieces.append(cleaner.feed(text))
            return
        sys.stdout.write(cleaner.feed(text))
        sys.stdout.flush()

    with _ctrl_c_stops(stoppable) as stopping:
        result = run(write, stopping)
    if result["finish_reason"] == "refused":  # nothing was said: no empty answer line
        if line is not None:
            _write_line(NO_ANSWER)
        return None
    if line is not None:
        _write_line(escaped_line("".join(pieces) + cleaner.flush()))
    else:
        _write_line(cleaner.flush())
    where = "" if line is None else f"line {line}: "
    if result["finish_reason"] == "length":
        say(f"{where}[answer cut at --max-new-tokens {max_new_tokens}]", console=err)
    elif result["finish_reason"] == "stopped":
        say(f"{where}[stopped]", console=err)
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
    """While an answer of the REPL (`stoppable`) streams on a terminal, a first Ctrl-C asks it to stop (the answer
    ends after the current token and the session stays); a second one interrupts at once."""

    def __init__(self, stoppable: bool = True) -> None:
        self.stoppable = stoppable

    def __enter__(self):
        self.requested = False
        self.previous = None
        if self.stoppable and sys.stdin is not None and sys.stdin.isatty() and _main_thread():
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


def show_sources(sources: list[dict] | None, note: str | None, episode: int | None, *,
                 line: int | None = None) -> None:
    """An answer's sources under it (`--sources`, the REPL's /sources; as in `ask --json`), or the line saying why
    there are none. `line`: the answer is line `line` of a batch's output, so they go to stderr, named by it."""
    where = "" if line is None else f"line {line}: "
    if sources is None:
        say(f"kvchat: {where}{spell(note or '')}", console=err)
        return
    console = err if line is not None else out
    say((f"{where}sources (episode {episode}):", "bold"), console=console)
    for n, s in enumerate(sources, start=1):
        who = ", ".join(part for part in (s["speaker"], s["time"]) if part)
        held = f"{s['kept_tokens']}/{s['tokens']} tokens kept"
        if s.get("recalled"):  # a server before recalled turns were sources leaves it out
            held = "recalled, " + (held if s["kept_tokens"] else f"{s['tokens']} tokens, not in the cache")
        turn = f"turn {s['turn']}" + (f" ({s['turn_id']})" if s.get("turn_id") else "")  # "Trip to Japan, turn 3"
        say(f"  {n}. {turn} {who}: \u201c{s['quote']}\u201d ",
            (f"{s['attention_share']:.0%} of attention, {held}", "dim"), console=console)
