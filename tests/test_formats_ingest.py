"""Each new history format ingests and answers: the turns its importer reads are what the caches hold."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvchat.answer.session import Session
from kvchat.config import CacheConfig, EpisodeConfig, IngestConfig
from kvchat.history.loading import format_turns, load_history
from kvchat.ingest.pipeline import ingest
from kvchat.store import Store

GOOD = Path(__file__).parent / "data" / "good"
SMALL = IngestConfig(cache=CacheConfig(budget=64, block_size=32), episodes=EpisodeConfig(episodes=2, segment_turns=2,
                                                                                          patched_prompt_tokens=32))


@pytest.mark.parametrize(("name", "pick", "question"), [
    ("chatgpt_export.json", "all", "What is the hotel confirmation number?"),
    ("claude_export.json", "all", "What is my starter called?"),
    ("finetune.jsonl", "all", "Which terminal for TP 441?"),
    ("transcript_bracketed.txt", None, "Which hotel is Alice staying at?"),
])
def test_format_ingests_and_answers(tmp_path, tiny_lm, encoder, name, pick, question):
    turns = load_history(GOOD / name, pick=pick)
    store = Store(tmp_path)
    report = ingest(turns, name="conv", config=SMALL, store=store, lm=tiny_lm, encoder=encoder,
                    source=str(GOOD / name))
    assert report.turns == len(turns)
    assert report.history_tokens == tiny_lm.encode("\n".join(format_turns(turns))).shape[-1]
    answer = Session(store, store.get("conv"), tiny_lm, encoder).ask(question, log=False)
    assert answer.conversation == "conv" and 0 <= answer.episode < report.episodes
    assert answer.prompt_tokens > 0 and isinstance(answer.text, str)
