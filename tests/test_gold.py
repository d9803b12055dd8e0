"""Beyond the window: `rag` and `recent` baselines and scoring against gold answers (answer.rag, eval.gold)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kvchat.answer.rag import RagIndex, RagSession, chunk_turns
from kvchat.config import AskConfig, CacheConfig, EpisodeConfig, EvalConfig, IngestConfig, RagConfig
from kvchat.eval.evaluate import ResultsFile
from kvchat.eval.gold import (
    bootstrap_interval,
    evaluate_gold,
    fits_window,
    gold_markdown,
    kvchat_variant,
    paired_difference,
    rag_variant,
    recent_variant,
    summarize_gold,
    verdict,
)
from kvchat.eval.qa import planted_sets
from kvchat.kv import codec
from kvchat.kv.cache import EpisodeCache
from kvchat.kv.forward import forward
from kvchat.kv.methods import STREAMING_SINK
from kvchat.store import Store

SYSTEM = "You are a helpful assistant . Conversation :\n"
BASE = IngestConfig(cache=CacheConfig(budget=96, block_size=48, prefill="block"),
                    episodes=EpisodeConfig(patched_prompt_tokens=48), system_prompt=SYSTEM)  # fmt: skip
QA = planted_sets(1, topics=6, turns_per_topic=40)[0]  # conftest.short_lm: its window is a third of it


def test_chunks_are_consecutive_turns_within_the_token_cap():
    lines = ["a b c", "d e", "f g h i j k l m n o", "p", "q r"]

    def count(text):
        return len(text.split())

    chunks = chunk_turns(len(lines), lambda i, j: "\n".join(lines[i:j]), count, 5,
                         cut=lambda text, n: " ".join(text.split()[:n]))  # fmt: skip
    assert [(c.first, c.end) for c in chunks] == [(0, 2), (2, 3), (3, 5)]
    assert chunks[1].text == "f g h i j" and chunks[1].tokens == 5  # a turn over the cap is cut to it
    assert all(c.tokens <= 5 for c in chunks) and chunks[0].text == "a b c\nd e"


def test_dated_chunks_open_with_their_date(short_lm, encoder):
    from kvchat.history.loading import Turn

    turns = [Turn("A", f"word {i}", time="1 May 2023" if i < 30 else "2 June 2023") for i in range(60)]
    plain = RagIndex.build(turns, short_lm, encoder, chunk_tokens=24)
    dated = RagIndex.build(turns, short_lm, encoder, chunk_tokens=24, dated=True)
    assert len(plain.chunks) > 4 and sum(c.text.startswith("[") for c in plain.chunks) == 1  # the first chunk only
    assert sum(c.text.count("[") for c in plain.chunks) == 2  # a session's first turn only
    assert all(c.text.startswith("[") and c.tokens <= 24 for c in dated.chunks)


def test_rag_prefills_exactly_the_top_chunks_in_history_order(short_lm, encoder):
    index = RagIndex.build(QA.turns, short_lm, encoder, chunk_tokens=32)
    assert len(index.chunks) > 8 and all(c.tokens <= 32 for c in index.chunks)
    assert [c.first for c in index.chunks[1:]] == [c.end for c in index.chunks[:-1]]  # every turn, in order
    config, ask = RagConfig(chunk_tokens=32, top_k=3), AskConfig(max_new_tokens=4, question_template="{question}")
    session = RagSession(index, short_lm, encoder, config, ask, system_prompt=SYSTEM)
    question = QA.questions[1].text
    sims = index.embeddings @ encoder.embed([question])[0]
    expected = sorted(np.argsort(-sims)[:3].tolist())
    first = []
    answer = session.ask(question, on_first_logits=first.append)
    assert list(answer.chunks) == expected
    layout = session.layout
    ids = torch.cat([short_lm.encode(layout.before_conversation),
                     short_lm.encode("\n".join(index.chunks[i].text for i in expected)),
                     short_lm.encode(layout.question(question))], dim=-1)  # fmt: skip
    assert answer.prompt_tokens == answer.entries == ids.shape[-1]
    reference = forward(short_lm.model, EpisodeCache(short_lm.num_layers), ids)[0, -1]
    torch.testing.assert_close(first[0], reference)


def test_recent_keeps_the_system_prompt_a_sink_and_the_last_tokens(short_lm, encoder, tmp_path):
    from kvchat.ingest.pipeline import ingest

    budget = 96
    variant = recent_variant(budget)
    config = dataclasses.replace(BASE, cache=dataclasses.replace(variant.cache, block_size=48, positions="original"))
    store = Store(tmp_path)
    report = ingest(QA.turns, name="r", config=config, store=store, lm=short_lm, encoder=encoder)
    cache, meta = codec.decode(*store.load_episode(store.get("r").episodes[0], short_lm.fingerprint))
    n, protected, sink = meta.protected + report.history_tokens, meta.protected, min(STREAMING_SINK, budget // 4)
    want = [*range(protected + sink), *range(n - (budget - protected - sink), n)]
    for layer in cache.layers:
        for positions in layer.positions:
            assert positions.tolist() == want


def test_bootstrap_interval_contains_the_mean_and_is_deterministic():
    values = [0.0, 0.2, 0.5, 1.0, 0.0, 0.3, 0.7, 0.1]
    low, high = bootstrap_interval(values)
    assert low < np.mean(values) < high
    assert bootstrap_interval(values) == (low, high)
    wide = bootstrap_interval(values[:4])
    assert wide[1] - wide[0] > high - low > 0
    assert bootstrap_interval([0.4] * 5) == (pytest.approx(0.4), pytest.approx(0.4))


def test_paired_difference_is_over_the_shared_questions():
    a = {("s", str(i)): 0.1 * i + 0.2 for i in range(10)}
    b = {("s", str(i)): 0.1 * i for i in range(12)}
    diff, low, high, n = paired_difference(a, b)
    assert n == 10 and diff == pytest.approx(0.2) and low == pytest.approx(0.2) and high == pytest.approx(0.2)


def _answers(variant, f1s, *, baseline, budget=1024):
    return [{"kind": "answer", "against": "gold", "set": "s", "variant": variant, "method": variant.split("@")[0],
             "entries_budget": budget, "baseline": baseline, "qid": str(i), "category": 1 + i % 4, "f1": f,
             "recall": f > 0.5, "seconds": 1.0, "entries": 1100, "resident_bytes": 10, "disk_bytes": 20}
            for i, f in enumerate(f1s)]  # fmt: skip


def test_verdict_calls_a_win_only_outside_the_noise():
    rng = np.random.default_rng(1)
    base = rng.uniform(0, 0.5, 60)
    clear = _answers("snapkv@1024", base + 0.3, baseline=False) + _answers("rag@4x256", base, baseline=True)
    [line] = verdict(clear)
    assert line.startswith("1024 entries: snapkv@1024 beat rag@4x256 by 0.300 F1")
    noisy = _answers("snapkv@1024", base + rng.normal(0, 0.2, 60), baseline=False) + _answers(
        "rag@4x256", base, baseline=True)
    [line] = verdict(noisy)
    assert "no winner" in line and "inside the noise" in line
    rows = summarize_gold(clear)
    assert [r["variant"] for r in rows] == ["snapkv@1024", "rag@4x256"]
    assert set(rows[0]["f1_by_category"]) == {"multi-hop", "temporal", "open-domain", "single-hop"}


def test_the_gold_report_states_its_settings_n_and_what_each_column_means():
    base = np.linspace(0, 0.5, 40)
    records = _answers("snapkv@1024", base + 0.3, baseline=False) + _answers("rag@4x256", base, baseline=True)
    text = gold_markdown(records, title="t", settings={"budgets": "1024"})
    assert "- budgets: 1024" in text and "| 40 |" in text
    for column in ("entries attended", "questions", "F1 [95% interval]", "answer s", "disk MB / resident MB"):
        assert f"- {column}: " in text


def test_verdict_compares_only_systems_measured_on_the_most_questions():
    base = np.linspace(0, 0.5, 60)
    subset = _answers("keydiff@1024", np.ones(20), baseline=False)  # perfect, on a third of the questions
    records = _answers("snapkv@1024", base + 0.3, baseline=False) + _answers("rag@4x256", base, baseline=True)
    [line] = verdict(records + subset)
    assert line.startswith("1024 entries: snapkv@1024 beat rag@4x256") and "keydiff" not in line


def test_gold_eval_runs_every_system_on_a_history_3x_the_window(short_lm, encoder, tmp_path):
    assert not fits_window(short_lm, QA, SYSTEM)
    variants = [kvchat_variant(dataclasses.replace(BASE.cache, method="snapkv"), "snapkv@96"),
                rag_variant(96, 32), recent_variant(96, BASE.cache)]  # fmt: skip
    config = EvalConfig(max_new_tokens=4)
    store = Store(tmp_path / "home")
    results = ResultsFile(tmp_path / "r.jsonl")
    records = evaluate_gold([QA], variants, lm=short_lm, encoder=encoder, results=results, config=config,
                            base=BASE, store=store)  # fmt: skip
    answers = [r for r in records if r["kind"] == "answer"]
    assert not [r for r in records if r["kind"] == "skipped"]
    assert {(r["variant"], r["qid"]) for r in answers} == {(v.key, q.qid) for v in variants for q in QA.questions}
    prompt = {r["variant"]: r["prompt_tokens"] for r in answers if r["qid"] == "0"}
    entries = {r["variant"]: r["entries"] for r in answers if r["qid"] == "0"}
    assert entries["snapkv@96"] == pytest.approx(96 + prompt["snapkv@96"])  # resident M + the question prefilled
    assert entries["recent@96"] == pytest.approx(96 + prompt["recent@96"])
    assert entries["rag@3x32"] == prompt["rag@3x32"] <= 96 + prompt["snapkv@96"] + 16  # system prompt + chunks
    assert all(0 <= r["f1"] <= 1 and r["seconds"] > 0 and r["disk_bytes"] > 0 for r in answers)
    # the caches stay in the store and a later run reuses them
    built = {c.name: c.created_at for c in store.conversations()}
    assert len(built) == 2
    again = evaluate_gold([QA], variants, lm=short_lm, encoder=encoder, results=ResultsFile(tmp_path / "s.jsonl"),
                          config=config, base=BASE, store=store)  # fmt: skip
    assert {c.name: c.created_at for c in store.conversations()} == built
    assert [r["prediction"] for r in again if r["kind"] == "answer"] == [r["prediction"] for r in answers]


def test_auto_sends_only_histories_beyond_the_window_to_gold(short_lm):
    from kvchat.errors import UserError
    from kvchat.eval.gold import by_reference

    short = dataclasses.replace(QA, name="short", turns=QA.turns[:4])
    assert by_reference([QA, short], short_lm, "auto", SYSTEM) == ([short], [QA])
    assert by_reference([QA, short], short_lm, "gold", SYSTEM) == ([], [QA, short])
    with pytest.raises(UserError, match="does not fit"):
        by_reference([QA, short], short_lm, "full", SYSTEM)


def test_gold_variants_put_rag_and_recent_at_each_budget():
    from kvchat.config import OffloadConfig
    from kvchat.eval.gold import gold_variants

    paged = CacheConfig(method="snapkv", budget=512, offload=OffloadConfig(mode="icecache", retrieve=192))
    caches = [("snapkv@512", CacheConfig(method="snapkv", budget=512)), ("snapkv@512/paged", paged)]
    keys = [(v.key, v.entries, v.baseline) for v in gold_variants(caches, [512, 1024], 256)]
    assert keys == [("snapkv@512", 512, False), ("snapkv@512/paged", 512 + 32 + 192, False),
                    ("rag@2x256", 512, True), ("rag-lexical@2x256", 512, True), ("rag-hybrid@2x256", 512, True),
                    ("recent@512", 512, True), ("rag@4x256", 1024, True), ("rag-lexical@4x256", 1024, True),
                    ("rag-hybrid@4x256", 1024, True), ("recent@1024", 1024, True)]  # fmt: skip


def test_cli_eval_scores_a_history_beyond_the_window_against_gold(tmp_path, short_model_dir):
    import json

    from cli_helpers import run_main

    out, report = tmp_path / "r.jsonl", tmp_path / "report.md"
    args = ("eval", "--synthetic", "1", "--model", str(short_model_dir), "--methods", "snapkv", "--budgets", "96",
            "--setting", "block_size=48", "--chunk-tokens", "32", "--questions", "3", "--out", str(out), "--report",
            str(report), "--json")  # fmt: skip
    result = run_main(tmp_path / "home", *args)  # --against auto: the history does not fit, so gold
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["rows"] == []  # nothing compared with full KV, nothing refused
    rows = {r["variant"]: r for r in document["gold"]["rows"]}
    assert set(rows) == {"snapkv@96/block_size=48", "rag@3x32", "rag-lexical@3x32", "rag-hybrid@3x32", "recent@96"}
    assert all(r["questions"] == 3 and r["f1_low"] <= r["f1"] <= r["f1_high"] for r in rows.values())
    assert all(r["nll_low"] <= r["nll"] <= r["nll_high"] and r["recovery"] is not None and
               0 <= r["evidence_any"] <= 1 for r in rows.values())  # fmt: skip
    [line] = document["gold"]["verdict"]
    assert line.startswith("96 entries: ") and "snapkv@96/block_size=48" in line and "RAG (rag" in line
    assert "by gold-answer NLL" in line
    assert "| recent@96 |" in report.read_text() and line in report.read_text()
    again = run_main(tmp_path / "home", *args)  # everything is in the file: nothing is recomputed
    assert again.returncode == 0 and json.loads(again.stdout) == document
    refused = run_main(tmp_path / "home", *args, "--against", "full")
    assert refused.returncode == 2 and "does not fit" in refused.stderr and "--against gold" in refused.stderr


def test_gold_eval_builds_caches_with_lm_and_answers_with_the_answering_model(short_lm, short_model_dir, encoder,
                                                                              tmp_path):
    """As `kvchat ingest` then `kvchat ask --weights int4`: the caches are the float weights', the answers int4's."""
    from kvchat.model.llm import load_model

    int4 = load_model(str(short_model_dir), tmp_path / "models", weights="int4")
    variants = [kvchat_variant(dataclasses.replace(BASE.cache, method="snapkv"), "snapkv@96"), rag_variant(96, 32)]
    config = EvalConfig(max_new_tokens=6, echo_guard=False)
    runs = {}
    for label, answering in (("float", None), ("int4", int4)):
        store = Store(tmp_path / label)
        records = evaluate_gold([QA], variants, lm=short_lm, encoder=encoder, results=ResultsFile(None),
                                config=config, base=BASE, store=store, answering=answering)  # fmt: skip
        (record,) = store.conversations()
        tensors, _ = store.load_episode(record.episodes[0], short_lm.fingerprint)
        runs[label] = (tensors, {(r["variant"], r["qid"]): r["prediction"] for r in records if r["kind"] == "answer"})
    ours, theirs = runs["int4"][0], runs["float"][0]
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)  # the float weights'
    assert runs["int4"][1].keys() == runs["float"][1].keys()
    assert runs["int4"][1] != runs["float"][1]  # decoded by the int4 weights
