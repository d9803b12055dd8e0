"""A first GGUF conversion (issue 28's first hour, issue 29's case 6): it shows itself once on stderr, with its size
and an estimate; a disk without room for the copy refuses it before it starts; a disk that fills meanwhile ends it
with one "disk full" line (exit 2), nothing half-written left in `models/`.

transformers' GGUF reading (the slow dequantization) is replaced, in this test process only, by loading the tiny
model: what is tested is kvchat's side of the conversion (its checks, writes, clean-up and reports)."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest
from cli_helpers import run_main
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvchat.errors import UserError
from kvchat.model import files as model_files

TINY = ("--budget", "64", "--setting", "block_size=32", "--episodes", "2")
WEIGHTS = 123_000_000


@pytest.fixture
def gguf(tmp_path, monkeypatch, tiny_model_dir) -> Path:
    """A `.gguf` path whose conversion loads the tiny model (its check says it holds WEIGHTS weights)."""
    path = tmp_path / "little.gguf"
    path.write_bytes(b"GGUF" + bytes(2**20))

    monkeypatch.setattr(model_files, "_check_gguf", lambda p: WEIGHTS)
    monkeypatch.setattr(model_files, "_gguf_model", lambda gguf: AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    monkeypatch.setattr(model_files, "_gguf_tokenizer", lambda gguf: AutoTokenizer.from_pretrained(tiny_model_dir))
    return path


class Heard:
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def converting(self, gguf: Path, weights: int, estimate_s: float) -> None:
        self.events.append(("converting", gguf, weights, estimate_s))

    def phase(self, what: str) -> None:
        self.events.append(("phase", what))

    def converted(self, seconds: float) -> None:
        self.events.append(("converted",))


def _left_in(models: Path) -> list[str]:
    return sorted(p.name for p in models.iterdir()) if models.exists() else []


def test_a_conversion_reports_its_size_an_estimate_and_its_phases_once(gguf, tmp_path):
    heard = Heard()
    target = model_files.convert_gguf(gguf, tmp_path / "models", heard)
    assert (target / "model.safetensors").is_file()
    kind, path, weights, estimate = heard.events[0]
    assert (kind, path, weights) == ("converting", gguf, WEIGHTS) and estimate > 0
    assert [e[1] for e in heard.events[1:-1]] == [
        "dequantizing the weights", "reading the tokenizer", "writing the safetensors copy"]
    assert heard.events[-1] == ("converted",)
    again = Heard()
    assert model_files.convert_gguf(gguf, tmp_path / "models", again) == target and again.events == []  # once


@pytest.mark.parametrize("error", ["ENOSPC", "safetensors"])
def test_a_disk_that_fills_during_a_conversion_is_one_line_and_leaves_nothing(gguf, tmp_path, monkeypatch, error):
    def fills_up(model, filename: str) -> None:
        Path(filename).write_bytes(b"\0" * 4096)  # part of the file, as a full disk leaves it
        if error == "ENOSPC":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No '
                              'space left on device" })')  # fmt: skip

    monkeypatch.setattr(model_files, "save_model", fills_up)
    models = tmp_path / "models"
    with pytest.raises(UserError, match=rf"^disk full: no space left in {models} while converting little.gguf once"):
        model_files.convert_gguf(gguf, models)
    assert _left_in(models) == []


def test_a_disk_without_room_for_the_copy_refuses_the_conversion_before_it_starts(gguf, tmp_path, monkeypatch):
    monkeypatch.setattr(model_files.shutil, "disk_usage", lambda where: shutil._ntuple_diskusage(10**9, 10**9, 2**20))
    heard = Heard()
    with pytest.raises(UserError, match=r"^disk full: converting little.gguf once needs about 485 MiB in .* and 1 "
                                        r"MiB are free"):  # fmt: skip
        model_files.convert_gguf(gguf, tmp_path / "models", heard)
    assert heard.events == [] and _left_in(tmp_path / "models") == []


def test_the_first_ingest_shows_the_conversion_and_counts_it_in_its_time(gguf, tmp_path, history):
    result = run_main(tmp_path / "home", "ingest", str(history), "--model", str(gguf), *TINY)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    starts = [line for line in lines if line.startswith("kvchat: converting the model little (1 MiB, 123M weights) "
                                                        "once, about ")]  # fmt: skip
    assert len(starts) == 1 and sum(line.startswith("kvchat: model converted in ") for line in lines) == 1
    assert "s reading and loading the model)" in result.stdout
    again = run_main(tmp_path / "home", "ingest", str(history), "--model", str(gguf), *TINY, "--name", "b")
    assert again.returncode == 0 and "converting" not in again.stderr


def test_a_full_disk_during_the_first_conversion_exits_2_with_one_line(gguf, tmp_path, history, monkeypatch):
    def full(model, filename: str) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)

    monkeypatch.setattr(model_files, "save_model", full)
    result = run_main(tmp_path / "home", "ingest", str(history), "--model", str(gguf), *TINY)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if not line.startswith("kvchat: converting")]
    assert len(errors) == 1 and errors[0].startswith("kvchat: error: disk full: no space left in "), result.stderr
    assert _left_in(tmp_path / "home" / "models") == []
