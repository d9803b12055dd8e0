"""One history's ingest, side by side in one run: in this process with 1 and 2 torch threads (resumable, the
command's default, and not), spread over 1 and 2 Ray workers of one thread each (`kvchat ingest --ray`), and killed
with SIGKILL at half its blocks then resumed: what resumability costs, what it loses, and how an ingest scales with
workers on this machine.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/ingest_ray.py [--topics 6] [--turns 50] \\
        [--out benchmarks/results/ingest_ray.md]

The history is a generated planted-fact conversation (kvchat.history.synthetic) at the defaults (`--method auto`:
within the embedded model's window epicache, beyond it recall's routed episode caches). Every run ingests it into a
fresh store with the embedded model (`--weights auto`: int4 on a CPU); a run's seconds go from its call to its commit,
planning included, the Ray workers' start (processes, imports, model) reported apart. Each run's files are compared
with the first local run's (sha256 of every file): the same bytes, or the table says not. The kill: a child process
runs the resumable ingest, writing how many blocks it has computed after each one; at half the planned blocks this
process kills it (SIGKILL, observed progress), then runs the same ingest again, counting its blocks: the blocks
computed twice over are the work lost. Markdown on stdout and in --out, raw numbers in benchmarks/results/records/.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _load import checked, shown  # benchmarks/ is on sys.path

from kvchat.config import WEIGHTS, BatchConfig, IngestConfig
from kvchat.history.loading import load_history
from kvchat.history.synthetic import planted_conversation
from kvchat.ingest.pipeline import IngestProgress, ingest
from kvchat.store import Store

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "results" / "ingest_ray.md"
RECORDS = REPO / "benchmarks" / "results" / "records" / "ingest_ray.jsonl"
TEST_MODELS_DIR = REPO / ".venv" / "kvchat-test-models"  # where the tests keep the converted default model


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Blocks(IngestProgress):
    """Counts the blocks computed (and recall chunks), writing the count to `path` after each when given."""

    def __init__(self, path: Path | None = None) -> None:
        self.path, self.computed, self.planned_blocks = path, 0, 0
        self.ray_started: float | None = None
        self.resumed = ""

    def planned(self, blocks: int, episodes: int, tokens: int) -> None:
        self.planned_blocks = blocks

    def planning(self, step: str, done: int, total: int) -> None:
        if step.startswith("planning on a worker") and self.ray_started is None:
            self.ray_started = time.perf_counter()

    def block(self, done: int, total: int) -> None:
        self.computed += 1  # every call is one block computed now
        if self.path is not None:
            self.path.write_text(str(self.computed))

    def resuming(self, done: str, blocks: int) -> None:
        self.resumed = done


def files_of(home: Path, name: str) -> dict[str, str]:
    record = Store(home).get(name)
    folder = record.episodes[0].path.parent
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()
            if p.name != "conversation.json"}  # fmt: skip


def local(turns, root: Path, label: str, threads: int, resumable: bool, models: Path) -> dict:
    import torch

    from kvchat.model.encoder import SentenceEncoder
    from kvchat.model.llm import load_model

    torch.set_num_threads(threads)
    lm = load_model("default", models, weights=WEIGHTS)
    home = root / label
    progress = Blocks()
    started = time.perf_counter()
    report = ingest(turns, name="h", config=IngestConfig(), store=Store(home), lm=lm, encoder=SentenceEncoder(),
                    progress=progress, resumable=resumable)  # fmt: skip
    seconds = time.perf_counter() - started
    log(f"  {label}: {seconds:.1f} s, {progress.computed} blocks")
    return {"label": label, "threads": threads, "workers": 0, "resumable": resumable, "seconds": seconds,
            "start_s": 0.0, "tokens": report.history_tokens, "blocks": progress.planned_blocks,
            "episodes": report.episodes, "method": report.method, "home": home}  # fmt: skip


def spread(turns, root: Path, workers: int, models: Path) -> dict:
    from kvchat.ingest.batch_units import ingest_spread

    label = f"ray-{workers}"
    home = root / label
    home.mkdir()
    (home / "models").symlink_to(models)
    progress = Blocks()
    started = time.perf_counter()
    report = ingest_spread(turns, name="h", store=Store(home), config=IngestConfig(), progress=progress,
                           batch=BatchConfig(workers=workers, threads=1), resumable=True)  # fmt: skip
    ended = time.perf_counter()
    begun = progress.ray_started or started
    log(f"  {label}: {ended - begun:.1f} s after {begun - started:.1f} s of worker start")
    return {"label": label, "threads": 1, "workers": workers, "resumable": True, "seconds": ended - begun,
            "start_s": begun - started, "tokens": report.history_tokens, "blocks": progress.planned_blocks,
            "episodes": report.episodes, "home": home}  # fmt: skip


def killed_and_resumed(history: Path, root: Path, models: Path, blocks: int) -> dict:
    """SIGKILL a child's resumable ingest at half its blocks, then run it again here; blocks computed by each."""
    import torch

    from kvchat.model.encoder import SentenceEncoder
    from kvchat.model.llm import load_model

    home, count = root / "killed", root / "killed.count"
    child = subprocess.Popen([sys.executable, __file__, "--child", str(home), str(history), str(count),
                              str(models)], env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    started = time.perf_counter()
    while child.poll() is None:
        try:
            done = int(count.read_text() or 0)
        except (OSError, ValueError):
            done = 0
        if done >= blocks // 2:
            child.send_signal(signal.SIGKILL)
            break
        time.sleep(0.2)  # polls the child's count: the kill rides on its progress, not on this interval
    child.wait()
    first_s = time.perf_counter() - started
    before = int(count.read_text())
    assert child.returncode == -signal.SIGKILL, f"the child ended with {child.returncode} before half its blocks"
    torch.set_num_threads(1)
    lm = load_model("default", models, weights=WEIGHTS)
    progress = Blocks()
    started = time.perf_counter()
    ingest(load_history(history), name="h", config=IngestConfig(), store=Store(home), lm=lm,
           encoder=SentenceEncoder(), progress=progress, resumable=True)  # fmt: skip
    second_s = time.perf_counter() - started
    lost = before + progress.computed - blocks
    log(f"  killed after {before} of {blocks} blocks; resumed ({progress.resumed}), {progress.computed} more; "
        f"{lost} computed twice")
    return {"label": "killed at 1/2, resumed", "blocks": blocks, "before_kill": before, "after": progress.computed,
            "lost": lost, "first_s": first_s, "second_s": second_s, "resumed": progress.resumed, "home": home}


def child(home: Path, history: Path, count: Path, models: Path) -> None:
    """The process `killed_and_resumed` kills: a resumable ingest writing its block count after each block."""
    import torch

    from kvchat.model.encoder import SentenceEncoder
    from kvchat.model.llm import load_model

    torch.set_num_threads(1)
    lm = load_model("default", models, weights=WEIGHTS)
    ingest(load_history(history), name="h", config=IngestConfig(), store=Store(home), lm=lm,
           encoder=SentenceEncoder(), progress=Blocks(count), resumable=True)  # fmt: skip


def render(runs: list[dict], kill: dict, same: dict[str, bool], load, topics: int, turns: int) -> str:
    base = runs[0]
    tokens = base["tokens"]
    lines = [
        f"Machine: {os.cpu_count()} CPUs, {load}; SmolLM2-135M-Instruct (embedded default, `--weights auto`: int4 on "
        f"a CPU); one generated planted-fact history of {tokens} tokens ({topics} topics x {turns} turns, "
        f"kvchat.history.synthetic) at the defaults (`--method auto`: {base['method']}, {base['episodes']} episodes, "
        f"{base['blocks']} blocks); {dt.date.today().isoformat()}. Command: `OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 "
        f".venv/bin/python benchmarks/ingest_ray.py --topics {topics} --turns {turns}`.",
        "",
        "| run | workers x threads | resumable | seconds | history tokens/s | vs local, 1 thread, resumable "
        "| worker start s | files as the first run's |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    ref = next(r for r in runs if r["label"] == "local-1-resumable")
    for r in runs:
        shape = f"{r['workers']} x 1" if r["workers"] else f"this process, {r['threads']} thread(s)"
        lines.append(f"| {r['label']} | {shape} | {'yes' if r['resumable'] else 'no'} | {r['seconds']:.1f} "
                     f"| {tokens / r['seconds']:.0f} | {ref['seconds'] / r['seconds']:.2f}x "
                     f"| {r['start_s']:.1f} | {'same' if same[r['label']] else 'DIFFERENT'} |")  # fmt: skip
    lines += [
        "",
        f"Killed with SIGKILL at half the blocks ({kill['before_kill']} of {kill['blocks']} computed), then the same "
        f"ingest again ({kill['resumed']}): {kill['after']} blocks computed on resuming, {kill['lost']} blocks "
        f"computed twice ({100 * kill['lost'] / kill['blocks']:.1f}% of the ingest's blocks); {kill['first_s']:.1f} s "
        f"until the kill + {kill['second_s']:.1f} s resumed; files as the first run's: "
        f"{'same' if same[kill['label']] else 'DIFFERENT'}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(*map(Path, sys.argv[2:6]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topics", type=int, default=6, help="topics of the generated history, 1 to 6 (default 6)")
    parser.add_argument("--turns", type=int, default=50, help="turns per topic (default 50)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="markdown output")
    args = checked(parser, argv)
    from kvchat.ingest.batch import import_ray
    from kvchat.model.files import convert_gguf, default_gguf_path

    ray = import_ray()
    with tempfile.TemporaryDirectory(prefix="kvchat-bench-") as tmp:
        root = Path(tmp)
        models = TEST_MODELS_DIR if TEST_MODELS_DIR.is_dir() else root / "models"
        convert_gguf(default_gguf_path(), models)  # once, not in every run
        history = root / "history.json"
        history.write_text(json.dumps(planted_conversation(seed=43, topics=args.topics,
                                                           turns_per_topic=args.turns)[0]))  # fmt: skip
        turns = load_history(history)
        runs = [local(turns, root, "local-1-resumable", 1, True, models),
                local(turns, root, "local-1-not-resumable", 1, False, models),
                local(turns, root, "local-2-resumable", 2, True, models)]
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
        try:
            runs += [spread(turns, root, workers, models) for workers in (1, 2)]
        finally:
            ray.shutdown()
        kill = killed_and_resumed(history, root, models, runs[0]["blocks"])
        first = files_of(runs[0]["home"], "h")
        same = {r["label"]: files_of(r["home"], "h") == first for r in [*runs, kill]}
    markdown = render(runs, kill, same, args.load, args.topics, args.turns)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(markdown)
    RECORDS.parent.mkdir(parents=True, exist_ok=True)
    with RECORDS.open("a") as records:
        for r in [*runs, kill]:
            row = {k: v for k, v in r.items() if k != "home"} | {"same_files": same[r["label"]]}
            records.write(json.dumps({"date": dt.date.today().isoformat(), "load": dataclasses.asdict(args.load)
                                      if args.load else None, "out": shown(args.out), **row}) + "\n")  # fmt: skip
    print(markdown)


if __name__ == "__main__":
    main()
