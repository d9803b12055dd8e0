"""Bad options, a full disk, too little memory and damaged caches: each ends in one line on stderr and
exit 2, with nothing written. Runs kvchat's main() in this process (cli_helpers.run_main) to save the
start-up of a process per case; test_cli.py covers the real process."""

from __future__ import annotations

import errno
import json
import os
import shlex
from pathlib import Path

import pytest
from cli_helpers import run_main
from conftest import raises_said

from kvchat import store as store_module
from kvchat.cli.words import error_text
from kvchat.errors import UserError
from kvchat.history.synthetic import planted_conversation
from kvchat.ingest import preflight
from kvchat.ingest.preflight import ModelShape, check_fits, estimate_ingest_bytes
from kvchat.store import Store, validate_name

TINY = ("--budget", "64", "--setting", "block_size=32", "--episodes", "2")


@pytest.fixture
def history(tmp_path: Path) -> Path:
    path = tmp_path / "h.json"
    path.write_text(json.dumps(planted_conversation(seed=2, topics=2, turns_per_topic=8)[0]))
    return path


def _assert_refused(home: Path, result, fragment: str) -> None:
    """Exit 2, one line naming the problem (after the progress lines of a run that had started), nothing on
    stdout, nothing in the store (the model's held weights aside: `auto`'s verdict, kept when the model loaded)."""
    assert result.returncode == 2, (result.stdout, result.stderr)
    progress = ("kvchat: episode ", "kvchat: history ", "kvchat: method ")  # the method is announced at the start
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith(progress)]
    assert len(lines) == 1 and fragment in lines[0] and "Traceback" not in result.stderr, result.stderr
    assert result.stdout == ""
    held = home / "models" / "held"
    assert [p for p in home.rglob("*.safetensors") if p.parent != held] == [] and list(home.rglob(".tmp-*")) == []
    assert Store(home).conversations() == []


@pytest.mark.parametrize(
    "args, fragment",
    [
        (("--budget", "-5"), "--budget must be >= 1"),
        (("--budget", "64", "--setting", "block_size=600"), "more than 8x --budget 64"),
        (("--setting", "block_size=8"), "--setting block_size must be >= 16"),
        (("--episodes", "0"), "--episodes must be >= 1"),
        ((*TINY, "--episodes", "99"), "--episodes 99 is more than the history's"),
        (("--name", "a/b"), "invalid conversation name"),
        (("--name", ".."), "invalid conversation name"),
        (("--name", "tab\there"), "invalid conversation name"),
        (("--name", "esc\x1b[31mred"), "invalid conversation name"),
        (("--name=-starts-like-an-option",), "invalid conversation name"),
        (("--name", "CON"), "not a device name"),
        (("--name", "nul.txt"), "invalid conversation name"),
        (("--name", "a."), "not ending with '.'"),
    ],
)
def test_bad_ingest_options(tmp_path, history, tiny_model_dir, args, fragment):
    home = tmp_path / "home"
    result = run_main(home, "ingest", str(history), "--model", str(tiny_model_dir), *args)
    _assert_refused(home, result, fragment)
    assert "\x1b" not in result.stderr


@pytest.mark.parametrize("args", [("--setting", "tau1=1e-300"), ("--method", "cake", "--setting", "tau2=5e-324")])
def test_cake_budgets_take_any_temperature_in_range(tmp_path, history, tiny_model_dir, args):
    """H^(1/tau1) overflowed a float into a ValueError (issue 16); the preference is kept in log space."""
    home = tmp_path / "home"
    result = run_main(home, "ingest", str(history), "--model", str(tiny_model_dir), *TINY, "--setting",
                      "layer_budgets=cake", *args)
    assert result.returncode == 0, result.stderr
    record = Store(home).get("h")
    key, value = args[-1].split("=")
    assert record.settings["layer_budgets"] == "cake" and record.settings[key] == float(value)
    assert all(sum(e.budgets) <= 2 * 64 for e in record.episodes)  # 2 layers, mean budget 64


@pytest.mark.parametrize("question", ["", " \t "])
def test_empty_questions(tmp_path, question):
    _assert_refused(tmp_path, run_main(tmp_path, "ask", question), "the question is empty")


@pytest.mark.parametrize("bad", ["a\x00b", "\x00", "nul\x00", "del\x7f", "cr\rlf", "line\u2028sep", "é"])
def test_names_with_nul_or_control_characters_are_refused(bad):
    """NUL cannot travel through argv (execve ends strings there), so this is checked on the library."""
    with pytest.raises(UserError, match="invalid conversation name") as info:
        validate_name(bad)
    assert not any(ch in str(info.value) for ch in "\x00\x7f\r\n\u2028")


# --------------------------------------------------------------------------- memory estimate

SHAPE = ModelShape(weight_bytes=540 << 20, layers=30, heads=9, kv_heads=3, head_dim=64, hidden=576, dtype_bytes=4)


def _estimate(**kw) -> int:
    settings = {"budget": 1024, "block_size": 512, "prompt_tokens": 272, "context_tokens": 20_000, "full": False}
    return estimate_ingest_bytes(SHAPE, **(settings | kw))


def test_estimate_grows_with_budget_and_block_not_with_the_history():
    assert _estimate(budget=256) < _estimate(budget=512) < _estimate() < _estimate(budget=4096)
    assert _estimate(block_size=64) < _estimate(block_size=128) < _estimate() < _estimate(block_size=2048)
    assert _estimate(context_tokens=10**6) == _estimate()  # the bound kvchat promises
    assert _estimate(full=True, context_tokens=5_000) < _estimate(full=True, context_tokens=50_000)
    kv_entry = SHAPE.layers * SHAPE.kv_heads * SHAPE.head_dim * 2 * SHAPE.dtype_bytes
    assert _estimate() > SHAPE.weight_bytes + (1024 + 512 + 272) * kv_entry


def test_estimate_sizes_attention_by_the_longest_head_layer_and_head_budgets_allow():
    from kvchat.ingest.cache_budgets import longest_head as _longest_head
    from kvchat.kv.cascade import CakeBudgets
    from kvchat.kv.heads import HeadBudgets

    uniform, adaptive = HeadBudgets("uniform"), HeadBudgets("adaptive")
    sensitivity = [512] * 20 + [2048] * 10  # mean 1024
    assert _longest_head([1024] * 30, uniform, SHAPE, protected=40) == 1024
    assert _longest_head(sensitivity, uniform, SHAPE, protected=40) == 2048
    assert _longest_head(sensitivity, adaptive, SHAPE, protected=40) == 3 * 2048 - 2 * int(0.2 * 2048)
    cake = CakeBudgets(1024, window=32, tau1=1.0, tau2=1.0, floor_fraction=0.25, cascade=True)
    assert _longest_head(cake, uniform, SHAPE, protected=40) == 30 * 1024 - 29 * 256
    assert _estimate(longest_head=1024) == _estimate() < _estimate(longest_head=2048) < _estimate(longest_head=23296)


def test_model_shape_of_the_tiny_model(tiny_lm):
    shape = ModelShape.of(tiny_lm.model)
    assert (shape.layers, shape.heads, shape.kv_heads, shape.head_dim, shape.hidden) == (2, 4, 2, 16, 64)
    assert shape.weight_bytes == sum(p.numel() * 4 for p in tiny_lm.model.parameters()) + sum(
        b.numel() * b.element_size() for b in tiny_lm.model.buffers()
    )


def test_check_fits():
    check_fits(10**9, resident=10**8, available=None)  # unknown: not checked
    check_fits(10**9, resident=10**8, available=9 * 10**8)  # the loaded model is already counted
    with raises_said(UserError, r"estimated 0\.93 GiB .* only 1\.0 MiB is available: lower --budget") as info:
        check_fits(10**9, resident=10**8, available=2**20)
    assert "--force" in error_text(info.value) and "\n" not in str(info.value)


def test_available_bytes_reads_this_machine():
    available = preflight.available_bytes()
    assert available is None or available > 0


def test_ingest_refuses_what_cannot_fit_unless_forced(tmp_path, history, tiny_model_dir, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setattr(preflight, "available_bytes", lambda *args, **kwargs: 1000)
    args = ("ingest", str(history), "--model", str(tiny_model_dir), *TINY, "--json")
    _assert_refused(home, run_main(home, *args), "pass --force to run it anyway")
    forced = run_main(home, *args, "--force")
    assert forced.returncode == 0, forced.stderr
    report = json.loads(forced.stdout)
    assert report["estimated_peak_bytes"] > report["cache_bytes"] / report["episode_count"]

    # A damaged cache is refused when asked, with the way to rebuild it.
    path = Store(home).get("h").episodes[0].path
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    asked = run_main(home, "ask", "Which gate?", "--conversation", "h", "--episode", "0")
    assert asked.returncode == 2 and len(asked.stderr.strip().splitlines()) == 1, asked.stderr
    # The hint is the real command: the stored source and settings, as `doctor --fix` prints them.
    rebuild = asked.stderr.split("rebuild with `")[1].split("`")[0]
    words = shlex.split(rebuild)
    assert "failed its checksum" in asked.stderr and words[:5] == ["kvchat", "ingest", str(history), "--name", "h"]
    assert words[-1] == "--replace" and words[words.index("--model") + 1] == str(tiny_model_dir)


def test_ingest_on_a_full_disk(tmp_path, history, tiny_model_dir, monkeypatch):
    home = tmp_path / "home"

    def full(path: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(store_module, "_write_file", full)
    result = run_main(home, "ingest", str(history), "--model", str(tiny_model_dir), *TINY)
    _assert_refused(home, result, f"no space left on device while writing caches to {home / 'caches'}")
    assert result.stderr.strip().endswith("free space or lower --budget")
    assert json.loads(run_main(home, "list", "--json").stdout)["conversations"] == []


# --------------------------------------------------------------------------- model files


def _gguf(path: Path, cut: int = 0) -> Path:
    """A small valid GGUF file (one tensor), its last `cut` bytes removed."""
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.ones((64, 16), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if cut:
        data = path.read_bytes()
        path.write_bytes(data[:-cut])
    return path


def _empty(d: Path) -> Path:
    (d / "empty.gguf").write_bytes(b"")
    return d / "empty.gguf"


def _random(d: Path) -> Path:
    (d / "random.gguf").write_bytes(os.urandom(4096))
    return d / "random.gguf"


@pytest.mark.parametrize(
    "make, fragment",
    [
        (_empty, "not a GGUF file (it is empty)"),
        (_random, "does not start with GGUF's magic"),
        (lambda d: _gguf(d / "cut.gguf", cut=1000), "damaged GGUF file"),
    ],
)
def test_bad_gguf_files_are_the_users_to_fix(tmp_path, make, fragment):
    model = make(tmp_path)
    result = run_main(tmp_path / "home", "profile-layers", "--model", str(model))
    assert result.returncode == 2 and fragment in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert not any((tmp_path / "home" / "models").glob(".tmp-*"))


def test_a_truncated_safetensors_model_is_the_users_to_fix(tmp_path, tiny_model_dir):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    result = run_main(tmp_path / "home", "profile-layers", "--model", str(model))
    assert result.returncode == 2 and "model.safetensors: damaged or cut short" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
