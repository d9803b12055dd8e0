"""`--recall-entries stored`: recall's chunks as KV entries computed at ingest, kept in one file per conversation and
placed on the routed cache at each question (kvchat.recall_entries)."""

from __future__ import annotations

import hashlib

import pytest
import torch

from kvchat import recall_entries
from kvchat.kv.cache import EpisodeCache
from kvchat.kv.rope import rotate_keys
from kvchat.kv.tensorfile import open_tensors
from kvchat.rag import Chunk

TEXTS = ["alice likes green tea", "bob went to the market on monday and bought apples",
         "carol plays the piano", "dave fixed the old bicycle in the garage yesterday evening"]  # fmt: skip
CHUNKS = [Chunk(i, i + 1, text, 0) for i, text in enumerate(TEXTS)]


def written(tmp_path, lm, chunks=CHUNKS, bits=8, name="entries.safetensors", previous=None, prefix=None):
    prefix = lm.encode("you are a helpful assistant") if prefix is None else prefix
    path = tmp_path / name
    size, sha = recall_entries.write(path, lm, chunks, prefix, bits=bits, group=4, previous=previous)
    assert size == path.stat().st_size and sha == hashlib.sha256(path.read_bytes()).hexdigest()
    return recall_entries.StoredEntries.opened(*open_tensors(path)), prefix, sha


def test_each_chunks_entries_come_back_as_computed_after_the_chunk_before_it(tiny_lm, tmp_path):
    stored, prefix, _ = written(tmp_path, tiny_lm)
    ids = recall_entries.chunk_ids(tiny_lm, CHUNKS)
    assert stored.tokens == [t.shape[-1] for t in ids] and stored.chunks == len(CHUNKS)
    for chunk, i in ((0, 0), (3, 3)):
        cache = EpisodeCache(tiny_lm.num_layers)
        with torch.inference_mode():
            tiny_lm.forward(cache, prefix)
            if i:
                tiny_lm.forward(cache, ids[i - 1])
            assert stored.starts[chunk] == cache.next_position
            tiny_lm.forward(cache, ids[i])
        n = stored.tokens[chunk]
        for layer in range(tiny_lm.num_layers):
            keys, values = stored.entries(chunk, layer, torch.float32, torch.device("cpu"))
            want_k, want_v = cache.layers[layer].keys[:, :, -n:], cache.layers[layer].values[:, :, -n:]
            assert keys.shape == want_k.shape
            # 8-bit codes: every number within half a step of what it was (groups of 4 tokens per channel)
            assert torch.allclose(keys, want_k, atol=(want_k.abs().max() / 100).item())
            assert torch.allclose(values, want_v, atol=(want_v.abs().max() / 100).item())


def test_a_placed_chunk_answers_as_its_prefill_after_the_chunk_before_it(tiny_lm, tmp_path):
    stored, prefix, _ = written(tmp_path, tiny_lm)
    ids = recall_entries.chunk_ids(tiny_lm, CHUNKS)
    question = tiny_lm.encode("\nwhat does carol play ?")
    logits = []
    for place in (False, True):
        cache = EpisodeCache(tiny_lm.num_layers)
        with torch.inference_mode():
            tiny_lm.forward(cache, prefix)
            tiny_lm.forward(cache, ids[0])
            tiny_lm.forward(cache, ids[1])  # more before it than at ingest: its positions move
            before = cache.next_position
            if place:
                assert stored.place(cache, 2, tiny_lm) == ids[2].shape[-1]
            else:
                tiny_lm.forward(cache, ids[2])
            assert cache.next_position == before + ids[2].shape[-1]
            logits.append(tiny_lm.forward(cache, question)[0, -1])
    assert torch.nn.functional.cosine_similarity(logits[0], logits[1], dim=0) > 0.999


def test_placed_keys_are_the_stored_keys_rotated_to_their_new_positions(tiny_lm, tmp_path):
    stored, prefix, _ = written(tmp_path, tiny_lm)
    cache = EpisodeCache(tiny_lm.num_layers)
    with torch.inference_mode():
        tiny_lm.forward(cache, prefix)
        stored.place(cache, 1, tiny_lm)
    n, moved = stored.tokens[1], cache.next_position - stored.tokens[1] - stored.starts[1]
    assert moved != 0
    keys, values = stored.entries(1, 0, torch.float32, torch.device("cpu"))
    rotary = tiny_lm.answering.model.rotary_emb
    assert torch.allclose(cache.layers[0].keys[:, :, -n:], rotate_keys(keys, torch.full((keys.shape[1], n), moved),
                                                                       rotary), atol=1e-5)  # fmt: skip
    assert torch.equal(cache.layers[0].values[:, :, -n:], values)


def test_an_append_copies_the_stored_chunks_rows_and_computes_only_the_new_ones(tiny_lm, tmp_path, monkeypatch):
    _, _, whole = written(tmp_path, tiny_lm, bits=4, name="whole.safetensors")
    first, prefix, _ = written(tmp_path, tiny_lm, chunks=CHUNKS[:2], bits=4, name="first.safetensors")
    computed_from = []
    compute = recall_entries.computed

    def counting(lm, ids, prefix, first=0):
        computed_from.append(first)
        return compute(lm, ids, prefix, first)

    monkeypatch.setattr(recall_entries, "computed", counting)
    _, _, extended = written(tmp_path, tiny_lm, bits=4, name="extended.safetensors", previous=first)
    assert computed_from == [2] and extended == whole  # the same bytes as computing all of them
    other = tiny_lm.encode("you are a terse assistant")  # another system prompt: nothing of it is reused
    written(tmp_path, tiny_lm, bits=4, name="other.safetensors", previous=first, prefix=other)
    assert computed_from == [2, 0]


def test_a_file_of_another_format_is_refused(tiny_lm, tmp_path):
    written(tmp_path, tiny_lm)
    tensors, metadata = open_tensors(tmp_path / "entries.safetensors")
    with pytest.raises(ValueError, match="format"):
        recall_entries.StoredEntries.opened(tensors, metadata | {"recall_entries_format": "0"})
