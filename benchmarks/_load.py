"""The load check of every benchmark that times something or runs a model: such a benchmark needs the machine's
cores to itself, and says so rather than measure beside other work.

    args = checked(parser)  # in place of parser.parse_args(); args.load says what the check saw

`checked` adds `--allow-busy` to the parser (and to each of its subcommands), parses the arguments, then reads
the 1-minute load average and the cores this process may use, and, when psutil is installed, samples every
other process's CPU use for half a second. The machine is busy when the load is above 0.5 + 0.05 a core (0.6
on 2 cores: half a core of other work, and a little for what an idle machine runs) or another process used
more than 30% of a core in the sample. Busy, the script prints one line saying so and exits 2, unless
`--allow-busy` or `KVCHAT_BENCH_ALLOW_BUSY=1` says to measure anyway. `args.load` (a `Load`; None where `skip`
said the run measures nothing, e.g. a report rebuilt from records) goes into the result's header or record.
The load average is a 1-minute mean: work that ended a minute ago still counts, so wait and run again.

`shown(path)`: a path as a result names it, never a machine's absolute path (tests/test_benchmarks_tree.py
checks the results).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvchat.model.cores import usable_cores

ALLOW_ENV = "KVCHAT_BENCH_ALLOW_BUSY"
BASE_LOAD = 0.5  # other work the 1-minute load may show: half a core...
LOAD_PER_CORE = 0.05  # ...and a little a core for what an idle machine runs
BUSY_PERCENT = 30.0  # another process using more of a core than this in the sample is other work
SAMPLE_S = 0.5
REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Load:
    """What the check saw at the start of a run."""

    average: float  # 1-minute load average
    cores: int  # usable by this process
    others: tuple[str, ...]  # other processes busy in the sample: "name (pid N, P% CPU)"
    sampled: bool  # psutil was there to sample processes (else the load average alone)
    allowed: bool  # --allow-busy or KVCHAT_BENCH_ALLOW_BUSY given

    @property
    def limit(self) -> float:
        return BASE_LOAD + LOAD_PER_CORE * self.cores

    @property
    def busy(self) -> bool:
        return self.average > self.limit or bool(self.others)

    def seen(self) -> str:
        text = f"1-min load {self.average:.2f} on {self.cores} usable cores"
        if self.others:
            return f"{text}, busy: {', '.join(self.others)}"
        return f"{text}, {'no other process busy' if self.sampled else 'processes not sampled (no psutil)'}"

    def __str__(self) -> str:
        """For a result's header ("Run {load}."): alone on the machine, or beside other work."""
        if self.busy:
            return f"beside other work (--allow-busy; at start {self.seen()})"
        return f"alone on the machine (at start {self.seen()})"

    def record(self) -> dict:
        """For a JSON record."""
        return {"load_1min": round(self.average, 2), "cores": self.cores, "busy": self.busy,
                "busy_processes": list(self.others), "allow_busy": self.allowed}  # fmt: skip


def checked(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None = None,
    skip: Callable[[argparse.Namespace], bool] | None = None,
) -> argparse.Namespace:
    """`parser.parse_args(argv)` with `--allow-busy`, then the load check (not when `skip(args)`): exits 2 on a
    busy machine unless allowed; `args.load` holds the `Load` it saw (None when skipped)."""
    help_text = f"measure even when other work is running (also {ALLOW_ENV}=1); the result says so"
    parser.add_argument("--allow-busy", action="store_true", help=help_text)
    for action in parser._actions:  # a subcommand takes it after its name too
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                sub.add_argument("--allow-busy", action="store_true", default=argparse.SUPPRESS, help=help_text)
    args = parser.parse_args(argv)
    args.load = None
    if skip is not None and skip(args):
        return args
    allowed = args.allow_busy or os.environ.get(ALLOW_ENV, "").strip().lower() in ("1", "true", "yes")
    args.load = check(allowed)
    return args


def shown(path: Path) -> str:
    """`path` relative to the repository, or to the home directory as `~/...`; elsewhere (a scratch directory)
    its last three parts, e.g. `HOME/profiles/FILE` of a KVCHAT_HOME."""
    path = Path(path).absolute()
    for root, prefix in ((REPO, ""), (Path.home(), "~/")):
        if path.is_relative_to(root):
            return prefix + path.relative_to(root).as_posix()
    return "/".join(path.parts[-3:])


def check(allowed: bool) -> Load:
    """Read the load; busy and not allowed: one line on stderr, exit 2."""
    others, sampled = _busy_processes()
    load = Load(os.getloadavg()[0], usable_cores(), others, sampled, allowed)
    if load.busy and not allowed:
        print(f"{Path(sys.argv[0]).name}: the machine is busy ({load.seen()}; limit {load.limit:.2f}): its timings "
              f"would measure the other work too. Wait for it, or pass --allow-busy ({ALLOW_ENV}=1) to measure "
              f"anyway.", file=sys.stderr)  # fmt: skip
        raise SystemExit(2)
    return load



def _busy_processes() -> tuple[tuple[str, ...], bool]:
    """Other processes over BUSY_PERCENT of a core in one SAMPLE_S sample (this one and its parents left out);
    ((), False) without psutil."""
    try:
        import psutil
    except ImportError:
        return (), False
    me = psutil.Process()
    mine = {me.pid, *(p.pid for p in me.parents())}
    watched = []
    for process in psutil.process_iter(["name"]):
        if process.pid in mine:
            continue
        try:
            process.cpu_percent(None)  # the first call starts the process's sample
        except psutil.Error:
            continue
        watched.append(process)
    time.sleep(SAMPLE_S)
    busy = []
    for process in watched:
        try:
            percent = process.cpu_percent(None)
        except psutil.Error:
            continue
        if percent > BUSY_PERCENT:
            busy.append(f"{process.info['name']} (pid {process.pid}, {percent:.0f}% CPU)")
    return tuple(busy), True
