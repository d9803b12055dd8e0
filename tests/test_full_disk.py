"""A full disk (issue 29, case 6): with less room than SQLite's WAL index needs (32 KiB), `rm` and `doctor`
still run (they free space) and every other command exits 2 saying "disk full", never "disk I/O error".

On a real small file system: a tmpfs mounted in a user and mount namespace (`unshare -r -m`), which needs no
root where unprivileged user namespaces are allowed (skipped where they are not). The store is made, the disk
filled and the commands run inside that namespace by one script; it reports each command's exit status and
stderr as JSON lines on the real disk.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvchat

REPO = Path(kvchat.__file__).resolve().parents[1]


def _can_mount_tmpfs(where: Path) -> bool:
    if shutil.which("unshare") is None:
        return False
    where.mkdir(exist_ok=True)
    probe = subprocess.run(["unshare", "-r", "-m", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs '{where}'"],
                           capture_output=True)  # fmt: skip
    return probe.returncode == 0


# Run inside the namespace: argv = mount point, report path, room to leave, then one command per argument.
SCENARIO = r'''
import json, os, subprocess, sys
from pathlib import Path

import torch

from kvchat.model.encoder import embedding_dimension
from kvchat.store import Store

mount, report, room, commands = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
home = mount / "home"
store = Store(home)
for name, values in (("big", 65536), ("small", 4)):  # "big": two episode files of 256 KiB
    with store.begin(name) as pending:
        for i in range(2):
            pending.write_episode(i, {"k.0": torch.zeros(values, dtype=torch.float32) + i}, {"fingerprint": "fp"},
                                  centroid=[float(i), 1.0] + [0.0] * (embedding_dimension() - 2),
                                  medoid_text=f"episode {i}", budgets=[4], n_tokens=8)
        pending.commit(model="default", fingerprint="fp", settings={"budget": 64}, stats={})
store.close()
turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
(mount / "history.json").write_text(json.dumps(turns))
fd = os.open(mount / "filler", os.O_WRONLY | os.O_CREAT)
for chunk in (1 << 16, 1 << 12):
    try:
        while True:
            os.write(fd, bytes(chunk))
    except OSError:
        pass
os.close(fd)
os.truncate(mount / "filler", os.path.getsize(mount / "filler") - room)
env = dict(os.environ, KVCHAT_HOME=str(home))
with open(report, "w") as out:
    for command in commands:
        if command.startswith("!flip "):  # a byte of the conversation's first episode file, in place: no room taken
            with open(sorted((home / "caches" / command.split()[1]).glob("*/*.safetensors"))[0], "r+b") as f:
                f.seek(-1, os.SEEK_END)
                last = f.read(1)
                f.seek(-1, os.SEEK_END)
                f.write(bytes([last[0] ^ 0xFF]))
            continue
        args = command.replace("MOUNT", str(mount)).split()
        done = subprocess.run([sys.executable, "-m", "kvchat", *args], env=env, capture_output=True, text=True)
        out.write(json.dumps({"command": command, "code": done.returncode, "stdout": done.stdout,
                              "stderr": done.stderr, "free": os.statvfs(mount).f_bavail * os.statvfs(mount).f_frsize})
                  + "\n")
'''


def _on_a_full_disk(tmp_path: Path, room: int, *commands: str) -> dict[str, dict]:
    mount = tmp_path / "mnt"
    if not _can_mount_tmpfs(mount):
        pytest.skip("cannot mount a tmpfs without root here (unprivileged user namespaces are off)")
    script, report = tmp_path / "scenario.py", tmp_path / "report.jsonl"
    script.write_text(SCENARIO)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    shell = 'mount -t tmpfs -o size=2m tmpfs "$1" && shift && exec "$@"'
    ran = subprocess.run(["unshare", "-r", "-m", "sh", "-c", shell, "sh", str(mount), sys.executable, str(script),
                          str(mount), str(report), str(room), *commands], env=env, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    results = [json.loads(line) for line in report.read_text().splitlines()]
    assert [r["command"] for r in results] == [c for c in commands if not c.startswith("!")]
    return results


def _disk_full(result: dict) -> bool:
    lines = result["stderr"].strip().splitlines()
    return result["code"] == 2 and len(lines) == 1 and "disk full" in lines[0] and "I/O error" not in lines[0]


@pytest.mark.parametrize("room", [0, 16 * 1024])
def test_on_a_full_disk_rm_and_doctor_run_and_every_other_command_says_disk_full(tmp_path, room):
    results = _on_a_full_disk(
        tmp_path, room,
        "list", "show small", "logs", "ingest MOUNT/history.json --name x", "ask hello --conversation small", "doctor",
        "rm big", "list --json", "doctor",
    )  # fmt: skip
    refused, doctor, rm, listed, healthy = results[:5], results[5], results[6], results[7], results[8]
    assert [r["command"] for r in refused if not _disk_full(r)] == [], refused
    assert "`kvchat rm NAME` and `kvchat doctor --fix` still run" in refused[0]["stderr"]
    assert doctor["code"] == 0 and doctor["stdout"] == "healthy\n", doctor
    assert rm["code"] == 0 and rm["stdout"] == "removed big\n", rm
    assert rm["free"] > 512 * 1024  # its two episode files are gone
    assert listed["code"] == 0, listed
    assert [c["name"] for c in json.loads(listed["stdout"])["conversations"]] == ["small"]
    assert healthy["code"] == 0 and healthy["stdout"] == "healthy\n", healthy


def test_on_a_full_disk_doctor_fix_removes_a_damaged_conversation(tmp_path):
    """`doctor --fix` removes a damaged conversation whole (here: one whose episode file is gone) where there is
    no room to record the removal before deleting its files."""
    found, fixed, listed = _on_a_full_disk(tmp_path, 0, "!flip big", "doctor", "doctor --fix", "list --json")
    assert found["code"] == 1 and "conversation 'big' episode 0" in found["stdout"], found
    assert fixed["code"] == 0 and "fixed: removed conversation 'big'" in fixed["stdout"], fixed
    assert fixed["free"] > 512 * 1024
    assert [c["name"] for c in json.loads(listed["stdout"])["conversations"]] == ["small"], listed
