"""Core-loop benchmark on the embedded model: peak cache size, decode speed, and where a turn's time goes.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/core_loop.py [--quick] [--out PATH]

1. Peak KV entries per layer during block prefill, epicache (budget 1024, block 512) vs full KV,
   for histories of growing length: epicache's peak should stay flat, full's grows with the history.
2. Greedy decode speed (forced to a fixed number of tokens, EOS ignored) on the longest history,
   from the compressed cache vs the full one.
3. One `Session.ask` turn split into embed / route / load / decode, after a real `ingest`.

Progress goes to stderr; a markdown section goes to stdout and to `--out`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from _load import Load, checked  # benchmarks/ is on sys.path

from kvchat.answer.session import Answer, Session
from kvchat.config import EPISODE_INSTRUCTION, SYSTEM_PROMPT, CacheConfig, IngestConfig
from kvchat.history.loading import Turn, format_turns
from kvchat.history.synthetic import planted_conversation
from kvchat.ingest.pipeline import ingest
from kvchat.kv.budgets import uniform_budgets
from kvchat.kv.cache import EpisodeCache
from kvchat.kv.forward import forward
from kvchat.kv.prefill import block_prefill
from kvchat.kv.scoring import PatchedPromptScorer
from kvchat.model.encoder import SentenceEncoder
from kvchat.model.llm import ChatLayout, LoadedModel, load_model
from kvchat.store import Store

REPO = Path(__file__).resolve().parents[1]
TEST_MODELS_DIR = REPO / ".venv" / "kvchat-test-models"
DEFAULT_OUT = REPO / "benchmarks" / "results" / "core_loop.md"

BUDGET = 1024
BLOCK = 512
PROMPT_TOKENS = 256  # patched prompt cap (instruction + segment), as EpisodeConfig.prompt_tokens
TURNS_PER_TOPIC = 24
FULL_LENGTHS = (2048, 4096, 8000)  # 8192 is the model window: leave room for a question and answer
QUICK_LENGTHS = (1024, 2048, 4096)
FULL_DECODE_TOKENS = 64
QUICK_DECODE_TOKENS = 16
DECODE_QUESTION = "What did Maya and Tom talk about?"

TURN_HISTORY_TOPICS = 6
TURN_BUDGET = 512


@dataclass(frozen=True)
class TurnPlan:
    turns_per_topic: int  # 28 gives about 2K tokens
    questions: int


FULL_TURNS = TurnPlan(turns_per_topic=28, questions=8)
QUICK_TURNS = TurnPlan(turns_per_topic=12, questions=4)


def log(message: str) -> None:
    print(f"[core_loop {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def mib(nbytes: int) -> float:
    return nbytes / 2**20


# --------------------------------------------------------------------------- inputs


def history_lines(seed: int, topics: int = 6, turns_per_topic: int = TURNS_PER_TOPIC) -> list[str]:
    messages, _ = planted_conversation(seed, topics=topics, turns_per_topic=turns_per_topic)
    return format_turns([Turn(m["role"], m["content"]) for m in messages])


def long_history_ids(lm: LoadedModel, tokens: int) -> torch.Tensor:
    """Rendered planted-fact conversations (seeds 0, 1, ...) concatenated until `tokens` ids, cut there."""
    lines: list[str] = []
    seed = 0
    while True:
        lines += history_lines(seed)
        ids = lm.encode("\n".join(lines))
        if ids.shape[-1] >= tokens:
            return ids[:, :tokens]
        seed += 1


def patched_prompt_ids(lm: LoadedModel, layout: ChatLayout) -> torch.Tensor:
    """Instruction + a segment of the history, cut to PROMPT_TOKENS, in the question slot (like ingest)."""
    cap = max(PROMPT_TOKENS - lm.encode(EPISODE_INSTRUCTION).shape[-1], 16)
    segment = lm.encode("\n".join(history_lines(0)[:40]))[0, :cap].tolist()
    return lm.encode(layout.question(f"{EPISODE_INSTRUCTION}\n\n{lm.decode(segment)}"))


# --------------------------------------------------------------------------- 1. peak entries


@dataclass(frozen=True)
class PrefillRow:
    history_tokens: int
    method: str
    peak: int
    final: int
    nbytes: int
    seconds: float


def run_prefill(
    lm: LoadedModel, prefix: torch.Tensor, context: torch.Tensor, scorer: PatchedPromptScorer | None
) -> tuple[PrefillRow, EpisodeCache]:
    method = "full" if scorer is None else "epicache"
    budgets = None if scorer is None else uniform_budgets(lm.num_layers, BUDGET)
    clock = time.perf_counter()
    with torch.inference_mode():
        result = block_prefill(lm.model, prefix, context, block_size=BLOCK, budgets=budgets, scorer=scorer)
    seconds = time.perf_counter() - clock
    cache = result.cache
    row = PrefillRow(
        int(context.shape[-1]), method, result.peak_layer_entries, max(cache.sizes), cache.nbytes(), seconds
    )
    log(
        f"prefill {method:8s} {row.history_tokens:5d} tokens: peak {row.peak}, final {row.final}, "
        f"{mib(row.nbytes):.1f} MiB, {seconds:.1f} s"
    )
    return row, cache


def bench_prefill(
    lm: LoadedModel, layout: ChatLayout, lengths: tuple[int, ...]
) -> tuple[list[PrefillRow], dict[str, EpisodeCache], int]:
    """Rows for every length and method, the caches of the longest history (for decoding), and the
    patched prompt's length in tokens."""
    prefix = lm.encode(layout.before_conversation)
    history = long_history_ids(lm, max(lengths))
    scorer = PatchedPromptScorer(patched_prompt_ids(lm, layout))
    log(f"prefix {prefix.shape[-1]} tokens, patched prompt {scorer.transient_tokens} tokens")
    rows, longest = [], {}
    for n in lengths:
        for method_scorer in (scorer, None):
            row, cache = run_prefill(lm, prefix, history[:, :n], method_scorer)
            rows.append(row)
            if n == max(lengths):
                longest[row.method] = cache
    return rows, longest, scorer.transient_tokens


# --------------------------------------------------------------------------- 2. decode speed


def forced_decode(lm: LoadedModel, cache: EpisodeCache, prompt: torch.Tensor, new_tokens: int) -> float:
    """Greedy-decode exactly `new_tokens` (EOS ignored) on top of `cache`; seconds of the per-token steps.

    The question prompt is fed first (not timed); the cache is rolled back afterwards.
    """
    mark = cache.checkpoint()
    try:
        with torch.inference_mode():
            logits = forward(lm.model, cache, prompt)
            clock = time.perf_counter()
            for _ in range(new_tokens):
                token = logits[0, -1].argmax().view(1, 1)
                logits = forward(lm.model, cache, token)
            return time.perf_counter() - clock
    finally:
        cache.rollback(mark)


@dataclass(frozen=True)
class DecodeRow:
    method: str
    entries: int
    tokens_per_s: float


def bench_decode(
    lm: LoadedModel, layout: ChatLayout, caches: dict[str, EpisodeCache], new_tokens: int
) -> list[DecodeRow]:
    prompt = lm.encode(layout.question(DECODE_QUESTION))
    rows = []
    for method, cache in caches.items():
        forced_decode(lm, cache, prompt, 4)  # warm-up
        seconds = forced_decode(lm, cache, prompt, new_tokens)
        rows.append(DecodeRow(method, max(cache.sizes), new_tokens / seconds))
        log(f"decode {method:8s} {max(cache.sizes):5d} entries: {new_tokens / seconds:.1f} tokens/s")
    return rows


# --------------------------------------------------------------------------- 3. turn breakdown


@dataclass(frozen=True)
class TurnStats:
    history_tokens: int
    answers: list[Answer]

    def mean(self, key: str, answers: list[Answer] | None = None) -> float:
        values = [a.timings_ms[key] for a in (self.answers if answers is None else answers)]
        return statistics.fmean(values) if values else float("nan")

    @property
    def load_disk(self) -> float:
        return self.mean("load", [a for a in self.answers if not a.reused_cache])

    @property
    def load_resident(self) -> float:
        return self.mean("load", [a for a in self.answers if a.reused_cache])

    @property
    def share(self) -> float:
        overhead = sum(a.timings_ms[k] for a in self.answers for k in ("embed", "route", "load"))
        total = overhead + sum(a.timings_ms["decode"] for a in self.answers)
        return overhead / total


def bench_turns(lm: LoadedModel, home: Path, plan: TurnPlan) -> TurnStats:
    messages, facts = planted_conversation(0, topics=TURN_HISTORY_TOPICS, turns_per_topic=plan.turns_per_topic)
    home.mkdir(parents=True, exist_ok=True)
    history = home / "planted.json"
    history.write_text(json.dumps(messages))
    store = Store(home)
    encoder = SentenceEncoder()
    config = IngestConfig(cache=CacheConfig(budget=TURN_BUDGET, prefill="block"))
    with torch.inference_mode():
        report = ingest(history, name="bench", config=config, store=store, lm=lm, encoder=encoder)
    log(f"ingested {report.history_tokens} tokens into {report.episodes} episodes in {report.seconds:.1f} s")
    record = store.get("bench")

    warm = Session(store, record, lm, encoder)  # warms the encoder and the decode path, then discarded
    warm.ask(facts[0].question, log=False)

    session = Session(store, record, lm, encoder)
    # Each question twice in a row: the repeat reuses the resident cache, the next question usually
    # routes to another episode and loads from disk.
    questions = [facts[i // 2 % len(facts)].question for i in range(plan.questions)]
    answers = []
    with torch.inference_mode():
        for question in questions:
            answer = session.ask(question, log=False)
            answers.append(answer)
            log(
                f"ask ep {answer.episode} reused={answer.reused_cache} {answer.answer_tokens} tokens "
                f"{answer.timings_ms} -> {answer.text[:40]!r}"
            )
    store.close()
    return TurnStats(report.history_tokens, answers)


# --------------------------------------------------------------------------- report


def cpu_name() -> str:
    """The CPU's model name where Linux tells it, else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({platform.processor() or platform.machine()})"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def header(load: Load) -> str:
    return (
        f"Machine: {cpu_name()}, {os.cpu_count()} CPUs, {platform.system()}; torch {torch.__version__} "
        f"with {torch.get_num_threads()} threads; SmolLM2-135M-Instruct (embedded default, float32); "
        f"run {load}; {dt.date.today().isoformat()}."
    )


def prefill_table(rows: list[PrefillRow]) -> list[str]:
    out = [
        "| history tokens | method | peak entries/layer | final entries/layer | cache MiB | prefill s |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r.history_tokens} | {r.method} | {r.peak} | {r.final} | {mib(r.nbytes):.1f} | {r.seconds:.1f} |"
        )
    return out


def decode_table(rows: list[DecodeRow]) -> list[str]:
    by_method = {r.method: r for r in rows}
    reference = by_method.get("full")
    out = ["| cache | entries/layer | tokens/s | ratio vs full |", "|---|---:|---:|---:|"]
    for r in rows:
        ratio = f"{r.tokens_per_s / reference.tokens_per_s:.2f}x" if reference else "-"
        out.append(f"| {r.method} | {r.entries} | {r.tokens_per_s:.1f} | {ratio} |")
    return out


def turn_table(stats: TurnStats) -> list[str]:
    return [
        "| embed ms | route ms | load ms (disk) | load ms (resident) | decode ms | share embed+route+load |",
        "|---:|---:|---:|---:|---:|---:|",
        f"| {stats.mean('embed'):.1f} | {stats.mean('route'):.2f} | {stats.load_disk:.1f} | "
        f"{stats.load_resident:.2f} | {stats.mean('decode'):.0f} | {stats.share:.1%} |",
    ]


def render(
    prefill: list[PrefillRow],
    decode: list[DecodeRow],
    turns: TurnStats,
    *,
    new_tokens: int,
    quick: bool,
    load: Load,
    prompt_tokens: int,
) -> str:
    longest = max(r.history_tokens for r in prefill)
    answer_tokens = statistics.fmean(a.answer_tokens for a in turns.answers)
    reused = sum(a.reused_cache for a in turns.answers)
    lines = [
        "## Core loop benchmark" + (" (quick)" if quick else ""),
        "",
        header(load),
        "",
        f"### Peak KV entries per layer (budget {BUDGET}, block {BLOCK}, patched prompt {prompt_tokens} tokens: "
        f"instruction + segment capped at {PROMPT_TOKENS}, in the question template)",
        "",
        *prefill_table(prefill),
        "",
        f"### Decode speed ({new_tokens} forced greedy tokens on the {longest}-token history)",
        "",
        *decode_table(decode),
        "",
        f"### One turn (`Session.ask`, {turns.history_tokens}-token history, budget {TURN_BUDGET}, "
        f"{len(turns.answers)} questions, {reused} on the resident cache, "
        f"{answer_tokens:.0f} answer tokens on average)",
        "",
        *turn_table(turns),
        "",
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="1K/2K/4K histories, 16 decode tokens, a shorter turn test (smoke run)"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"markdown output (default {DEFAULT_OUT})")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's own choice)"
    )
    return checked(parser, argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    lengths = QUICK_LENGTHS if args.quick else FULL_LENGTHS
    new_tokens = QUICK_DECODE_TOKENS if args.quick else FULL_DECODE_TOKENS
    plan = QUICK_TURNS if args.quick else FULL_TURNS
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvchat-bench-") as tmp:
        home = Path(tmp)
        models_dir = TEST_MODELS_DIR if TEST_MODELS_DIR.is_dir() else home / "models"
        log(f"loading the default model (models dir {models_dir})")
        lm = load_model("default", models_dir)
        layout = ChatLayout.from_tokenizer(lm.tokenizer, SYSTEM_PROMPT)

        prefill_rows, caches, prompt_tokens = bench_prefill(lm, layout, lengths)
        decode_rows = bench_decode(lm, layout, caches, new_tokens)
        caches.clear()
        turns = bench_turns(lm, home / "home", plan)

    markdown = render(
        prefill_rows,
        decode_rows,
        turns,
        new_tokens=new_tokens,
        quick=args.quick,
        load=args.load,
        prompt_tokens=prompt_tokens,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(markdown)
    print(markdown)
    log(f"wrote {args.out}; total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
