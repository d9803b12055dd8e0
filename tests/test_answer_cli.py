"""`kvchat ask`'s answer settings as users give them: sampling, instructions, `-c/--continue`, the REPL's /set; on the
tiny model, each compared with the library call it stands for."""

from __future__ import annotations

import json

import pytest
from cli_helpers import run_main

from kvchat.answer.session import Session
from kvchat.config import AskConfig, Sampling
from kvchat.history.synthetic import planted_conversation
from kvchat.store import Store


@pytest.fixture(scope="module")
def home(tmp_path_factory, tiny_model_dir):
    home = tmp_path_factory.mktemp("home")
    messages, facts = planted_conversation(seed=4, topics=3, turns_per_topic=12)
    history = home / "chat.json"
    history.write_text(json.dumps(messages))
    result = run_main(home, "ingest", str(history), "--model", str(tiny_model_dir), "--budget", "80",
                      "--setting", "block_size=32", "--episodes", "3", "--setting", "prefill=block")
    assert result.returncode == 0, result.stderr
    return home, facts


def library(home, tiny_lm, encoder, question: str, earlier=(), **config) -> object:
    """The library's answer to `question` with `config` (AskConfig's fields)."""
    store = Store(home)
    try:
        session = Session(store, store.get("chat"), tiny_lm, encoder, AskConfig(**config))
        return session.ask(question, log=False, earlier=earlier)
    finally:
        store.close()


def ask(home, *args, stdin=None) -> dict:
    result = run_main(home, "ask", "--json", *args, stdin=stdin)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.parametrize(("args", "said"), [
    (("--temperature", "3"), "--temperature must be within 0..2 (got 3)"),
    (("--top-p", "0"), "--top-p must be within (0, 1] (got 0)"),
    (("--repetition-penalty", "0.5"), "--repetition-penalty must be within 1..2 (got 0.5)"),
    (("--seed", "-1"), "the sampling seed must be within 0..2^63-1 (got -1)"),
])
def test_a_sampling_option_out_of_range_is_one_line_before_any_model_loads(tmp_path, args, said):
    result = run_main(tmp_path, "ask", "Which gate?", *args)
    assert result.returncode == 2 and result.stderr.strip() == f"kvchat: error: {said}"


def test_the_same_seed_gives_the_same_answer_as_the_library(home, tiny_lm, encoder):
    home, facts = home
    question = facts[0].question
    answers = [ask(home, question, "--no-log", "--max-new-tokens", "10", "--temperature", "1.0", "--seed", str(seed),
                   "--top-p", "0.9")["answer"] for seed in (5, 5, 6)]  # fmt: skip
    expected = library(home, tiny_lm, encoder, question, max_new_tokens=10,
                       sampling=Sampling(temperature=1.0, seed=5, top_p=0.9)).text  # fmt: skip
    assert answers[0] == answers[1] == expected
    assert answers[2] == library(home, tiny_lm, encoder, question, max_new_tokens=10,
                                 sampling=Sampling(temperature=1.0, seed=6, top_p=0.9)).text  # fmt: skip


def test_instructions_and_the_repetition_penalty_are_the_librarys(home, tiny_lm, encoder):
    home, facts = home
    question = facts[1].question
    got = ask(home, question, "--no-log", "--max-new-tokens", "12", "--system", "Answer briefly .",
              "--repetition-penalty", "1.5")
    expected = library(home, tiny_lm, encoder, question, max_new_tokens=12, system="Answer briefly .",
                       sampling=Sampling(repetition_penalty=1.5))  # fmt: skip
    assert got["answer"] == expected.text and got["prompt_tokens"] == expected.prompt_tokens


def test_continue_follows_up_the_last_logged_exchange(home, tiny_lm, encoder):
    home, facts = home
    first = ask(home, facts[2].question, "--max-new-tokens", "8")  # logged
    follow_up = "And what colour was it?"
    got = ask(home, "-c", follow_up, "--max-new-tokens", "8", "--no-log")
    earlier = ((facts[2].question, first["answer"]),)
    expected = library(home, tiny_lm, encoder, follow_up, max_new_tokens=8, earlier=earlier)
    assert first["answer"] and got["answer"] == expected.text and got["episode"] == expected.episode
    assert got["prompt_tokens"] == expected.prompt_tokens > ask(home, follow_up, "--max-new-tokens", "8",
                                                                "--no-log")["prompt_tokens"]  # fmt: skip
    assert not got["off_topic"]


def test_continue_with_nothing_to_follow_up_is_one_line(tmp_path, home):
    home, _ = home
    result = run_main(home, "ask", "-c", "And then?", "--conversation", "nosuch")
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "no answered question about conversation 'nosuch'" in result.stderr


def test_the_repl_sets_sampling_and_instructions(home, monkeypatch):
    from kvchat.cli.asking import _Asker
    from kvchat.cli.options import open_store
    from kvchat.cli.repl import Repl

    home, _ = home
    monkeypatch.setenv("KVCHAT_HOME", str(home))
    asker = _Asker(open_store(), "chat", AskConfig(max_new_tokens=4), log=False, threads=1)
    said: list[str] = []
    lines = iter(["/set temperature 0.7", "/set top-p 0.9", "/set seed 11", "/set repetition-penalty 1.3",
                  "/set system Answer in one word .", "/set temperature 9", "/set temperature hot", "/set seed off",
                  "/set"])  # fmt: skip

    def read(prompt: str) -> str:
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    Repl(read, asker, said.append).run()
    assert asker.session.config.sampling == Sampling(temperature=0.7, top_p=0.9, seed=None, repetition_penalty=1.3)
    assert asker.session.config.system == "Answer in one word ."
    assert "temperature = 0.7" in said and "seed = 11" in said and "seed = default" in said
    assert "error: temperature must be within 0..2 (got 9)" in said
    assert "error: /set temperature takes a number" in said
    assert any("temperature 0.7" in s and "system 'Answer in one word .'" in s for s in said)
