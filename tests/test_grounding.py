"""Grounded answers (kvchat.answer.grounding): an answer's terms looked for in the turns it drew on, the better quote,
`--grounded`'s refusal, receipts quoting the span the answer matches, and the off-topic signal read off retrieval."""

from __future__ import annotations

import dataclasses
import json

import pytest
from cli_helpers import run_main

from kvchat import documents
from kvchat.answer.grounding import (
    SUPPORTED,
    UNCHECKED,
    UNSUPPORTED,
    Turn,
    check,
    coverage,
    drawn_on,
    off_topic,
    quote_span,
)
from kvchat.answer.session import Session
from kvchat.config import AskConfig, CacheConfig, EpisodeConfig, GroundingConfig, IngestConfig
from kvchat.history.loading import Turn as HistoryTurn
from kvchat.history.synthetic import OFF_TOPIC_QUESTIONS, planted_conversation
from kvchat.ingest.pipeline import ingest
from kvchat.store import Store

DOOR = Turn(3, "Alex", "I changed it last week. The door code for the back entrance is 4821, don't share it.")
BOOTS = Turn(5, "Sam", "My boots got soaked crossing the glacier lake near Mount Ash. My hiking partner's dog is "
                       "named Tobermory, a huge sheepdog who hates water.")
FILLER = Turn(7, "Alex", "The weather forecast says sunny all week.")


def test_an_answer_found_in_its_turns_is_supported_whatever_its_case_stems_and_number_spelling():
    assert check("The door code is 4,821.", "What is the door code?", [FILLER, DOOR]).status == SUPPORTED
    assert check("It's Tobermory, the sheepdog.", "What is the dog called?", [BOOTS]).status == SUPPORTED
    assert check("Partners hiking near the lakes", "Where?", [BOOTS]).status == SUPPORTED  # stems
    assert check("Four.", "How many?", [Turn(1, "A", "We planted 4 rows.")]).status == SUPPORTED  # number words
    # nothing to check: a yes/no question's answer repeating its words, or an answer that drew on no turn
    assert check("Yes, the door code changed.", "Did the door code change?", [DOOR]).status == UNCHECKED
    assert check("4821", "What is the door code?", []).status == UNCHECKED


def test_an_answer_only_repeating_a_question_that_asks_for_something_is_flagged():
    echoed = check('The door code is "the door code".', "What is the door code?", [FILLER, DOOR])
    assert echoed.status == UNSUPPORTED and echoed.unsupported == []
    assert echoed.better is not None and "4821" in echoed.better.quote


def test_a_number_not_in_the_sources_is_flagged_with_the_quote_that_answers_better():
    grounding = check("The door code for the back entrance is 483.", "What is the door code?", [FILLER, DOOR])
    assert grounding.status == UNSUPPORTED and grounding.unsupported == ["483"]
    assert grounding.better is not None and grounding.better.turn == DOOR.index and grounding.better.speaker == "Alex"
    assert "4821" in grounding.better.quote and "changed it last week" not in grounding.better.quote


def test_a_name_or_mostly_unfound_words_are_flagged():
    named = check("His dog is named Rover.", "What is the dog's name?", [BOOTS])
    assert named.status == UNSUPPORTED and named.unsupported == ["Rover"]
    assert named.better is not None and "Tobermory" in named.better.quote  # a name of the same kind
    looping = check("He was a big dog with a big head. He was a big dog.", "What is the dog's name?", [BOOTS])
    assert looping.status == UNSUPPORTED and set(looping.unsupported) == {"big", "head"}
    # one unfound word among several found ones is tolerated (GroundingConfig.max_unsupported_words)
    assert check("Tobermory, a huge friendly sheepdog", "Whose dog?", [BOOTS]).status == SUPPORTED
    strict = GroundingConfig(max_unsupported_words=0.0)
    assert check("Tobermory, a huge friendly sheepdog", "Whose dog?", [BOOTS], strict).status == UNSUPPORTED


def test_the_turns_drawn_on_are_the_sources_then_the_turns_matching_the_question():
    sources = [FILLER]
    drawn = drawn_on("What is the door code?", [BOOTS, DOOR, FILLER], sources, count=3)
    assert [t.index for t in drawn] == [FILLER.index, DOOR.index]  # BOOTS shares no word with the question
    assert coverage("What is the door code?", [BOOTS, DOOR]) == 1.0
    assert coverage(OFF_TOPIC_QUESTIONS[0], [BOOTS, DOOR, FILLER]) == 0.0


def test_a_receipts_quote_is_the_span_the_answer_matches_not_the_turns_start():
    """The issue's example: the top source of "The dog's name is Tobermory." read "My boots got soaked..."."""
    quoted = quote_span(BOOTS.text, "The dog's name is Tobermory.", "What is the dog called?", 90)
    assert "Tobermory" in quoted and "boots" not in quoted and len(quoted) <= 90
    # no answer word in the turn: the span matching the question; neither: the turn's start
    assert quote_span(BOOTS.text, "Rover", "Which lake did they cross?", 90).startswith("My boots got soaked")
    assert quote_span(DOOR.text, "", "", 20) == "I changed it last…"
    long = "word " * 40 + "the code is 4821 " + "word " * 40
    assert "4821" in quote_span(long, "4821", "", 40) and len(quote_span(long, "4821", "", 40)) <= 40


def test_the_off_topic_signal_needs_both_a_weak_route_and_no_turn_holding_the_question():
    assert off_topic(0.1, 0.0, follow_up=False)
    assert not off_topic(0.1, 0.8, follow_up=False)  # a long history's broad episodes: its words are in a turn
    assert not off_topic(0.1, 0.0, follow_up=True)   # a follow-up's words are the exchange before it
    assert not off_topic(0.6, 0.0, follow_up=False)


SMALL = IngestConfig(cache=CacheConfig(budget=96, block_size=48, prefill="block"),
                     episodes=EpisodeConfig(patched_prompt_tokens=48))


@pytest.fixture(scope="module")
def stored(tmp_path_factory, tiny_lm, encoder):
    store = Store(tmp_path_factory.mktemp("home"))
    messages, facts = planted_conversation(seed=3, topics=4, turns_per_topic=16)
    ingest([HistoryTurn(m["role"], m["content"]) for m in messages], name="conv", config=SMALL, store=store,
           lm=tiny_lm, encoder=encoder, source="planted")
    return store, facts


def test_off_topic_does_not_fire_on_follow_ups_or_on_questions_whose_words_a_turn_holds(stored, tiny_lm, encoder):
    store, facts = stored
    session = Session(store, store.get("conv"), tiny_lm, encoder, AskConfig(max_new_tokens=2))
    assert session.ask(OFF_TOPIC_QUESTIONS[0], log=False).off_topic
    follow_up = session.ask(OFF_TOPIC_QUESTIONS[0], log=False, earlier=[(facts[0].question, facts[0].answer)])
    assert not follow_up.off_topic
    # every routing similarity under the threshold, as on a long history whose episodes are broad: questions whose
    # words a turn holds are still answered, the others still flagged and refused
    broad = Session(store, store.get("conv"), tiny_lm, encoder,
                    AskConfig(max_new_tokens=2, off_topic_similarity=1.01, refuse_off_topic=True))
    assert all(broad.ask(f.question, log=False).finish_reason != "refused" for f in facts)
    assert broad.ask(OFF_TOPIC_QUESTIONS[1], log=False).finish_reason == "refused"


def test_every_answer_carries_its_grounding_and_grounded_withholds_the_unsupported(stored, tiny_lm, encoder):
    store, facts = stored
    plain = Session(store, store.get("conv"), tiny_lm, encoder, AskConfig(max_new_tokens=12, echo_guard=False))
    answers = {f.question: plain.ask(f.question, log=False) for f in facts}
    assert all(a.grounding is not None and a.grounding.status in (SUPPORTED, UNSUPPORTED, UNCHECKED)
               for a in answers.values())  # fmt: skip
    question, flagged = next((q, a) for q, a in answers.items() if a.grounding.status == UNSUPPORTED)
    assert flagged.grounding.unsupported and all(w in flagged.text for w in flagged.grounding.unsupported)
    line = documents.answer(question, flagged)
    assert line["grounding"]["status"] == UNSUPPORTED and line["grounding"]["unsupported"]
    json.dumps(line)
    grounded = Session(store, store.get("conv"), tiny_lm, encoder,
                       dataclasses.replace(plain.config, grounded=True))
    shown: list[str] = []
    withheld = grounded.ask(question, log=False, on_text=shown.append)
    assert withheld.finish_reason == "unsupported" and withheld.text == "" and shown == []
    assert withheld.grounding == flagged.grounding
    kept = [q for q, a in answers.items() if a.grounding.status != UNSUPPORTED]
    for q in kept:  # answers found in their turns are given as without the flag, streamed once checked
        shown.clear()
        answer = grounded.ask(q, log=False, on_text=shown.append)
        assert answer.text == answers[q].text and "".join(shown).strip() == answer.text


def test_cli_says_what_was_not_found_and_grounded_exits_3(tmp_path, tiny_model_dir):
    messages, facts = planted_conversation(seed=5, topics=3, turns_per_topic=12)
    history = tmp_path / "chat.json"
    history.write_text(json.dumps(messages))
    home = tmp_path / "home"
    made = run_main(home, "ingest", str(history), "--model", str(tiny_model_dir), "--budget", "80",
                    "--setting", "block_size=32", "--episodes", "3", "--setting", "prefill=block")
    assert made.returncode == 0, made.stderr
    lines = run_main(home, "ask", "--json", "--max-new-tokens", "12", "--no-log",
                     stdin="".join(f.question + "\n" for f in facts))
    assert lines.returncode == 0, lines.stderr
    documents_ = [json.loads(line) for line in lines.stdout.splitlines()]
    flagged = next(d for d in documents_ if d["grounding"]["status"] == UNSUPPORTED)
    noted = run_main(home, "ask", flagged["question"], "--max-new-tokens", "12", "--no-log")
    assert noted.returncode == 0 and noted.stdout.strip() == flagged["answer"]
    assert f"note: not found in the conversation: {', '.join(flagged['grounding']['unsupported'])}" in noted.stderr
    refused = run_main(home, "ask", flagged["question"], "--max-new-tokens", "12", "--no-log", "--grounded")
    assert refused.returncode == 3 and refused.stdout == ""
    assert "not answered: not found in the conversation" in refused.stderr
    as_json = run_main(home, "ask", flagged["question"], "--max-new-tokens", "12", "--no-log", "--grounded", "--json")
    withheld = json.loads(as_json.stdout)
    assert as_json.returncode == 3 and withheld["finish_reason"] == "unsupported" and withheld["answer"] == ""
