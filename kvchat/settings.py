"""A conversation's saved ingest settings, both ways: the `IngestConfig` that built it <-> the flat dict the store
keeps with it, `KEY=VALUE` pairs (`kvchat ingest --setting`), and the command that builds it again (a
kvchat.messages reference, which the CLI writes as a command line). All of it is read off the rows of
kvchat.settings_table; nothing here names a setting.

The store keeps the *resolved* settings (what ran: `auto` positions and layer budgets replaced by the choice made,
the alpha used), so the same settings rebuild the same caches. A setting is saved only while it changes what is
built (its row's `features` on, its `used` true); a key an older kvchat did not write takes its row's `legacy`
value where that kvchat built with something else than today's default, else the default.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvchat import features
from kvchat.config import IngestConfig
from kvchat.errors import UserError
from kvchat.messages import command, option
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
            raise UserError(f"{option('setting')} {pair!r}: expected KEY=VALUE with KEY one of "
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


def changed_settings(config: IngestConfig) -> dict[str, Any]:
    """`config`'s saved settings that an ingest must be given: each one in use whose value is not its default."""
    default = IngestConfig()
    return {row.key: row.get(config) for row in saved_rows(config)
            if _in_use(row, config) and row.get(config) != row.get(default)}  # fmt: skip


def rebuild_command(name: str, model: str, settings: Mapping[str, Any], *, replace: bool = False) -> str:
    """The commands that build the conversation again, as kvchat.messages references joined by ` && `: an ingest of
    its source named `name` with every setting it was built with (the CLI: `kvchat ingest SOURCE --name NAME ...`),
    then one appending each history appended to it."""
    source = settings.get("source") or "HISTORY"
    options: dict[str, Any] = {"name": name, **stored_read(settings, settings.get("source"))}
    if model != "default":
        options["model"] = model
    options |= changed_settings(from_settings(settings, model))
    if replace:
        options["replace"] = True
    appends = [command("ingest", path, name=name, append=True, **stored_read(settings, path))
               for path in settings.get("appended", [])]
    return " && ".join([command("ingest", source, **options), *appends])


def differing_options(given: IngestConfig, settings: Mapping[str, Any], model: str) -> list[str]:
    """The settings an append gave (those not at their defaults) whose values differ from the conversation's
    stored `settings`, each a reference with what it was built with (the CLI: `--budget 128 (built with 64)`,
    `--setting recall_share=0.75 (built with 0.5)`): a setting equal to the stored one is no conflict."""
    default, stored = IngestConfig(model=given.model), from_settings(settings, model)
    differing = []
    for row in SETTINGS:
        mine, theirs = row.get(given), row.get(stored)
        if mine != row.get(default) and mine != theirs:
            built = "without it" if theirs is None else f"with {theirs}"
            differing.append(f"{row.given(mine)} (built {built})")
    return differing
