"""The store's promises: bit-exact round trips, nothing half-written visible, damage refused."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import sqlite3
import struct
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch
from cli_helpers import run_main
from conftest import centroid, raises_said

from kvchat import store as store_module
from kvchat.cli.words import error_text, spell
from kvchat.errors import CacheIntegrityError, UserError
from kvchat.store import (
    MAX_HEADER_BYTES,
    ConversationRecord,
    EpisodeRecord,
    Store,
    check_safetensors_header,
    manifest,
)

FP = "fp-model-a"
SETTINGS = {"budget": 64, "block_size": 32, "method": "epicache", "positions": "auto"}
STATS = {"n_turns": 12, "n_tokens": 345, "peak_layer_entries": 80, "seconds": 1.5}


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "k.0": torch.randn(2, 5, 4, generator=g),
        "v.0": torch.randn(2, 5, 4, generator=g).to(torch.bfloat16),
        "pos.0": torch.arange(10, dtype=torch.int32).reshape(2, 5),
    }


def _ingest(store: Store, name: str, n: int = 2, *, replace: bool = False, fp: str = FP, seed: int = 0,
            offset: float = 0.0):
    with store.begin(name, replace=replace) as pending:
        for i in range(n):
            pending.write_episode(
                i, _tensors(seed + i), {"fingerprint": fp, "method": "epicache"},
                centroid=centroid(0.25 * i + offset, -1.0, 3.0), medoid_text=f"episode {i}", budgets=[8, 12],
                n_tokens=20,
            )  # fmt: skip
        return pending.commit(model="default", fingerprint=fp, settings=SETTINGS, stats=STATS)


def _tmp_dirs(store: Store) -> list[str]:
    return [p.name for p in store.caches_dir.iterdir() if p.name.startswith(".tmp-")]


def _edit_episode_row(store: Store, name: str, index: int, **columns: object) -> None:
    """Change an episode row and re-sign its conversation's digest: an index that is consistent, yet wrong."""
    with sqlite3.connect(store.db_path) as conn:
        conn.row_factory = sqlite3.Row
        for column, value in columns.items():
            conn.execute(f"update episodes set {column} = ? where conversation = ? and idx = ?", (value, name, index))
        row = dict(conn.execute("select * from conversations where name = ?", (name,)).fetchone())
        episodes = [dict(r) for r in conn.execute("select * from episodes where conversation = ? order by idx",
                                                  (name,))]
        conn.execute("update conversations set digest = ? where name = ?",
                     (manifest.digest(manifest.document_from_rows(row, episodes)), name))


def _set_file_record(store: Store, record: EpisodeRecord, name: str) -> EpisodeRecord:
    """Make the index agree with whatever is now in the file, so only content checks can object."""
    data = record.path.read_bytes()
    _edit_episode_row(store, name, record.index, bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    return store.get(name).episodes[record.index]


def _safetensors_bytes(header: dict, data: bytes = b"", header_len: int | None = None) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "home")


# --------------------------------------------------------------------------- happy path


def test_round_trip_is_bit_exact(store: Store) -> None:
    committed = _ingest(store, "chat", n=3)
    got = store.get("chat")
    assert got == committed
    assert isinstance(got, ConversationRecord)
    assert got.model == "default" and got.fingerprint == FP
    assert got.settings == SETTINGS and got.stats == STATS
    assert [e.index for e in got.episodes] == [0, 1, 2]
    for ep in got.episodes:
        assert ep.path.is_absolute() and ep.path.is_file()
        assert ep.path.is_relative_to(store.caches_dir / "chat")
        assert ep.bytes == ep.path.stat().st_size
        assert ep.sha256 == hashlib.sha256(ep.path.read_bytes()).hexdigest()
        assert ep.centroid == centroid(0.25 * ep.index, -1.0, 3.0)
        assert ep.budgets == [8, 12] and ep.n_tokens == 20 and ep.medoid_text == f"episode {ep.index}"
        tensors, meta = store.load_episode(ep, FP)
        expected = _tensors(ep.index)
        assert set(tensors) == set(expected)
        for key, t in expected.items():
            assert tensors[key].dtype == t.dtype
            assert torch.equal(tensors[key], t)
        assert meta["fingerprint"] == FP and meta["method"] == "epicache" and meta["format_version"]
    assert store.latest() == got
    assert store.conversations() == [got]


def test_conversations_newest_first(store: Store) -> None:
    for name in ("first", "second", "third"):
        _ingest(store, name, n=1)
    assert [c.name for c in store.conversations()] == ["third", "second", "first"]
    assert store.latest().name == "third"


def test_records_survive_reopening(store: Store) -> None:
    committed = _ingest(store, "chat")
    reopened = Store(store.home)
    assert reopened.get("chat") == committed
    with sqlite3.connect(store.db_path) as conn:
        assert conn.execute("select version from migrations").fetchall() == [(1,), (2,), (3,), (4,)]
        assert conn.execute("pragma journal_mode").fetchone()[0] == "wal"


@pytest.mark.parametrize("versions", [1, 2])
def test_a_home_from_before_pages_files_is_upgraded_in_place(tmp_path: Path, monkeypatch, versions: int) -> None:
    """A kvchat.db written by an older schema (no pages columns) gains them; its episodes have no pages and
    its rows still match their digest."""
    from kvchat.store import schema

    monkeypatch.setattr(schema, "MIGRATIONS", schema.MIGRATIONS[:versions])
    Store(tmp_path).close()
    monkeypatch.undo()
    data = b"an episode file"
    path = tmp_path / "caches" / "chat" / "old" / "0.safetensors"
    path.parent.mkdir(parents=True)
    path.write_bytes(data)
    with sqlite3.connect(tmp_path / "kvchat.db") as conn:
        conn.execute("insert into conversations (name, created_at, model, fingerprint, settings, stats, ingest_id) "
                     "values ('chat', '2026-01-01', 'default', ?, '{}', '{}', 'old')", [FP])  # fmt: skip
        conn.execute(
            "insert into episodes values ('chat', 0, '[1.0]', 'm', '[4]', 8, ?, ?, 'caches/chat/old/0.safetensors')",
            [len(data), hashlib.sha256(data).hexdigest()],
        )
        if versions >= 2:  # that schema's rows carry their digest
            from kvchat.store.manifest import digest, document_from_rows

            conn.row_factory = sqlite3.Row
            row = dict(conn.execute("select * from conversations").fetchone())
            episodes = [dict(r) for r in conn.execute("select * from episodes")]
            conn.execute("update conversations set digest = ?", [digest(document_from_rows(row, episodes))])
    store = Store(tmp_path)
    assert [e.pages for e in store.get("chat").episodes] == [None]
    assert store.check() == [] and store.database_damage() is None
    with sqlite3.connect(store.db_path) as conn:
        assert conn.execute("select version from migrations").fetchall() == [(1,), (2,), (3,), (4,)]


def test_newer_schema_is_refused(store: Store) -> None:
    with sqlite3.connect(store.db_path) as conn:
        conn.execute("insert into migrations (version, applied_at) values (99, 'x')")
    with pytest.raises(UserError, match="newer kvchat"):
        Store(store.home)


def test_unknown_and_empty(store: Store) -> None:
    with pytest.raises(UserError, match="no conversations yet"):
        store.latest()
    with raises_said(UserError, r"unknown conversation 'nope' \(see `kvchat list`\)"):
        store.get("nope")
    with pytest.raises(UserError, match="unknown conversation"):
        store.remove("nope")


# --------------------------------------------------------------------------- atomicity


def test_not_visible_before_commit(store: Store) -> None:
    other = Store(store.home)
    with store.begin("chat") as pending:
        pending.write_episode(
            0, _tensors(), {"fingerprint": FP}, centroid=centroid(1.0), medoid_text="m", budgets=[4], n_tokens=8
        )
        assert store.conversations() == [] and other.conversations() == []
        assert not (store.caches_dir / "chat").exists()
        with pytest.raises(UserError):
            other.get("chat")
        pending.commit(model="default", fingerprint=FP, settings={}, stats={})
    assert [c.name for c in other.conversations()] == ["chat"]
    assert _tmp_dirs(store) == []


def test_exception_in_with_leaves_nothing(store: Store) -> None:
    with pytest.raises(RuntimeError, match="boom"), store.begin("chat") as pending:
        pending.write_episode(
            0, _tensors(), {"fingerprint": FP}, centroid=centroid(1.0), medoid_text="m", budgets=[4], n_tokens=8
        )
        raise RuntimeError("boom")
    assert _tmp_dirs(store) == []
    assert store.conversations() == []
    assert not (store.caches_dir / "chat").exists()


def test_abort_and_leaving_without_commit(store: Store) -> None:
    pending = store.begin("chat")
    pending.write_episode(
        0, _tensors(), {"fingerprint": FP}, centroid=centroid(1.0), medoid_text="m", budgets=[4], n_tokens=8
    )
    pending.abort()
    pending.abort()  # idempotent
    with pytest.raises(RuntimeError):
        pending.commit(model="default", fingerprint=FP, settings={}, stats={})
    with store.begin("chat2"):
        pass
    assert _tmp_dirs(store) == []
    assert store.conversations() == []


def test_commit_refuses_inconsistent_fingerprint(store: Store) -> None:
    with store.begin("chat") as pending:
        pending.write_episode(
            0, _tensors(), {"fingerprint": "other"}, centroid=centroid(1.0), medoid_text="m", budgets=[4], n_tokens=8
        )
        with pytest.raises(ValueError, match="fingerprint"):
            pending.commit(model="default", fingerprint=FP, settings={}, stats={})
    assert _tmp_dirs(store) == [] and store.conversations() == []


def test_write_episode_requires_fingerprint_and_str_metadata(store: Store) -> None:
    with store.begin("chat") as pending:
        kwargs = {"centroid": centroid(1.0), "medoid_text": "m", "budgets": [4], "n_tokens": 8}
        with pytest.raises(ValueError, match="fingerprint"):
            pending.write_episode(0, _tensors(), {"method": "full"}, **kwargs)
        with pytest.raises(ValueError, match="str"):
            pending.write_episode(0, _tensors(), {"fingerprint": FP, "budget": 3}, **kwargs)  # type: ignore[dict-item]


# --------------------------------------------------------------------------- replace and names


def test_replace_requires_flag_and_replaces_files(store: Store) -> None:
    old = _ingest(store, "chat", seed=0)
    old_dir = old.episodes[0].path.parent
    with raises_said(UserError, "conversation 'chat' exists; use --replace"):
        store.begin("chat")
    new = _ingest(store, "chat", n=1, replace=True, seed=10)
    assert not old_dir.exists()
    assert [p for p in (store.caches_dir / "chat").iterdir()] == [new.episodes[0].path.parent]
    got = store.get("chat")
    assert got == new and len(got.episodes) == 1
    tensors, _ = store.load_episode(got.episodes[0], FP)
    assert torch.equal(tensors["k.0"], _tensors(10)["k.0"])
    assert [c.name for c in store.conversations()] == ["chat"]


def test_name_taken_while_pending_is_refused(store: Store) -> None:
    first, second = store.begin("chat"), store.begin("chat")
    for pending in (first, second):
        pending.write_episode(
            0, _tensors(), {"fingerprint": FP}, centroid=centroid(1.0), medoid_text="m", budgets=[4], n_tokens=8
        )
    committed = first.commit(model="default", fingerprint=FP, settings={}, stats={})
    with raises_said(UserError, "use --replace"):
        second.commit(model="default", fingerprint=FP, settings={}, stats={})
    assert _tmp_dirs(store) == []
    assert [p.name for p in (store.caches_dir / "chat").iterdir()] == [committed.episodes[0].path.parent.name]
    assert store.get("chat") == committed
    store.load_episode(committed.episodes[0], FP)


@pytest.mark.parametrize("bad", ["", ".", "..", "a/b", "../x", "a\x00b", "a\nb", "x" * 101, ".hidden", "a b",
                                 "-dash", "CON", "com1.json", "a."])  # fmt: skip
def test_bad_names_are_refused(store: Store, bad: str) -> None:
    with pytest.raises(UserError, match="invalid conversation name") as info:
        store.begin(bad)
    assert "\n" not in str(info.value)
    assert _tmp_dirs(store) == []


@pytest.mark.parametrize("good", ["a", "chat-1.v2_x", "x" * 100, "2024.01", "_under", "CONTROL", "a.b"])
def test_good_names_are_accepted(store: Store, good: str) -> None:
    _ingest(store, good, n=1)
    assert store.get(good).name == good


# --------------------------------------------------------------------------- integrity


def test_flipped_byte_is_refused(store: Store) -> None:
    ep = _ingest(store, "chat").episodes[0]
    data = bytearray(ep.path.read_bytes())
    data[-3] ^= 0x01
    ep.path.write_bytes(bytes(data))
    with pytest.raises(CacheIntegrityError, match="rebuild") as info:
        store.load_episode(ep, FP)
    msg = error_text(info.value)
    assert "checksum" in msg and "'chat'" in msg and "episode 0" in msg and "--name chat " in msg
    assert msg.endswith("--replace`")  # the stored settings' rebuild command
    assert "\n" not in msg


def test_truncated_file_is_refused(store: Store) -> None:
    ep = _ingest(store, "chat").episodes[1]
    ep.path.write_bytes(ep.path.read_bytes()[:-7])
    with pytest.raises(CacheIntegrityError, match="truncated"):
        store.load_episode(ep, FP)


def test_truncated_file_with_matching_index_is_refused(store: Store) -> None:
    ep = _ingest(store, "chat").episodes[0]
    ep.path.write_bytes(ep.path.read_bytes()[:-7])
    ep = _set_file_record(store, ep, "chat")
    with pytest.raises(CacheIntegrityError, match="not a valid safetensors"):
        store.load_episode(ep, FP)


def test_missing_file_is_refused(store: Store) -> None:
    ep = _ingest(store, "chat").episodes[0]
    ep.path.unlink()
    with pytest.raises(CacheIntegrityError, match="missing.*rebuild"):
        store.load_episode(ep, FP)


def test_file_swapped_with_another_conversation_is_refused(store: Store) -> None:
    mine = _ingest(store, "mine", seed=0).episodes[0]
    theirs = _ingest(store, "theirs", seed=50).episodes[0]
    assert mine.bytes == theirs.bytes  # same shapes: only the checksum can tell
    mine.path.write_bytes(theirs.path.read_bytes())
    with pytest.raises(CacheIntegrityError, match="checksum"):
        store.load_episode(mine, FP)


def test_wrong_fingerprint_is_refused(store: Store) -> None:
    ep = _ingest(store, "chat").episodes[0]
    with pytest.raises(CacheIntegrityError, match="different model.*rebuild"):
        store.load_episode(ep, "fp-model-b")


def test_path_outside_store_is_refused(store: Store, tmp_path: Path) -> None:
    ep = _ingest(store, "chat").episodes[0]
    _edit_episode_row(store, "chat", 0, path="../outside.safetensors")
    (tmp_path / "outside.safetensors").write_bytes(ep.path.read_bytes())
    with pytest.raises(CacheIntegrityError, match="outside the store"):
        store.load_episode(store.get("chat").episodes[0], FP)


def test_huge_claimed_shape_is_refused_without_allocating(store: Store) -> None:
    ep = _ingest(store, "chat").episodes[0]
    header = {
        "__metadata__": {"fingerprint": FP, "format_version": "1"},
        "k.0": {"dtype": "F32", "shape": [10**6, 10**6], "data_offsets": [0, 16]},
    }
    ep.path.write_bytes(_safetensors_bytes(header, b"\0" * 16))
    ep = _set_file_record(store, ep, "chat")
    with pytest.raises(CacheIntegrityError, match="shape.*rebuild"):
        store.load_episode(ep, FP)


def _header(**tensor: object) -> dict:
    info = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
    return {"__metadata__": {"a": "b"}, "t": {**info, **tensor}}


@pytest.mark.parametrize(
    ("blob", "problem"),
    [
        (b"\x01\x02", "too short"),
        (struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}", "limit"),
        (struct.pack("<Q", 1000) + b"{}", "past the end"),
        (struct.pack("<Q", 5) + b"{not}", "not valid JSON"),
        (_safetensors_bytes([1, 2]), "not a JSON object"),  # type: ignore[arg-type]
        (_safetensors_bytes({"__metadata__": {"a": 1}}), "metadata"),
        (_safetensors_bytes(_header(dtype="F99"), b"\0" * 16), "unknown dtype"),
        (_safetensors_bytes(_header(shape=[2, -2]), b"\0" * 16), "invalid shape"),
        (_safetensors_bytes(_header(shape=[True, 2]), b"\0" * 16), "invalid shape"),
        (_safetensors_bytes(_header(data_offsets=[0]), b"\0" * 16), "invalid data offsets"),
        (_safetensors_bytes(_header(data_offsets=[0, 4 * 10**12]), b"\0" * 16), "outside the file"),
        (_safetensors_bytes(_header(shape=[10**12]), b"\0" * 16), "does not match"),
        (_safetensors_bytes(_header(data_offsets=[8, 24]), b"\0" * 24), "gaps"),
        (_safetensors_bytes(_header(), b"\0" * 20), "does not fill"),
    ],
)
def test_malformed_headers_are_refused(blob: bytes, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        check_safetensors_header(blob)


def test_well_formed_header_passes() -> None:
    header = check_safetensors_header(_safetensors_bytes(_header(), b"\0" * 16))
    assert header["t"]["shape"] == [2, 2]


# --------------------------------------------------------------------------- stale files


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temp_dir_of_dead_pid_is_cleaned(store: Store) -> None:
    stale = store.caches_dir / f".tmp-{_dead_pid()}-{uuid.uuid4().hex}"
    stale.mkdir()
    (stale / "0.safetensors").write_bytes(b"half written")
    Store(store.home)
    assert not stale.exists()


def test_live_pid_temp_dir_is_kept(store: Store) -> None:
    live = store.caches_dir / f".tmp-{os.getpid()}-{uuid.uuid4().hex}"
    live.mkdir()
    (live / "0.safetensors").write_bytes(b"in progress")
    Store(store.home)
    assert live.is_dir()


def test_orphan_ingest_dirs_are_cleaned_only_when_old(store: Store) -> None:
    committed = _ingest(store, "chat")
    live_dir = committed.episodes[0].path.parent
    old = time.time() - 3600
    os.utime(live_dir, (old, old))
    orphan_old = store.caches_dir / "chat" / uuid.uuid4().hex
    orphan_young = store.caches_dir / "chat" / uuid.uuid4().hex
    orphan_gone_conv = store.caches_dir / "removed" / uuid.uuid4().hex
    for d in (orphan_old, orphan_young, orphan_gone_conv):
        d.mkdir(parents=True)
        (d / "0.safetensors").write_bytes(b"x")
    for d in (orphan_old, orphan_gone_conv):
        os.utime(d, (old, old))
    empty_name_dir = store.caches_dir / "empty"
    empty_name_dir.mkdir()
    Store(store.home)
    assert not orphan_old.exists() and not orphan_gone_conv.exists()
    assert not (store.caches_dir / "removed").exists() and not empty_name_dir.exists()
    assert orphan_young.is_dir() and live_dir.is_dir()
    assert _tmp_dirs(store) == []
    store.load_episode(store.get("chat").episodes[0], FP)


# --------------------------------------------------------------------------- remove, asks, concurrency


def test_remove_deletes_rows_and_files(store: Store) -> None:
    gone = _ingest(store, "gone")
    kept = _ingest(store, "kept")
    store.remove("gone")
    with pytest.raises(UserError, match="unknown conversation"):
        store.get("gone")
    assert not (store.caches_dir / "gone").exists()
    assert not gone.episodes[0].path.exists()
    assert [c.name for c in store.conversations()] == ["kept"]
    with sqlite3.connect(store.db_path) as conn:
        assert conn.execute("select count(*) from episodes where conversation = 'gone'").fetchone() == (0,)
    store.load_episode(kept.episodes[0], FP)
    assert _tmp_dirs(store) == []


def test_log_ask_round_trip(store: Store) -> None:
    assert store.asks() == []
    store.log_ask({"question": "q1", "answer": "a1", "conversation": "chat", "episode": 0,
                   "similarity": 0.5, "timings": {"retrieve_s": 0.01, "decode_s": 0.2}})  # fmt: skip
    store.log_ask({"question": "q2", "answer": "a2", "conversation": "chat", "episode": 1,
                   "similarity": 0.75})  # fmt: skip
    rows = store.asks()
    assert [r["question"] for r in rows] == ["q2", "q1"]
    assert rows[1]["timings"] == {"retrieve_s": 0.01, "decode_s": 0.2} and rows[0]["timings"] == {}
    assert rows[1]["answer"] == "a1" and rows[1]["episode"] == 0 and rows[1]["similarity"] == 0.5
    assert rows[1]["created_at"].endswith("+00:00")
    assert [r["question"] for r in store.asks(limit=1)] == ["q2"]
    assert store.asks(limit=0) == []
    with pytest.raises(ValueError, match="unknown fields"):
        store.log_ask({"question": "q", "answer": "a", "bogus": 1})


def test_two_stores_on_one_home_write_different_conversations(tmp_path: Path) -> None:
    a, b = Store(tmp_path / "home"), Store(tmp_path / "home")
    pa, pb = a.begin("alpha"), b.begin("beta")
    for i, pending in enumerate((pa, pb)):
        pending.write_episode(
            0, _tensors(i), {"fingerprint": FP}, centroid=centroid(1.0), medoid_text="m", budgets=[4], n_tokens=8
        )
    ra = pa.commit(model="default", fingerprint=FP, settings={}, stats={})
    rb = pb.commit(model="default", fingerprint=FP, settings={}, stats={})
    for s in (a, b):
        assert sorted(c.name for c in s.conversations()) == ["alpha", "beta"]
        assert torch.equal(s.load_episode(s.get("alpha").episodes[0], FP)[0]["k.0"], _tensors(0)["k.0"])
        assert torch.equal(s.load_episode(s.get("beta").episodes[0], FP)[0]["k.0"], _tensors(1)["k.0"])
    assert ra.name == "alpha" and rb.name == "beta"


def test_concurrent_processes(tmp_path: Path) -> None:
    home = tmp_path / "home"  # created by the racing processes themselves
    script = textwrap.dedent(
        """
        import sys, torch
        from pathlib import Path
        from kvchat.store import Store
        store = Store(Path(sys.argv[1]))
        for round in range(3):
            with store.begin(sys.argv[2], replace=True) as p:
                for i in range(2):
                    p.write_episode(i, {"k.0": torch.full((2, 3), float(round))}, {"fingerprint": "fp"},
                                    centroid=[0.0], medoid_text="m", budgets=[3], n_tokens=6)
                p.commit(model="default", fingerprint="fp", settings={}, stats={})
            store.log_ask({"question": sys.argv[2], "answer": str(round)})
        """
    )
    procs = [subprocess.Popen([sys.executable, "-c", script, str(home), f"p{i}"]) for i in range(3)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    store = Store(home)
    assert sorted(c.name for c in store.conversations()) == ["p0", "p1", "p2"]
    for conv in store.conversations():
        assert len(list((store.caches_dir / conv.name).iterdir())) == 1
        for ep in conv.episodes:
            tensors, _ = store.load_episode(ep, "fp")
            assert torch.equal(tensors["k.0"], torch.full((2, 3), 2.0))
    assert len(store.asks(limit=100)) == 9
    assert _tmp_dirs(store) == []


# --------------------------------------------------------------------------- disk full


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_disk_full_while_writing_aborts_with_one_line(store: Store, monkeypatch, code: int) -> None:
    _ingest(store, "before")
    real_write, calls = store_module._write_file, []

    def fills_up(path: Path, data: bytes) -> None:
        calls.append(path)
        if len(calls) == 1:
            return real_write(path, data)
        path.write_bytes(data[: len(data) // 2])  # a full disk leaves a partial file behind
        raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr(store_module, "_write_file", fills_up)
    with pytest.raises(UserError) as info, store.begin("chat") as pending:
        for i in range(2):
            pending.write_episode(
                i, _tensors(i), {"fingerprint": FP}, centroid=centroid(1.0), medoid_text="m", budgets=[4], n_tokens=8
            )
    assert error_text(info.value) == (
        f"no space left on device while writing caches to {store.caches_dir}: free space or lower --budget"
    )
    assert [c.name for c in store.conversations()] == ["before"]
    assert _tmp_dirs(store) == [] and not (store.caches_dir / "chat").exists()


def test_other_write_errors_are_not_disguised(store: Store, monkeypatch) -> None:
    def broken(path: Path, data: bytes) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(store_module, "_write_file", broken)
    with pytest.raises(OSError, match="Input/output") as info, store.begin("chat") as pending:
        pending.write_episode(0, _tensors(), {"fingerprint": FP}, centroid=centroid(1.0), medoid_text="m", budgets=[4],
                              n_tokens=8)  # fmt: skip
    assert not isinstance(info.value, UserError)
    assert _tmp_dirs(store) == [] and store.conversations() == []


# --------------------------------------------------------------------------- doctor


def test_check_finds_nothing_wrong_in_a_healthy_store(store: Store) -> None:
    _ingest(store, "chat")
    live = store.caches_dir / f".tmp-{os.getpid()}-{uuid.uuid4().hex}"  # an ingest in progress
    live.mkdir()
    assert store.check() == [] and store.fix([]) == []
    assert live.is_dir()


def test_check_and_fix_every_kind_of_damage(store: Store) -> None:
    healthy = _ingest(store, "healthy")
    _ingest(store, "donor", seed=50)
    flipped = _ingest(store, "flipped").episodes[1]
    data = bytearray(flipped.path.read_bytes())
    data[-3] ^= 0x01
    flipped.path.write_bytes(bytes(data))
    truncated = _ingest(store, "truncated").episodes[0]
    truncated.path.write_bytes(truncated.path.read_bytes()[:-7])
    _ingest(store, "missing").episodes[0].path.unlink()
    swapped = _ingest(store, "swapped").episodes[0]
    swapped.path.write_bytes(store.get("donor").episodes[0].path.read_bytes())  # same size, other content
    orphan = store.caches_dir / "gone" / uuid.uuid4().hex
    orphan.mkdir(parents=True)
    (orphan / "0.safetensors").write_bytes(b"x")
    old = time.time() - 3600  # a young one may be an ingest committing now: doctor takes no lock to know
    os.utime(orphan, (old, old))
    stray = store.caches_dir / "notes.txt"
    stray.write_text("x")
    extra = healthy.episodes[0].path.parent / "7.safetensors"
    extra.write_bytes(b"x")
    stale = store.caches_dir / f".tmp-{_dead_pid()}-{uuid.uuid4().hex}"
    stale.mkdir()
    (stale / "0.safetensors").write_bytes(b"half written")

    doctor = Store(store.home, clean_stale=False)
    problems = doctor.check()
    assert {(p.kind, p.conversation, p.episode) for p in problems if p.conversation} == {
        ("checksum", "flipped", 1), ("size", "truncated", 0), ("missing", "missing", 0), ("checksum", "swapped", 0),
    }  # fmt: skip
    assert {(p.kind, p.path) for p in problems if p.conversation is None} == {
        ("orphan", orphan), ("stray", stray), ("stray", extra), ("stale-temp", stale),
    }  # fmt: skip
    assert all("\n" not in p.message and "--fix" in spell(p.message) for p in problems)

    done = doctor.fix(problems)
    removed = [line for line in done if line.startswith("removed conversation")]
    assert len(removed) == 4 and "re-ingest it with `kvchat ingest HISTORY --name flipped --method epicache" in (
        spell(" ".join(removed))
    )
    assert doctor.check() == []
    assert sorted(c.name for c in doctor.conversations()) == ["donor", "healthy"]
    for name in ("flipped", "truncated", "missing", "swapped", "gone"):
        assert not (store.caches_dir / name).exists()
    assert not stray.exists() and not extra.exists() and not stale.exists() and _tmp_dirs(store) == []
    for episode in doctor.get("healthy").episodes:
        doctor.load_episode(episode, FP)


def test_fix_leaves_a_conversation_replaced_since_the_check_alone(store: Store) -> None:
    _ingest(store, "chat").episodes[0].path.unlink()
    problems = store.check()
    assert [p.kind for p in problems] == ["missing"]
    fresh = _ingest(store, "chat", replace=True, seed=5)
    assert store.fix(problems) == []
    assert store.get("chat") == fresh and store.check() == []
    assert store.remove("chat", ingest_id="not-this-one") is False and store.get("chat") == fresh


def test_doctor_command(tmp_path: Path) -> None:
    home = tmp_path / "home"
    store = Store(home)
    _ingest(store, "chat")
    _ingest(store, "broken").episodes[0].path.unlink()
    assert "Exit status: 0 when the store is healthy" in run_main(home, "doctor", "--help").stdout
    found = run_main(home, "doctor", "--json")
    report = json.loads(found.stdout)
    assert found.returncode == 1 and not report["healthy"] and report["fixed"] == []
    assert [(p["kind"], p["conversation"], p["episode"]) for p in report["problems"]] == [("missing", "broken", 0)]
    fixed = run_main(home, "doctor", "--fix")
    assert fixed.returncode == 0, fixed.stderr
    assert "removed conversation 'broken'" in fixed.stdout and fixed.stdout.strip().endswith("healthy now")
    again = run_main(home, "doctor")
    assert (again.returncode, again.stdout) == (0, "healthy\n")
    assert [c.name for c in Store(home).conversations()] == ["chat"]


@pytest.mark.parametrize("settings", [
    {"method": "epicache", "budget": 256, "block_size": 128, "positions": "compact", "layer_budgets": "sensitivity",
     "alpha": 1.3, "head_budgets": "adaptive", "episodes": 3, "window": 2, "pool_kernel": 7},
    {"method": "cake", "budget": 512, "block_size": 256, "positions": "original", "layer_budgets": "cake",
     "tau1": 0.5, "tau2": 2.0, "cake_window": 32, "head_budgets": "uniform", "episodes": 4, "window": 4},
    {"method": "full", "budget": 1024, "block_size": 512, "positions": "original", "layer_budgets": "full",
     "head_budgets": "uniform", "episodes": 4, "window": 4},
])  # fmt: skip
def test_rebuild_command_carries_every_setting(settings: dict) -> None:
    """The command `doctor --fix` prints parses, through the real CLI, back into the settings stored."""
    import shlex

    import typer.main

    from kvchat.cli import app
    from kvchat.cli.setting_options import PARAMETERS, config_from
    from kvchat.settings import from_settings

    record = ConversationRecord("chat", "", "/models/m", FP, {**settings, "source": "/h/chat.json"}, {}, [])
    words = shlex.split(spell(store_module._reingest_command(record)))
    ingest = typer.main.get_command(app).commands["ingest"]
    params = ingest.make_context("ingest", words[2:], resilient_parsing=True).params
    assert params["history"] == Path("/h/chat.json") and (params["name"], params["model"]) == ("chat", "/models/m")
    given = config_from(**{p.name: params[p.name] for p in PARAMETERS})
    assert given == from_settings(settings, "/models/m")
