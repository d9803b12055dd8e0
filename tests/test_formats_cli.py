"""`kvchat ingest --format/--pick`: a ChatGPT export ingests one picked conversation; mistakes exit 2 in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import run_main

GOOD = Path(__file__).parent / "data" / "good"
TINY = ("--budget", "64", "--setting", "block_size=32", "--episodes", "1", "--json")


def test_ingest_picks_a_conversation_of_a_chatgpt_export(tmp_path, tiny_model_dir):
    result = run_main(tmp_path, "ingest", str(GOOD / "chatgpt_export.json"), "--pick", "Tomato plants",
                      "--format", "chatgpt", "--name", "tomato", "--model", str(tiny_model_dir), *TINY)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["turns"] == 2


@pytest.mark.parametrize(("args", "fragment"), [
    (("chatgpt_export.json",), "holds 2 ChatGPT conversations"),
    (("chatgpt_export.json", "--pick", "Paris"), 'no conversation titled "Paris"'),
    (("openai.json", "--pick", "1"), "pick applies to ChatGPT and Claude exports"),
    (("openai.json", "--format", "claude"), 'History formats'),
])
def test_format_and_pick_mistakes_exit_2(tmp_path, args, fragment):
    result = run_main(tmp_path, "ingest", str(GOOD / args[0]), *args[1:])
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0] and result.stdout == ""


def test_append_reingest_reads_a_picked_history_as_it_was_read(tmp_path, tiny_model_dir):
    """The export holds two conversations: `--pick` is kept with the conversation, so `--append --reingest` reads
    the stored export the same way (without it the export would be refused), and rebuild commands carry it."""
    more = tmp_path / "more.txt"
    more.write_text("Alice: The tomatoes need water every evening.\nBob: I will water them at seven.\n")
    made = run_main(tmp_path, "ingest", str(GOOD / "chatgpt_export.json"), "--pick", "Tomato plants",
                    "--name", "tomato", "--model", str(tiny_model_dir), *TINY)
    assert made.returncode == 0, made.stderr
    again = run_main(tmp_path, "ingest", str(more), "--name", "tomato", "--append", "--reingest", "--format",
                     "transcript", "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["turns"] == 2 + 2
    settings = json.loads(run_main(tmp_path, "show", "tomato", "--json").stdout)["settings"]
    assert settings["reads"] == {str(GOOD.resolve() / "chatgpt_export.json"): {"pick": "Tomato plants"},
                                 str(more.resolve()): {"format": "transcript"}}

    from kvchat.cli.words import spell
    from kvchat.settings import rebuild_command

    command = spell(rebuild_command("tomato", "default", settings))
    assert "--pick 'Tomato plants'" in command and "--append --format transcript" in command

