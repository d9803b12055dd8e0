"""ingest -> store -> ask as library calls, on the tiny model with the real encoder."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import raises_said, with_kvchat_attention
from transformers import AutoModelForCausalLM

from kvchat.answer.decoding import question_prompt
from kvchat.answer.session import Session
from kvchat.config import AskConfig, CacheConfig, CakeConfig, EpisodeConfig, IngestConfig, Sampling
from kvchat.errors import CacheIntegrityError, UserError
from kvchat.history.episodes import build_episodes, route, segment
from kvchat.history.loading import Turn, format_turns
from kvchat.history.synthetic import planted_conversation
from kvchat.ingest.pipeline import ingest
from kvchat.model.llm import ChatLayout
from kvchat.store import Store

# Block prefill, whose peak these tests bound (the default, auto, holds the whole history when it fits).
SMALL = IngestConfig(cache=CacheConfig(budget=96, block_size=48, prefill="block"),
                     episodes=EpisodeConfig(patched_prompt_tokens=48))


def _ingest(store, history, lm, encoder, config=SMALL, name="conv", **kw):
    return ingest(history, name=name, config=config, store=store, lm=lm, encoder=encoder, **kw)


def test_ingest_stores_one_bounded_cache_per_episode(tmp_path, history, tiny_lm, encoder):
    store = Store(tmp_path)
    report = _ingest(store, history, tiny_lm, encoder)
    record = store.get("conv")
    assert report.episodes == len(record.episodes) == 4
    assert report.budgets == [96, 96]
    prompt_bound = 48 + 16  # prompt cap plus the chat template around it
    assert report.peak_layer_entries <= 96 + 48 + prompt_bound
    for episode in record.episodes:
        tensors, meta = store.load_episode(episode, tiny_lm.fingerprint)
        assert tensors["k.0"].shape[1] == 96 and meta["method"] == "epicache"


def test_full_method_reproduces_model_generate(tmp_path, history, tiny_lm, encoder):
    store = Store(tmp_path)
    config = replace(SMALL, cache=CacheConfig(method="full", block_size=48))
    _ingest(store, history, tiny_lm, encoder, config=config)
    plain = AskConfig(sampling=Sampling(repetition_penalty=1.0))  # transformers' greedy search, no penalty
    session = Session(store, store.get("conv"), tiny_lm, encoder, plain)
    question = "What is the code name of Tom's project at work?"
    answer = session.ask(question)

    layout = ChatLayout.from_tokenizer(tiny_lm.tokenizer, config.system_prompt)
    turns = [Turn(m["role"], m["content"]) for m in json.loads(history.read_text())]
    ids = torch.cat(
        [
            tiny_lm.encode(layout.before_conversation),
            tiny_lm.encode("\n".join(format_turns(turns))),
            tiny_lm.encode(question_prompt(layout, plain, question)),
        ],
        dim=-1,
    )
    reference = AutoModelForCausalLM.from_pretrained(tiny_lm.config.name_or_path, dtype=torch.float32)
    reference = with_kvchat_attention(reference).eval()
    with torch.no_grad():  # transformers' own generate, on its own model of the same weights
        out = reference.generate(ids, max_new_tokens=64, do_sample=False, eos_token_id=list(tiny_lm.stop_ids))
    reference = tiny_lm.decode([t for t in out[0, ids.shape[1]:].tolist() if t not in tiny_lm.stop_ids])
    assert answer.text == reference.strip()
    assert answer.answer_tokens > 0


def test_answers_do_not_leak_into_the_next_question(tmp_path, history, tiny_lm, encoder):
    store = Store(tmp_path)
    _ingest(store, history, tiny_lm, encoder)
    session = Session(store, store.get("conv"), tiny_lm, encoder)
    first = session.ask("How many tomato plants did Tom plant this spring?", episode=1)
    session.ask("Which gate does Tom's flight to Lisbon leave from?", episode=1)
    again = session.ask("How many tomato plants did Tom plant this spring?", episode=1)
    assert again.text == first.text
    assert again.reused_cache and not first.reused_cache


def test_routing_sends_each_question_to_the_episode_holding_its_fact(encoder):
    messages, facts = planted_conversation(seed=11, topics=4, turns_per_topic=24)
    lines = format_turns([Turn(m["role"], m["content"]) for m in messages])
    segments = segment(lines, 4)
    episodes = build_episodes(
        segments, encoder.embed(segments), k=4, seed=0, token_cap=256, count_tokens=lambda t: len(t.split())
    )
    centroids = np.stack([e.centroid for e in episodes])
    for fact, query in zip(facts, encoder.embed([f.question for f in facts]), strict=True):
        index, _ = route(query, centroids)
        assert fact.turn // 4 in episodes[index].segments, fact


def test_compact_positions_stay_within_the_budget(tmp_path, history, tiny_lm, encoder):
    store = Store(tmp_path)
    config = replace(SMALL, cache=replace(SMALL.cache, positions="compact"))
    report = _ingest(store, history, tiny_lm, encoder, config=config)
    assert report.positions == "compact"
    episode = store.get("conv").episodes[0]
    tensors, meta = store.load_episode(episode, tiny_lm.fingerprint)
    assert tensors["pos.0"].max().item() == 95 and meta["next_position"] == "96"
    assert Session(store, store.get("conv"), tiny_lm, encoder).ask("Which gate?").answer_tokens >= 0


@pytest.mark.parametrize("alpha", [None, 3.0])
def test_a_profile_of_the_weights_gives_sensitivity_budgets_and_is_recorded(tmp_path, history, tiny_lm, encoder,
                                                                          alpha):
    from kvchat.ingest.layer_profiles import LayerProfile
    from kvchat.kv.budgets import sensitivity_budgets
    from kvchat.model.llm import weights_fingerprint

    profiles = tmp_path / "profiles"
    LayerProfile("tiny", weights_fingerprint(tiny_lm.model), {}, 400, [0.7, 0.6], [0.3, 0.4], alpha=1.5).save(
        profiles / "tiny.json"
    )
    store = Store(tmp_path / "home")
    config = replace(SMALL, cache=replace(SMALL.cache, alpha=alpha))  # layer_budgets "auto"
    report = _ingest(store, history, tiny_lm, encoder, config=config, profile_dirs=[profiles])
    record = store.get("conv")
    used = 1.5 if alpha is None else alpha
    assert (record.settings["layer_budgets"], record.settings["alpha"]) == ("sensitivity", used)
    protected = int(store.load_episode(record.episodes[0], tiny_lm.fingerprint)[1]["protected"])
    expected = sensitivity_budgets([0.3, 0.4], 96, used, protected=protected)
    assert report.budgets == record.episodes[0].budgets == expected
    assert report.budgets[0] < 96 < report.budgets[1]


@pytest.mark.parametrize("method", ["epicache", "cake"])
def test_cake_layer_budgets_ingest_and_answer(tmp_path, history, tiny_lm, encoder, method):
    """`--layer-budgets cake` with EpiCache's probe scorer, and with CAKE's own (all of CAKE)."""
    store = Store(tmp_path)
    config = replace(SMALL, cache=replace(SMALL.cache, method=method, layer_budgets="cake"))
    report = _ingest(store, history, tiny_lm, encoder, config=config)
    record = store.get("conv")
    assert report.layer_budgets == record.settings["layer_budgets"] == "cake"
    assert (record.settings["tau1"], record.settings["tau2"]) == (1.0, 1.0)
    assert len(record.episodes) == (4 if method == "epicache" else 1)
    for episode in record.episodes:  # computed from each episode's own prefill
        assert sum(episode.budgets) == 2 * 96 and min(episode.budgets) >= 96 // 4
        tensors, meta = store.load_episode(episode, tiny_lm.fingerprint)
        assert [tensors[f"k.{layer}"].shape[1] for layer in (0, 1)] == episode.budgets
    prompt = 48 + 16 if method == "epicache" else 0
    assert report.peak_total_entries <= 2 * (96 + 48) + prompt
    answer = Session(store, record, tiny_lm, encoder).ask("How many tomato plants did Tom plant this spring?")
    assert answer.conversation == "conv" and answer.answer_tokens > 0


@pytest.mark.parametrize(
    "config, message",
    [
        (replace(SMALL, cache=replace(SMALL.cache, budget=0)), "--budget must be >= 1"),
        (replace(SMALL, cache=replace(SMALL.cache, budget=20)), "must exceed the system prompt"),
        (replace(SMALL, episodes=EpisodeConfig(episodes=500)), "more than the history's"),
        (replace(SMALL, cache=replace(SMALL.cache, method="magic")), "unknown --method"),
        (replace(SMALL, cache=replace(SMALL.cache, block_size=8)), "--setting block_size must be >= 16"),
        (replace(SMALL, cache=replace(SMALL.cache, cake=CakeConfig(tau1=0.0))), r"--setting tau1 must be in \(0, 10\]"),
        (replace(SMALL, cache=replace(SMALL.cache, cake=CakeConfig(tau2=float("nan")))), "--setting tau2 must be in"),
        (replace(SMALL, cache=replace(SMALL.cache, layer_budgets="cake", budget=20)), "must exceed the system prompt"),
    ],
)
def test_bad_settings_are_user_errors_and_write_nothing(tmp_path, history, tiny_lm, encoder, config, message):
    store = Store(tmp_path)
    with raises_said(UserError, message):
        _ingest(store, history, tiny_lm, encoder, config=config)
    assert store.conversations() == []


def test_default_episodes_are_what_the_history_holds_and_a_given_count_is_not_lowered(tmp_path, tiny_lm, encoder):
    """12 turns in segments of 4 hold 3 episodes: without --episodes, 3 and a note; --episodes 4, refused."""
    turns = [Turn("user" if i % 2 == 0 else "assistant", f"Message {i} about the garden and tomatoes.")
             for i in range(12)]  # fmt: skip
    store = Store(tmp_path)
    report = _ingest(store, turns, tiny_lm, encoder)
    assert report.episodes == len(store.get("conv").episodes) == 3
    assert store.get("conv").settings["episodes"] is None  # counted from the history again at a re-ingest
    assert any("3 episodes, not 4: the history has 3 segments of 4 turns" in note for note in report.notes)
    given = replace(SMALL, episodes=replace(SMALL.episodes, episodes=4))
    with raises_said(UserError, "--episodes 4 is more than the history's 3 segments .* at most 3"):
        _ingest(store, turns, tiny_lm, encoder, config=given, name="given")


def test_reingest_needs_replace(tmp_path, history, tiny_lm, encoder):
    store = Store(tmp_path)
    _ingest(store, history, tiny_lm, encoder)
    with raises_said(UserError, "--replace"):
        _ingest(store, history, tiny_lm, encoder)
    _ingest(store, history, tiny_lm, encoder, replace=True)
    assert [c.name for c in store.conversations()] == ["conv"]


def test_a_tampered_cache_is_refused_when_asked(tmp_path, history, tiny_lm, encoder):
    store = Store(tmp_path)
    _ingest(store, history, tiny_lm, encoder)
    record = store.get("conv")
    path = record.episodes[0].path
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CacheIntegrityError, match="rebuild"):
        Session(store, record, tiny_lm, encoder).ask("anything?", episode=0)


def test_session_follows_a_replaced_conversation_and_names_a_removed_one(tmp_path, history, tiny_lm, encoder):
    store = Store(tmp_path)
    _ingest(store, history, tiny_lm, encoder)
    session = Session(store, store.get("conv"), tiny_lm, encoder)
    session.ask("What is the name of Maya's dog?", log=False)
    fewer = replace(SMALL, episodes=replace(SMALL.episodes, episodes=2))
    _ingest(store, history, tiny_lm, encoder, config=fewer, replace=True)  # old files are gone now
    answer = session.ask("What is the name of Maya's dog?", log=False)
    assert answer.episode in (0, 1) and len(session.conversation.episodes) == 2 and not answer.reused_cache
    store.remove("conv")
    with pytest.raises(UserError, match="was removed while this session was open"):
        session.ask("What is the name of Maya's dog?", log=False)
