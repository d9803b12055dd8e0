"""The whole loop on the embedded SmolLM2 model and real conversations (slow, still run in CI)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import REPO, SHARED_DATA

from kvchat.answer.session import Session
from kvchat.config import CacheConfig, EpisodeConfig, IngestConfig
from kvchat.history.loading import format_turns, load_history
from kvchat.ingest.pipeline import ingest
from kvchat.store import Store

pytestmark = pytest.mark.slow

EXAMPLE = REPO / "examples" / "planted_facts.json"
QUESTIONS = [  # the facts planted in examples/planted_facts.json (kvchat.history.synthetic, seed 7)
    "What is the secret ingredient in Maya's grandmother's soup?",
    "Which gate does Tom's flight to Lisbon leave from?",
    "What is the code name of Tom's project at work?",
    "How many tomato plants did Tom plant this spring?",
]


def _locomo_prefix(source: Path, max_tokens: int, lm, target: Path) -> Path:
    """Whole sessions from the start of a LoCoMo file while the rendered text stays under max_tokens."""
    data = json.loads(source.read_text())
    kept = {k: v for k, v in data.items() if k in ("speaker_a", "speaker_b")}
    n = 1
    while f"session_{n}" in data:
        trial = kept | {f"session_{n}": data[f"session_{n}"], f"session_{n}_date_time": data[f"session_{n}_date_time"]}
        target.write_text(json.dumps(trial))
        if lm.encode("\n".join(format_turns(load_history(target)))).shape[-1] > max_tokens:
            break
        kept, n = trial, n + 1
    target.write_text(json.dumps(kept))
    return target


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="shared LoCoMo data not beside the repo")
def test_locomo_conversation_cut_to_2k_tokens(tmp_path, default_lm, encoder):
    history = _locomo_prefix(SHARED_DATA / "conv-30.json", 2000, default_lm, tmp_path / "conv30.json")
    store = Store(tmp_path / "home")
    config = IngestConfig(cache=CacheConfig(budget=512, block_size=256, prefill="block"))
    report = ingest(history, name="conv30", config=config, store=store, lm=default_lm, encoder=encoder)
    assert 1000 < report.history_tokens <= 2000 and report.episodes == 4
    assert report.layer_budgets == "sensitivity"  # the shipped profile of the embedded model is used
    assert sum(report.budgets) == 512 * default_lm.num_layers and len(set(report.budgets)) > 1
    assert report.peak_layer_entries <= max(report.budgets) + 256 + config.episodes.patched_prompt_tokens + 16
    answer = Session(store, store.get("conv30"), default_lm, encoder).ask("What does Gina do for work?")
    assert answer.text and answer.answer_tokens > 0


def test_a_budget_that_keeps_everything_answers_exactly_like_full_kv(tmp_path, default_lm, encoder):
    """Also: each planted question routes to its own episode (the four topics became four episodes)."""
    store = Store(tmp_path)
    keep_all = IngestConfig(
        cache=CacheConfig(budget=4096, block_size=512, layer_budgets="uniform"), episodes=EpisodeConfig(episodes=4)
    )
    full = IngestConfig(cache=CacheConfig(method="full", block_size=512))
    ingest(EXAMPLE, name="big", config=keep_all, store=store, lm=default_lm, encoder=encoder)
    ingest(EXAMPLE, name="full", config=full, store=store, lm=default_lm, encoder=encoder)
    big = Session(store, store.get("big"), default_lm, encoder)
    reference = Session(store, store.get("full"), default_lm, encoder)
    answers = [big.ask(q) for q in QUESTIONS]
    assert [a.text for a in answers] == [reference.ask(q).text for q in QUESTIONS]
    assert sorted(a.episode for a in answers) == [0, 1, 2, 3]
