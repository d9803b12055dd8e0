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
    (("openai.json", "--pick", "1"), "pick applies to ChatGPT, Claude and Telegram exports"),
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



def test_receipts_from_several_conversations_name_the_title_and_the_turn(tmp_path, tiny_model_dir):
    made = run_main(tmp_path, "ingest", str(GOOD / "chatgpt_export.json"), "--pick", "all", "--name", "both",
                    "--model", str(tiny_model_dir), *TINY)
    assert made.returncode == 0, made.stderr
    record = json.loads(run_main(tmp_path, "ask", "What is the hotel confirmation number?", "--sources", "--json",
                                 "--max-new-tokens", "4", "--no-log").stdout)
    assert record["sources"], record["sources_note"]
    titles = {"Trip to Japan", "Tomato plants"}
    for source in record["sources"]:
        title, _, number = source["turn_id"].rpartition(", turn ")
        assert title in titles and int(number) >= 1, source
    shown = run_main(tmp_path, "ask", "What is the hotel confirmation number?", "--sources", "--max-new-tokens", "4",
                     "--no-log").stdout
    assert any(f"({title}, turn " in shown for title in titles), shown


def test_append_of_a_re_export_skips_the_turns_already_stored(tmp_path, tiny_model_dir):
    export = (GOOD / "whatsapp_ios.txt").read_text()
    earlier = tmp_path / "WhatsApp Chat - Cabin trip.txt"  # the export of two weeks ago: it ended with Sam's turn
    earlier.write_text(export[: export.index("[25/05/2023")])
    made = run_main(tmp_path, "ingest", str(earlier), "--name", "cabin", "--model", str(tiny_model_dir), *TINY)
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout)["turns"] == 2
    later = tmp_path / "WhatsApp Chat - Cabin trip (1).txt"
    later.write_text(export)
    appended = run_main(tmp_path, "ingest", str(later), "--name", "cabin", "--append", "--json")
    assert appended.returncode == 0, appended.stderr
    report = json.loads(appended.stdout)
    assert (report["turns"], report["skipped_turns"]) == (3, 2)
    assert "2 of the file's turns were in 'cabin' already (a re-export?): appended the 1 after them" in appended.stderr
    again = run_main(tmp_path, "ingest", str(later), "--name", "cabin", "--append")
    assert again.returncode == 0 and "nothing to append: the conversation holds all 3" in again.stderr
    assert json.loads(run_main(tmp_path, "show", "cabin", "--json").stdout)["turns"] == 3  # nothing written


def test_a_slack_channel_folder_ingests_under_its_name(tmp_path, tiny_model_dir):
    made = run_main(tmp_path, "ingest", str(GOOD / "slack_export" / "cabin-trip"), "--model", str(tiny_model_dir),
                    *TINY)
    assert made.returncode == 0, made.stderr
    assert (json.loads(made.stdout)["name"], json.loads(made.stdout)["turns"]) == ("cabin-trip", 3)
