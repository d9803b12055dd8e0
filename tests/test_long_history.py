"""The long generated histories (kvchat.history.long_history): deterministic, as long as asked, facts planted evenly
and updated later, questions whose evidence states the latest value, readable by kvchat's LoCoMo reader."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from kvchat.eval.qa import load_locomo
from kvchat.history.loading import format_turns, load_history
from kvchat.history.long_history import FACTS, long_history


def _words(text: str) -> int:
    return len(text.split())


@pytest.fixture(scope="module")
def made():
    return long_history(30_000, seed=3, count_tokens=_words)


def test_the_same_seed_gives_the_same_history_and_another_seed_another():
    one = long_history(5_000, seed=1, facts=20)
    assert one.to_locomo() == long_history(5_000, seed=1, facts=20).to_locomo()
    assert one.to_locomo() != long_history(5_000, seed=2, facts=20).to_locomo()


def test_it_is_as_long_as_asked_by_the_counter_given(made):
    rendered = format_turns(made.turns())
    counted = sum(_words(line) for line in rendered)
    assert made.tokens >= 30_000
    assert counted + len(rendered) == made.tokens  # each rendered line and its newline
    assert made.tokens < 30_000 + 1_000  # it stops after the session that reached the size


def test_facts_are_planted_evenly_and_some_are_updated_later(made):
    facts = made.facts
    assert len(facts) == FACTS >= 100
    updated = [f for f in facts if f.updated]
    assert len(updated) >= 10
    assert all(f.first_depth < f.depth for f in updated)
    depths = sorted([f.depth for f in facts] + [f.first_depth for f in updated])
    gaps = np.diff([0.0, *depths, 1.0])
    assert gaps.max() < 2.5 / len(depths)  # evenly spread: no stretch of the history without planted turns
    assert len({f.question for f in facts}) == len(facts)
    assert Counter(f.kind for f in facts).most_common(1)[0][1] <= 10  # many kinds of fact


def test_each_question_s_evidence_states_its_latest_value(made):
    turns = {t.turn_id: t for t in made.turns()}
    for fact in made.facts:
        said = turns[fact.evidence].text
        assert fact.answer in said and fact.subject in said
        if fact.updated:
            assert fact.first_answer in turns[fact.first_evidence].text
            assert fact.first_answer not in said
    # no other turn states the answer: the latest value is said once, where the evidence says
    for fact in made.facts:
        holding = [t for t in turns.values() if f"{fact.subject}" in t.text and fact.answer in t.text]
        assert [t.turn_id for t in holding] == [fact.evidence]


def test_kvchat_reads_it_as_a_locomo_history_with_its_questions(made, tmp_path):
    path = tmp_path / "long.json"
    path.write_text(json.dumps(made.to_locomo()))
    turns = load_history(path)
    assert [(t.role, t.text, t.time, t.turn_id) for t in turns] == [
        (t.role, t.text, t.time, t.turn_id) for t in made.turns()]  # fmt: skip
    assert set(made.speakers) == {t.role for t in turns}
    qa = load_locomo(path)
    assert len(qa.questions) == len(made.facts)
    assert [q.evidence for q in qa.questions] == [(f.evidence,) for f in made.facts]
    assert [q.gold for q in qa.questions] == [f.answer for f in made.facts]
    dates = [t.time for t in turns]
    assert len(set(dates)) == len(made.sessions) > 50  # dated sessions


def test_its_turns_are_varied_talk_about_many_topics(made):
    texts = [t.text for t in made.turns()]
    assert len(set(texts)) > 0.4 * len(texts)
    segments = ["\n".join(texts[i : i + 4]) for i in range(0, len(texts), 4)]
    assert len(set(segments)) > 0.99 * len(segments)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="at least 1000"):
        long_history(10)
    with pytest.raises(ValueError, match="facts must be"):
        long_history(5_000, facts=10_000)
