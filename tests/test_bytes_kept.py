"""Keep only what a cache holds (issue 43): episodes whose caches would be the same are stored once, no episode file
holds more entries than the history has tokens, episode files are written in the storage precision asked for, and
stores written before all this still load."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kvchat.answer.session import Session
from kvchat.config import CacheConfig, EpisodeConfig, IngestConfig
from kvchat.documents import conversation
from kvchat.history.loading import parse_history
from kvchat.history.synthetic import planted_conversation
from kvchat.ingest.append import append
from kvchat.ingest.pipeline import build_episodes, commit_ingest, ingest, plan_ingest, write_episode
from kvchat.kv import codec
from kvchat.settings import from_settings, to_settings
from kvchat.store import Store
from kvchat.store.home_doctor import diagnose

SHORT = parse_history(planted_conversation(seed=4, topics=4, turns_per_topic=4)[0], source="short")  # 16 turns
ROOMY = IngestConfig(cache=CacheConfig(budget=512, block_size=64, storage="model"),
                     episodes=EpisodeConfig(episodes=4, segment_turns=2, patched_prompt_tokens=48))  # fmt: skip


def _question_answers(store, name, lm, encoder) -> list[str]:
    session = Session(store, store.get(name), lm, encoder)
    return [session.ask("How many tomato plants did Tom plant?", episode=e, log=False).text for e in range(4)]


def test_episodes_that_evict_nothing_share_one_file(tmp_path, tiny_lm, encoder):
    store = Store(tmp_path)
    report = ingest(SHORT, name="short", config=ROOMY, store=store, lm=tiny_lm, encoder=encoder)
    record = store.get("short")
    assert len(record.episodes) == 4 and len({e.path for e in record.episodes}) == 1
    assert len({tuple(e.centroid) for e in record.episodes}) == 4  # four episodes all the same, routed as before
    size = record.episodes[0].path.stat().st_size
    assert report.cache_bytes == size == conversation(record)["cache_bytes"] == conversation(record)["disk_bytes"]
    assert sorted(p.name for p in record.episodes[0].path.parent.iterdir()) == ["0.safetensors", "conversation.json"]
    assert any("stored once" in note for note in report.notes)
    assert diagnose(tmp_path) == []
    # each episode answers from the shared cache, as it would from a cache of its own
    answers = _question_answers(store, "short", tiny_lm, encoder)
    assert len(set(answers)) == 1


def test_the_shared_file_equals_each_cache_built_on_its_own(tmp_path, tiny_lm, encoder):
    """What sharing stores is exactly what each episode would have built: one cache of the whole history."""
    store = Store(tmp_path)
    plan = plan_ingest(SHORT, name="apart", config=ROOMY, store=store, lm=tiny_lm, encoder=encoder)
    assert plan.one_cache
    apart = dataclasses.replace(plan, one_cache=False)  # as kvchat stored such a history before: a file each
    with store.begin("apart") as pending:
        built = list(build_episodes(apart, tiny_lm, scratch=pending.scratch_dir))
        records = [write_episode(pending, apart, b, tiny_lm) for b in built]
        commit_ingest(pending, apart, [b.stats() for b in built], records, tiny_lm, 0.0)
    old = store.get("apart")
    assert len({e.path for e in old.episodes}) == 4
    ingest(SHORT, name="shared", config=ROOMY, store=store, lm=tiny_lm, encoder=encoder)
    shared = store.load_episode(store.get("shared").episodes[0], tiny_lm.fingerprint)
    for episode in old.episodes:  # (the files' bytes differ: safetensors orders a header's entries as it likes)
        tensors, metadata = store.load_episode(episode, tiny_lm.fingerprint)
        assert metadata == shared[1] and tensors.keys() == shared[0].keys()
        assert all(torch.equal(tensors[k], shared[0][k]) for k in tensors)
    assert _question_answers(store, "apart", tiny_lm, encoder) == _question_answers(store, "shared", tiny_lm, encoder)


def test_an_append_keeps_sharing_while_nothing_is_evicted_then_splits(tmp_path, tiny_lm, encoder):
    store = Store(tmp_path)
    ingest(SHORT, name="grow", config=ROOMY, store=store, lm=tiny_lm, encoder=encoder)
    more = tmp_path / "more.json"
    more.write_text(json.dumps(planted_conversation(seed=5, topics=1, turns_per_topic=2)[0]))
    append(more, name="grow", store=store, lm=tiny_lm, encoder=encoder)
    record = store.get("grow")
    assert len({e.path for e in record.episodes}) == 1
    long = tmp_path / "long.json"
    long.write_text(json.dumps(planted_conversation(seed=6, topics=6, turns_per_topic=24)[0]))
    append(long, name="grow", store=store, lm=tiny_lm, encoder=encoder)
    record = store.get("grow")
    assert len({e.path for e in record.episodes}) == 4  # over budget: each episode keeps its own entries
    assert len({e.sha256 for e in record.episodes}) == 4
    assert diagnose(tmp_path) == []


@pytest.mark.parametrize("method", ["epicache", "snapkv", "full"])
def test_no_episode_file_holds_more_entries_than_the_history_has_tokens(tmp_path, tiny_lm, encoder, method):
    store = Store(tmp_path)
    config = dataclasses.replace(ROOMY, cache=dataclasses.replace(ROOMY.cache, method=method))
    report = ingest(SHORT, name="few", config=config, store=store, lm=tiny_lm, encoder=encoder)
    protected = codec.EpisodeMeta.from_metadata(store.load_episode(store.get("few").episodes[0],
                                                                   tiny_lm.fingerprint)[1]).protected  # fmt: skip
    for episode in store.get("few").episodes:
        cache, _ = codec.decode(*store.load_episode(episode, tiny_lm.fingerprint))
        assert max(n for layer in cache.layers for n in layer.lengths) <= protected + report.history_tokens


def test_episode_files_are_written_in_the_storage_asked_for_and_answer_alike(tmp_path, tiny_lm, encoder):
    store = Store(tmp_path)
    sizes = {}
    for storage in ("model", "float16", "int8"):
        config = dataclasses.replace(ROOMY, cache=dataclasses.replace(ROOMY.cache, storage=storage))
        ingest(SHORT, name=storage, config=config, store=store, lm=tiny_lm, encoder=encoder)
        record = store.get(storage)
        assert from_settings(record.settings).cache.storage == storage
        tensors, metadata = store.load_episode(record.episodes[0], tiny_lm.fingerprint)
        assert codec.EpisodeMeta.from_metadata(metadata).storage == storage
        sizes[storage] = record.episodes[0].bytes
        cache, _ = codec.decode(tensors, metadata, dtype=tiny_lm.dtype)
        assert cache.precision == "full"
    assert sizes["int8"] < sizes["float16"] < 0.6 * sizes["model"]


def test_settings_saved_before_storage_existed_read_as_the_models_dtype():
    saved = {k: v for k, v in to_settings(IngestConfig(), source=None).items() if k != "cache_storage"}
    assert from_settings(saved).cache.storage == "model"
