"""Uniform vs adaptive (AdaKV) head budgets on the embedded model, side by side in one run.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/head_budgets.py [--budget 256] [--tokens 32] [--out PATH]

Ingests examples/planted_facts.json (the four planted facts of kvchat.history.synthetic seed 7) once per mode
into a fresh temporary home, then reports: bytes stored and resident, how uneven the heads' lengths
get, decode speed (forced greedy tokens on each mode's episode caches, modes interleaved so both see
the same machine load; median of the rounds), and the answers to the four planted questions.
Progress goes to stderr; a markdown section goes to stdout and to `--out`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _load import checked
from core_loop import forced_decode  # benchmarks/ is on sys.path when a script here runs

from kvchat.answer.session import Session
from kvchat.config import CacheConfig, IngestConfig
from kvchat.history.synthetic import planted_conversation
from kvchat.ingest.pipeline import IngestReport, ingest
from kvchat.kv import codec
from kvchat.kv.cache import EpisodeCache
from kvchat.model.encoder import SentenceEncoder
from kvchat.model.llm import ChatLayout, load_model
from kvchat.store import Store

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "planted_facts.json"
TEST_MODELS_DIR = REPO / ".venv" / "kvchat-test-models"
MODES = ("uniform", "adaptive")
ROUNDS = 3


def log(message: str) -> None:
    print(f"[head_budgets {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)



def head_spread(cache: EpisodeCache) -> tuple[int, int, float]:
    """(fewest, most) entries of one head, and the mean over layers of max/min head length."""
    lengths = [layer.lengths for layer in cache.layers]
    flat = [n for ls in lengths for n in ls]
    return min(flat), max(flat), statistics.fmean(max(ls) / max(min(ls), 1) for ls in lengths)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=32, help="forced decode tokens per measurement")
    parser.add_argument("--out", type=Path, default=None)
    args = checked(parser)
    torch.set_grad_enabled(False)

    lm = load_model("default", TEST_MODELS_DIR)
    encoder = SentenceEncoder()
    _, facts = planted_conversation(7, topics=4, turns_per_topic=24)  # what examples/planted_facts.json holds
    home = Path(tempfile.mkdtemp(prefix="kvchat-heads-"))
    store = Store(home)
    reports: dict[str, IngestReport] = {}
    caches: dict[str, list[EpisodeCache]] = {}
    answers: dict[str, list[str]] = {}
    for mode in MODES:
        config = IngestConfig(cache=CacheConfig(budget=args.budget, head_budgets=mode, prefill="block"))
        reports[mode] = ingest(EXAMPLE, name=mode, config=config, store=store, lm=lm, encoder=encoder)
        record = store.get(mode)
        session = Session(store, record, lm, encoder)
        answers[mode] = [session.ask(f.question, log=False).text for f in facts]
        caches[mode] = []
        for episode in record.episodes:
            caches[mode].append(codec.decode(*store.load_episode(episode, lm.fingerprint))[0])
        log(f"{mode}: {reports[mode].cache_bytes} bytes stored, {reports[mode].seconds:.1f} s, {answers[mode]}")

    layout = ChatLayout.from_tokenizer(lm.tokenizer, IngestConfig().system_prompt)
    prompt = lm.encode(layout.question(facts[3].question))
    for mode in MODES:
        forced_decode(lm, caches[mode][0], prompt, 4)  # warm-up
    speeds: dict[str, list[float]] = {mode: [] for mode in MODES}
    for r in range(ROUNDS):
        for mode in MODES if r % 2 == 0 else reversed(MODES):
            seconds = sum(forced_decode(lm, cache, prompt, args.tokens) for cache in caches[mode])
            speeds[mode].append(args.tokens * len(caches[mode]) / seconds)
            log(f"round {r} {mode}: {speeds[mode][-1]:.1f} tokens/s")

    lines = [
        "## Head budgets: uniform vs adaptive (AdaKV)",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} with "
        f"{torch.get_num_threads()} threads, run {args.load}; "
        f"SmolLM2-135M-Instruct (embedded, float32, 30 layers x 3 KV heads x 64); "
        f"{dt.date.today()}. `examples/planted_facts.json` ({reports['uniform'].history_tokens} tokens), "
        f"budget {args.budget}, block {CacheConfig.block_size}, {reports['uniform'].layer_budgets} layer budgets, "
        f"{reports['uniform'].episodes} episodes. Decode: {args.tokens} forced tokens on every episode cache, "
        f"modes interleaved, median of {ROUNDS} rounds.",
        "",
        "| head budgets | stored bytes | resident bytes | kept entries | bytes/entry | fewest-most entries per head "
        "| mean max/min head length per layer | decode tokens/s | planted facts right |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for mode in MODES:
        resident = sum(c.nbytes() for c in caches[mode])
        entries = sum(c.entries for c in caches[mode])
        spreads = [head_spread(c) for c in caches[mode]]
        right = sum(f.answer.lower() in a.lower() for f, a in zip(facts, answers[mode], strict=True))
        lines.append(
            f"| {mode} | {reports[mode].cache_bytes} | {resident} | {entries} | {resident / entries:.0f} "
            f"| {min(s[0] for s in spreads)}-{max(s[1] for s in spreads)} "
            f"| {statistics.fmean(s[2] for s in spreads):.2f} | {statistics.median(speeds[mode]):.1f} "
            f"| {right}/{len(facts)} |"
        )
    lines += ["", "Answers:", ""]
    for f, u, a in zip(facts, answers["uniform"], answers["adaptive"], strict=True):
        lines.append(f"- {f.question} (planted: {f.answer}) uniform: {u!r}; adaptive: {a!r}")
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    if args.out:
        args.out.write_text(text)
    store.close()


if __name__ == "__main__":
    main()
