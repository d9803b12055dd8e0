"""Real `kvchat` processes killed with SIGKILL or run side by side: a conversation is always complete or
absent, whatever moment an ingest dies, and parallel ingests and asks do not disturb each other. (What a killed
ingest completed is kept for the same command to continue, tests/test_resume.py: here a killed ingest's name is run
again with the same settings, so some runs continue one.)"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from cli_helpers import KVCHAT, cli_env

from kvchat.config import CacheConfig, EpisodeConfig, IngestConfig
from kvchat.history.synthetic import planted_conversation
from kvchat.ingest.pipeline import ingest
from kvchat.store import ConversationRecord, Store

pytestmark = pytest.mark.slow

TRIALS = 20
EPISODES = 4
SMALL = ("--budget", "64", "--setting", "block_size=32", "--episodes", str(EPISODES))


def _env(home: Path) -> dict[str, str]:
    # One thread per process: the trials share 2 cores with parallel processes, and oversubscribed
    # BLAS threads slow everything down without testing anything.
    return {**cli_env(home), "OMP_NUM_THREADS": "1"}


def _history(path: Path, seed: int, topics: int, turns: int) -> Path:
    path.write_text(json.dumps(planted_conversation(seed=seed, topics=topics, turns_per_topic=turns)[0]))
    return path


def _whole(store: Store, fingerprint: str) -> dict[str, ConversationRecord]:
    """The listed conversations by name, after checking each has all its episodes, each loadable."""
    listed = {c.name: c for c in store.conversations()}
    for record in listed.values():
        assert record.fingerprint == fingerprint and len(record.episodes) == EPISODES, record.name
        for episode in record.episodes:
            store.load_episode(episode, fingerprint)  # size, header, sha256 and fingerprint checks
            if record.settings.get("offload", "none") != "none":
                store.load_pages(episode, fingerprint)  # the same checks on its pages file
    return listed


def _run_killed_at(command: list[str], home: Path, stage: int) -> int:
    """Run an ingest and SIGKILL it at `stage`: 0 at once, k in 1..EPISODES as it says "episode k/N", later
    never. Kills are timed by what the ingest says it is doing (one line per episode on stderr), never by
    the clock (from the second episode on, its temp dir holds files). Returns its exit status."""
    proc = subprocess.Popen(command, env=_env(home), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if stage == 0:
        proc.kill()
    elif stage <= EPISODES:
        for line in proc.stderr:
            if line.startswith(f"kvchat: episode {stage}/"):
                proc.kill()
                break
    proc.stderr.read()
    proc.stderr.close()
    proc.wait()
    assert proc.returncode in (0, -9)
    return proc.returncode


def test_kill_9_at_any_moment_of_an_ingest_leaves_all_or_nothing(tmp_path, tiny_model_dir):
    home = tmp_path / "home"
    history = _history(tmp_path / "long.json", seed=7, topics=6, turns=40)
    ingest_cmd = [*KVCHAT, "ingest", str(history), "--model", str(tiny_model_dir), *SMALL]

    first = subprocess.run([*ingest_cmd, "--name", "kept"], env=_env(home), capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    fingerprint = Store(home).get("kept").fingerprint

    killed = interrupted_writes = 0
    for trial in range(TRIALS):
        # Even trials ingest a new name (it must be complete or absent); odd ones re-ingest "kept"
        # with --replace (the old version must survive a kill).
        replace = trial % 2 == 1
        name = "kept" if replace else f"new{trial}"
        stage = (trial // 2) % (EPISODES + 2)  # 0: at once; 1..EPISODES: at "episode k/N"; last: let it finish
        returncode = _run_killed_at([*ingest_cmd, "--name", name, *(["--replace"] if replace else [])], home, stage)
        killed += returncode == -9
        # died with files half-way (kept to be continued, or a temp dir)
        interrupted_writes += any((home / "caches").glob(".tmp-*")) or any((home / "caches").glob(".resume-*"))
        store = Store(home)  # the next start cleans up after the dead process
        assert sorted(store.caches_dir.glob(".tmp-*")) == []
        listed = _whole(store, fingerprint)
        assert "kept" in listed
        store.close()
    assert killed >= TRIALS // 2 and interrupted_writes >= 1

    # Re-running works: a name whose every ingest died, and "kept" with --replace (side by side).
    absent = sorted({f"new{t}" for t in range(0, TRIALS, 2)} - set(listed))
    assert absent, "every new-name trial completed: the kills came too late"
    reruns = [
        subprocess.Popen([*ingest_cmd, "--name", absent[0]], env=_env(home), stderr=subprocess.PIPE, text=True),
        subprocess.Popen([*ingest_cmd, "--name", "kept", "--replace"], env=_env(home), stderr=subprocess.PIPE,
                         text=True),
    ]  # fmt: skip
    errors = [p.communicate(timeout=300)[1] for p in reruns]
    assert [p.returncode for p in reruns] == [0, 0], errors
    cli = [
        subprocess.Popen([*KVCHAT, *args], env=_env(home), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for args in (["list", "--json"], ["ask", "Which gate?", "--conversation", absent[0], "--json",
                                          "--max-new-tokens", "3"])
    ]  # fmt: skip
    (listed_json, err_list), (answer, err_ask) = (p.communicate(timeout=300) for p in cli)
    assert [p.returncode for p in cli] == [0, 0], (err_list, err_ask)
    by_name = {c["name"]: c for c in json.loads(listed_json)["conversations"]}
    assert {absent[0], "kept"} <= set(by_name) and all(c["episode_count"] == EPISODES for c in by_name.values())
    assert json.loads(answer)["conversation"] == absent[0]

    # What the kills may leave behind is only what doctor reports as leftovers (and unfinished ingests to continue),
    # never a damaged row.
    store = Store(home, clean_stale=False)
    _whole(store, fingerprint)
    problems = store.check()
    assert all(p.conversation is None and p.kind in ("orphan", "unfinished") for p in problems), problems
    store.fix(problems)
    assert store.check() == []


def test_kill_9_during_an_offload_ingest_leaves_all_or_nothing(tmp_path, tiny_model_dir):
    """As above with `--offload icecache`: killed while spilling evicted entries or writing pages files, an
    ingest leaves no conversation, no temp dir and no spill file; a listed one has every pages file."""
    home = tmp_path / "home"
    history = _history(tmp_path / "long.json", seed=5, topics=6, turns=40)
    ingest_cmd = [*KVCHAT, "ingest", str(history), "--model", str(tiny_model_dir), *SMALL, "--offload", "icecache"]
    first = subprocess.run([*ingest_cmd, "--name", "kept"], env=_env(home), capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    fingerprint = Store(home).get("kept").fingerprint
    killed = 0
    for stage in range(1, EPISODES + 2):  # at "episode k/N" (spill files and pages files in flight), or never
        name = f"new{stage}"
        returncode = _run_killed_at([*ingest_cmd, "--name", name], home, stage)
        killed += returncode == -9
        store = Store(home)
        assert sorted(store.caches_dir.glob(".tmp-*")) == []
        listed = _whole(store, fingerprint)
        assert "kept" in listed and (returncode != 0 or name in listed)
        assert not list(store.caches_dir.rglob("scratch-*"))
        store.close()
    assert killed >= EPISODES - 1
    store = Store(home, clean_stale=False)
    problems = store.check()
    assert all(p.conversation is None and p.kind in ("orphan", "unfinished") for p in problems), problems


def test_parallel_ingests_and_asks(tmp_path, tiny_model_dir, tiny_lm, encoder):
    home = tmp_path / "home"
    config = IngestConfig(cache=CacheConfig(budget=64, block_size=32), episodes=EpisodeConfig(episodes=EPISODES))
    ingest(_history(tmp_path / "base.json", seed=1, topics=3, turns=12), name="base", config=config,
           store=Store(home), lm=tiny_lm, encoder=encoder)  # fmt: skip
    ingests = [
        [*KVCHAT, "ingest", str(_history(tmp_path / f"h{i}.json", seed=10 + i, topics=3, turns=12)),
         "--model", str(tiny_model_dir), *SMALL]
        for i in range(4)
    ]  # fmt: skip
    questions = "Which gate does the flight leave from?\nHow many tomato plants?\nWhat is the code name?\n"
    asks = [[*KVCHAT, "ask", "--conversation", "base", "--json", "--max-new-tokens", "3"]] * 2
    procs = [
        subprocess.Popen(cmd, env=_env(home), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for cmd in ingests + asks
    ]  # fmt: skip
    outputs = [p.communicate(input="" if i < len(ingests) else questions, timeout=300) for i, p in enumerate(procs)]
    assert [p.returncode for p in procs] == [0] * len(procs), [err for _, err in outputs]
    for out, _ in outputs[len(ingests):]:
        assert [json.loads(line)["conversation"] for line in out.splitlines()] == ["base"] * 3
    store = Store(home)
    assert sorted(_whole(store, tiny_lm.fingerprint)) == ["base", "h0", "h1", "h2", "h3"]
    assert sorted(store.caches_dir.glob(".tmp-*")) == []
