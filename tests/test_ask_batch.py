"""`kvchat ask` in scripts (issue 45, item 5): a plain-text batch's output lines up with its questions, Ctrl-C during
an answer exits 130, and an option only this process honours says, while a server runs, that it answers here."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest
from cli_helpers import KVCHAT, cli_env, run_main

from kvchat.cli.asking import NO_ANSWER, escaped_line
from kvchat.history.synthetic import planted_conversation


@pytest.fixture(scope="module")
def home(tmp_path_factory, tiny_model_dir):
    """A store with one conversation ingested on the tiny model."""
    home = tmp_path_factory.mktemp("home")
    messages, _ = planted_conversation(seed=5, topics=2, turns_per_topic=8)
    history = home / "chat.json"
    history.write_text(json.dumps(messages))
    result = run_main(home, "ingest", str(history), "--model", str(tiny_model_dir), "--budget", "64",
                      "--setting", "block_size=32", "--episodes", "2")  # fmt: skip
    assert result.returncode == 0, result.stderr
    return home


def test_a_batchs_answers_line_up_with_its_questions(home):
    """Line N of the output answers line N of the input: a blank line for a blank one, a placeholder for a question
    refused (its line number and reason on stderr), the others answered, exit status 2."""
    questions = ["Where did Tom go?", "", "why " * 1500, "What did Ana buy?"]
    result = run_main(home, "ask", "--max-new-tokens", "12", stdin="\n".join(questions) + "\n")
    assert result.returncode == 2
    lines = result.stdout.split("\n")
    assert len(lines) == len(questions) + 1 and lines[-1] == ""  # one line per question, each ended
    assert lines[1] == "" and lines[2] == NO_ANSWER
    assert lines[0] != NO_ANSWER and lines[3] != NO_ANSWER
    assert "kvchat: error: line 3: the question is 1500 tokens" in result.stderr
    assert "1 of 3 questions failed" in result.stderr


def test_an_answer_with_line_breaks_stays_on_its_line(monkeypatch, capsys):
    from kvchat.cli import asking

    def run(write, stopping):
        write("First line.\nA path C:\\new\\file")
        write("\n\nLast \x1b[31mline.")
        return {"finish_reason": "stop", "episode": 0, "similarity": 0.5}

    asking._print_streamed(run, 8, line=7)
    written = capsys.readouterr().out
    assert written == "First line.\\nA path C:\\\\new\\\\file\\n\\nLast line.\n"
    assert written[:-1].encode().decode("unicode_escape") == "First line.\nA path C:\\new\\file\n\nLast line."
    assert escaped_line("a\\nb\nc") == "a\\\\nb\\nc"  # a backslash and an n is not a line break


def test_a_refused_question_in_a_batch_leaves_a_placeholder(capsys):
    from kvchat.cli import asking

    def refused(write, stopping):
        return {"finish_reason": "refused", "episode": 0, "similarity": 0.1}

    assert asking._print_streamed(refused, 8, line=2) is None
    assert capsys.readouterr().out == NO_ANSWER + "\n"


def test_ctrl_c_during_an_answer_exits_130(home):
    """SIGINT once the first answer has been printed, while the batch's next questions are answered."""
    process = subprocess.Popen([*KVCHAT, "ask", "--max-new-tokens", "40"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(home))
    try:
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write("Where did Tom go?\n" * 500)
        process.stdin.close()
        first = process.stdout.readline()  # observed progress: one answer is out, 499 to go
        assert first.endswith("\n")
        process.send_signal(signal.SIGINT)
        process.stdin = None  # written and closed above: communicate() must not flush it
        _, stderr = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1] == "kvchat: interrupted" and "Traceback" not in stderr


def test_an_option_only_this_process_honours_says_it_answers_here(home, tmp_path):
    (home / "serve.json").write_text(json.dumps({"url": "http://127.0.0.1:9", "pid": os.getpid()}))  # alive: us
    try:
        result = run_main(home, "ask", "Where did Tom go?", "--weights", "float", "--conversation", "nope")
    finally:
        (home / "serve.json").unlink()
    lines = result.stderr.strip().splitlines()
    assert lines[0] == ("kvchat: note: answering in this process, not through the server at http://127.0.0.1:9 "
                        "(--weights is honoured only here)")
    assert result.returncode == 2 and "unknown conversation 'nope'" in lines[1]
    quiet = run_main(home, "ask", "Where did Tom go?", "--weights", "float", "--conversation", "nope")
    assert "note" not in quiet.stderr  # no server: nothing to say
