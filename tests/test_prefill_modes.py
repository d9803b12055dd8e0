"""`--prefill full|block|auto`: one full prefill shared by the episodes, and when auto picks it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import raises_said
from conftest import random_ids as _ids

from kvchat.answer.session import Session
from kvchat.config import CacheConfig, EpisodeConfig, IngestConfig
from kvchat.errors import UserError
from kvchat.ingest.pipeline import ingest, plan_ingest
from kvchat.kv.forward import forward
from kvchat.kv.heads import HeadBudgets
from kvchat.kv.prefill import block_prefill, select_from
from kvchat.kv.scoring import CakeScorer, PatchedPromptScorer, probe_scores, select_top
from kvchat.store import Store

CONFIG = IngestConfig(cache=CacheConfig(budget=96, block_size=48), episodes=EpisodeConfig(patched_prompt_tokens=48))


def test_select_from_keeps_the_top_scored_entries_and_leaves_the_full_cache_whole(model):
    prefix, context, prompt = _ids(3, 1), _ids(80, 2), _ids(6, 9)
    full = block_prefill(model, prefix, context, block_size=16, budgets=None, scorer=None).cache
    before = [layer.keys.clone() for layer in full.layers]
    want = [select_top(s, 30, 3) for s in probe_scores(model, full, prompt)]
    picked = select_from(model, full, context[:, -16:], budgets=[30, 30], scorer=PatchedPromptScorer(prompt))
    for layer, index in zip(picked.layers, want, strict=True):
        assert torch.equal(layer.positions, index)
    assert full.sizes == [83, 83] and all(torch.equal(a.keys, b) for a, b in zip(full.layers, before, strict=True))
    assert picked.next_position == full.next_position == 83
    adaptive = select_from(model, full, context[:, -16:], budgets=[30, 30], scorer=PatchedPromptScorer(prompt),
                           heads=HeadBudgets("adaptive"))  # fmt: skip
    assert all(layer.ragged and layer.entries == 60 for layer in adaptive.layers)


def test_a_selection_as_large_as_the_history_answers_as_full_kv(model):
    prefix, context, question = _ids(3, 1), _ids(60, 2), _ids(5, 3)
    full = block_prefill(model, prefix, context, block_size=16, budgets=None, scorer=None).cache
    picked = select_from(model, full, context[:, -16:], budgets=[63, 63], scorer=PatchedPromptScorer(_ids(4, 8)))
    torch.testing.assert_close(forward(model, picked, question), forward(model, full, question))


def test_select_from_refuses_a_scorer_that_reads_the_forward(model):
    full = block_prefill(model, _ids(3, 1), _ids(40, 2), block_size=16, budgets=None, scorer=None).cache
    with pytest.raises(ValueError, match="after the block"):
        select_from(model, full, _ids(16, 2), budgets=[20, 20], scorer=CakeScorer(8, 200.0, 5))


def test_full_prefill_ingest_builds_every_episode_from_one_prefill(tmp_path, history, tiny_lm, encoder):
    store = Store(tmp_path)
    config = dataclasses.replace(CONFIG, cache=dataclasses.replace(CONFIG.cache, prefill="full"))
    report = ingest(history, name="conv", config=config, store=store, lm=tiny_lm, encoder=encoder)
    record = store.get("conv")
    assert report.prefill == "full" == record.settings["prefill"] and len(record.episodes) == 4
    prefix = plan_ingest(history, name="x", config=config, store=store, lm=tiny_lm, encoder=encoder).prefix_ids
    total = prefix.shape[-1] + report.history_tokens  # the whole history is held at once...
    assert total < report.peak_layer_entries <= total + 48 + 16  # ...with one patched prompt on top
    assert report.budgets == [96, 96]
    answer = Session(store, record, tiny_lm, encoder).ask("How many tomato plants did Tom plant this spring?")
    assert answer.answer_tokens >= 0


def test_auto_picks_full_inside_the_window_and_memory_and_block_otherwise(tmp_path, history, tiny_lm, encoder):
    store = Store(tmp_path)

    def plan(**kw):
        return plan_ingest(history, name="c", config=CONFIG, store=store, lm=tiny_lm, encoder=encoder, **kw)

    assert plan().prefill == "full" and plan().config.cache.prefill == "full"
    assert plan(max_memory=1, force=True).prefill == "block"  # the whole history would not fit
    cake = dataclasses.replace(CONFIG, cache=dataclasses.replace(CONFIG.cache, layer_budgets="cake"))
    assert plan_ingest(history, name="c", config=cake, store=store, lm=tiny_lm, encoder=encoder).prefill == "block"
    forced = dataclasses.replace(cake, cache=dataclasses.replace(cake.cache, prefill="full"))
    with raises_said(UserError, "--setting prefill=full cannot run: cake layer budgets"):
        plan_ingest(history, name="c", config=forced, store=store, lm=tiny_lm, encoder=encoder)
