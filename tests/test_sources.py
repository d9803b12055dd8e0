"""Receipts (`ask --sources`): turn spans as ingest tokenizes, attention per turn, old stores, the off-topic flag."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
from cli_helpers import run_main

from kvchat import documents
from kvchat.answer.session import Session
from kvchat.answer.sources import SourceRecorder, quote, rank
from kvchat.cli.words import spell
from kvchat.config import AskConfig, CacheConfig, EpisodeConfig, IngestConfig
from kvchat.history.loading import Turn
from kvchat.history.spans import TurnSpan
from kvchat.history.synthetic import OFF_TOPIC_QUESTIONS, planted_conversation, recalled
from kvchat.history.tokens import turn_spans
from kvchat.ingest.pipeline import build_episodes, commit_ingest, ingest, plan_ingest, write_episode
from kvchat.kv.attention import LayerView, Retrieved
from kvchat.kv.layers import UniformLayer
from kvchat.model.llm import ChatLayout
from kvchat.store import Store

SMALL = IngestConfig(cache=CacheConfig(budget=96, block_size=48, prefill="block"),
                     episodes=EpisodeConfig(patched_prompt_tokens=48))
SOURCE_KEYS = {"turn", "turn_id", "speaker", "time", "quote", "attention_share", "kept_tokens", "tokens", "recalled"}


def _turns(seed: int = 3) -> tuple[list[Turn], list]:
    messages, facts = planted_conversation(seed=seed, topics=4, turns_per_topic=16)
    return [Turn(m["role"], m["content"]) for m in messages], facts


def test_turn_spans_cover_the_history_as_ingest_tokenizes_it(tiny_lm):
    turns, _ = _turns()
    layout = ChatLayout.from_tokenizer(tiny_lm.tokenizer, SMALL.system_prompt)
    offset = tiny_lm.encode(layout.before_conversation).shape[-1]
    ids = tiny_lm.encode("\n".join(f"{t.role}: {t.text}" for t in turns))[0]
    spans = turn_spans(tiny_lm.tokenizer, turns, offset)
    assert spans[0].start == offset and spans[-1].end == offset + len(ids)
    assert all(a.end == b.start for a, b in zip(spans, spans[1:], strict=False))  # contiguous, every token owned once
    for span, turn in zip(spans, turns, strict=True):
        assert tiny_lm.decode(ids[span.start - offset : span.end - offset].tolist()).split() == (
            f"{turn.role} : {turn.text}".replace(".", " .").replace(",", " ,").replace("'", " ' ").split())


def _spans() -> list[TurnSpan]:  # a system prompt at 0..1, then three turns
    return [TurnSpan(2, 5, 0, "Maya", "hello there"), TurnSpan(5, 9, 1, "Tom", "the gate is C42"),
            TurnSpan(9, 12, 2, "Maya", "thanks")]


def test_the_turn_the_answer_attends_to_is_the_top_source():
    positions = torch.tensor([[0, 1, 3, 4, 6, 7, 10, 11, 12], [0, 1, 2, 5, 6, 9, 10, 11, 12]])  # 12: the question
    layer = UniformLayer.of(torch.zeros(1, 2, 9, 4), torch.zeros(1, 2, 9, 4), positions)
    cache = SimpleNamespace(layers=[layer], next_position=12)
    recorder = SourceRecorder(cache, _spans())
    weights = torch.full((2, 2, 1, 9), 0.01)
    weights[0, :, 0, 4:6] = 0.3   # head 0: positions 6, 7 (Tom's turn)
    weights[1, :, 0, 3:5] = 0.3   # head 1: positions 5, 6 (Tom's turn)
    weights[:, :, 0, 0] = 0.5     # the attention sink, in no turn
    recorder.record(LayerView(0, weights, 8, torch.zeros(1, 4, 1, 4)))
    kept = recorder.kept_tokens()
    assert kept.tolist() == [1.5, 2.0, 2.5]  # per turn, mean over the two heads (12, the question's, in none)
    top = rank(recorder.spans, recorder.mass, kept, 2, 40)
    assert top[0].turn == 1 and top[0].speaker == "Tom" and top[0].tokens == 4 and top[0].attention_share > 0.8
    every = rank(recorder.spans, recorder.mass, kept, 3, 40)
    assert sum(s.attention_share for s in every) == pytest.approx(1, abs=1e-3)
    upper = SourceRecorder(cache, _spans(), first_layer=1)  # layers below first_layer are not counted
    upper.record(LayerView(0, weights, 8, torch.zeros(1, 4, 1, 4)))
    assert not upper.mass.any() and rank(upper.spans, upper.mass, kept, 3, 40) == []


def test_retrieved_entries_count_for_their_turn():
    """IceCache: a head's columns are its cached entries, then what it retrieved for this forward."""
    pool = SimpleNamespace(current=[
        Retrieved(torch.zeros(1, 4), torch.zeros(1, 4), torch.tensor([10]), torch.tensor([0])),
        Retrieved(torch.zeros(1, 4), torch.zeros(1, 4), torch.tensor([3]), torch.tensor([0])),
    ])
    layer = SimpleNamespace(positions=(torch.tensor([0, 1, 6, 13]), torch.tensor([0, 1, 7, 13])), pool=pool)
    recorder = SourceRecorder(SimpleNamespace(layers=[layer], next_position=13), _spans())
    weights = torch.zeros(2, 1, 1, 5)  # per head: 3 cached, 1 retrieved, the new token
    weights[:, 0, 0, 3] = 1.0          # all on the retrieved entry
    recorder.record(LayerView(0, weights, 4, torch.zeros(1, 2, 1, 4)))
    assert recorder.mass[:3].tolist() == [1.0, 0.0, 1.0]  # head 0 retrieved 10 (turn 2), head 1 retrieved 3 (turn 0)


def test_a_compacted_cache_counts_entries_by_origin_and_recalled_tokens_for_their_turns():
    """Keys re-rotated to 0..4, `origins` their original positions; after the cache, recalled text (positions 5..7:
    history turn 7, which the episode does not hold, then turn 1, which it does), then the question (8)."""
    held = UniformLayer.of(torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4), torch.arange(5).expand(2, 5))
    cache = SimpleNamespace(layers=[held], next_position=5)
    origins = [[torch.tensor([0, 1, 5, 6, 11]), torch.tensor([0, 1, 3, 9, 10])]]
    recalled = [TurnSpan(0, 2, 7, "Ann", "the code is 4711"), TurnSpan(2, 3, 1, "Tom", "the gate is C42")]
    recorder = SourceRecorder(cache, _spans(), origins=origins, recalled=recalled)
    kept = recorder.kept_tokens()
    assert kept.tolist() == [0.5, 1.0, 1.5, 0.0]  # by origin: head 0 holds 5, 6 (turn 1), 11; head 1 3, 9, 10
    cache.layers = [UniformLayer.of(torch.zeros(1, 2, 9, 4), torch.zeros(1, 2, 9, 4), torch.arange(9).expand(2, 9))]
    prompt = torch.zeros(2, 1, 1, 9)  # the question's forward: the recalled text and the question are its own tokens
    prompt[0, 0, 0, 6] = 1.0          # recalled turn 7
    prompt[1, 0, 0, 2] = 1.0          # compacted position 2 of head 1: origin 3, turn 0
    recorder.record(LayerView(0, prompt, 5, torch.zeros(1, 2, 1, 4)))
    cache.next_position = 8           # a decode step: the recalled text is cached now, 8 is this forward's
    step = torch.zeros(2, 1, 1, 9)
    step[0, 0, 0, [0, 2, 7]] = torch.tensor([0.5, 0.25, 0.25])  # the sink, origin 5 (turn 1), recalled turn 1
    step[1, 0, 0, [4, 8]] = 0.5       # origin 10 (turn 2), the step's own token (no turn)
    recorder.record(LayerView(0, step, 8, torch.zeros(1, 2, 1, 4)))
    assert recorder.mass.tolist() == [1.0, 0.5, 0.5, 1.0, 1.0]  # turns 0, 1, 2, recalled 7, none
    top = rank(recorder.spans, recorder.mass, kept, 4, 40, recorder.recalled)
    assert [(s.turn, s.recalled) for s in top] == [(0, False), (7, True), (1, True), (2, False)]
    assert (top[1].speaker, top[1].kept_tokens, top[1].tokens) == ("Ann", 0, 2)  # recalled only: not in the cache
    assert (top[2].kept_tokens, top[2].tokens) == (1, 4)  # stored and recalled: the cache's tokens of it
    assert sum(s.attention_share for s in top) == pytest.approx(1, abs=1e-3)


def test_quote_cuts_at_a_word_boundary():
    assert quote("The   secret\ningredient is smoked paprika", 30) == "The secret ingredient is…"
    assert quote("short one", 30) == "short one"


@pytest.fixture(scope="module")
def stored(tmp_path_factory, tiny_lm, encoder):
    store = Store(tmp_path_factory.mktemp("home"))
    turns, facts = _turns()
    ingest(turns, name="conv", config=SMALL, store=store, lm=tiny_lm, encoder=encoder, source="planted")
    return store, facts


def test_sources_name_turns_and_do_not_change_the_answer(stored, tiny_lm, encoder):
    store, facts = stored
    session = Session(store, store.get("conv"), tiny_lm, encoder, AskConfig(max_new_tokens=6))
    plain = session.ask(facts[0].question, log=False)
    receipted = session.ask(facts[0].question, log=False, sources=True)
    assert plain.sources is None and plain.sources_note is None
    assert receipted.text == plain.text and receipted.sources_note is None
    assert 1 <= len(receipted.sources) <= 3
    assert all(0 < s.attention_share <= 1 and 0 <= s.kept_tokens <= s.tokens for s in receipted.sources)
    shares = [s.attention_share for s in receipted.sources]
    assert shares == sorted(shares, reverse=True)
    line = documents.answer(facts[0].question, receipted)
    assert set(line["sources"][0]) == SOURCE_KEYS and line["off_topic"] is False and line["schema"] == 1
    json.dumps(line)


def test_receipts_are_recorded_in_one_forward_over_the_decoded_answer(stored, tiny_lm, encoder, monkeypatch):
    """The answer is decoded as without sources (the decode step, no recorder); then one forward of the question's
    last token and the answer, on the question's other entries as they were cached, records the attention of every
    query that chose an answer token."""
    store, facts = stored
    session = Session(store, store.get("conv"), tiny_lm, encoder, AskConfig(max_new_tokens=24, echo_guard=False))
    plain = session.ask(facts[1].question, log=False)
    forwards: list[tuple[int, int, int]] = []  # per recorded layer view: tokens fed, rows weighed, rows read
    record = SourceRecorder.record

    def counted(self, view):
        forwards.append((view.weights.shape[-1] - view.past, view.weights.shape[2], self.query_rows))
        record(self, view)

    monkeypatch.setattr(SourceRecorder, "record", counted)
    receipted = session.ask(facts[1].question, log=False, sources=True)
    assert receipted.text == plain.text and receipted.sources
    chose = receipted.answer_tokens - (receipted.finish_reason == "length")  # a cut answer's last token chose none
    assert forwards == [(1 + chose, 1 + chose, 1 + chose)] * tiny_lm.num_layers  # one forward: each layer once


def test_a_store_without_turn_spans_answers_without_sources_and_says_why(tmp_path, tiny_lm, encoder):
    """Conversations ingested before kvchat stored turn spans: every episode file lacks them."""
    store = Store(tmp_path)
    turns, facts = _turns()
    plan = plan_ingest(turns, name="old", config=SMALL, store=store, lm=tiny_lm, encoder=encoder)
    plan = dataclasses.replace(plan, turn_spans=())
    with store.begin("old") as pending:
        built = list(build_episodes(plan, tiny_lm, scratch=pending.scratch_dir))
        records = [write_episode(pending, plan, b, tiny_lm) for b in built]
        commit_ingest(pending, plan, [b.stats() for b in built], records, tiny_lm, 0.0)
    answer = Session(store, store.get("old"), tiny_lm, encoder, AskConfig(max_new_tokens=4)).ask(
        facts[0].question, sources=True, log=False)
    assert answer.sources is None and "before kvchat recorded turn spans" in answer.sources_note
    assert "kvchat ingest" in spell(answer.sources_note)  # the command that rebuilds it


def test_off_topic_questions_are_flagged_and_refused_on_request(stored, tiny_lm, encoder):
    store, facts = stored
    flagging = Session(store, store.get("conv"), tiny_lm, encoder, AskConfig(max_new_tokens=2))
    assert flagging.ask(OFF_TOPIC_QUESTIONS[0], log=False).off_topic
    nearest = max((f.question for f in facts), key=lambda q: flagging.route(q)[1])
    assert not flagging.ask(nearest, log=False).off_topic
    refusing = Session(store, store.get("conv"), tiny_lm, encoder, AskConfig(refuse_off_topic=True))
    refused = refusing.ask(OFF_TOPIC_QUESTIONS[0], log=False)
    assert refused.finish_reason == "refused" and refused.text == "" and refused.answer_tokens == 0


def test_cli_sources_json_and_refusal_exit_code(tmp_path, tiny_model_dir):
    messages, facts = planted_conversation(seed=5, topics=3, turns_per_topic=12)
    history = tmp_path / "chat.json"
    history.write_text(json.dumps(messages))
    home = tmp_path / "home"
    made = run_main(home, "ingest", str(history), "--model", str(tiny_model_dir), "--budget", "80",
                    "--setting", "block_size=32", "--episodes", "3", "--setting", "prefill=block")
    assert made.returncode == 0, made.stderr
    asked = run_main(home, "ask", facts[0].question, "--sources", "--json", "--max-new-tokens", "3")
    assert asked.returncode == 0, asked.stderr
    assert set(json.loads(asked.stdout)["sources"][0]) == SOURCE_KEYS
    shown = run_main(home, "ask", facts[0].question, "--sources", "--max-new-tokens", "3")
    assert shown.returncode == 0 and "sources (episode" in shown.stdout and "tokens kept" in shown.stdout
    refused = run_main(home, "ask", "--refuse-off-topic", stdin=f"{OFF_TOPIC_QUESTIONS[1]}\n{facts[0].question}\n")
    assert refused.returncode == 3, refused.stderr
    assert "not answered: no episode matches" in refused.stderr and refused.stdout.strip()  # the second answered


def test_embedded_model_names_the_planted_turn_among_its_top_sources(tmp_path, default_lm, encoder):
    """Integration: the default model at a budget that compresses the history (benchmarks/receipts.py runs more)."""
    messages, facts = planted_conversation(seed=7, topics=4, turns_per_topic=24)
    store = Store(tmp_path)
    ingest([Turn(m["role"], m["content"]) for m in messages], name="planted", store=store, lm=default_lm,
           encoder=encoder, config=IngestConfig(cache=CacheConfig(budget=256)), source="planted")
    fact = next(f for f in facts if f.topic == "garden")
    answer = Session(store, store.get("planted"), default_lm, encoder, AskConfig(max_new_tokens=24)).ask(
        fact.question, sources=True, log=False)
    assert recalled(answer.text, fact), answer.text
    assert fact.turn in [s.turn for s in answer.sources]
    assert answer.sources[0].kept_tokens <= answer.sources[0].tokens


def test_the_repl_sources_command_turns_receipts_on_and_off():
    from kvchat.cli.repl import Repl

    actions, said = SimpleNamespace(sources=False), []
    lines = iter(["/sources", "/sources off", "/sources on", "/sources maybe"])

    def read(prompt: str) -> str:
        line = next(lines, None)
        if line is None:
            raise EOFError
        return line

    def say(message: str) -> None:
        said.append((message, actions.sources))

    Repl(read, actions, say).run()
    assert [state for message, state in said[:3]] == [True, False, True]
    assert said[3][0] == "error: /sources takes on or off" and actions.sources


def test_routed_episodes_name_the_history_turns_they_hold(tmp_path, tiny_lm, encoder):
    """`--method routed`: an episode's cache holds its own turns from the system prompt on; its spans say so."""
    store = Store(tmp_path)
    turns, facts = _turns()
    config = IngestConfig(cache=CacheConfig(method="routed", budget=4096, block_size=64),
                          episodes=EpisodeConfig(patched_prompt_tokens=48))
    ingest(turns, name="routed", config=config, store=store, lm=tiny_lm, encoder=encoder, source="planted")
    session = Session(store, store.get("routed"), tiny_lm, encoder, AskConfig(max_new_tokens=4))
    for fact in facts:
        answer = session.ask(fact.question, sources=True, log=False)
        assert answer.sources, answer.sources_note
        for s in answer.sources:  # a budget above every episode: each turn is held whole
            assert s.kept_tokens == s.tokens and s.speaker == turns[s.turn].role
            assert s.quote == quote(turns[s.turn].text, AskConfig.quote_chars)


def test_an_append_extends_the_stored_turn_spans(tmp_path, tiny_lm, encoder):
    from kvchat.history.spans import from_metadata
    from kvchat.ingest.append import append

    store = Store(tmp_path)
    turns, _ = _turns()
    ingest(turns[:40], name="grow", config=SMALL, store=store, lm=tiny_lm, encoder=encoder, source="planted")
    append(turns[40:], name="grow", store=store, lm=tiny_lm, encoder=encoder, source="more")
    record = store.get("grow")
    spans = from_metadata(store.load_episode(record.episodes[0], tiny_lm.fingerprint)[1])
    assert [s.index for s in spans] == list(range(len(turns)))
    assert all(a.end == b.start for a, b in zip(spans, spans[1:], strict=False))
    assert spans[-1].end == spans[0].start + record.stats["history_tokens"]
