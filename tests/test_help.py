"""`--help` when piped: plain, short, one line per option, grouped, with examples and -h."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer.main
from cli_helpers import run_main

from kvchat.cli import app

_BOX = re.compile("[\u2500-\u257f]")


def _help(monkeypatch, *args: str, columns: int = 80) -> str:
    monkeypatch.setenv("COLUMNS", str(columns))
    result = run_main(Path("/nonexistent"), *args)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_ingest_help_fits_80_lines_at_80_columns_without_boxes(monkeypatch):
    shown = _help(monkeypatch, "ingest", "--help")
    lines = shown.splitlines()
    assert len(lines) <= 80, len(lines)
    assert not _BOX.search(shown) and "<bool>" not in shown
    assert all(len(line) <= 80 for line in lines if not line.startswith("  --")), shown
    assert "Examples:" in shown and "kvchat ingest chat.json" in shown
    for group in ("History:", "Cache:", "Offload and memory:", "Storing:", "Options:"):
        assert group in lines


@pytest.mark.parametrize("name", ["ingest", "ask", "ingest-batch", "eval", "serve", "show"])
def test_every_option_is_on_one_line_with_its_choices_whole(monkeypatch, name):
    shown = _help(monkeypatch, name, "-h")  # -h is --help
    command = typer.main.get_command(app).commands[name]
    for param in command.params:
        for option in (*param.opts, *param.secondary_opts):
            if not option.startswith("-"):
                continue
            line = next((line for line in shown.splitlines() if re.search(rf"(^|\s){re.escape(option)}(,?\s|$)",
                                                                          line.split("  ")[1] if "  " in line else
                                                                          line)), None)
            assert line is not None, f"{option} is not on a line of its own in `kvchat {name} -h`"
            choices = param.type_descriptor.choices if param.type_descriptor.is_choice else None
            if choices and option == param.opts[0]:
                assert "|".join(str(c) for c in choices) in line, line


def test_root_help_lists_commands_whole(monkeypatch):
    shown = _help(monkeypatch, "-h")
    assert "...\n" not in shown.split("\n", 1)[1] and not _BOX.search(shown)
    assert re.search(r"^  ingest-batch\s", shown, re.M) and re.search(r"^  -h, --help\s", shown, re.M)


def test_path_and_rm_of_several(tmp_path):
    shown = run_main(tmp_path, "path").stdout.splitlines()
    assert shown[0] == f"home\t{tmp_path}" and shown[1].startswith("models\t")
    result = run_main(tmp_path, "rm", "nope", "other")
    assert result.returncode == 2 and "unknown conversation" in result.stderr
