"""Resumable ingest (kvchat.ingest.units, kvchat.store.resumable): an ingest stopped at any point (kill -9, Ctrl-C,
a full disk) continues with the same command from its last completed unit, and the finished conversation's files
are byte for byte those of an uninterrupted ingest. Kills and interrupts are placed by observed progress (what the
ingest says, its journal, a hold point), never by a timer."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from cli_helpers import KVCHAT, cli_env, run_main

import kvchat.store as store_module
from kvchat.config import CacheConfig, EpisodeConfig, IngestConfig, OffloadConfig, RecallConfig
from kvchat.errors import UserError
from kvchat.history.loading import load_history
from kvchat.history.synthetic import planted_conversation
from kvchat.ingest.pipeline import IngestProgress, ingest
from kvchat.store import Store
from kvchat.store.files import HOLD_AT
from kvchat.store.resumable import JOURNAL_NAME, claim, create, resumable_path

EPISODES = 4
# block prefill: the tiny model's window holds the history, where `auto` would select from one full prefill
SMALL = ("--budget", "64", "--setting", "block_size=32", "--setting", "prefill=block", "--episodes", str(EPISODES))


def _config(tiny_model_dir: Path, **cache) -> IngestConfig:
    """Block prefill (the tiny model's window holds the history, where `auto` would select from a full prefill, whose
    unit is the episode: the case `full` covers it)."""
    cache = {"budget": 64, "block_size": 32, "prefill": "block", **cache}
    return IngestConfig(model=str(tiny_model_dir), cache=CacheConfig(**cache),
                        episodes=EpisodeConfig(episodes=EPISODES))  # fmt: skip


STORED = {"budget": 128, "method": "recall", "recall": RecallConfig(entries="stored", chunk_tokens=64)}


@pytest.fixture(scope="module")
def history(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("resume") / "long.json"
    path.write_text(json.dumps(planted_conversation(seed=7, topics=6, turns_per_topic=40)[0]))
    return path


@pytest.fixture(scope="module")
def turns(history) -> list:
    return load_history(history)


def _files(home: Path, name: str) -> dict[str, str]:
    """sha256 of every file of conversation `name` but its manifest (which records when and how long), and the
    digests its manifest records."""
    record = Store(home, clean_stale=False).get(name)
    folder = record.episodes[0].path.parent
    found = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
             for p in folder.iterdir() if p.name != "conversation.json"}  # fmt: skip
    recorded = {f"manifest {path.name}": sha for path, _, sha, _ in record.files()}
    return found | recorded


class StopAt(IngestProgress):
    """Ctrl-C (KeyboardInterrupt) once the ingest reaches episode `episode` (0-based) and, with `block`, that block
    of it; or with `chunk`, once that many recall chunks are written."""

    def __init__(self, episode: int | None = None, block: int | None = None, chunk: int | None = None) -> None:
        self.target, self.block_target, self.chunk_target = episode, block, chunk
        self.current, self.said, self.resumed = None, [], None

    def episode(self, index: int, total: int) -> None:
        self.current = index
        if index == self.target and self.block_target is None:
            raise KeyboardInterrupt

    def block(self, done: int, total: int) -> None:
        if self.current == self.target and done == self.block_target:
            raise KeyboardInterrupt
        assert self.current != self.target or self.block_target is None or total > self.block_target, "too short"

    def recall_entries(self, done: int, total: int) -> None:
        if done == self.chunk_target:
            raise KeyboardInterrupt

    def resuming(self, done: str, blocks: int) -> None:
        self.resumed = done

    def note(self, text: str) -> None:
        self.said.append(text)


def _ingest(home: Path, turns, config, lm, encoder, progress=None, **options):
    return ingest(turns, name="c", config=config, store=Store(home), lm=lm, encoder=encoder, progress=progress,
                  resumable=True, **options)  # fmt: skip


@pytest.mark.parametrize("stop, cache", [
    ({"episode": 2}, {}),                               # between episodes
    ({"episode": 2}, {"prefill": "full"}),              # selected from one full prefill: by episode
    ({"episode": 1, "block": 11}, {}),                  # inside one: continued from its last checkpoint (8 blocks)
    ({"episode": 0, "block": 10}, {"positions": "compact"}),  # compacted, original positions tracked
    ({"episode": 1, "block": 9}, {"head_budgets": "adaptive"}),  # ragged layers
    ({"chunk": 3}, STORED),                             # inside the recall entries' chunks
    ({"episode": 2, "block": 9}, STORED),               # a stored-chunks ingest stopped in an episode
    ({"episode": 2}, {"offload": OffloadConfig(mode="icecache")}),  # pages files: kept by episode
], ids=["between-episodes", "full-prefill", "mid-episode", "compact", "ragged", "mid-chunks", "recall-mid-episode",
        "offload"])
def test_an_interrupted_ingest_continues_to_the_files_of_an_uninterrupted_one(
    stop, cache, turns, tiny_model_dir, tiny_lm, encoder, tmp_path
):
    config = _config(tiny_model_dir, **cache)
    _ingest(tmp_path / "whole", turns, config, tiny_lm, encoder)
    home = tmp_path / "home"
    with pytest.raises(KeyboardInterrupt) as stopped:
        _ingest(home, turns, config, tiny_lm, encoder, progress=StopAt(**stop))
    assert any(note.startswith("kept: ") for note in stopped.value.__notes__)
    assert Store(home).conversations() == []  # nothing visible, and the open's sweep keeps the unfinished one
    journal = (resumable_path(home / "caches", "c") / JOURNAL_NAME).read_text().splitlines()
    if "block" in stop:  # stopped in an episode: continued from its checkpoint
        assert any(json.loads(line).get("checkpoint") == stop["episode"] for line in journal)
    again = StopAt()
    report = _ingest(home, turns, config, tiny_lm, encoder, progress=again)
    assert again.resumed is not None and "done" in again.resumed
    assert _files(home, "c") == _files(tmp_path / "whole", "c")
    assert report.episodes == EPISODES and Store(home).check() == []
    assert not any((home / "caches").glob(".resume-*")) and not any((home / "caches").glob(".tmp-*"))


def test_a_full_disk_keeps_what_was_done_and_the_same_ingest_continues_once_space_is_freed(
    turns, tiny_model_dir, tiny_lm, encoder, tmp_path, monkeypatch
):
    """ENOSPC at the 6th file written (episodes and checkpoints): one line saying what is kept; with room again, the
    same ingest finishes with the files of one that never met a full disk."""
    config = _config(tiny_model_dir)
    _ingest(tmp_path / "whole", turns, config, tiny_lm, encoder)
    real, calls = store_module._write_file, []

    def fills_up(path, data):
        calls.append(path.name)
        if len(calls) == 6:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data)

    monkeypatch.setattr(store_module, "_write_file", fills_up)
    home = tmp_path / "home"
    with pytest.raises(UserError, match="no space left on device") as full:
        _ingest(home, turns, config, tiny_lm, encoder)
    assert ": kept: 0 of 4 episodes done, 1 more episode partly; free space and run the same ingest again" in str(
        full.value)
    assert "\n" not in str(full.value)
    monkeypatch.setattr(store_module, "_write_file", real)
    _ingest(home, turns, config, tiny_lm, encoder)
    assert _files(home, "c") == _files(tmp_path / "whole", "c")


def test_other_settings_discard_the_unfinished_ingest_and_say_so(turns, tiny_model_dir, tiny_lm, encoder, tmp_path):
    home = tmp_path / "home"
    with pytest.raises(KeyboardInterrupt):
        _ingest(home, turns, _config(tiny_model_dir), tiny_lm, encoder, progress=StopAt(episode=2))
    other = _config(tiny_model_dir, budget=96)
    with pytest.raises(UserError, match="cannot be continued"):
        _ingest(home, turns, other, tiny_lm, encoder, resume=True)
    seen = StopAt()
    _ingest(home, turns, other, tiny_lm, encoder, progress=seen)
    assert seen.resumed is None and len(seen.said) == 1
    assert seen.said[0].startswith("discarded the unfinished ingest of 'c' (2 of 4 episodes done)")
    _ingest(tmp_path / "whole", turns, other, tiny_lm, encoder)
    assert _files(home, "c") == _files(tmp_path / "whole", "c")


def test_resume_false_starts_over_and_true_insists(turns, tiny_model_dir, tiny_lm, encoder, tmp_path):
    home, config = tmp_path / "home", _config(tiny_model_dir)
    with pytest.raises(UserError, match="no unfinished ingest of 'c'"):
        _ingest(home, turns, config, tiny_lm, encoder, resume=True)
    with pytest.raises(KeyboardInterrupt):
        _ingest(home, turns, config, tiny_lm, encoder, progress=StopAt(episode=1))
    seen = StopAt()
    _ingest(home, turns, config, tiny_lm, encoder, progress=seen, resume=False)
    assert seen.resumed is None and seen.said == ["discarded the unfinished ingest of 'c' (1 of 4 episodes done): "
                                                  "asked to start over"]  # fmt: skip


def test_an_ingest_not_asked_to_be_resumable_leaves_nothing(turns, tiny_model_dir, tiny_lm, encoder, tmp_path):
    """The library's default (serve's ingest jobs, eval): a private temp dir, removed when it stops."""
    with pytest.raises(KeyboardInterrupt):
        ingest(turns, name="c", config=_config(tiny_model_dir), store=Store(tmp_path), lm=tiny_lm, encoder=encoder,
               progress=StopAt(episode=2))  # fmt: skip
    assert list((tmp_path / "caches").iterdir()) == []


def test_another_process_holding_the_unfinished_ingest_leaves_this_one_apart(
    turns, tiny_model_dir, tiny_lm, encoder, tmp_path
):
    home, config = tmp_path / "home", _config(tiny_model_dir)
    with pytest.raises(KeyboardInterrupt):
        _ingest(home, turns, config, tiny_lm, encoder, progress=StopAt(episode=1))
    path = resumable_path(home / "caches", "c")
    before = sorted(p.name for p in path.iterdir())
    held = claim(path)  # as a running ingest holds it
    try:
        seen = StopAt()
        _ingest(home, turns, config, tiny_lm, encoder, progress=seen)
        assert seen.said == ["another ingest of 'c' is running: this one is not resumable"]
        assert Store(home).check() == [] and sorted(p.name for p in path.iterdir()) == before
    finally:
        held.release()


def test_the_sweep_keeps_work_and_drops_dirs_with_none_and_doctor_fix_deletes_it(
    turns, tiny_model_dir, tiny_lm, encoder, tmp_path
):
    home = tmp_path / "home"
    with pytest.raises(KeyboardInterrupt):
        _ingest(home, turns, _config(tiny_model_dir), tiny_lm, encoder, progress=StopAt(episode=3))
    from kvchat.store.resumable import Identity

    empty = create(home / "caches", "empty", Identity("k", {"episodes": 2, "chunks": 0}), "id")
    empty.release()  # made, then its ingest died before its first unit
    store = Store(home)  # the sweep
    assert sorted(p.name for p in (home / "caches").iterdir()) == [".resume-c"]
    problems = store.check()
    assert [(p.kind, p.path.name) for p in problems] == [("unfinished", ".resume-c")]
    assert "unfinished ingest of 'c' (3 of 4 episodes done)" in problems[0].message
    found = run_main(home, "doctor")
    assert found.returncode == 1 and "3 of 4 episodes done" in found.stdout
    fixed = run_main(home, "doctor", "--fix")
    assert fixed.returncode == 0 and "deleted unfinished" in fixed.stdout, fixed
    assert list((home / "caches").iterdir()) == [] and Store(home).check() == []


def test_a_torn_journal_line_is_dropped(turns, tiny_model_dir, tiny_lm, encoder, tmp_path):
    """A kill in the middle of a journal line: the line is not a completed unit; the rest is."""
    home, config = tmp_path / "home", _config(tiny_model_dir)
    _ingest(tmp_path / "whole", turns, config, tiny_lm, encoder)
    with pytest.raises(KeyboardInterrupt):
        _ingest(home, turns, config, tiny_lm, encoder, progress=StopAt(episode=2))
    journal = resumable_path(home / "caches", "c") / JOURNAL_NAME
    with open(journal, "ab") as f:
        f.write(b'{"episode": 2, "record": {"ind')
    seen = StopAt()
    _ingest(home, turns, config, tiny_lm, encoder, progress=seen)
    assert seen.resumed.startswith("2 of 4 episodes done")
    assert _files(home, "c") == _files(tmp_path / "whole", "c")


# --------------------------------------------------------------------------- real processes


def _env(home: Path, **extra: str) -> dict[str, str]:
    return {**cli_env(home), "OMP_NUM_THREADS": "1", **extra}


def _whole(history: Path, tiny_model_dir: Path, home: Path) -> dict[str, str]:
    done = subprocess.run([*KVCHAT, "ingest", str(history), "--model", str(tiny_model_dir), *SMALL, "--name", "c"],
                          env=_env(home), capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return _files(home, "c")


@pytest.mark.slow
def test_kill_9_at_a_checkpoint_and_at_an_episode_then_the_same_command_finishes_it(
    history, tiny_model_dir, tmp_path
):
    """SIGKILL while the ingest holds right after journaling a checkpoint of its second episode (a hold point: it
    waits there for a file that never comes), then SIGKILL when it says it starts its fourth episode; each time the
    same command continues, saying from where, and the result is the uninterrupted ingest's, byte for byte."""
    home = tmp_path / "home"
    command = [*KVCHAT, "ingest", str(history), "--model", str(tiny_model_dir), *SMALL, "--name", "c"]
    held = subprocess.Popen(command, env=_env(home, **{HOLD_AT: f"checkpoint 1 8:{tmp_path / 'never'}"}),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    journal = resumable_path(home / "caches", "c") / JOURNAL_NAME
    try:
        while held.poll() is None and not _journaled(journal, checkpoint=(1, 8)):
            time.sleep(0.05)  # polls the journal; it holds there once it is written, so no timing rides on this
    finally:
        held.kill()
        held.wait()
    assert held.returncode == -signal.SIGKILL and _journaled(journal, checkpoint=(1, 8))

    second = subprocess.Popen(command, env=_env(home), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    said = []
    for line in second.stderr:
        said.append(line)
        if line.startswith(f"kvchat: episode {EPISODES}/"):
            second.kill()
            break
    second.stderr.read()
    second.wait()
    assert second.returncode == -signal.SIGKILL, said
    assert any(line.startswith("kvchat: resuming: 1 of 4 episodes done, 1 more episode partly") for line in said), said

    third = subprocess.run(command, env=_env(home), capture_output=True, text=True, timeout=600)
    assert third.returncode == 0, third.stderr
    assert "kvchat: resuming: 3 of 4 episodes done" in third.stderr
    assert _files(home, "c") == _whole(history, tiny_model_dir, tmp_path / "whole")


@pytest.mark.slow
def test_ctrl_c_keeps_the_work_and_says_so_and_resume_insists(history, tiny_model_dir, tmp_path):
    home = tmp_path / "home"
    command = [*KVCHAT, "ingest", str(history), "--model", str(tiny_model_dir), *SMALL, "--name", "c"]
    nothing = subprocess.run([*command, "--resume"], env=_env(home), capture_output=True, text=True, timeout=600)
    assert nothing.returncode == 2 and nothing.stderr.strip().splitlines() == [
        "kvchat: error: --resume: no unfinished ingest of 'c' to continue"]
    first = subprocess.Popen(command, env=_env(home), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    said = []
    for line in first.stderr:
        said.append(line)
        if line.startswith("kvchat: episode 3/"):
            first.send_signal(signal.SIGINT)
            break
    said += first.stderr.readlines()
    first.wait()
    assert first.returncode == 130, said
    assert any(line.startswith("kvchat: note: kept: 2 of 4 episodes done") and
               line.endswith("; the same ingest run again continues from there\n") for line in said), said
    assert said[-1] == "kvchat: interrupted\n", said
    resumed = subprocess.run([*command, "--resume"], env=_env(home), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0 and "kvchat: resuming: " in resumed.stderr, resumed.stderr
    assert _files(home, "c") == _whole(history, tiny_model_dir, tmp_path / "whole")


def _journaled(journal: Path, *, checkpoint: tuple[int, int]) -> bool:
    """Whether `journal` holds the checkpoint of episode `checkpoint[0]` after `checkpoint[1]` blocks."""
    try:
        lines = journal.read_bytes().split(b"\n")[:-1]
    except OSError:
        return False
    for line in lines:
        entry = json.loads(line)
        if entry.get("checkpoint") == checkpoint[0] and entry["note"]["blocks"] == checkpoint[1]:
            return True
    return False


def test_resume_and_ray_options_combine_only_where_they_mean_something(history, tmp_path):
    for args, message in (
        (["--append", "--name", "c", "--resume"],
         "--resume and --no-resume go with a plain ingest: an --append is not resumable"),
        (["--append", "--name", "c", "--ray"], "--ray spreads a plain ingest: an --append runs in this process"),
        (["--workers", "2"], "--workers goes with --ray"),
        (["--address", "auto"], "--address goes with --ray"),
    ):
        done = run_main(tmp_path, "ingest", str(history), *args)
        assert done.returncode == 2 and done.stderr.strip().splitlines() == [f"kvchat: error: {message}"], done.stderr


def test_identity_covers_what_decides_the_bytes(turns, tiny_model_dir, tiny_lm, encoder, tmp_path):
    from kvchat.ingest import units
    from kvchat.ingest.plan import plan_ingest

    def key(config, history=turns, model=tiny_lm.identity):
        plan = plan_ingest(history, name="c", config=config, store=Store(tmp_path), lm=tiny_lm, encoder=encoder)
        return units.identity(plan, model).key

    base = key(_config(tiny_model_dir))
    assert key(_config(tiny_model_dir)) == base  # planning is deterministic
    assert key(_config(tiny_model_dir, budget=96)) != base
    assert key(_config(tiny_model_dir), history=turns[:-1]) != base
    assert key(_config(tiny_model_dir), model=dataclasses.replace(tiny_lm.identity, weights="int8")) != base
    assert key(_config(tiny_model_dir), model=dataclasses.replace(tiny_lm.identity, dtype="bfloat16")) != base
