"""`--help` as plain text when piped or narrow: one line per option, grouped, with examples.

Rich's boxed help wraps option names and choices inside narrow columns, which neither grep nor an 80-column
terminal reads well. When stdout is not a terminal or is narrower than `RICH_MIN_COLUMNS`, each option gets
one line that starts with its names and metavar (never broken) and carries the first sentence of its help;
the full sentences stay in the wide rich help and in docs/commands.md.
"""

from __future__ import annotations

import re
import shutil
import sys
import textwrap

from typer import _click as click  # typer vendors a slim click
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

RICH_MIN_COLUMNS = 100
_NAME_COLUMN = 24
_SENTENCE_END = re.compile(r"(?<=[.;])\s+(?=[A-Z(-])|(?<=\.)\s+")
TyperParameter = TyperOption | TyperArgument  # every parameter of a typer command (its help option too)


def summary(text: str) -> str:
    """The first sentence of a help text (the whole text when it is one sentence)."""
    text = " ".join((text or "").split())
    first = _SENTENCE_END.split(text, maxsplit=1)[0]
    return first if first.endswith((".", ";")) or first == text else first + "."


def _plain_wanted() -> bool:
    width = shutil.get_terminal_size((80, 24)).columns
    return not sys.stdout.isatty() or width < RICH_MIN_COLUMNS


def _width() -> int:
    return max(40, min(shutil.get_terminal_size((80, 24)).columns, 120))


def _is_argument(param: click.Parameter) -> bool:
    return param.param_type_name == "argument"


def _declaration(param: TyperParameter, ctx: click.Context) -> str:
    """`--name METAVAR`, `--flag / --no-flag` or `ARG`: the names a user types, with what they take."""
    if _is_argument(param):
        return (param.metavar or param.name or "").upper()
    names = " / ".join([", ".join(param.opts), *param.secondary_opts]) if param.secondary_opts \
        else ", ".join(sorted(param.opts, key=len))
    if getattr(param, "is_flag", False) and not getattr(param, "count", False):
        return names
    if param.metavar is not None:
        return f"{names} {param.metavar}".rstrip()
    label = param.display_type(ctx).strip("<>")  # typer's own: `<int>`, `<a|b|c>`
    return f"{names} {label if param.type_descriptor.is_choice else label.upper()}"


def _default(param: TyperParameter) -> str:
    if _is_argument(param) or getattr(param, "is_flag", False) or param.show_default is False:
        return ""
    value = param.default
    if value is None or value == () or value == [] or callable(value):
        return ""
    return f" (default: {value})"


def _entry(param: TyperParameter, ctx: click.Context, width: int) -> list[str]:
    """One option's lines: its declaration, then its summary beside it, wrapped at words."""
    head = f"  {_declaration(param, ctx)}"
    text = summary(getattr(param, "help", None) or "") + _default(param)
    if len(head) < _NAME_COLUMN - 1:
        head = head.ljust(_NAME_COLUMN)
    elif len(head) > width - 30:  # long choices: the help goes under them, not squeezed beside
        return [head, *textwrap.wrap(text, width=width, initial_indent=" " * _NAME_COLUMN,
                                     subsequent_indent=" " * _NAME_COLUMN, break_long_words=False,
                                     break_on_hyphens=False)]
    else:
        head += "  "
    wrapped = textwrap.wrap(text or " ", width=width, initial_indent=head, subsequent_indent=" " * _NAME_COLUMN,
                            break_long_words=False, break_on_hyphens=False)
    return wrapped or [head.rstrip()]


def plain_help(command: click.Command, ctx: click.Context) -> str:
    """The whole `--help` of `command` as plain text: usage, description, grouped options, epilog."""
    width = _width()
    lines = [f"Usage: {ctx.command_path} {' '.join(command.collect_usage_pieces(ctx))}", ""]
    for paragraph in (command.help or "").split("\n\n"):
        if paragraph.strip():
            lines += textwrap.wrap(" ".join(paragraph.split()), width=width, initial_indent="  ",
                                   subsequent_indent="  ")
            lines.append("")
    if isinstance(command, TyperGroup):
        lines.append("Commands:")
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                lines += textwrap.wrap(summary(sub.short_help or sub.help or ""), width=width,
                                       initial_indent=f"  {name:<16}", subsequent_indent=" " * 18)
        lines.append("")
    groups: dict[str, list[TyperParameter]] = {}
    for param in command.get_params(ctx):
        if getattr(param, "hidden", False) or not isinstance(param, TyperParameter):  # typer makes only these
            continue
        default_group = "Arguments" if _is_argument(param) else "Options"
        groups.setdefault(getattr(param, "rich_help_panel", None) or default_group, []).append(param)
    for group, params in sorted(groups.items(), key=lambda item: (item[0] != "Arguments", item[0] == "Options")):
        lines.append(f"{group}:")
        for param in params:
            lines += _entry(param, ctx, width)
        lines.append("")
    if command.epilog:
        for paragraph in command.epilog.strip().split("\n\n"):
            lines += [line.rstrip() for line in paragraph.splitlines()]
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _unlabel_flags(params: list[click.Parameter]) -> None:
    """A flag takes no value: no `<bool>` beside it in the rich help."""
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""


class _PlainHelp(click.Command):
    """Plain help (see the module docstring) unless a wide terminal shows rich's; flags without `<bool>`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _unlabel_flags(self.params)

    def get_help_option(self, ctx: click.Context):
        option = super().get_help_option(ctx)
        if option is not None:
            _unlabel_flags([option])
        return option

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        if not _plain_wanted():
            return super().format_help(ctx, formatter)
        formatter.write(plain_help(self, ctx))


class HelpCommand(_PlainHelp, TyperCommand):
    """A command of kvchat's."""


class HelpGroup(_PlainHelp, TyperGroup):
    """The root command, with the same help as its commands."""
