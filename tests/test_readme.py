"""Every command in the README's "Using it" block runs as written (on the tiny model instead of the
default one: `--model` is added to `ingest`), in order, and succeeds."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from cli_helpers import run_main

from kvchat.synthetic import planted_conversation

README = Path(__file__).resolve().parents[1] / "README.md"


def _using_it_commands() -> list[str]:
    section = README.read_text().split("## Using it", 1)[1]
    block = re.search(r"```sh\n(.*?)```", section, re.DOTALL).group(1)
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def test_readme_commands_run_as_written(tmp_path, monkeypatch, tiny_model_dir):
    monkeypatch.chdir(tmp_path)
    messages, _ = planted_conversation(seed=4, topics=2, turns_per_topic=8)
    (tmp_path / "history.json").write_text(json.dumps(messages))
    (tmp_path / "questions.txt").write_text("Which gate does the flight leave from?\nHow many tomato plants?\n")
    home = tmp_path / "home"
    commands = _using_it_commands()
    assert len(commands) >= 10 and all(c.startswith("kvchat ") for c in commands), commands
    for command in commands:
        words = shlex.split(command)[1:]
        stdin = ""  # not a terminal: `kvchat ask` alone reads questions from stdin (none here)
        if "<" in words:
            stdin = (tmp_path / words[words.index("<") + 1]).read_text()
            words = words[: words.index("<")]
        if words[0] == "ingest":
            words += ["--model", str(tiny_model_dir)]
        result = run_main(home, *words, stdin=stdin)
        assert result.returncode == 0, (command, result.stderr)
        if "--json" in words and words[0] == "ask":
            assert len(result.stdout.splitlines()) == 2
    assert json.loads(run_main(home, "list", "--json").stdout)["conversations"] == []  # the block ends in rm
