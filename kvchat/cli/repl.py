"""`kvchat ask` on a terminal: a REPL in the manner of `llm chat` and `ollama run`.

The loop (`Repl.run`) knows nothing of terminals: it reads lines through a function, answers through an
`Actions` object and speaks through another function, so its logic is tested without a terminal.
`prompt_reader` gives it line editing and a persistent history (prompt_toolkit); Ctrl-C while an
answer streams stops that answer and keeps the session (the CLI turns it into `stop` for `Session.ask`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from pathlib import Path
from typing import Final, Literal, Protocol

from kvchat.cli.words import error_text
from kvchat.errors import UserError

HELP = """\
Type a question and press Enter. A pasted multi-line question stays one question.
A question follows up the previous one: its question and answer stay on top of the episode until /clear.
  !multi ... !end       a question over several lines (or start and end it with \"\"\")
  /episodes             the episodes, with their topics and sizes
  /episode N            answer from episode N's cache; /episode auto routes again
  /conversation NAME    switch to another stored conversation
  /set NAME VALUE       max-new-tokens N (longest answer), retrieve R, temperature T (0: greedy), top-p P,
                        seed S (or off), repetition-penalty X (1: off), system TEXT (or off: your
                        instructions for every answer); /set alone shows them
  /sources [on|off]     show the turns each answer drew on (toggles without an argument)
  /clear, clear         forget the previous question and answer
  /help, /?, help       this help
  exit, quit, Ctrl-D    leave
Ctrl-C stops an answer (the session stays); at the prompt it clears the line."""

# What `/set` changes: the REPL's name -> (the AskConfig field, sampling's as `sampling.NAME`; the kind of value:
# a whole number >= N, a number, a whole number or "off", text or "off"). Values out of range are refused by
# AskConfig's own checks (kvchat.config.Sampling).
SETTINGS: dict[str, tuple[str, object]] = {
    "max-new-tokens": ("max_new_tokens", 1), "retrieve": ("retrieve", 0),
    "temperature": ("sampling.temperature", float), "top-p": ("sampling.top_p", float),
    "seed": ("sampling.seed", "whole or off"), "repetition-penalty": ("sampling.repetition_penalty", float),
    "system": ("system", str),
}

PROMPT, CONTINUATION = "> ", "... "


class Actions(Protocol):
    """What the loop asks of the CLI."""

    def answer(self, question: str, episode: int | None, earlier: tuple[tuple[str, str], ...] = ()) -> str | None:
        """Answer (following up the `earlier` question-answer pairs) and print; return the answer's text.
        KeyboardInterrupt stops it, UserError is shown and the loop goes on."""

    def switch(self, name: str) -> int:
        """Make `name` the conversation asked; return its number of episodes."""

    def episode_count(self) -> int: ...

    sources: bool  # show each answer's sources (/sources)

    def episodes(self) -> list[str]:
        """One line per episode: its number, topic and size."""

    def settings(self) -> dict[str, object]:
        """The answer settings `/set` changes, by AskConfig field."""

    def configure(self, field: str, value: object) -> None:
        """Set an AskConfig field (`sampling.NAME` for sampling's) for the questions that follow; UserError when
        the value is out of range."""


class Repl:
    def __init__(self, read: Callable[[str], str], actions: Actions, say: Callable[[str], None]) -> None:
        self.read, self.actions, self.say = read, actions, say
        self.episode: int | None = None
        self.earlier: tuple[tuple[str, str], ...] = ()  # the previous question and answer, until /clear

    def run(self) -> None:
        """Until exit, quit or end of input (Ctrl-D)."""
        while True:
            try:
                line = self.read(PROMPT)
            except KeyboardInterrupt:  # at the prompt: drop the line, as shells do
                continue
            except EOFError:
                self.say("")  # end the prompt's line, so the shell's prompt starts on its own
                return
            try:
                question = self._question(line)
            except EOFError:
                self.say("")
                return
            except KeyboardInterrupt:  # Ctrl-C inside a multi-line question drops it
                continue
            if question is _EXIT:
                return
            if question is None:
                continue
            try:
                text = self.actions.answer(question, self.episode, self.earlier)
            except KeyboardInterrupt:
                self.say("[interrupted]")
            except UserError as exc:
                self.say(f"error: {error_text(exc)}")
            else:
                self.earlier = ((question, text),) if text else ()

    def _question(self, line: str) -> str | Literal[_Exit.EXIT] | None:
        """The question `line` starts (reading more lines for a multi-line one), _EXIT, or None when the
        line was a command or blank."""
        stripped = line.strip()
        if stripped.lower() in {"exit", "quit", "/exit", "/quit", "/bye"}:
            return _EXIT
        if stripped.lower() in _BARE_COMMANDS:  # a word the REPL knows is never a question for the model
            self._command("/" + stripped.lower())
            return None
        if stripped == "!multi":
            return self._until(lambda s: s.strip() == "!end", keep_last=False)
        if stripped == "!end":  # closes a `!multi` question; alone it is a slip, not a question
            self.say("!end closes a question started with !multi; nothing to close")
            return None
        if stripped.startswith('"""'):
            rest = stripped[3:]
            if rest.endswith('"""') and len(rest) >= 3:  # """one line"""
                return rest[:-3].strip() or None
            head = [rest] if rest else []
            return self._until(lambda s: s.rstrip().endswith('"""'), keep_last=True, head=head, strip='"""')
        if stripped.startswith("/"):
            self._command(stripped)
            return None
        return stripped or None

    def _until(self, last: Callable[[str], bool], *, keep_last: bool, head: list[str] | None = None,
               strip: str = "") -> str | None:
        lines = list(head or [])
        while True:
            line = self.read(CONTINUATION)
            if last(line):
                if keep_last:
                    lines.append(line.rstrip()[: -len(strip)] if strip else line)
                break
            lines.append(line)
        return "\n".join(lines).strip() or None

    def _command(self, text: str) -> None:
        word, _, arg = text.partition(" ")
        arg = arg.strip()
        if word in {"/help", "/?", "/h"}:
            self.say(HELP)
        elif word == "/clear":
            self.earlier = ()
            self.say("cleared: the next question starts afresh")
        elif word == "/episodes":
            for line in self.actions.episodes():
                self.say(line)
        elif word == "/set":
            self._set(arg)
        elif word == "/episode":
            if arg in {"", "auto"}:
                self.episode = None
                self.say("routing each question to the nearest episode")
                return
            count = self.actions.episode_count()
            if not arg.isdigit() or not 0 <= int(arg) < count:
                self.say(f"error: /episode takes a number from 0 to {count - 1}, or auto")
                return
            self.episode = int(arg)
            self.say(f"answering from episode {self.episode}")
        elif word == "/sources":
            if arg not in {"", "on", "off"}:
                self.say("error: /sources takes on or off")
                return
            self.actions.sources = arg == "on" or (not arg and not self.actions.sources)
            self.say("sources " + ("on: each answer names the turns it drew on" if self.actions.sources else "off"))
        elif word == "/conversation":
            if not arg:
                self.say("error: /conversation takes a conversation name")
                return
            try:
                count = self.actions.switch(arg)
            except UserError as exc:
                self.say(f"error: {error_text(exc)}")
                return
            self.episode, self.earlier = None, ()
            self.say(f"{arg}: {count} episode{'s' * (count != 1)}")
        else:
            self.say(f"error: unknown command {word} (/help lists them)")


    def _set(self, arg: str) -> None:
        name, _, value = arg.partition(" ")
        if not name:
            shown = self.actions.settings()
            self.say("  ".join(f"{n} {_shown(shown[f])}" for n, (f, _) in SETTINGS.items() if f in shown))
            return
        if name not in SETTINGS:
            self.say(f"error: /set knows {', '.join(SETTINGS)} (got {name!r})")
            return
        field, kind = SETTINGS[name]
        parsed = _parsed(value.strip(), kind)
        if parsed is _INVALID:
            wanted = {float: "a number", "whole or off": "a whole number, or off", str: "text, or off"}
            self.say(f"error: /set {name} takes {wanted.get(kind, f'a whole number >= {kind}')}")
            return
        try:
            self.actions.configure(field, parsed)
        except UserError as exc:
            self.say(f"error: {exc}")
            return
        self.say(f"{name} = {_shown(parsed)}")


class _Exit(enum.Enum):
    EXIT = "exit"


_EXIT: Final = _Exit.EXIT  # what `_question` returns for exit, quit and the like
_INVALID = object()


def _parsed(value: str, kind: object) -> object:
    """`value` as a /set setting of `kind` takes it (SETTINGS), or _INVALID."""
    if kind is str:
        return None if value in ("", "off") else value
    if kind == "whole or off":
        return None if value == "off" else int(value) if value.isdigit() else _INVALID
    if kind is float:
        try:
            return float(value)
        except ValueError:
            return _INVALID
    least = kind if isinstance(kind, int) else 0
    return int(value) if value.isdigit() and int(value) >= least else _INVALID


def _shown(value: object) -> str:
    return "default" if value is None else repr(value) if isinstance(value, str) else f"{value:g}" \
        if isinstance(value, float) else str(value)


_BARE_COMMANDS = {"help", "clear", "episodes"}


def prompt_reader(history_file: Path | None, *, input=None, output=None) -> Callable[[str], str]:
    """A `read` with line editing, bracketed paste (a pasted block stays one question) and a persistent
    history in `history_file` (None: this session's only, where the home cannot be written). `input` and
    `output`: prompt_toolkit's, where not the terminal (tests drive it through a pipe)."""
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory, InMemoryHistory

    if history_file is not None:
        history_file.parent.mkdir(parents=True, exist_ok=True)
    history = InMemoryHistory() if history_file is None else FileHistory(str(history_file))
    session: PromptSession[str] = PromptSession(history=history, input=input, output=output)

    def read(prompt: str) -> str:
        return session.prompt(prompt)

    return read
