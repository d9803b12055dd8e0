"""First-token latency of `kvchat serve` (questions one at a time, then N streaming clients at once), and of the
one-shot commands a user runs without a server.

    HF_HUB_OFFLINE=1 python benchmarks/serve_latency.py [--clients 4] [--tokens 32] [--threads 2] [--out PATH]

A planted-fact conversation (kvchat.history.synthetic, 4 topics) is ingested with the embedded model into a temporary
home (the model converted there first, so every later load finds it converted); the server is `kvchat serve` in
its own process, as a user runs it (port 0, found through `$KVCHAT_HOME`, the model and encoder preloaded before
the first question). Each client uses the `openai` package in this process,
streams its answer and measures the time from sending its request to its first content chunk; the usage chunk
gives the answer's tokens, so the decode rate through the server is (tokens - 1) over the time from the first
content chunk to the last. Pass 1 asks every question alone (the server's caches warm after the first one per
episode); pass 2 sends `--clients` questions at once, `--rounds` times. Every concurrent answer must equal that
question's answer alone: the row says how many did. One worker answers one question at a time, so a client's
first token waits for the answers queued before it: pass 2's p95 is about the answers ahead of the last client.

Then the command line, each a new process (`python -m kvchat`, `$KVCHAT_HOME` the temporary home): `kvchat ask
QUESTION` while the server runs (it finds the server in `$KVCHAT_HOME` and asks it), `kvchat ask --local
QUESTION` after it stopped (SIGTERM) (torch, the model and the encoder loaded in the process), both timed from the start
of the process to the first byte of the answer on stdout; and `kvchat list` to its exit. `--repeat` runs each.

A markdown section goes to stdout and to `--out`; progress to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _load import checked  # benchmarks/ is on sys.path

from kvchat.config import WEIGHT_MODES, AskConfig, CacheConfig, IngestConfig
from kvchat.history.synthetic import planted_conversation
from kvchat.ingest.pipeline import ingest
from kvchat.model.encoder import SentenceEncoder
from kvchat.model.llm import load_model, use_threads
from kvchat.serve.announcement import announced_url
from kvchat.store import Store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--weights", choices=WEIGHT_MODES, default=AskConfig.weights, help="the server's weights")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each command-line measurement")
    parser.add_argument("--out", type=Path, default=None)
    args = checked(parser)
    from openai import OpenAI

    use_threads(args.threads)
    home = Path(tempfile.mkdtemp(prefix="kvchat-serve-bench-"))
    messages, qa = planted_conversation(seed=3, topics=4, turns_per_topic=16)
    history = home / "planted.json"
    history.write_text(json.dumps(messages))
    store = Store(home)
    lm, encoder = load_model("default", store.models_dir), SentenceEncoder()
    _say("ingesting the planted-fact conversation")
    ingest(history, name="planted", config=IngestConfig(cache=CacheConfig(budget=args.budget)), store=store, lm=lm,
           encoder=encoder)
    store.close()
    questions = [fact.question for fact in qa]

    del lm, encoder
    env = os.environ | {"KVCHAT_HOME": str(home), "OMP_NUM_THREADS": str(args.threads)}
    server, url = _start_server(home, env, args)
    client = OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)

    def ask(question: str) -> tuple[float, float, str, float]:
        """(first token s, answer s, text, decode tokens/s after the first token)."""
        started = time.perf_counter()
        first = last = None
        text, tokens = [], 0
        for chunk in client.chat.completions.create(model="planted", max_tokens=args.tokens, stream=True,
                                                    stream_options={"include_usage": True},
                                                    messages=[{"role": "user", "content": question}]):
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            piece = chunk.choices[0].delta.content if chunk.choices else None
            if piece:
                last = time.perf_counter() - started
                first = first or last
                text.append(piece)
        rate = (tokens - 1) / (last - first) if first is not None and last > first and tokens > 1 else float("nan")
        return first or float("nan"), time.perf_counter() - started, "".join(text), rate

    ask(questions[0])  # the first request pays for loading its episode
    _say(f"pass 1: {len(questions)} questions one at a time")
    alone = {q: ask(q) for q in questions}
    _say(f"pass 2: {args.clients} clients at once, {args.rounds} rounds")
    together, equal = [], 0
    with ThreadPoolExecutor(args.clients) as pool:
        for r in range(args.rounds):
            batch = [questions[(r * args.clients + i) % len(questions)] for i in range(args.clients)]
            for question, result in zip(batch, pool.map(ask, batch), strict=True):
                together.append(result)
                equal += result[2] == alone[question][2]
    _say(f"kvchat ask through the server, {args.repeat} times")
    through = [_first_byte(["ask", questions[0], "--conversation", "planted"], env) for _ in range(args.repeat)]
    server.terminate()
    if server.wait(timeout=60) not in (0, 128 + signal.SIGTERM):  # kvchat exits 128 + signal after a clean stop
        raise RuntimeError(f"kvchat serve exited {server.returncode} on SIGTERM")
    _say(f"kvchat ask --local and kvchat list, {args.repeat} times each")
    local = [_first_byte(["ask", "--local", "--no-log", questions[0], "--conversation", "planted"], env)
             for _ in range(args.repeat)]
    listing = [_first_byte(["list"], env, to_exit=True) for _ in range(args.repeat)]

    rows = [_row("one at a time", list(alone.values())), _row(f"{args.clients} clients at once", together)]
    rates = [r[3] for r in alone.values() if r[3] == r[3]]
    lines = [
        f"### kvchat serve: first-token latency ({args.clients} streaming clients, {args.tokens} tokens)", "",
        f"Embedded SmolLM2-135M, `--weights {args.weights}`, {args.threads} threads, "
        f"planted-fact conversation ({len(questions)} questions), budget {args.budget}; `kvchat serve` in its own "
        f"process, the clients in another; one worker answers one request at a time. Run {args.load}; load "
        f"average at the end {os.getloadavg()[0]:.1f}.", "",
        "| pass | answers | first token p50 (s) | first token p95 (s) | answer p95 (s) |",
        "|---|---:|---:|---:|---:|", *rows, "",
        f"Concurrent answers equal to the same question asked alone: {equal} of {len(together)}. Decode through the "
        f"server (one at a time, tokens after the first over their time): median {statistics.median(rates):.1f} "
        "tokens/s.", "",
        f"### The command line, one process each ({args.repeat} runs)", "",
        "| command | median (s) | runs (s) |", "|---|---:|---|",
        _command_row("`kvchat ask QUESTION` with the server running: to the first answer byte", through),
        _command_row("`kvchat ask --local QUESTION` (model converted): to the first answer byte", local),
        _command_row("`kvchat list`: to its exit", listing),
    ]
    report = "\n".join(lines) + "\n"
    sys.stdout.write(report)
    if args.out is not None:
        args.out.write_text(report)


def _start_server(home: Path, env: dict[str, str], args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    """`kvchat serve` in its own process; its URL once it is announced in the home and says it is ready."""
    command = [sys.executable, "-m", "kvchat", "serve", "--port", "0", "--weights", args.weights, "--no-log",
               "--threads", str(args.threads), "--queue-size", str(max(8, args.clients))]
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while server.poll() is None:
        url = announced_url(home)
        if url is not None:
            try:
                with urllib.request.urlopen(url + "/kvchat/health", timeout=5) as response:
                    if json.load(response).get("status") == "ok":
                        return server, url
            except OSError:
                pass
        time.sleep(0.2)
    raise RuntimeError(f"kvchat serve exited {server.returncode} before it was ready")


def _first_byte(command: list[str], env: dict[str, str], to_exit: bool = False) -> float:
    """Seconds from starting `python -m kvchat COMMAND` to the first byte on its stdout (or to its exit)."""
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "kvchat", *command], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL)
    first = process.stdout.read(1)
    seconds = time.perf_counter() - started
    process.stdout.read()
    if process.wait() != 0 or not first:
        raise RuntimeError(f"kvchat {' '.join(command)} failed (exit {process.returncode})")
    return time.perf_counter() - started if to_exit else seconds


def _command_row(name: str, seconds: list[float]) -> str:
    return f"| {name} | {statistics.median(seconds):.2f} | {', '.join(f'{s:.2f}' for s in seconds)} |"


def _row(name: str, results: list[tuple[float, float, str, float]]) -> str:
    firsts, totals = [r[0] for r in results], [r[1] for r in results]
    return (f"| {name} | {len(results)} | {statistics.median(firsts):.3f} | {_p95(firsts):.3f} | "
            f"{_p95(totals):.3f} |")


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def _say(message: str) -> None:
    print(f"serve_latency: {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
