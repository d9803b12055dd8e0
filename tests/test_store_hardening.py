"""The store's last rough edges (issue 46): a temp dir whose writer's pid was reused, names that differ in case
only, a read-only home without kvchat.db, two `doctor --fix` at once, and a repair that needs one run."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from cli_helpers import KVCHAT, cli_env, run_main
from test_data_loss import _age, _closed
from test_store import FP, _ingest, _tmp_dirs
from test_store_damage import _digit_in_centroid, _home

from kvchat.errors import UserError
from kvchat.store import Store, diagnose
from kvchat.store.files import new_temp_path, process_start
from kvchat.store.recovery import REBUILD_LOCK

WAIT_S = 120


def test_a_temp_dir_whose_writers_pid_was_reused_is_swept(tmp_path):
    """The name carries the writer's start time: a live process of that pid started at another time did not
    write it. Names of older kvchat (the pid alone) are still judged by the pid."""
    store = Store(tmp_path / "home")
    mine = new_temp_path(store.caches_dir)
    start = process_start(os.getpid())
    if start is None:
        pytest.skip("no /proc here: the start time is unknown")
    assert mine.name.startswith(f".tmp-{os.getpid()}-s{start}-")
    reused = store.caches_dir / f".tmp-{os.getpid()}-s{start + 1}-{uuid.uuid4().hex}"  # the pid, another process
    older = store.caches_dir / f".tmp-{os.getpid()}-{uuid.uuid4().hex}"  # kvchat before the start time: kept
    for path in (mine, reused, older):
        path.mkdir()
    problems = diagnose(store.home)
    assert [(p.kind, p.path) for p in problems] == [("stale-temp", reused)]
    Store(store.home)  # every open sweeps them
    assert sorted(_tmp_dirs(store)) == sorted([mine.name, older.name])


def test_names_that_differ_in_case_only_are_one_name(tmp_path):
    store = Store(tmp_path / "home")
    _ingest(store, "base")
    for twin in ("Base", "BASE"):
        with pytest.raises(UserError, match="differs from it in case only"):
            _ingest(store, twin)
    assert [c.name for c in store.conversations()] == ["base"]
    _ingest(store, "base", replace=True)  # the name itself stays the user's to replace


def test_a_pair_stored_before_the_check_keeps_working(tmp_path):
    """A store that holds `base` and `Base` (made before kvchat compared names without case): both are listed and
    read, and each is replaced and removed by its exact name."""
    home, other = tmp_path / "home", tmp_path / "other"
    store = Store(home)
    first = _ingest(store, "base", seed=1)
    second = _ingest(Store(other), "Base", seed=2)
    os.rename(second.episodes[0].path.parent.parent, home / "caches" / "Base")  # its dir, manifest and all
    _age(home / "caches" / "Base" / second.ingest_id)
    store = Store(home)  # lists it again from its manifest
    assert sorted(c.name for c in store.conversations()) == ["Base", "base"]
    for record in (store.get("base"), store.get("Base")):
        store.load_episode(record.episodes[0], FP)
    assert store.get("base").ingest_id == first.ingest_id
    _ingest(store, "Base", replace=True, seed=3)
    assert store.remove("base") and [c.name for c in store.conversations()] == ["Base"]


def test_a_read_only_home_without_its_database_is_listed_from_the_manifests(tmp_path, read_only):
    home = tmp_path / "home"
    store = Store(home)
    _ingest(store, "alpha", seed=1)
    _ingest(store, "beta", seed=2)
    _closed(store).unlink()
    view = read_only(home)
    opened = Store(view)
    assert opened.read_only and sorted(c.name for c in opened.conversations()) == ["alpha", "beta"]
    opened.load_episode(opened.get("alpha").episodes[0], FP)
    listed = run_main(view, "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert sorted(c["name"] for c in json.loads(listed.stdout)["conversations"]) == ["alpha", "beta"]
    assert not (home / "kvchat.db").exists()  # nothing was written


def test_doctor_fix_repairs_a_missing_database_and_a_truncated_cache_in_one_run(tmp_path):
    home = tmp_path / "home"
    store = Store(home)
    kept, damaged = _ingest(store, "kept", seed=1), _ingest(store, "damaged", seed=2)
    _closed(store).unlink()
    for record in (kept, damaged):
        _age(record.episodes[0].path.parent)
    path = damaged.episodes[0].path
    path.write_bytes(path.read_bytes()[:-10])
    fixed = run_main(home, "doctor", "--fix")
    assert fixed.returncode == 0 and "healthy now" in fixed.stdout, fixed.stdout
    assert diagnose(home) == []
    assert [c.name for c in Store(home).conversations()] == ["kept"]


def _locked(path: Path) -> bool:
    """Whether another process holds the advisory lock on `path` (observed, not waited for)."""
    if not path.exists():
        return False
    with open(path, "a") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        return False


def test_two_doctor_fix_at_once_on_a_damaged_database(tmp_path):
    """The first is held in its rebuild (a test hook), holding the rebuild lock; the second starts meanwhile and
    waits for it, then finds the database rebuilt. Both end without an internal error, one rebuild happened."""
    home = _home(tmp_path)
    _digit_in_centroid(home / "kvchat.db")
    barrier = tmp_path / "go-on"
    first = subprocess.Popen([*KVCHAT, "doctor", "--fix"], env={**cli_env(home), "KVCHAT_HOLD_AT":
                             f"rebuild-planned:{barrier}"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + WAIT_S
        while not _locked(home / REBUILD_LOCK):  # observed: the first holds the lock, mid-rebuild
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.05)
        second = subprocess.Popen([*KVCHAT, "doctor", "--fix"], env=cli_env(home), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        barrier.touch()
        outputs = [process.communicate(timeout=WAIT_S) for process in (first, second)]
    finally:
        barrier.touch()
        if first.poll() is None:
            first.kill()
    for process, (stdout, stderr) in zip((first, second), outputs, strict=True):
        assert process.returncode == 0, (stdout, stderr)
        assert "internal error" not in stderr and "Traceback" not in stderr
    assert len(list(home.glob("damaged-*"))) == 1
    assert diagnose(home) == [] and sorted(c.name for c in Store(home).conversations()) == ["alpha", "beta"]
