"""The CLI's words for the references in kvchat's messages (kvchat.messages): a saved setting by its option of its
table row (`--budget 64`) or else `--setting block_size=32`, any other option by its long name (key `max_new_tokens`:
`--max-new-tokens`), a command as the `kvchat ...` command line that runs it. Whatever the CLI prints that the
library wrote (an error, a note, a message field of a JSON document) goes through `spell`."""

from __future__ import annotations

import json
import shlex
from typing import Any

from kvchat.errors import message
from kvchat.messages import NOTHING, Command, Spelling, bare
from kvchat.messages import spell as spell_with
from kvchat.settings_table import BY_KEY


def option_name(key: str) -> str:
    """The option a key names: `--max-new-tokens` for `max_new_tokens`."""
    return "--" + key.replace("_", "-")


def _shown(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


class CliSpelling(Spelling):
    """kvchat's command-line words (see the module docstring)."""

    def setting(self, key: str, value: Any) -> str:
        row = BY_KEY.get(key)
        if row is None:
            return self.option(key, value)
        if value is NOTHING:
            return row.option or f"--setting {row.key}"
        return f"{row.option} {_shown(value)}" if row.option else f"--setting {row.key}={_shown(value)}"

    def option(self, key: str, value: Any) -> str:
        if key in BY_KEY:
            return self.setting(key, value)
        return " ".join(self._option_words(key, value))

    def command(self, command: Command) -> str:
        words = ["kvchat", command.name, *command.args]
        for key, value in command.options.items():
            words += self._setting_words(key, value) if key in BY_KEY else self._option_words(key, value)
        return shlex.join(words)

    @staticmethod
    def _option_words(key: str, value: Any) -> list[str]:
        if value is NOTHING or value is True:
            return [option_name(key)]
        if value is False:
            return [option_name("no_" + key)]
        return [option_name(key), _shown(value)]

    @staticmethod
    def _setting_words(key: str, value: Any) -> list[str]:
        """A setting as a command line gives it: by its option (a bool one as a flag), else `--setting KEY=VALUE`."""
        row = BY_KEY[key]
        if row.option is None:
            return ["--setting", f"{row.key}={bare(value)}"]
        if isinstance(value, bool):
            return [row.option if value else f"--no-{row.option.removeprefix('--')}"]
        return [row.option, str(value)]


CLI = CliSpelling()


def spell(text: str) -> str:
    """`text`, written by the library, in the CLI's words."""
    return spell_with(text, CLI)


def error_text(exc: BaseException) -> str:
    """An exception's message in the CLI's words."""
    return spell(message(exc))
