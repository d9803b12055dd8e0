"""Reader-light metrics (kvchat.eval.memory_metrics, kvchat.answer.probe): evidence recall, gold-answer NLL and
oracle-gain recovery, each against a hand-computed case; hybrid RAG (reciprocal-rank fusion)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvchat.answer.probe import Probe, continuation_nll, prompt_held
from kvchat.answer.rag import Chunk, RagIndex, RagSession, fused_order
from kvchat.answer.session import Session
from kvchat.answer.sources import TurnPresence
from kvchat.config import AskConfig, CacheConfig, EpisodeConfig, IngestConfig, RagConfig
from kvchat.eval import memory_metrics
from kvchat.eval.memory_metrics import References, evidence_recall, memory_summary, nll_verdict
from kvchat.eval.qa import Question, planted_sets
from kvchat.eval.stats import statistic_interval
from kvchat.history.spans import TurnSpan
from kvchat.ingest.pipeline import ingest
from kvchat.kv.attention import LayerView
from kvchat.kv.cache import EpisodeCache
from kvchat.kv.forward import forward
from kvchat.kv.layers import UniformLayer
from kvchat.store import Store

SYSTEM = "You are a helpful assistant . Conversation :\n"
QA = planted_sets(1, topics=2, turns_per_topic=12)[0]  # short: full KV fits tiny_lm's window


# --- evidence recall --------------------------------------------------------------------------------
def _spans() -> list[TurnSpan]:  # a system prompt at 0..1, then three turns of 3, 4 and 3 tokens
    return [TurnSpan(2, 5, 0, "Maya", "hello there"), TurnSpan(5, 9, 1, "Tom", "the gate is C42"),
            TurnSpan(9, 12, 2, "Maya", "thanks")]


def test_turn_presence_counts_each_heads_entries_of_every_turn_by_hand():
    # head 0 holds 3, 4 (turn 0: 2 of 3 tokens) and 6 (turn 1: 1 of 4); head 1 holds all of turn 1 and 9 (turn 2)
    positions = torch.tensor([[0, 1, 3, 4, 6, 12], [5, 6, 7, 8, 9, 12]])  # 12: the question, fed now
    layer = UniformLayer.of(torch.zeros(1, 2, 6, 4), torch.zeros(1, 2, 6, 4), positions)
    cache = SimpleNamespace(layers=[layer], next_position=12)
    presence = TurnPresence(cache, _spans())
    presence.record(LayerView(0, torch.zeros(2, 2, 1, 6), 5, torch.zeros(1, 4, 1, 4)))
    present = presence.present()
    assert {t: c.tolist() for t, c in present.items()} == {0: [2, 0], 1: [1, 4], 2: [0, 1]}
    tokens = [3, 4, 3]
    # turn 1: any token in both heads, at least half in one (4/4; 1/4 is not half)
    assert evidence_recall(present, [1], tokens) == {"evidence_any": 1.0, "evidence_half": 0.5,
                                                     "evidence_tokens": round((1 / 4 + 1) / 2, 4)}  # fmt: skip
    # turns 0 and 2: each in one head of two, 2/3 (half) and 1/3 (not)
    assert evidence_recall(present, [0, 2], tokens) == {"evidence_any": 0.5, "evidence_half": 0.25,
                                                        "evidence_tokens": round((2 / 3 + 1 / 3) / 4, 4)}  # fmt: skip
    assert evidence_recall(None, [1], tokens) == dict.fromkeys(memory_metrics.EVIDENCE)


def test_turns_prefilled_after_the_cache_count_in_every_head():
    layer = UniformLayer.of(torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 4), torch.tensor([[0, 1], [0, 1]]))
    cache = SimpleNamespace(layers=[layer], next_position=2)
    recalled = [TurnSpan(0, 4, 1, "Tom", "the gate is C42")]  # turn 1's 4 tokens right after the cache
    presence = TurnPresence(cache, _spans(), recalled=recalled)
    layer.append(torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4), torch.arange(2, 7).expand(2, 5))  # + the question
    presence.record(LayerView(0, torch.zeros(2, 2, 1, 7), 6, torch.zeros(1, 4, 1, 4)))
    assert {t: c.tolist() for t, c in presence.present().items()} == {1: [4, 4]}


@pytest.fixture(scope="module")
def full_store(tiny_lm, encoder, tmp_path_factory):
    """QA's history ingested with full KV (every entry kept) and with a cache holding only the system prompt and the
    last turns (streaming, at a small budget)."""
    store = Store(tmp_path_factory.mktemp("memory-metrics"))
    for name, cache in (("full", CacheConfig(method="full")),
                        ("recent", CacheConfig(method="streaming", budget=24, block_size=16, layer_budgets="uniform",
                                               prefill="block"))):  # fmt: skip
        ingest(QA.turns, name=name, config=IngestConfig(cache=cache, episodes=EpisodeConfig(episodes=1),
                                                         system_prompt=SYSTEM), store=store, lm=tiny_lm,
               encoder=encoder)  # fmt: skip
    return store


def test_a_cache_that_holds_the_evidence_scores_recall_one_and_one_that_does_not_zero(full_store, tiny_lm, encoder):
    references = References(tiny_lm, QA, SYSTEM, "{question}")
    early = next(q for q in QA.questions if references.evidence(q)[0] < len(QA.turns) // 2)
    scores = {}
    for name in ("full", "recent"):
        session = Session(full_store, full_store.get(name), tiny_lm, encoder, AskConfig(max_new_tokens=2))
        probe = memory_metrics.probe_for(tiny_lm, early)
        session.ask(early.text, log=False, probe=probe)
        scores[name] = memory_metrics.fields(probe, references, early)
    assert scores["full"]["evidence_any"] == scores["full"]["evidence_half"] == scores["full"]["evidence_tokens"] == 1
    assert scores["recent"]["evidence_any"] == 0  # a turn from the first half: long evicted
    assert scores["full"]["nll_none"] == scores["recent"]["nll_none"]  # the references are the question's


# --- gold-answer NLL --------------------------------------------------------------------------------
def test_the_continuations_nll_is_that_of_one_forward_of_prompt_and_continuation(tiny_lm):
    ids = tiny_lm.encode("maya : the gate is c42 . tom : thanks")
    continuation = tiny_lm.encode("gate c42")[0].tolist()
    cache = EpisodeCache(tiny_lm.num_layers)
    forward(tiny_lm.model, cache, ids)
    nll = continuation_nll(tiny_lm.model, cache, prompt_held(cache, ids.shape[-1]), ids[:, -1:], continuation)
    whole = torch.cat([ids, torch.tensor([continuation])], dim=-1)
    logits = forward(tiny_lm.model, EpisodeCache(tiny_lm.num_layers), whole, last_logits_only=False)[0]
    logprobs = logits[ids.shape[-1] - 1 : -1].float().log_softmax(-1)
    expected = -logprobs.gather(-1, torch.tensor(continuation).unsqueeze(-1)).mean()
    assert nll == pytest.approx(float(expected), abs=1e-4)


def test_probing_an_answer_leaves_it_and_the_cache_unchanged(full_store, tiny_lm, encoder):
    session = Session(full_store, full_store.get("full"), tiny_lm, encoder, AskConfig(max_new_tokens=4))
    question = QA.questions[0]
    plain = session.ask(question.text, log=False)
    sizes = session._resident[1].sizes
    probe = memory_metrics.probe_for(tiny_lm, question)
    probed = session.ask(question.text, log=False, probe=probe)
    assert probed.text == plain.text and session._resident[1].sizes == sizes
    assert probe.nll is not None and probe.nll > 0 and probe.present


def test_the_evidence_alone_scores_recovery_one_and_no_history_zero(tiny_lm, encoder):
    """A RAG whose only chunk is the evidence turns prefills what the oracle reference prefills: its NLL is
    nll_evidence and its recovery 1.0; a system no better than no history recovers 0."""
    references = References(tiny_lm, QA, SYSTEM, "{question}")
    records = []
    for question in QA.questions:
        evidence = [QA.turns[i] for i in references.evidence(question)]
        index = RagIndex.build(evidence, tiny_lm, encoder, chunk_tokens=10_000)
        rag = RagSession(index, tiny_lm, encoder, RagConfig(10_000, 1), AskConfig(max_new_tokens=2), SYSTEM)
        probe = memory_metrics.probe_for(tiny_lm, question)
        rag.ask(question.text, probe=probe)
        record = memory_metrics.fields(probe, references, question)
        assert record["nll"] == pytest.approx(record["nll_evidence"], abs=2e-4)
        records.append({**record, "set": QA.name, "qid": question.qid})
    assert memory_summary(records)["recovery"] == pytest.approx(1.0, abs=1e-3)
    none = [{**r, "nll": r["nll_none"]} for r in records]
    assert memory_summary(none)["recovery"] == pytest.approx(0.0, abs=1e-9)


def test_recovery_is_a_ratio_of_means_with_an_interval_over_the_questions():
    records = [{"nll": 2.0, "nll_none": 3.0, "nll_evidence": 1.0}, {"nll": 3.0, "nll_none": 4.0, "nll_evidence": 3.8}]
    summary = memory_summary(records)
    assert summary["recovery"] == pytest.approx((3.5 - 2.5) / (3.5 - 2.4))  # not the mean of 0.5 and 5.0
    assert summary["recovery_low"] <= summary["recovery"] <= summary["recovery_high"]
    assert summary["nll"] == 2.5 and summary["evidence_any"] is None
    point, low, high = statistic_interval([[1.0, 2.0, 3.0], [2.0, 2.0, 2.0]], lambda a, b: a / b)
    assert point == 1.0 and low < 1.0 < high


def _records(variant: str, nlls, *, baseline: bool, method: str, f1: float = 0.1) -> list[dict]:
    return [{"kind": "answer", "against": "gold", "set": "s", "variant": variant, "qid": str(i), "category": 4,
             "method": method, "entries_budget": 1024, "baseline": baseline, "f1": f1, "recall": False,
             "seconds": 1.0, "entries": 1040, "resident_bytes": 1, "disk_bytes": 1, "nll": float(n), "nll_none": 4.0,
             "nll_evidence": 1.0, "evidence_any": 0.5, "evidence_half": 0.5, "evidence_tokens": 0.5}
            for i, n in enumerate(nlls)]  # fmt: skip


def test_the_verdict_ranks_by_nll_against_the_best_of_the_retrieval_baselines():
    from kvchat.eval.gold import summarize_gold, verdict

    rng = np.random.default_rng(0)
    base = rng.uniform(2.5, 3.5, 80)
    records = (_records("recall@1024", base - 0.5, baseline=False, method="recall")
               + _records("rag@4x256", base, baseline=True, method="rag", f1=0.3)
               + _records("rag-lexical@4x256", base - 0.2, baseline=True, method="rag")
               + _records("recent@1024", base - 1.0, baseline=True, method="streaming"))  # fmt: skip
    [line] = verdict(records)
    assert line.startswith("1024 entries: recall@1024 beat RAG (rag-lexical@4x256, the best of 2 retrieval baselines)")
    assert "by gold-answer NLL" in line and "recovery" in line  # recent is no RAG: not the one compared
    noisy = (_records("recall@1024", base + rng.normal(0, 0.5, 80), baseline=False, method="recall")
             + _records("rag@4x256", base, baseline=True, method="rag"))  # fmt: skip
    [line] = nll_verdict(noisy, summarize_gold(noisy))
    assert "no winner" in line and "inside the noise" in line
    rows = {r["variant"]: r for r in summarize_gold(records)}
    assert rows["recall@1024"]["nll_low"] < rows["recall@1024"]["nll"] < rows["recall@1024"]["nll_high"]
    assert rows["recall@1024"]["recovery"] == pytest.approx((4 - np.mean(base - 0.5)) / 3)


# --- hybrid RAG -------------------------------------------------------------------------------------
def test_reciprocal_rank_fusion_by_hand():
    dense = np.array([0, 1, 2, 3])
    lexical = np.array([3, 2, 0, 1])
    # scores: 0: 1/60 + 1/62 = .03280; 1: 1/61 + 1/63 = .03227; 2: 1/62 + 1/61 = .03252; 3: 1/63 + 1/60 = .03254
    assert fused_order(dense, lexical).tolist() == [0, 3, 2, 1]
    assert fused_order(dense, dense[::-1]).tolist() == [0, 3, 1, 2]  # 0 and 3 tie, 1 and 2 too: dense breaks ties


def test_hybrid_retrieval_fuses_the_encoders_and_the_words_rankings():
    texts = ["sunrise painting melanie", "adoption agency caroline", "camping trip", "pottery class"]
    chunks = [Chunk(i, i + 1, t, 3) for i, t in enumerate(texts)]
    embeddings = np.eye(4, dtype=np.float32)
    index = RagIndex(chunks, embeddings)
    query = np.array([0.0, 0.0, 1.0, 0.9], dtype=np.float32)  # the encoder: camping, then pottery
    words = "When did Melanie paint a sunrise painting?"  # the words: chunk 0
    assert index.top(query, 1, words, "lexical") == [0]
    assert index.top(query, 1, None) == [2] == index.top(query, 1, words, "dense")
    # fused: chunk 0 is first by words and last by the encoder; chunk 2 first by the encoder and second by words
    assert index.top(query, 1, words, "hybrid") == [2] and index.top(query, 2, words, "hybrid") == [0, 2]


def test_the_gold_baselines_are_rag_three_ways_and_recent():
    from kvchat.eval.gold import baselines

    assert [v.key for v in baselines([1024], 256)] == ["rag@4x256", "rag-lexical@4x256", "rag-hybrid@4x256",
                                                       "recent@1024"]  # fmt: skip
    assert {v.rag.retrieval for v in baselines([1024], 256) if v.rag} == {"dense", "lexical", "hybrid"}


def test_probe_of_an_empty_continuation_is_refused(tiny_lm):
    cache = EpisodeCache(tiny_lm.num_layers)
    ids = tiny_lm.encode("maya : hello")
    forward(tiny_lm.model, cache, ids)
    with pytest.raises(ValueError):
        continuation_nll(tiny_lm.model, cache, prompt_held(cache, ids.shape[-1]), ids[:, -1:], [])
    assert Probe([1]).present is None and Question("0", "q", "a; b", 3).gold == "a; b"
    assert memory_metrics.gold_text(Question("0", "q", "a; b", 3)) == "a"
