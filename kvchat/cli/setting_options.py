"""The options that set a conversation's saved settings, for every command that ingests (`ingest`, `ingest-batch`):
one per row of kvchat.settings_table that has an option, `--model`, and `--setting KEY=VALUE` for any saved key.

`with_setting_options` gives a command these options in place of its parameter `config: IngestConfig` and calls it
with the `IngestConfig` they describe, so an option is added or moved by its table row alone.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal

import typer

from kvchat.config import IngestConfig
from kvchat.settings import with_settings
from kvchat.settings_table import SETTINGS, Setting

CACHE_PANEL, OFFLOAD_PANEL = "Cache", "Offload and memory"
_PANELS = {"offload": OFFLOAD_PANEL, "retrieve": OFFLOAD_PANEL}  # the rest: CACHE_PANEL
OPTION_ROWS: tuple[Setting, ...] = tuple(row for row in SETTINGS if row.option is not None)


def _one_of(row: Setting) -> Callable[[Any], Any]:
    """A parser check that `--OPTION VALUE` is one of the row's choices, for an option whose --help lists only some."""

    def check(value: Any) -> Any:
        if value not in row.choices:
            raise typer.BadParameter(f"{value!r} is not one of {', '.join(map(str, row.choices))}.")
        return value

    return check


def _parameter(row: Setting) -> inspect.Parameter:
    assert row.option is not None, row.key  # OPTION_ROWS are the rows with an option
    info: dict[str, Any] = {"help": row.help, "rich_help_panel": _PANELS.get(row.key, CACHE_PANEL)}
    if row.shown_choices:  # a str option: --help shows the shown choices, the parser takes all of them
        annotation: Any = str
        info |= {"metavar": "|".join(row.shown_choices), "callback": _one_of(row),
                 "autocompletion": lambda incomplete: [c for c in row.shown_choices if c.startswith(incomplete)]}
    elif row.choices:  # a real choice: listed in --help, completed by the shell, refused by the parser (exit 2)
        annotation = Literal[row.choices]
    else:
        annotation = row.annotation
    if row.default is None:
        info["show_default"] = False
    name = row.option.removeprefix("--").replace("-", "_")
    return inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                             annotation=Annotated[annotation, typer.Option(row.option, **info)], default=row.default)


_MODEL = inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Annotated[str, typer.Option(
    help="'default' (SmolLM2-135M), a model dir or a .gguf file. The default one is embedded in kvchat.",
    show_default=False, rich_help_panel=CACHE_PANEL)], default=IngestConfig.model)
_SETTING_OPTION = typer.Option(metavar="KEY=VALUE", rich_help_panel=CACHE_PANEL, help="A saved setting, VALUE in "
                               "JSON (a string may go bare); repeatable. Every saved key, those without an option of "
                               "their own too (block_size, layer_budgets, ...): docs/commands.md lists them; rebuild "
                               "commands carry them.")
_SETTING = inspect.Parameter("setting", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                             annotation=Annotated[list[str] | None, _SETTING_OPTION], default=None)
_ROW_PARAMETERS = {row: _parameter(row) for row in OPTION_ROWS}
PARAMETERS: tuple[inspect.Parameter, ...] = (_MODEL, *_ROW_PARAMETERS.values(), _SETTING)


def config_from(model: str, setting: Sequence[str] | None, **options: Any) -> IngestConfig:
    """The IngestConfig the options give: each row's option by its parameter name, then each `--setting`."""
    config = IngestConfig(model=model)
    for row, parameter in _ROW_PARAMETERS.items():
        config = row.set(config, options[parameter.name])
    return with_settings(config, setting or [])


def with_setting_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Give `command`, in place of its parameter `config: IngestConfig`, `PARAMETERS`, and call it with the
    IngestConfig they describe."""
    signature = inspect.signature(command, eval_str=True)
    params = list(signature.parameters.values())
    at = [p.name for p in params].index("config")
    names = {p.name for p in PARAMETERS}

    @functools.wraps(command)
    def with_config(**given: Any) -> Any:
        return command(config=config_from(**{name: given.pop(name) for name in names}), **given)

    with_config.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[*params[:at], *PARAMETERS, *params[at + 1 :]])
    return with_config
