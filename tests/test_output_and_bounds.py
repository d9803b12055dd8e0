"""Output that cannot be written and options past their bounds are the user's to fix: exit 2 and one line on
stderr, never an internal error (issue 29, case 9)."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch
from cli_helpers import KVCHAT, cli_env, run_main
from conftest import raises_said

from kvchat.errors import UserError
from kvchat.model.llm import generate


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("args", [("list",), ("list", "--json")])
def test_a_full_stdout_is_one_line_saying_disk_full(tmp_path, args):
    with open("/dev/full", "w") as full:
        result = subprocess.run([*KVCHAT, *args], stdout=full, stderr=subprocess.PIPE, text=True,
                                env=cli_env(tmp_path / "home"), timeout=300)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == ["kvchat: error: cannot write standard output: No space left on device "
                                          "(disk full)"]


@pytest.mark.skipif(os.name == "nt", reason="POSIX shell redirection")
def test_a_closed_stdout_is_refused_in_one_line(tmp_path):
    command = " ".join([*KVCHAT, "ask", "--conversation", "x", "q"]) + " >&-"
    result = subprocess.run(["sh", "-c", command], stderr=subprocess.PIPE, text=True,
                            env=cli_env(tmp_path / "home"), timeout=300)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == ["kvchat: error: standard output is closed; redirect it to /dev/null to "
                                          "discard it"]
    assert not (tmp_path / "home" / "kvchat.db").exists()  # refused before it opened anything


def test_logs_count_past_sqlites_integers_is_refused(tmp_path):
    result = run_main(tmp_path, "logs", "-n", "99999999999999999999999")
    assert result.returncode == 2 and "-n must be within 1..4611686018427387904" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_an_answer_longer_than_the_models_context_is_refused_before_anything_is_reserved(tiny_lm):
    context = tiny_lm.model.config.max_position_embeddings
    with raises_said(UserError, f"--max-new-tokens must be within 1..{context}"):
        next(generate(tiny_lm, None, torch.zeros(1, 1, dtype=torch.long), 10**9))


def test_a_disk_io_error_on_a_nearly_full_disk_says_disk_full(tmp_path, monkeypatch):
    """SQLite says only "disk I/O error" when it cannot create its WAL files on a full disk (issue 29, case 6)."""
    import shutil
    import sqlite3

    from kvchat.store import files
    from kvchat.store.errors import database_error

    error = sqlite3.OperationalError("disk I/O error")
    error.sqlite_errorname = "SQLITE_IOERR_SHMOPEN"
    assert "disk full" not in str(database_error(tmp_path / "kvchat.db", error))
    monkeypatch.setattr(files.shutil, "disk_usage", lambda where: shutil._ntuple_diskusage(10**9, 10**9, 4096))
    assert str(database_error(tmp_path / "kvchat.db", error)).startswith("disk full: cannot open")


def test_train_indexer_data_given_a_directory_says_what_it_takes(tmp_path):
    result = run_main(tmp_path / "home", "train-indexer", "--data", str(tmp_path))
    assert result.returncode == 2, result.stderr
    assert "a directory; --data takes files (chat histories or .txt)" in result.stderr
