"""A conversation's saved ingest settings, both ways: the `IngestConfig` that built it <-> the flat dict the store
keeps with it, `--setting KEY=VALUE`, and the command line that builds it again. All of it is read off the rows of
kvchat.settings_table; nothing here names a setting.

The store keeps the *resolved* settings (what ran: `auto` positions and layer budgets replaced by the choice made,
the alpha used), so the same settings rebuild the same caches. A setting is saved only while it changes what is
built (its row's `features` on, its `used` true); a key an older kvchat did not write takes its row's `legacy`
value where that kvchat built with something else than today's default, else the default.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from kvchat import features
from kvchat.config import IngestConfig
from kvchat.errors import UserError
from kvchat.settings_table import BY_KEY, NOTHING, SETTINGS, Setting


def saved_rows(config: IngestConfig) -> list[Setting]:
    """The settings `config` saves, in table order: those of no feature or of a feature it turns on, and used (or
    saved as their `unused` value)."""
    on = {f.name for f in features.active(config.cache)}
    return [row for row in SETTINGS if (not row.features or on.intersection(row.features))
            and (row.used is None or row.unused is not NOTHING or row.used(config))]  # fmt: skip


def _in_use(row: Setting, config: IngestConfig) -> bool:
    return row.used is None or row.used(config)


def to_settings(config: IngestConfig, *, source: str | None, appended: Sequence[str] = (),
                reads: dict[str, dict[str, str]] | None = None) -> dict:
    """The dict stored with a conversation. `config` is the resolved one (see the module docstring);
    `appended`, the histories `kvchat ingest --append` added after `source`, in order; `reads`, how those of them
    read with `--format` or `--pick` were read (`read_options`)."""
    settings: dict = {row.key: row.get(config) if _in_use(row, config) else row.unused for row in saved_rows(config)}
    settings["source"] = source
    if appended:
        settings["appended"] = list(appended)
    if reads:
        settings["reads"] = {path: dict(options) for path, options in reads.items()}
    return settings


def from_settings(settings: Mapping[str, Any], model: str = "default") -> IngestConfig:
    """The `IngestConfig` stored `settings` describe, whichever kvchat wrote them (older keys read too; a key they
    lack takes its row's legacy value where it would have been saved, else the default)."""
    config, missing = IngestConfig(model=model), []
    for row in SETTINGS:
        key = next((k for k in (row.key, *row.old_keys) if k in settings), None)
        if key is None:
            missing.append(row)
        elif row.unused is NOTHING or settings[key] != row.unused:
            config = row.set(config, settings[key])
    saved = {row.key for row in saved_rows(config)}
    for row in missing:
        if row.legacy is not NOTHING and row.key in saved:
            config = row.set(config, row.legacy(config) if callable(row.legacy) else row.legacy)
    return config


def upgraded(settings: Mapping[str, Any]) -> dict:
    """Saved `settings` under today's keys (an older kvchat's renamed ones renamed), values as saved: what a store
    shows and what a new ingest's settings are compared with."""
    return {BY_KEY[key].key if key in BY_KEY else key: value for key, value in settings.items()}


def with_settings(config: IngestConfig, pairs: Sequence[str]) -> IngestConfig:
    """`config` with settings given as `KEY=VALUE` (`kvchat ingest --setting`): any saved key, VALUE in JSON or
    else a plain string. Unknown keys and values of the wrong type are user errors; `ingest.validate` checks the
    values."""
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or key not in BY_KEY:
            raise UserError(f"--setting {pair!r}: expected KEY=VALUE with KEY one of "
                            f"{', '.join(row.key for row in SETTINGS)}")
        row = BY_KEY[key]
        config = row.set(config, row.parse(raw))
    return config


def read_options(format: str | None = None, pick: str | None = None) -> dict[str, str]:
    """How a history file was read (`--format`, `--pick`), as a conversation's `reads` keeps it: the options given."""
    return {key: value for key, value in (("format", format), ("pick", pick)) if value is not None}


def stored_read(settings: Mapping[str, Any], path: str | None) -> dict[str, str]:
    """`load_history`'s `format` and `pick` for `path`, one of the histories a conversation was built from."""
    return dict((settings.get("reads") or {}).get(path) or {})


def setting_words(config: IngestConfig) -> list[str]:
    """The `kvchat ingest` arguments that give `config`'s saved settings: each one in use whose value is not its
    default, by its option if its row has one, else as `--setting KEY=VALUE`."""
    words, default = [], IngestConfig()
    for row in saved_rows(config):
        value = row.get(config)
        if not _in_use(row, config) or value == row.get(default):
            continue
        if row.option is None:
            words += ["--setting", f"{row.key}={_bare(value)}"]
        elif isinstance(value, bool):
            words.append(row.option if value else f"--no-{row.option.removeprefix('--')}")
        else:
            words += [row.option, str(value)]
    return words


def _bare(value: Any) -> str:
    """`value` as `--setting` reads it back: a printable string bare where it reads as no other JSON value, else
    JSON (so a command stays on one line)."""
    if isinstance(value, str) and value.isprintable():
        try:
            json.loads(value)
        except json.JSONDecodeError:
            return value
    return json.dumps(value)


def rebuild_command(name: str, model: str, settings: Mapping[str, Any], *, replace: bool = False) -> str:
    """`kvchat ingest SOURCE --name NAME ...` with every setting the conversation was built with, then an `--append`
    for each history appended to it."""
    words = ["kvchat", "ingest", settings.get("source") or "HISTORY", "--name", name,
             *_read_words(settings, settings.get("source"))]  # fmt: skip
    if model != "default":
        words += ["--model", model]
    words += setting_words(from_settings(settings, model))
    if replace:
        words.append("--replace")
    appends = [shlex.join(["kvchat", "ingest", p, "--name", name, "--append", *_read_words(settings, p)])
               for p in settings.get("appended", [])]
    return " && ".join([shlex.join(words), *appends])


def _read_words(settings: Mapping[str, Any], path: str | None) -> list[str]:
    """`--format F --pick P` as history `path` was read."""
    return [word for key, value in stored_read(settings, path).items() for word in (f"--{key}", str(value))]


def differing_options(given: IngestConfig, settings: Mapping[str, Any], model: str) -> list[str]:
    """The settings an `--append` gave (those not at their defaults) whose values differ from the conversation's
    stored `settings`, each as the user gives it (`--budget 128 (built with 64)`, `--setting recall_share=0.75
    (built with 0.5)`): a setting equal to the stored one is no conflict."""
    default, stored = IngestConfig(model=given.model), from_settings(settings, model)
    differing = []
    for row in SETTINGS:
        mine, theirs = row.get(given), row.get(stored)
        if mine != row.get(default) and mine != theirs:
            built = "without it" if theirs is None else f"with {theirs}"
            differing.append(f"{row.given(mine)} (built {built})")
    return differing
