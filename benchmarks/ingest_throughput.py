"""Ingest throughput against llama.cpp's prompt processing of the same GGUF on the same cores, side by side.

    python benchmarks/ingest_throughput.py --tokens 4096 --threads 2 --out benchmarks/results/ingest_throughput.md

The history: the shared LoCoMo conversations' turns (conv-26, then conv-30, again while needed) cut to whole turns
of at least --tokens history tokens. With the embedded model on --threads torch and llama.cpp threads, in one run:
1. llama.cpp's prompt processing of the system prompt and the history's token ids (kvchat's, the GGUF's own
   vocabulary) in windows of at most the model's 8192 positions: tokens/s, the unit;
2. one full-KV block prefill of the same ids (block 512, no scoring nor eviction) by kvchat's model: with the
   decoder's int4 weights through torch's int4 kernel (what answering runs), with them held dense in bfloat16
   (`LoadedModel.prefill_weights`, what ingest runs), and with float32 weights;
3. `ingest` at the defaults (`IngestConfig()`, `--weights auto`) of the same turns: history tokens/s, and where the
   time goes (planning: tokenizing, embedding, clustering; the shared history prefill; the episodes' block
   prefill, probe scoring and eviction with their writes; the rest: recall's entries, the store's commit).
Each kvchat row is a ratio to llama.cpp's tokens/s. Progress on stderr; the markdown goes to stdout and to --out,
one JSON line per run to --records.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import platform
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import torch
from _load import checked  # benchmarks/ is on sys.path

from kvchat.config import SYSTEM_PROMPT, IngestConfig
from kvchat.history.loading import format_turns, load_history
from kvchat.ingest.pipeline import IngestProgress, ingest
from kvchat.kv.prefill import block_prefill
from kvchat.model.encoder import SentenceEncoder
from kvchat.model.files import default_gguf_path
from kvchat.model.llm import ChatLayout, LoadedModel, load_model, use_threads
from kvchat.store import Store

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "locomo"
RESULTS = REPO / "benchmarks" / "results"
WINDOW = 8192  # the embedded model's positions: llama.cpp's context, and each prefill's
BLOCK = 512


def log(message: str) -> None:
    print(f"[ingest_throughput {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def history_turns(lm: LoadedModel, tokens: int, conversations: list[Path]) -> list:
    """Whole turns of the conversations, in turn and again, until their formatted text reaches `tokens` tokens."""
    pool = [turn for path in conversations for turn in load_history(path)]
    turns, count = [], 0
    while count < tokens:
        turn = pool[len(turns) % len(pool)]
        turns.append(turn)
        count += lm.encode("\n" + format_turns([turn])[-1]).shape[-1]
    return turns


def windows(prefix: torch.Tensor, history: torch.Tensor) -> list[torch.Tensor]:
    """The history in pieces that fit the window after the prefix."""
    step = WINDOW - prefix.shape[-1]
    return [history[:, start : start + step] for start in range(0, history.shape[-1], step)]


def llama_cpp_rate(prefix: torch.Tensor, history: torch.Tensor, threads: int) -> float:
    from llama_cpp import Llama

    llm = Llama(str(default_gguf_path()), n_ctx=WINDOW, n_batch=BLOCK, n_threads=threads, n_threads_batch=threads,
                verbose=False)  # fmt: skip
    llm.eval(prefix[0].tolist())  # warm
    fed, seconds = 0, 0.0
    for piece in windows(prefix, history):
        ids = torch.cat([prefix, piece], dim=-1)[0].tolist()
        llm.reset()
        clock = time.perf_counter()
        llm.eval(ids)
        seconds += time.perf_counter() - clock
        fed += len(ids)
    return fed / seconds


def kvchat_prefill_rate(lm: LoadedModel, prefix: torch.Tensor, history: torch.Tensor, dense: bool
                        ) -> tuple[float, float]:  # fmt: skip
    """Tokens/s of full-KV block prefills of the history's windows, and the seconds holding the dense weights took
    (once per ingest: not in the rate)."""
    fed, seconds = 0, 0.0
    with torch.inference_mode(), ExitStack() as stack:
        clock = time.perf_counter()
        if dense:
            stack.enter_context(lm.prefill_weights())
        holding = time.perf_counter() - clock
        block_prefill(lm.model, prefix, history[:, :BLOCK], block_size=BLOCK, budgets=None, scorer=None)  # warm
        for piece in windows(prefix, history):
            clock = time.perf_counter()
            block_prefill(lm.model, prefix, piece, block_size=BLOCK, budgets=None, scorer=None)
            seconds += time.perf_counter() - clock
            fed += prefix.shape[-1] + piece.shape[-1]
    return fed / seconds, holding


class Phases(IngestProgress):
    """When each stage of an ingest began (seconds from the start)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.planned_at = self.first_episode = self.last_block = 0.0

    def planned(self, blocks: int, episodes: int, tokens: int) -> None:
        self.planned_at, self.blocks = time.perf_counter() - self.start, blocks

    def episode(self, index: int, total: int) -> None:
        if not self.first_episode:
            self.first_episode = time.perf_counter() - self.start

    def block(self, done: int, total: int) -> None:
        self.last_block = time.perf_counter() - self.start


def ingest_run(lm: LoadedModel, turns: list, encoder: SentenceEncoder) -> dict:
    with tempfile.TemporaryDirectory() as home:
        phases = Phases()
        report = ingest(turns, name="h", config=IngestConfig(), store=Store(Path(home)), lm=lm, encoder=encoder,
                        source="h", progress=phases)  # fmt: skip
        total = time.perf_counter() - phases.start
    episodes_end = phases.last_block or phases.first_episode
    return {"history_tokens": report.history_tokens, "seconds": total, "method": report.method,
            "episodes": report.episodes, "blocks": getattr(phases, "blocks", 0),
            "planning": phases.planned_at, "history_prefill": max(phases.first_episode - phases.planned_at, 0.0),
            "episode_builds": max(episodes_end - phases.first_episode, 0.0),
            "rest": total - max(episodes_end, phases.planned_at)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="history tokens (at least; whole turns)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads and llama.cpp threads")
    parser.add_argument("--conversations", type=Path, nargs="+", default=[DATA / "conv-26.json", DATA / "conv-30.json"])
    parser.add_argument("--models-dir", type=Path, default=Path(tempfile.gettempdir()) / "kvchat-bench-models",
                        help="where the embedded GGUF is converted (once)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--records", type=Path, default=RESULTS / "records" / "ingest_throughput.jsonl")
    args = checked(parser)
    if importlib.util.find_spec("llama_cpp") is None:
        raise SystemExit("llama-cpp-python is not installed (pip install 'kvchat[bench]')")
    threads = use_threads(args.threads)
    auto = load_model("default", args.models_dir, weights="auto")
    float32 = load_model("default", args.models_dir, weights="float")
    encoder = SentenceEncoder()
    turns = history_turns(auto, args.tokens, args.conversations)
    prefix = auto.encode(ChatLayout.from_tokenizer(auto.tokenizer, SYSTEM_PROMPT).before_conversation)
    history = auto.encode("\n".join(format_turns(turns)))
    n = history.shape[-1]
    log(f"{threads} threads, {len(turns)} turns, {n} history tokens, weights auto = {auto.weights}")

    unit = llama_cpp_rate(prefix, history, threads)
    log(f"llama.cpp prompt processing: {unit:.0f} tokens/s")
    rates, holding = {}, 0.0
    for label, lm, dense in [(f"{auto.weights} weights, torch's {auto.weights} kernel", auto, False),
                             (f"{auto.weights} weights held dense in bfloat16 (ingest)", auto, True),
                             ("float32 weights", float32, False)]:  # fmt: skip
        rates[label], held = kvchat_prefill_rate(lm, prefix, history, dense)
        holding = held if dense else holding
        log(f"kvchat prefill, {label}: {rates[label]:.0f} tokens/s" + (f" (held in {held:.2f} s)" if dense else ""))
    run = ingest_run(auto, turns, encoder)
    rate = run["history_tokens"] / run["seconds"]
    log(f"kvchat ingest at the defaults: {run['seconds']:.1f} s, {rate:.0f} history tokens/s ({run})")

    lines = [
        f"Embedded model (SmolLM2-135M-Instruct, {auto.weights} weights at the defaults), {threads} threads on "
        f"{platform.processor() or platform.machine()}, torch {torch.__version__}; run {args.load}.",
        f"History: {len(turns)} LoCoMo turns, {n} history tokens (the system prompt, {prefix.shape[-1]} tokens, "
        f"fed again per window of {WINDOW} positions by the prefill rows).",
        "",
        "| what | tokens/s | x llama.cpp |",
        "|---|---|---|",
        f"| llama.cpp prompt processing (llama-cpp-python, n_batch {BLOCK}) | {unit:.0f} | 1.00 |",
        *(f"| kvchat full-KV block prefill ({BLOCK}), {label} | {r:.0f} | {r / unit:.2f} |"
          for label, r in rates.items()),
        f"| **kvchat ingest at the defaults** (method {run['method']}, {run['episodes']} episodes, "
        f"{run['blocks']} block forwards), history tokens | {rate:.0f} | {rate / unit:.2f} |",
        "",
        f"Holding the int4 weights dense in bfloat16 took {holding:.2f} s (once per ingest; not in the prefill's rate; "
        f"{auto.prefill_weight_bytes / 2**20:.0f} MiB while held).",
        "",
        f"Where the ingest's {run['seconds']:.1f} s went:",
        "",
        "| stage | seconds | share |",
        "|---|---|---|",
        *(f"| {label} | {run[key]:.1f} | {run[key] / run['seconds']:.0%} |" for key, label in [
            ("planning", "planning: tokenizing, segment embeddings, clustering, routing"),
            ("history_prefill", "the history prefill the episodes share (full prefill)"),
            ("episode_builds", "episodes: block prefill, probe scoring, eviction, and their writes"),
            ("rest", "the rest: the last episode's write, recall entries, the store's commit")]),
    ]  # fmt: skip
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    args.records.parent.mkdir(parents=True, exist_ok=True)
    with args.records.open("a") as records:
        records.write(json.dumps({"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                                  "threads": threads, "history_tokens": n, "weights": auto.weights,
                                  "llama_cpp_tokens_per_s": round(unit, 1),
                                  "prefill_tokens_per_s": {k: round(v, 1) for k, v in rates.items()},
                                  "holding_dense_s": round(holding, 3),
                                  "ingest": {k: round(v, 2) if isinstance(v, float) else v for k, v in run.items()},
                                  "load": args.load.record() if args.load else None}) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
