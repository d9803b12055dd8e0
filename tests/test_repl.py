"""The REPL's loop without a terminal: scripted lines in, questions and messages out."""

from __future__ import annotations

import pytest

from kvchat.cli.repl import HELP, Repl
from kvchat.errors import UserError


class Script:
    """Feeds lines (or raises what is given in their place), records prompts."""

    def __init__(self, *lines):
        self.lines, self.prompts = list(lines), []

    def __call__(self, prompt: str) -> str:
        self.prompts.append(prompt)
        if not self.lines:
            raise EOFError
        item = self.lines.pop(0)
        if isinstance(item, BaseException) or (isinstance(item, type) and issubclass(item, BaseException)):
            raise item
        return item


class Fake:
    def __init__(self, episodes: int = 3, interrupt_on: str | None = None, fail_on: str | None = None):
        self.asked: list[tuple[str, int | None]] = []
        self.n_episodes, self.interrupt_on, self.fail_on, self.switched = episodes, interrupt_on, fail_on, []
        self.earlier: list = []
        self.config = {"max_new_tokens": 64, "retrieve": None}

    def answer(self, question, episode, earlier=()):
        self.asked.append((question, episode))
        self.earlier.append(earlier)
        if question == self.interrupt_on:
            raise KeyboardInterrupt
        if question == self.fail_on:
            raise UserError("--episode 7 does not exist")
        return f"answer to {question}"

    def episodes(self):
        return [f"  {i}  topic {i}  (0.1 MiB)" for i in range(self.n_episodes)]

    def settings(self):
        return dict(self.config)

    def configure(self, field, value):
        self.config[field] = value

    def switch(self, name):
        if name == "nope":
            raise UserError("unknown conversation 'nope'")
        self.switched.append(name)
        return 5

    def episode_count(self):
        return self.n_episodes


def run(*lines, **fake):
    actions, said = Fake(**fake), []
    read = Script(*lines)
    Repl(read, actions, said.append).run()
    return actions, said, read


def test_questions_are_answered_until_exit():
    actions, said, _ = run("first?", "  ", "second?", "exit", "never asked")
    assert actions.asked == [("first?", None), ("second?", None)]


@pytest.mark.parametrize("word", ["exit", "quit", "/exit", "/quit", " quit "])
def test_exit_words(word):
    actions, _, read = run(word, "after?")
    assert actions.asked == [] and read.lines == ["after?"]


def test_ctrl_d_ends_and_ends_the_line():
    actions, said, _ = run("q?")
    assert actions.asked == [("q?", None)] and said[-1] == ""  # a newline, so the shell prompt starts afresh


@pytest.mark.parametrize("command", ["/help", "/?"])
def test_help_is_not_sent_to_the_model(command):
    actions, said, _ = run(command)
    assert actions.asked == [] and HELP in said


def test_unknown_slash_command_is_not_a_question():
    actions, said, _ = run("/frobnicate now")
    assert actions.asked == [] and any("unknown command /frobnicate" in s for s in said)


def test_multi_line_questions():
    actions, _, read = run("!multi", "line one", "line two", "!end", '"""', "a", "b", '"""', '"""x', 'y"""',
                           '"""single"""')
    assert [q for q, _ in actions.asked] == ["line one\nline two", "a\nb", "x\ny", "single"]
    assert read.prompts[:4] == ["> ", "... ", "... ", "... "]


def test_a_stray_end_is_not_sent_as_a_question():
    actions, said, _ = run("!end", "q?")
    assert actions.asked == [("q?", None)] and any("nothing to close" in s for s in said)


def test_a_pasted_block_stays_one_question():
    """prompt_toolkit's bracketed paste hands the loop one line holding newlines."""
    actions, _, _ = run("What did Maya say\nabout the gate?")
    assert actions.asked == [("What did Maya say\nabout the gate?", None)]


def test_ctrl_c_during_an_answer_keeps_the_session():
    actions, said, _ = run("slow?", "next?", interrupt_on="slow?")
    assert [q for q, _ in actions.asked] == ["slow?", "next?"] and "[interrupted]" in said


def test_ctrl_c_at_the_prompt_drops_the_line():
    actions, _, _ = run(KeyboardInterrupt(), "q?")
    assert actions.asked == [("q?", None)]


def test_ctrl_c_inside_a_multi_line_question_drops_it():
    actions, _, _ = run("!multi", "half", KeyboardInterrupt(), "q?")
    assert actions.asked == [("q?", None)]


def test_episode_pins_and_auto_routes_again():
    actions, said, _ = run("/episode 2", "a?", "/episode 3", "/episode x", "b?", "/episode auto", "c?")
    assert actions.asked == [("a?", 2), ("b?", 2), ("c?", None)]
    assert sum("/episode takes a number from 0 to 2" in s for s in said) == 2


def test_conversation_switches_and_unpins_the_episode():
    actions, said, _ = run("/episode 1", "/conversation other", "q?", "/conversation nope", "/conversation")
    assert actions.switched == ["other"] and actions.asked == [("q?", None)]
    assert "other: 5 episodes" in said and any("unknown conversation 'nope'" in s for s in said)
    assert any("takes a conversation name" in s for s in said)


def test_a_user_error_is_shown_and_the_loop_goes_on():
    actions, said, _ = run("bad?", "good?", fail_on="bad?")
    assert [q for q, _ in actions.asked] == ["bad?", "good?"] and any(s.startswith("error: --episode 7") for s in said)


def test_a_long_line_arrives_whole():
    question = "x " * 5000 + "the question at the end?"
    actions, _, _ = run(question)
    assert actions.asked == [(question.strip(), None)]


# --------------------------------------------------------------------------- /set, /episodes, follow-ups, bare words


def test_set_changes_the_answer_settings_and_refuses_nonsense():
    actions, said, _ = run("/set max-new-tokens 200", "/set retrieve 0", "/set max-new-tokens 0", "/set colour 3",
                           "/set")
    assert actions.config == {"max_new_tokens": 200, "retrieve": 0} and actions.asked == []
    assert "max-new-tokens = 200" in said and any("whole number >= 1" in s for s in said)
    assert any("/set knows max-new-tokens, retrieve" in s for s in said)
    assert "max-new-tokens 200  retrieve 0" in said


@pytest.mark.parametrize("command", ["/episodes", "episodes"])
def test_episodes_lists_them_locally(command):
    actions, said, _ = run(command)
    assert actions.asked == [] and "  2  topic 2  (0.1 MiB)" in said


def test_a_question_follows_up_the_previous_one_until_clear():
    actions, said, _ = run("who?", "and when?", "/clear", "what?", "clear", "why?")
    assert [q for q, _ in actions.asked] == ["who?", "and when?", "what?", "why?"]
    assert actions.earlier == [(), (("who?", "answer to who?"),), (), ()]


def test_a_failed_answer_is_not_followed_up():
    actions, _, _ = run("bad", "next?", fail_on="bad")
    assert actions.earlier == [(), ()]


@pytest.mark.parametrize("word", ["help", "Help", "clear", "!end", "exit"])
def test_words_the_repl_knows_never_reach_the_model(word):
    actions, said, _ = run(word)
    assert actions.asked == []
    if word.lower() == "help":
        assert HELP in said
    if word == "!end":
        assert any("nothing to close" in s for s in said)
