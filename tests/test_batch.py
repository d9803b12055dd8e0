"""Batch ingest on a real local Ray (kvchat.ingest.batch): histories committed all or nothing by the driver, bad
files reported without stopping the others, killed workers retried elsewhere, Ctrl-C, re-runs skipping
what is stored. One Ray instance (2 CPUs) serves the whole module; each batch starts its own 2 workers."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from cli_helpers import run_main

from kvchat.config import BatchConfig, CacheConfig, EpisodeConfig, IngestConfig, OffloadConfig, RecallConfig
from kvchat.errors import UserError
from kvchat.history.synthetic import planted_conversation
from kvchat.store import Store

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="ray is not installed: pip install 'kvchat[batch]'")  # fmt: skip
# `make test` runs the module's Ray tests on one xdist worker (--dist loadgroup), so one Ray serves them.
pytestmark = pytest.mark.xdist_group("ray")

EPISODES = 4
SMALL = ("--budget", "64", "--setting", "block_size=32", "--episodes", str(EPISODES))


def _config(model_dir: Path, budget: int = 64) -> IngestConfig:
    return IngestConfig(model=str(model_dir), cache=CacheConfig(budget=budget, block_size=32),
                        episodes=EpisodeConfig(episodes=EPISODES))  # fmt: skip


@pytest.fixture(scope="module")
def worker_tmp() -> Path:
    """The temp dir of the module's Ray workers (TMPDIR when Ray starts them): what they leave is seen there.
    Short, under /tmp: Ray puts its sockets there, and a socket's path has at most 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="kvchat-test-", dir="/tmp" if os.path.isdir("/tmp") else None))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_instance(worker_tmp):
    """One local Ray for the module: starting one takes about 10 s."""
    ray = pytest.importorskip("ray")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TMPDIR", str(worker_tmp))
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> list[Path]:
    """Four small histories (32 turns, 8 segments each) and a file that is not a history."""
    folder = tmp_path_factory.mktemp("batch")
    found = []
    for i in range(4):
        path = folder / f"h{i}.json"
        path.write_text(json.dumps(planted_conversation(seed=i, topics=4, turns_per_topic=8)[0]))
        found.append(path)
    bad = folder / "bad.json"
    bad.write_text("this is not JSON")
    return [*found, bad]


class Recorder:
    """A BatchProgress that keeps what it saw; `on_episode` may act on it (kill a worker, press Ctrl-C)."""

    def __init__(self, on_episode=None) -> None:
        self.on_episode = on_episode
        self.workers: dict[str, list] = {}  # history -> the worker of each try
        self.retried: list[str] = []
        self.results: list = []

    def start(self, total, workers):
        pass

    def running(self, name, attempt, worker):
        self.workers.setdefault(name, []).append(worker)

    def episode(self, name, done, total):
        if self.on_episode is not None:
            self.on_episode(self, name, done, total)

    def retrying(self, name, why):
        self.retried.append(name)

    def finished(self, result):
        self.results.append(result)


def _batch(files, home, model_dir, progress=None, **options):
    from kvchat.ingest.batch import histories, ingest_batch

    return ingest_batch(histories(files), store=Store(home), config=_config(model_dir, options.pop("budget", 64)),
                        batch=BatchConfig(workers=2), progress=progress, **options)  # fmt: skip


def _temp_dirs(home: Path) -> list[Path]:
    return sorted((home / "caches").glob(".tmp-*"))


def _assert_whole(home: Path, names: set[str]) -> None:
    """Exactly `names` are stored, each with every episode loadable; doctor finds nothing; no temp dir."""
    store = Store(home, clean_stale=False)
    stored = {c.name: c for c in store.conversations()}
    assert set(stored) == names
    for record in stored.values():
        assert len(record.episodes) == EPISODES
        for episode in record.episodes:
            store.load_episode(episode, record.fingerprint)  # size, sha256, header, fingerprint
    assert store.check() == []
    assert _temp_dirs(home) == []


@needs_ray
def test_four_histories_and_a_bad_file_on_two_workers(ray_instance, files, tmp_path, tiny_model_dir, tiny_lm,
                                                      encoder):  # fmt: skip
    from kvchat.ingest.pipeline import ingest

    progress = Recorder()
    report = _batch(files, tmp_path / "home", tiny_model_dir, progress)
    status = {h.name: h.status for h in report.histories}
    assert status == {"h0": "committed", "h1": "committed", "h2": "committed", "h3": "committed", "bad": "failed"}
    bad = report.histories[-1]
    assert "bad.json" in bad.error and "JSON" in bad.error and bad.attempts == 0
    assert len({id(w) for tries in progress.workers.values() for w in tries}) == 2  # both workers ingested
    assert report.count("committed") == 4 and report.cache_bytes > 0
    _assert_whole(tmp_path / "home", {"h0", "h1", "h2", "h3"})

    # A worker builds what `kvchat ingest` builds in-process: the same tensors and metadata. (Not the same
    # bytes: safetensors writes the metadata's keys in an order of its own.)
    alone = Store(tmp_path / "alone")
    ingest(files[0], name="h0", config=_config(tiny_model_dir), store=alone, lm=tiny_lm, encoder=encoder)
    batch_store = Store(tmp_path / "home")
    batch_record, alone_record = batch_store.get("h0"), alone.get("h0")
    assert batch_record.settings == alone_record.settings
    assert len(batch_record.episodes) == len(alone_record.episodes)
    for ours, theirs in zip(batch_record.episodes, alone_record.episodes, strict=True):
        assert ours.centroid == theirs.centroid and ours.medoid_text == theirs.medoid_text
        tensors, metadata = batch_store.load_episode(ours, batch_record.fingerprint)
        expected, expected_metadata = alone.load_episode(theirs, alone_record.fingerprint)
        assert metadata == expected_metadata
        assert tensors.keys() == expected.keys()
        assert all(torch.equal(tensors[key], expected[key]) for key in tensors)


@needs_ray
def test_a_batch_with_offload_stores_the_pages_and_answers_from_them(ray_instance, files, tmp_path, tiny_model_dir,
                                                                     tiny_lm, encoder):  # fmt: skip
    """Workers run the ingest's own episode loop: with --offload icecache every episode's pages file is stored
    (paged by the worker, written by the driver), as `kvchat ingest` stores it, and questions are answered."""
    from kvchat.answer.session import Session
    from kvchat.ingest.batch import histories, ingest_batch
    from kvchat.ingest.pipeline import ingest

    plain = _config(tiny_model_dir)
    config = replace(plain, cache=replace(plain.cache, offload=OffloadConfig(mode="icecache", retrieve=32)))
    report = ingest_batch(histories(files[:2]), store=Store(tmp_path / "home"), config=config,
                          batch=BatchConfig(workers=2))  # fmt: skip
    assert [h.status for h in report.histories] == ["committed", "committed"]
    assert all(h.report.offloaded_entries > 0 and h.report.pages_bytes > 0 for h in report.histories)
    store = Store(tmp_path / "home")
    assert store.check() == []
    record = store.get("h0")
    alone = Store(tmp_path / "alone")
    ingest(files[0], name="h0", config=config, store=alone, lm=tiny_lm, encoder=encoder)
    alone_record = alone.get("h0")
    assert record.settings == alone_record.settings and record.settings["offload"] == "icecache"
    for ours, theirs in zip(record.episodes, alone_record.episodes, strict=True):
        pages, _ = store.load_pages(ours, record.fingerprint)  # size, sha256, header, fingerprint
        expected, _ = alone.load_pages(theirs, alone_record.fingerprint)
        assert pages.keys() == expected.keys() and all(torch.equal(pages[k], expected[k]) for k in pages)
    answer = Session(store, record, tiny_lm, encoder).ask("Where did Alice go?", log=False)
    assert answer.answer_tokens > 0


@needs_ray
def test_a_batch_with_stored_recall_entries_writes_the_file_an_ingest_writes(
    ray_instance, files, tmp_path, tiny_model_dir, tiny_lm, encoder
):
    """With --recall-entries stored a worker computes the recall entries file and the driver writes it: the file
    `kvchat ingest` writes, byte for byte."""
    from kvchat.ingest.batch import histories, ingest_batch
    from kvchat.ingest.pipeline import ingest

    plain = _config(tiny_model_dir, budget=128)
    config = replace(plain, cache=replace(plain.cache, method="recall", recall=RecallConfig(entries="stored")))
    report = ingest_batch(histories(files[:1]), store=Store(tmp_path / "home"), config=config,
                          batch=BatchConfig(workers=2))  # fmt: skip
    assert [h.status for h in report.histories] == ["committed"], report.histories[0].error
    assert report.histories[0].report.recall_entries_bytes
    store = Store(tmp_path / "home")
    assert store.check() == []
    alone = Store(tmp_path / "alone")
    ingest(files[0], name="h0", config=config, store=alone, lm=tiny_lm, encoder=encoder)
    ours, theirs = store.get("h0").recall_entries, alone.get("h0").recall_entries
    assert ours is not None and theirs is not None and ours.sha256 == theirs.sha256


@needs_ray
def test_a_rerun_skips_what_is_stored_with_the_same_settings(ray_instance, files, tmp_path, tiny_model_dir):
    home = tmp_path / "home"
    _batch(files[:2], home, tiny_model_dir)
    before = {c.name: c.created_at for c in Store(home).conversations()}

    again = _batch(files, home, tiny_model_dir)
    assert [h.status for h in again.histories] == ["skipped", "skipped", "committed", "committed", "failed"]
    after = {c.name: c.created_at for c in Store(home).conversations()}
    assert {name: after[name] for name in before} == before  # not built again
    _assert_whole(home, {"h0", "h1", "h2", "h3"})


@needs_ray
def test_a_killed_worker_leaves_its_history_absent_and_it_is_retried_elsewhere(ray_instance, files, tmp_path,
                                                                                tiny_model_dir):  # fmt: skip
    home = tmp_path / "home"
    seen = {}

    def kill_during_first_try(progress, name, done, total):
        if name == "h1" and done == 1 and len(progress.workers[name]) == 1:
            assert _temp_dirs(home), "the history's first episode waits in a temp dir"
            ray_instance.kill(progress.workers[name][0])  # what a lost node does to its actor
        if name == "h1" and done == 0 and len(progress.workers[name]) == 2:  # the retry has started
            seen["stored then"] = {c.name for c in Store(home).conversations()}

    progress = Recorder(kill_during_first_try)
    report = _batch(files[:4], home, tiny_model_dir, progress)
    assert progress.retried == ["h1"]
    assert "h1" not in seen["stored then"]
    first, second = progress.workers["h1"]
    assert first is not second
    assert {h.name: (h.status, h.attempts) for h in report.histories}["h1"] == ("committed", 2)
    assert report.count("committed") == 4
    _assert_whole(home, {"h0", "h1", "h2", "h3"})


@needs_ray
def test_a_history_whose_worker_dies_twice_fails_and_the_rest_is_intact(ray_instance, files, tmp_path,
                                                                         tiny_model_dir):  # fmt: skip
    home = tmp_path / "home"

    def kill_every_try(progress, name, done, total):
        if name == "h3" and done == 1:
            ray_instance.kill(progress.workers[name][-1])

    progress = Recorder(kill_every_try)
    report = _batch(files[:4], home, tiny_model_dir, progress)
    result = {h.name: h for h in report.histories}["h3"]
    assert (result.status, result.attempts) == ("failed", 2)
    assert "worker died" in result.error
    assert [h.status for h in report.histories[:3]] == ["committed"] * 3
    _assert_whole(home, {"h0", "h1", "h2"})


@needs_ray
def test_workers_leave_no_profiles_dir_behind(ray_instance, worker_tmp, files, tmp_path, tiny_model_dir):
    """Issue 29, case 10: the actors are killed at the end of a batch, so nothing they hold is cleaned up then."""
    home = tmp_path / "home"
    (home / "profiles").mkdir(parents=True)
    (home / "profiles" / "other.json").write_text("{}")  # a profile the workers are handed (for other weights)
    _batch(files[:2], home, tiny_model_dir)
    assert sorted(p.name for p in worker_tmp.glob("kvchat-profiles-*")) == []


@needs_ray
def test_ctrl_c_stops_the_batch_and_leaves_no_temp_dir(ray_instance, files, tmp_path, tiny_model_dir):
    home = tmp_path / "home"

    def interrupt(progress, name, done, total):
        if name == "h2" and done == 2:
            raise KeyboardInterrupt

    progress = Recorder(interrupt)
    with pytest.raises(KeyboardInterrupt):
        _batch(files[:4], home, tiny_model_dir, progress)
    committed = {r.name for r in progress.results if r.status == "committed"}
    assert "h2" not in committed
    _assert_whole(home, committed)


@needs_ray
def test_the_command_reports_json_replaces_with_other_settings_and_exits_2(ray_instance, files, tmp_path,
                                                                           tiny_model_dir):  # fmt: skip
    home = tmp_path / "home"
    manifest = tmp_path / "batch.txt"
    manifest.write_text(f"# name path\nfirst {files[0]}\nsecond\t{files[1]}\n\n")
    args = ["ingest-batch", *map(str, files[2:]), "--manifest", str(manifest), "--model", str(tiny_model_dir),
            "--workers", "2", *SMALL]  # fmt: skip
    run = run_main(home, *args, "--json")
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines()[-1] == "kvchat: error: 1 of 5 histories failed"
    document = json.loads(run.stdout)
    assert document["schema"] == 1 and (document["committed"], document["failed"]) == (4, 1)
    entries = {h["name"]: h for h in document["histories"]}
    assert set(entries) == {"h2", "h3", "bad", "first", "second"}
    assert entries["first"]["episode_count"] == EPISODES and entries["first"]["cache_bytes"] > 0
    assert entries["first"]["timings_ms"]["total"] > 0 and entries["bad"]["status"] == "failed"

    # Other settings: refused without --replace, replaced with it.
    other = [a if a != "64" else "48" for a in args]
    refused = run_main(home, *other, "--json")
    assert refused.returncode == 2
    errors = {h["name"]: h["error"] for h in json.loads(refused.stdout)["histories"]}
    assert "exists with other settings (budget)" in errors["first"] and "use --replace" in errors["first"]
    replaced = run_main(home, *other, "--replace")
    assert replaced.returncode == 2  # bad.json still fails
    assert "4 committed, 0 skipped, 1 failed" in replaced.stderr  # stdout piped: the TSV table alone
    lines = [line.split("\t") for line in replaced.stdout.splitlines()]
    assert lines[0] == ["conversation", "status", "episodes", "MiB", "seconds", "tries", "error"]
    assert len(lines) == 6 and all(len(fields) == 7 for fields in lines)
    assert {c.settings["budget"] for c in Store(home).conversations()} == {48}
    _assert_whole(home, {"h2", "h3", "first", "second"})


@needs_ray
def test_a_batch_reads_every_history_with_format_and_pick(ray_instance, tmp_path, tiny_model_dir):
    export = Path(__file__).parent / "data" / "good" / "chatgpt_export.json"
    args = ["ingest-batch", str(export), "--pick", "Tomato plants", "--format", "chatgpt", "--model",
            str(tiny_model_dir), "--workers", "1", "--budget", "64", "--setting", "block_size=32", "--episodes", "1",
            "--json"]
    run = run_main(tmp_path, *args)
    assert run.returncode == 0, run.stderr
    (entry,) = json.loads(run.stdout)["histories"]
    assert entry["status"] == "committed" and entry["turns"] == 2
    assert Store(tmp_path).get("chatgpt_export").settings["reads"] == {str(export.resolve()): {
        "format": "chatgpt", "pick": "Tomato plants"}}
    again = json.loads(run_main(tmp_path, *args).stdout)["histories"][0]
    assert again["status"] == "skipped"  # read the same way: the same settings


@needs_ray
def test_batch_workers_build_with_the_weights_asked_for(ray_instance, tmp_path, tiny_model_dir):
    export = Path(__file__).parent / "data" / "good" / "chatgpt_export.json"
    run = run_main(tmp_path, "ingest-batch", str(export), "--pick", "Tomato plants", "--model", str(tiny_model_dir),
                   "--workers", "1", "--budget", "64", "--setting", "block_size=32", "--episodes", "1",
                   "--weights", "int4", "--json")  # fmt: skip
    assert run.returncode == 0, run.stderr
    (entry,) = json.loads(run.stdout)["histories"]
    assert entry["status"] == "committed" and entry["weights"] == "int4"
    assert Store(tmp_path).get("chatgpt_export").stats["weights"] == "int4"


@needs_ray
def test_more_threads_than_cores_are_refused(files, tmp_path):
    run = run_main(tmp_path / "home", "ingest-batch", str(files[0]), "--workers", "100000")
    assert run.returncode == 2
    assert run.stderr.startswith("kvchat: error: --workers 100000 x --threads 1 needs 100000 CPUs but ")


def test_the_batch_extra_installs_rays_client_for_a_ray_address():
    import tomllib

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    extra = project["optional-dependencies"]
    assert [d.split("==")[0] for d in extra["batch"]] == ["ray[client]"]


def test_without_ray_the_command_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    history = tmp_path / "h.json"  # a history that exists: a missing one is refused before Ray is looked for
    history.write_text(json.dumps([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]))
    run = run_main(tmp_path / "home", "ingest-batch", str(history))
    assert run.returncode == 2
    # only kvchat's lines: an earlier test's Ray workers in this process may still forward a log line meanwhile
    ours = [line for line in run.stderr.splitlines() if line.startswith("kvchat")]
    assert ours == ["kvchat: error: batch ingest needs Ray: pip install 'kvchat[batch]'"]


def test_histories_are_named_before_anything_runs(tmp_path):
    from kvchat.ingest.batch import histories, read_manifest

    manifest = tmp_path / "m.txt"
    manifest.write_text("# comment\n\nalice  sub dir/alice.json\nbob /abs/bob.json\n")
    assert [(s.name, str(s.path)) for s in read_manifest(manifest)] == [
        ("alice", str(tmp_path / "sub dir" / "alice.json")), ("bob", "/abs/bob.json")]
    with pytest.raises(UserError, match="two histories would be conversation 'alice'"):
        histories([tmp_path / "alice.json"], [manifest])
    manifest.write_text("alice\n")
    with pytest.raises(UserError, match=r"m.txt:1: expected NAME PATH"):
        read_manifest(manifest)
    with pytest.raises(UserError, match="no histories"):
        histories([], [])
    run = run_main(tmp_path / "home", "ingest-batch", str(tmp_path / "a" / "x.json"), str(tmp_path / "b" / "x.json"))
    assert run.returncode == 2 and "name them in a --manifest" in run.stderr


def test_a_stored_conversation_differs_in_what_a_rerun_would_change(files, tiny_lm, encoder):
    from kvchat.ingest.batch import StoredIngest, stored_differences
    from kvchat.ingest.pipeline import plan_ingest
    from kvchat.settings import to_settings

    config = IngestConfig(cache=CacheConfig(budget=64, block_size=32), episodes=EpisodeConfig(episodes=EPISODES))
    plan = plan_ingest(files[0], name="h0", config=config, store=None, lm=tiny_lm, encoder=encoder, replace=True,
                       profile_dirs=[])  # fmt: skip
    fingerprint = tiny_lm.fingerprint
    settings = json.loads(json.dumps(to_settings(plan.config, source=plan.source)))
    stored = StoredIngest(settings, fingerprint, plan.turns, plan.history_tokens)
    assert stored_differences(stored, plan, fingerprint, config) == []

    # --prefill auto accepts either prefill it may resolve to; an explicit one does not.
    other = StoredIngest({**settings, "prefill": "block" if plan.prefill == "full" else "full"}, fingerprint,
                         plan.turns, plan.history_tokens)  # fmt: skip
    assert stored_differences(other, plan, fingerprint, config) == []
    explicit = IngestConfig(cache=CacheConfig(budget=64, block_size=32, prefill=plan.prefill),
                            episodes=EpisodeConfig(episodes=EPISODES))  # fmt: skip
    assert stored_differences(other, plan, fingerprint, explicit) == ["settings (prefill)"]

    changed = StoredIngest({**settings, "budget": 128}, "another model", plan.turns + 1, plan.history_tokens)
    assert stored_differences(changed, plan, fingerprint, config) == [
        "settings (budget)", "model", f"history ({plan.turns + 1} turns stored, {plan.turns} now)"]
