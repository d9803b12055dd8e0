"""Never lose a conversation (issue 29's data-loss cases): the files are the truth and kvchat.db an index of
them, writers of one conversation cannot lose each other's update, and nothing kvchat deletes lies outside
its home, whatever the symbolic links."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from cli_helpers import run_main
from conftest import centroid
from test_store import FP, _ingest, _tensors, _tmp_dirs

from kvchat.config import CacheConfig, EpisodeConfig, IngestConfig
from kvchat.errors import UserError
from kvchat.history.synthetic import planted_conversation
from kvchat.ingest.pipeline import IngestProgress, ingest
from kvchat.store import ConversationRecord, Store
from kvchat.store.home_doctor import diagnose, repair

CHANGED = "was changed by another kvchat process while this command worked on it"
AN_HOUR_AGO = time.time() - 3600


def _age(path: Path) -> None:
    """Make an ingest dir look as old as any crash leftover the sweep of an open would take."""
    os.utime(path, (AN_HOUR_AGO, AN_HOUR_AGO))


def _closed(store: Store) -> Path:
    """Close `store` so that its kvchat.db is one file (no WAL) that can be copied or restored."""
    store.close()
    assert not Path(f"{store.db_path}-wal").exists()
    return store.db_path


def _with_the_database_before(home: Path, change: Callable[[Store], ConversationRecord]) -> ConversationRecord:
    """`change` the store, then put back the kvchat.db it had before (a backup restored), with the changed
    conversation's dir as old as any crash leftover. Returns what `change` committed."""
    store = Store(home)
    backup = home.parent / "backup.db"
    shutil.copy(_closed(store), backup)
    store = Store(home)
    record = change(store)
    shutil.copy(backup, _closed(store))
    _age(record.episodes[0].path.parent)
    return record


def _loads(store: Store, name: str) -> None:
    for episode in store.get(name).episodes:
        store.load_episode(episode, FP)


# --------------------------------------------------------------------------- an older or missing kvchat.db


def test_an_older_database_loses_no_conversation(tmp_path):
    """The issue's reproduction: ingest first; back up the db; ingest second; wait; restore the db; list."""
    home = tmp_path / "home"
    _ingest(store := Store(home), "first")
    store.close()
    second = _with_the_database_before(home, lambda store: _ingest(store, "second", n=3, seed=7))
    second_dir = second.episodes[0].path.parent

    listed = run_main(home, "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert sorted(c["name"] for c in json.loads(listed.stdout)["conversations"]) == ["first", "second"]
    assert second_dir.is_dir()
    store = Store(home)
    assert store.get("second") == second
    _loads(store, "second")
    assert store.check() == []


def test_an_older_database_listing_an_older_version_gets_the_newer_one(tmp_path):
    home = tmp_path / "home"
    _ingest(store := Store(home), "chat")
    store.close()
    # the old version's files are gone with it
    newer = _with_the_database_before(home, lambda store: _ingest(store, "chat", n=3, seed=5, replace=True))

    store = Store(home)
    assert store.get("chat") == newer
    _loads(store, "chat")


def test_a_missing_database_is_listed_again_by_doctor_and_nothing_is_deleted(tmp_path):
    home = tmp_path / "home"
    store = Store(home)
    records = {name: _ingest(store, name, seed=i) for i, name in enumerate(("alpha", "beta"))}
    db = _closed(store)
    db.unlink()
    dirs = [r.episodes[0].path.parent for r in records.values()]
    for ingest_dir in dirs:
        _age(ingest_dir)

    problems = diagnose(home)  # opens without the sweep: sees what the next command would list again
    assert sorted((p.kind, p.path) for p in problems) == [("unlisted", d) for d in sorted(dirs)]
    assert not any("deletes" in p.message for p in problems)
    done = repair(home, problems)
    assert len(done) == 2 and all(line.startswith("listed conversation") for line in done)
    assert diagnose(home) == []
    store = Store(home)
    assert {c.name: c for c in store.conversations()} == records


def test_a_removed_database_is_rebuilt_by_the_next_command(tmp_path):
    home = tmp_path / "home"
    store = Store(home)
    record = _ingest(store, "chat")
    _closed(store).unlink()
    _age(record.episodes[0].path.parent)
    store = Store(home)
    assert store.conversations() == [record]


def test_the_sweep_never_takes_a_dir_that_carries_a_manifest(tmp_path):
    """An older version a crashed `--replace` left beside the new one is kept (kvchat.db lists the newer
    one); a dir with no manifest is still an orphan the sweep takes."""
    home = tmp_path / "home"
    store = Store(home)
    old = _ingest(store, "chat")
    old_dir = old.episodes[0].path.parent
    kept = tmp_path / "kept"
    shutil.copytree(old_dir, kept)
    new = _ingest(store, "chat", seed=3, replace=True)
    assert not old_dir.exists()
    shutil.copytree(kept, old_dir)  # as if the replace died before deleting the old version
    orphan = old_dir.parent / "0123456789abcdef0123456789abcdef"
    orphan.mkdir()
    for ingest_dir in (old_dir, orphan):
        _age(ingest_dir)
    store.close()

    store = Store(home)
    assert store.get("chat") == new
    assert old_dir.is_dir() and not orphan.exists()
    assert not any(p.path == old_dir for p in store.check())


# --------------------------------------------------------------------------- two writers of one conversation


def test_two_writers_from_one_version_both_cannot_commit(tmp_path):
    store = Store(tmp_path / "home")
    version = _ingest(store, "chat").ingest_id
    pendings = [store.begin("chat", replace=True, expect=version) for _ in range(2)]
    for seed, pending in enumerate(pendings):
        pending.write_episode(0, _tensors(seed), {"fingerprint": FP}, centroid=centroid(1.0), medoid_text="m",
                              budgets=[4], n_tokens=8)  # fmt: skip
    winner = pendings[0].commit(model="default", fingerprint=FP, settings={}, stats={})
    with pytest.raises(UserError, match=CHANGED):
        pendings[1].commit(model="default", fingerprint=FP, settings={}, stats={})
    assert store.get("chat") == winner
    assert _tmp_dirs(store) == [] and store.check() == []
    with pytest.raises(UserError, match=CHANGED):  # a writer that starts from a replaced version is refused at once
        store.begin("chat", replace=True, expect=version)


def test_reading_a_version_another_process_replaced_says_so(tmp_path):
    store = Store(tmp_path / "home")
    old = _ingest(store, "chat")
    _ingest(Store(store.home), "chat", seed=4, replace=True)
    with pytest.raises(UserError, match=CHANGED) as info:
        store.load_episode(old.episodes[0], FP)
    assert "rebuild" not in str(info.value)


@pytest.fixture(scope="module")
def thirds(tmp_path_factory) -> tuple[Path, Path, Path]:
    messages, _ = planted_conversation(seed=3, topics=4, turns_per_topic=12)
    folder = tmp_path_factory.mktemp("thirds")
    paths = tuple(folder / f"{part}.json" for part in ("base", "a", "b"))
    for path, turns in zip(paths, (messages[:30], messages[30:39], messages[39:48]), strict=True):
        path.write_text(json.dumps(turns))
    return paths


class _AppendsMeanwhile(IngestProgress):
    """Runs another whole append of the same conversation (another process, as far as the store can tell)
    at one point of this append: before it reads its first stored episode, or once it has read its last."""

    def __init__(self, when: str, other) -> None:
        self.when, self.other, self.current, self.fired = when, other, -1, False

    def episode(self, index: int, total: int) -> None:
        self.current, self.total = index, total
        if self.when == "before reading" and index == 0:
            self._fire()

    def block(self, done: int, total: int) -> None:
        if self.when == "after reading" and self.current == self.total - 1:
            self._fire()

    def _fire(self) -> None:
        if not self.fired:
            self.fired = True
            self.other()


@pytest.mark.parametrize("when", ["before reading", "after reading"])
def test_two_appends_to_one_conversation_lose_neither(tmp_path, thirds, tiny_lm, encoder, when):
    from kvchat.ingest.append import append

    base, first, second = thirds
    home = tmp_path / "home"
    config = IngestConfig(cache=CacheConfig(budget=64, block_size=32), episodes=EpisodeConfig(episodes=2))
    ingest(base, name="chat", config=config, store=Store(home), lm=tiny_lm, encoder=encoder)
    turns = Store(home).get("chat").stats["turns"]

    def other() -> None:
        append(second, name="chat", store=Store(home), lm=tiny_lm, encoder=encoder)

    with pytest.raises(UserError, match=CHANGED):
        append(first, name="chat", store=Store(home), lm=tiny_lm, encoder=encoder,
               progress=_AppendsMeanwhile(when, other))  # fmt: skip
    store = Store(home)
    assert store.get("chat").stats["turns"] == turns + 9  # the other append's turns are there
    assert store.check() == [] and _tmp_dirs(store) == []
    append(first, name="chat", store=store, lm=tiny_lm, encoder=encoder)  # run again: on top of the other's
    assert store.get("chat").stats["turns"] == turns + 18


# --------------------------------------------------------------------------- symbolic links


@pytest.mark.parametrize("link", ["conversation dir", "ingest dir"])
def test_doctor_fix_deletes_nothing_through_a_symlink(tmp_path, link):
    home = tmp_path / "home"
    store = Store(home)
    record = _ingest(store, "chat")
    ingest_dir = record.episodes[0].path.parent
    linked = ingest_dir.parent if link == "conversation dir" else ingest_dir
    outside = tmp_path / "elsewhere" / linked.name
    outside.parent.mkdir()
    os.rename(linked, outside)
    linked.symlink_to(outside, target_is_directory=True)
    before = {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()}
    assert len(before) >= 3
    store.close()

    fixed = run_main(home, "doctor", "--fix")
    assert fixed.returncode in (0, 1), fixed.stderr
    assert {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()} == before
    assert "chat" not in [c.name for c in Store(home).conversations()]  # not kvchat's to serve from there


# --------------------------------------------------------------------------- a manifest whose digest checks out


def test_a_re_signed_manifest_with_a_wrong_centroid_is_not_restored(tmp_path):
    """Issue 29, case 8: the digest proves only that the bytes are the ones written, not that they are right."""
    from kvchat.store.manifest import MANIFEST_NAME, digest

    home = tmp_path / "home"
    store = Store(home)
    record = _ingest(store, "chat")
    ingest_dir = record.episodes[0].path.parent
    _closed(store).unlink()
    manifest = ingest_dir / MANIFEST_NAME
    body = json.loads(manifest.read_text())
    body["conversation"]["episodes"][1]["centroid"] = [0.5]
    body["sha256"] = digest(body["conversation"])
    manifest.write_text(json.dumps(body))
    _age(ingest_dir)

    problems = diagnose(home)
    assert not any(p.kind == "unlisted" for p in problems)
    repair(home, problems)
    assert Store(home).conversations() == []


def _one_episode_re_signed_with_a_short_centroid(tmp_path, history, lm, encoder) -> Path:
    """A home whose one conversation, "chat" (one episode), has a manifest re-signed with a 3-number centroid and no
    kvchat.db (so it is listed again from that manifest)."""
    from kvchat.store.manifest import MANIFEST_NAME, digest

    home = tmp_path / "home"
    config = IngestConfig(cache=CacheConfig(budget=64, block_size=32), episodes=EpisodeConfig(episodes=1))
    ingest(history, name="chat", config=config, store=(store := Store(home)), lm=lm, encoder=encoder)
    ingest_dir = store.get("chat").episodes[0].path.parent
    _closed(store).unlink()
    manifest = ingest_dir / MANIFEST_NAME
    body = json.loads(manifest.read_text())
    body["conversation"]["episodes"][0]["centroid"] = [0.6, 0.8, 0.0]
    body["sha256"] = digest(body["conversation"])
    manifest.write_text(json.dumps(body))
    _age(ingest_dir)
    return home


def test_a_re_signed_manifest_whose_centroid_has_the_wrong_length_throughout_is_caught(
    tmp_path, history, tiny_lm, tiny_model_dir, encoder
):
    """Issue 29, case 8's limit: one episode, so its centroids agree with each other; only the encoder's length
    tells. `ask` refuses it in one line (exit 2), not exit 1; `diagnose` given the encoder's length finds it and
    `repair` removes it."""
    from kvchat.model.encoder import embedding_dimension

    home = _one_episode_re_signed_with_a_short_centroid(tmp_path, history, tiny_lm, encoder)

    asked = run_main(home, "ask", "Where did Alice go?", "--conversation", "chat")  # listed again, then refused
    assert asked.returncode == 2, asked.stderr
    lines = asked.stderr.strip().splitlines()
    assert len(lines) == 1 and ("conversation 'chat' has episode centroids of 3 numbers where the encoder's "
                                "embeddings have 384") in lines[0] and "rebuild with `kvchat ingest" in lines[0]
    found = diagnose(home, embedding_dimension=embedding_dimension())
    assert [(p.kind, p.conversation) for p in found] == [("centroids", "chat")]
    assert "centroids of 3 numbers where the encoder's embeddings have 384" in found[0].message
    assert any("removed conversation 'chat'" in line for line in repair(home, found))
    assert Store(home).conversations() == []


@pytest.mark.parametrize("listed_first", [True, False])
def test_kvchat_doctor_finds_centroids_of_the_wrong_length_and_fix_does_not_restore_them(
    tmp_path, history, tiny_lm, encoder, listed_first
):
    """Issue 29, case 8 through the command line: `kvchat doctor` checks every centroid against the encoder's length
    (read from its config), and `doctor --fix` removes such a conversation rather than listing it again as healthy,
    whether a command listed it again first (`listed_first`) or the fix itself does."""
    home = _one_episode_re_signed_with_a_short_centroid(tmp_path, history, tiny_lm, encoder)
    if listed_first:
        assert run_main(home, "list").returncode == 0  # lists it again from its manifest
        found = run_main(home, "doctor")
        assert found.returncode == 1
        assert "centroids of 3 numbers where the encoder's embeddings have 384" in found.stdout
    fixed = run_main(home, "doctor", "--fix")
    assert fixed.returncode == 0 and "removed conversation 'chat'" in fixed.stdout, fixed.stdout
    assert "healthy now" in fixed.stdout
    assert run_main(home, "doctor").returncode == 0
    assert Store(home).conversations() == []
