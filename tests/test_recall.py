"""`--method recall`: routed episode caches keep part of the budget, the question's chunks of raw turns the rest;
the default (`--method auto`) for a history longer than the model's window."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from kvchat.answer import recall
from kvchat.answer.rag import Chunk, RagIndex, TurnEmbeddings, interleaved_order
from kvchat.answer.session import Session
from kvchat.cli.words import spell
from kvchat.config import AskConfig, CacheConfig, EpisodeConfig, IngestConfig, RecallConfig
from kvchat.errors import UserError
from kvchat.eval.qa import planted_sets
from kvchat.history.loading import format_turns
from kvchat.ingest.pipeline import ingest, plan_ingest
from kvchat.kv import codec
from kvchat.settings import from_settings, rebuild_command, with_settings
from kvchat.store import Store

SYSTEM = "You are a helpful assistant . Conversation :\n"
QA = planted_sets(1, topics=6, turns_per_topic=40)[0]  # conftest.short_lm's window is a third of it
CONFIG = IngestConfig(
    cache=CacheConfig(budget=96, block_size=48, prefill="block", recall=RecallConfig(chunk_tokens=16)),
    episodes=EpisodeConfig(episodes=3, patched_prompt_tokens=48), system_prompt=SYSTEM,
)


def test_the_budget_splits_into_whole_chunks_and_the_episode_caches_keep_the_rest():
    assert recall.split(CacheConfig(budget=1024)) == recall.RecallSplit(512, 2, 256, "lexical", 256)
    assert recall.split(CacheConfig(budget=1000)) == recall.RecallSplit(744, 1, 256, "lexical", 256)
    small = recall.split(CacheConfig(budget=64))  # chunks shrink to fit a small budget
    assert (small.chunks, small.chunk_tokens, small.cache_budget) == (1, 32, 32)
    with pytest.raises(UserError, match="recall_share must be between 0 and 1"):
        recall.split(CacheConfig(recall=RecallConfig(share=1.0)))


@pytest.fixture(scope="module")
def stored(short_lm, encoder, tmp_path_factory):
    store = Store(tmp_path_factory.mktemp("recall"))
    report = ingest(QA.turns, name="long", config=CONFIG, store=store, lm=short_lm, encoder=encoder)
    return store, report


def test_auto_recalls_beyond_the_window_and_stays_epicache_within(stored, short_lm, tiny_lm, encoder, tmp_path):
    store, report = stored
    assert report.method == "recall"  # CONFIG leaves --method at auto (the ingest's progress announces it)
    within = plan_ingest(QA.turns[:40], name="short", config=CONFIG, store=Store(tmp_path), lm=tiny_lm,
                         encoder=encoder)  # fmt: skip
    assert within.config.cache.method == "epicache" and within.recall is None
    settings = store.get("long").settings
    assert settings["method"] == "recall" and from_settings(settings).cache.recall.chunk_tokens == 16
    assert "--method recall" in spell(rebuild_command("long", "default", settings))


def test_every_episode_cache_keeps_the_budget_less_the_recalled_chunks(stored, short_lm):
    store, _ = stored
    split = recall.split(CONFIG.cache)
    assert (split.cache_budget, split.chunks, split.chunk_tokens) == (48, 3, 16)
    records = store.get("long").episodes
    assert len(records) == 3
    indexes = []
    for record in records:
        tensors, metadata = store.load_episode(record, short_lm.fingerprint)
        cache, _ = codec.decode(tensors, metadata)
        assert max(cache.sizes) <= split.cache_budget
        indexes.append(recall.from_metadata(metadata))
    index = indexes[0]  # every file carries the whole history's chunks, in order, each within the cap
    assert all(i.chunks == index.chunks for i in indexes)
    assert index.chunks[0].first == 0 and index.chunks[-1].end == len(QA.turns)
    assert all(a.end == b.first for a, b in zip(index.chunks, index.chunks[1:], strict=False))
    assert all(c.tokens <= split.chunk_tokens for c in index.chunks)


def test_the_ingest_report_and_show_say_how_the_budget_is_shared(stored):
    from kvchat import documents
    from kvchat.cli.ingesting import _budget_text
    from kvchat.cli.stored import _summary

    store, report = stored
    assert (report.budget, report.recalled_entries) == (96, 48) and max(report.budgets) <= 48
    kept = round(sum(report.budgets) / len(report.budgets))
    assert _budget_text(report) == (f"budget 96 asked, {kept} kept on average per layer and KV head "
                                    "+ 48 recalled per question")
    shown = documents.show(store.get("long"))
    assert (shown["budget"], shown["recalled_entries"]) == (96, 48)
    line = _summary(shown, False)[1]
    assert "recall, budget 96 per layer and KV head (48 cached + 48 recalled per question), " in line


def test_a_question_is_answered_over_its_top_chunks_prefilled_on_the_cache(stored, short_lm, encoder):
    store, _ = stored
    conversation = store.get("long")
    session = Session(store, conversation, short_lm, encoder, AskConfig(max_new_tokens=2))
    question = QA.questions[0].text
    first: list[torch.Tensor] = []
    answer = session.ask(question, on_first_logits=first.append, log=False)
    _, metadata = store.load_episode(conversation.episodes[answer.episode], short_lm.fingerprint)
    index = recall.from_metadata(metadata)
    expected = index.top(encoder.embed([question])[0], 3, question)  # ranked by its words (the default)
    assert answer.recalled == [[index.chunks[i].first, index.chunks[i].end] for i in expected]
    text = "\n".join(index.chunks[i].text for i in expected)
    question_ids = short_lm.encode(session.layout.question(session.config.question_template.format(question=question)))
    assert answer.prompt_tokens == short_lm.encode("\n" + text).shape[-1] + question_ids.shape[-1]
    again: list[torch.Tensor] = []  # the same text given explicitly: the same first logits
    session.ask(question, on_first_logits=again.append, log=False, retrieved_text=text, episode=answer.episode)
    torch.testing.assert_close(first[0], again[0])
    bare: list[torch.Tensor] = []  # and something else than no recall at all
    session.ask(question, on_first_logits=bare.append, log=False, retrieved_text=" ", episode=answer.episode)
    assert not torch.allclose(first[0], bare[0])


def test_chunks_are_ranked_by_the_retrieval_the_conversation_was_built_with(stored, short_lm):
    store, _ = stored
    settings = store.get("long").settings
    assert settings["recall_retrieval"] == "lexical"
    assert recall.split(from_settings(settings).cache).retrieval == "lexical"
    dense = {k: v for k, v in settings.items() if k != "recall_retrieval"}  # a store written before lexical ranking
    assert recall.split(from_settings(dense).cache).retrieval == "dense"
    assert "recall_retrieval" not in spell(rebuild_command("long", "default", settings))  # the default
    assert "--setting recall_retrieval=dense" in spell(rebuild_command("long", "default", dense))
    index = recall.from_metadata(store.load_episode(store.get("long").episodes[0], short_lm.fingerprint)[1])
    assert index.turns is None  # turn embeddings are kept for the interleaved ranking only


def _index(texts: list[str], chunk_vectors: list[list[float]], group_starts: list[int] | None = None,
           group_vectors: list[list[float]] | None = None) -> RagIndex:
    """Chunks of two turns each, with the embeddings given (unit-normed)."""
    def unit(rows):
        a = np.asarray(rows, dtype=np.float32)
        return a / np.linalg.norm(a, axis=1, keepdims=True)

    chunks = [Chunk(2 * i, 2 * i + 2, text, 8) for i, text in enumerate(texts)]
    turns = None if group_starts is None else TurnEmbeddings(np.asarray(group_starts), unit(group_vectors))
    return RagIndex(chunks, unit(chunk_vectors), turns)


def test_interleaved_takes_the_best_by_words_then_the_chunk_of_the_nearest_turn():
    texts = ["the puppy is called Cobble", "a puppy and another puppy", "rain all week", "we went hiking"]
    query = np.asarray([1.0, 0.0, 0.0], dtype=np.float32)
    # the group of turns 5-6 (chunk 2's second turn, chunk 3's first) is nearest the question
    index = _index(texts, [[0, 1, 0]] * 4, [0, 3, 5, 7], [[0, 1, 0], [0, 0, 1], [1, 0.1, 0], [0, 1, 1]])
    question = "What is the puppy called?"
    assert index.top(query, 2, question, "lexical") == [0, 1]
    assert index.top(query, 2, question, "interleaved") == [0, 2]  # the first chunk the nearest group overlaps
    assert index.top(query, 3, question, "interleaved") == [0, 1, 2]  # then the next by words
    best = index.turns.best_per_chunk(index.chunks, query)
    assert best[2] == pytest.approx(best[3]) and best[2] > best[0]  # a group counts for every chunk it overlaps
    bare = _index(texts, [[0, 1, 0]] * 4)  # an index stored before turn embeddings: lexical
    assert bare.top(query, 2, question, "interleaved") == bare.top(query, 2, question, "lexical")


def test_interleaved_order_alternates_and_skips_what_is_taken():
    first, second = np.asarray([3, 1, 2, 0]), np.asarray([3, 0, 1, 2])
    assert interleaved_order(first, second, k=3).tolist() == [3, 0, 1]
    assert interleaved_order(first, second, k=9).tolist() == [3, 0, 1, 2]


def test_an_append_extends_the_index_with_the_new_turns(short_lm, encoder, tmp_path):
    """With the interleaved ranking: the chunks and every turn's embedding, the new turns' after the stored ones."""
    from kvchat.ingest.append import append

    store = Store(tmp_path)
    interleaved = with_settings(CONFIG, ["recall_retrieval=interleaved"])
    ingest(QA.turns[:200], name="c", config=interleaved, store=store, lm=short_lm, encoder=encoder)
    before = recall.from_metadata(store.load_episode(store.get("c").episodes[0], short_lm.fingerprint)[1])
    path = tmp_path / "more.json"
    path.write_text(json.dumps([{"role": t.role, "content": t.text} for t in QA.turns[200:]]))
    append(path, name="c", store=store, lm=short_lm, encoder=encoder)
    after = recall.from_metadata(store.load_episode(store.get("c").episodes[0], short_lm.fingerprint)[1])
    assert before.turns.starts.tolist() == list(range(200))  # what the interleaved ranking reads
    assert after.chunks[: len(before.chunks)] == before.chunks
    assert after.chunks[len(before.chunks)].first == 200 and after.chunks[-1].end == len(QA.turns)
    assert after.embeddings.shape == (len(after.chunks), before.embeddings.shape[1])
    assert after.turns.starts.tolist() == list(range(len(QA.turns)))  # the new turns' embeddings follow
    np.testing.assert_array_equal(after.turns.embeddings[:200], before.turns.embeddings)


def test_the_index_round_trips_and_a_damaged_one_is_refused(encoder, short_lm):
    turns = TurnEmbeddings.build(format_turns(QA.turns[:30]), encoder, width=4)
    index = RagIndex.build(QA.turns[:30], short_lm, encoder, chunk_tokens=16, turn_embeddings=turns)
    back = recall.from_metadata({recall.METADATA_KEY: recall.to_metadata(index)})
    assert back.chunks == index.chunks
    torch.testing.assert_close(torch.from_numpy(back.embeddings), torch.from_numpy(index.embeddings), atol=1e-3, rtol=0)
    assert back.turns.starts.tolist() == list(range(0, 30, 4))
    np.testing.assert_allclose(back.turns.embeddings, turns.embeddings, atol=1e-3)
    assert recall.from_metadata({}) is None
    with pytest.raises(ValueError, match="recall index"):
        recall.from_metadata({recall.METADATA_KEY: recall.to_metadata(index)[:-40]})


def test_a_budget_that_leaves_the_caches_no_more_than_the_system_prompt_is_refused(short_lm, encoder, tmp_path):
    protected = plan_ingest(QA.turns, name="x", config=CONFIG, store=Store(tmp_path), lm=short_lm,
                            encoder=encoder).prefix_ids.shape[-1]  # fmt: skip
    budget = protected + 2  # enough for one cache of the whole budget, not for half of it
    config = dataclasses.replace(CONFIG, cache=dataclasses.replace(CONFIG.cache, method="recall", budget=budget,
                                                                   block_size=16))  # fmt: skip
    with pytest.raises(UserError, match="recall's episode caches"):
        plan_ingest(QA.turns, name="x", config=config, store=Store(tmp_path), lm=short_lm, encoder=encoder)


def test_an_unknown_retrieval_is_refused(short_lm, encoder, tmp_path):
    config = with_settings(CONFIG, ["recall_retrieval=bm42"])
    with pytest.raises(UserError, match="bm42"):
        plan_ingest(QA.turns, name="x", config=config, store=Store(tmp_path), lm=short_lm, encoder=encoder)


def test_each_recalled_turn_has_its_tokens_in_the_prefilled_text(encoder, short_lm):
    """Receipts for recalled turns: a turn's token range in the text a question prefills holds that turn's line."""
    index = RagIndex.build(QA.turns[:40], short_lm, encoder, chunk_tokens=24)
    picked = index.chunks[1::2]
    spans = recall.recalled_spans(short_lm.tokenizer, picked)
    ids = short_lm.encode("\n" + "\n".join(c.text for c in picked))[0]
    assert [s.index for s in spans] == [t for c in picked for t in range(c.first, c.end)]
    assert spans[0].start == 0 and spans[-1].end == len(ids)
    assert all(a.end == b.start for a, b in zip(spans, spans[1:], strict=False))  # every token owned once
    whole = [s for s in spans if QA.turns[s.index].text.strip() == s.text]  # not cut to a chunk's tokens
    assert len(whole) > len(spans) // 2
    for span in whole:
        turn = QA.turns[span.index]
        line = short_lm.decode(short_lm.encode(f"{turn.role}: {turn.text}")[0].tolist())
        assert short_lm.decode(ids[span.start : span.end].tolist()).split() == line.split()
        assert (span.speaker, span.turn_id) == (turn.role, turn.turn_id)
    unmarked = [dataclasses.replace(c, marks=()) for c in picked]  # an index stored before kvchat kept them
    assert recall.recalled_spans(short_lm.tokenizer, unmarked) == []


def test_a_recalled_planted_fact_is_among_the_sources_marked_recalled(stored, short_lm, encoder):
    """Beyond the window the answer's sources are the turns its compacted cache holds (by their original positions)
    and the turns recalled for the question, marked so, with the attention their prefilled tokens got."""
    store, _ = stored
    session = Session(store, store.get("long"), short_lm, encoder,
                      AskConfig(max_new_tokens=3, source_count=len(QA.turns)))  # fmt: skip
    for question in QA.questions:
        fact = int(question.evidence[0][1:])
        answer = session.ask(question.text, log=False, sources=True)
        if any(first <= fact < end for first, end in answer.recalled):
            break
    else:
        pytest.fail("no question recalled the turn of its planted fact")
    assert answer.sources_note is None
    rounding = 5e-5 * len(answer.sources)  # each share is rounded to 4 decimals
    assert sum(s.attention_share for s in answer.sources) == pytest.approx(1, abs=rounding)
    source = next(s for s in answer.sources if s.turn == fact)
    assert source.recalled and source.attention_share > 0 and source.turn_id == f"T{fact}"
    assert source.speaker == QA.turns[fact].role and QA.turns[fact].text.startswith(source.quote.rstrip("…"))
    recalled = {t for first, end in answer.recalled for t in range(first, end)}
    assert {s.turn for s in answer.sources if s.recalled} == recalled
    assert any(s.kept_tokens > 0 and not s.recalled for s in answer.sources)  # and the episode cache's own turns
