"""Histories three times the model's window: every cache option ingests, appends and answers there, with every
position a key is rotated for inside the window (compact positions), IceCache's pages included."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from conftest import raises_said, random_ids, tiny_model, tiny_tokenizer
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvchat.answer.grounding import quote_span
from kvchat.answer.session import Session
from kvchat.cli.words import spell
from kvchat.config import (
    AskConfig,
    CacheConfig,
    EpisodeConfig,
    IndexMemConfig,
    IngestConfig,
    OffloadConfig,
    PagingConfig,
    TrainConfig,
)
from kvchat.history import spans as turn_spans
from kvchat.history.loading import format_turns, load_history
from kvchat.history.synthetic import planted_conversation
from kvchat.ingest.append import append
from kvchat.ingest.pipeline import ingest
from kvchat.kv import codec, pagefile
from kvchat.kv.cache import EpisodeCache
from kvchat.kv.layers import QuantizedLayer
from kvchat.kv.prefill import block_prefill
from kvchat.kv.scoring import PatchedPromptScorer
from kvchat.kv.spill import SpillWriter
from kvchat.store import Store

BASE = IngestConfig(cache=CacheConfig(budget=96, block_size=32, prefill="block"),
                    episodes=EpisodeConfig(episodes=2, segment_turns=4, patched_prompt_tokens=48))  # fmt: skip
OFFLOAD = OffloadConfig(mode="icecache", recent=8, dtype="float32")
EVERYTHING = 10**6  # entries read back per head: every page


def _config(**cache) -> IngestConfig:
    return dataclasses.replace(BASE, cache=dataclasses.replace(BASE.cache, **cache))


@pytest.fixture(scope="module")
def histories(tmp_path_factory) -> dict[str, Path]:
    """A planted-fact history (`whole`), its first eighth (`start`: inside the window with room for an answer) and
    the rest (`rest`)."""
    messages, _ = planted_conversation(seed=5, topics=4, turns_per_topic=48)
    folder = tmp_path_factory.mktemp("histories")
    eighth = len(messages) // 8
    paths = {"whole": messages, "start": messages[:eighth], "rest": messages[eighth:]}
    for name, part in paths.items():
        (folder / f"{name}.json").write_text(json.dumps(part))
    return {name: folder / f"{name}.json" for name in paths}


@pytest.fixture(scope="module")
def short_lm(histories, tmp_path_factory):
    """The tiny Llama with a window a third of the whole history's tokens."""
    from kvchat.model.llm import load_model

    tokenizer = tiny_tokenizer()
    tokens = len(tokenizer("\n".join(format_turns(load_history(histories["whole"]))))["input_ids"])
    path = tmp_path_factory.mktemp("short-llama")
    model = tiny_model("llama", vocab_size=len(tokenizer))
    model.config.max_position_embeddings = tokens // 3
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return load_model(str(path), tmp_path_factory.mktemp("models"))


def _rotated_for(cache: EpisodeCache) -> list[list[torch.Tensor]]:
    """Per layer, per KV head, the positions its keys are rotated for."""
    return [list(layer.positions) if layer.ragged else list(layer.positions.unbind(0)) for layer in cache.layers]


def _assert_inside_the_window(cache: EpisodeCache, window: int) -> None:
    assert cache.next_position < window
    assert all(int(p.max()) < cache.next_position for layer in _rotated_for(cache) for p in layer)


def _first_answer(store: Store, name: str, lm, encoder, question: str, **ask) -> tuple[torch.Tensor, list, object]:
    """The first answer token's logits, what every layer read back from the pages then, and the answer."""
    session = Session(store, store.get(name), lm, encoder, AskConfig(max_new_tokens=4, **ask))
    seen: list = []
    answer = session.ask(question, episode=0, on_first_logits=lambda logits: seen.extend(
        [logits, session.retrieved_positions()]), log=False)  # fmt: skip
    return seen[0], seen[1], answer


def _assert_pages_beside_the_residents(store: Store, name: str, lm) -> None:
    """Every history entry of every head is resident or paged once, and each paged key is rotated for the compact
    position of its nearest resident predecessor in history order, inside the window."""
    for episode in store.get(name).episodes:
        cache, meta = codec.decode(*store.load_episode(episode, lm.fingerprint), origins=True)
        _assert_inside_the_window(cache, lm.context_window)
        tensors, metadata = store.load_pages(episode, lm.fingerprint)
        assert metadata["positions"] == "compact" and metadata["pages_format"] == pagefile.COMPACT_PAGES_FORMAT
        for layer, (heads, resident, placed) in enumerate(zip(
                pagefile.decode(tensors, metadata), cache.origins, _rotated_for(cache), strict=True)):  # fmt: skip
            for pages, origins, positions in zip(heads, resident, placed, strict=True):
                assert sorted(origins.tolist() + pages.positions.tolist()) == list(range(meta.next_origin)), layer
                before = torch.searchsorted(origins, pages.positions) - 1
                assert torch.equal(pages.at.to(torch.long), positions[before])


@pytest.mark.parametrize(("method", "heads"), [("auto", "uniform"), ("epicache", "uniform"), ("epicache", "adaptive")])
def test_offload_pages_sit_beside_the_compacted_cache_and_are_read_back(tmp_path, histories, short_lm, encoder,
                                                                        method, heads):  # fmt: skip
    store = Store(tmp_path)
    config = _config(method=method, offload=OFFLOAD, head_budgets=heads)
    report = ingest(histories["whole"], name="c", config=config, store=store, lm=short_lm, encoder=encoder)
    window = short_lm.context_window
    assert report.method == ("recall" if method == "auto" else method)  # the default beyond the window: recall
    assert report.positions == "compact" and report.history_tokens >= 3 * window and report.offloaded_entries > 0
    _assert_pages_beside_the_residents(store, "c", short_lm)
    logits, retrieved, answer = _first_answer(store, "c", short_lm, encoder, "Which gate does the flight leave from?",
                                              retrieve=EVERYTHING)  # fmt: skip
    assert torch.isfinite(logits).all() and answer.answer_tokens > 0
    read = torch.cat([p for layer in retrieved if layer for p in layer])
    assert read.numel() > 0 and int(read.max()) >= window  # entries from past the window were read back


def test_offloaded_keys_are_what_the_model_computes_at_their_new_positions(tmp_path, model):
    """Layer 0's keys depend only on the token and its position: a paged key moved beside the residents must equal
    the model's own key of that token at that position (transformers' RoPE, not kvchat's)."""
    prefix, context = random_ids(5, 1), random_ids(300, 2)
    cfg = model.config
    spill = SpillWriter(tmp_path, num_layers=2, kv_heads=2, head_dim=16, dtype=torch.float32,
                        rotary_emb=model.model.rotary_emb)  # fmt: skip
    cache = block_prefill(model, prefix, context, block_size=32, budgets=[40, 40], scorer=PatchedPromptScorer(
        random_ids(6, 7)), compact=True, on_evict=spill, recent=8, origins=True).cache  # fmt: skip
    spill.place_beside(cache)
    pages = next(iter(spill.layers(PagingConfig(page_size=4, cluster_size=4))))
    ids = torch.cat([prefix, context], -1)[0]
    attention = model.model.layers[0].self_attn
    hidden = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
    raw = attention.k_proj(hidden).view(len(ids), cfg.num_key_value_heads, cfg.head_dim).transpose(0, 1)[None]
    assert cache.next_position == 40  # compacted: the budget's entries at 0..39
    for h, head in enumerate(pages):
        assert head.at is not None and int(head.at.max()) < cache.next_position
        cos, sin = model.model.rotary_emb(raw, head.at[None].to(torch.long))
        want, _ = apply_rotary_pos_emb(raw[:, h : h + 1, head.positions], raw[:, h : h + 1, head.positions], cos, sin)
        torch.testing.assert_close(head.keys, want[0, 0].detach(), rtol=1e-4, atol=1e-5)
    assert sum(head.num_entries for head in pages) == 2 * (305 - 40)


@pytest.mark.parametrize("offload", [False, True])
def test_an_append_past_the_window_continues_at_compact_positions(tmp_path, histories, short_lm, encoder, offload):
    """Ingested inside the window (original positions), then appended past it: the caches go on compacted, the
    stored pages are placed beside them, and every turn's span is in every episode's file."""
    store = Store(tmp_path)
    config = _config(offload=OFFLOAD) if offload else _config()
    first = ingest(histories["start"], name="c", config=config, store=store, lm=short_lm, encoder=encoder)
    assert first.positions == "original"
    report = append(histories["rest"], name="c", store=store, lm=short_lm, encoder=encoder)
    assert report.positions == "compact" and store.get("c").settings["positions"] == "compact"
    assert any("exceeds the model's window" in note for note in report.notes)
    turns = len(load_history(histories["whole"]))
    for episode in store.get("c").episodes:
        cache, meta = codec.decode(*store.load_episode(episode, short_lm.fingerprint), origins=True)
        _assert_inside_the_window(cache, short_lm.context_window)
        spans = turn_spans.from_metadata(store.load_episode(episode, short_lm.fingerprint)[1])
        assert [s.index for s in spans] == list(range(turns)) and spans[-1].end > 3 * short_lm.context_window
        if offload:
            assert meta.next_origin == spans[-1].end  # the cache was fed every appended token
    if offload:
        _assert_pages_beside_the_residents(store, "c", short_lm)


@pytest.mark.parametrize("method", ["routed", "recall"])
def test_a_routed_append_feeds_each_new_turn_to_the_episode_it_joins(tmp_path, histories, short_lm, encoder, method):
    store = Store(tmp_path)
    config = _config(method=method, offload=OFFLOAD)
    ingest(histories["start"], name="r", config=config, store=store, lm=short_lm, encoder=encoder)
    before = [turn_spans.from_metadata(store.load_episode(e, short_lm.fingerprint)[1]) for e in store.get("r").episodes]
    append(histories["rest"], name="r", store=store, lm=short_lm, encoder=encoder)
    held: list[int] = []
    for episode, stored in zip(store.get("r").episodes, before, strict=True):
        cache, meta = codec.decode(*store.load_episode(episode, short_lm.fingerprint), origins=True)
        _assert_inside_the_window(cache, short_lm.context_window)
        spans = turn_spans.from_metadata(store.load_episode(episode, short_lm.fingerprint)[1])
        assert spans[: len(stored)] == stored  # its own turns first, then the new turns that joined it
        assert all(a.end == b.start for a, b in zip(spans, spans[1:], strict=False))  # laid out one after another
        assert meta.next_origin == spans[-1].end  # the cache was fed every turn its spans say it holds
        held += [s.index for s in spans]
    assert sorted(held) == list(range(len(load_history(histories["whole"]))))  # each turn in one episode, once
    _assert_pages_beside_the_residents(store, "r", short_lm)


@pytest.mark.parametrize(("precision", "tolerance"), [("int8", 0.05), ("int4", 0.5)])
def test_quantized_caches_beyond_the_window(tmp_path, histories, short_lm, encoder, precision, tolerance):
    """A compacted cache held in 8 or 4 bits answers as the same cache in full precision does, nearly."""
    store = Store(tmp_path)
    groups = {"quant_group": 8, "quant_group_4bit": 8}
    report = ingest(histories["whole"], name="q", config=_config(precision=precision, **groups), store=store,
                    lm=short_lm, encoder=encoder)  # fmt: skip
    ingest(histories["whole"], name="full", config=_config(**groups), store=store, lm=short_lm, encoder=encoder)
    assert report.positions == "compact" and report.cache_precision == precision
    cache, _ = codec.decode(*store.load_episode(store.get("q").episodes[0], short_lm.fingerprint))
    assert all(isinstance(layer, QuantizedLayer) for layer in cache.layers)
    _assert_inside_the_window(cache, short_lm.context_window)
    question = "Which gate does the flight leave from?"
    logits, _, answer = _first_answer(store, "q", short_lm, encoder, question)
    want, _, _ = _first_answer(store, "full", short_lm, encoder, question)
    assert answer.answer_tokens > 0 and (logits - want).abs().max() < tolerance


def test_indexmem_and_its_memory_beyond_the_window(tmp_path, histories, short_lm, encoder):
    from kvchat.training import default_out, train

    small = TrainConfig(steps=2, chunk_tokens=96, train_chunks=2, held_out_chunks=1, checkpoint_every=2, warmup=1,
                        memory_queries=16, memory_budgets=(40,), memory_block=24, memory_min_gain=float("-inf"))
    train(short_lm, default_out(tmp_path, short_lm), small, files=[histories["start"]], indexmem=IndexMemConfig())
    store = Store(tmp_path)
    report = ingest(histories["whole"], name="m", config=_config(method="indexmem"), store=store, lm=short_lm,
                    encoder=encoder)  # fmt: skip
    assert report.positions == "compact" and store.get("m").settings["latent_memory"] is True
    cache, _ = codec.decode(*store.load_episode(store.get("m").episodes[0], short_lm.fingerprint))
    _assert_inside_the_window(cache, short_lm.context_window)
    memory = cache.memory
    assert memory is not None and any(m.abs().sum() > 0 for m in memory.m)  # evicted entries were written
    # the mass readout's distances are measured in the compacted frame its keys were written in
    assert memory.weights.readout == "mass" and 0 < float(memory.ref.max()) < short_lm.context_window
    logits, _, answer = _first_answer(store, "m", short_lm, encoder, "Which gate does the flight leave from?")
    assert torch.isfinite(logits).all() and answer.answer_tokens > 0


def test_full_kv_beyond_the_window_is_refused_unless_it_offloads(histories, short_lm, encoder, tmp_path):
    """Full KV evicts nothing, so nothing would be re-rotated: its keys would sit past the window."""
    from kvchat.errors import UserError
    from kvchat.ingest.plan import plan_ingest

    store = Store(tmp_path)
    with raises_said(UserError, "--method full keeps every entry at its own position"):
        plan_ingest(histories["whole"], name="f", config=_config(method="full"), store=store, lm=short_lm,
                    encoder=encoder)  # fmt: skip
    paged = plan_ingest(histories["whole"], name="f", config=_config(method="full", offload=OFFLOAD), store=store,
                        lm=short_lm, encoder=encoder)  # fmt: skip
    assert paged.config.cache.positions == "compact"


@pytest.mark.parametrize("offload", [False, True])
def test_a_compacted_conversation_names_the_turns_its_answer_drew_on(tmp_path, histories, short_lm, encoder, offload):
    """Receipts beyond the window: each compacted entry counts for the turn of its original position (`orig`), so
    the turns are the history's own, the cache holds turns from all over it and the shares cover the answer's
    attention to them (with --offload, the retrieved entries' too)."""
    store = Store(tmp_path)
    config = _config(method="epicache", offload=OFFLOAD) if offload else _config(method="epicache")
    assert ingest(histories["whole"], name="c", config=config, store=store, lm=short_lm, encoder=encoder).positions == (
        "compact")
    turns = load_history(histories["whole"])
    session = Session(store, store.get("c"), short_lm, encoder,
                      AskConfig(max_new_tokens=4, source_count=len(turns), retrieve=EVERYTHING))  # fmt: skip
    question = "Which gate does the flight leave from?"
    answer = session.ask(question, episode=0, sources=True, log=False)
    assert answer.sources_note is None and answer.sources
    rounding = 5e-5 * len(answer.sources)  # each share is rounded to 4 decimals
    assert sum(s.attention_share for s in answer.sources) == pytest.approx(1, abs=rounding)
    for s in answer.sources:
        assert s.speaker == turns[s.turn].role and s.quote == quote_span(turns[s.turn].text, answer.text, question,
                                                                     AskConfig.quote_chars)
        assert 0 <= s.kept_tokens <= s.tokens and not s.recalled
    held = sorted(s.turn for s in answer.sources if s.kept_tokens)
    assert held and held[-1] > len(turns) // 2  # not only the first turns, as compacted positions would map
    if offload:  # every page read back: entries past the resident ones get attention too
        assert len([s for s in answer.sources if s.attention_share > 0]) > len(held)


def test_a_compacted_cache_stored_without_its_origins_says_why_it_has_no_sources(tmp_path, histories, short_lm,
                                                                                 encoder):  # fmt: skip
    """Files compacted before kvchat kept every entry's original position: no sources, the command that rebuilds them;
    an append to them does not make up origins from the compacted positions."""
    from kvchat.ingest.pipeline import build_episodes, commit_ingest, write_episode
    from kvchat.ingest.plan import plan_ingest

    store = Store(tmp_path)
    config = _config(method="epicache")
    plan = plan_ingest(histories["whole"], name="old", config=config, store=store, lm=short_lm, encoder=encoder)
    with store.begin("old") as pending:
        built = list(build_episodes(plan, short_lm, scratch=pending.scratch_dir))
        for b in built:
            assert b.cache.origins is not None  # kept now; dropped to write what older kvchat wrote
            b.cache.origins = None
        records = [write_episode(pending, plan, b, short_lm) for b in built]
        commit_ingest(pending, plan, [b.stats() for b in built], records, short_lm, 0.0)
    answer = Session(store, store.get("old"), short_lm, encoder, AskConfig(max_new_tokens=2)).ask(
        "Which gate does the flight leave from?", sources=True, log=False)
    assert answer.sources is None and "re-rotated to compact positions before kvchat kept" in answer.sources_note
    assert "kvchat ingest" in spell(answer.sources_note) and "--replace" in spell(answer.sources_note)
    append(histories["start"], name="old", store=store, lm=short_lm, encoder=encoder)
    for episode in store.get("old").episodes:
        assert codec.decode(*store.load_episode(episode, short_lm.fingerprint))[1].next_origin is None
