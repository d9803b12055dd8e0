"""Ingest time by prefill mode, appending, and what full prefill changes in the answers.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/ingest_speed.py [--max-context 4096]

On each history (the shared LoCoMo conversations cut to --max-context tokens, whole sessions), with the
embedded model, one thread, E = 4 episodes, budget 512, block 512, all side by side in one run:
1. seconds of one full-KV prefill of the history (the unit), of `ingest --prefill block`, `--prefill full`
   and `--method full`, each as a ratio to that unit, with the peak entries per layer;
2. appending the last 10% of the turns to an ingest of the first 90% vs ingesting all of it again;
3. first-token KL and answer agreement vs full KV of epicache built block by block vs from the full
   prefill (kvchat.eval.evaluate, --questions per conversation).
Progress on stderr; the markdown goes to stdout and to --out.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from _load import checked  # benchmarks/ is on sys.path

from kvchat.config import CacheConfig, EpisodeConfig, EvalConfig, IngestConfig
from kvchat.eval.evaluate import ResultsFile, Variant, evaluate, qa_sets
from kvchat.eval.summary import summarize
from kvchat.history.loading import Turn
from kvchat.ingest.append import append
from kvchat.ingest.pipeline import IngestReport, ingest, plan_ingest
from kvchat.kv.prefill import block_prefill
from kvchat.model.encoder import SentenceEncoder
from kvchat.model.llm import load_model, use_threads
from kvchat.store import Store

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data" / "locomo"
RESULTS = REPO / "benchmarks" / "results"
CONFIG = IngestConfig(cache=CacheConfig(budget=512, block_size=512), episodes=EpisodeConfig(episodes=4))


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def timed_ingest(turns: list[Turn], config: IngestConfig, lm, encoder) -> tuple[float, IngestReport]:
    with tempfile.TemporaryDirectory() as home:
        clock = time.perf_counter()
        report = ingest(turns, name="h", config=config, store=Store(Path(home)), lm=lm, encoder=encoder, source="h")
        return time.perf_counter() - clock, report


def speed_rows(name: str, turns: list[Turn], lm, encoder) -> list[str]:
    with tempfile.TemporaryDirectory() as home:
        plan = plan_ingest(turns, name="h", config=CONFIG, store=Store(Path(home)), lm=lm, encoder=encoder)
    clock = time.perf_counter()
    block_prefill(lm.model, plan.prefix_ids, plan.context_ids, block_size=512, budgets=None, scorer=None)
    unit = time.perf_counter() - clock
    log(f"{name}: {plan.context_ids.shape[-1]} tokens, one full-KV prefill {unit:.1f} s")
    rows = [f"| {name} | one full-KV prefill | {unit:.1f} | 1.00 | {plan.prefix_ids.shape[-1] + plan.history_tokens} |"]
    for label, cache in (
        ("epicache, --prefill block", CacheConfig(budget=512, block_size=512, prefill="block")),
        ("epicache, --prefill full", CacheConfig(budget=512, block_size=512, prefill="full")),
        ("--method full", CacheConfig(method="full", block_size=512)),
    ):
        seconds, report = timed_ingest(turns, IngestConfig(cache=cache, episodes=CONFIG.episodes), lm, encoder)
        log(f"{name}: {label} {seconds:.1f} s, peak {report.peak_layer_entries}")
        rows.append(f"| {name} | {label} | {seconds:.1f} | {seconds / unit:.2f} | {report.peak_layer_entries} |")
    cut = int(len(turns) * 0.9)
    block = IngestConfig(cache=CacheConfig(budget=512, block_size=512, prefill="block"), episodes=CONFIG.episodes)
    with tempfile.TemporaryDirectory() as home:
        store = Store(Path(home))
        ingest(turns[:cut], name="h", config=block, store=store, lm=lm, encoder=encoder, source="h")
        clock = time.perf_counter()
        append(turns[cut:], name="h", store=store, lm=lm, encoder=encoder, source="more")
        appended = time.perf_counter() - clock
    again, _ = timed_ingest(turns, block, lm, encoder)
    log(f"{name}: append 10% {appended:.1f} s vs re-ingest {again:.1f} s")
    rows.append(f"| {name} | append the last {len(turns) - cut} of {len(turns)} turns (block) | {appended:.1f} | "
                f"{appended / unit:.2f} ({appended / again:.0%} of a re-ingest, {again:.1f} s) | |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", nargs="*", type=Path, default=[SHARED / "conv-26.json", SHARED / "conv-30.json"])
    parser.add_argument("--max-context", type=int, default=4096)
    parser.add_argument("--questions", type=int, default=10, help="per conversation, for KL and agreement")
    parser.add_argument("--out", type=Path, default=RESULTS / "ingest_speed.md")
    args = checked(parser)

    threads = use_threads()
    lm = load_model("default", REPO / ".venv" / "kvchat-test-models")
    encoder = SentenceEncoder()
    config = EvalConfig(max_context=args.max_context, questions=args.questions)
    sets = qa_sets(args.data, 0, lm, config)
    lines = [
        f"Embedded model, {threads} thread(s), {os.cpu_count()} CPUs; budget 512, block 512, 4 episodes; "
        f"histories cut to {args.max_context} tokens (whole sessions); run {args.load}.", "",
        "| history | build | seconds | x one full-KV prefill | peak entries/layer |", "|---|---|---|---|---|",
    ]
    for qa_set in sets:
        lines += speed_rows(qa_set.name, qa_set.turns, lm, encoder)
    variants = [Variant(CacheConfig(budget=512, block_size=512, prefill=mode)) for mode in ("block", "full")]
    with tempfile.TemporaryDirectory() as scratch:
        records = evaluate(sets, variants, lm=lm, encoder=encoder, config=config,
                           base=IngestConfig(cache=CacheConfig(block_size=512)),
                           results=ResultsFile(Path(scratch) / "r.jsonl"))  # fmt: skip
    lines += ["", f"Against full KV, {args.questions} questions per conversation (LoCoMo categories 1-4):", "",
              "| variant | questions | first-token KL | agreement | evidence kept (routed) |", "|---|---|---|---|---|"]
    for row in summarize(records):
        if row["variant"] != "full":
            lines.append(f"| {row['variant']} | {row['questions']} | {row['kl']:.3f} | {row['agreement']:.2f} | "
                         f"{row['evidence_kept'] or 0:.3f} |")
    text = "\n".join(lines) + "\n"
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
