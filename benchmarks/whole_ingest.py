"""Ingest of whole LoCoMo conversations at the defaults: time and peak memory, against one single cache, and
what appending one new session costs against ingesting everything again.

    python benchmarks/whole_ingest.py ../shared/data/locomo/conv-26.json [...] \
        --out benchmarks/results/whole_ingest.md

Every command is the real `kvchat` command line, each in its own process under `/usr/bin/time` (wall seconds
and peak resident memory), one torch thread, the embedded model already converted, all side by side in one
run on one store. Per conversation: `kvchat ingest` at the defaults (a whole conversation is beyond the
window: `--method auto` resolves to recall), `--method recall` over the first half of its sessions and over the
whole history twice over (peak memory must not grow with the history's length), the first half at the defaults
(within the window: epicache's full prefill), `--method snapkv` (one cache: the unit), and an ingest of every
session but the last followed by `--append` of the last one; and the defaults with `--weights float` (the embedded
model's weights as loaded, float32, where `auto` holds its decoder in 4 bits on a CPU); and `--recall-entries stored`
(recall's chunks computed at ingest) over the history, twice over it, and with an append. `--rows` runs some of
them (their labels separated by ";", `--method snapkv` always: the unit).
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
from pathlib import Path

from _load import checked  # benchmarks/ is on sys.path

from kvchat.history.loading import load_history

KVCHAT = [sys.executable, "-m", "kvchat"]


def run(home: Path, *args: str) -> tuple[float, float, dict]:
    """(wall seconds, peak RSS in MB, the command's --json document) of one kvchat command."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as timing:
        done = subprocess.run(["/usr/bin/time", "-o", timing.name, "-f", "%e %M", *KVCHAT, *args, "--json"],
                              env={**os.environ, "KVCHAT_HOME": str(home), "OMP_NUM_THREADS": "1"},
                              capture_output=True, text=True)  # fmt: skip
        if done.returncode != 0:
            raise SystemExit(f"kvchat {' '.join(args)} failed: {done.stderr.strip()[-2000:]}")
        seconds, kb = timing.read().split()[-2:]
    return float(seconds), int(kb) / 1024, json.loads(done.stdout.strip().splitlines()[-1])


def write_turns(turns, path: Path) -> Path:
    path.write_text(json.dumps([{"role": t.role, "content": t.text, **({"time": t.time} if t.time else {})}
                                for t in turns]))  # fmt: skip
    return path


def sessions(turns) -> list[list]:
    """Turns grouped by their time (LoCoMo dates each session)."""
    groups: list[list] = []
    for turn in turns:
        if not groups or turn.time != groups[-1][-1].time:
            groups.append([])
        groups[-1].append(turn)
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--rows", default=None, help="labels of the rows to run, separated by ; (default: all)")
    args = checked(parser)
    wanted = None if args.rows is None else {r.strip() for r in args.rows.split(";")} | {"--method snapkv"}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        home, files = Path(tmp) / "home", Path(tmp)
        warm = write_turns(load_history(args.data[0])[:4], files / "warm.json")
        run(home, "ingest", str(warm), "--name", "warm")  # the model is converted once, before any measurement
        for path in args.data:
            turns = load_history(path)
            parts = sessions(turns)
            half = [t for s in parts[: len(parts) // 2] for t in s]
            but_last = [t for s in parts[:-1] for t in s]
            whole = write_turns(turns, files / f"{path.stem}.json")
            first_half = write_turns(half, files / f"{path.stem}-half.json")
            twice = write_turns(turns + turns, files / f"{path.stem}-twice.json")
            earlier = write_turns(but_last, files / f"{path.stem}-a.json")
            last = write_turns(parts[-1], files / f"{path.stem}-b.json")
            name = path.stem
            stored = ("--recall-entries", "stored")
            commands = {
                "defaults": ("ingest", str(whole), "--name", f"{name}-d"),
                "defaults, --weights float": ("ingest", str(whole), "--name", f"{name}-f", "--weights", "float"),
                "--method recall, first half of the sessions": ("ingest", str(first_half), "--name", f"{name}-rh",
                                                                "--method", "recall"),
                "--method recall, the history twice over": ("ingest", str(twice), "--name", f"{name}-r2", "--method",
                                                            "recall"),
                "defaults, first half of the sessions": ("ingest", str(first_half), "--name", f"{name}-h"),
                "--method snapkv": ("ingest", str(whole), "--name", f"{name}-s", "--method", "snapkv"),
                "defaults, all sessions but the last": ("ingest", str(earlier), "--name", f"{name}-a"),
                "--append of the last session": ("ingest", str(last), "--name", f"{name}-a", "--append"),
                "--recall-entries stored": ("ingest", str(whole), "--name", f"{name}-e", *stored),
                "--recall-entries stored, the history twice over": ("ingest", str(twice), "--name", f"{name}-e2",
                                                                    *stored),
                "--recall-entries stored, all sessions but the last": ("ingest", str(earlier), "--name",
                                                                       f"{name}-ea", *stored),
                "--append of the last session, --recall-entries stored": ("ingest", str(last), "--name",
                                                                          f"{name}-ea", "--append"),
            }  # fmt: skip
            measured = {what: run(home, *command) for what, command in commands.items()
                        if wanted is None or what in wanted}  # fmt: skip
            unit = measured["--method snapkv"][0]
            for what, (seconds, mb, doc) in measured.items():
                rows.append((name, what, doc.get("method"), doc.get("turns"), doc.get("history_tokens"),
                             doc.get("episode_count"), seconds, seconds / unit, mb,
                             doc.get("peak_layer_entries")))  # fmt: skip
                print(f"{path.stem} {what}: {seconds:.0f} s, {mb:.0f} MB", file=sys.stderr, flush=True)
    lines = [
        "# Whole conversations: ingest at the defaults",
        "",
        f"`python benchmarks/whole_ingest.py {' '.join(sys.argv[1:])}`",
        "",
        f"{dt.date.today()}, {platform.machine()}, {os.cpu_count()} cores, one torch thread, each command in its own "
        f"process (`/usr/bin/time`: wall seconds, peak RSS), the embedded model with its default weights (`--weights "
        f"auto`: int4 on a CPU) unless a row says `--weights float`; run {args.load} (load average "
        f"{os.getloadavg()[0]:.1f} at the end).",
        "",
        "| conversation | ingest | method | turns | history tokens | episodes | seconds | x snapkv | peak RSS MB | "
        "peak entries per layer |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
        *(f"| {c} | {w} | {m} | {t} | {h} | {e} | {s:.0f} | {r:.2f} | {mb:.0f} | {p} |"
          for c, w, m, t, h, e, s, r, mb, p in rows),  # fmt: skip
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
