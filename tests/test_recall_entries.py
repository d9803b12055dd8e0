"""`--recall-entries stored`: recall's chunks as KV entries computed at ingest, kept in one file per conversation and
placed on the routed cache at each question (kvchat.answer.recall_entries)."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest
import torch
from conftest import raises_said

from kvchat.answer import recall, recall_entries
from kvchat.answer.rag import Chunk
from kvchat.answer.recall_entries import StoredEntries
from kvchat.answer.session import Session
from kvchat.cli.words import spell
from kvchat.config import AskConfig, CacheConfig, EpisodeConfig, IngestConfig, RecallConfig
from kvchat.errors import CacheIntegrityError, UserError
from kvchat.eval.qa import planted_sets
from kvchat.ingest.pipeline import ingest, plan_ingest
from kvchat.kv.cache import EpisodeCache
from kvchat.kv.rope import rotate_keys
from kvchat.kv.tensorfile import RowWriter, open_tensors
from kvchat.settings import rebuild_command
from kvchat.store import Store

TEXTS = ["alice likes green tea", "bob went to the market on monday and bought apples",
         "carol plays the piano", "dave fixed the old bicycle in the garage yesterday evening"]  # fmt: skip
CHUNKS = [Chunk(i, i + 1, text, 0) for i, text in enumerate(TEXTS)]


def written(tmp_path, lm, chunks=CHUNKS, bits=8, name="entries.safetensors", previous=None, prefix=None, repair=0,
            kept=1.0):
    prefix = lm.encode("you are a helpful assistant") if prefix is None else prefix
    path = tmp_path / name
    storing = recall_entries.Storing(bits, 4, repair, kept, queries=4, pool_kernel=1)
    size, sha = recall_entries.write(path, lm, chunks, prefix, storing, previous=previous)
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
    rotary = tiny_lm.model.model.rotary_emb
    assert torch.allclose(cache.layers[0].keys[:, :, -n:], rotate_keys(keys, torch.full((keys.shape[1], n), moved),
                                                                       rotary), atol=1e-5)  # fmt: skip
    assert torch.equal(cache.layers[0].values[:, :, -n:], values)


def test_an_append_copies_the_stored_chunks_rows_and_computes_only_the_new_ones(tiny_lm, tmp_path, monkeypatch):
    _, _, whole = written(tmp_path, tiny_lm, bits=4, name="whole.safetensors")
    first, prefix, _ = written(tmp_path, tiny_lm, chunks=CHUNKS[:2], bits=4, name="first.safetensors")
    computed_from = []
    compute = recall_entries.computed

    def counting(lm, ids, prefix, storing, first=0):
        computed_from.append(first)
        return compute(lm, ids, prefix, storing, first)

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


def _prefilled(lm, prefix, ids, upto):
    """A cache of `prefix` and chunks 0..upto-1 prefilled (more before the next chunk than at ingest)."""
    cache = EpisodeCache(lm.num_layers)
    with torch.inference_mode():
        lm.forward(cache, prefix)
        for i in range(upto):
            lm.forward(cache, ids[i])
    return cache


def test_a_repaired_chunk_recomputes_its_first_tokens_with_what_precedes_it_in_view(tiny_lm, tmp_path):
    stored, prefix, _ = written(tmp_path, tiny_lm, repair=3)
    ids = recall_entries.chunk_ids(tiny_lm, CHUNKS)
    n = ids[3].shape[-1]
    assert stored.tokens[3] == n - 3 and stored.lengths[3] == n  # the first 3 are not stored
    placed, prefill = _prefilled(tiny_lm, prefix, ids, 2), _prefilled(tiny_lm, prefix, ids, 2)
    before = placed.next_position
    assert stored.place(placed, 3, tiny_lm, ids[3]) == n
    with torch.inference_mode():
        tiny_lm.forward(prefill, ids[3])
    assert placed.next_position == prefill.next_position == before + n
    for layer in range(tiny_lm.num_layers):
        got, want = placed.layers[layer], prefill.layers[layer]
        assert torch.equal(got.positions, want.positions)
        # the first 3: computed as the prefill computes them, after chunks 0 and 1 (not after chunk 2 as stored)
        assert torch.allclose(got.keys[:, :, -n : -n + 3], want.keys[:, :, -n : -n + 3], atol=1e-5)
        assert torch.allclose(got.values[:, :, -n : -n + 3], want.values[:, :, -n : -n + 3], atol=1e-5)
        keys, values = stored.entries(3, layer, torch.float32, torch.device("cpu"))  # the rest: the stored ones
        assert torch.equal(got.values[:, :, -n + 3 :], values)
    with pytest.raises(ValueError, match="another text"):
        stored.place(_prefilled(tiny_lm, prefix, ids, 0), 3, tiny_lm, ids[2])


def test_repairing_every_token_is_the_prefill(tiny_lm, tmp_path):
    stored, prefix, _ = written(tmp_path, tiny_lm, repair=1000)
    ids = recall_entries.chunk_ids(tiny_lm, CHUNKS)
    assert stored.tokens == [0] * len(CHUNKS)  # nothing stored
    placed, prefill = _prefilled(tiny_lm, prefix, ids, 1), _prefilled(tiny_lm, prefix, ids, 1)
    stored.place(placed, 2, tiny_lm, ids[2])
    with torch.inference_mode():
        tiny_lm.forward(prefill, ids[2])
    for got, want in zip(placed.layers, prefill.layers, strict=True):
        assert torch.allclose(got.keys, want.keys, atol=1e-5) and torch.allclose(got.values, want.values, atol=1e-5)


def test_a_compressed_chunk_stores_each_heads_best_scored_entries_and_places_them_at_their_tokens(tiny_lm, tmp_path):
    from kvchat.kv.scoring import probe_scores

    stored, prefix, _ = written(tmp_path, tiny_lm, repair=2, kept=0.5)
    ids = recall_entries.chunk_ids(tiny_lm, CHUNKS)
    n = ids[3].shape[-1]
    m = -(-n // 2) - 2  # half the chunk's entries, its 2 recomputed ones counted
    assert stored.tokens[3] == m and stored.placed(3) == m + 2 and stored.lengths[3] == n
    # the kept entries: each head's top-scored tokens after the first 2, by the attention of the chunk's last 4
    cache = _prefilled(tiny_lm, prefix, ids, 0)
    with torch.inference_mode():
        tiny_lm.forward(cache, torch.cat([ids[2], ids[3]], dim=-1))
        scores = probe_scores(tiny_lm.model, cache, ids[3][:, -4:])
    heads = tiny_lm.config.num_key_value_heads
    for layer in range(tiny_lm.num_layers):
        best = scores[layer][:, -n:][:, 2:].topk(m, dim=-1).indices.sort(dim=-1).values + 2
        assert torch.equal(stored.token_offsets(3, layer, heads), best)
    placed = _prefilled(tiny_lm, prefix, ids, 1)
    base = placed.next_position
    assert stored.place(placed, 3, tiny_lm, ids[3]) == m + 2 and placed.next_position == base + n
    for layer in range(tiny_lm.num_layers):
        positions = placed.layers[layer].positions[:, -(m + 2) :]
        assert torch.equal(positions[:, :2], torch.arange(base, base + 2).expand(heads, 2))  # recomputed
        assert torch.equal(positions[:, 2:], base + stored.token_offsets(3, layer, heads))  # each at its token
    with torch.inference_mode():  # the question after it sees every placed entry
        assert torch.isfinite(tiny_lm.forward(placed, tiny_lm.encode("\nwhat does dave fix ?"))).all()


def test_a_file_of_the_first_format_still_places_its_chunks(tiny_lm, tmp_path):
    from safetensors.torch import save_file

    stored, prefix, _ = written(tmp_path, tiny_lm)
    tensors, metadata = open_tensors(tmp_path / "entries.safetensors")
    old = {k: v.read() for k, v in tensors.items() if k != "lengths" and not k.startswith("o.")}
    save_file(old, tmp_path / "old.safetensors", {k: v for k, v in metadata.items() if k not in ("repair", "kept")}
              | {"recall_entries_format": "1"})  # fmt: skip
    first = StoredEntries.opened(*open_tensors(tmp_path / "old.safetensors"))
    assert (first.lengths, first.repair, first.offsets) == (stored.tokens, 0, False)
    ids = recall_entries.chunk_ids(tiny_lm, CHUNKS)
    caches = [_prefilled(tiny_lm, prefix, ids, 1) for _ in range(2)]
    stored.place(caches[0], 2, tiny_lm)
    first.place(caches[1], 2, tiny_lm)
    assert all(torch.equal(a.keys, b.keys) and torch.equal(a.positions, b.positions)
               for a, b in zip(caches[0].layers, caches[1].layers, strict=True))  # fmt: skip


def test_the_recall_split_places_more_compressed_chunks_in_the_same_budget():
    from kvchat.features.recall import split, stored_entries

    full = CacheConfig(method="recall", budget=1024, recall=RecallConfig(entries="stored"))
    quarter = dataclasses.replace(full, recall=dataclasses.replace(full.recall, kept=0.25, repair=8))
    assert (split(full).chunks, split(full).recalled, split(full).cache_budget) == (2, 512, 512)
    assert (split(quarter).chunks, split(quarter).chunk_entries, split(quarter).cache_budget) == (8, 64, 512)
    assert stored_entries(10, quarter.recall) == 8  # the recomputed tokens, at least
    prefilled = dataclasses.replace(quarter, recall=dataclasses.replace(quarter.recall, entries="prefilled"))
    assert split(prefilled).chunks == 2  # kept and repair are the stored entries': prefilled chunks are whole


# --- the store, ingest, questions and appends (the planted conversation of test_recall.py, 3x short_lm's window)

QA = planted_sets(1, topics=6, turns_per_topic=40)[0]
SYSTEM = "You are a helpful assistant . Conversation :\n"


def config(entries: str, method: str = "auto") -> IngestConfig:
    return IngestConfig(
        cache=CacheConfig(method=method, budget=96, block_size=48, prefill="block",
                          recall=RecallConfig(chunk_tokens=16, entries=entries)),
        episodes=EpisodeConfig(episodes=3, patched_prompt_tokens=48), system_prompt=SYSTEM,
    )  # fmt: skip


@pytest.fixture(scope="module")
def both(short_lm, encoder, tmp_path_factory):
    """The conversation ingested with its chunks prefilled ("prefilled") and stored ("stored")."""
    store = Store(tmp_path_factory.mktemp("recall-entries"))
    reports = {entries: ingest(QA.turns, name=entries, config=config(entries), store=store, lm=short_lm,
                               encoder=encoder) for entries in ("prefilled", "stored")}  # fmt: skip
    return store, reports


def test_ingest_stores_every_chunks_entries_in_the_conversations_recall_entries_file(both, short_lm):
    store, reports = both
    stored, prefilled = store.get("stored"), store.get("prefilled")
    assert prefilled.recall_entries is None and reports["prefilled"].recall_entries_bytes == 0
    record = stored.recall_entries
    assert record is not None and reports["stored"].recall_entries_bytes == record.bytes == record.path.stat().st_size
    assert record.path.parent == stored.episodes[0].path.parent  # in the conversation's ingest dir
    entries = StoredEntries.opened(*store.load_recall_entries(stored, short_lm.fingerprint))
    index = recall.from_metadata(store.load_episode(stored.episodes[0], short_lm.fingerprint)[1])
    assert entries.chunks == len(index.chunks)
    assert entries.tokens == [t.shape[-1] for t in recall_entries.chunk_ids(short_lm, index.chunks)]
    assert (entries.bits, entries.group) == (RecallConfig.stored_bits, RecallConfig.stored_group)
    assert stored.settings["recall_entries"] == "stored"
    assert "--recall-entries stored" in spell(rebuild_command("stored", "default", stored.settings))
    assert "--recall-entries" not in spell(rebuild_command("prefilled", "default", prefilled.settings))


def test_a_question_places_its_chunks_entries_and_prefills_only_itself(both, short_lm, encoder):
    store, _ = both
    sessions = {name: Session(store, store.get(name), short_lm, encoder, AskConfig(max_new_tokens=3))
                for name in ("prefilled", "stored")}  # fmt: skip
    question = QA.questions[0].text
    answers = {name: s.ask(question, log=False) for name, s in sessions.items()}
    stored = sessions["stored"]
    assert answers["stored"].recalled == answers["prefilled"].recalled  # the same chunks, ranked the same way
    picked = [i for i, c in enumerate(stored._recall.chunks) if [c.first, c.end] in answers["stored"].recalled]
    question_ids = short_lm.encode(stored.layout.question(stored.config.question_template.format(question=question)))
    placed = sum(stored._stored.tokens[i] for i in picked)
    assert answers["stored"].prompt_tokens == placed + question_ids.shape[-1]
    first: list[torch.Tensor] = []
    stored.ask(question, log=False, on_first_logits=first.append)
    sizes = stored._resident[1].sizes  # rolled back: the next question starts from the episode cache alone
    bare: list[torch.Tensor] = []  # the placed entries are attended: without them the answer starts elsewhere
    stored.ask(question, log=False, on_first_logits=bare.append, retrieved_text=" ",
                episode=answers["stored"].episode)
    assert stored._resident[1].sizes == sizes and not torch.allclose(first[0], bare[0])


def test_receipts_name_the_placed_turns_as_the_prefilled_ones(both, short_lm, encoder):
    store, _ = both
    config = AskConfig(max_new_tokens=3, source_count=len(QA.turns))
    named = {}
    for name in ("prefilled", "stored"):
        answer = Session(store, store.get(name), short_lm, encoder, config).ask(QA.questions[1].text, log=False,
                                                                                sources=True)  # fmt: skip
        assert answer.sources_note is None
        named[name] = {s.turn for s in answer.sources if s.recalled}
    recalled = {t for first, end in answer.recalled for t in range(first, end)}
    assert named["prefilled"] and named["stored"] and named["stored"] <= recalled  # the placed chunks' own turns


def test_a_file_holding_other_chunks_is_refused_with_the_rebuild_command(both, short_lm, encoder, tmp_path):
    store, _ = both
    session = Session(store, store.get("stored"), short_lm, encoder, AskConfig(max_new_tokens=1))
    session.layout = dataclasses.replace(session.layout, before_conversation="another system prompt")
    with raises_said(CacheIntegrityError, "recall entries file .* other chunks .*--recall-entries stored"):
        session.ask(QA.questions[0].text, log=False)


def test_an_append_copies_the_stored_chunks_entries_and_adds_the_new_ones(short_lm, encoder, tmp_path):
    from kvchat.ingest.append import append

    store = Store(tmp_path)
    ingest(QA.turns[:200], name="c", config=config("stored"), store=store, lm=short_lm, encoder=encoder)
    before = StoredEntries.opened(*store.load_recall_entries(store.get("c"), short_lm.fingerprint))
    path = tmp_path / "more.json"
    path.write_text(json.dumps([{"role": t.role, "content": t.text} for t in QA.turns[200:]]))
    append(path, name="c", store=store, lm=short_lm, encoder=encoder)
    conversation = store.get("c")
    after = StoredEntries.opened(*store.load_recall_entries(conversation, short_lm.fingerprint))
    index = recall.from_metadata(store.load_episode(conversation.episodes[0], short_lm.fingerprint)[1])
    assert after.chunks == len(index.chunks) > before.chunks
    assert after.tokens[: before.chunks] == before.tokens and after.starts[: before.chunks] == before.starts
    end = before.rows[-1]
    for name in ("k.0", "v.0", "vs.1"):
        assert torch.equal(after.tensors[name][:end].read(), before.tensors[name][:end].read())
    answer = Session(store, conversation, short_lm, encoder, AskConfig(max_new_tokens=2)).ask(
        QA.questions[-1].text, log=False)
    assert answer.recalled


def test_stored_entries_need_a_method_that_recalls(short_lm, encoder, tmp_path):
    with raises_said(UserError, "--recall-entries stored needs --method recall"):
        plan_ingest(QA.turns, name="x", config=config("stored", method="snapkv"), store=Store(tmp_path),
                    lm=short_lm, encoder=encoder)  # fmt: skip
    within = plan_ingest(QA.turns[:40], name="x", config=config("stored"), store=Store(tmp_path), lm=short_lm,
                         encoder=encoder)  # fmt: skip
    assert within.config.cache.method == "epicache"
    assert any("--recall-entries stored is unused" in spell(note) for note in within.notes)


def test_the_command_line_stores_the_entries_shows_their_bytes_and_answers_from_them(short_model_dir, tmp_path):
    from cli_helpers import run_main

    history = tmp_path / "long.json"
    history.write_text(json.dumps([{"role": t.role, "content": t.text} for t in QA.turns]))
    model = ("--model", str(short_model_dir), "--budget", "96", "--setting", "block_size=48", "--episodes", "3")
    made = run_main(tmp_path, "ingest", str(history), *model, "--recall-entries", "stored", "--json")
    assert made.returncode == 0, made.stderr
    report = json.loads(made.stdout)
    assert report["method"] == "recall" and report["recall_entries_bytes"] > 0
    shown = json.loads(run_main(tmp_path, "show", "long", "--json").stdout)
    assert shown["recall_entries_bytes"] == report["recall_entries_bytes"]
    asked = run_main(tmp_path, "ask", "what did the user plant ?", "--max-new-tokens", "2", "--json")
    assert asked.returncode == 0, asked.stderr
    assert json.loads(asked.stdout)["recalled"]
    refused = run_main(tmp_path, "ingest", str(history), *model, "--method", "snapkv", "--recall-entries", "stored",
                       "--name", "other")  # fmt: skip
    assert refused.returncode == 2 and "needs --method recall" in refused.stderr and "Traceback" not in refused.stderr


def test_rows_computed_in_pieces_as_units_and_ray_workers_do_make_the_file_write_makes(tiny_lm, tmp_path):
    """Repaired and compressed (format 2), each chunk's rows from `chunk_rows` started at any chunk, written out of
    order into the file `Layout` describes (kvchat.ingest.units, kvchat.ingest.batch_units), are `write`'s bytes."""
    _, prefix, whole = written(tmp_path, tiny_lm, repair=2, kept=0.5)
    storing = recall_entries.Storing(8, 4, 2, 0.5, queries=4, pool_kernel=1)
    ids = recall_entries.chunk_ids(tiny_lm, CHUNKS)
    layout = recall_entries.Layout.of(tiny_lm, CHUNKS, prefix, storing, ids=ids)
    assert layout.metadata["recall_entries_format"] == "2" and layout.lengths == [t.shape[-1] for t in ids]
    path = tmp_path / "pieces.safetensors"
    writer = RowWriter(path, layout.shapes, layout.metadata)
    starts = {}
    for first, end in ((2, 4), (0, 1), (1, 2)):
        for rows in recall_entries.chunk_rows(tiny_lm, layout, ids, prefix, first, end):
            rows.write(writer)
            starts[rows.chunk] = rows.start
    layout.index(writer, [starts[c] for c in range(layout.chunks)])
    _, sha = writer.finish()
    assert sha == whole
    stored = StoredEntries.opened(*open_tensors(path))
    assert (stored.repair, stored.kept, stored.offsets) == (2, 0.5, True)
