"""Crash-point tests in the manner of SQLite's (issue 29): each store operation (a new conversation's commit,
a `--replace`, an append's compare-and-swap commit, an `rm`, a `doctor --fix`) runs once to count its writes,
fsyncs, renames and commits (`kvchat.store.files.crash_point`), then once per point N, dying at the N-th
(os._exit: no clean-up, no finally). After each death the store must hold exactly the old or the new version
of what the operation changed, every episode must load, and `doctor` must find nothing the operation left.

The operation runs in a forked child of this process (torch is already imported, so a point costs
milliseconds); tensors are made before the fork. Ingest and append go through the same `PendingConversation`
commit, so their file-level points are these; the model's forward pass writes nothing to the store.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import centroid
from test_store import FP, SETTINGS, STATS, _tensors
from test_store_recall_entries import _writer

from kvchat.store import Store, diagnose, repair
from kvchat.store.files import CRASH_AT, CRASH_EXIT, CRASH_LOG

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="forks a child per crash point")

AN_HOUR_AGO = time.time() - 3600
TENSORS = [_tensors(seed) for seed in range(3)]


def _commit(store: Store, name: str, *, replace: bool = False, expect: str | None = None, seed: int = 0):
    with store.begin(name, replace=replace, expect=expect) as pending:
        for i in range(2):
            pending.write_episode(i, TENSORS[(seed + i) % 3], {"fingerprint": FP, "method": "epicache"},
                                  centroid=centroid(0.25 * i, -1.0, 3.0), medoid_text=f"episode {i}", budgets=[8, 12],
                                  n_tokens=20)  # fmt: skip
        return pending.commit(model="default", fingerprint=FP, settings=SETTINGS, stats=STATS)


def _commit_with_entries(store: Store, name: str, *, replace: bool = False, expect: str | None = None):
    """`_commit` with a recall entries file."""
    with store.begin(name, replace=replace, expect=expect) as pending:
        for i in range(2):
            pending.write_episode(i, TENSORS[i], {"fingerprint": FP, "method": "recall"}, centroid=centroid(0.25 * i),
                                  medoid_text=f"episode {i}", budgets=[8, 12], n_tokens=20)  # fmt: skip
        pending.write_recall_entries(_writer())
        return pending.commit(model="default", fingerprint=FP, settings=SETTINGS, stats=STATS)


def _run(action: Callable[[Path], None], home: Path, env: dict[str, str]) -> int:
    """`action(home)` in a forked child with `env` added; its exit status (0: it finished)."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            os.environ.update(env)
            action(home)
        except BaseException:  # noqa: BLE001 - reported by the exit status
            code = 1
        os._exit(code)
    deadline = time.monotonic() + 120  # a hang guard only
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the operation hung")
        time.sleep(0.01)


def _state(home: Path, damaged: frozenset[str] = frozenset()) -> dict[str, str]:
    """Each conversation's ingest id, every episode (and recall entries file) loaded and verified, after any time a
    crash's leftovers wait."""
    for path in (home / "caches").rglob("*"):  # as much later as the leftovers' grace period
        os.utime(path, (AN_HOUR_AGO, AN_HOUR_AGO), follow_symlinks=False)
    store = Store(home)
    try:
        for record in store.conversations():
            for episode in record.episodes if record.name not in damaged else ():
                store.load_episode(episode, FP)
            if record.recall_entries is not None and record.name not in damaged:
                store.load_recall_entries(record, FP)
        return {c.name: c.ingest_id for c in store.conversations()}
    finally:
        store.close()


def _points(action: Callable[[Path], None], pristine: Path, tmp: Path) -> list[str]:
    home, log = tmp / "count", tmp / "points.log"
    shutil.copytree(pristine, home)
    assert _run(action, home, {CRASH_LOG: str(log)}) == 0
    points = log.read_text().splitlines()
    assert points, "the operation reached no crash point"
    return points


def _every_crash(action: Callable[[Path], None], pristine: Path, tmp: Path, *, allowed: Callable[[dict], bool],
                 problems_allowed: Callable[[list], bool] = lambda found: not found,
                 damaged: frozenset[str] = frozenset()) -> int:
    points = _points(action, pristine, tmp)
    for n in range(1, len(points) + 1):
        home = tmp / f"crash-{n}"
        shutil.copytree(pristine, home)
        assert _run(action, home, {CRASH_AT: str(n)}) == CRASH_EXIT, f"did not die at point {n}: {points[n - 1]}"
        state = _state(home, damaged)
        assert allowed(state), f"after a crash at {points[n - 1]} (point {n}): {state}"
        found = diagnose(home)
        assert problems_allowed(found), f"after a crash at {points[n - 1]} (point {n}): {found}"
        shutil.rmtree(home)
    return len(points)


@pytest.fixture
def pristine(tmp_path) -> tuple[Path, str]:
    """A home with conversation `a`, closed (one file, no WAL); `a`'s ingest id."""
    home = tmp_path / "pristine"
    store = Store(home)
    record = _commit(store, "a")
    store.close()
    return home, record.ingest_id


def test_a_crash_at_any_point_of_a_new_conversations_commit(pristine, tmp_path):
    home, old = pristine
    n = _every_crash(lambda h: _commit(Store(h), "b", seed=1), home, tmp_path,
                     allowed=lambda s: s.keys() in ({"a"}, {"a", "b"}) and s["a"] == old)
    assert n >= 8  # two episodes' writes and fsyncs, the manifest's, the dir's, the rename, the commit


def test_a_crash_at_any_point_of_a_replace(pristine, tmp_path):
    home, old = pristine
    _every_crash(lambda h: _commit(Store(h), "a", replace=True, seed=2), home, tmp_path,
                 allowed=lambda s: s.keys() == {"a"})


def test_a_crash_at_any_point_of_an_appends_commit(pristine, tmp_path):
    home, old = pristine
    _every_crash(lambda h: _commit(Store(h), "a", replace=True, expect=old, seed=1), home, tmp_path,
                 allowed=lambda s: s.keys() == {"a"})


def test_a_crash_at_any_point_of_rm(pristine, tmp_path):
    home, old = pristine
    _every_crash(lambda h: Store(h).remove("a"), home, tmp_path, allowed=lambda s: s in ({"a": old}, {}))


def test_a_crash_at_any_point_of_doctor_fix(pristine, tmp_path):
    """A damaged conversation `b` beside `a`: --fix removes `b` whole; a crash leaves it damaged or gone."""
    home, old = pristine
    store = Store(home)
    damaged = _commit(store, "b", seed=1)
    store.close()
    path = damaged.episodes[0].path
    path.write_bytes(path.read_bytes()[:-1] + b"\0")  # a flipped byte
    _every_crash(lambda h: repair(h, diagnose(h)), home, tmp_path,
                 allowed=lambda s: s.get("a") == old and s.keys() <= {"a", "b"},
                 problems_allowed=lambda found: {p.conversation for p in found} <= {"b"}, damaged=frozenset("b"))


def test_a_crash_at_any_point_of_a_commit_with_a_recall_entries_file(pristine, tmp_path):
    home, old = pristine
    _every_crash(lambda h: _commit_with_entries(Store(h), "b"), home, tmp_path,
                 allowed=lambda s: s.keys() in ({"a"}, {"a", "b"}) and s["a"] == old)


def test_a_crash_at_any_point_of_an_append_writing_its_recall_entries_file(tmp_path):
    """An append writes the new version's file beside the old version's: whichever version a crash leaves, its
    file reads."""
    home = tmp_path / "pristine"
    store = Store(home)
    old = _commit_with_entries(store, "a").ingest_id
    store.close()

    def append(h: Path) -> None:
        _commit_with_entries(Store(h), "a", replace=True, expect=old)

    _every_crash(append, home, tmp_path, allowed=lambda s: s.keys() == {"a"})


def _resumable_commit(store: Store, name: str, *, replace: bool = False):
    """A resumable ingest's writes (kvchat.store.resumable): its dir made, a checkpoint, two episodes, each journaled,
    then the commit; run again after a crash it continues from what the journal kept."""
    from kvchat.store.resumable import Identity

    identity = Identity("the-same-ingest", {"episodes": 2, "chunks": 0})
    with store.begin(name, replace=replace, resumable=identity) as pending:
        written = pending.written_episodes()
        if 0 not in written:
            pending.write_checkpoint(0, TENSORS[2], {"fingerprint": FP}, {"blocks": 1})
        for i in range(2):
            if i not in written:
                pending.write_episode(i, TENSORS[i], {"fingerprint": FP, "method": "epicache"},
                                      centroid=centroid(0.25 * i, -1.0, 3.0), medoid_text=f"episode {i}",
                                      budgets=[8, 12], n_tokens=20, note={"i": i})  # fmt: skip
        return pending.commit(model="default", fingerprint=FP, settings=SETTINGS, stats=STATS)


@pytest.mark.parametrize("replace", [False, True], ids=["new", "replace"])
def test_a_crash_at_any_point_of_a_resumable_ingest_then_the_same_ingest_finishes_it(pristine, tmp_path, replace):
    """Dying at any write, fsync, rename, journal line or commit of a resumable ingest leaves the old version or the
    new one, and at most its unfinished dir (`doctor`: unfinished); the same ingest run again then commits the new
    version, whatever it had kept, and leaves nothing behind."""
    home, old = pristine
    name = "a" if replace else "b"

    def finish(h: Path) -> None:
        _resumable_commit(Store(h), name, replace=replace)

    points = _points(finish, home, tmp_path)
    assert any(" journal " in p for p in points) and len(points) >= 12, points
    for n in range(1, len(points) + 1):
        crashed = tmp_path / f"crash-{n}"
        shutil.copytree(home, crashed)
        assert _run(finish, crashed, {CRASH_AT: str(n)}) == CRASH_EXIT, f"did not die at point {n}: {points[n - 1]}"
        state = _state(crashed)
        new = state.get("a") != old if replace else "b" in state
        assert state.keys() == ({"a"} if replace else {"a", "b"} if new else {"a"}), f"at {points[n - 1]}: {state}"
        assert {p.kind for p in diagnose(crashed)} <= {"unfinished"}, f"after a crash at {points[n - 1]}"
        if not new:  # committed already: a plain ingest would now say the name exists
            assert _run(finish, crashed, {}) == 0, f"the ingest run again after a crash at {points[n - 1]} failed"
            state = _state(crashed)
            assert (state["a"] != old) if replace else (state.keys() == {"a", "b"} and state["a"] == old), state
        assert diagnose(crashed) == [], f"left behind after a crash at {points[n - 1]} and the run again"
        shutil.rmtree(crashed)
