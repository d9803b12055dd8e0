"""benchmarks/_load.py: a busy machine stops a benchmark with one line and exit 2 unless --allow-busy (or
KVCHAT_BENCH_ALLOW_BUSY=1) says to measure anyway; what it saw goes into the result. The load average and
the process sample are stubbed: nothing here depends on the machine the tests run on."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def load(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_load", ROOT / "benchmarks" / "_load.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_load", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    monkeypatch.delenv(module.ALLOW_ENV, raising=False)
    monkeypatch.setattr(module, "usable_cores", lambda: 2)

    def machine(average: float, others: tuple[str, ...] = ()) -> None:
        monkeypatch.setattr(module.os, "getloadavg", lambda: (average, average, average))
        monkeypatch.setattr(module, "_busy_processes", lambda: (others, True))

    module.machine = machine
    return module


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    return parser


def test_an_idle_machine_runs_and_the_result_says_so(load):
    load.machine(0.1)
    args = load.checked(_parser(), ["--out", "x.md"])
    assert args.out == "x.md" and not args.load.busy
    assert str(args.load).startswith("alone on the machine (at start 1-min load 0.10 on 2 usable cores")
    assert args.load.record() == {"load_1min": 0.1, "cores": 2, "busy": False, "busy_processes": [],
                                  "allow_busy": False}  # fmt: skip


@pytest.mark.parametrize("average, others", [(0.9, ()), (0.1, ("python3 (pid 7, 97% CPU)",))])
def test_a_busy_machine_exits_2_with_one_line(load, capsys, average, others):
    load.machine(average, others)
    with pytest.raises(SystemExit) as stopped:
        load.checked(_parser(), [])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "busy" in err and "--allow-busy" in err


def test_allowed_a_busy_run_measures_and_says_it_was_busy(load, monkeypatch):
    load.machine(1.7, ("python3 (pid 7, 97% CPU)",))
    args = load.checked(_parser(), ["--allow-busy"])
    assert args.load.busy and args.load.allowed
    assert str(args.load).startswith("beside other work (--allow-busy; at start 1-min load 1.70")
    assert "python3 (pid 7, 97% CPU)" in str(args.load)
    monkeypatch.setenv(load.ALLOW_ENV, "1")
    assert load.checked(_parser(), []).load.allowed


def test_the_limit_grows_with_the_cores(load, monkeypatch):
    load.machine(0.7)
    with pytest.raises(SystemExit):
        load.checked(_parser(), [])  # 2 cores: 0.6
    monkeypatch.setattr(load, "usable_cores", lambda: 16)
    assert not load.checked(_parser(), []).load.busy  # 16 cores: 1.3


def test_a_run_that_measures_nothing_skips_the_check(load):
    load.machine(5.0)
    parser = _parser()
    parser.add_argument("--report-only", action="store_true")
    args = load.checked(parser, ["--report-only"], skip=lambda a: a.report_only)
    assert args.load is None


def test_a_subcommand_takes_allow_busy_after_its_name(load):
    load.machine(1.5)
    parser = argparse.ArgumentParser()
    parser.add_subparsers(dest="what").add_parser("speed")
    assert load.checked(parser, ["speed", "--allow-busy"]).load.allowed
    assert load.checked(argparse.ArgumentParser(), ["--allow-busy"]).load.allowed


def test_shown_names_no_machine_path(load, tmp_path):
    assert load.shown(ROOT / "profiles" / "x.safetensors") == "profiles/x.safetensors"
    assert load.shown(Path.home() / ".kvchat" / "profiles" / "x") == "~/.kvchat/profiles/x"
    scratch = load.shown(tmp_path / "memhome" / "profiles" / "x")  # its last three parts, outside repo and home
    assert scratch.endswith("memhome/profiles/x") and not scratch.startswith("/")
