"""The command line as users run it: real processes, exit codes, stdout/stderr contracts."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from cli_helpers import KVCHAT, run, run_main

from kvchat.synthetic import planted_conversation


@pytest.fixture(scope="module")
def ingested(tmp_path_factory, tiny_model_dir):
    """A store with one conversation ingested through the CLI on the tiny model."""
    home = tmp_path_factory.mktemp("home")
    messages, _ = planted_conversation(seed=5, topics=3, turns_per_topic=12)
    history = home / "chat.json"
    history.write_text(json.dumps(messages))
    result = run(
        home, "ingest", str(history), "--model", str(tiny_model_dir), "--budget", "80", "--block-size", "32",
        "--episodes", "3", "--json",
    )
    assert result.returncode == 0, result.stderr
    return home, json.loads(result.stdout)


def test_ingest_json_reports_the_peak(ingested):
    _, report = ingested
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


def test_ask_reads_one_question_per_stdin_line(ingested):
    home, _ = ingested
    result = run(home, "ask", "--json", "--max-new-tokens", "3", stdin="first question?\n\nsecond question?\n")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 2 and all(json.loads(line)["conversation"] == "chat" for line in lines)


def test_list_show_rm(ingested, tmp_path):
    home, _ = ingested
    listed = json.loads(run(home, "list", "--json").stdout)
    assert listed["schema"] == 1 and [c["name"] for c in listed["conversations"]] == ["chat"]
    shown = json.loads(run(home, "show", "chat", "--json").stdout)
    assert len(shown["episodes"]) == 3 and all(e["budgets"] == [80, 80] for e in shown["episodes"])
    assert "chat" in run(home, "show", "chat").stdout


@pytest.mark.parametrize(
    "args, fragment",
    [
        (("ingest", "/no/such/file.json"), "no such file"),
        (("ingest", "{history}", "--budget", "0"), "--budget must be >= 1"),
        (("ingest", "{history}", "--name", "../escape"), "name"),
        (("ingest", "{history}", "--method", "magic"), "unknown --method"),
        (("ingest", "{history}", "--tau1", "0"), "--tau1 must be in (0, 10]"),
        (("ingest", "{history}", "--tau2", "-1"), "--tau2 must be in (0, 10]"),
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
                      "--block-size", "32", "--episodes", "2", "--layer-budgets", "cake", "--tau2", "0.5", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["peak_total_entries"] <= 2 * (80 + 32) + 256 + 16
    shown = json.loads(run_main(tmp_path, "show", "h", "--json").stdout)
    assert shown["settings"]["layer_budgets"] == "cake" and shown["settings"]["tau2"] == 0.5
    assert all(sum(e["budgets"]) == 2 * 80 for e in shown["episodes"])
    text = " ".join(run_main(tmp_path, "show", "h").stdout.split())  # rich wraps lines at the console width
    assert "cake tau1=1.0 tau2=0.5 layer budgets" in text
    for episode in shown["episodes"]:
        assert " ".join(map(str, episode["budgets"])) in text or f"{episode['budgets'][0]} x2" in text


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
                        "--block-size", "32", "--episodes", "2", "--json")
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
               "--block-size", "32", "--episodes", "2").returncode == 0
    assert run(tmp_path, "rm", "h").returncode == 0
    assert json.loads(run(tmp_path, "list", "--json").stdout)["conversations"] == []


def test_help_lists_the_commands():
    result = subprocess.run([*KVCHAT, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    for command in ("ingest", "ask", "list", "show", "rm"):
        assert command in result.stdout
