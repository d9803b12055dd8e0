"""`kvchat ingest-batch --address` on a real two-node Ray cluster on this machine (issue 29, "Ray for real"): a head
(`ray start --head`, one CPU) and a second node (`ray start --address`, one CPU and a resource of its own), both with
a small object store. The second node's worker holds after sending each episode until the test releases it (the
test hook `kvchat.store.files.hold_point`, set in that node's environment only), so its history is always unfinished
when the test kills the node (its raylet, SIGKILL) on seeing that history's first episode written: the history is
retried on the head's worker, which does not hold, and nothing is lost.

`kvchat ingest --ray --address` (one history's parts on the workers, issue 43) on the same cluster: the second node's
worker holds after sending its episode's first checkpoint, the node is killed, the episode goes on from that
checkpoint on the head's worker, and the files are a local ingest's, byte for byte.

Heavy on a small machine: run it alone. The cluster's processes are ended by their ids (every process whose command
line names this test's session dir, and their children), never by name, so another Ray on the machine is left alone;
the session dir is removed, whether the test passes or fails.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
from cli_helpers import run_main

from kvchat.history.synthetic import planted_conversation
from kvchat.store import Store
from kvchat.store.files import HOLD_AT

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                       reason="ray is not installed: pip install 'kvchat[batch]'"),  # fmt: skip
    pytest.mark.skipif(shutil.which("ray", path=str(Path(sys.executable).parent)) is None,
                       reason="the `ray` command is not installed beside this Python"),  # fmt: skip
    pytest.mark.xdist_group("ray"),
]

EPISODES = 4
SMALL = ("--budget", "64", "--setting", "block_size=32", "--episodes", str(EPISODES))
BLOCK_PREFILL = ("--setting", "prefill=block")
OBJECT_STORE = str(80 * 2**20)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray(*args: str, env: dict[str, str]) -> None:
    ray = str(Path(sys.executable).parent / "ray")
    done = subprocess.run([ray, *args], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr


def _ours(session: Path):
    """The processes of this cluster: those whose command line names `session`, and their children."""
    import psutil

    found = {}
    for process in psutil.process_iter(["cmdline"]):
        if any(str(session) in part for part in process.info["cmdline"] or ()):
            found[process.pid] = process
            for child in process.children(recursive=True):
                found[child.pid] = child
    return list(found.values())


def _raylet_of_port(session: Path, port: int):
    return next(p for p in _ours(session) if any(f"--node_manager_port={port}" in a for a in p.cmdline()))


@pytest.fixture
def cluster():
    """(head address, the second node's node-manager port, session dir, env, the file that releases the second
    node's held worker): two nodes on this machine."""
    session = Path(tempfile.mkdtemp(prefix="kr-", dir="/tmp"))  # sockets: a path of at most 107 bytes
    # Ray's token authentication: every node and the driver share one token
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", TMPDIR=str(session), RAY_AUTH_MODE="token",
               RAY_AUTH_TOKEN=secrets.token_hex(32))
    env.pop("RAY_ADDRESS", None)
    head, second = _free_port(), _free_port()
    address = f"127.0.0.1:{head}"
    release = session / "release-second-node"
    try:
        _ray("start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(head), "--num-cpus", "1",
             "--object-store-memory", OBJECT_STORE, "--temp-dir", str(session), "--include-dashboard", "false",
             env=env)  # fmt: skip
        _ray("start", "--address", address, "--node-ip-address", "127.0.0.1", "--num-cpus", "1",
             "--object-store-memory", OBJECT_STORE, "--node-manager-port", str(second),
             "--resources", json.dumps({"second_node": 1}),
             env={**env, HOLD_AT: f"batch-episode-sent:{release}"})  # fmt: skip
        yield address, second, session, env, release
    finally:
        release.touch()
        for process in _ours(session):
            try:
                process.kill()
            except Exception:  # noqa: BLE001 - gone already
                pass
        shutil.rmtree(session, ignore_errors=True)


@pytest.fixture
def files(tmp_path) -> list[Path]:
    found = []
    for i in range(4):
        path = tmp_path / f"h{i}.json"
        path.write_text(json.dumps(planted_conversation(seed=i, topics=4, turns_per_topic=8)[0]))
        found.append(path)
    return found


_CHILD = "KVCHAT_CLUSTER_TEST_CHILD"  # set in the fresh pytest process that runs the test itself


@pytest.mark.skipif(bool(os.environ.get(_CHILD)), reason="the child process runs the test itself")
@pytest.mark.parametrize("test", ["test_killing_the_second_node_mid_batch_loses_no_history",
                                  "test_killing_the_second_node_mid_episode_keeps_the_files_of_a_local_ingest"])
def test_the_cluster_test_runs_in_a_fresh_process(test):
    """Ray keeps a process-wide connection (and reads its cluster's token when first imported): another test that
    started a local Ray in this worker, or another cluster's test before it, would make the driver connect there or
    with the wrong token. So each cluster test runs in a pytest process of its own, on a cluster of its own."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           f"{__file__}::{test}"], env={**os.environ, _CHILD: "1"}, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    passed = re.search(r"^1 passed\b", done.stdout, re.M)  # -q's summary line (", 1 warning" may follow)
    assert done.returncode == 0 and passed, done.stdout[-4000:] + done.stderr[-2000:]


@pytest.mark.skipif(not os.environ.get(_CHILD), reason="runs in a fresh process, started by the test above")
def test_killing_the_second_node_mid_batch_loses_no_history(cluster, files, tmp_path, tiny_model_dir, monkeypatch):
    address, second_port, session, env, _ = cluster
    for key in ("TMPDIR", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):  # read when Ray is first imported
        monkeypatch.setenv(key, env[key])
    import ray

    from kvchat.cli import progress as progress_module

    if ray.is_initialized():
        ray.shutdown()  # another module's local Ray: this test's driver joins the cluster
    killed = threading.Event()
    second_node = next(n["NodeID"] for n in ray_nodes(address) if "second_node" in n["Resources"])
    seen: dict[str, object] = {}

    def on_episode(self, name: str, done: int, total: int) -> None:
        """Once a history on the second node's worker has written an episode (the worker now holds): that node
        dies, with the history unfinished."""
        if killed.is_set() or done < 1 or _node_of(seen[name]) != second_node:
            return
        assert done < total, "the second node's worker did not hold after its first episode"
        _raylet_of_port(session, second_port).kill()  # its held worker stays held: released at clean-up only
        killed.set()

    def on_running(self, name: str, attempt: int, worker) -> None:
        seen[name] = worker
        original_running(self, name, attempt, worker)

    original_running = progress_module.LineBatchProgress.running
    monkeypatch.setattr(progress_module.LineBatchProgress, "running", on_running)
    monkeypatch.setattr(progress_module.LineBatchProgress, "episode", on_episode)
    home = tmp_path / "home"
    result = run_main(home, "ingest-batch", *map(str, files), "--address", address, "--workers", "2", "--threads",
                      "1", "--model", str(tiny_model_dir), *SMALL, "--json")  # fmt: skip
    assert killed.is_set(), "no history ran on the second node"
    assert result.returncode == 0, result.stderr
    assert "retrying" in result.stderr, result.stderr  # the killed node's unfinished history, on the head
    store = Store(home)
    stored = {c.name: c for c in store.conversations()}
    assert set(stored) == {f.stem for f in files}
    for record in stored.values():
        assert len(record.episodes) == EPISODES
        for episode in record.episodes:
            store.load_episode(episode, record.fingerprint)
    assert store.check() == []


@pytest.mark.skipif(not os.environ.get(_CHILD), reason="runs in a fresh process, started by the test above")
def test_killing_the_second_node_mid_episode_keeps_the_files_of_a_local_ingest(cluster, files, tmp_path,
                                                                              tiny_model_dir, monkeypatch):  # fmt: skip
    address, second_port, session, env, _ = cluster
    for key in ("TMPDIR", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):  # read when Ray is first imported
        monkeypatch.setenv(key, env[key])
    import ray

    from kvchat.cli import progress as progress_module

    if ray.is_initialized():
        ray.shutdown()
    killed = threading.Event()
    second_node = next(n["NodeID"] for n in ray_nodes(address) if "second_node" in n["Resources"])
    parts: dict[str, object] = {}

    def on_running(self, part: str, worker) -> None:
        parts[part] = worker

    def on_checkpoint(self, index: int, blocks: int, total: int) -> None:
        """A checkpoint of an episode on the second node's worker (which now holds): that node dies mid-episode."""
        if killed.is_set() or _node_of(parts[f"episode {index + 1}"]) != second_node:
            return
        assert blocks < total, "the second node's worker did not hold after its first checkpoint"
        _raylet_of_port(session, second_port).kill()
        killed.set()

    monkeypatch.setattr(progress_module.LineIngestProgress, "running", on_running)
    monkeypatch.setattr(progress_module.LineIngestProgress, "checkpoint", on_checkpoint)
    history = files[0]
    # block prefill: only a block-prefilled episode checkpoints (auto picks full prefill for this short a history,
    # whose episodes select from one prefill and never pause)
    spread = run_main(tmp_path / "spread", "ingest", str(history), "--ray", "--address", address, "--workers", "2",
                      "--threads", "1", "--model", str(tiny_model_dir), *SMALL, *BLOCK_PREFILL)  # fmt: skip
    assert killed.is_set(), "no episode ran on the second node"
    assert spread.returncode == 0, spread.stderr
    assert "a worker died" in spread.stderr, spread.stderr
    local = run_main(tmp_path / "local", "ingest", str(history), "--threads", "1", "--model", str(tiny_model_dir),
                     *SMALL, *BLOCK_PREFILL)  # fmt: skip
    assert local.returncode == 0, local.stderr

    def files_of(home: Path) -> dict[str, str]:
        record = Store(home).get(history.stem)
        folder = record.episodes[0].path.parent
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()
                if p.name != "conversation.json"}  # fmt: skip

    assert files_of(tmp_path / "spread") == files_of(tmp_path / "local")
    assert Store(tmp_path / "spread").check() == []


def ray_nodes(address: str) -> list[dict]:
    """The cluster's nodes, asked from a driver of their own (the batch's driver connects afterwards)."""
    import ray

    ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        return [n for n in ray.nodes() if n["Alive"]]
    finally:
        ray.shutdown()


def _node_of(worker) -> str | None:
    """The node an actor runs on, from Ray's global state (no dashboard needed)."""
    from ray._private.state import actors

    info = actors(worker._actor_id.hex())
    return (info or {}).get("Address", {}).get("NodeID")
