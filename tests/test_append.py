"""`kvchat ingest --append`: new turns continue every stored episode cache instead of ingesting the past again."""

from __future__ import annotations

import json
import shlex
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_helpers import run_main
from conftest import raises_said

from kvchat import store as store_module
from kvchat.cli.words import spell
from kvchat.config import DEFAULT_EPISODES, CacheConfig, EpisodeConfig, IngestConfig
from kvchat.errors import UserError
from kvchat.history.episodes import Episode
from kvchat.history.loading import format_turns, load_history
from kvchat.history.synthetic import planted_conversation
from kvchat.ingest.append import append, reingest
from kvchat.ingest.pipeline import episode_scorer, ingest
from kvchat.kv import codec
from kvchat.kv.prefill import block_prefill
from kvchat.model.llm import ChatLayout
from kvchat.settings import differing_options, from_settings, to_settings
from kvchat.store import Store


@pytest.fixture(scope="module")
def halves(tmp_path_factory) -> tuple[Path, Path]:
    messages, _ = planted_conversation(seed=3, topics=4, turns_per_topic=12)
    folder = tmp_path_factory.mktemp("halves")
    first, second = folder / "a.json", folder / "b.json"
    first.write_text(json.dumps(messages[:30]))
    second.write_text(json.dumps(messages[30:]))
    return first, second


def _tokens(lm, path: Path) -> torch.Tensor:
    return lm.encode("\n".join(format_turns(load_history(path))))


def test_appending_b_to_a_gives_the_caches_of_a_and_b_at_once(tmp_path, halves, tiny_lm, encoder):
    first, second = halves
    a = _tokens(tiny_lm, first)
    block = a.shape[-1]  # A ends on a block boundary: its one block
    config = IngestConfig(cache=CacheConfig(budget=max(64, block // 8 + 1), block_size=block, prefill="block"),
                          episodes=EpisodeConfig(episodes=2, patched_prompt_tokens=48))  # fmt: skip
    store = Store(tmp_path)
    ingest(first, name="chat", config=config, store=store, lm=tiny_lm, encoder=encoder)
    report = append(second, name="chat", store=store, lm=tiny_lm, encoder=encoder)
    record = store.get("chat")
    b = tiny_lm.encode("\n" + "\n".join(format_turns(load_history(second))))
    both = torch.cat([a, b], dim=-1)
    whole = tiny_lm.encode("\n".join(format_turns(load_history(first) + load_history(second))))
    assert torch.equal(both, whole)  # the appended tokens are the whole history's tail
    assert report.history_tokens == both.shape[-1] and report.turns == record.stats["turns"] == 48

    resolved = from_settings(record.settings, record.model)
    layout = ChatLayout.from_tokenizer(tiny_lm.tokenizer, resolved.system_prompt)
    for stored in record.episodes:
        episode = Episode(stored.index, np.asarray(stored.centroid), (), stored.medoid_text)
        at_once = block_prefill(
            tiny_lm.model, tiny_lm.encode(layout.before_conversation), both, block_size=block,
            budgets=[resolved.cache.budget] * 2, scorer=episode_scorer(resolved, episode, tiny_lm, layout),
        ).cache  # fmt: skip
        appended, meta = codec.decode(*store.load_episode(stored, tiny_lm.fingerprint))
        assert meta.next_position == at_once.next_position
        want, got = codec.encode_layers(at_once), codec.encode_layers(appended)
        assert all(torch.equal(want[k], got[k]) for k in want), stored.index


def test_an_append_moves_centroids_and_counts_segments(tmp_path, halves, tiny_lm, encoder):
    first, second = halves
    store = Store(tmp_path)
    config = IngestConfig(cache=CacheConfig(budget=64, block_size=32), episodes=EpisodeConfig(episodes=2))
    before = ingest(first, name="chat", config=config, store=store, lm=tiny_lm, encoder=encoder)
    old = store.get("chat")
    after = append(second, name="chat", store=store, lm=tiny_lm, encoder=encoder)
    new = store.get("chat")
    assert sum(before.episode_segments) == 8 and sum(after.episode_segments) == 8 + 5  # 30 then 18 turns by 4
    moved = [e.index for e, o in zip(new.episodes, old.episodes, strict=True) if e.centroid != o.centroid]
    assert moved and all(abs(np.linalg.norm(e.centroid) - 1) < 1e-5 for e in new.episodes)
    assert [e.medoid_text for e in new.episodes] == [e.medoid_text for e in old.episodes]
    assert new.settings["appended"] == [str(second.resolve())] and new.settings["budget"] == 64


def test_a_failed_append_leaves_the_conversation_as_it_was(tmp_path, halves, tiny_lm, encoder, monkeypatch):
    first, second = halves
    store = Store(tmp_path)
    config = IngestConfig(cache=CacheConfig(budget=64, block_size=32), episodes=EpisodeConfig(episodes=2))
    ingest(first, name="chat", config=config, store=store, lm=tiny_lm, encoder=encoder)
    old = store.get("chat")
    written, real_write = [], store_module._write_file

    def fails_second(path, data):
        written.append(path)
        if len(written) == 2:
            raise OSError(5, "Input/output error")
        real_write(path, data)

    monkeypatch.setattr(store_module, "_write_file", fails_second)
    with pytest.raises(OSError):
        append(second, name="chat", store=store, lm=tiny_lm, encoder=encoder)
    assert store.get("chat") == old and store.check() == []


def test_reingest_clusters_the_stored_and_the_new_turns_again(tmp_path, halves, tiny_lm, encoder):
    first, second = halves
    store = Store(tmp_path)
    config = IngestConfig(cache=CacheConfig(budget=64, block_size=32), episodes=EpisodeConfig(episodes=2))
    ingest(first, name="chat", config=config, store=store, lm=tiny_lm, encoder=encoder)
    report = reingest(second, name="chat", store=store, lm=tiny_lm, encoder=encoder)
    record = store.get("chat")
    assert report.turns == 48 and record.settings["appended"] == [str(second.resolve())]
    assert record.settings["source"] == str(first.resolve()) and record.settings["budget"] == 64


def test_reingest_counts_the_episodes_of_the_longer_history_again(tmp_path, tiny_lm, encoder):
    """Without --episodes a short history holds fewer than the default count; re-ingested with more turns appended,
    the conversation gets the default count, not the short history's."""
    store = Store(tmp_path)
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"Message {i} about garden topic {i // 8}."}
             for i in range(32)]  # fmt: skip
    short, longer = tmp_path / "short.json", tmp_path / "more.json"
    short.write_text(json.dumps(turns[:8]))
    longer.write_text(json.dumps(turns[8:]))
    config = IngestConfig(cache=CacheConfig(budget=64, block_size=32))
    ingest(short, name="chat", config=config, store=store, lm=tiny_lm, encoder=encoder)
    assert len(store.get("chat").episodes) == 2  # 8 turns: 2 segments of 4
    reingest(longer, name="chat", store=store, lm=tiny_lm, encoder=encoder)
    assert len(store.get("chat").episodes) == DEFAULT_EPISODES


def test_cli_append_and_its_refusals(tmp_path, halves, tiny_model_dir):
    first, second = halves
    home = tmp_path / "home"
    model = ("--model", str(tiny_model_dir))
    base = ("--budget", "64", "--setting", "block_size=32", "--episodes", "2")
    assert run_main(home, "ingest", str(first), "--name", "chat", *model, *base).returncode == 0
    for args, says in [
        (("--append",), "--append needs --name"),
        (("--name", "chat", "--append", "--replace"), "give one of them"),
        (("--name", "chat", "--append", "--budget", "128"), "drop the cache options"),
        (("--name", "chat", "--append", "--budget", "128", "--episodes", "2"), "--budget 128 (built with 64):"),
        (("--name", "chat", "--reingest"), "--reingest goes with --append"),
    ]:
        refused = run_main(home, "ingest", str(second), *args)
        assert refused.returncode == 2 and says in refused.stderr, refused.stderr
    # options equal to the stored ones are no conflict (issue 28): they are accepted, not refused
    done = run_main(home, "ingest", str(second), "--name", "chat", "--append", "--json", *model, *base)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["turns"] == 48
    settings = Store(home).get("chat").settings
    command = spell(store_module._reingest_command(Store(home).get("chat")))
    first_part, then = command.split(" && ")
    assert shlex.split(then) == ["kvchat", "ingest", str(second.resolve()), "--name", "chat", "--append"]
    assert shlex.split(first_part)[2] == settings["source"] == str(first.resolve())


def test_an_append_takes_a_setting_equal_to_the_stored_one_and_names_one_that_differs(tmp_path, halves,
                                                                                        tiny_model_dir):
    """Issue 42: `--append --setting recall_share=0.75` on a conversation built with it is no conflict, and one that
    differs is refused naming `--setting recall_share=...`, the way it is given (there is no --recall-share)."""
    first, second = halves
    home = tmp_path / "home"
    base = ("--model", str(tiny_model_dir), "--budget", "256", "--setting", "block_size=32", "--episodes", "2")
    built = run_main(home, "ingest", str(first), "--name", "chat", "--method", "recall", *base,
                     "--setting", "recall_share=0.75")
    assert built.returncode == 0, built.stderr
    assert Store(home).get("chat").settings["recall_share"] == 0.75
    other = run_main(home, "ingest", str(second), "--name", "chat", "--append", "--setting", "recall_share=0.6")
    assert other.returncode == 2 and "--setting recall_share=0.6 (built with 0.75)" in other.stderr, other.stderr
    assert "--recall-share" not in other.stderr
    same = run_main(home, "ingest", str(second), "--name", "chat", "--append", "--setting", "recall_share=0.75")
    assert same.returncode == 0, same.stderr
    assert Store(home).get("chat").stats["turns"] == 48


def test_append_refuses_a_conversation_of_another_model(tmp_path, halves, tiny_lm, encoder):
    first, second = halves
    store = Store(tmp_path)
    config = IngestConfig(cache=CacheConfig(budget=64, block_size=32), episodes=EpisodeConfig(episodes=2))
    ingest(first, name="chat", config=config, store=store, lm=tiny_lm, encoder=encoder)
    other = replace(tiny_lm, fingerprint="another model")
    with raises_said(Exception, "append with --model"):
        append(second, name="chat", store=store, lm=other, encoder=encoder)


def test_appending_to_an_offload_conversation_pages_the_stored_and_the_new_evictions(tmp_path, halves, tiny_lm,
                                                                                      encoder):  # fmt: skip
    """The new pages file of every episode holds what ingesting A and B at once would have evicted (the
    resident window slides on: A's last tokens are evictable once B follows them)."""
    from kvchat.config import OffloadConfig
    from kvchat.kv.pagefile import decode as decode_pages
    from kvchat.kv.spill import SpillWriter

    first, second = halves
    a = _tokens(tiny_lm, first)
    block = a.shape[-1]
    offload = OffloadConfig(mode="icecache", dtype="float32")
    config = IngestConfig(cache=CacheConfig(method="epicache", budget=max(64, block // 8 + 1), block_size=block,
                                            prefill="block", offload=offload),
                          episodes=EpisodeConfig(episodes=2, patched_prompt_tokens=48))  # fmt: skip
    store = Store(tmp_path)
    ingest(first, name="chat", config=config, store=store, lm=tiny_lm, encoder=encoder)
    append(second, name="chat", store=store, lm=tiny_lm, encoder=encoder)
    record = store.get("chat")
    both = tiny_lm.encode("\n".join(format_turns(load_history(first) + load_history(second))))
    layout = ChatLayout.from_tokenizer(tiny_lm.tokenizer, config.system_prompt)
    cfg = tiny_lm.model.config
    for stored in record.episodes:
        episode = Episode(stored.index, np.asarray(stored.centroid), (), stored.medoid_text)
        spill_dir = tmp_path / f"spill-{stored.index}"
        spill_dir.mkdir()
        spill = SpillWriter(spill_dir, num_layers=2, kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                            dtype=torch.float32)  # fmt: skip
        block_prefill(
            tiny_lm.model, tiny_lm.encode(layout.before_conversation), both, block_size=block,
            budgets=[config.cache.budget + offload.recent] * 2, scorer=episode_scorer(config, episode, tiny_lm, layout),
            on_evict=spill, recent=offload.recent,
        )  # fmt: skip
        pages = decode_pages(*store.load_pages(stored, tiny_lm.fingerprint))
        for layer in range(2):
            for head in range(cfg.num_key_value_heads):
                keys, _, positions = spill.head_entries(layer, head)
                got = pages[layer][head]
                order, got_order = positions.argsort(), got.positions.argsort()
                assert torch.equal(positions[order], got.positions[got_order])
                assert torch.equal(keys[order], got.keys[got_order])


def test_append_refuses_a_full_kv_offload_conversation(tmp_path, halves, tiny_lm, encoder):
    from kvchat.config import OffloadConfig

    first, second = halves
    config = IngestConfig(cache=CacheConfig(method="full", offload=OffloadConfig(mode="icecache")),
                          episodes=EpisodeConfig(episodes=2, patched_prompt_tokens=48))  # fmt: skip
    store = Store(tmp_path)
    ingest(first, name="chat", config=config, store=store, lm=tiny_lm, encoder=encoder)
    with raises_said(UserError, "--append --reingest"):
        append(second, name="chat", store=store, lm=tiny_lm, encoder=encoder)


def test_cli_appends_a_single_new_turn(tmp_path, halves, tiny_model_dir):
    """A history to ingest needs two turns, but one new turn is a natural thing to append."""
    first, _ = halves
    home = tmp_path / "home"
    model = ("--model", str(tiny_model_dir))
    assert run_main(home, "ingest", str(first), "--name", "chat", *model, "--budget", "64",
                    "--setting", "block_size=32", "--episodes", "2").returncode == 0
    before = Store(home).get("chat").stats["turns"]
    one = tmp_path / "one.json"
    one.write_text(json.dumps([{"role": "user", "content": "By the way, the gate changed to 52."}]))
    done = run_main(home, "ingest", str(one), "--name", "chat", "--append", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["turns"] == before + 1
    refused = run_main(home, "ingest", str(one), "--name", "other", *model)
    assert refused.returncode == 2 and "needs at least 2 turns" in refused.stderr


def test_appending_the_same_file_twice_says_so(tmp_path, halves, tiny_model_dir):
    """Right after it, the file's turns are the conversation's last: nothing is appended. After other turns, they
    are appended again, and the note says they are now in it twice."""
    first, second = halves
    home = tmp_path / "home"
    assert run_main(home, "ingest", str(first), "--name", "chat", "--model", str(tiny_model_dir), "--budget", "64",
                    "--setting", "block_size=32", "--episodes", "2").returncode == 0
    once = run_main(home, "ingest", str(second), "--name", "chat", "--append", "--json")
    assert once.returncode == 0 and not any("before" in n for n in json.loads(once.stdout)["notes"])
    turns = Store(home).get("chat").stats["turns"]
    twice = run_main(home, "ingest", str(second), "--name", "chat", "--append", "--json")
    assert twice.returncode == 0, twice.stderr
    assert json.loads(twice.stdout)["appended_turns"] == 0 and "nothing to append" in twice.stderr
    assert Store(home).get("chat").stats["turns"] == turns
    one = tmp_path / "one.json"
    one.write_text(json.dumps([{"role": "user", "content": "By the way, the gate changed to 52."}]))
    assert run_main(home, "ingest", str(one), "--name", "chat", "--append").returncode == 0
    thrice = run_main(home, "ingest", str(second), "--name", "chat", "--append", "--json")
    assert thrice.returncode == 0, thrice.stderr
    assert any(f"{second.resolve()} was ingested into 'chat' before" in n for n in json.loads(thrice.stdout)["notes"])


def test_an_append_names_a_count_the_conversation_was_built_without():
    stored = to_settings(IngestConfig(), source="h.json")
    given = IngestConfig(episodes=EpisodeConfig(episodes=2))
    assert [spell(d) for d in differing_options(given, stored, "default")] == ["--episodes 2 (built without it)"]
