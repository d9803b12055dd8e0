"""Cold start: `kvchat ask --local QUESTION` to its first answer byte, one fresh process per run.

    python benchmarks/cold_start.py --checkouts ../before,. [--runs 5] [--home H]

Each checkout (a directory put first on PYTHONPATH: the kvchat it imports; `git worktree add ../before COMMIT`
makes one of an earlier commit) answers the same question in turn, runs alternated, so a machine's drift falls on
every checkout alike; the answer must be `--expect` in every run. The model must be converted already (`make demo`
does it: the default home and question are the demo's). Prints the median and the runs of each, checkouts named
relative to the working directory; `python -X importtime -m kvchat ask ...` says where a start's time goes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _load import checked  # benchmarks/ is on sys.path

REPO = Path(__file__).resolve().parents[1]


def first_byte(checkout: Path, args: argparse.Namespace) -> tuple[float, float]:
    """Seconds to the first byte of the answer on stdout, and to the process's exit."""
    env = {**os.environ, "PYTHONPATH": str(checkout), "KVCHAT_HOME": str(args.home), "HF_HUB_OFFLINE": "1"}
    clock = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "kvchat", "ask", "--local", args.question, "--conversation",
                                args.conversation], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                               cwd="/")  # fmt: skip
    first = process.stdout.read(1)
    reached = time.perf_counter() - clock
    rest = process.stdout.read()
    process.wait()
    answer = (first + rest).decode().strip()
    if process.returncode != 0 or answer != args.expect:
        raise SystemExit(f"{checkout}: exit {process.returncode}, answered {answer!r}")
    return reached, time.perf_counter() - clock


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkouts", type=lambda s: [Path(p).resolve() for p in s.split(",")], default=[REPO])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--home", type=Path, default=REPO / ".kvchat-demo")
    parser.add_argument("--conversation", default="demo")
    parser.add_argument("--question", default="How many tomato plants did Tom plant this spring?")
    parser.add_argument("--expect", default="Tom planted 31 tomato plants this spring.")
    args = checked(parser)
    runs: dict[Path, list[tuple[float, float]]] = {c: [] for c in args.checkouts}
    for _ in range(args.runs):
        for checkout in args.checkouts:
            runs[checkout].append(first_byte(checkout, args))
    print(f"Run {args.load}.\n")
    print("| checkout | first answer byte, median (s) | runs (s) | exit, median (s) |\n|---|---:|---|---:|")
    for checkout, times in runs.items():
        firsts = [t[0] for t in times]
        print(f"| {os.path.relpath(checkout)} | {statistics.median(firsts):.2f} | "
              f"{', '.join(f'{t:.2f}' for t in firsts)} | {statistics.median(t[1] for t in times):.2f} |")


if __name__ == "__main__":
    main()
