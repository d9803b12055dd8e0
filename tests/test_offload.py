"""IceCache in the pipeline: spilling during prefill, pages files in the store, answering with retrieved pages."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import raises_said
from conftest import random_ids as _ids
from torch.nn.utils.rnn import pad_sequence

from kvchat.answer.session import Session
from kvchat.cli.words import spell
from kvchat.config import AskConfig, CacheConfig, EpisodeConfig, IngestConfig, OffloadConfig, PagingConfig
from kvchat.errors import CacheIntegrityError, UserError
from kvchat.ingest.pipeline import ingest
from kvchat.kv.forward import forward
from kvchat.kv.layers import PagedLayer
from kvchat.kv.pagefile import open_pages
from kvchat.kv.prefill import block_prefill, keep_sink_and_window
from kvchat.kv.retrieval import attach_pages
from kvchat.kv.scoring import BlockScorer, CakeScorer, PatchedPromptScorer
from kvchat.kv.spill import SpillWriter
from kvchat.settings import from_settings, rebuild_command, to_settings
from kvchat.store import Store

EVERYTHING = 10**6  # R larger than any head's pages


def _spill(tmp_path: Path, model, dtype=torch.float32) -> SpillWriter:
    directory = tmp_path / "spill"
    directory.mkdir(exist_ok=True)
    cfg = model.config
    return SpillWriter(directory, num_layers=cfg.num_hidden_layers, kv_heads=cfg.num_key_value_heads,
                       head_dim=cfg.head_dim, dtype=dtype)  # fmt: skip


def _paged(tmp_path: Path, spill: SpillWriter, cache, budget: int = EVERYTHING, **pool) -> None:
    path = tmp_path / "pages.safetensors"
    spill.write_pages(path, PagingConfig(page_size=4, cluster_size=4))
    attach_pages(cache, open_pages(path), budget=budget, **pool)


def _answer_logits(model, cache, question: torch.Tensor, steps: int = 3) -> list[torch.Tensor]:
    """Logits of the question's last token and of `steps` greedy tokens after it; the cache is rolled back."""
    mark = cache.checkpoint()
    logits = [forward(model, cache, question)[0, -1]]
    for _ in range(steps):
        logits.append(forward(model, cache, logits[-1].argmax().view(1, 1))[0, -1])
    cache.rollback(mark)
    return logits


def _full_reference(model, prefix, context, question):
    full = block_prefill(model, prefix, context, block_size=16, budgets=None, scorer=None).cache
    return _answer_logits(model, full, question)


def test_full_cache_paged_past_sink_and_window_with_every_page_retrieved_is_full_kv(tmp_path, model):
    prefix, context, question = _ids(5, 1), _ids(90, 2), _ids(7, 3)
    want = _full_reference(model, prefix, context, question)
    spill = _spill(tmp_path, model)
    cache = block_prefill(model, prefix, context, block_size=16, budgets=None, scorer=None, on_evict=spill).cache
    keep_sink_and_window(cache, window=8)
    assert cache.sizes == [5 + 8, 5 + 8] and spill.entries == 2 * 2 * (90 - 8)
    _paged(tmp_path, spill, cache)
    assert all(isinstance(layer, PagedLayer) for layer in cache.layers)
    for got, ref in zip(_answer_logits(model, cache, question), want, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads", ["uniform", "adaptive"])
def test_evicting_prefill_with_every_spilled_page_retrieved_attends_to_every_entry(tmp_path, model, heads):
    """Whatever eviction chose, resident + spilled is every entry the prefill computed (once each), and
    retrieving every page answers as a cache holding all of them would."""
    from kvchat.kv.cache import EpisodeCache
    from kvchat.kv.heads import HeadBudgets
    from kvchat.kv.layers import RaggedLayer

    prefix, context, question = _ids(5, 1), _ids(120, 4), _ids(6, 5)
    spill = _spill(tmp_path, model)
    cache = block_prefill(
        model, prefix, context, block_size=16, budgets=[24, 32], scorer=PatchedPromptScorer(_ids(4, 6)),
        heads=HeadBudgets(heads), on_evict=spill,
    ).cache
    whole = []  # per layer, per head: kept + spilled entries in position order
    for i, layer in enumerate(cache.layers):
        heads_kv = RaggedLayer.from_uniform(layer) if not layer.ragged else layer
        ks, vs, ps = [], [], []
        for h, (k, v, p) in enumerate(zip(heads_kv.keys, heads_kv.values, heads_kv.positions, strict=True)):
            sk, sv, sp = spill.head_entries(i, h)
            positions = torch.cat([p, sp])
            order = positions.argsort()
            assert torch.equal(positions[order], torch.arange(125))  # every entry exactly once
            ks.append(torch.cat([k[0, 0], sk])[order].view(1, 1, -1, 16))
            vs.append(torch.cat([v[0, 0], sv])[order].view(1, 1, -1, 16))
            ps.append(positions[order])
        whole.append(RaggedLayer(ks, vs, ps))
    want = _answer_logits(model, EpisodeCache.of_layers(whole, next_position=125, protected=5), question)
    _paged(tmp_path, spill, cache)
    for got, ref in zip(_answer_logits(model, cache, question), want, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_spilling_leaves_the_prefill_peak_and_the_kept_cache_unchanged(tmp_path, model):
    prefix, context = _ids(5, 1), _ids(200, 7)
    kwargs = dict(block_size=32, budgets=[40, 40], scorer=PatchedPromptScorer(_ids(4, 6)))
    plain = block_prefill(model, prefix, context, **kwargs)
    spilled = block_prefill(model, prefix, context, **kwargs, on_evict=_spill(tmp_path, model))
    assert (spilled.peak_layer_entries, spilled.peak_total_entries) == (plain.peak_layer_entries,
                                                                       plain.peak_total_entries)  # fmt: skip
    for a, b in zip(plain.cache.layers, spilled.cache.layers, strict=True):
        assert torch.equal(a.positions, b.positions) and torch.equal(a.keys, b.keys)


def test_rollback_empties_the_pool(tmp_path, model):
    """After an answer, the next question retrieves for itself, as on a freshly loaded cache."""
    prefix, context, first, second = _ids(5, 1), _ids(90, 2), _ids(7, 3), _ids(7, 8)

    def paged_cache(directory: Path):
        directory.mkdir()
        spill = _spill(directory, model)
        cache = block_prefill(model, prefix, context, block_size=16, budgets=None, scorer=None, on_evict=spill).cache
        keep_sink_and_window(cache, window=8)
        _paged(directory, spill, cache, budget=8, refresh=1)
        return cache

    used = paged_cache(tmp_path / "used")
    lengths = [layer.lengths for layer in used.layers]
    _answer_logits(model, used, first)
    assert [layer.lengths for layer in used.layers] == lengths
    fresh = paged_cache(tmp_path / "fresh")
    for got, ref in zip(_answer_logits(model, used, second), _answer_logits(model, fresh, second), strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)


class _NewestFirstOut(BlockScorer):
    """Scores every entry by how old it is: left alone, eviction keeps the oldest and drops the recent."""

    def __call__(self, model, cache, block_ids):
        return [pad_sequence([-p.float() for p in layer.positions], batch_first=True, padding_value=-1e9)
                for layer in cache.layers]  # fmt: skip


@pytest.mark.parametrize("scorer", [_NewestFirstOut(), CakeScorer(window=4, gamma=200.0, pool_kernel=1),
                                    PatchedPromptScorer(_ids(4, 6))], ids=["newest-out", "cake", "epicache"])
@pytest.mark.parametrize("heads", ["uniform", "adaptive"])
def test_the_window_is_resident_after_prefill_whatever_the_scorer(tmp_path, model, scorer, heads):
    """Every layer and KV head ends with its budget, the last W history tokens among it; with the spill,
    resident and spilled entries still partition the history."""
    from kvchat.kv.heads import HeadBudgets

    prefix, context, window, budget = _ids(5, 1), _ids(150, 9), 8, 24
    spill = _spill(tmp_path, model)
    cache = block_prefill(model, prefix, context, block_size=32, budgets=[budget] * 2, scorer=scorer,
                          heads=HeadBudgets(heads), on_evict=spill, recent=window).cache  # fmt: skip
    end = 5 + 150
    for i, layer in enumerate(cache.layers):
        for h, positions in enumerate(layer.positions):
            kept = set(positions.tolist())
            assert set(range(end - window, end)) <= kept and set(range(5)) <= kept
            spilled = set(spill.head_entries(i, h)[2].tolist())
            assert not kept & spilled and kept | spilled == set(range(end))
        assert sum(layer.lengths) == budget * len(layer.lengths)
    if isinstance(scorer, _NewestFirstOut):  # without the window this scorer keeps none of the end
        plain = block_prefill(model, prefix, context, block_size=32, budgets=[budget] * 2, scorer=scorer).cache
        assert all(int(p.max()) < end - window for layer in plain.layers for p in layer.positions)


# --------------------------------------------------------------------------- through ingest, store and ask

OFFLOAD = IngestConfig(
    cache=CacheConfig(budget=64, block_size=32, prefill="block",
                      offload=OffloadConfig(mode="icecache", retrieve=32, dtype="float32")),
    episodes=EpisodeConfig(episodes=2, patched_prompt_tokens=48),
)  # fmt: skip


def _ingest(store, history, lm, encoder, config=OFFLOAD):
    return ingest(history, name="conv", config=config, store=store, lm=lm, encoder=encoder)


def test_ingest_writes_a_pages_file_per_episode_holding_what_eviction_dropped(tmp_path, history, tiny_lm, encoder):
    store = Store(tmp_path)
    report = _ingest(store, history, tiny_lm, encoder)
    record = store.get("conv")
    assert report.offload == "icecache" and report.pages_bytes == sum(e.pages.bytes for e in record.episodes)
    window = OFFLOAD.cache.offload.recent  # resident beside M: a plain ingest at M + W peaks the same
    plain = _ingest(Store(tmp_path / "plain"), history, tiny_lm, encoder, replace(OFFLOAD, cache=replace(
        OFFLOAD.cache, budget=OFFLOAD.cache.budget + window, offload=OffloadConfig())))  # fmt: skip
    assert report.peak_layer_entries == plain.peak_layer_entries  # the ingest bound is unchanged
    entries = 0
    for episode in record.episodes:
        assert episode.pages is not None and episode.pages.path.name == f"{episode.index}.pages.safetensors"
        tensors, metadata = store.load_pages(episode, tiny_lm.fingerprint)
        assert metadata["fingerprint"] == tiny_lm.fingerprint
        entries += sum(int(t.shape[0]) for name, t in tensors.items() if name.startswith("pos."))
        kept, meta = store.load_episode(episode, tiny_lm.fingerprint)
        for layer in range(2):  # head 0: kept and paged positions partition the prompt and the history
            resident = kept[f"pos.{layer}"][0].tolist()
            rows = int(tensors[f"page_len.{layer}"][: int(tensors[f"head_pages.{layer}"][0])].sum())
            paged = tensors[f"pos.{layer}"][:rows].tolist()
            assert sorted(resident + paged) == list(range(int(meta["next_position"])))
    assert entries == report.offloaded_entries > 0
    assert sorted(p.name for p in record.episodes[0].path.parent.iterdir()) == sorted(
        [f"{i}.safetensors" for i in range(2)] + [f"{i}.pages.safetensors" for i in range(2)] + ["conversation.json"]
    )  # no spill files left behind
    manifest = json.loads((record.episodes[0].path.parent / "conversation.json").read_text())["conversation"]
    assert [e["pages"]["sha256"] for e in manifest["episodes"]] == [e.pages.sha256 for e in record.episodes]


def test_answers_with_every_page_equal_full_kv_answers(tmp_path, history, tiny_lm, encoder):
    store = Store(tmp_path)
    full = replace(OFFLOAD, cache=CacheConfig(method="full", block_size=32, prefill="block"))
    _ingest(store, history, tiny_lm, encoder, full)
    reference = Session(store, store.get("conv"), tiny_lm, encoder)
    paged_store = Store(tmp_path / "paged")
    offload = replace(OFFLOAD, cache=replace(full.cache, offload=OffloadConfig(mode="icecache", recent=8,
                                                                             dtype="float32")))  # fmt: skip
    _ingest(paged_store, history, tiny_lm, encoder, offload)
    paged = Session(paged_store, paged_store.get("conv"), tiny_lm, encoder, AskConfig(retrieve=EVERYTHING))
    for question in ("How many tomato plants did Tom plant?", "Which gate does the flight leave from?"):
        firsts: list[list[torch.Tensor]] = [[], []]
        want = reference.ask(question, episode=0, on_first_logits=firsts[0].append).text
        got = paged.ask(question, episode=0, on_first_logits=firsts[1].append).text
        assert got == want
        torch.testing.assert_close(firsts[1][0], firsts[0][0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("prefill", ["block", "full"])
def test_ingest_keeps_the_window_resident_beside_the_budget(tmp_path, history, tiny_lm, encoder, prefill):
    window = 12
    config = replace(OFFLOAD, cache=replace(OFFLOAD.cache, method="keydiff", prefill=prefill, offload=replace(
        OFFLOAD.cache.offload, recent=window)))  # fmt: skip
    store = Store(tmp_path)
    _ingest(store, history, tiny_lm, encoder, config)
    for episode in store.get("conv").episodes:
        kept, meta = store.load_episode(episode, tiny_lm.fingerprint)
        end = int(meta["next_position"])
        for layer in range(2):
            positions = kept[f"pos.{layer}"]
            assert positions.shape[-1] == OFFLOAD.cache.budget + window
            assert all(set(range(end - window, end)) <= set(p.tolist()) for p in positions)


def test_layers_below_the_first_paged_one_keep_everything(tmp_path, history, tiny_lm, encoder):
    config = replace(OFFLOAD, cache=replace(OFFLOAD.cache, offload=replace(OFFLOAD.cache.offload,
                                                                         first_paged_layer=1)))  # fmt: skip
    store = Store(tmp_path)
    _ingest(store, history, tiny_lm, encoder, config)
    episode = store.get("conv").episodes[0]
    kept, meta = store.load_episode(episode, tiny_lm.fingerprint)
    pages, _ = store.load_pages(episode, tiny_lm.fingerprint)
    assert kept["pos.0"].shape[-1] == int(meta["next_position"]) and pages["pos.0"].numel() == 0
    assert kept["pos.1"].shape[-1] == OFFLOAD.cache.budget + OffloadConfig.recent and pages["pos.1"].numel() > 0
    cake = replace(config, cache=replace(config.cache, layer_budgets="cake"))
    with pytest.raises(UserError, match="first paged layer"):
        _ingest(Store(tmp_path / "cake"), history, tiny_lm, encoder, cake)


def test_offload_settings_round_trip_and_rebuild(tmp_path):
    config = replace(OFFLOAD, cache=replace(OFFLOAD.cache, offload=OffloadConfig(
        mode="icecache", retrieve=96, recent=16, candidates=8, paging=PagingConfig(page_size=8))))  # fmt: skip
    settings = to_settings(config, source="h.json")
    assert from_settings(settings).cache.offload == config.cache.offload
    command = spell(rebuild_command("c", "default", settings))
    assert "--offload icecache --retrieve 96" in command
    assert "--setting offload_recent=16" in command and "--setting page_size=8" in command
    assert from_settings({}).cache.offload.mode == "none"  # stores from before --offload


@pytest.mark.parametrize(
    ("offload", "message"),
    [
        (OffloadConfig(mode="disk"), "--offload"),
        (OffloadConfig(mode="icecache", retrieve=-1), "--retrieve"),
        (OffloadConfig(mode="icecache", paging=PagingConfig(page_size=1, cluster_size=1)), None),
        (OffloadConfig(mode="icecache", scorer="best"), "--setting page_scorer"),
        (OffloadConfig(mode="icecache", paging=PagingConfig(page_size=0)), "--setting page_size must be >= 1"),
        (OffloadConfig(mode="icecache", recent=-1), "--setting offload_recent must be >= 0"),
        (OffloadConfig(mode="icecache", candidates=0), "--setting page_candidates must be >= 1"),
    ],
)
def test_bad_offload_settings_are_user_errors(tmp_path, history, tiny_lm, encoder, offload, message):
    config = replace(OFFLOAD, cache=replace(OFFLOAD.cache, offload=offload))
    if message is None:
        _ingest(Store(tmp_path), history, tiny_lm, encoder, config)  # one-entry pages are fine
        return
    with raises_said(UserError, message):
        _ingest(Store(tmp_path), history, tiny_lm, encoder, config)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_a_damaged_or_missing_pages_file_is_refused_with_the_rebuild_command(
    tmp_path, history, tiny_lm, encoder, damage
):
    store = Store(tmp_path)
    _ingest(store, history, tiny_lm, encoder)
    record = store.get("conv")
    path = record.episodes[0].pages.path
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-3] ^= 0xFF
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    else:
        path.unlink()
    with raises_said(CacheIntegrityError, r"pages file of conversation 'conv' episode 0 .*rebuild with "
                                          r"`kvchat ingest .* --offload icecache"):  # fmt: skip
        Session(store, record, tiny_lm, encoder).ask("anything?", episode=0)
    problems = store.check()
    assert [(p.conversation, p.episode, p.path) for p in problems] == [("conv", 0, path)]
    assert "pages file" in problems[0].message
    assert any("removed conversation 'conv'" in line for line in store.fix(problems))
    assert store.conversations() == [] and store.check() == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the session runs in a forked child")
def test_a_pages_file_truncated_while_a_session_reads_it_ends_the_answer_with_a_message(
    tmp_path, history, tiny_lm, encoder
):
    """Issue 29, case 9: the pages file is truncated in place (same inode) after a first answer, while the
    session holds the episode with its pages file open. A memory map of it would kill the process with SIGBUS
    at the next answer's first read past the new end; the answer ends with the message instead, and the next
    question reads the files again and is refused by their size check. In a forked child, so that a SIGBUS
    fails this test rather than ending pytest."""
    from test_crash_points import _run

    store = Store(tmp_path)
    _ingest(store, history, tiny_lm, encoder)
    record = store.get("conv")
    path = record.episodes[0].pages.path
    header_end = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    session = Session(store, record, tiny_lm, encoder)
    first = session.ask("Where did Alice go?", episode=0, log=False)
    assert first.answer_tokens > 0 and session.retrieved_positions() != []

    def truncated_between_questions(home: Path) -> None:
        os.truncate(path, header_end)  # every entry's bytes are gone; the header read at open is not
        with raises_said(CacheIntegrityError, r"^pages file of conversation 'conv' episode 0 was truncated "
                                              r"while this session was reading it; rebuild with `kvchat "):
            session.ask("Where did Alice go?", episode=0, log=False)
        with pytest.raises(CacheIntegrityError, match=r"pages file of conversation 'conv' episode 0 .*rebuild with"):
            session.ask("And then?", episode=0, log=False)

    assert _run(truncated_between_questions, tmp_path, {}) == 0  # -7: SIGBUS


@pytest.mark.parametrize("where", ["spill", "pages"])
def test_a_full_disk_during_an_offload_ingest_aborts_with_one_line(tmp_path, history, tiny_lm, encoder,
                                                                   monkeypatch, where):  # fmt: skip
    """Whether the disk fills while evicted entries are spilled or while the pages file is written: one
    line, no conversation, no temp dir, no spill files."""
    import errno
    import os

    import kvchat.kv.spill as spill_module

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if where == "spill":
        monkeypatch.setattr(spill_module.SpillWriter, "spill", full)
    else:
        monkeypatch.setattr(spill_module, "write_layers", full)
    store = Store(tmp_path)
    with pytest.raises(UserError, match="no space left on device"):
        _ingest(store, history, tiny_lm, encoder)
    assert store.conversations() == [] and list(store.caches_dir.iterdir()) == []


def test_any_other_failure_of_an_offload_ingest_leaves_nothing(tmp_path, history, tiny_lm, encoder, monkeypatch):
    import kvchat.kv.spill as spill_module

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(spill_module, "write_layers", broken)
    store = Store(tmp_path)
    with pytest.raises(RuntimeError, match="boom"):
        _ingest(store, history, tiny_lm, encoder)
    assert store.conversations() == [] and list(store.caches_dir.iterdir()) == []


def test_a_damaged_database_is_rebuilt_with_the_pages_files(tmp_path, history, tiny_lm, encoder):
    """`doctor --fix` rebuilds kvchat.db from the manifests: the pages files come back with their rows."""
    import os

    from kvchat.store import diagnose, repair

    store = Store(tmp_path)
    _ingest(store, history, tiny_lm, encoder)
    before = store.get("conv")
    store.close()
    db = tmp_path / "kvchat.db"
    db.write_bytes(os.urandom(db.stat().st_size))
    problems = diagnose(tmp_path)
    assert [p.kind for p in problems] == ["database"]
    assert any("restored conversation 'conv'" in line for line in repair(tmp_path, problems))
    store = Store(tmp_path)
    assert store.get("conv").episodes == before.episodes and all(e.pages for e in before.episodes)
    for episode in before.episodes:
        store.load_pages(episode, tiny_lm.fingerprint)
    assert diagnose(tmp_path) == []
