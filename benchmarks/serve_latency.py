"""First-token latency of `kvchat serve`: questions one at a time, then N streaming clients at once.

    HF_HUB_OFFLINE=1 python benchmarks/serve_latency.py [--clients 4] [--tokens 32] [--threads 2] [--out PATH]

A planted-fact conversation (kvchat.synthetic, 4 topics) is ingested with the embedded model into a temporary
home; the server (uvicorn on 127.0.0.1, the model and encoder preloaded) runs in this process. Each client
uses the `openai` package, streams its answer and measures the time from sending its request to its first
content chunk. Pass 1 asks every question alone (the server's caches warm after the first one per episode);
pass 2 sends `--clients` questions at once, `--rounds` times. Every concurrent answer must equal that question's
answer alone: the row says how many did. One worker answers one question at a time, so a client's first token
waits for the answers queued before it: pass 2's p95 is about the answers ahead of the last client.

A markdown section goes to stdout and to `--out`; progress to stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvchat.config import CacheConfig, IngestConfig, ServeConfig
from kvchat.encoder import SentenceEncoder
from kvchat.ingest import ingest
from kvchat.llm import load_model, use_threads
from kvchat.serve.engine import Engine
from kvchat.serve.server import build_server
from kvchat.store import Store
from kvchat.synthetic import planted_conversation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--models-dir", type=Path, default=None, help="where the embedded model is converted "
                        "(default: the temporary home's, converted anew)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from openai import OpenAI

    use_threads(args.threads)
    home = Path(tempfile.mkdtemp(prefix="kvchat-serve-bench-"))
    messages, qa = planted_conversation(seed=3, topics=4, turns_per_topic=16)
    history = home / "planted.json"
    history.write_text(json.dumps(messages))
    store = Store(home)
    lm, encoder = load_model("default", args.models_dir or store.models_dir), SentenceEncoder()
    _say("ingesting the planted-fact conversation")
    ingest(history, name="planted", config=IngestConfig(cache=CacheConfig(budget=args.budget)), store=store, lm=lm,
           encoder=encoder)
    store.close()
    questions = [fact.question for fact in qa]

    config = ServeConfig(port=0, preload=False, log=False, threads=args.threads, queue_size=max(8, args.clients))
    server = build_server(config, home=home, engine=Engine(home, config, models={lm.spec: lm}, encoder=encoder))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    client = OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)

    def ask(question: str) -> tuple[float, float, str]:
        started = time.perf_counter()
        first, text = None, []
        for chunk in client.chat.completions.create(model="planted", max_tokens=args.tokens, stream=True,
                                                    messages=[{"role": "user", "content": question}]):
            piece = chunk.choices[0].delta.content if chunk.choices else None
            if piece:
                first = first or time.perf_counter() - started
                text.append(piece)
        return first or float("nan"), time.perf_counter() - started, "".join(text)

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
    server.should_exit = True
    thread.join()

    rows = [_row("one at a time", list(alone.values())), _row(f"{args.clients} clients at once", together)]
    lines = [
        f"### kvchat serve: first-token latency ({args.clients} streaming clients, {args.tokens} tokens)", "",
        f"Embedded SmolLM2-135M, float32, {args.threads} threads, planted-fact conversation "
        f"({len(questions)} questions), budget {args.budget}; one worker answers one request at a time.", "",
        "| pass | answers | first token p50 (s) | first token p95 (s) | answer p95 (s) |",
        "|---|---:|---:|---:|---:|", *rows, "",
        f"Concurrent answers equal to the same question asked alone: {equal} of {len(together)}.",
    ]
    report = "\n".join(lines) + "\n"
    sys.stdout.write(report)
    if args.out is not None:
        args.out.write_text(report)


def _row(name: str, results: list[tuple[float, float, str]]) -> str:
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
