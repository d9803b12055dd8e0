"""The REPL end to end on the tiny model, typed through prompt_toolkit's pipe input: /set, /episodes, a
follow-up question decoded on top of the previous exchange, and words the REPL knows kept from the model."""

from __future__ import annotations

import json

from cli_helpers import run
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput

from kvchat.cli.asking import _Asker
from kvchat.cli.options import open_store
from kvchat.cli.repl import Repl, prompt_reader
from kvchat.config import AskConfig
from kvchat.history.synthetic import planted_conversation


class _Recording:
    """The loaded model, recording every prompt text it is asked to encode."""

    def __init__(self, lm) -> None:
        self._lm, self.prompts = lm, []

    def encode(self, text, *args, **kwargs):
        self.prompts.append(text)
        return self._lm.encode(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._lm, name)


def test_repl_set_episodes_follow_up_and_help(tmp_path, tiny_model_dir, monkeypatch, capsys):
    messages, _ = planted_conversation(seed=5, topics=3, turns_per_topic=12)
    history = tmp_path / "chat.json"
    history.write_text(json.dumps(messages))
    ingest = run(tmp_path, "ingest", str(history), "--model", str(tiny_model_dir), "--budget", "80",
                 "--setting", "block_size=32", "--episodes", "3", "--setting", "prefill=block")
    assert ingest.returncode == 0, ingest.stderr
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path))
    asker = _Asker(open_store(), "chat", AskConfig(max_new_tokens=16), log=False, threads=1)
    recording = _Recording(asker.session.lm)
    asker.session.lm = recording
    said: list[str] = []
    with create_pipe_input() as typed:
        typed.send_text("/set max-new-tokens 4\n/episodes\nWhere is the hotel?\nAnd its number?\nhelp\n"
                        "clear\nWhat next?\nexit\n")
        Repl(prompt_reader(None, input=typed, output=DummyOutput()), asker, said.append).run()
    assert asker.session.config.max_new_tokens == 4 and "max-new-tokens = 4" in said
    assert [line.split()[0] for line in said if line.startswith("  ") and "MiB)" in line] == ["0", "1", "2"]
    typed_questions = {"Where is the hotel?", "And its number?", "What next?"}
    prompts = [p for p in recording.prompts if p not in typed_questions]  # less the question's length check
    assert len(prompts) == 3  # help and clear never reached the model
    first, follow_up, fresh = prompts
    assert "Where is the hotel?" in first and "Where is the hotel?" in follow_up and "And its number?" in follow_up
    answers = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert answers and answers[0].strip() in follow_up  # the previous answer is decoded before the follow-up
    assert "Where is the hotel?" not in fresh and "And its number?" not in fresh  # /clear forgot them
