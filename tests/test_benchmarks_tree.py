"""benchmarks/ and the docs run from any clone: no path of one machine, records apart from the tables, and every
benchmark script checks the machine's load (benchmarks/_load.py). Pure file reads.

A machine path is an absolute path under a directory that differs from machine to machine: /work, /home, /root,
/Users, /mnt or /tmp (a scratch file's name is a result of nothing). A path relative to the clone, `~/...` and
the system's own files (/usr/bin/time, /proc/cpuinfo, /sys/fs/cgroup) are the same everywhere and pass; so does
`../shared/data/locomo/`, where docs/benchmarks.md says the LoCoMo files go. A worktree's name in front of a
repository path (`wt-NAME/kvchat/...`) is one machine's too.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TEXT = {".py", ".sh", ".md", ".json", ".jsonl", ".txt", ".toml", ".yaml", ".yml", ".csv", ".gitattributes"}
TABLES = {".md", ".png", ".svg"}  # what benchmarks/results/ itself holds: tables and their figures
HINTS = ("/work/", "/home/", "/root/", "/Users/", "/mnt/", "/tmp/", "wt-")  # a file without any needs no regex
MACHINE_PATH = re.compile(r"(?<![\w.~/-])/(?:work|home|root|Users|mnt|tmp)/[\w.-]+|(?<![\w.-])wt-[\w.-]+/(?=\w)")


def _texts() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*"))]
    files += [p for p in sorted((ROOT / "benchmarks").rglob("*")) if "__pycache__" not in p.parts]
    return [p for p in files if p.is_file() and (p.suffix or p.name) in TEXT]


def test_no_machine_paths_in_benchmarks_results_or_docs():
    found = []
    for path in _texts():
        text = path.read_text(encoding="utf-8")
        if not any(hint in text for hint in HINTS):
            continue
        found += [f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group()}"
                  for m in MACHINE_PATH.finditer(text)]  # fmt: skip
    assert not found, "paths of one machine (name the command a clone runs instead):\n" + "\n".join(found[:50])


def test_the_rule_catches_machine_paths_and_passes_generic_ones():
    caught = ["`/work/exclusive python x`", '"file": "/tmp/memhome-mass/profiles/x"', "/home/ann/kvchat",
              "# wt-compile/kvchat/kv/cache.py:89", "PYTHONPATH=/work/bench-venv/lib"]  # fmt: skip
    passed = ["/usr/bin/time -v", "/proc/cpuinfo", "KVCHAT_HOME=~/.kvchat-bench", "../shared/data/locomo/conv-26.json",
              "benchmarks/results/records/x.jsonl", "https://github.com/snap-research/locomo/tmp/x", "../tmp/x",
              "exclusive locking mode", "git worktree add ../before 15e6dc2", "$SITE/models"]  # fmt: skip
    assert [s for s in caught if not MACHINE_PATH.search(s)] == []
    assert [s for s in passed if MACHINE_PATH.search(s)] == []


def test_results_hold_tables_and_figures_records_sit_in_records():
    loose = [p.name for p in RESULTS.iterdir() if p.is_file() and p.suffix not in TABLES]
    assert not loose, f"raw records belong in benchmarks/results/records/: {loose}"
    assert (RESULTS / "records").is_dir()
    assert not [p.name for p in (RESULTS / "records").iterdir() if p.suffix == ".md"], "tables belong one level up"


def test_every_benchmark_script_checks_the_load():
    scripts = [p for p in sorted((ROOT / "benchmarks").glob("*.py")) if not p.name.startswith("_")]
    unchecked = [p.name for p in scripts if "checked(parser" not in p.read_text(encoding="utf-8")]
    assert scripts and not unchecked, f"call benchmarks/_load.py's checked(parser) in place of parse_args: {unchecked}"
