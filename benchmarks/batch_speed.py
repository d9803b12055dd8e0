"""Batch ingest throughput on Ray (kvchat.ingest.batch): histories per hour with 1 and with 2 workers of one torch
thread each on this machine, and what a cluster of N nodes would do at the measured per-worker rate.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/batch_speed.py [--histories 8] [--out PATH]

Both runs ingest the same planted-fact histories (kvchat.history.synthetic) with the embedded model into fresh stores,
through `ingest_batch` on one local Ray of 2 CPUs (--workers 1, then 2). A rate counts from the first history
handed to a worker to the last commit: the workers' one-time start (process, imports, model and encoder) is
reported apart. The CPU seconds the workers spent per history (from /proc) give the rate of one worker on a core
of its own, which a machine shared with other sessions does not show; the driver's CPU seconds per history, the
rate one driver can take. The projection multiplies the per-worker rates by the workers a cluster runs, one per
core, capped by that driver rate. Progress on stderr; markdown on stdout and in --out.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from _load import Load, checked  # benchmarks/ is on sys.path

from kvchat.config import BatchConfig, CacheConfig, EpisodeConfig, IngestConfig
from kvchat.history.synthetic import planted_conversation
from kvchat.ingest.batch import BatchProgress, histories, import_ray, ingest_batch
from kvchat.model.files import convert_gguf, default_gguf_path
from kvchat.store import Store

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "results" / "batch_speed.md"
TEST_MODELS_DIR = REPO / ".venv" / "kvchat-test-models"  # where the tests keep the converted default model
CONFIG = IngestConfig(cache=CacheConfig(budget=512, block_size=512), episodes=EpisodeConfig(episodes=4))
TOPICS, TURNS_PER_TOPIC = 4, 16
NODES = (1, 4, 16, 64)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def worker_cpu_seconds() -> float:
    """CPU seconds used so far by this machine's batch workers (Ray titles their processes after the actor)."""
    ticks = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if b"HistoryWorker" not in (proc / "cmdline").read_bytes():
                continue
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


class Clock(BatchProgress):
    """When the first history went to a worker and when the last one finished, and the workers' CPU time."""

    def __init__(self, started: float, total: int) -> None:
        self.started, self.total, self.done = started, total, 0
        self.first: float | None = None
        self.last: float | None = None
        self.cpu = 0.0
        self.driver_cpu = 0.0

    def running(self, name, attempt, worker) -> None:
        if self.first is None:
            self.first = time.perf_counter()
            self.cpu = -worker_cpu_seconds()
            self.driver_cpu = -time.process_time()
            log(f"  workers started after {self.first - self.started:.1f} s")

    def finished(self, result) -> None:
        self.last = time.perf_counter()
        self.done += 1
        if self.done == self.total:
            self.cpu += worker_cpu_seconds()
            self.driver_cpu += time.process_time()
        log(f"  {result.name}: {result.status} in {result.seconds:.1f} s")


@dataclass(frozen=True)
class Run:
    workers: int
    histories: int
    start_s: float  # Ray workers started and loaded
    ingest_s: float  # first history handed out -> last commit
    history_s: float  # mean seconds of one history on its worker
    cpu_s: float  # mean CPU seconds the workers spent per history
    driver_cpu_s: float  # mean CPU seconds the driver spent per history (receiving, writing, committing)
    cache_bytes: int  # mean bytes stored per history
    history_tokens: int  # mean tokens per history

    @property
    def per_hour(self) -> float:
        return self.histories * 3600 / self.ingest_s

    @property
    def per_core_hour(self) -> float:
        """One worker's rate on a core of its own."""
        return 3600 / self.cpu_s


def run(files: list[Path], workers: int, models: Path, root: Path) -> Run:
    home = root / f"home-{workers}"
    home.mkdir()
    (home / "models").symlink_to(models)
    log(f"{workers} worker(s) x 1 thread, {len(files)} histories")
    started = time.perf_counter()
    clock = Clock(started, len(files))
    report = ingest_batch(histories(files), store=Store(home), config=CONFIG, batch=BatchConfig(workers=workers),
                          progress=clock)  # fmt: skip
    assert report.count("committed") == len(files), [h.error for h in report.histories]
    assert clock.first is not None and clock.last is not None
    done = [h for h in report.histories if h.report is not None]
    return Run(workers, len(files), clock.first - started, clock.last - clock.first,
               sum(h.seconds for h in done) / len(done), clock.cpu / len(done), clock.driver_cpu / len(done),
               report.cache_bytes // len(done),
               sum(h.report.history_tokens for h in done) // len(done))  # fmt: skip


def render(runs: list[Run], cores_per_node: int, load: Load) -> str:
    one = runs[0]
    lines = [
        f"Machine: {os.cpu_count()} CPUs, {load}; "
        f"SmolLM2-135M-Instruct (embedded default, float32), one torch thread per worker; {one.histories} "
        f"planted-fact histories of {one.history_tokens} tokens ({TOPICS} topics x {TURNS_PER_TOPIC} turns), "
        f"budget {CONFIG.cache.budget}, block {CONFIG.cache.block_size}, {CONFIG.episodes.episodes} episodes; "
        f"{one.cache_bytes / 2**20:.1f} MiB stored per history; {dt.date.today().isoformat()}.",
        "",
        "| workers x threads | worker start s | ingest s | s per history (on its worker) | worker CPU s per history "
        "| driver CPU s per history | histories/hour | vs 1 worker | per worker on a core of its own |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        lines.append(
            f"| {r.workers} x 1 | {r.start_s:.1f} | {r.ingest_s:.1f} | {r.history_s:.1f} | {r.cpu_s:.1f} "
            f"| {r.driver_cpu_s:.2f} | {r.per_hour:.0f} | {r.per_hour / one.per_hour:.2f}x "
            f"| {r.per_core_hour:.0f}/hour |"
        )
    driver_cap = 3600 / one.driver_cpu_s
    lines += [
        "",
        f"Projected for N nodes of {cores_per_node} cores, one worker per core: at the 1-worker rate measured "
        f"here ({one.per_hour:.0f}/hour) and at the rate of a worker on a core of its own "
        f"({one.per_core_hour:.0f}/hour, from its CPU seconds). One driver receives, encodes, hashes and writes "
        f"every cache ({one.driver_cpu_s:.2f} CPU s per history): on one core it keeps up with at most "
        f"{driver_cap:,.0f} histories/hour, which caps the last columns.",
        "",
        "| nodes | workers | histories/hour (measured rate) | histories/hour (a core each) | capped by one driver "
        "| driver writes MiB/s |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for nodes in NODES:
        workers = nodes * cores_per_node
        measured, dedicated = workers * one.per_hour, workers * one.per_core_hour
        capped = min(dedicated, driver_cap)
        lines.append(f"| {nodes} | {workers} | {measured:,.0f} | {dedicated:,.0f} | {capped:,.0f} | "
                     f"{capped * one.cache_bytes / 2**20 / 3600:,.1f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--histories", type=int, default=8, help="histories per run (default 8)")
    parser.add_argument("--cores-per-node", type=int, default=16, help="for the projection (default 16)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"markdown output (default {DEFAULT_OUT})")
    args = checked(parser, argv)
    ray = import_ray()
    with tempfile.TemporaryDirectory(prefix="kvchat-bench-") as tmp:
        root = Path(tmp)
        models = TEST_MODELS_DIR if TEST_MODELS_DIR.is_dir() else root / "models"
        convert_gguf(default_gguf_path(), models)  # once, not in every worker
        files = []
        for seed in range(args.histories):
            path = root / f"history{seed}.json"
            path.write_text(json.dumps(planted_conversation(seed=seed, topics=TOPICS,
                                                            turns_per_topic=TURNS_PER_TOPIC)[0]))  # fmt: skip
            files.append(path)
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
        try:
            runs = [run(files, workers, models, root) for workers in (1, 2)]
        finally:
            ray.shutdown()
    markdown = render(runs, args.cores_per_node, args.load)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(markdown)
    print(markdown)


if __name__ == "__main__":
    main()
