"""Head-wise budgets (AdaKV): selection across heads, the ragged layout, its attention, memory and files."""

from __future__ import annotations

import json
import struct
from dataclasses import replace

import pytest
import safetensors.torch
import torch
from cli_helpers import run_main
from conftest import ARCHITECTURES, centroid, tiny_model
from conftest import random_ids as _ids
from conftest import with_kvchat_attention as _with_kvchat_attention
from hypothesis import given, settings
from hypothesis import strategies as st

from kvchat.answer.session import Session
from kvchat.config import CacheConfig, EpisodeConfig, IngestConfig
from kvchat.history.synthetic import planted_conversation
from kvchat.ingest.pipeline import ingest
from kvchat.kv import codec
from kvchat.kv.attention import AttentionRecorder, HeadList, kvchat_attention
from kvchat.kv.cache import EpisodeCache, RaggedLayer
from kvchat.kv.forward import forward
from kvchat.kv.heads import HeadBudgets, head_floor, select_adaptive
from kvchat.kv.prefill import block_prefill
from kvchat.kv.scoring import PatchedPromptScorer, select_top
from kvchat.store import Store

HEADS, HEAD_DIM, LAYERS = 2, 16, 2  # the tiny model's KV heads, head size, layers (conftest.tiny_model)
ADAPTIVE = HeadBudgets("adaptive")


def _adaptive_cache(model, *, budget=40, history=300, heads=ADAPTIVE, compact=False) -> EpisodeCache:
    return block_prefill(
        model, _ids(4, 1), _ids(history, 2), block_size=32, budgets=[budget] * LAYERS,
        scorer=PatchedPromptScorer(_ids(6, 7)), heads=heads, compact=compact,
    ).cache  # fmt: skip


# --------------------------------------------------------------------------- selection


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_adaptive_selection_keeps_the_layers_top_pairs_above_a_per_head_floor(data):
    heads = data.draw(st.integers(1, 4))
    protected = data.draw(st.integers(0, 4))
    budget = data.draw(st.integers(max(protected, 1), 12))
    floor = data.draw(st.integers(protected, budget))
    lengths = data.draw(st.lists(st.integers(protected, 30), min_size=heads, max_size=heads))
    n_max = max(lengths) + data.draw(st.integers(0, 3))  # padding after the longest head too
    values = data.draw(st.lists(st.integers(0, 5), min_size=heads * n_max, max_size=heads * n_max))  # many ties
    scores = torch.tensor(values, dtype=torch.float32).reshape(heads, n_max)

    index = select_adaptive(scores, lengths, budget, protected, floor)
    if sum(lengths) <= budget * heads:
        assert index is None
        return
    kept = [set(i.tolist()) for i in index]
    assert [i.tolist() for i in index] == [sorted(k) for k in kept]  # position order within each head
    assert sum(map(len, kept)) == budget * heads  # exactly the layer's budget
    for h, n in enumerate(lengths):
        assert kept[h] <= set(range(n))  # never padding
        assert set(range(protected)) <= kept[h]  # the system prompt, in every head
        assert len(kept[h]) >= min(floor, n)  # the floor

    def key(h, i):  # the order selection ranks by: protected first, then score, ties to lower head, earlier entry
        return (i >= protected, -values[h * n_max + i], h, i)

    # Each head keeps a prefix of its own ranking, and beyond each head's floor the kept pairs outrank
    # every dropped pair of the layer.
    dropped = [(h, i) for h, n in enumerate(lengths) for i in range(n) if i not in kept[h]]
    for h, n in enumerate(lengths):
        ranking = sorted(range(n), key=lambda i: key(h, i))
        assert set(ranking[: len(kept[h])]) == kept[h]
        above_floor = ranking[min(floor, n) : len(kept[h])]
        assert all(key(h, i) < key(d, j) for i in above_floor for d, j in dropped)


def test_adaptive_with_a_full_floor_is_uniform_selection():
    torch.manual_seed(0)
    scores = torch.rand(3, 50)
    uniform = select_top(scores, budget=20, protected=3)
    adaptive = select_adaptive(scores, [50, 50, 50], budget=20, protected=3, floor=20)
    assert [i.tolist() for i in adaptive] == uniform.tolist()


def test_adaptive_shifts_entries_to_the_head_with_more_high_scores():
    scores = torch.zeros(2, 10)
    scores[0, :] = 1.0  # head 0: every entry scores high
    index = select_adaptive(scores, [10, 10], budget=5, protected=1, floor=2)
    assert [len(i) for i in index] == [8, 2]  # head 1 keeps only its floor


def test_head_floor_is_a_fraction_of_the_budget_but_never_below_the_protected_prefix():
    assert head_floor(100, 5, 0.2) == 20
    assert head_floor(100, 30, 0.2) == 30
    assert head_floor(10, 0, 1.0) == 10


# --------------------------------------------------------------------------- ragged attention


def _reference_attention(query, keys, values, scale):
    """Per query head j, softmax attention over KV head j // group's own entries (new tokens causal)."""
    q_heads, q_len = query.shape[1], query.shape[2]
    group = q_heads // len(keys)
    out = torch.zeros(1, q_len, q_heads, query.shape[-1])
    weights = []
    for j in range(q_heads):
        k, v = keys[j // group][0, 0], values[j // group][0, 0]
        past = k.shape[0] - q_len
        rows = []
        for t in range(q_len):
            logits = (k[: past + t + 1] @ query[0, j, t]) * scale
            w = logits.softmax(-1)
            out[0, t, j] = w @ v[: past + t + 1]
            rows.append(w[:past])
        weights.append(torch.stack(rows))  # [q, past]
    return out, weights


@pytest.mark.parametrize("q_len", [1, 3])
def test_ragged_attention_equals_per_head_attention_over_each_heads_own_entries(q_len):
    g = torch.Generator().manual_seed(0)
    lengths = [5 + q_len, 17 + q_len, 9 + q_len]  # three KV heads, each with its own cached entries + the new ones
    keys = HeadList(torch.randn(1, 1, n, 8, generator=g) for n in lengths)
    values = HeadList(torch.randn(1, 1, n, 8, generator=g) for n in lengths)
    query = torch.randn(1, 6, q_len, 8, generator=g)  # GQA: 2 query heads per KV head
    module = torch.nn.Module()
    module.layer_idx = 0
    recorder = AttentionRecorder()
    got, _ = kvchat_attention(module, query, keys, values, None, scaling=0.3, kvchat_recorder=recorder)
    want, weights = _reference_attention(query, keys, values, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    scores = recorder.scores[0]  # [kv_heads, longest past]: max over the group and the queries
    assert scores.shape == (3, 17)
    for h, n in enumerate(lengths):
        want_h = torch.stack([weights[2 * h], weights[2 * h + 1]]).amax(dim=(0, 1))
        torch.testing.assert_close(scores[h, : n - q_len], want_h, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_ragged_layout_with_equal_heads_gives_the_uniform_paths_logits(arch):
    """Adaptive selection with a floor of the whole budget keeps each head's own top M_l, as uniform
    does, but through the ragged layout from the first eviction on: scoring, eviction and decode of
    ragged layers must reproduce the uniform path."""
    model = _with_kvchat_attention(tiny_model(arch))
    uniform = _adaptive_cache(model, heads=HeadBudgets("uniform"))
    ragged = _adaptive_cache(model, heads=HeadBudgets("adaptive", floor_fraction=1.0))
    assert all(isinstance(layer, RaggedLayer) for layer in ragged.layers)
    assert [layer.lengths for layer in ragged.layers] == [layer.lengths for layer in uniform.layers]
    question = _ids(7, 3)
    want = forward(model, uniform, question, last_logits_only=False)
    got = forward(model, ragged, question, last_logits_only=False)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for token in (5, 9, 11):  # decode steps (one query token) too
        torch.testing.assert_close(
            forward(model, ragged, torch.tensor([[token]])), forward(model, uniform, torch.tensor([[token]])),
            rtol=1e-5, atol=1e-5,
        )  # fmt: skip


# --------------------------------------------------------------------------- memory and files


def test_resident_bytes_and_file_hold_only_the_kept_entries(model):
    cache = _adaptive_cache(model)
    lengths = [layer.lengths for layer in cache.layers]
    assert any(len(set(ls)) > 1 for ls in lengths), lengths  # heads really are uneven
    assert [sum(ls) for ls in lengths] == [40 * HEADS] * LAYERS  # each layer: M_l x kv_heads entries
    assert cache.sizes == [40] * LAYERS and cache.entries == 40 * HEADS * LAYERS
    entry = 2 * HEAD_DIM * 4  # a key and a value, float32
    assert cache.nbytes() == cache.entries * entry  # no padding anywhere
    for layer in cache.layers:
        assert [k.shape[2] for k in layer.keys] == [v.shape[2] for v in layer.values] == layer.lengths
        assert [p.shape[0] for p in layer.positions] == layer.lengths

    tensors = codec.encode_layers(cache)
    data = safetensors.torch.save(tensors)
    header_len = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + header_len])
    for i in range(LAYERS):
        assert header[f"k.{i}"]["shape"] == header[f"v.{i}"]["shape"] == [40 * HEADS, HEAD_DIM]
        assert header[f"pos.{i}"]["shape"] == [40 * HEADS] and tensors[f"len.{i}"].tolist() == lengths[i]
    # Data section: kept entries x (key + value + int32 position) and one int32 length per head.
    assert len(data) - 8 - header_len == cache.entries * (entry + 4) + LAYERS * HEADS * 4


def test_ragged_tensors_round_trip_and_bad_lengths_are_refused(model):
    cache = _adaptive_cache(model)
    tensors = codec.encode_layers(cache)
    back = codec.decode_layers(tensors, next_position=cache.next_position, protected=4)
    assert all(isinstance(layer, RaggedLayer) for layer in back.layers)
    again = codec.encode_layers(back)
    assert set(again) == set(tensors) and all(torch.equal(tensors[k], again[k]) for k in tensors)
    question = _ids(5, 3)
    torch.testing.assert_close(forward(model, back, question), forward(model, cache, question))

    tensors["len.1"] = tensors["len.1"] + torch.tensor([1, 0], dtype=torch.int32)
    with pytest.raises(ValueError, match="per-head lengths"):
        codec.decode_layers(tensors, next_position=cache.next_position, protected=4)


def test_rollback_restores_a_ragged_cache_exactly(model):
    cache = _adaptive_cache(model)
    before = {k: v.clone() for k, v in codec.encode_layers(cache).items()}
    mark = cache.checkpoint()
    first = forward(model, cache, _ids(9, 3))
    forward(model, cache, torch.tensor([[7]]))
    assert [sum(layer.lengths) for layer in cache.layers] == [80 + 2 * 10] * LAYERS
    cache.rollback(mark)
    after = codec.encode_layers(cache)
    assert all(torch.equal(before[k], after[k]) for k in before)
    torch.testing.assert_close(forward(model, cache, _ids(9, 3)), first, rtol=0, atol=0)


def test_probing_a_ragged_cache_leaves_it_unchanged_and_scores_every_heads_entries(model):
    cache = _adaptive_cache(model)
    lengths = [layer.lengths for layer in cache.layers]
    recorder = AttentionRecorder()
    with cache.probing():
        forward(model, cache, _ids(6, 5), recorder=recorder)
    assert [layer.lengths for layer in cache.layers] == lengths
    for i, ls in enumerate(lengths):
        scores = recorder.scores[i]
        assert scores.shape == (HEADS, max(ls))
        for h, n in enumerate(ls):
            assert (scores[h, :n] > 0).all() and (scores[h, n:] == 0).all()  # padding only past a head's end


def test_compact_rerotates_each_ragged_head_to_its_own_contiguous_positions(model):
    """Layer-0 keys depend only on token and position: each head's compacted keys must equal the keys
    computed afresh for the tokens it kept, at positions 0..n_h-1."""
    prefix, context = _ids(4, 1), _ids(300, 2)
    all_ids = torch.cat([prefix, context], dim=-1)[0]
    original = _adaptive_cache(model)
    compacted = codec.decode_layers(codec.encode_layers(original), next_position=original.next_position, protected=4)
    compacted.compact(model.model.rotary_emb)
    longest = max(n for layer in original.layers for n in layer.lengths)
    assert compacted.next_position == longest
    for layer in compacted.layers:
        assert [p.tolist() for p in layer.positions] == [list(range(n)) for n in layer.lengths]
    layer0 = original.layers[0]
    for h, positions in enumerate(layer0.positions):
        fresh = EpisodeCache(LAYERS)
        forward(model, fresh, all_ids[positions].unsqueeze(0))
        torch.testing.assert_close(
            compacted.layers[0].keys[h], fresh.layers[0].keys[:, h : h + 1], rtol=1e-4, atol=1e-5
        )


def test_compact_during_adaptive_prefill_keeps_positions_contiguous(model):
    cache = _adaptive_cache(model, compact=True)
    for layer in cache.layers:
        assert isinstance(layer, RaggedLayer)
        assert [p.tolist() for p in layer.positions] == [list(range(n)) for n in layer.lengths]
    assert cache.next_position == max(n for layer in cache.layers for n in layer.lengths)
    assert forward(model, cache, _ids(3, 4)).isfinite().all()


def test_adaptive_prefill_keeps_the_memory_bound(model):
    result = block_prefill(
        model, _ids(4, 1), _ids(400, 2), block_size=32, budgets=[48, 64], scorer=PatchedPromptScorer(_ids(6, 7)),
        heads=ADAPTIVE,
    )  # fmt: skip
    assert result.peak_layer_entries <= 64 + 32 + 6  # entries per head, averaged over a layer's heads
    assert [sum(layer.lengths) for layer in result.cache.layers] == [48 * HEADS, 64 * HEADS]
    assert all(min(layer.lengths) >= head_floor(b, 4, ADAPTIVE.floor_fraction)
               for layer, b in zip(result.cache.layers, [48, 64], strict=True))


def test_head_budgets_reject_unknown_modes():
    with pytest.raises(ValueError, match="unknown head budget mode"):
        HeadBudgets("greedy")
    with pytest.raises(ValueError, match="floor fraction"):
        replace(ADAPTIVE, floor_fraction=1.5)


# --------------------------------------------------------------------------- ingest, store, ask, CLI


def test_adaptive_ingest_and_ask_round_trip_through_the_store(tmp_path, history, tiny_lm, encoder):
    store = Store(tmp_path)
    # stored as built (storage model): the files' tensors are the cache's own, in the model's float32
    config = IngestConfig(cache=CacheConfig(budget=96, block_size=48, head_budgets="adaptive", storage="model"),
                          episodes=EpisodeConfig(patched_prompt_tokens=48))
    report = ingest(history, name="conv", config=config, store=store, lm=tiny_lm, encoder=encoder)
    assert report.head_budgets == "adaptive" and report.budgets == [96, 96]
    fewest, most = report.head_entries
    assert fewest >= head_floor(96, 0, ADAPTIVE.floor_fraction) and fewest < 96 < most
    record = store.get("conv")
    assert record.settings["head_budgets"] == "adaptive"
    for episode in record.episodes:
        tensors, meta = store.load_episode(episode, tiny_lm.fingerprint)
        assert meta["format_version"] == codec.FORMAT_VERSION
        for i in range(LAYERS):
            assert int(tensors[f"len.{i}"].sum()) == tensors[f"k.{i}"].shape[0] == 96 * HEADS
        assert episode.n_tokens == 96 * HEADS * LAYERS
        cache = codec.decode_layers(tensors, next_position=int(meta["next_position"]), protected=0)
        assert cache.nbytes() == episode.n_tokens * 2 * HEAD_DIM * 4
    session = Session(store, record, tiny_lm, encoder)
    first = session.ask("How many tomato plants did Tom plant this spring?", episode=1)
    session.ask("Which gate does Tom's flight to Lisbon leave from?", episode=1)
    again = session.ask("How many tomato plants did Tom plant this spring?", episode=1)
    assert first.answer_tokens > 0 and again.text == first.text and again.reused_cache


def test_uniform_files_of_format_1_still_load(tmp_path, monkeypatch):
    store = Store(tmp_path)
    tensors = {"k.0": torch.ones(2, 3, 4), "v.0": torch.ones(2, 3, 4), "pos.0": torch.zeros(2, 3, dtype=torch.int32)}
    monkeypatch.setattr(codec, "FORMAT_VERSION", "1")
    with store.begin("old") as pending:
        pending.write_episode(0, tensors, {"fingerprint": "fp"}, centroid=centroid(1.0), medoid_text="x", budgets=[3],
                              n_tokens=6)
        pending.commit(model="default", fingerprint="fp", settings={}, stats={})
    monkeypatch.undo()
    loaded, meta = store.load_episode(store.get("old").episodes[0], "fp")
    assert meta["format_version"] == "1" and torch.equal(loaded["k.0"], tensors["k.0"])
    assert codec.decode_layers(loaded, next_position=3, protected=0).layers[0].lengths == [3, 3]


def test_cli_head_budgets_option(tmp_path, tiny_model_dir):
    messages, _ = planted_conversation(seed=5, topics=3, turns_per_topic=12)
    path = tmp_path / "chat.json"
    path.write_text(json.dumps(messages))
    home = tmp_path / "home"
    common = ["ingest", str(path), "--model", str(tiny_model_dir), "--budget", "80", "--setting", "block_size=32",
              "--episodes", "2"]  # fmt: skip

    bad = run_main(home, *common, "--setting", "head_budgets=greedy")
    assert bad.returncode == 2 and "unknown --setting head_budgets 'greedy' (choose from uniform" in bad.stderr
    streaming = run_main(home, *common, "--method", "streaming", "--setting", "head_budgets=adaptive")
    assert streaming.returncode == 2 and "--setting head_budgets=adaptive needs" in streaming.stderr

    done = run_main(home, *common, "--setting", "head_budgets=adaptive", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["head_budgets"] == "adaptive" and report["head_entries"][0] < 80 < report["head_entries"][1]
    shown = run_main(home, "show", "chat", "--verbose")  # the summary goes to stderr when stdout is piped
    assert shown.returncode == 0 and "adaptive head budgets" in shown.stderr
    assert json.loads(run_main(home, "show", "chat", "--json").stdout)["settings"]["head_budgets"] == "adaptive"
