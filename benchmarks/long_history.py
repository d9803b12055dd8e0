"""kvchat on histories of 10^5 to 10^6 tokens (issue 43): ingest time and tokens/s beside llama.cpp's prompt
processing, peak memory, disk, answer latency one-shot and through a warm server, and whether each planted fact's turn
is inside what the answer attends to.

    HF_HUB_OFFLINE=1 python benchmarks/long_history.py run 100000 300000 1000000 \
        --out benchmarks/results/records/long_history.jsonl --report benchmarks/results/long_history.md
    python benchmarks/long_history.py report --out benchmarks/results/records/long_history.jsonl \
        --report benchmarks/results/long_history.md    # the table again from the records, nothing run
    python benchmarks/long_history.py write 1000000 --dir DIR   # the history files alone

Each size is a history made here (kvchat.history.long_history, seed 0: two recurring speakers, dated sessions, 100
facts planted evenly by depth, a fifth of them updated later; sized by the embedded model's tokenizer), written as a
LoCoMo file with its questions. Per size, in `$KVCHAT_HOME` (default: a scratch home; give one where the model is
converted to skip its conversion):
- ingest: the real `kvchat ingest FILE` at the defaults (`--setting KEY=VALUE` and `--episodes` passed through with
  `--ingest`) under `/usr/bin/time -v`: wall seconds, history tokens/s, peak resident memory of the process, and the
  conversation's files on disk. `--kill-at F` also kills an ingest with SIGKILL once it reports a share F of its
  episodes and runs the same command again (with `--resume` where `kvchat ingest` has it), for the work lost.
- llama.cpp: llama-cpp-python's prompt processing of the same GGUF over the history's first `--llama-tokens` tokens
  in windows of its context (`n_ctx` 8192), with the same threads, in this run: the same cores, one after the other.
- answers: each planted question through `kvchat ask --local` (a new process: the model, encoder and the routed
  episode loaded for it) timed to the first byte of the answer on stdout (`--one-shot N` questions), and through a
  warm `kvchat serve` (started once, one question asked first) timed from the request to the first streamed chunk.
- evidence: every planted question routed and answered as `kvchat ask` answers it (kvchat.answer.session, budget as
  ingested): its evidence turn (the latest value's) counts as attended when a chunk the question recalled holds it
  (prefilled or placed) or when at least half of its entries, over every layer and KV head, are resident in the
  routed episode's cache; the answer's containing the planted value is reported beside it (a 135M reader).
Records (JSON lines) resume by size and step: a step recorded is not run again, so sizes can be run one at a time
(10^6 tokens is over an hour of ingest on 2 cores). Ingest and the latencies are timings: the load check applies.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from _load import Load, checked, shown  # benchmarks/ is on sys.path

from kvchat.config import default_home
from kvchat.history.long_history import long_history

THREADS = os.environ.get("OMP_NUM_THREADS", "2")
LLAMA_CTX = 8192


def _say(message: str) -> None:
    print(f"long_history: {message}", file=sys.stderr, flush=True)


def history_file(size: int, directory: Path, models_dir: Path) -> tuple[Path, dict]:
    """The LoCoMo file of the size's history (written once) and its description."""
    path = directory / f"long-{size}.json"
    meta = directory / f"long-{size}.meta.json"
    if path.exists() and meta.exists():
        return path, json.loads(meta.read_text())
    from transformers import AutoTokenizer

    from kvchat.model.files import resolve

    tokenizer = AutoTokenizer.from_pretrained(resolve("default", models_dir)[1])
    made = long_history(size, seed=0, count_tokens=lambda text: len(tokenizer(text, add_special_tokens=False)[
        "input_ids"]))  # fmt: skip
    path.write_text(json.dumps(made.to_locomo()))
    described = {"tokens": made.tokens, "sessions": len(made.sessions), "turns": sum(len(s.turns) for s in
                 made.sessions), "facts": len(made.facts), "updated": sum(f.updated for f in made.facts)}  # fmt: skip
    meta.write_text(json.dumps(described))
    return path, described


def _env(home: Path) -> dict[str, str]:
    return os.environ | {"KVCHAT_HOME": str(home), "OMP_NUM_THREADS": THREADS, "HF_HUB_OFFLINE": "1"}


def ingest(path: Path, name: str, home: Path, options: list[str], kill_at: float | None) -> dict:
    """`kvchat ingest` under /usr/bin/time -v: seconds, peak RSS, its --json report; with `kill_at`, killed (SIGKILL)
    once that share of its episodes began, then run again to the end."""
    command = [sys.executable, "-m", "kvchat", "ingest", str(path), "--name", name, "--replace", "--json",
               "--threads", THREADS, *options]  # fmt: skip
    first = None
    if kill_at is not None:
        first = _killed(command, home, kill_at)
        helps = subprocess.run([sys.executable, "-m", "kvchat", "ingest", "--help"], env=_env(home),
                               capture_output=True, text=True).stdout  # fmt: skip
        command = [c for c in command if c != "--replace"] + (["--resume"] if "--resume" in helps else ["--replace"])
    with tempfile.NamedTemporaryFile("r", suffix=".time") as timing:
        started = time.perf_counter()
        done = subprocess.run(["/usr/bin/time", "-v", "-o", timing.name, *command], env=_env(home),
                              capture_output=True, text=True)  # fmt: skip
        seconds = time.perf_counter() - started
        report = timing.read()
    if done.returncode != 0:
        raise SystemExit(f"kvchat ingest failed ({done.returncode}):\n{done.stderr[-3000:]}")
    peak_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", report).group(1))
    out = {"seconds": seconds, "peak_rss_mb": peak_kb / 1024, "report": json.loads(done.stdout),
           "notes": [line for line in done.stderr.splitlines() if line.startswith("kvchat: ")][:40]}  # fmt: skip
    if first is not None:
        out["killed"] = first
    return out


def _killed(command: list[str], home: Path, share: float) -> dict:
    """Run `command` until the share `share` of its episodes began, then SIGKILL it: seconds it ran, where it was."""
    started = time.perf_counter()
    process = subprocess.Popen(command, env=_env(home), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    at = None
    for line in process.stderr:
        found = re.search(r"episode (\d+)/(\d+)", line)
        if found and int(found.group(1)) - 1 >= share * int(found.group(2)):
            at = line.strip()
            process.send_signal(signal.SIGKILL)
            break
    process.wait()
    return {"seconds": time.perf_counter() - started, "at": at}


def disk_bytes(home: Path, name: str) -> int:
    """Bytes of every file of the conversation's current version (its ingest dir)."""
    found = subprocess.run([sys.executable, "-m", "kvchat", "list", "--json"], env=_env(home), capture_output=True,
                           text=True, check=True)  # fmt: skip
    listed = {c["name"]: c for c in json.loads(found.stdout)["conversations"]}
    dirs = sorted((home / "caches" / name).iterdir(), key=lambda p: p.stat().st_mtime)
    on_disk = sum(f.stat().st_size for f in dirs[-1].iterdir() if f.is_file()) if dirs else 0
    return max(listed[name]["disk_bytes"], on_disk)


def llama_cpp_rate(path: Path, tokens: int, models_dir: Path) -> dict | None:
    """llama.cpp's prompt processing (tokens/s) of the history's first `tokens` tokens, in windows of its context."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    from transformers import AutoTokenizer

    from kvchat.history.loading import format_turns, load_history
    from kvchat.model.files import default_gguf_path, resolve

    tokenizer = AutoTokenizer.from_pretrained(resolve("default", models_dir)[1])
    text = "\n".join(format_turns(load_history(path)[:4000]))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:tokens]
    llm = Llama(str(default_gguf_path()), n_ctx=LLAMA_CTX, n_threads=int(THREADS), n_threads_batch=int(THREADS),
                n_batch=512, verbose=False)  # fmt: skip
    clock = time.perf_counter()
    for start in range(0, len(ids), LLAMA_CTX):
        llm.reset()
        llm.eval(ids[start : start + LLAMA_CTX])
    seconds = time.perf_counter() - clock
    return {"tokens": len(ids), "seconds": seconds, "tokens_per_s": len(ids) / seconds, "n_ctx": LLAMA_CTX}


def first_byte(command: list[str], env: dict[str, str]) -> float:
    """Seconds from starting `python -m kvchat COMMAND` to the first byte on its stdout."""
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "kvchat", *command], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL)  # fmt: skip
    first = process.stdout.read(1)
    seconds = time.perf_counter() - started
    process.stdout.read()
    if process.wait() != 0 or not first:
        raise RuntimeError(f"kvchat {' '.join(command)} failed (exit {process.returncode})")
    return seconds


def served(home: Path, name: str, questions: list[str]) -> list[float]:
    """Seconds from each request to its first streamed content chunk through a warm `kvchat serve`."""
    from openai import OpenAI

    from kvchat.serve.announcement import announced_url

    command = [sys.executable, "-m", "kvchat", "serve", "--port", "0", "--no-log", "--threads", THREADS]
    server = subprocess.Popen(command, env=_env(home), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = None
        while server.poll() is None and url is None:
            found = announced_url(home)
            try:
                if found is not None:
                    with urllib.request.urlopen(found + "/kvchat/health", timeout=5) as response:
                        url = found if json.load(response).get("status") == "ok" else None
            except OSError:
                pass
            time.sleep(0.2)
        if url is None:
            raise RuntimeError(f"kvchat serve exited {server.returncode} before it was ready")
        client = OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)

        def ask(question: str) -> float:
            started = time.perf_counter()
            for chunk in client.chat.completions.create(model=name, max_tokens=16, stream=True,
                                                        messages=[{"role": "user", "content": question}]):
                if chunk.choices and chunk.choices[0].delta.content:
                    return time.perf_counter() - started
            return float("nan")

        ask(questions[0])  # warm: the first request loads its episode
        return [ask(q) for q in questions]
    finally:
        server.terminate()
        server.wait(timeout=60)


def evidence(home: Path, name: str, path: Path) -> list[dict]:
    """Per planted question: whether its evidence turn is recalled (a chunk the question recalled holds it) or
    resident (at least half its entries kept in the routed cache), and whether the answer holds the planted value."""
    from kvchat.answer.session import Session
    from kvchat.config import AskConfig, EvalConfig
    from kvchat.eval.qa import contains_gold, load_locomo
    from kvchat.history.spans import METADATA_KEY, from_metadata
    from kvchat.kv import codec
    from kvchat.model.encoder import SentenceEncoder
    from kvchat.model.llm import load_model, use_threads
    from kvchat.store import Store

    use_threads(int(THREADS))
    store = Store(home)
    record = store.get(name)
    lm, encoder = load_model(record.model, store.models_dir, weights=AskConfig.weights), SentenceEncoder()
    qa = load_locomo(path)
    turn_index = {t.turn_id: i for i, t in enumerate(qa.turns)}
    session = Session(store, record, lm, encoder, AskConfig(max_new_tokens=EvalConfig.max_new_tokens))
    resident_of: dict[int, dict[int, float]] = {}
    out = []
    for question in qa.questions:
        answer = session.ask(question.text, log=False)
        turn = turn_index[question.evidence[0]]
        recalled = any(first <= turn < end for first, end in answer.recalled or [])
        if answer.episode not in resident_of:
            tensors, metadata = store.load_episode(record.episodes[answer.episode], lm.fingerprint)
            cache, meta = codec.decode(tensors, metadata)
            origins = codec.stored_origins(tensors, meta, cache)
            heads = [o for layer in origins for o in layer] if origins is not None else [
                p for layer in cache.layers for p in (layer.positions if layer.ragged else layer.positions.unbind(0))]
            spans = from_metadata({METADATA_KEY: metadata[METADATA_KEY]}) if METADATA_KEY in metadata else []
            shares = {}
            for span in spans:
                size = span.end - span.start
                held = sum(int(((h >= span.start) & (h < span.end)).sum()) for h in heads)
                shares[span.index] = held / (size * len(heads)) if size else 0.0
            resident_of[answer.episode] = shares
        resident = resident_of[answer.episode].get(turn, 0.0)
        out.append({"qid": question.qid, "episode": answer.episode, "recalled": recalled, "resident": resident,
                    "attended": recalled or resident >= 0.5, "contains_gold": contains_gold(answer.text, question),
                    "depth": None})  # fmt: skip
    return out


def run(sizes: list[int], out: Path, home: Path, work: Path, args: argparse.Namespace, load: Load) -> list[dict]:
    records = [json.loads(line) for line in out.open()] if out.exists() else []
    done = {(r["size"], r["kind"]) for r in records if "size" in r}
    models_dir = home / "models"
    with out.open("a") as sink:
        def keep(record: dict) -> None:
            records.append(record)
            sink.write(json.dumps(record) + "\n")
            sink.flush()

        keep({"kind": "run", "load": load.record(), "date": str(dt.date.today()), "threads": THREADS,
              "ingest_options": args.ingest})  # fmt: skip
        for size in sizes:
            path, described = history_file(size, work, models_dir)
            name = f"long-{size}"
            if (size, "history") not in done:
                keep({"size": size, "kind": "history", **described})
            if (size, "ingest") not in done:
                _say(f"{size}: ingesting {described['tokens']:,} tokens")
                found = ingest(path, name, home, args.ingest, args.kill_at)
                keep({"size": size, "kind": "ingest", **found, "disk_bytes": disk_bytes(home, name)})
            if (size, "llama_cpp") not in done and args.llama_tokens:
                _say(f"{size}: llama.cpp prompt processing")
                rate = llama_cpp_rate(path, args.llama_tokens, models_dir)
                if rate is not None:
                    keep({"size": size, "kind": "llama_cpp", **rate})
            questions = [q["question"] for q in json.loads(path.read_text())["qa"]]
            if (size, "one_shot") not in done:
                _say(f"{size}: one-shot asks")
                picked = questions[:: max(1, len(questions) // args.one_shot)][: args.one_shot]
                seconds = [first_byte(["ask", "--local", "--no-log", "--conversation", name, q], _env(home))
                           for q in picked]  # fmt: skip
                keep({"size": size, "kind": "one_shot", "seconds": seconds})
            if (size, "serve") not in done:
                _say(f"{size}: asks through kvchat serve")
                keep({"size": size, "kind": "serve", "seconds": served(home, name, questions)})
            if (size, "evidence") not in done:
                _say(f"{size}: planted-fact evidence")
                keep({"size": size, "kind": "evidence", "questions": evidence(home, name, path)})
    return records


def report(records: list[dict], command: str) -> str:
    by: dict[tuple[int, str], dict] = {}
    for r in records:
        if "size" in r:
            by[(r["size"], r["kind"])] = r
    runs = [r for r in records if r["kind"] == "run"]
    sizes = sorted({size for size, _ in by})
    lines = [
        "# kvchat on 10^5 to 10^6-token histories", "", f"`{command}`", "",
        f"{dt.date.today()}, {platform.machine()}, {runs[-1]['threads'] if runs else THREADS} torch threads, the "
        "embedded model at kvchat's defaults (int4 weights on a CPU, budget 1024, --method auto: recall beyond the "
        "window); histories from kvchat.history.long_history (seed 0, 100 planted facts). Runs: "
        + "; ".join(f"{r['date']} {'beside other work' if r['load']['busy'] else 'alone'} (1-min load "
                    f"{r['load']['load_1min']})" for r in runs) + ".", "",
        "| history tokens | turns | episodes | ingest s | tokens/s | llama.cpp pp tokens/s | peak RSS MB | disk MB "
        "| KB / token | ask one-shot s, median [max] | warm serve s, median [p95] | evidence attended | recalled "
        "| resident | answer holds the fact |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|",
    ]
    for size in sizes:
        history, done = by.get((size, "history"), {}), by.get((size, "ingest"))
        llama, one, serve, ev = (by.get((size, k)) for k in ("llama_cpp", "one_shot", "serve", "evidence"))
        tokens = done["report"]["history_tokens"] if done else history.get("tokens", size)
        cells = [f"{tokens:,}", f"{history.get('turns', 0):,}"]
        if done:
            cells += [str(done["report"].get("episode_count", "")), f"{done['seconds']:.0f}",
                      f"{tokens / done['seconds']:.0f}", f"{llama['tokens_per_s']:.0f}" if llama else "",
                      f"{done['peak_rss_mb']:.0f}", f"{done['disk_bytes'] / 1e6:.1f}",
                      f"{done['disk_bytes'] / tokens / 1e3:.2f}"]  # fmt: skip
        else:
            cells += [""] * 7
        cells.append(f"{statistics.median(one['seconds']):.2f} [{max(one['seconds']):.2f}]" if one else "")
        cells.append(f"{statistics.median(serve['seconds']):.2f} [{_p95(serve['seconds']):.2f}]" if serve else "")
        if ev:
            qs = ev["questions"]
            cells += [f"{statistics.mean(q[k] for q in qs):.0%}" for k in ("attended", "recalled")]
            cells += [f"{statistics.mean(q['resident'] >= 0.5 for q in qs):.0%}",
                      f"{statistics.mean(q['contains_gold'] for q in qs):.0%}"]  # fmt: skip
        else:
            cells += [""] * 4
        lines.append("| " + " | ".join(cells) + " |")
    killed = [(size, by[(size, "ingest")]) for size in sizes if "killed" in by.get((size, "ingest"), {})]
    for size, done in killed:
        lines += ["", f"{size:,}: killed after {done['killed']['seconds']:.0f} s at `{done['killed']['at']}`, then "
                  f"run again: {done['seconds']:.0f} s more."]  # fmt: skip
    return "\n".join(lines) + "\n"


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    ran = sub.add_parser("run", help="measure the sizes given (resumed from the records)")
    ran.add_argument("sizes", nargs="+", type=int)
    ran.add_argument("--out", type=Path, required=True, help="records, JSON lines (resumed)")
    ran.add_argument("--report", type=Path)
    ran.add_argument("--work", type=Path, help="where the history files go (default: a scratch dir)")
    ran.add_argument("--ingest", nargs=argparse.REMAINDER, default=[], help="options passed to kvchat ingest")
    ran.add_argument("--kill-at", type=float, help="kill the ingest at this share of its episodes, then resume")
    ran.add_argument("--llama-tokens", type=int, default=2 * LLAMA_CTX, help="0: no llama.cpp measurement")
    ran.add_argument("--one-shot", type=int, default=5, help="questions asked one-shot")
    again = sub.add_parser("report", help="the table from the records")
    again.add_argument("--out", type=Path, required=True)
    again.add_argument("--report", type=Path)
    write = sub.add_parser("write", help="write the history files")
    write.add_argument("sizes", nargs="+", type=int)
    write.add_argument("--dir", type=Path, required=True)
    args = checked(parser, skip=lambda a: a.command != "run")
    command = "python benchmarks/long_history.py " + " ".join(
        shown(Path(a)) if os.path.sep in a and os.path.exists(a) else a for a in sys.argv[1:])  # fmt: skip
    home = default_home() if "KVCHAT_HOME" in os.environ else Path(tempfile.mkdtemp(prefix="kvchat-long-"))
    if args.command == "write":
        args.dir.mkdir(parents=True, exist_ok=True)
        for size in args.sizes:
            print(history_file(size, args.dir, home / "models")[0])
        return
    if args.command == "run":
        work = args.work or Path(tempfile.mkdtemp(prefix="kvchat-long-work-"))
        work.mkdir(parents=True, exist_ok=True)
        records = run(args.sizes, args.out, home, work, args, args.load)
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    else:
        records = [json.loads(line) for line in args.out.open()]
    text = report(records, command)
    print(text)
    if args.report is not None:
        args.report.write_text(text)


if __name__ == "__main__":
    main()
