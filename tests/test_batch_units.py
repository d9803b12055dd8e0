"""One history's units spread over Ray workers (`kvchat ingest --ray`, kvchat.ingest.batch_units): the episodes and
the recall chunks' entries built on two local workers, the driver writing the store, give the files a local ingest
gives, byte for byte; a worker killed mid-episode hands its episode on from its last checkpoint; a spread ingest
stopped half-way is continued by a plain one. One Ray instance (2 CPUs) serves the module, as in test_batch.py."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from test_resume import STORED, _config, _files

from kvchat.config import BatchConfig
from kvchat.history.loading import load_history
from kvchat.history.synthetic import planted_conversation
from kvchat.ingest.pipeline import IngestProgress, ingest
from kvchat.store import Store

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                       reason="ray is not installed: pip install 'kvchat[batch]'"),  # fmt: skip
    pytest.mark.xdist_group("ray"),  # one xdist worker runs the Ray tests (make test: --dist loadgroup)
]


@pytest.fixture(scope="module")
def ray_instance():
    """One local Ray for the module, its sockets in a short dir under /tmp (a socket's path has at most 107 bytes)."""
    ray = pytest.importorskip("ray")
    folder = Path(tempfile.mkdtemp(prefix="kvchat-units-", dir="/tmp" if os.path.isdir("/tmp") else None))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TMPDIR", str(folder))
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    yield ray
    ray.shutdown()
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def turns(tmp_path_factory) -> list:
    path = tmp_path_factory.mktemp("units") / "h.json"
    path.write_text(json.dumps(planted_conversation(seed=5, topics=6, turns_per_topic=24)[0]))
    return load_history(path)


class Watch(IngestProgress):
    """Which worker runs each part; `on_checkpoint(self, index, blocks)` may act on a checkpoint as it arrives."""

    def __init__(self, on_checkpoint=None) -> None:
        self.on_checkpoint, self.workers, self.said, self.resumed = on_checkpoint, {}, [], None
        self.methods: list[tuple] = []

    def method(self, name, history_tokens, window) -> None:
        self.methods.append((name, history_tokens, window))

    def running(self, part, worker) -> None:
        self.workers[part] = worker

    def checkpoint(self, index, blocks, total) -> None:
        if self.on_checkpoint is not None:
            self.on_checkpoint(self, index, blocks)

    def note(self, text) -> None:
        self.said.append(text)

    def resuming(self, done, blocks) -> None:
        self.resumed = done


def _spread(home: Path, turns, config, progress=None, **options):
    from kvchat.ingest.batch_units import ingest_spread

    return ingest_spread(turns, name="c", store=Store(home), config=config, batch=BatchConfig(workers=2),
                         progress=progress, resumable=True, **options)  # fmt: skip


def test_two_workers_store_the_files_of_a_local_ingest(ray_instance, turns, tiny_model_dir, tiny_lm, encoder,
                                                       tmp_path):  # fmt: skip
    """Episodes and recall chunks built on two workers: byte for byte the local ingest's files."""
    config = _config(tiny_model_dir, **STORED)
    watch = Watch()
    report = _spread(tmp_path / "ray", turns, config, progress=watch)
    local = Watch()
    ingest(turns, name="c", config=config, store=Store(tmp_path / "local"), lm=tiny_lm, encoder=encoder,
           progress=local)  # fmt: skip
    assert _files(tmp_path / "ray", "c") == _files(tmp_path / "local", "c")
    assert watch.methods == local.methods and len(local.methods) == 1  # announced as a local ingest announces it
    assert report.recall_entries_bytes and report.episodes == 4
    assert len({id(w) for w in watch.workers.values()}) == 2  # both workers had a part
    assert any(part.startswith("recall chunks") for part in watch.workers)
    assert Store(tmp_path / "ray").check() == []


def test_a_worker_killed_mid_episode_hands_it_on_from_its_checkpoint(ray_instance, turns, tiny_model_dir, tiny_lm,
                                                                    encoder, tmp_path):  # fmt: skip
    killed = []

    def kill(self, index, blocks):
        if not killed and blocks >= 2:
            killed.append(index)
            ray_instance.kill(self.workers[f"episode {index + 1}"])

    config = _config(tiny_model_dir)
    watch = Watch(kill)
    _spread(tmp_path / "ray", turns, config, progress=watch)
    assert killed and any("a worker died" in note for note in watch.said), watch.said
    ingest(turns, name="c", config=config, store=Store(tmp_path / "local"), lm=tiny_lm, encoder=encoder)
    assert _files(tmp_path / "ray", "c") == _files(tmp_path / "local", "c")


def test_a_spread_ingest_stopped_half_way_is_continued_by_a_plain_one(ray_instance, turns, tiny_model_dir, tiny_lm,
                                                                     encoder, tmp_path):  # fmt: skip
    def stop(self, index, blocks):
        if blocks >= 3:
            raise KeyboardInterrupt

    config = _config(tiny_model_dir, **STORED)
    home = tmp_path / "home"
    with pytest.raises(KeyboardInterrupt):
        _spread(home, turns, config, progress=Watch(stop))
    assert Store(home).conversations() == []
    progress = Watch()
    ingest(turns, name="c", config=config, store=Store(home), lm=tiny_lm, encoder=encoder, resumable=True,
           progress=progress)  # fmt: skip
    assert progress.resumed is not None
    ingest(turns, name="c", config=config, store=Store(tmp_path / "local"), lm=tiny_lm, encoder=encoder)
    assert _files(home, "c") == _files(tmp_path / "local", "c")


def test_the_command_spreads_and_says_so(ray_instance, turns, tiny_model_dir, tmp_path):
    from cli_helpers import run_main

    history = tmp_path / "h.json"
    history.write_text(json.dumps([{"role": t.role, "content": t.text} for t in turns]))
    done = run_main(tmp_path / "home", "ingest", str(history), "--ray", "--workers", "2", "--model",
                    str(tiny_model_dir), "--budget", "64", "--setting", "block_size=32", "--episodes", "4",
                    "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["episode_count"] == 4
    assert Store(tmp_path / "home").get("h").episodes


def test_episodes_that_evict_nothing_share_one_file_as_in_a_local_ingest(ray_instance, tiny_model_dir, tiny_lm,
                                                                          encoder, tmp_path):  # fmt: skip
    """A budget that holds the whole history (`IngestPlan.one_cache`): one episode is built on a worker and every
    other one's record names its file, byte for byte a local ingest's files."""
    path = tmp_path / "short.json"
    path.write_text(json.dumps(planted_conversation(seed=3, topics=4, turns_per_topic=6)[0]))
    short = load_history(path)
    config = _config(tiny_model_dir, budget=1024)
    watch = Watch()
    report = _spread(tmp_path / "ray", short, config, progress=watch)
    ingest(short, name="c", config=config, store=Store(tmp_path / "local"), lm=tiny_lm, encoder=encoder)
    assert _files(tmp_path / "ray", "c") == _files(tmp_path / "local", "c")
    record = Store(tmp_path / "ray").get("c")
    assert report.episodes == len(record.episodes) > 1 and len({e.path for e in record.episodes}) == 1
    assert [part for part in watch.workers if part.startswith("episode")] == ["episode 1"]  # built once
    assert Store(tmp_path / "ray").check() == []
