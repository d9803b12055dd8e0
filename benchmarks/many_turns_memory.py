"""Peak memory of planning an ingest of a history of very many tiny turns (issue 29, case 11), and how soon the
user hears of it.

    python benchmarks/many_turns_memory.py 100000 1000000 --out benchmarks/results/many_turns_memory.md

Per size, a JSONL history of N turns `{"role": "user"/"assistant", "content": "hi i"}` is written and the real
`kvchat ingest` command line runs under `/usr/bin/time -v` (`--method snapkv --budget 64 --block-size 64
--episodes 1`, the embedded model, already converted in the home). Once the plan is made (the line "history of
... tokens" on stderr) the ingest is stopped (SIGTERM): prefilling millions of tokens on a CPU takes hours, and
this measures the stage before it (reading, tokenizing, turn spans, embedding the segments, clustering). The
peak resident memory is `/usr/bin/time`'s, of the whole process up to then.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _load import checked  # benchmarks/ is on sys.path

KVCHAT = [sys.executable, "-m", "kvchat"]
OPTIONS = ["--method", "snapkv", "--budget", "64", "--block-size", "64", "--episodes", "1", "--threads", "1"]


def history(path: Path, turns: int) -> Path:
    with path.open("w") as f:
        for i in range(turns):
            f.write(json.dumps({"role": ("user", "assistant")[i % 2], "content": f"hi {i}"}) + "\n")
    return path


def measure(home: Path, path: Path) -> dict:
    """Seconds to the first progress line, to the plan, and the peak RSS (MB) up to the plan."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as timing:
        started = time.monotonic()
        process = subprocess.Popen(
            ["/usr/bin/time", "-v", "-o", timing.name, *KVCHAT, "ingest", str(path), "--name", "many", "--replace",
             *OPTIONS],
            env={**os.environ, "KVCHAT_HOME": str(home), "OMP_NUM_THREADS": "1"},
            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        first = planned = None
        tokens = None
        lines = []
        for line in process.stderr:
            lines.append(line.rstrip())
            if first is None and line.startswith("kvchat: "):
                first = time.monotonic() - started
            if match := re.search(r"history of (\d+) tokens", line):
                planned, tokens = time.monotonic() - started, int(match.group(1))
                import psutil  # the kvchat process: time's child

                for child in psutil.Process(process.pid).children():
                    child.send_signal(signal.SIGTERM)
                break
        process.wait()
        report = timing.read()
    if planned is None:
        raise SystemExit("the ingest ended before its plan:\n" + "\n".join(lines[-20:]))
    peak_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", report).group(1))
    return {"first_line_s": first, "planned_s": planned, "tokens": tokens, "peak_mb": peak_kb / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sizes", nargs="+", type=int)
    parser.add_argument("--home", type=Path, help="a kvchat home, the embedded model converted (default: a temp one)")
    parser.add_argument("--label", default="", help="what this run measures (the code's version)")
    parser.add_argument("--out", type=Path)
    args = checked(parser)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        home = args.home or Path(scratch) / "home"
        for turns in args.sizes:
            found = measure(home, history(Path(scratch) / f"{turns}.jsonl", turns))
            rows.append((turns, found))
            print(turns, found, flush=True)
    table = ["| turns | history tokens | first line s | plan made s | peak RSS MB |", "|---:|---:|---:|---:|---:|"]
    table += [f"| {t:,} | {f['tokens']:,} | {f['first_line_s']:.0f} | {f['planned_s']:.0f} | {f['peak_mb']:.0f} |"
              for t, f in rows]  # fmt: skip
    text = (f"{args.label}\n\n{dt.date.today()}, {platform.machine()}, `{' '.join(OPTIONS)}`, run {args.load}\n\n"
            + "\n".join(table) + "\n")  # fmt: skip
    print(text)
    if args.out:
        with args.out.open("a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
