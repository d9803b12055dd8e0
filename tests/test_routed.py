"""`--method routed`: each episode's cache prefills only its own segments' turns, in history order."""

from __future__ import annotations

import dataclasses

import torch

from kvchat.answer.session import Session
from kvchat.config import AskConfig, CacheConfig, EpisodeConfig, IngestConfig
from kvchat.eval.qa import planted_sets
from kvchat.history.loading import format_turns
from kvchat.ingest.pipeline import ingest, plan_ingest
from kvchat.kv import codec
from kvchat.kv.cache import EpisodeCache
from kvchat.kv.forward import forward
from kvchat.store import Store

QA = planted_sets(1, topics=4, turns_per_topic=16)[0]
# files in the model's dtype: an answer is compared with a forward of the same tokens
CONFIG = IngestConfig(cache=CacheConfig(method="routed", budget=4096, block_size=64, prefill="auto", storage="model"),
                      episodes=EpisodeConfig(episodes=4, segment_turns=4, patched_prompt_tokens=48))  # fmt: skip


def test_each_episode_holds_its_own_turns_once_in_history_order(tmp_path, tiny_lm, encoder):
    plan = plan_ingest(QA.turns, name="r", config=CONFIG, store=Store(tmp_path), lm=tiny_lm, encoder=encoder)
    assert plan.prefill == "block"
    turns_of = [[t for s in sorted(e.segments) for t in QA.turns[4 * s : 4 * s + 4]] for e in plan.episodes]
    assert sorted(QA.turns.index(t) for turns in turns_of for t in turns) == list(range(len(QA.turns)))
    for turns, ids in zip(turns_of, plan.episode_ids, strict=True):
        assert torch.equal(ids, tiny_lm.encode("\n".join(format_turns(turns))))
    # one pass over the history in all (the planted history has no dates to repeat)
    prefilled = sum(ids.shape[-1] for ids in plan.episode_ids)
    assert plan.history_tokens - len(plan.episodes) <= prefilled <= plan.history_tokens


def test_an_answer_sees_exactly_its_episode_turns(tmp_path, tiny_lm, encoder):
    store = Store(tmp_path)
    ingest(QA.turns, name="r", config=CONFIG, store=store, lm=tiny_lm, encoder=encoder)
    conversation = store.get("r")
    plan = plan_ingest(QA.turns, name="r", config=CONFIG, store=store, lm=tiny_lm, encoder=encoder, replace=True)
    session = Session(store, conversation, tiny_lm, encoder, AskConfig(max_new_tokens=2))
    for e, ids in enumerate(plan.episode_ids):
        cache, meta = codec.decode(*store.load_episode(conversation.episodes[e], tiny_lm.fingerprint))
        assert meta.next_position == plan.prefix_ids.shape[-1] + ids.shape[-1]  # nothing else was prefilled
        first = []
        session.ask(QA.questions[0].text, episode=e, on_first_logits=first.append, log=False)
        prompt = torch.cat([plan.prefix_ids, ids, tiny_lm.encode(plan.layout.question(QA.questions[0].text))], -1)
        torch.testing.assert_close(first[0], forward(tiny_lm.model, EpisodeCache(tiny_lm.num_layers), prompt)[0, -1])


def test_a_budget_bounds_every_episode_cache(tmp_path, tiny_lm, encoder):
    store = Store(tmp_path)
    config = dataclasses.replace(CONFIG, cache=dataclasses.replace(CONFIG.cache, budget=96, block_size=48))
    report = ingest(QA.turns, name="r", config=config, store=store, lm=tiny_lm, encoder=encoder)
    assert report.method == "routed" and report.episodes == 4
    for record in store.get("r").episodes:
        cache, _ = codec.decode(*store.load_episode(record, tiny_lm.fingerprint))
        assert max(cache.sizes) <= 96
