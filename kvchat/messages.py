"""How a message names a setting, an option or a command below the CLI: by a neutral reference, which each front
end spells in its own words.

kvchat's messages reach a terminal (`--budget 64`, `kvchat list`), HTTP clients of `kvchat serve` (`"budget": 64`,
`GET /kvchat/conversations`) and Python callers (`budget=64`, `list`), so the library never spells a command line:
`setting("budget", 64)`, `option("episode")` and `command("ingest", "HISTORY", name="chat", replace=True)` return a
reference as text (`{setting:budget=64}`: kind, key, and the value in JSON), which goes into a message like any
other text. A front end passes the text through `spell(text, its_spelling)`; `str()` of a kvchat error is `plain`.
Keys are neutral names: a saved setting's key (kvchat.settings_table), an option's long name with underscores
(`episode`, `max_new_tokens` for `--max-new-tokens`), a command's name (`profile-layers`);
tests/test_architecture.py checks each is one the CLI has.

Text that only looks like a reference (a history may hold anything) is spelt like one, or left as it is when it does
not parse: a message is never lost to it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any


class _Nothing:
    """No value given: the reference names the setting or option alone."""

    def __repr__(self) -> str:
        return "NOTHING"


NOTHING: Any = _Nothing()
_START = re.compile(r"\{(setting|option|command):([a-z][a-z0-9_-]*)(=|\})")
_DECODER = json.JSONDecoder()


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)


def setting(key: str, value: Any = NOTHING) -> str:
    """A saved setting, by its key (kvchat.settings_table), given `value` if one is passed."""
    return f"{{setting:{key}}}" if value is NOTHING else f"{{setting:{key}={_json(value)}}}"


def option(key: str, value: Any = NOTHING) -> str:
    """An option that is not a saved setting, by its long name with underscores (`episode`, `max_new_tokens`), given
    `value` if one is passed (True: a flag that is on, as `option("append")` names it)."""
    return f"{{option:{key}}}" if value is NOTHING else f"{{option:{key}={_json(value)}}}"


def command(name: str, /, *args: Any, **options: Any) -> str:
    """A command (`list`, `profile-layers`) with its arguments and its options or settings by key (True: a flag)."""
    if not args and not options:
        return f"{{command:{name}}}"
    return f"{{command:{name}={_json([[str(a) for a in args], options])}}}"


@dataclass(frozen=True)
class Command:
    """A command reference read back: name, positional arguments, options and settings by key, in order."""

    name: str
    args: tuple[str, ...] = ()
    options: Mapping[str, Any] = field(default_factory=dict)


def bare(value: Any) -> str:
    """`value` as a person types it: a printable string bare where it reads as no other JSON value, else JSON."""
    if isinstance(value, str) and value.isprintable() and value:
        try:
            json.loads(value)
        except json.JSONDecodeError:
            return value
    return json.dumps(value, ensure_ascii=False)


class Spelling:
    """How a front end writes references; this base writes them plainly, as `str()` of an error shows them:
    `budget`, `budget=64`, `list`, `ingest HISTORY name=chat replace=true`. Front ends override what they spell
    differently."""

    def setting(self, key: str, value: Any) -> str:
        return key if value is NOTHING else f"{key}={_word(value)}"

    def option(self, key: str, value: Any) -> str:
        return self.setting(key, value)

    def command(self, command: Command) -> str:
        return " ".join([command.name, *map(_word, command.args),
                         *(self.option(key, value) for key, value in command.options.items())])  # fmt: skip


def _word(value: Any) -> str:
    """`value` as one word of a plain message: bare, or in JSON where it holds a space."""
    shown = bare(value)
    return shown if shown.split() == [shown] else json.dumps(value, ensure_ascii=False)


PLAIN = Spelling()


def _references(text: str) -> Iterator[tuple[int, int, str, str, Any]]:
    """Each well-formed reference in `text`: (start, end, kind, key, value)."""
    at = 0
    while (match := _START.search(text, at)) is not None:
        kind, key, after = match.groups()
        value, end = NOTHING, match.end()
        if after == "=":
            try:
                value, end = _DECODER.raw_decode(text, end)
            except json.JSONDecodeError:
                at = match.start() + 1
                continue
            if not text.startswith("}", end):
                at = match.start() + 1
                continue
            end += 1
        if kind == "command" and value is not NOTHING and not _command_value(value):
            at = match.start() + 1
            continue
        yield match.start(), end, kind, key, value
        at = end


def _command_value(value: Any) -> bool:
    return (isinstance(value, list) and len(value) == 2 and isinstance(value[0], list)
            and all(isinstance(a, str) for a in value[0]) and isinstance(value[1], dict))  # fmt: skip


def spell(text: str, spelling: Spelling = PLAIN) -> str:
    """`text` with every reference in it written as `spelling` writes it."""
    parts, at = [], 0
    for start, end, kind, key, value in _references(text):
        parts.append(text[at:start])
        if kind == "setting":
            parts.append(spelling.setting(key, value))
        elif kind == "option":
            parts.append(spelling.option(key, value))
        else:
            args, options = value if value is not NOTHING else ([], {})
            parts.append(spelling.command(Command(key, tuple(args), options)))
        at = end
    parts.append(text[at:])
    return "".join(parts)


def plain(text: str) -> str:
    """`text` with its references written plainly (what `str()` of a kvchat error shows)."""
    return spell(text, PLAIN)


def referenced(text: str) -> list[tuple[str, str]]:
    """The (kind, key) of each reference in `text`, a command's options as ("option", key) too."""
    found = []
    for _start, _end, kind, key, value in _references(text):
        found.append((kind, key))
        if kind == "command" and value is not NOTHING:
            found += [("option", name) for name in value[1]]
    return found

