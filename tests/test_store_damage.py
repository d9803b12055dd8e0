"""A store in a bad way (issue 16, store side): a damaged, unopenable or read-only kvchat.db, a writer holding
the lock, a FIFO in an episode file's place, a killed model conversion. Each is one line and exit 2 where a
command cannot go on, `kvchat doctor` says what it sees, and `doctor --fix` repairs what it can and says
exactly what is lost."""

from __future__ import annotations

import json
import os
import shlex
import sqlite3
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from cli_helpers import run_main
from conftest import raises_said
from test_store import FP, _dead_pid, _ingest

from kvchat import store as store_module
from kvchat.cli.words import spell
from kvchat.errors import CacheIntegrityError, UserError
from kvchat.history.synthetic import planted_conversation
from kvchat.store import DamagedDatabase, Store, diagnose, repair
from kvchat.store.manifest import MANIFEST_NAME

ASKS = 3


def _home(tmp_path: Path) -> Path:
    """Two conversations ("alpha" with centroids unique in the file, "beta") and a few logged asks, closed
    so that everything is in kvchat.db itself (no WAL)."""
    home = tmp_path / "home"
    store = Store(home)
    _ingest(store, "alpha", offset=0.5123)
    _ingest(store, "beta", n=3, seed=10)
    for i in range(ASKS):
        store.log_ask({"conversation": "alpha", "episode": 0, "question": f"q{i}", "answer": f"a{i}"})
    store.close()
    assert not Path(f"{store.db_path}-wal").exists()
    return home


def _records(home: Path) -> dict:
    store = Store(home)
    try:
        return {c.name: c for c in store.conversations()}
    finally:
        store.close()


def _one_line_error(result, *fragments: str) -> str:
    assert result.returncode == 2, (result.stdout, result.stderr)
    line = result.stderr.strip()
    assert "\n" not in line and "Traceback" not in result.stderr and result.stdout == "", result.stderr
    assert all(f in line for f in fragments), line
    return line


def _flip_in_db(db_path: Path, needle: bytes, at: int, value: int) -> None:
    data = bytearray(db_path.read_bytes())
    assert data.count(needle) == 1
    data[data.index(needle) + at] = value
    db_path.write_bytes(bytes(data))


def _truncate(db: Path) -> None:
    db.write_bytes(db.read_bytes()[: db.stat().st_size // 2])


def _random(db: Path) -> None:
    db.write_bytes(os.urandom(db.stat().st_size))


def _directory(db: Path) -> None:
    db.unlink()
    db.mkdir()
    (db / "x").write_text("not a database")


def _digit_in_centroid(db: Path) -> None:  # still valid JSON: only the rows' digest can tell
    _flip_in_db(db, b"0.7623", 2, ord("8"))


def _not_utf8_in_centroid(db: Path) -> None:
    _flip_in_db(db, b"0.7623", 2, 0xFF)


# (damage, what commands say, asks kept: None where it depends on which pages a truncation cut)
DAMAGE = [
    (_truncate, "malformed", None),
    (_random, "not a database", 0),
    (_directory, "not a database file", 0),
    (_digit_in_centroid, "conversation 'alpha': its rows fail their checksum", ASKS),
    (_not_utf8_in_centroid, "column 'centroid' holds text that is not UTF-8", ASKS),
]


@pytest.mark.parametrize("damage, what, asks_kept", DAMAGE, ids=[d[0].__name__.strip("_") for d in DAMAGE])
def test_a_damaged_database_is_refused_diagnosed_and_rebuilt(tmp_path, damage, what, asks_kept):
    home = _home(tmp_path)
    before = _records(home)
    db = home / "kvchat.db"
    damage(db)
    damaged_bytes = db.read_bytes() if db.is_file() else None

    commands = [("list",), ("show", "alpha"), ("ask", "hello?", "--conversation", "alpha", "--no-log")]
    if asks_kept != ASKS:  # the whole file is damaged, not one conversation's rows
        commands += [("show", "beta"), ("logs",), ("ask", "hello?", "--no-log")]
    for command in commands:
        _one_line_error(run_main(home, *command), str(db), what, "kvchat doctor --fix")

    report = run_main(home, "doctor", "--json")
    assert report.returncode == 1, report.stderr
    problems = json.loads(report.stdout)["problems"]
    assert [p["kind"] for p in problems] == ["database"]
    assert what in problems[0]["message"] and "'alpha' (from its" in problems[0]["message"]
    assert "'beta' (from its" in problems[0]["message"]

    fixed = run_main(home, "doctor", "--fix")
    assert fixed.returncode == 0, (fixed.stdout, fixed.stderr)
    lines = fixed.stdout.strip().splitlines()
    assert lines[0].startswith("problem: ") and lines[-1] == "healthy now"
    lines = [line for line in lines if line.startswith("fixed: ")]
    assert lines[0].startswith(f"fixed: moved the damaged {db} (") and what in lines[0] and "(kept)" in lines[0]
    restored = [line for line in lines if line.startswith("fixed: restored conversation")]
    assert len(restored) == 2 and "fixed: restored conversation 'beta' (3 episodes) from its " in restored[1]
    if asks_kept == ASKS:  # the database still reads: alpha's damaged rows give way to its manifest
        assert restored == ["fixed: restored conversation 'alpha' (2 episodes) from its manifest",
                            "fixed: restored conversation 'beta' (3 episodes) from its rows in the damaged database"]
    if asks_kept:
        assert f"fixed: {asks_kept} logged questions of the ask log kept\n" in fixed.stdout
    elif asks_kept == 0:
        assert "fixed: the ask log could not be read: it is lost" in fixed.stdout

    assert _records(home) == before  # centroids, medoid texts, settings, stats: all as they were
    asides = list(home.glob("damaged-*/kvchat.db"))
    assert len(asides) == 1 and (asides[0].read_bytes() == damaged_bytes if damaged_bytes else asides[0].is_dir())
    if asks_kept is not None:
        assert len(json.loads(run_main(home, "logs", "--json").stdout)["asks"]) == asks_kept
    store = Store(home)
    for record in before.values():
        for episode in record.episodes:
            store.load_episode(episode, FP)
    assert (run_main(home, "doctor").stdout, diagnose(home)) == ("healthy\n", [])


def test_a_conversation_without_rows_or_manifest_is_kept_aside_with_its_rebuild_command(tmp_path):
    """An ingest from before manifests whose rows are lost: its episode files alone cannot answer (no
    centroids, medoid texts, model or system prompt), so it is re-ingested, never guessed at."""
    home = _home(tmp_path)
    before = _records(home)
    alpha_dir = before["alpha"].episodes[0].path.parent
    alpha_bytes = before["alpha"].episodes[0].path.read_bytes()
    (alpha_dir / MANIFEST_NAME).unlink()
    (before["beta"].episodes[0].path.parent / MANIFEST_NAME).unlink()
    _digit_in_centroid(home / "kvchat.db")  # alpha's rows fail their digest; its conversation row still reads

    problems = diagnose(home)
    assert [p.kind for p in problems] == ["database", "lost"]
    lost = problems[1]
    assert lost.conversation == "alpha" and lost.path == alpha_dir
    assert "no row of it survives, and it has no manifest" in lost.message
    command = spell(lost.message).split("re-ingest it with `")[1].rstrip("`")
    assert shlex.split(command)[:5] == ["kvchat", "ingest", "HISTORY", "--name", "alpha"]
    assert "--budget 64" in command and "--method epicache" in command  # the settings its row still had

    done = repair(home, problems)
    assert "restored conversation 'beta' (3 episodes) from its rows in the damaged database" in done
    line = next(d for d in done if d.startswith("conversation 'alpha' (2 episode files) cannot be rebuilt"))
    assert command in spell(line)
    assert set(_records(home)) == {"beta"} and not alpha_dir.exists()
    kept = list(home.glob(f"damaged-*/caches/alpha/{alpha_dir.name}/0.safetensors"))
    assert len(kept) == 1 and kept[0].read_bytes() == alpha_bytes
    assert diagnose(home) == []


def test_a_row_changed_behind_the_stores_back_is_damage(tmp_path):
    home = _home(tmp_path)
    with sqlite3.connect(home / "kvchat.db") as conn:
        conn.execute("update episodes set medoid_text = 'edited' where conversation = 'beta' and idx = 1")
    _one_line_error(run_main(home, "show", "beta"), "conversation 'beta': its rows fail their checksum")
    assert run_main(home, "show", "alpha").returncode == 0  # the others still read
    with pytest.raises(DamagedDatabase):
        Store(home).conversations()


def test_an_ingest_dir_a_damaged_row_no_longer_names_is_not_swept(tmp_path):
    home = _home(tmp_path)
    alpha_dir = _records(home)["alpha"].episodes[0].path.parent
    os.utime(alpha_dir, (0, 0))  # as old as any orphan the startup sweep deletes
    with sqlite3.connect(home / "kvchat.db") as conn:
        conn.execute("update conversations set ingest_id = 'garbled' where name = 'alpha'")
    Store(home).close()
    assert alpha_dir.is_dir()
    assert [p.kind for p in diagnose(home)] == ["database"]
    assert "restored conversation 'alpha' (2 episodes) from its manifest" in repair(home, diagnose(home))
    assert Store(home).get("alpha").episodes[0].path.parent == alpha_dir


def test_a_database_from_before_digests_is_upgraded_in_place(tmp_path):
    home = _home(tmp_path)
    before = _records(home)
    with sqlite3.connect(home / "kvchat.db") as conn:  # schema 1: what kvchat wrote before this version
        conn.execute("alter table conversations drop column digest")
        conn.execute("delete from migrations where version = 2")
    assert _records(home) == before
    assert diagnose(home) == []


# --------------------------------------------------------------------------- the write lock


@contextmanager
def _writer_holding_the_lock(home: Path) -> Iterator[None]:
    """Another process's write transaction, as an ingest's commit holds it: BEGIN IMMEDIATE has returned."""
    conn = sqlite3.connect(home / "kvchat.db", isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    finally:
        conn.execute("ROLLBACK")
        conn.close()


def test_reading_commands_do_not_wait_for_a_writer(tmp_path, monkeypatch):
    home = _home(tmp_path)
    orphan = home / "caches" / "gone" / uuid.uuid4().hex  # an open would sweep it, under the lock
    orphan.mkdir(parents=True)
    os.utime(orphan, (0, 0))
    monkeypatch.setattr(store_module, "BUSY_TIMEOUT_MS", 300)  # were the lock taken, this fails at once
    with _writer_holding_the_lock(home):
        listed = run_main(home, "list", "--json")
        assert listed.returncode == 0, listed.stderr
        assert [c["name"] for c in json.loads(listed.stdout)["conversations"]] == ["beta", "alpha"]
        assert run_main(home, "show", "alpha").returncode == 0
        assert len(json.loads(run_main(home, "logs", "--json").stdout)["asks"]) == ASKS
        doctor = run_main(home, "doctor", "--json")
        assert [p["kind"] for p in json.loads(doctor.stdout)["problems"]] == ["orphan"], doctor.stderr
        assert orphan.is_dir()  # the sweep waits for an open that finds the lock free
        _one_line_error(run_main(home, "rm", "beta"), "stayed locked by another kvchat process")
    Store(home)
    assert not orphan.exists()


def test_a_pending_migration_still_waits_for_the_lock(tmp_path, monkeypatch):
    home = _home(tmp_path)
    with sqlite3.connect(home / "kvchat.db") as conn:
        conn.execute("alter table conversations drop column digest")
        conn.execute("delete from migrations where version = 2")
    monkeypatch.setattr(store_module, "BUSY_TIMEOUT_MS", 300)
    with _writer_holding_the_lock(home):
        _one_line_error(run_main(home, "list"), "stayed locked by another kvchat process")
    assert run_main(home, "list").returncode == 0


# --------------------------------------------------------------------------- a read-only home


@pytest.fixture
def tiny_home(tmp_path: Path, tiny_model_dir: Path) -> Path:
    """A home with one conversation "h" ingested with the tiny model, and one logged ask."""
    history = tmp_path / "h.json"
    history.write_text(json.dumps(planted_conversation(seed=2, topics=2, turns_per_topic=8)[0]))
    home = tmp_path / "home"
    ingested = run_main(home, "ingest", str(history), "--model", str(tiny_model_dir), "--budget", "64",
                        "--setting", "block_size=32", "--episodes", "2")  # fmt: skip
    assert ingested.returncode == 0, ingested.stderr
    asked = run_main(home, "ask", "Which gate?")
    assert asked.returncode == 0, asked.stderr
    return home


def test_a_read_only_home_can_be_listed_and_asked(tiny_home, read_only):
    home = read_only(tiny_home)
    assert Store(home).read_only
    listed = run_main(home, "list", "--json")
    assert listed.returncode == 0 and [c["name"] for c in json.loads(listed.stdout)["conversations"]] == ["h"]
    assert run_main(home, "show", "h").returncode == 0
    assert len(json.loads(run_main(home, "logs", "--json").stdout)["asks"]) == 1
    asked = run_main(home, "ask", "--conversation", "h", stdin="Which gate?\nWhich gate again?\n")
    assert asked.returncode == 0 and asked.stdout.strip(), asked.stderr
    notes = [line for line in asked.stderr.splitlines() if "read-only" in line]
    assert len(notes) == 1 and "questions are not logged" in notes[0], asked.stderr  # once, not per question
    unlogged = run_main(home, "ask", "Which gate?", "--no-log")
    assert unlogged.returncode == 0 and "read-only" not in unlogged.stderr  # nothing was to be logged
    assert (run_main(home, "doctor").returncode, run_main(home, "doctor").stdout) == (0, "healthy\n")
    _one_line_error(run_main(home, "rm", "h"), "is read-only", "not ingested, removed")
    _one_line_error(run_main(home, "ingest", str(tiny_home.parent / "h.json"), "--name", "other"), "is read-only")
    assert len(Store(tiny_home).asks()) == 1  # nothing was logged


def test_a_damaged_read_only_home_is_diagnosed_not_repaired(tmp_path, read_only):
    home = _home(tmp_path)
    _digit_in_centroid(home / "kvchat.db")
    view = read_only(home)
    problems = diagnose(view)
    assert [p.kind for p in problems] == ["database"]
    _one_line_error(run_main(view, "doctor", "--fix"), "is read-only", "cannot be rebuilt there")


# --------------------------------------------------------------------------- a FIFO in a file's place


@contextmanager
def _released_readers(fifo: Path, tmp_path: Path) -> Iterator[None]:
    """Keep opening `fifo` for writing: a reader that blocks opening it (the bug) is let through and reads
    nothing, so a regression shows as a wrong answer, not a hung test."""
    handle = tmp_path / f"fifo-{uuid.uuid4().hex}"
    os.link(fifo, handle)  # still there after --fix deletes the conversation
    stop = threading.Event()

    def feed() -> None:
        while not stop.is_set():
            with open(handle, "wb"):
                pass

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    try:
        yield
    finally:
        stop.set()
        reader = os.open(handle, os.O_RDONLY | os.O_NONBLOCK)  # lets the writer's pending open return
        writer.join()
        os.close(reader)


def _fifo_in_place_of(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def test_a_fifo_in_place_of_an_episode_file_is_refused_not_read(tmp_path):
    home = _home(tmp_path)
    store = Store(home)
    episode = store.get("beta").episodes[1]
    _fifo_in_place_of(episode.path)
    with _released_readers(episode.path, tmp_path):
        with raises_said(CacheIntegrityError, "is not a regular file but a FIFO.*rebuild with `kvchat ingest"):
            store.load_episode(episode, FP)
        problems = store.check()
        assert [(p.kind, p.conversation, p.episode) for p in problems] == [("not-a-file", "beta", 1)]
        fixed = run_main(home, "doctor", "--fix")
    assert fixed.returncode == 0 and "fixed: removed conversation 'beta'" in fixed.stdout, fixed.stderr
    assert set(_records(home)) == {"alpha"}


def test_ask_refuses_a_fifo_with_the_rebuild_command(tiny_home, tmp_path):
    path = Store(tiny_home).get("h").episodes[0].path
    _fifo_in_place_of(path)
    with _released_readers(path, tmp_path):
        asked = run_main(tiny_home, "ask", "Which gate?", "--conversation", "h", "--episode", "0")
    _one_line_error(asked, "is not a regular file but a FIFO", "rebuild with `kvchat ingest ")


# --------------------------------------------------------------------------- held weights no process reads


def test_held_weights_no_process_will_read_are_found_and_removed(tmp_path):
    from torch import nn

    from kvchat.model.held_weights import keep, path_for
    from kvchat.store.layout import held_name, held_source

    home = _home(tmp_path)
    models = home / "models"
    sources = {name: models / name / "model.safetensors" for name in ("kept", "changed", "gone")}
    for source in sources.values():
        source.parent.mkdir(parents=True)
        source.write_bytes(b"float weights")
    current = path_for(models, "a" * 16, "int4")  # what this torch would read: made from the file as it is
    changed, gone = path_for(models, "b" * 16, "int4"), path_for(models, "c" * 16, "auto")
    other_torch = models / "held" / held_name("d" * 16, "int8", "0.1+cpu-AVX2")
    for path, source in ((current, "kept"), (changed, "changed"), (gone, "gone"), (other_torch, "kept")):
        keep(nn.Module(), path, held_source(sources[source]), "float")
    garbage = models / "held" / held_name("e" * 16, "int4", "0.1+cpu-AVX2")
    garbage.write_bytes(b"not a safetensors file")
    sources["changed"].write_bytes(b"float weights, converted again")
    sources["gone"].unlink()

    import torch

    from kvchat.store.leftovers import _torch_version

    assert _torch_version() == torch.__version__  # what held files are named by, its local part ("+cu130") too
    problems = diagnose(home)
    assert sorted((p.kind, p.path) for p in problems) == sorted(
        ("stale-held", path) for path in (changed, gone, other_torch, garbage))
    why = {p.path: p.message for p in problems}
    assert "an earlier version of" in why[changed] and "which is gone" in why[gone]
    assert "another torch" in why[other_torch] and "cannot be read" in why[garbage]
    fixed = run_main(home, "doctor", "--fix")
    assert fixed.returncode == 0 and f"deleted stale-held {gone}" in fixed.stdout, fixed.stdout
    assert sorted((models / "held").iterdir()) == [current]


# --------------------------------------------------------------------------- a killed model conversion


def test_a_dead_model_conversions_temp_dir_is_found_and_removed(tmp_path):
    home = _home(tmp_path)
    dead = home / "models" / f".tmp-{_dead_pid()}-{uuid.uuid4().hex}"
    live = home / "models" / f".tmp-{os.getpid()}-{uuid.uuid4().hex}"
    for d in (dead, live):
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"\0" * 1024)
    problems = diagnose(home)
    assert [(p.kind, p.path) for p in problems] == [("stale-temp", dead)]
    assert "model conversion that died" in problems[0].message
    fixed = run_main(home, "doctor", "--fix")
    assert fixed.returncode == 0 and f"deleted stale-temp {dead}" in fixed.stdout, fixed.stdout
    assert not dead.exists() and live.is_dir()

    dead.mkdir()
    Store(home)  # every start sweeps them too
    assert not dead.exists() and live.is_dir()


def test_a_store_that_cannot_be_created_is_one_line(tmp_path, read_only):
    (tmp_path / "parent").mkdir()
    parent = read_only(tmp_path / "parent")
    with pytest.raises(UserError, match="cannot create kvchat home"):
        Store(parent / "home")


def test_a_read_only_home_cannot_take_a_model_conversion(tmp_path, read_only):
    view = read_only(_home(tmp_path))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    _one_line_error(run_main(view, "profile-layers", "--model", str(gguf)), f"cannot convert {gguf} into {view}")
