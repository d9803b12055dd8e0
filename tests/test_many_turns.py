"""A history of very many tiny turns (issue 29, case 11): planning an ingest reports its steps as it goes
(reading, tokenizing, embedding the segments chunk by chunk, clustering), so a long history shows progress
within seconds rather than at its first block."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvchat.config import DEFAULT_EPISODES, EPISODE_SPAN_TOKENS, CacheConfig, EpisodeConfig, IngestConfig
from kvchat.history.episodes import scaled_count
from kvchat.ingest.plan import plan_ingest
from kvchat.model import encoder as encoder_module

TURNS = 100_000


class _FastEncoder:
    """The encoder's interface, its chunks and reports included, without its model: segments embed by length."""

    def embed(self, texts, on_progress=None):
        out = []
        for start in range(0, len(texts), encoder_module.EMBED_CHUNK):
            chunk = texts[start : start + encoder_module.EMBED_CHUNK]
            out.append(np.stack([np.array([len(t) % 7 + 1.0, len(t) % 3 + 1.0], dtype=np.float32) for t in chunk]))
            if on_progress is not None:
                on_progress(start + len(chunk), len(texts))
        vectors = np.concatenate(out)
        return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def test_planning_a_history_of_many_tiny_turns_reports_every_step(tmp_path, tiny_lm):
    history = tmp_path / "tiny-turns.json"
    history.write_text(json.dumps([{"role": ("user", "assistant")[i % 2], "content": f"ok {i % 7}"}
                                   for i in range(TURNS)]))  # fmt: skip
    steps: list[tuple[str, int, int]] = []
    config = IngestConfig(cache=CacheConfig(method="epicache", budget=64, block_size=64),
                          episodes=EpisodeConfig(episodes=2))
    plan = plan_ingest(history, name="many", config=config, store=None, lm=tiny_lm, encoder=_FastEncoder(),
                       replace=True, profile_dirs=[], force=True, on_step=lambda *step: steps.append(step))  # fmt: skip
    assert plan.turns == TURNS
    names = [s[0] for s in steps]
    assert names[:2] == ["reading the history", f"tokenizing {TURNS:,} turns"] and names[-1] == "clustering episodes"
    embedding = [(done, total) for name, done, total in steps if name == "embedding segments"]
    segments = TURNS // EpisodeConfig.segment_turns
    assert len(embedding) == -(-segments // encoder_module.EMBED_CHUNK) > 10  # one report per chunk, in order
    assert embedding[-1] == (segments, segments) and [d for d, _ in embedding] == sorted(d for d, _ in embedding)


def test_the_encoder_embeds_in_chunks_and_reports_each(encoder, monkeypatch):
    texts = [f"segment {i} about {('cats', 'tax forms', 'the sea')[i % 3]}" for i in range(7)]
    whole = encoder.embed(texts)
    monkeypatch.setattr(encoder_module, "EMBED_CHUNK", 3)
    reports: list[tuple[int, int]] = []
    chunked = encoder.embed(texts, lambda done, total: reports.append((done, total)))
    assert reports == [(3, 7), (6, 7), (7, 7)]
    np.testing.assert_allclose(chunked, whole, atol=1e-5)
    assert encoder.embed([]).shape[0] == 0


@pytest.mark.parametrize("elapsed, lines", [(0.0, 0), (10.0, 3)])
def test_a_log_hears_of_planning_only_once_an_ingest_is_slow(capsys, monkeypatch, elapsed, lines):
    from kvchat.cli import progress as progress_module

    shown = progress_module.LineIngestProgress()
    monkeypatch.setattr(shown, "_seconds", lambda: elapsed)
    shown.planning("tokenizing 10 turns", 0, 1)
    for done in (100, 150, 900):  # the first tenth, the same tenth again, another tenth
        shown.planning("embedding segments", done, 1000)
    printed = [line for line in capsys.readouterr().err.splitlines() if line.startswith("kvchat: ")]
    assert len(printed) == lines


@pytest.mark.parametrize("method", ["routed", "epicache"])
def test_a_routed_method_gets_one_episode_per_span_of_a_long_history(tmp_path, tiny_lm, method):
    """Without a given count, routed episode caches each stand for at most about EPISODE_SPAN_TOKENS of the history
    (they prefill it once between them); a method that feeds every episode the whole history keeps
    DEFAULT_EPISODES, each one a pass over it."""
    history = tmp_path / "long.json"
    history.write_text(json.dumps([{"role": ("user", "assistant")[i % 2], "content": f"ok {i % 7} then {i % 11}"}
                                   for i in range(40_000)]))  # fmt: skip
    config = IngestConfig(cache=CacheConfig(method=method, budget=64, block_size=64))
    plan = plan_ingest(history, name="long", config=config, store=None, lm=tiny_lm, encoder=_FastEncoder(),
                       replace=True, profile_dirs=[], force=True)  # fmt: skip
    total = plan.history_tokens + plan.prefix_ids.shape[-1]
    assert total > 5 * EPISODE_SPAN_TOKENS
    if method == "routed":
        assert len(plan.episodes) == -(-total // EPISODE_SPAN_TOKENS) > DEFAULT_EPISODES
        assert any(f"one per {EPISODE_SPAN_TOKENS} tokens" in note for note in plan.notes)
    else:
        assert len(plan.episodes) == DEFAULT_EPISODES


def test_the_scaled_count_is_one_episode_per_span_and_never_under_the_least():
    assert scaled_count(10 * EPISODE_SPAN_TOKENS, least=DEFAULT_EPISODES, span=EPISODE_SPAN_TOKENS) == 10
    assert scaled_count(EPISODE_SPAN_TOKENS + 1, least=DEFAULT_EPISODES, span=EPISODE_SPAN_TOKENS) == DEFAULT_EPISODES
    assert scaled_count(9 * EPISODE_SPAN_TOKENS + 1, least=DEFAULT_EPISODES, span=EPISODE_SPAN_TOKENS) == 10
