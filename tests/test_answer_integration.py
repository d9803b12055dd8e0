"""The one answer path on the embedded model: `kvchat ask` and the benchmarks' harness give the same answers, and on
histories made like chat exports no answer goes on writing the transcript or loops (slow, still run in CI)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from cli_helpers import run_main
from conftest import MODELS_DIR

from kvchat.answer.session import Session
from kvchat.config import CacheConfig, EvalConfig, IngestConfig
from kvchat.eval.evaluate import ResultsFile
from kvchat.eval.gold import evaluate_gold, kvchat_variant
from kvchat.eval.qa import QASet, Question, repeats_itself
from kvchat.history.loading import load_history
from kvchat.history.synthetic import planted_export
from kvchat.ingest.pipeline import ingest
from kvchat.model.llm import load_model
from kvchat.store import Store

pytestmark = pytest.mark.slow


def _home_with_the_embedded_model(home, default_lm) -> None:
    """A store whose models dir holds the embedded model as converted once for the tests (linked, not converted
    again; `default_lm` converted it)."""
    source = next(MODELS_DIR.glob("SmolLM2-135M-Instruct*"))
    target = home / "models" / source.name
    target.mkdir(parents=True)
    for file in source.iterdir():
        try:
            os.link(file, target / file.name)
        except OSError:  # another file system
            shutil.copy2(file, target / file.name)


def test_kvchat_ask_and_the_benchmark_harness_give_the_same_answers(tmp_path, default_lm, encoder):
    home = tmp_path / "home"
    _home_with_the_embedded_model(home, default_lm)
    text, facts = planted_export(1, "transcript")
    history = tmp_path / "chat.txt"
    history.write_text(text)
    assert run_main(home, "ingest", str(history), "--name", "chat").returncode == 0  # every default
    asked = run_main(home, "ask", "--json", "--no-log", stdin="\n".join(f.question for f in facts))
    assert asked.returncode == 0, asked.stderr
    cli = [json.loads(line)["answer"] for line in asked.stdout.splitlines()]

    # benchmarks/whole_conversation.py's and answer_defaults.py's library, at kvchat's defaults (`auto@1024`)
    qa = QASet("chat", load_history(history), [Question(str(i), f.question, f.answer, 0) for i, f in enumerate(facts)])
    lm = load_model("default", home / "models", weights="auto")  # as the CLI holds it on a CPU
    records = evaluate_gold([qa], [kvchat_variant(CacheConfig(), "defaults")], lm=lm, encoder=encoder,
                            results=ResultsFile(None), config=EvalConfig())  # fmt: skip
    harness = [r["prediction"] for r in records if r["kind"] == "answer"]
    assert harness == cli and all(cli)


@pytest.mark.parametrize("style", ["transcript", "whatsapp"])
def test_no_answer_goes_on_writing_the_transcript_or_loops(tmp_path, default_lm, encoder, style):
    store = Store(tmp_path)
    for seed in (0, 1):
        text, facts = planted_export(seed, style)
        history = tmp_path / f"{style}-{seed}.txt"
        history.write_text(text)
        turns = load_history(history)
        ingest(turns, name=f"h{seed}", config=IngestConfig(), store=store, lm=default_lm, encoder=encoder)
        session = Session(store, store.get(f"h{seed}"), default_lm, encoder)
        labels = {f"{t.role}:" for t in turns}
        for fact in facts:
            answer = session.ask(fact.question, log=False)
            lines = answer.text.splitlines()
            assert answer.text and not any(line.lstrip().startswith(label) for line in lines for label in labels)
            assert not any(line.lstrip().startswith("[") and line.rstrip().endswith("]") for line in lines)
            assert not repeats_itself(answer.text), answer.text
    store.close()
