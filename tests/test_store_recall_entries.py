"""A conversation's recall entries file (`--method recall`): one file per conversation beside its episode
files, committed, checksummed, listed in the manifest and kvchat.db, checked by doctor, rebuilt by recovery and
carried unchanged into an append's new version. The files here are small dummies written as the real one is
(`SafetensorsWriter`, the model fingerprint in its metadata)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from cli_helpers import run_main
from conftest import centroid, raises_said
from test_store import FP, SETTINGS, STATS, _ingest, _tensors, _tmp_dirs

from kvchat.cli.words import spell
from kvchat.errors import CacheIntegrityError, UserError
from kvchat.kv.tensorfile import FileRows, SafetensorsWriter
from kvchat.store import ConversationChanged, Store, diagnose, repair
from kvchat.store.layout import RECALL_ENTRIES_NAME
from kvchat.store.manifest import MANIFEST_NAME, digest, document, read_manifest

AN_HOUR_AGO = time.time() - 3600
REBUILD = r"rebuild with `kvchat ingest .*--name chat .*--replace"


def _entries(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + seed)
    return {"k.0": torch.randn(6, 2, 4, generator=g).to(torch.bfloat16), "v.0": torch.randn(6, 2, 4, generator=g),
            "chunk_first": torch.arange(6, dtype=torch.int32) * 3}  # fmt: skip


def _writer(seed: int = 0, fingerprint: str = FP) -> Callable[[Path], tuple[int, str]]:
    def write(path: Path) -> tuple[int, str]:
        writer = SafetensorsWriter(path)
        for name, tensor in _entries(seed).items():
            writer.add(name, tensor)
        return writer.finish({"fingerprint": fingerprint, "chunks": "6"})

    return write


def _commit(store: Store, name: str = "chat", *, seed: int = 0, replace: bool = False, expect: str | None = None,
            fingerprint: str = FP):  # fmt: skip
    """Conversation `name` of two episodes with a recall entries file."""
    with store.begin(name, replace=replace, expect=expect) as pending:
        for i in range(2):
            pending.write_episode(i, _tensors(seed + i), {"fingerprint": FP, "method": "recall"},
                                  centroid=centroid(0.25 * i, -1.0, 3.0), medoid_text=f"episode {i}", budgets=[8, 12],
                                  n_tokens=20)  # fmt: skip
        pending.write_recall_entries(_writer(seed, fingerprint))
        return pending.commit(model="default", fingerprint=FP, settings=SETTINGS, stats=STATS)


def _reads_back(store: Store, name: str = "chat", seed: int = 0) -> None:
    tensors, metadata = store.load_recall_entries(store.get(name), FP)
    assert metadata == {"fingerprint": FP, "chunks": "6"}
    expected = _entries(seed)
    assert set(tensors) == set(expected) and all(isinstance(t, FileRows) for t in tensors.values())
    for key, tensor in expected.items():
        assert tensors[key].read().dtype == tensor.dtype and torch.equal(tensors[key].read(), tensor)


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))


DAMAGE = {
    "flipped": (_flip, "checksum", "failed its checksum"),
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:-8]), "size", "truncated or replaced"),
    "missing": (lambda p: p.unlink(), "missing", "is missing"),
}


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "home")


# --------------------------------------------------------------------------- round trip


def test_a_recall_entries_file_is_committed_with_its_conversation_and_read_back(store: Store) -> None:
    committed = _commit(store)
    entries = committed.recall_entries
    ingest_dir = store.caches_dir / "chat" / committed.ingest_id
    assert entries is not None and entries.path == ingest_dir / RECALL_ENTRIES_NAME and entries.path.is_file()
    assert entries.bytes == entries.path.stat().st_size
    assert store.get("chat") == committed and Store(store.home).get("chat") == committed
    assert committed.files()[-1] == (entries.path, entries.bytes, entries.sha256, "recall entries")
    assert [f[3] for f in committed.files()] == ["cache", "cache", "recall entries"]
    _reads_back(store)
    doc = read_manifest(ingest_dir)  # in the manifest, so in its digest, relative to the home
    assert doc["recall_entries"] == {"path": f"caches/chat/{committed.ingest_id}/{RECALL_ENTRIES_NAME}",
                                     "bytes": entries.bytes, "sha256": entries.sha256}  # fmt: skip
    with sqlite3.connect(store.db_path) as conn:
        row = conn.execute("select recall_entries_path, recall_entries_bytes, recall_entries_sha256, digest "
                           "from conversations").fetchone()  # fmt: skip
    assert row == (doc["recall_entries"]["path"], entries.bytes, entries.sha256, digest(doc))
    assert store.check() == []  # not taken for a stray file: a row names it
    assert sorted(p.name for p in ingest_dir.iterdir()) == [
        "0.safetensors", "1.safetensors", MANIFEST_NAME, RECALL_ENTRIES_NAME]  # fmt: skip


def test_a_conversation_without_one_keeps_the_document_and_digest_it_had(store: Store) -> None:
    """No `recall_entries` key, NULL columns, the same digest: conversations stored before the file existed, and
    those without one, are unchanged."""
    home_path = "caches/chat/" + "0" * 32
    episodes = [
        {"index": 0, "centroid": [0.25, -1.0], "medoid_text": "episode 0", "budgets": [8, 12], "n_tokens": 20,
         "bytes": 1000, "sha256": "a" * 64, "path": f"{home_path}/0.safetensors"},
        {"index": 1, "centroid": [0.5, -1.0], "medoid_text": "episode 1", "budgets": [8, 12], "n_tokens": 20,
         "bytes": 2000, "sha256": "b" * 64, "path": f"{home_path}/1.safetensors",
         "pages": {"path": f"{home_path}/1.pages.safetensors", "bytes": 300, "sha256": "c" * 64}},
    ]  # fmt: skip
    fields = dict(name="chat", ingest_id="0" * 32, created_at="2026-01-01T00:00:00.000000+00:00", model="default",
                  fingerprint="fp-model-a", settings={"budget": 64, "method": "recall"}, stats={"turns": 12},
                  episodes=episodes)  # fmt: skip
    # the digest kvchat computed for this document before recall entries files existed
    assert digest(document(**fields)) == "fc66509f6273eda32d8f9fddf90ec458542a9ff5f8ae2608602d4680f6d9bee9"
    assert digest(document(**fields, recall_entries=None)) == digest(document(**fields))
    with_file = document(**fields, recall_entries={"path": f"{home_path}/{RECALL_ENTRIES_NAME}", "bytes": 9,
                                                   "sha256": "d" * 64})  # fmt: skip
    assert digest(with_file) != digest(document(**fields))

    record = _ingest(store, "plain")
    assert record.recall_entries is None and [f[3] for f in record.files()] == ["cache", "cache"]
    assert "recall_entries" not in read_manifest(record.episodes[0].path.parent)
    with sqlite3.connect(store.db_path) as conn:
        assert conn.execute("select recall_entries_path, recall_entries_bytes, recall_entries_sha256 "
                            "from conversations").fetchall() == [(None, None, None)]  # fmt: skip
    with raises_said(UserError, r"conversation 'plain' keeps no recall entries file; rebuild with `kvchat"):
        store.load_recall_entries(record, FP)


def test_list_and_show_report_the_recall_entries_bytes(tmp_path: Path) -> None:
    store = Store(tmp_path)
    entries = _commit(store).recall_entries
    _ingest(store, "plain")
    store.close()
    listed = json.loads(run_main(tmp_path, "list", "--json").stdout)["conversations"]
    assert {c["name"]: c["recall_entries_bytes"] for c in listed} == {"chat": entries.bytes, "plain": 0}
    shown = json.loads(run_main(tmp_path, "show", "chat", "--json").stdout)
    assert shown["recall_entries_bytes"] == entries.bytes
    text = run_main(tmp_path, "show", "chat")
    assert text.returncode == 0 and " MiB of recall entries" in text.stderr
    assert " MiB of recall entries" not in run_main(tmp_path, "show", "plain").stderr
    disk = {c["name"]: c["disk_bytes"] - c["cache_bytes"] for c in listed}  # `list`'s MiB: every file on disk
    assert disk == {"chat": entries.bytes, "plain": 0}


# --------------------------------------------------------------------------- damage


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_recall_entries_file_is_refused_reported_and_removed_whole(store: Store, damage: str) -> None:
    damage_file, kind, said = DAMAGE[damage]
    record = _commit(store)
    other = _ingest(store, "other", seed=3)
    damage_file(record.recall_entries.path)
    with raises_said(CacheIntegrityError, rf"^recall entries file of conversation 'chat' .*{said}.*{REBUILD}"):
        store.load_recall_entries(record, FP)
    for episode in record.episodes:  # the episodes themselves still read
        store.load_episode(episode, FP)

    problems = store.check()
    assert [(p.kind, p.conversation, p.episode, p.path) for p in problems] == [
        (kind, "chat", None, record.recall_entries.path)]  # fmt: skip
    said = spell(problems[0].message)
    assert "recall entries file" in said and "--fix removes the conversation" in said
    done = store.fix(problems)
    assert len(done) == 1 and done[0].startswith("removed conversation 'chat'")
    assert [c.name for c in store.conversations()] == ["other"] and store.get("other") == other
    assert not (store.caches_dir / "chat").exists() and store.check() == []


def test_a_recall_entries_file_of_another_model_is_refused(store: Store) -> None:
    record = _commit(store, fingerprint="fp-model-b")
    with raises_said(CacheIntegrityError, rf"recall entries file of conversation 'chat' was built by a "
                                          rf"different model.*{REBUILD}"):  # fmt: skip
        store.load_recall_entries(record, FP)


def test_reading_the_recall_entries_of_a_version_another_process_replaced_says_so(store: Store) -> None:
    old = _commit(store)
    _commit(Store(store.home), replace=True, seed=1)
    with pytest.raises(ConversationChanged) as info:
        store.load_recall_entries(old, FP)
    assert "rebuild" not in str(info.value)


# --------------------------------------------------------------------------- nothing half-written visible


def test_nothing_of_a_recall_entries_file_is_visible_before_commit_or_after_an_abort(store: Store) -> None:
    with pytest.raises(RuntimeError, match="the ingest failed"), store.begin("chat") as pending:
        pending.write_episode(0, _tensors(), {"fingerprint": FP}, centroid=centroid(1.0), medoid_text="m",
                              budgets=[4], n_tokens=8)  # fmt: skip
        record = pending.write_recall_entries(_writer())
        assert record.path == store.caches_dir / "chat" / pending.ingest_id / RECALL_ENTRIES_NAME
        assert not record.path.exists() and store.conversations() == []  # in the temp dir only
        raise RuntimeError("the ingest failed")
    assert store.conversations() == [] and _tmp_dirs(store) == [] and list(store.caches_dir.iterdir()) == []


def test_a_full_disk_while_the_recall_entries_file_is_written_gives_the_space_back(store: Store) -> None:
    def fills_the_disk(path: Path) -> tuple[int, str]:
        path.write_bytes(b"part of a file")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(UserError, match="no space left on device"), store.begin("chat") as pending:
        pending.write_episode(0, _tensors(), {"fingerprint": FP}, centroid=centroid(1.0), medoid_text="m",
                              budgets=[4], n_tokens=8)  # fmt: skip
        pending.write_recall_entries(fills_the_disk)
    assert store.conversations() == [] and _tmp_dirs(store) == []


def test_a_failed_write_leaves_no_part_of_the_file_to_commit(store: Store) -> None:
    """A writer that fails (not for room) and a caller that goes on without the file: nothing of it is committed."""
    def fails(path: Path) -> tuple[int, str]:
        path.write_bytes(b"part of a file")
        raise ValueError("could not compute the entries")

    with store.begin("chat") as pending:
        pending.write_episode(0, _tensors(), {"fingerprint": FP}, centroid=centroid(1.0), medoid_text="m",
                              budgets=[4], n_tokens=8)  # fmt: skip
        with pytest.raises(ValueError, match="could not compute"):
            pending.write_recall_entries(fails)
        record = pending.commit(model="default", fingerprint=FP, settings=SETTINGS, stats=STATS)
    assert record.recall_entries is None and not (record.episodes[0].path.parent / RECALL_ENTRIES_NAME).exists()
    assert store.check() == []


def test_commit_refuses_a_recall_entries_record_whose_file_is_not_in_its_temp_dir(store: Store) -> None:
    elsewhere = store.home / "elsewhere.safetensors"
    with pytest.raises(ValueError, match="recall entries file is not in this ingest's temp dir"), \
            store.begin("chat") as pending:  # fmt: skip
        pending.write_episode(0, _tensors(), {"fingerprint": FP}, centroid=centroid(1.0), medoid_text="m",
                              budgets=[4], n_tokens=8)  # fmt: skip
        pending.write_recall_entries(lambda path: _writer()(elsewhere))  # written, but not where it was asked
        pending.commit(model="default", fingerprint=FP, settings=SETTINGS, stats=STATS)
    assert store.conversations() == [] and _tmp_dirs(store) == []


def test_a_second_recall_entries_file_is_refused(store: Store) -> None:
    with store.begin("chat") as pending:
        pending.write_recall_entries(_writer())
        with pytest.raises(ValueError, match="already written"):
            pending.write_recall_entries(_writer(1))


# --------------------------------------------------------------------------- recovery and reindex


def test_a_damaged_database_is_rebuilt_with_the_recall_entries(tmp_path: Path) -> None:
    store = Store(tmp_path)
    record = _commit(store)
    store.close()
    (tmp_path / "kvchat.db").write_bytes(os.urandom((tmp_path / "kvchat.db").stat().st_size))
    problems = diagnose(tmp_path)
    assert problems[0].kind == "database" and "restoring 'chat' (from its manifest)" in problems[0].message
    done = repair(tmp_path, problems)
    assert "restored conversation 'chat' (2 episodes) from its manifest" in done
    store = Store(tmp_path)
    assert store.get("chat") == record and store.get("chat").recall_entries is not None
    _reads_back(store)
    assert store.check() == []


def test_a_missing_database_lists_the_conversation_again_with_its_recall_entries(tmp_path: Path) -> None:
    store = Store(tmp_path)
    record = _commit(store)
    store.close()
    (tmp_path / "kvchat.db").unlink()
    os.utime(record.recall_entries.path.parent, (AN_HOUR_AGO, AN_HOUR_AGO))
    store = Store(tmp_path)  # the next command lists it again from its manifest (reindex)
    assert store.get("chat") == record
    _reads_back(store)


def test_a_rebuild_does_not_restore_a_conversation_whose_recall_entries_file_is_damaged(tmp_path: Path) -> None:
    store = Store(tmp_path)
    record = _commit(store)
    store.close()
    _flip(record.recall_entries.path)
    (tmp_path / "kvchat.db").write_bytes(b"not a database" * 100)
    lost = [p for p in diagnose(tmp_path) if p.kind == "lost"]
    assert len(lost) == 1 and lost[0].conversation == "chat"
    assert "(2 episode files) cannot be rebuilt: its recall entries file failed its checksum" in lost[0].message
    repair(tmp_path, diagnose(tmp_path))
    assert Store(tmp_path).conversations() == []


# --------------------------------------------------------------------------- schema


def test_a_home_at_schema_3_is_upgraded_and_its_rows_are_unchanged(tmp_path: Path, monkeypatch) -> None:
    from kvchat.store import schema

    monkeypatch.setattr(schema, "MIGRATIONS", schema.MIGRATIONS[:3])
    store = Store(tmp_path)
    assert "recall_entries_path" not in store._db["conversations"].columns_dict
    store.close()
    old_data = b"an episode file"
    path = tmp_path / "caches" / "chat" / "old" / "0.safetensors"
    path.parent.mkdir(parents=True)
    path.write_bytes(old_data)
    old = document(name="chat", ingest_id="old", created_at="2026-01-01", model="default", fingerprint=FP,
                   settings={}, stats={}, episodes=[{
                       "index": 0, "centroid": [1.0], "medoid_text": "m", "budgets": [4], "n_tokens": 8,
                       "bytes": len(old_data), "sha256": hashlib.sha256(old_data).hexdigest(),
                       "path": "caches/chat/old/0.safetensors"}])  # fmt: skip
    with sqlite3.connect(tmp_path / "kvchat.db") as conn:  # the rows schema 3 wrote
        conn.execute("insert into conversations (name, created_at, model, fingerprint, settings, stats, ingest_id, "
                     "digest) values ('chat', '2026-01-01', 'default', ?, '{}', '{}', 'old', ?)", [FP, digest(old)])
        conn.execute("insert into episodes (conversation, idx, centroid, medoid_text, budgets, n_tokens, bytes, "
                     "sha256, path) values ('chat', 0, '[1.0]', 'm', '[4]', 8, ?, ?, ?)",
                     [len(old_data), old["episodes"][0]["sha256"], old["episodes"][0]["path"]])  # fmt: skip
    monkeypatch.undo()

    store = Store(tmp_path)
    with sqlite3.connect(store.db_path) as conn:
        assert conn.execute("select version from migrations").fetchall() == [(1,), (2,), (3,), (4,)]
        assert conn.execute("select digest, recall_entries_path from conversations").fetchall() == [(digest(old), None)]
    assert store.get("chat").recall_entries is None and store.get("chat").episodes[0].path == path
    assert store.check() == [] and store.database_damage() is None
    _commit(store, "new")  # the upgraded home takes a conversation with a recall entries file
    _reads_back(store, "new")
