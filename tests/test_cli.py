"""The command line as users run it: real processes, exit codes, stdout/stderr contracts."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import KVCHAT, cli_env, run, run_main

from kvchat.errors import UserError
from kvchat.history.synthetic import planted_conversation


@pytest.fixture(scope="module")
def ingested(tmp_path_factory, tiny_model_dir):
    """A store with one conversation ingested through the CLI on the tiny model."""
    home = tmp_path_factory.mktemp("home")
    messages, _ = planted_conversation(seed=5, topics=3, turns_per_topic=12)
    history = home / "chat.json"
    history.write_text(json.dumps(messages))
    result = run(
        home, "ingest", str(history), "--model", str(tiny_model_dir), "--budget", "80", "--setting", "block_size=32",
        "--episodes", "3", "--setting", "prefill=block", "--json",
    )
    assert result.returncode == 0, result.stderr
    assert [line.split(" (")[0] for line in result.stderr.splitlines() if line.startswith("kvchat: episode ")] == [
        "kvchat: episode 1/3", "kvchat: episode 2/3", "kvchat: episode 3/3"
    ]  # not a terminal: one line per episode (with the time elapsed), so a log shows the ingest is alive
    return home, json.loads(result.stdout)


def test_ingest_json_reports_the_peak(ingested):
    _, report = ingested
    assert report["timings_ms"]["total"] > 0 and "seconds" not in report and "episodes" not in report
    assert report["name"] == "chat" and report["episode_count"] == 3 and report["schema"] == 1
    assert report["peak_layer_entries"] <= 80 + 32 + 256 + 16
    assert report["estimated_peak_bytes"] > 0


def test_ask_json_one_shot(ingested):
    home, _ = ingested
    result = run(home, "ask", "Which gate does the flight leave from?", "--json", "--max-new-tokens", "5")
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert answer["conversation"] == "chat" and 0 <= answer["episode"] < 3
    assert set(answer["timings_ms"]) == {"embed", "route", "load", "decode"}
    assert answer["answer_tokens"] <= 5
    assert answer["weights"] == "float"  # --weights auto: the tiny model's random weights are not 4-bit groups


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_ask_answers_with_quantized_weights_kept_for_the_next_process(ingested, weights):
    home, _ = ingested
    asked = ("ask", "Which gate does the flight leave from?", "--json", "--max-new-tokens", "5", "--weights", weights,
             "--device", "cpu")
    first, again = run(home, *asked), run(home, *asked)
    assert first.returncode == again.returncode == 0, first.stderr + again.stderr
    assert json.loads(first.stdout)["answer"] == json.loads(again.stdout)["answer"]
    assert json.loads(first.stdout)["weights"] == json.loads(again.stdout)["weights"] == weights
    assert len(list((home / "models" / "held").glob(f"*.{weights}.*"))) == 1
    refused = run(home, *asked[:-3], "int2")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr


def test_ask_reads_one_question_per_stdin_line(ingested):
    home, _ = ingested
    result = run(home, "ask", "--json", "--max-new-tokens", "3", stdin="first question?\n\n  second question?\r\n")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]  # JSON Lines: one object a line
    assert [r["question"] for r in records] == ["first question?", "second question?"]
    assert all(r["conversation"] == "chat" and r["schema"] == 1 and isinstance(r["answer"], str) for r in records)


def test_list_show_rm(ingested, tmp_path):
    home, _ = ingested
    listed = json.loads(run(home, "list", "--json").stdout)
    assert listed["schema"] == 1 and [c["name"] for c in listed["conversations"]] == ["chat"]
    shown = json.loads(run(home, "show", "chat", "--json").stdout)
    assert len(shown["episodes"]) == 3 and all(e["budgets"] == [80, 80] for e in shown["episodes"])
    piped = run(home, "show", "chat")
    assert piped.stderr.startswith("chat (the default conversation)\n")
    assert [line.split("\t")[0] for line in piped.stdout.splitlines()] == ["episode", "0", "1", "2"]


def test_json_documents_share_one_vocabulary(ingested):
    """A key that ingest, list, show and ask documents share means the same thing in each: the same value."""
    home, report = ingested
    listed = json.loads(run_main(home, "list", "--json").stdout)["conversations"][0]
    shown = json.loads(run_main(home, "show", "chat", "--json").stdout)
    answer = json.loads(run_main(home, "ask", "Which gate?", "--json", "--max-new-tokens", "2").stdout)
    for a, b in ((report, shown), (listed, shown), (report, listed)):
        shared = (set(a) & set(b)) - {"schema"}
        assert {"name", "episode_count", "cache_bytes", "turns"} <= shared
        assert {key: a[key] for key in shared} == {key: b[key] for key in shared}
    assert {"history_tokens", "timings_ms", "budgets", "prefill", "positions"} <= set(report) & set(shown)
    assert isinstance(shown["episodes"], list) and len(shown["episodes"]) == shown["episode_count"] == 3
    assert "seconds" not in shown and answer["conversation"] == shown["name"]
    assert answer["episode"] in [e["index"] for e in shown["episodes"]]
    assert sum(e["cache_bytes"] for e in shown["episodes"]) == shown["cache_bytes"]
    assert all(e["topic"] and e["segments"] >= 1 for e in shown["episodes"])


def test_a_single_cache_is_counted_as_one_episode(tmp_path, tiny_model_dir):
    messages, _ = planted_conversation(seed=6, topics=2, turns_per_topic=6)
    history = tmp_path / "chat.json"
    history.write_text(json.dumps(messages))
    ingested = run_main(tmp_path, "ingest", str(history), "--model", str(tiny_model_dir), "--method", "snapkv",
                        "--budget", "64", "--setting", "block_size=32")
    assert ingested.returncode == 0, ingested.stderr
    assert re.search(r"-> 1 episode, budget 64 asked, \d+ kept on average per layer and KV head \(snapkv",
                     ingested.stdout), ingested.stdout
    assert "kvchat: method snapkv\n" in ingested.stderr  # announced before the first block
    assert " in 1 episode (segments of " in run_main(tmp_path, "show", "chat").stderr  # not a terminal: beside it


def test_show_on_a_terminal_leads_with_sizes_and_topics(ingested, monkeypatch):
    from kvchat.cli import render  # its consoles made before TTY_COMPATIBLE is set, as the other tests' are

    home, _ = ingested
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich's way to say "a terminal"
    monkeypatch.setattr(render.out, "width", 400)  # one table row per line
    shown = json.loads(run_main(home, "show", "chat", "--json").stdout)
    plain = re.sub(r"\x1b\[[0-9;]*m", "", run_main(home, "show", "chat").stdout)  # bold, dim
    lines = [line.strip() for line in plain.splitlines()]
    entries = sum(e["entries"] for e in shown["episodes"])
    assert lines[0] == "chat (the default conversation)"
    assert lines[1] == (f"{shown['turns']} turns, {shown['history_tokens']:,} tokens in 3 episodes (segments of 4 "
                        f"turns): {entries:,} entries kept, {shown['cache_bytes'] / 2**20:.1f} MiB")
    assert lines[2].startswith("epicache, budget 80 per layer and KV head, full precision; model ")
    rows = [line for line in lines if line.startswith("│")]
    assert len(rows) == 3 and "budgets per layer" not in "\n".join(lines)
    for row, episode in zip(rows, shown["episodes"], strict=True):
        cells = [c.strip() for c in row.strip("│").split("│")]
        assert cells[:4] == [str(episode["index"]), episode["topic"], str(episode["segments"]), str(episode["entries"])]
        assert episode["topic"] and len(cells[5]) <= 90  # an excerpt, cut at a word
        assert " ".join(episode["medoid_text"].split()).startswith(cells[5].rstrip("…"))


@pytest.mark.parametrize(
    "args, fragment",
    [
        (("ingest", "/no/such/file.json"), "no such file"),
        (("ingest", "{history}", "--budget", "0"), "--budget must be >= 1"),
        (("ingest", "{history}", "--name", "../escape"), "name"),
        (("ingest", "{history}", "--setting", "tau1=0"), "--setting tau1 must be in (0, 10]"),
        (("ingest", "{history}", "--setting", "tau2=-1"), "--setting tau2 must be in (0, 10]"),
        (("ingest", "{history}", "--setting", "positions=sideways"), "unknown --setting positions 'sideways'"),
        (("ingest", "{history}", "--setting", "budget=many"), "--setting budget: expected int, got 'many'"),
        (("ingest", "{history}", "--model", "/no/such/model.gguf"), "model file not found"),
        (("ingest", "{history}", "--model", "no-such-org/no-such-model"), "model not found"),
        (("ask", "hello?", "--conversation", "nope"), "unknown conversation"),
        (("ask", "   "), "question is empty"),
        (("show", "nope"), "unknown conversation"),
        (("rm", "nope"), "unknown conversation"),
    ],
)
def test_user_mistakes_exit_2_with_one_line(ingested, tmp_path, args, fragment):
    home, _ = ingested
    history = tmp_path / "h.json"
    history.write_text(json.dumps(planted_conversation(seed=1, topics=1, turns_per_topic=4)[0]))
    before = run_main(home, "list", "--json").stdout
    # In-process for speed; test_a_bad_history_file_exits_2 checks the same in a real process.
    result = run_main(home, *[a.format(history=history) for a in args])
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0] and "Traceback" not in result.stderr
    assert result.stdout == ""
    assert run_main(home, "list", "--json").stdout == before  # nothing written


def test_show_lists_each_episodes_cake_budgets(tmp_path, tiny_model_dir):
    history = tmp_path / "h.json"
    history.write_text(json.dumps(planted_conversation(seed=2, topics=2, turns_per_topic=8)[0]))
    result = run_main(tmp_path, "ingest", str(history), "--model", str(tiny_model_dir), "--budget", "80",
                      "--setting", "block_size=32", "--episodes", "2", "--setting", "layer_budgets=cake", "--setting",
                      "tau2=0.5", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["peak_total_entries"] <= 2 * (80 + 32) + 256 + 16
    shown = json.loads(run_main(tmp_path, "show", "h", "--json").stdout)
    assert shown["settings"]["layer_budgets"] == "cake" and shown["settings"]["tau2"] == 0.5
    assert all(sum(e["budgets"]) == 2 * 80 for e in shown["episodes"])
    verbose = run_main(tmp_path, "show", "h", "--verbose")  # per-layer budgets only with --verbose
    text = " ".join((verbose.stderr + verbose.stdout).split())  # rich wraps lines at the console width
    assert "cake tau1=1.0 tau2=0.5 layer budgets" in text
    for episode in shown["episodes"]:
        assert " ".join(map(str, episode["budgets"])) in text or f"{episode['budgets'][0]} x2" in text
    plain = run_main(tmp_path, "show", "h")
    assert "layer budgets" not in plain.stderr and "budgets per layer" not in plain.stdout
    assert "epicache, budget 80 per layer and KV head" in plain.stderr


def test_profile_layers_on_a_local_model_dir_then_ingest_uses_it(tmp_path, tiny_model_dir):
    """profile-layers offline on any HF model dir; the profile it stores is what ingest's `auto` picks."""
    text = tmp_path / "calibration.txt"
    text.write_text(" ".join(["Maya walks the dog in the park and Tom bakes sourdough bread ."] * 40))
    args = ("--model", str(tiny_model_dir), "--text", str(text), "--budget", "48", "--block-size", "16", "--sink", "4")
    profiled = run_main(tmp_path, "profile-layers", *args, "--plot", str(tmp_path / "layers.png"), "--json")
    assert profiled.returncode == 0, profiled.stderr
    profile = json.loads(profiled.stdout)
    assert Path(profile["path"]).parent == tmp_path / "profiles" and len(profile["sensitivity"]) == 2
    assert (tmp_path / "layers.png").read_bytes().startswith(b"\x89PNG")
    history = tmp_path / "h.json"
    history.write_text(json.dumps(planted_conversation(seed=2, topics=2, turns_per_topic=8)[0]))
    ingested = run_main(tmp_path, "ingest", str(history), "--model", str(tiny_model_dir), "--budget", "96",
                        "--setting", "block_size=32", "--episodes", "2", "--json")
    assert ingested.returncode == 0, ingested.stderr
    report = json.loads(ingested.stdout)
    assert report["layer_budgets"] == "sensitivity" and report["notes"] == []
    assert json.loads(run_main(tmp_path, "show", "h", "--json").stdout)["settings"]["alpha"] == profile["alpha"]
    missing = run_main(tmp_path, "profile-layers", "--model", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1


def test_a_bad_history_file_exits_2(tmp_path):
    bad = Path(__file__).parent / "data" / "bad" / "truncated.json"
    result = run(tmp_path, "ingest", str(bad))
    assert result.returncode == 2 and "truncated.json" in result.stderr and "Traceback" not in result.stderr


def test_rm_removes(tmp_path, tiny_model_dir):
    history = tmp_path / "h.json"
    history.write_text(json.dumps(planted_conversation(seed=2, topics=2, turns_per_topic=8)[0]))
    assert run(tmp_path, "ingest", str(history), "--model", str(tiny_model_dir), "--budget", "64",
               "--setting", "block_size=32", "--episodes", "2").returncode == 0
    assert run(tmp_path, "rm", "h").returncode == 0
    assert json.loads(run(tmp_path, "list", "--json").stdout)["conversations"] == []


def test_use_chooses_the_default_conversation_and_list_and_ask_follow_it(tmp_path, tiny_model_dir):
    history = tmp_path / "h.json"
    history.write_text(json.dumps(planted_conversation(seed=2, topics=2, turns_per_topic=8)[0]))
    for name in ("first", "second"):
        assert run_main(tmp_path, "ingest", str(history), "--name", name, "--model", str(tiny_model_dir),
                        "--budget", "64", "--setting", "block_size=32", "--episodes", "2").returncode == 0
    shown = run_main(tmp_path, "use")  # none chosen: the latest, and a note saying so
    assert shown.returncode == 0 and shown.stdout == "second\n" and "kvchat use NAME" in shown.stderr
    assert json.loads(run_main(tmp_path, "use", "--json").stdout) == {"schema": 1, "conversation": "second",
                                                                     "chosen": False}
    assert run_main(tmp_path, "use", "first").returncode == 0
    assert run_main(tmp_path, "use").stdout == "first\n"
    rows = [line.split("\t") for line in run_main(tmp_path, "list").stdout.splitlines()[1:]]
    assert {row[0]: row[-1] for row in rows} == {"first": "*", "second": ""}
    listed = json.loads(run_main(tmp_path, "list", "--json").stdout)["conversations"]
    assert {c["name"]: c["default"] for c in listed} == {"first": True, "second": False}
    answer = json.loads(run_main(tmp_path, "ask", "Where?", "--json", "--max-new-tokens", "2").stdout)
    assert answer["conversation"] == "first"
    unknown = run_main(tmp_path, "use", "nope")
    assert unknown.returncode == 2 and "unknown conversation" in unknown.stderr
    assert run_main(tmp_path, "use").stdout == "first\n"  # a refused choice changes nothing
    assert run_main(tmp_path, "rm", "first").returncode == 0  # the chosen one removed: back to the latest
    assert json.loads(run_main(tmp_path, "use", "--json").stdout)["conversation"] == "second"
    assert not (tmp_path / "default-conversation").exists()


def test_the_answers_footer_on_a_terminal_names_its_conversation(monkeypatch, capsys):
    import io

    from rich.console import Console

    from kvchat.cli import asking

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    footer = io.StringIO()
    monkeypatch.setattr(asking, "err", Console(file=footer, force_terminal=True, no_color=True, width=200))
    monkeypatch.setattr(sys, "stdin", Terminal())
    monkeypatch.setattr(asking, "_ctrl_c_stops", lambda *_: contextlib.nullcontext(lambda: False))

    def run(write, stopping):
        write("Gate 22.")
        return {"finish_reason": "stop", "conversation": "trip\x1b[31m", "episode": 2, "similarity": 0.4142,
                "reused_cache": True}

    asking._print_streamed(run, 8)
    assert capsys.readouterr().out == "Gate 22.\n"
    assert "trip, episode 2 (similarity 0.41, resident)" in footer.getvalue()
    assert "\x1b[31m" not in footer.getvalue()  # a name from the server is text, never an escape sequence


def test_help_lists_the_commands():
    result = subprocess.run([*KVCHAT, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    for command in ("ingest", "ask", "list", "show", "rm"):
        assert command in result.stdout


# --------------------------------------------------------------------------- usage errors, --version, completion


@pytest.mark.parametrize(
    "args, fragment",
    [
        ((), "Usage: kvchat"),
        (("bogus",), "No such command 'bogus'"),
        (("ingest",), "Missing argument 'HISTORY'"),
        (("ingest", "h.json", "--budget", "abc"), "Invalid value for '--budget'"),
        (("ingest", "h.json", "--budget", "1.5"), "Invalid value for '--budget'"),
        (("ingest", "h.json", "--method", "magic"), "Invalid value for '--method'"),
        (("ingest", "h.json", "--cache-precision", "int2"), "Invalid value for '--cache-precision'"),
        (("ingest", "h.json", "--block-size", "32"), "--block-size is `--setting block_size=VALUE` now"),
        (("ingest-batch", "h.json", "--no-memory"), "--no-memory is `--setting latent_memory=VALUE` now"),
        (("list", "--frobnicate"), "No such option: --frobnicate"),
        (("ask", "q?", "--max-new-tokens"), "Option '--max-new-tokens' requires an argument"),
        (("show",), "Missing argument 'NAME'"),
    ],
)
def test_usage_errors_exit_2_with_the_usage_line(tmp_path, args, fragment):
    result = run_main(tmp_path, *args)
    assert result.returncode == 2, (result.stdout, result.stderr)
    shown = result.stdout + result.stderr
    assert fragment.lower() in shown.lower() and "Usage: kvchat" in shown
    assert "kvchat: internal error" not in shown and "Traceback" not in shown


def test_version():
    result = subprocess.run([*KVCHAT, "--version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.startswith("kvchat ") and result.stderr == ""


def test_choices_are_listed_in_help(monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")
    shown = " ".join(run_main(Path("/nonexistent"), "ingest", "--help").stdout.split())
    assert "auto|epicache|recall|full" in shown and "none|icecache" in shown and "prefilled|stored" in shown


def test_shell_completion_script_and_conversation_names(ingested, monkeypatch):
    home, _ = ingested
    monkeypatch.setenv("_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION", "1")  # name the shell, not detect it
    script = run(home, "--show-completion", "bash")
    assert script.returncode == 0 and "_KVCHAT_COMPLETE" in script.stdout
    monkeypatch.setenv("_KVCHAT_COMPLETE", "complete_bash")
    monkeypatch.setenv("COMP_WORDS", "kvchat show ch")
    monkeypatch.setenv("COMP_CWORD", "2")
    completed = run(home, "show", "ch")
    assert completed.returncode == 0 and completed.stdout.split() == ["chat"]


# --------------------------------------------------------------------------- untrusted text

HOSTILE = " [/] [b]bold[/b] \x1b[31mred\x1b[0m \x1b]0;pwned\x07 \u202eevil"


@pytest.fixture(scope="module")
def hostile(tmp_path_factory, tiny_model_dir):
    """A store whose history text and model path are full of markup and escape sequences."""
    import shutil

    root = tmp_path_factory.mktemp("hostile")
    model = root / "m[" / "]x"  # the model path reads "m[/]x": rich markup's closing tag
    shutil.copytree(tiny_model_dir, model)
    messages, _ = planted_conversation(seed=3, topics=2, turns_per_topic=6)
    history = root / "h.json"
    history.write_text(json.dumps([{**m, "content": m["content"] + HOSTILE} for m in messages]))
    home = root / "home"
    result = run_main(home, "ingest", str(history), "--model", str(model), "--budget", "64",
                      "--setting", "block_size=32", "--episodes", "2")
    assert result.returncode == 0, result.stderr
    return home, str(model)


@pytest.mark.parametrize("terminal", [True, False])
def test_history_text_and_paths_are_shown_as_text(hostile, monkeypatch, terminal):
    home, model = hostile
    monkeypatch.setenv("TTY_COMPATIBLE", "1" if terminal else "0")  # rich's way to say "a terminal"
    monkeypatch.setenv("COLUMNS", "400")
    from kvchat.cli import render

    monkeypatch.setattr(render.out, "width", 400)  # a console made earlier in this process read COLUMNS then
    for args in (("show", "h"), ("list",)):
        result = run_main(home, *args)
        assert result.returncode == 0, result.stderr
        assert "\x1b" not in result.stdout and "\x07" not in result.stdout and "\u202e" not in result.stdout
        assert ("\t" in result.stdout) != terminal  # piped: tab-separated values
    shown = run_main(home, "show", "h").stdout
    assert "[/] [b]bold[/b] red  \\u202eevil" in shown  # markup as typed; the bidi override made visible
    assert model in run_main(home, "list").stdout


def test_piped_tables_are_tab_separated_and_whole(hostile):
    home, model = hostile
    lines = run_main(home, "list").stdout.splitlines()
    assert lines[0].split("\t") == ["name", "created", "model", "method", "episodes", "turns", "MiB", "default"]
    assert lines[1].split("\t")[0] == "h" and lines[1].split("\t")[2] == model and len(lines) == 2
    shown = run_main(home, "show", "h").stdout.splitlines()  # piped: the table alone (the lines above: stderr)
    assert shown[0].split("\t") == ["episode", "topic", "segments", "entries", "MiB", "medoid excerpt"]
    rows = [line.split("\t") for line in shown[1:]]
    assert len(rows) == 2 and all(len(r) == 6 for r in rows) and all(len(r[5]) > 90 for r in rows)  # not cut


@pytest.mark.parametrize("args", [("list",), ("show", "chat"), ("show", "chat", "--verbose"), ("logs",),
                                  ("path",)])
def test_piped_stdout_is_tsv_alone(ingested, args):
    """Every line a table command prints to a pipe is a row of its table: the same fields as the header line."""
    home, _ = ingested
    run_main(home, "ask", "Which gate?", "--max-new-tokens", "2")  # something for `logs`
    result = run_main(home, *args)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) >= 2 and all(len(line.split("\t")) == len(lines[0].split("\t")) >= 2 for line in lines)


def test_streamed_answers_are_cleaned(monkeypatch, capsys):
    from kvchat.answer.session import Answer
    from kvchat.cli.asking import _Asker
    from kvchat.config import AskConfig

    class FakeSession:
        def ask(self, question, *, episode, on_text, log, stop, earlier=()):
            for piece in ["a \x1b[3", "1mred\x1b", "[0m [b]x[/b] \x1b]0;t", "itle\x07 done"]:
                on_text(piece)
            return Answer("", "c", 0, 1.0, 1, 4, False, finish_reason="length")

    asker = _Asker.__new__(_Asker)
    asker.session, asker.log, asker.config = FakeSession(), True, AskConfig(4)
    asker.answer("q?", None)
    captured = capsys.readouterr()
    assert captured.out == "a red [b]x[/b]  done\n"
    assert "[answer cut at --max-new-tokens 4]" in captured.err


# --------------------------------------------------------------------------- ask: the gaps bad input found


def test_ask_marks_a_cut_off_answer(ingested):
    home, _ = ingested
    plain = run_main(home, "ask", "Which gate does the flight leave from?", "--max-new-tokens", "1")
    record = json.loads(run_main(home, "ask", "Which gate does the flight leave from?", "--max-new-tokens", "1",
                                 "--json").stdout)
    assert record["finish_reason"] in {"length", "stop"}
    assert ("[answer cut at --max-new-tokens 1]" in plain.stderr) == (record["finish_reason"] == "length")
    assert record["answer_tokens"] == (1 if record["finish_reason"] == "length" else 0)


def test_a_question_too_long_is_refused_before_it_costs(ingested):
    home, _ = ingested
    result = run_main(home, "ask", "why " * 250_000)
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1 and "the question is 999999 characters" in result.stderr
    tokens = run_main(home, "ask", "why " * 1500)  # few characters enough, too many tokens
    assert tokens.returncode == 2 and "the question is 1500 tokens; at most 1024" in tokens.stderr


def test_ask_with_stdin_closed(ingested, monkeypatch):
    """`kvchat ask <&-`: Python then has no sys.stdin at all."""
    home, _ = ingested
    monkeypatch.setattr(sys, "stdin", None)
    result = run_main(home, "ask")
    assert result.returncode == 2 and "no question" in result.stderr and "Traceback" not in result.stderr


def test_a_closed_pipe_ends_ask_quietly(ingested):
    """`kvchat ask ... | head -c1`: the reader is gone before the answer; kvchat dies of SIGPIPE as git does,
    with nothing on stderr, rather than reporting an internal error."""
    home, _ = ingested
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run([*KVCHAT, "ask", "Which gate?", "--max-new-tokens", "3"], stdout=write_end,
                                stderr=subprocess.PIPE, text=True, env=cli_env(home), timeout=300)
    finally:
        os.close(write_end)
    assert result.returncode == -signal.SIGPIPE and result.stderr == ""


def test_a_file_name_with_spaces_becomes_a_valid_conversation_name(tmp_path, tiny_model_dir):
    history = tmp_path / "WhatsApp Chat with Dana (1).json"
    history.write_text(json.dumps(planted_conversation(seed=1, topics=1, turns_per_topic=4)[0]))
    result = run_main(tmp_path, "ingest", str(history), "--model", str(tiny_model_dir), "--budget", "64", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["name"] == "WhatsApp-Chat-with-Dana-1"
    assert [c["name"] for c in json.loads(run_main(tmp_path, "list", "--json").stdout)["conversations"]] == [
        "WhatsApp-Chat-with-Dana-1"]
    given = run_main(tmp_path, "ingest", str(history), "--name", "my chat")  # a name given is checked, not changed
    assert given.returncode == 2 and "invalid conversation name 'my chat'" in given.stderr


# --------------------------------------------------------------------------- logs


def test_logs_and_no_log(ingested):
    home, _ = ingested
    before = json.loads(run_main(home, "logs", "-n", "1000", "--json").stdout)["asks"]
    assert run_main(home, "ask", "A question not to keep?", "--no-log", "--max-new-tokens", "2").returncode == 0
    assert json.loads(run_main(home, "logs", "-n", "1000", "--json").stdout)["asks"] == before
    assert run_main(home, "ask", "A question to keep?", "--max-new-tokens", "2").returncode == 0
    logged = json.loads(run_main(home, "logs", "-n", "1", "--json").stdout)
    assert logged["schema"] == 1 and len(logged["asks"]) == 1
    latest = logged["asks"][0]
    assert latest["question"] == "A question to keep?" and latest["conversation"] == "chat"
    assert set(latest["timings_ms"]) == {"embed", "route", "load", "decode"}
    assert json.loads(run_main(home, "logs", "--conversation", "chat", "-n", "1", "--json").stdout) == logged
    table = run_main(home, "logs", "-n", "1").stdout.splitlines()
    assert table[0].split("\t") == ["time", "conversation", "episode", "question", "answer"]
    assert table[1].split("\t")[3] == "A question to keep?"
    unknown = run_main(home, "logs", "--conversation", "nope")
    assert unknown.returncode == 2 and "unknown conversation" in unknown.stderr


def test_sigterm_during_an_ingest_leaves_nothing_half_written_visible(tmp_path, tiny_model_dir):
    """SIGTERM, sent once the ingest says it is on its second episode (its resumable dir `caches/.resume-<name>` then
    holds the first episode's file), unwinds: exit 143, "terminated" and what was kept, no temp dir, nothing listed;
    the resumable dir is kept (by design: the same ingest run again continues from it), hidden from the store."""
    history = tmp_path / "long.json"
    history.write_text(json.dumps(planted_conversation(seed=7, topics=6, turns_per_topic=30)[0]))
    home = tmp_path / "home"
    proc = subprocess.Popen(
        [*KVCHAT, "ingest", str(history), "--model", str(tiny_model_dir), "--budget", "64", "--setting",
         "block_size=32", "--episodes", "4"],
        env={**cli_env(home), "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if line.startswith("kvchat: episode 2/"):
            assert list((home / "caches").glob(".resume-*")), "the ingest's resumable dir should exist by now"
            proc.send_signal(signal.SIGTERM)
            break
    rest = proc.stderr.read()
    proc.wait(timeout=300)
    assert proc.returncode == 143, seen + [rest]
    said = rest.strip().splitlines()
    assert said[-2:] == ["kvchat: terminated", "kvchat: note: kept: 1 of 4 episodes done; the same ingest run again "
                         "continues from there"] and "Traceback" not in rest, said  # fmt: skip
    assert list((home / "caches").glob(".tmp-*")) == []
    assert [p.name for p in (home / "caches").glob(".resume-*")] == [".resume-long"]
    assert json.loads(run_main(home, "list", "--json").stdout)["conversations"] == []


def test_profile_layers_says_when_its_profile_overrides_a_shipped_one(tmp_path, tiny_model_dir, monkeypatch):
    text = tmp_path / "calibration.txt"
    text.write_text(" ".join(["Maya walks the dog in the park and Tom bakes sourdough bread ."] * 20))
    args = ("profile-layers", "--model", str(tiny_model_dir), "--text", str(text), "--budget", "48",
            "--block-size", "16", "--sink", "4", "--json")
    first = run_main(tmp_path, *args)
    assert first.returncode == 0 and json.loads(first.stdout)["overrides"] is None and first.stderr == ""
    shipped = tmp_path / "shipped" / "tiny.json"
    shipped.parent.mkdir()
    shipped.write_text(Path(json.loads(first.stdout)["path"]).read_text())  # as if kvchat shipped these weights'
    monkeypatch.setattr("kvchat.ingest.layer_profiles.shipped_profiles", lambda: [shipped])
    second = run_main(tmp_path, *args)
    assert json.loads(second.stdout)["overrides"] == str(shipped)
    assert "ingest now uses" in second.stderr and f"instead of the shipped {shipped}" in second.stderr


# --------------------------------------------------------------------------- cold start: no model, no torch

_NO_MODEL = [
    pytest.param(("--help",), id="help"),
    pytest.param(("ingest", "--help"), id="ingest-help"),
    pytest.param(("list",), id="list"),
    pytest.param(("show", "chat"), id="show"),
    pytest.param(("show", "nope"), id="show-unknown"),
    pytest.param(("rm", "nope"), id="rm-unknown"),
    pytest.param(("logs",), id="logs"),
    pytest.param(("doctor",), id="doctor"),
    pytest.param(("ask", "why?", "--conversation", "nope"), id="ask-unknown"),
]


def _imports(home: Path, *args: str) -> set[str]:
    """The modules `kvchat ARGS` imports, from `python -X importtime`'s report."""
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "kvchat", *args], capture_output=True,
                            text=True, env=cli_env(home), timeout=300)  # fmt: skip
    assert result.returncode in (0, 2), result.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:")}  # fmt: skip
    assert "kvchat.cli" in imported
    return imported


def _heavy_imports(home: Path, *args: str) -> set[str]:
    """Which of torch and transformers `kvchat ARGS` imports."""
    return _imports(home, *args) & {"torch", "transformers"}


@pytest.mark.parametrize("args", [p.values[0] for p in _NO_MODEL], ids=[p.id for p in _NO_MODEL])
def test_commands_without_a_model_do_not_import_transformers(ingested, args):
    home, _ = ingested
    assert "transformers" not in _heavy_imports(home, *args)


@pytest.mark.parametrize("args", _NO_MODEL)
def test_commands_without_a_model_do_not_import_torch(ingested, args):
    home, _ = ingested
    assert "torch" not in _heavy_imports(home, *args)


def test_a_question_answered_in_process_imports_neither_scikit_learn_nor_sentence_transformers(ingested):
    """Answering needs the encoder's BERT and the episodes' centroids, not their clustering (scikit-learn, with
    SciPy) nor sentence-transformers: both cost a cold `kvchat ask` time before its first answer token."""
    home, _ = ingested
    imported = _imports(home, "ask", "Where did Tom go?", "--conversation", "chat", "--local", "--max-new-tokens", "2")
    assert {"torch", "kvchat.model.encoder", "kvchat.answer.session"} <= imported  # it answered
    assert not imported & {"sklearn", "sentence_transformers"}


def test_a_batch_ask_reports_a_bad_line_by_number_and_goes_on(monkeypatch, capsys):
    from kvchat.cli.asking import _answer_lines

    class FakeAsker:
        def __init__(self):
            self.asked = []

        def answer(self, question, episode, *, as_json=False, line=None):
            if "bad" in question:
                raise UserError("the question is too long")
            self.asked.append(question.strip())

    asker = FakeAsker()
    with pytest.raises(UserError, match="1 of 3 questions failed"):
        _answer_lines(asker, ["first?\n", "\n", "bad one\n", "third?\n"], None, False)
    assert asker.asked == ["first?", "third?"]
    assert "kvchat: error: line 3: the question is too long" in capsys.readouterr().err
