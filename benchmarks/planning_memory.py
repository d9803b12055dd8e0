"""What planning an ingest holds in memory as a history grows (issue 43): the peak resident memory of
`kvchat.ingest.plan.plan_ingest` (reading, tokenizing, embedding segments, clustering, the recall index) above the
loaded model and encoder, per step, on the generated long histories (kvchat.history.long_history, seed 0).

    HF_HUB_OFFLINE=1 python benchmarks/planning_memory.py 100000 1000000 \
        --out benchmarks/results/records/planning_memory.jsonl --report benchmarks/results/planning_memory.md

Each size runs in a process of its own (`--one`), so each peak is its own: the model (int4 weights, as an ingest
on a CPU holds them) and the encoder are loaded and warmed first, then the baseline is read (VmRSS), then the plan
is made as `kvchat ingest FILE` makes it at the defaults (`--method auto`), the progress hook reading the process's
resident memory at every step (VmRSS; the step's peak is VmHWM, the high-water mark since the baseline was
reset). Nothing is prefilled and nothing is written: what the plan holds is what the episode loop starts with.
Memory, not time, is measured: the load check applies only to the seconds column.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _load import checked  # benchmarks/ is on sys.path


def _status(key: str) -> int:
    """A /proc/self/status figure (VmRSS, VmHWM), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> None:
    """VmHWM back to the current VmRSS (Linux: writing 5 to clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


def one(size: int, path: Path) -> dict:
    """Plan an ingest of the generated history of `size` tokens in this process; its memory figures."""
    from kvchat.config import IngestConfig, default_home
    from kvchat.history.loading import load_history
    from kvchat.ingest.plan import plan_ingest
    from kvchat.model.encoder import SentenceEncoder
    from kvchat.model.llm import load_model, use_threads

    use_threads()
    home = default_home()
    lm = load_model("default", home / "models", weights="auto")
    encoder = SentenceEncoder()
    encoder.embed(["warm up the encoder"] * 8)
    lm.encode("warm up the tokenizer")
    turns = len(load_history(path))
    baseline = _status("VmRSS")
    _reset_peak()
    steps: dict[str, dict] = {}
    order: list[str] = []

    def hook(step: str, done: int, total: int) -> None:
        name = step.split(" ")[0] if step.startswith("tokenizing") else step
        if name not in steps:
            order.append(name)
            steps[name] = {"rss_mb": 0.0}
        steps[name]["rss_mb"] = max(steps[name]["rss_mb"], (_status("VmRSS") - baseline) / 2**20)

    clock = time.perf_counter()
    plan = plan_ingest(path, name=f"long-{size}", config=IngestConfig(), store=None, lm=lm, encoder=encoder,
                       replace=True, profile_dirs=[home / "profiles"], on_step=hook)  # fmt: skip
    seconds = time.perf_counter() - clock
    return {
        "size": size, "kind": "plan", "tokens": plan.history_tokens, "turns": turns, "episodes": len(plan.episodes),
        "method": plan.config.cache.method, "seconds": seconds,
        "baseline_mb": baseline / 2**20, "peak_mb": (_status("VmHWM") - baseline) / 2**20,
        "held_mb": (_status("VmRSS") - baseline) / 2**20,
        "steps": [{"step": s, **steps[s]} for s in order],
    }  # fmt: skip


def report(records: list[dict], notes: list[str]) -> str:
    lines = ["# Planning memory", "", *[line for note in notes for line in (note, "")]]
    lines += ["| history tokens | turns | episodes | planning peak MB | held after planning MB | MB per 10^5 tokens "
              "| seconds |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted((r for r in records if r.get("kind") == "plan"), key=lambda r: r["tokens"]):
        lines.append(f"| {r['tokens']:,} | {r['turns']:,} | {r['episodes']} | {r['peak_mb']:.0f} | {r['held_mb']:.0f} "
                     f"| {r['peak_mb'] / r['tokens'] * 1e5:.1f} | {r['seconds']:.0f} |")
    lines += ["", "Resident memory above the baseline at each step (MB, the most seen while the step reported):", ""]
    for r in sorted((r for r in records if r.get("kind") == "plan"), key=lambda r: r["tokens"]):
        lines.append(f"- {r['tokens']:,} tokens: " + ", ".join(f"{s['step']} {s['rss_mb']:.0f}" for s in r["steps"]))
    lines += ["", "Columns: planning peak: the process's high-water mark during `plan_ingest` above the loaded model "
              "and encoder; held after planning: what the finished plan keeps resident (the episode loop starts "
              "with it); seconds: planning alone.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sizes", nargs="+", type=int, help="history tokens")
    parser.add_argument("--out", type=Path, required=True, help="records, JSON lines (a size recorded is not rerun)")
    parser.add_argument("--report", type=Path)
    parser.add_argument("--note", default="")
    parser.add_argument("--one", type=Path, help=argparse.SUPPRESS)  # internal: plan this file in this process
    if "--one" in sys.argv:
        args = parser.parse_args()
        print(json.dumps(one(args.sizes[0], args.one)))
        return
    args = checked(parser)
    from kvchat.history.long_history import long_history

    args.out.parent.mkdir(parents=True, exist_ok=True)
    done = {r["size"] for r in _records(args.out) if r.get("kind") == "plan"}
    with tempfile.TemporaryDirectory(prefix="kvchat-planning-") as scratch:
        for size in args.sizes:
            if size in done:
                continue
            path = Path(scratch) / f"long-{size}.json"
            path.write_text(json.dumps(long_history(size).to_locomo()))
            print(f"planning_memory: {size}", file=sys.stderr, flush=True)
            out = subprocess.run([sys.executable, __file__, str(size), "--out", str(args.out), "--one", str(path)],
                                 check=True, capture_output=True, text=True).stdout  # fmt: skip
            with args.out.open("a") as f:
                f.write(out.strip().splitlines()[-1] + "\n")
    command = "python benchmarks/planning_memory.py " + " ".join(a for a in sys.argv[1:])
    note = (f"{dt.date.today()}, {platform.machine()} CPU, {os.cpu_count()} cores, run {args.load}. {args.note}")
    text = report(_records(args.out), [f"`{command}`", note])
    print(text)
    if args.report is not None:
        args.report.write_text(text)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


if __name__ == "__main__":
    main()
