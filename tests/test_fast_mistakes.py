"""Fast mistakes (issue 45, item 6): a missing file, an unknown format, an existing or invalid name, a bad option
value are refused with one line before torch (or transformers, or scikit-learn) is imported; `kvchat show` labels
topics without scikit-learn; an empty `list` or `logs` says what to run.

Each case runs kvchat in a real process through a tiny wrapper that, as the process exits, writes which of the
heavy libraries were imported: what is checked is that they were not, never a time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import cli_env
from conftest import centroid
from hypothesis import given, settings
from hypothesis import strategies as st
from test_store import FP, SETTINGS, STATS, _tensors

from kvchat.history.topics import _without_speakers, topic_labels
from kvchat.store import Store

HEAVY = ("torch", "transformers", "sklearn")
_WRAPPER = (
    "import atexit, sys\n"
    f"atexit.register(lambda: sys.stderr.write('imported: ' + ','.join(m for m in {HEAVY!r} if m in sys.modules)"
    " + '\\n'))\n"
    "sys.argv = ['kvchat', *sys.argv[1:]]\n"
    "from kvchat.cli import main\n"
    "main()\n"
)


def _kvchat(home: Path, *args: str, stdin: str | None = None) -> tuple[subprocess.CompletedProcess, set[str]]:
    """`kvchat ARGS` in a new process, and which of HEAVY it had imported when it exited."""
    result = subprocess.run([sys.executable, "-c", _WRAPPER, *args], input=stdin, capture_output=True, text=True,
                            env=cli_env(home), timeout=300)  # fmt: skip
    marks = [line for line in result.stderr.splitlines() if line.startswith("imported: ")]
    assert len(marks) == 1, result.stderr
    result.stderr = "\n".join(line for line in result.stderr.splitlines() if not line.startswith("imported: "))
    return result, {m for m in marks[0].removeprefix("imported: ").split(",") if m}


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """A store holding conversation "trip" (two episodes, written directly: no model needed) and a history file."""
    home = tmp_path_factory.mktemp("home")
    store = Store(home)
    with store.begin("trip") as pending:
        for i, text in enumerate(("Tom: the flight to Lisbon leaves from gate 52 at nine",
                                  "Ana: my sourdough starter Gerald needs feeding every morning")):
            pending.write_episode(i, _tensors(i), {"fingerprint": FP, "method": "epicache"}, centroid=centroid(0.5 * i),
                                  medoid_text=text, budgets=[8, 12], n_tokens=20)  # fmt: skip
        pending.commit(model="default", fingerprint=FP, settings=SETTINGS, stats=STATS)
    store.close()
    (home / "history.json").write_text(json.dumps([{"role": "user", "content": "We land on May 3rd."},
                                                   {"role": "assistant", "content": "Noted."}]))
    (home / "notes.txt").write_text("groceries\nmilk, eggs\n")
    return home


@pytest.mark.parametrize("args, fragment", [
    (("ingest", "{home}/missing.json"), "missing.json: no such file"),
    (("ingest", "{home}/notes.txt"), 'is not valid JSON, nor a "Name: text" transcript'),
    (("ingest", "{home}/history.json", "--format", "whatsapp-ish"), "Invalid value for '--format'"),
    (("ingest", "{home}/history.json", "--format", "locomo"), "that is not a LoCoMo conversation"),
    (("ingest", "{home}/history.json", "--name", "trip"), "conversation 'trip' exists; use --replace"),
    (("ingest", "{home}/history.json", "--name", "my trip"), "invalid conversation name 'my trip'"),
    (("ingest", "{home}/history.json", "--budget", "0"), "--budget must be >= 1 (got 0)"),
    (("ingest", "{home}/history.json", "--setting", "tau1=0"), "tau1 must be in (0, 10]"),
    (("ingest", "{home}/history.json", "--threads", "0"), "Invalid value for '--threads'"),
    (("ingest", "{home}/history.json", "--max-memory", "0"), "--max-memory must be >= 1 MiB"),
    (("ingest", "{home}/history.json", "--append", "--name", "nope"), "unknown conversation 'nope'"),
    (("ingest-batch", "{home}/missing.json"), "missing.json: no such file"),
    (("ingest-batch", "{home}/history.json", "--budget", "0"), "--budget must be >= 1 (got 0)"),
    (("ask", "Which gate?", "--conversation", "nope", "--local"), "unknown conversation 'nope'"),
    (("ask", "Which gate?", "--episode", "7", "--local"), "--episode 7 does not exist"),
    (("ask", "Which gate?", "--max-new-tokens", "0"), "--max-new-tokens must be >= 1"),
    (("show", "nope"), "unknown conversation 'nope'"),
], ids=lambda value: value if isinstance(value, str) else None)
def test_a_mistake_is_refused_before_torch_is_imported(home, args, fragment):
    before = sorted(p.name for p in (home / "caches").iterdir())
    result, imported = _kvchat(home, *[a.format(home=home) for a in args])
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert fragment in result.stderr and "Traceback" not in result.stderr
    if result.stderr.startswith("kvchat: error: "):  # kvchat's own refusals: one line (click's: its usage too)
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not imported, f"{' '.join(args)} imported {imported} before refusing"
    assert sorted(p.name for p in (home / "caches").iterdir()) == before  # nothing written


def test_show_labels_topics_without_scikit_learn(home):
    result, imported = _kvchat(home, "show", "trip")
    assert result.returncode == 0, result.stderr
    rows = [line.split("\t") for line in result.stdout.splitlines()]
    assert rows[0][:2] == ["episode", "topic"]
    assert [row[1] for row in rows[1:]] == ["flight, gate, leaves", "feeding, gerald, morning"]
    assert not imported  # neither scikit-learn nor torch


def test_an_empty_list_and_log_say_what_to_run(tmp_path):
    result, _ = _kvchat(tmp_path / "empty", "list")
    assert result.returncode == 0
    assert result.stdout.splitlines() == ["name\tcreated\tmodel\tmethod\tepisodes\tturns\tMiB\tdefault"]  # TSV header
    assert "no conversations yet; `kvchat ingest HISTORY` stores one" in result.stderr
    result, _ = _kvchat(tmp_path / "empty", "logs")
    assert result.returncode == 0 and "`kvchat ingest HISTORY` stores one, then `kvchat ask QUESTION`" in result.stderr


def test_an_empty_log_of_a_stored_conversation_says_how_to_ask(home):
    result, _ = _kvchat(home, "logs")
    assert result.returncode == 0 and "no questions asked yet" in result.stderr
    assert "`kvchat ask QUESTION` asks one" in result.stderr
    result, _ = _kvchat(home, "logs", "--conversation", "trip")
    assert "`kvchat ask --conversation trip QUESTION` asks one" in result.stderr


_WORDS = st.sampled_from(["gate", "flight", "Lisbon", "the", "and", "sourdough", "Gerald", "dog's", "x-ray", "42",
                          "Tom:", "café", "about", "garden", "tomato", "plants", "ok", "\n"])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(_WORDS, max_size=30).map(" ".join), min_size=1, max_size=5))
def test_topic_labels_are_scikit_learns_tf_idf(texts):
    """The labels computed with numpy weigh words as TfidfVectorizer(stop_words="english", sublinear_tf=True) did."""
    from sklearn.feature_extraction.text import TfidfVectorizer

    vectorizer = TfidfVectorizer(stop_words="english", token_pattern=r"(?u)\b[^\W\d_][\w'-]{2,}\b",
                                 sublinear_tf=True)  # kvchat's labels before they were computed here
    try:
        weights = vectorizer.fit_transform([_without_speakers(t) for t in texts]).toarray()
    except ValueError:  # nothing but stop words
        expected = ["" for _ in texts]
    else:
        vocabulary = vectorizer.get_feature_names_out()
        expected = [", ".join(vocabulary[i] for i in np.argsort(-row, kind="stable")[:3] if row[i] > 0)
                    for row in weights]
    assert topic_labels(texts) == expected
