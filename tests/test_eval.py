"""`kvchat eval`: LoCoMo scoring, session truncation and evidence filtering, resumable runs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from cli_helpers import run_main

from kvchat.config import CacheConfig, EpisodeConfig, EvalConfig, IngestConfig, OffloadConfig
from kvchat.errors import UserError
from kvchat.eval.evaluate import REFERENCE, ResultsFile, Variant, evaluate, variants
from kvchat.eval.qa import (
    QASet,
    Question,
    contains_gold,
    load_locomo,
    normalize_answer,
    planted_sets,
    sample_questions,
    score_answer,
    token_f1,
)
from kvchat.eval.summary import summarize
from kvchat.history.loading import format_turns
from kvchat.history.synthetic import _TOPICS

SMALL = IngestConfig(
    cache=CacheConfig(budget=96, block_size=48, prefill="block"), episodes=EpisodeConfig(patched_prompt_tokens=48)
)


# --- scoring ------------------------------------------------------------------------------------------
def test_normalisation_drops_case_punctuation_commas_and_articles():
    assert normalize_answer("The Cat, and a dog!") == "cat dog"
    assert normalize_answer("An apple; the END.") == "apple end"
    assert normalize_answer("Andrew and Theo") == "andrew theo"  # whole words only


def test_token_f1_is_stemmed_and_symmetric_in_overlap():
    assert token_f1("running dogs", "The dog runs") == 1.0
    assert token_f1("Paris, France", "paris") == pytest.approx(2 / 3)
    assert token_f1("nothing in common", "entirely different") == 0.0
    assert token_f1("", "gold") == 0.0


def test_per_category_scoring_follows_locomo():
    multi = Question("0", "q", "hiking, painting", 1)
    assert score_answer("painting", multi) == pytest.approx(0.5)   # mean over gold items
    assert score_answer("hiking, painting", multi) == 1.0
    open_domain = Question("1", "q", "likely yes; she said so", 3)
    assert score_answer("likely yes", open_domain) == 1.0          # only the part before ';' counts
    assert score_answer("she said so", open_domain) == 0.0
    adversarial = Question("2", "q", "Not mentioned in the conversation", 5)
    assert score_answer("That is not mentioned.", adversarial) == 1.0
    assert score_answer("Her dog Biscuit.", adversarial) == 0.0
    assert contains_gold("It leaves from gate B17, I think.", Question("3", "q", "B17", 0))
    assert not contains_gold("gate B1", Question("3", "q", "B17", 0))


# --- LoCoMo files ------------------------------------------------------------------------------------
def _locomo(path: Path, sessions: list[list[str]], qa: list[dict]) -> Path:
    data: dict = {"speaker_a": "Maya", "speaker_b": "Tom", "qa": qa}
    for s, lines in enumerate(sessions, start=1):
        data[f"session_{s}_date_time"] = f"1:00 pm on {s} May, 2023"
        data[f"session_{s}"] = [
            {"speaker": ("Maya", "Tom")[t % 2], "dia_id": f"D{s}:{t + 1}", "text": text} for t, text in enumerate(lines)
        ]
    path.write_text(json.dumps(data))
    return path


def _words(text: str) -> int:
    return len(text.split())


@pytest.fixture
def locomo_file(tmp_path) -> Path:
    filler = _TOPICS["garden"][0]
    sessions = [list(filler[:4]), list(filler[4:8]), list(filler[:3])]
    qa = [
        {"question": "in session one?", "answer": "x", "evidence": ["D1:2"], "category": 4},
        {"question": "in session three?", "answer": "y", "evidence": ["D3:1"], "category": 4},
        {"question": "across one and two?", "answer": "z", "evidence": ["D1:1; D2:3"], "category": 1},
        {"question": "no evidence?", "answer": "w", "evidence": [], "category": 2},
        {"question": "adversarial?", "adversarial_answer": "v", "evidence": ["D1:1"], "category": 5},
        {"question": "leading zero?", "answer": "u", "evidence": ["D2:01"], "category": 2},
    ]
    return _locomo(tmp_path / "conv.json", sessions, qa)


def _first_sessions_words(path: Path, turns: int) -> int:
    return _words("\n".join(format_turns(load_locomo(path).turns[:turns])))


def test_truncation_keeps_whole_sessions_that_fit(locomo_file):
    whole = load_locomo(locomo_file)
    assert whole.sessions_kept == whole.sessions_total == 3
    two_sessions = _first_sessions_words(locomo_file, 8)
    cut = load_locomo(locomo_file, count_tokens=_words, max_context=two_sessions)
    assert (cut.sessions_kept, len(cut.turns)) == (2, 8)
    assert load_locomo(locomo_file, count_tokens=_words, max_context=two_sessions - 1).sessions_kept == 1
    with pytest.raises(UserError, match="smaller than the first session"):
        load_locomo(locomo_file, count_tokens=_words, max_context=3)


def test_questions_are_kept_only_when_all_evidence_is_inside(locomo_file):
    whole = load_locomo(locomo_file)
    assert [q.text for q in whole.questions] == [
        "in session one?", "in session three?", "across one and two?", "leading zero?"
    ]
    two = load_locomo(locomo_file, count_tokens=_words, max_context=_first_sessions_words(locomo_file, 8))
    assert two.sessions_kept == 2
    assert [q.text for q in two.questions] == ["in session one?", "across one and two?", "leading zero?"]
    one = load_locomo(locomo_file, count_tokens=_words, max_context=_first_sessions_words(locomo_file, 4))
    assert one.sessions_kept == 1 and [q.text for q in one.questions] == ["in session one?"]


def test_adversarial_questions_only_when_asked(locomo_file):
    asked = load_locomo(locomo_file, categories=(5,))
    assert [(q.text, q.gold) for q in asked.questions] == [("adversarial?", "Not mentioned in the conversation")]


def test_not_a_locomo_file_is_a_user_error(tmp_path):
    path = tmp_path / "chat.json"
    path.write_text(json.dumps([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]))
    with pytest.raises(UserError, match="not a LoCoMo file"):
        load_locomo(path)


def test_question_sample_is_spread_over_the_file():
    questions = [Question(str(i), "q", "a", 1 + i % 4) for i in range(40)]
    sample = sample_questions(questions, 8)
    assert [q.qid for q in sample] == [str(i) for i in range(0, 40, 5)]
    assert {q.category for q in sample} == {1, 2, 3, 4}
    assert sample_questions(questions, None) == questions


def test_planted_sets_are_deterministic():
    a, b = planted_sets(2, topics=3, turns_per_topic=12), planted_sets(2, topics=3, turns_per_topic=12)
    assert [s.turns for s in a] == [s.turns for s in b] and a[0].turns != a[1].turns
    assert all(len(s.questions) == 3 for s in a)
    assert all(q.gold in " ".join(t.text for t in s.turns) for s in a for q in s.questions)


# --- runs -------------------------------------------------------------------------------------------
def _tiny_set() -> QASet:
    return planted_sets(1, topics=3, turns_per_topic=12)[0]


def test_variant_keys_name_what_differs_from_the_defaults():
    assert Variant(CacheConfig(method="snapkv", budget=256)).key == "snapkv@256"
    assert Variant(CacheConfig(method="full")).key == REFERENCE
    assert Variant(CacheConfig(budget=512, layer_budgets="pyramid")).key == "auto@512/layer_budgets=pyramid"
    assert [v.key for v in variants(["full", "keydiff"], [1, 2])] == ["keydiff@1", "keydiff@2"]


def test_offload_variants_are_named_apart_and_full_kv_paged_runs_as_a_variant():
    base = CacheConfig(offload=OffloadConfig(mode="icecache", retrieve=64))
    assert [v.key for v in variants(["full", "keydiff"], [8], base)] == [
        "full/offload=icecache:R64:W32", "keydiff@8/offload=icecache:R64:W32"
    ]
    other = CacheConfig(offload=OffloadConfig(mode="icecache", retrieve=64, recent=0, first_paged_layer=2))
    assert Variant(other).key == "auto@1024/offload=icecache:R64:W0:first_paged_layer=2"


def test_evidence_recalled_counts_resident_and_retrieved_entries_per_layer_and_head():
    import torch

    from kvchat.eval.evaluate import _retained, _with_retrieved

    kept = torch.zeros(4, 10, dtype=torch.bool)  # 2 layers x 2 KV heads, positions 0..9
    kept[:, :3] = True                           # resident: the sink 0..2 everywhere
    kept[3, 9] = True                            # and position 9 in layer 1, head 1
    retrieved = [None, [torch.tensor([5, 12]), torch.tensor([6])]]  # layer 0 has no pages
    evidence = torch.tensor([5, 6, 9, 12])
    # resident only: 1 of 16 (layer, head, position) entries; retrieved adds (1,0,5), (1,0,12), (1,1,6)
    assert _retained(kept, evidence) == pytest.approx(1 / 16, abs=1e-4)
    assert _retained(_with_retrieved(kept, retrieved), evidence) == pytest.approx(4 / 16, abs=1e-4)
    assert _with_retrieved(kept, [None, None]) is kept


def test_evidence_attention_recalled_is_the_share_of_full_kv_attention_on_held_entries():
    import torch

    from kvchat.eval.evaluate import _attention_recalled

    # 2 layers x 1 KV head; evidence positions 4, 5, 7 (7 beyond the variant's kept width: not held)
    attention = torch.tensor([[0.30, 0.10, 0.0], [0.05, 0.05, 0.50]])
    evidence = torch.tensor([4, 5, 7])
    seen = torch.zeros(2, 6, dtype=torch.bool)
    seen[0, 4] = True  # 0.30
    seen[1, 5] = True  # 0.05
    assert _attention_recalled(seen, evidence, attention) == pytest.approx(0.35 / 1.0, abs=1e-4)
    assert _attention_recalled(torch.ones(2, 8, dtype=torch.bool), evidence, attention) == 1.0
    assert _attention_recalled(torch.zeros(2, 8, dtype=torch.bool), evidence, attention) == 0.0
    assert _attention_recalled(seen, evidence, None) is None
    assert _attention_recalled(seen, evidence, torch.zeros(2, 3)) is None  # no attention on the evidence


def test_last_query_attention_sums_the_group_over_the_last_query_and_maps_cache_order_to_positions():
    import torch

    from kvchat.eval.evaluate import _LastQueryAttention
    from kvchat.kv.attention import LayerView

    recorder = _LastQueryAttention()
    # one layer, 2 KV heads x 2 query heads, 2 query rows (only the last counts), 3 cached + 2 new columns
    weights = torch.zeros(2, 2, 2, 5)
    weights[:, :, 0, :3] = 9.0  # an earlier query row: ignored
    weights[0, :, 1, :3] = torch.tensor([[0.1, 0.2, 0.3], [0.0, 0.2, 0.1]])
    weights[1, :, 1, :3] = torch.tensor([[0.5, 0.0, 0.0], [0.1, 0.1, 0.1]])
    weights[:, :, 1, 3:] = 7.0  # the forward's own tokens: not cached entries
    recorder.record(LayerView(0, weights, 3, torch.zeros(1, 4, 1, 8)))
    heads = [torch.tensor([0, 6, 2]), torch.tensor([2, 0, 6])]  # cache order differs per head
    got = recorder.on_positions(heads, torch.tensor([6, 2, 9]))
    # head 0: position 6 is column 1 (0.4), 2 is column 2 (0.4); head 1: 6 is column 2 (0.1), 2 is column 0 (0.6)
    assert torch.allclose(got, torch.tensor([[0.4, 0.4, 0.0], [0.1, 0.6, 0.0]]))
    assert recorder.on_positions([], torch.tensor([6])) is None


@pytest.mark.parametrize("retrieve", [0, 10**6])
def test_eval_reports_evidence_recalled_with_what_the_pages_gave(tmp_path, tiny_lm, encoder, retrieve):
    """Full KV paged past sink and window: nothing read leaves only the window's evidence; every page read
    recalls all of it, while the resident cache alone keeps little."""
    qa_set = _tiny_set()
    offload = OffloadConfig(mode="icecache", retrieve=retrieve, recent=4, dtype="float32")
    paged = Variant(dataclasses.replace(SMALL.cache, method="full", offload=offload))
    records = evaluate([qa_set], [paged], lm=tiny_lm, encoder=encoder, config=EvalConfig(max_new_tokens=2),
                       base=SMALL, results=ResultsFile(None))  # fmt: skip
    answers = [r for r in records if r["kind"] == "answer" and r["variant"] == paged.key]
    assert answers and all(r["evidence_kept"] < 0.5 for r in answers)
    for r in answers:
        assert r["evidence_recalled"] == (r["evidence_kept"] if retrieve == 0 else 1.0)
        if retrieve:  # every entry read: all of full KV's attention on the evidence is recalled
            assert r["evidence_attention_recalled"] == 1.0
        else:  # some attention share whenever some evidence is resident, none when none is
            assert (r["evidence_attention_recalled"] > 0) == (r["evidence_kept"] > 0)
    if not retrieve:
        assert any(r["evidence_attention_recalled"] == 0.0 for r in answers)
    reference = [r for r in records if r["kind"] == "answer" and r["variant"] == REFERENCE]
    assert all(r["evidence_recalled"] == r["evidence_kept"] == 1.0 for r in reference)
    assert all(r["evidence_attention_recalled"] == 1.0 for r in reference)
    assert summarize(records)[0]["evidence_attention_recalled"] == 1.0
    assert summarize(records)[-1]["evidence_recalled"] == (1.0 if retrieve else summarize(records)[-1]["evidence_kept"])


def test_eval_of_full_kv_paged_with_every_page_read_matches_the_reference(tmp_path, tiny_lm, encoder):
    qa_set = _tiny_set()
    everything = OffloadConfig(mode="icecache", retrieve=10**6, recent=4, dtype="float32")
    paged = Variant(dataclasses.replace(SMALL.cache, method="full", offload=everything))
    records = evaluate([qa_set], [paged], lm=tiny_lm, encoder=encoder, config=EvalConfig(max_new_tokens=6),
                       base=SMALL, results=ResultsFile(None))  # fmt: skip
    by = {(r["variant"], r["qid"]): r for r in records if r["kind"] == "answer"}
    for q in qa_set.questions:
        assert by[(paged.key, q.qid)]["prediction"] == by[(REFERENCE, q.qid)]["prediction"]
        assert by[(paged.key, q.qid)]["kl"] == pytest.approx(0.0, abs=1e-4)


def test_eval_compares_with_full_kv_and_resumes(tmp_path, tiny_lm, encoder):
    qa_set = _tiny_set()
    config = EvalConfig(max_new_tokens=6)
    # keeps everything, stored as the model computed it like the full-KV reference (int8, the default storage since
    # the scale merge, would change the tiny random model's answers: the comparison is of eviction alone)
    generous = Variant(dataclasses.replace(SMALL.cache, method="snapkv", budget=4096, storage="model"))
    tight = Variant(dataclasses.replace(SMALL.cache, method="streaming", budget=64))
    out = tmp_path / "results.jsonl"

    def run() -> list[dict]:
        return evaluate([qa_set], [generous, tight], lm=tiny_lm, encoder=encoder, config=config, base=SMALL,
                        results=ResultsFile(out))

    records = run()
    answers = [r for r in records if r["kind"] == "answer"]
    assert len(answers) == 3 * len(qa_set.questions)
    by = {(r["variant"], r["qid"]): r for r in answers}
    for q in qa_set.questions:
        full, same = by[(REFERENCE, q.qid)], by[(generous.key, q.qid)]
        assert full["agreement"] == 1.0 and full["kl"] == 0.0
        # a budget larger than the history keeps every entry: the same answer, the same distribution
        assert same["prediction"] == full["prediction"] and same["kl"] == pytest.approx(0.0, abs=1e-4)
        assert full["evidence_kept"] == same["evidence_kept"] == 1.0
        assert by[(tight.key, q.qid)]["kl"] >= 0
    assert len(list(Path(out).read_text().splitlines())) == len(records)

    # an interrupted run: the last record lost and the one before cut mid-line
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[:-2]) + "\n" + lines[-2][:20])
    resumed = run()
    def untouched(rs: list[dict]) -> list[str]:
        return sorted(json.dumps(r, sort_keys=True) for r in rs if r["kind"] == "answer" and r["variant"] != tight.key)

    assert untouched(resumed) == untouched(answers)
    reread = ResultsFile(out).records
    keys = [(r["variant"], r["qid"]) for r in reread if r["kind"] == "answer"]
    assert len(keys) == len(set(keys)) == len(answers)

    rows = {r["variant"]: r for r in summarize(reread)}
    assert rows[REFERENCE]["relative_f1"] in (None, 1.0) and rows[generous.key]["kl"] == pytest.approx(0, abs=1e-4)
    assert rows[tight.key]["peak_layer_entries"] <= 64 + 48 + 16
    # streaming keeps the sink and the recent past: evidence planted mid-conversation is mostly evicted
    assert rows[tight.key]["evidence_kept"] < 0.5


def test_cli_eval_rejects_bad_options_before_loading_a_model(tmp_path):
    for args, message in [
        ((), "give LoCoMo files"),
        (("x.json", "--methods", "epicache,bogus"), "unknown method 'bogus'"),
        (("x.json", "--budgets", "256,abc"), "comma-separated integers"),
        (("x.json", "--budgets", "0"), "--budget must be >= 1"),
        (("x.json", "--questions", "0"), "--questions must be >= 1"),
        ((str(tmp_path / "missing.json"),), "missing.json"),
    ]:
        result = run_main(tmp_path, "eval", *args)
        assert result.returncode == 2, (args, result.stderr)
        assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_cli_eval_with_no_scorable_question_is_a_user_error(tmp_path, tiny_model_dir):
    conv = {"conversation": {"speaker_a": "Tom", "speaker_b": "Ana", "session_1_date_time": "1:56 pm on 8 May, 2023",
                             "session_1": [{"speaker": "Tom", "dia_id": "D1:1", "text": "I planted 12 tomatoes."},
                                           {"speaker": "Ana", "dia_id": "D1:2", "text": "Where do they fit?"}]},
            "qa": [{"question": "What did Ana plant?", "adversarial_answer": "roses", "category": 5,
                    "evidence": ["D1:2"]}]}
    (tmp_path / "conv.json").write_text(json.dumps(conv))
    result = run_main(tmp_path / "home", "eval", str(tmp_path / "conv.json"), "--model", str(tiny_model_dir),
                      "--methods", "streaming", "--budgets", "64")
    assert result.returncode == 2 and "no question to score" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_cli_eval_synthetic_end_to_end_with_report(tmp_path, tiny_model_dir):
    out, report = tmp_path / "r.jsonl", tmp_path / "rep" / "report.md"
    args = ("eval", "--synthetic", "1", "--model", str(tiny_model_dir), "--methods", "streaming",
            "--budgets", "256", "--setting", "block_size=256", "--questions", "2", "--out", str(out),
            "--report", str(report), "--json")
    result = run_main(tmp_path / "home", *args)
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["schema"] == 1 and all(r["ingest_ms"] > 0 for r in document["rows"])
    rows = {r["variant"]: r for r in document["rows"]}
    assert set(rows) == {REFERENCE, "streaming@256/block_size=256"}
    assert all(r["questions"] == 2 for r in rows.values())
    assert "| streaming@256/block_size=256 |" in report.read_text() and report.with_suffix(".png").stat().st_size > 0
    assert " turns, 2 of its " in report.read_text()  # the notes say how many questions were asked
    again = run_main(tmp_path / "home", *args)  # everything is in the file: nothing is recomputed
    assert again.returncode == 0 and json.loads(again.stdout) == json.loads(result.stdout)
    assert len(out.read_text().splitlines()) == 2 + 2 * 2
    # the report says which weights built and answered: `auto` keeps the tiny model's random weights as loaded
    assert "; float weights (the caches built and the answers decoded with them" in report.read_text()


def test_cli_eval_answers_with_the_weights_asked_for(tmp_path, tiny_model_dir):
    report = tmp_path / "report.md"
    result = run_main(tmp_path / "home", "eval", "--synthetic", "1", "--model", str(tiny_model_dir), "--methods",
                      "streaming", "--budgets", "256", "--setting", "block_size=256", "--questions", "1",
                      "--weights", "int4", "--device", "cpu", "--report", str(report), "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "; int4 weights (the caches built and the answers decoded with them" in report.read_text()
    assert (tmp_path / "home" / "models" / "held").is_dir()  # the int4 weights were made, and kept


def test_turn_positions_point_at_the_turns_tokens(tiny_lm):
    from kvchat.eval.evaluate import _turn_positions

    turns = _tiny_set().turns[:12]
    ids = tiny_lm.encode("\n".join(format_turns(turns)))[0]
    spans = _turn_positions(tiny_lm, turns, offset=5)
    assert set(spans) == {t.turn_id for t in turns}
    for turn in turns:
        text = tiny_lm.decode(ids[spans[turn.turn_id] - 5].tolist())
        squeeze = "".join  # the word-level test tokenizer decodes with spaces around punctuation
        assert squeeze(text.split()) == squeeze(f"{turn.role}: {turn.text}".split())


def test_a_variant_the_model_cannot_take_is_recorded_as_skipped(tmp_path, tiny_lm, encoder):
    too_small = Variant(dataclasses.replace(SMALL.cache, method="streaming", budget=8))  # < the system prompt
    fine = Variant(dataclasses.replace(SMALL.cache, method="streaming", budget=64))
    records = evaluate([_tiny_set()], [too_small, fine], lm=tiny_lm, encoder=encoder,
                       config=EvalConfig(max_new_tokens=2, questions=1), base=SMALL,
                       results=ResultsFile(tmp_path / "r.jsonl"))
    skipped = [r for r in records if r["kind"] == "skipped"]
    assert [r["variant"] for r in skipped] == [too_small.key] and "system prompt" in skipped[0]["reason"]
    assert {r["variant"] for r in summarize(ResultsFile(tmp_path / "r.jsonl").records)} == {REFERENCE, fine.key}
    lines = (tmp_path / "r.jsonl").read_text()
    again = evaluate([_tiny_set()], [too_small, fine], lm=tiny_lm, encoder=encoder,
                     config=EvalConfig(max_new_tokens=2, questions=1), base=SMALL,
                     results=ResultsFile(tmp_path / "r.jsonl"))
    assert (tmp_path / "r.jsonl").read_text() == lines and len(again) == len(records)  # a resume does not retry it


def test_per_conversation_rows_name_their_conversation(tmp_path, tiny_lm, encoder):
    """Two conversations: the pooled summary has one row per variant, the per-conversation one a row per
    conversation and variant, each counting only its own questions."""
    from kvchat.eval.summary import summarize_per_conversation

    sets = planted_sets(2, topics=2, turns_per_topic=8)
    variant = Variant(dataclasses.replace(SMALL.cache, method="streaming", budget=64))
    records = evaluate(sets, [variant], lm=tiny_lm, encoder=encoder,
                       config=EvalConfig(max_new_tokens=2, questions=1), base=SMALL)  # fmt: skip
    pooled = {r["variant"]: r for r in summarize(records)}
    per = summarize_per_conversation(records)
    assert pooled[variant.key]["questions"] == 2
    assert sorted((r["conversation"], r["variant"]) for r in per) == sorted(
        (s.name, key) for s in sets for key in (REFERENCE, variant.key)
    )
    assert all(r["questions"] == 1 for r in per)
