"""Text from outside kvchat that used to end in an internal error or a terminal acting on it (issue 46): a lone
surrogate in a history, bytes that are not UTF-8 in a question, a turn too long to tokenize whole, and controls and
bidi overrides in --json output."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from cli_helpers import KVCHAT, cli_env, run_main

from kvchat.errors import UserError
from kvchat.history.formats.common import MAX_TURN_CHARS
from kvchat.history.loading import load_history, parse_history
from kvchat.history.synthetic import planted_conversation
from kvchat.untrusted_text import valid_text

TINY = ("--budget", "64", "--setting", "block_size=32", "--episodes", "2")
UNSAFE = "\x85\x9b\u202e\u2066\u2028"  # C1 controls (NEL, CSI), a bidi override and isolate, a line separator


@pytest.fixture
def messages() -> list[dict]:
    return planted_conversation(seed=2, topics=2, turns_per_topic=8)[0]


def _ingested(tmp_path: Path, tiny_model_dir: Path, text: str) -> Path:
    """A home with conversation "h", ingested from `text` (a history file's content) with the tiny model."""
    history = tmp_path / "h.json"
    history.write_text(text, encoding="utf-8")
    home = tmp_path / "home"
    done = run_main(home, "ingest", str(history), "--name", "h", "--model", str(tiny_model_dir), *TINY)
    assert done.returncode == 0, done.stderr
    return home


def test_valid_text_replaces_lone_surrogates_only():
    assert valid_text("a\ud800b\udcff") == "a\ufffdb\ufffd"
    assert valid_text("\ud83d\ude00") == "\U0001f600"  # a pair is the character it encodes
    same = "plain, é, 😀"
    assert valid_text(same) is same


def test_a_lone_surrogate_in_a_history_is_ingested(tmp_path, tiny_model_dir, messages):
    messages[3]["content"] = "The gate is B\ud80012."
    text = json.dumps(messages)  # ASCII: "\\ud800", as a JSON file holds it
    assert "\\ud800" in text
    home = _ingested(tmp_path, tiny_model_dir, text)
    shown = run_main(home, "show", "h", "--json")
    assert shown.returncode == 0 and "\\ud800" not in shown.stdout, shown.stderr
    turns = parse_history(json.loads(text))
    assert turns[3].text == "The gate is B\ufffd12."


def test_bytes_that_are_not_utf8_in_a_question(tmp_path, tiny_model_dir, messages):
    """In an argument Python keeps them as lone surrogates; on stdin they failed to decode."""
    home = _ingested(tmp_path, tiny_model_dir, json.dumps(messages))
    asked = subprocess.run([*KVCHAT, "ask", "--local", b"Which gate \xff\xfe?"], capture_output=True,
                           env=cli_env(home), timeout=300)
    assert asked.returncode == 0, asked.stderr.decode()
    lines = subprocess.run([*KVCHAT, "ask", "--local", "--json"], input=b"Which gate \xff?\nAnd the dog \xc3?\n",
                           capture_output=True, env=cli_env(home), timeout=300)
    assert lines.returncode == 0, lines.stderr.decode()
    documents = [json.loads(line) for line in lines.stdout.decode().splitlines()]
    assert [d["question"] for d in documents] == ["Which gate \ufffd?", "And the dog \ufffd?"]
    logged = json.loads(run_main(home, "logs", "--json").stdout)["asks"]
    assert any("\ufffd" in a["question"] for a in logged)


def test_a_turn_too_long_to_tokenize_whole_is_refused_naming_the_limit(tmp_path, messages):
    messages[1]["content"] = "word " * (MAX_TURN_CHARS // 5 + 1)
    path = tmp_path / "long.json"
    path.write_text(json.dumps(messages))
    with pytest.raises(UserError, match=f"turn 2 is .* over the limit of {MAX_TURN_CHARS:,} characters"):
        load_history(path)
    transcript = tmp_path / "long.txt"
    transcript.write_text("Alice: hello\nBob: " + "x" * (MAX_TURN_CHARS + 1) + "\n")  # one long line
    refused = run_main(tmp_path / "home", "ingest", str(transcript))
    assert refused.returncode == 2 and len(refused.stderr.splitlines()) == 1, refused.stderr
    assert f"over the limit of {MAX_TURN_CHARS:,} characters a turn" in refused.stderr
    messages[1]["content"] = "word " * (MAX_TURN_CHARS // 5 - 10)  # under it: read
    path.write_text(json.dumps(messages))
    assert len(load_history(path)) == len(messages)


def test_json_output_carries_no_character_a_terminal_acts_on(tmp_path, tiny_model_dir, messages):
    """show, logs and list --json escape them (`\\u202e`): the same JSON values, nothing a terminal acts on."""
    for message in messages:
        message["content"] = f"{UNSAFE}{message['content']}{UNSAFE}"
    home = _ingested(tmp_path, tiny_model_dir, json.dumps(messages, ensure_ascii=False))
    assert run_main(home, "ask", "--local", f"Which gate{UNSAFE}?").returncode == 0
    for args in (["show", "h", "--json"], ["logs", "--json"], ["list", "--json"]):
        result = run_main(home, *args)
        assert result.returncode == 0, result.stderr
        assert not any(c in result.stdout for c in UNSAFE), args
    shown = run_main(home, "show", "h", "--json").stdout
    assert "\\u202e" in shown and "\u202e" in json.dumps(json.loads(shown), ensure_ascii=False)
    logged = json.loads(run_main(home, "logs", "--json").stdout)["asks"]
    assert logged[0]["question"] == f"Which gate{UNSAFE}?"  # the same value, escaped


def test_the_cli_process_writes_the_escapes_not_the_characters(tmp_path, tiny_model_dir, messages):
    messages[0]["content"] = f"Gate{UNSAFE}B12"
    home = _ingested(tmp_path, tiny_model_dir, json.dumps(messages))
    result = subprocess.run([*KVCHAT, "show", "h", "--json"], capture_output=True, env=cli_env(home), timeout=300)
    assert result.returncode == 0, result.stderr
    assert not any(c.encode() in result.stdout for c in UNSAFE)
    assert json.loads(result.stdout)["name"] == "h"
