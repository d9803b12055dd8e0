"""Files kvchat opens but did not write (profiles, IndexMem weights, --model) that a user, a bad copy or a
hostile hand damaged: each is refused in one line (exit 2) before it can block an open or make kvchat
allocate what it claims (issue 29, cases 4, 5 and 7)."""

from __future__ import annotations

import json
import os
import resource
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import cli_env, run_main
from safetensors.torch import save_file

from kvchat.config import IndexMemConfig
from kvchat.errors import UserError
from kvchat.ingest.layer_profiles import find_indexmem, find_profile, profile_texts
from kvchat.kv.indexer import Indexer, IndexMemShape
from kvchat.kv.latent import MemoryWeights
from kvchat.kv.trained import SUFFIX, TrainedIndexMem
from kvchat.model.llm import weights_fingerprint

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are POSIX")


def _unless_blocked(call, fifo: Path):
    """`call()`'s exception (or None). A watchdog process opens and closes `fifo`'s write end after a minute, so
    a call blocked opening it (which may hold the GIL) sees its end and the test fails instead of hanging."""
    watchdog = subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(fifo)])
    try:
        call()
        error = None
    except Exception as e:  # noqa: BLE001 - handed to the test
        error = e
    finally:
        released = watchdog.poll() is not None
        watchdog.kill()
        watchdog.wait()
    assert not released, f"blocked opening the FIFO {fifo}"
    return error


_WATCHDOG = "import os, sys, time; time.sleep(60); os.close(os.open(sys.argv[1], os.O_WRONLY | os.O_NONBLOCK))"


def test_a_fifo_among_the_layer_profiles_is_refused_not_waited_on(tmp_path, tiny_lm):
    os.mkfifo(tmp_path / "x.json")
    error = _unless_blocked(lambda: find_profile(tiny_lm, [tmp_path]), tmp_path / "x.json")
    assert isinstance(error, UserError) and "not a regular file but a FIFO" in str(error)


def test_a_fifo_among_the_profiles_sent_to_batch_workers_is_refused_not_waited_on(tmp_path):
    (tmp_path / "a.json").write_text("{}")
    os.mkfifo(tmp_path / "x.json")
    error = _unless_blocked(lambda: profile_texts(tmp_path), tmp_path / "x.json")
    assert isinstance(error, UserError) and "not a regular file but a FIFO" in str(error)
    (tmp_path / "x.json").unlink()
    assert profile_texts(tmp_path) == {"a.json": "{}"}


def test_a_fifo_among_the_indexmem_weights_is_refused_not_waited_on(tmp_path, tiny_lm):
    fifo = tmp_path / f"x{SUFFIX}"
    os.mkfifo(fifo)
    error = _unless_blocked(lambda: find_indexmem(tiny_lm, [tmp_path]), fifo)
    assert isinstance(error, UserError) and "not a regular file but a FIFO" in str(error)
    assert "\n" not in str(error)


def test_doctor_reports_a_fifo_among_the_profiles_and_fix_removes_it(tmp_path):
    home = tmp_path / "home"
    (home / "profiles").mkdir(parents=True)
    os.mkfifo(home / "profiles" / "x.json")
    found = run_main(home, "doctor")
    assert found.returncode == 1 and "not a regular file but a FIFO" in found.stdout, found.stdout
    fixed = run_main(home, "doctor", "--fix")
    assert fixed.returncode == 0 and not (home / "profiles" / "x.json").exists(), fixed.stdout
    assert run_main(home, "doctor").stdout.strip() == "healthy"


# --------------------------------------------------------------------------- IndexMem weights


def _indexmem(tiny_lm, directory: Path) -> tuple[Path, dict[str, torch.Tensor], dict[str, str]]:
    """Untrained but well-formed IndexMem weights for the tiny model, saved in `directory`."""
    shape = IndexMemShape.of(tiny_lm.model.config)
    memory = MemoryWeights(shape, IndexMemConfig().readout)
    trained = TrainedIndexMem(shape=shape, indexer=Indexer(shape), memory=memory,
                              weights=weights_fingerprint(tiny_lm.model), model="tiny")
    path = directory / f"w{SUFFIX}"
    trained.save(path)
    return path, trained.tensors(), trained.metadata()


def test_well_formed_indexmem_weights_load(tmp_path, tiny_lm):
    path, *_ = _indexmem(tiny_lm, tmp_path)
    assert find_indexmem(tiny_lm, [tmp_path]).path == path


def _shape_with(tiny_lm, **change) -> str:
    return json.dumps(IndexMemShape.of(tiny_lm.model.config).to_dict() | change)


@pytest.mark.parametrize("damage, fragment", [
    (lambda lm: {"shape": "{not json"}, "shape metadata is not a JSON object"),
    (lambda lm: {"shape": "[1, 2, 3]"}, "shape metadata is not a JSON object"),
    (lambda lm: {"shape": _shape_with(lm, colour=3)}, "names 'colour' wrongly"),
    (lambda lm: {"shape": _shape_with(lm, index_dim=-4)}, "impossible shape in its metadata (index_dim)"),
    (lambda lm: {"shape": _shape_with(lm, index_dim=2**40)}, "impossible shape in its metadata (index_dim)"),
    (lambda lm: {"shape": _shape_with(lm, index_dim=3)}, "tensors do not match the shape in its metadata"),
    (lambda lm: {"config": "[]"}, "config metadata is not a JSON object"),
    (lambda lm: {"recipe": "{"}, "recipe metadata is not a JSON object"),
])  # fmt: skip
def test_damaged_indexmem_metadata_is_refused_in_one_line(tmp_path, tiny_lm, damage, fragment):
    path, tensors, metadata = _indexmem(tiny_lm, tmp_path)
    save_file(tensors, str(path), metadata=metadata | damage(tiny_lm))
    with pytest.raises(UserError) as e:
        find_indexmem(tiny_lm, [tmp_path])
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_nan_indexmem_weights_are_refused(tmp_path, tiny_lm):
    path, tensors, metadata = _indexmem(tiny_lm, tmp_path)
    save_file({k: torch.full_like(v, float("nan")) for k, v in tensors.items()}, str(path), metadata=metadata)
    with pytest.raises(UserError, match="holds NaN or infinite weights"):
        find_indexmem(tiny_lm, [tmp_path])


def test_an_indexmem_header_claiming_more_than_the_file_is_refused(tmp_path, tiny_lm):
    path, *_ = _indexmem(tiny_lm, tmp_path)
    data = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 2**60) + data[8:])
    with pytest.raises(UserError, match="header claims more than the file holds"):
        find_indexmem(tiny_lm, [tmp_path])


# --------------------------------------------------------------------------- --model


def _gguf_claiming(path: Path, count: int) -> Path:
    """A GGUF header with one metadata array of u8 that claims `count` elements and holds none."""
    key = b"a"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
                     + struct.pack("<IIQ", 9, 0, count))
    return path


def _limited_memory() -> None:
    limit = 8 << 30  # the check needs a few MB; without it the reader grows until this stops it
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def test_a_gguf_array_claiming_2_to_the_40_elements_is_refused_before_it_allocates(tmp_path):
    model = _gguf_claiming(tmp_path / "huge.gguf", 2**40)
    result = subprocess.run(
        [sys.executable, "-m", "kvchat", "profile-layers", "--model", str(model)], capture_output=True, text=True,
        env=cli_env(tmp_path / "home"), timeout=300, preexec_fn=_limited_memory,
    )
    assert result.returncode == 2, result.stderr
    assert "damaged GGUF file (the header claims 1099511627776 array elements" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_fifo_given_as_the_model_is_refused(tmp_path):
    fifo = tmp_path / "m.gguf"
    os.mkfifo(fifo)
    outcome: list = []
    error = _unless_blocked(lambda: outcome.append(run_main(tmp_path / "home", "profile-layers", "--model", str(fifo))),
                            fifo)
    assert error is None and outcome[0].returncode == 2
    assert "not a regular file but a FIFO" in outcome[0].stderr


def test_a_fifo_inside_a_model_directory_is_refused(tmp_path, tiny_model_dir):
    model = tmp_path / "model"
    model.mkdir()
    for f in tiny_model_dir.iterdir():
        (model / f.name).symlink_to(f)
    (model / "model.safetensors").unlink()
    os.mkfifo(model / "model.safetensors")
    outcome: list = []
    home = tmp_path / "home"
    error = _unless_blocked(lambda: outcome.append(run_main(home, "profile-layers", "--model", str(model))),
                            model / "model.safetensors")
    assert error is None and outcome[0].returncode == 2
    assert "not a regular file" in outcome[0].stderr


def _cut_short(source: Path, target: Path) -> Path:
    """A copy of the model directory `source` in `target` whose weights file lost its last bytes."""
    target.mkdir(parents=True)
    for f in source.iterdir():
        (target / f.name).write_bytes(f.read_bytes())
    weights = target / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 4096)
    return weights


def test_a_model_directory_whose_weights_are_cut_short_is_refused_before_it_is_mapped(tmp_path, tiny_model_dir):
    """safetensors memory-maps the weights: a file cut short would kill the process (SIGBUS) where it is read."""
    weights = _cut_short(tiny_model_dir, tmp_path / "model")
    result = run_main(tmp_path / "home", "profile-layers", "--model", str(weights.parent))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(weights) in lines[0] and "cut short" in lines[0]
    assert "copy or download the model again" in lines[0]


def test_a_converted_copy_cut_short_is_refused_with_how_to_convert_it_again(tmp_path, tiny_model_dir):
    from kvchat.model.files import _converted_dir, default_gguf_path
    from kvchat.model.llm import load_model

    models = tmp_path / "models"
    copy = _converted_dir(default_gguf_path(), models)
    weights = _cut_short(tiny_model_dir, copy)
    (copy / "kvchat-converted.txt").write_text("a test's copy\n")
    with pytest.raises(UserError) as caught:
        load_model("default", models)
    assert str(weights) in str(caught.value) and f"remove {copy} and kvchat converts the model again" in str(
        caught.value)
