"""IndexMem on the embedded model: answer quality against full KV, memory on and off, and ingest time.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/indexmem.py [quality|timing|report] [DATA...]
        [--budgets 128,256,512] [--methods indexmem,snapkv,epicache] [--questions 10] [--max-context 4096]
        [--out results.jsonl]

`quality`: `kvchat eval`'s measurement (first-token KL and agreement against full KV, LoCoMo F1, evidence
kept) on docs/benchmarks.md's LoCoMo setting (conv-26 and conv-30 cut to 4096 tokens, 10 questions each) for
indexmem with and without its latent memory, then snapkv and epicache at the same budgets, in that order,
appending to `--out` (a rerun resumes). `timing`: block prefill of one history with full KV, indexmem and
snapkv, interleaved rounds, minimum of each (ingest seconds relative to full prefill). `report`: the
markdown table of both into benchmarks/results/indexmem.md, baseline rows from the same file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from _load import checked  # benchmarks/ is on sys.path

from kvchat.config import SYSTEM_PROMPT, CacheConfig, EvalConfig, IngestConfig, default_home
from kvchat.eval import report as eval_report
from kvchat.eval.evaluate import ResultsFile, Variant, evaluate, qa_sets, skipped
from kvchat.eval.summary import summarize
from kvchat.history.loading import format_turns
from kvchat.ingest.layer_profiles import find_indexmem
from kvchat.kv.budgets import uniform_budgets
from kvchat.kv.latent import LatentMemory
from kvchat.kv.methods import REGISTRY, ScorerInputs
from kvchat.kv.prefill import block_prefill
from kvchat.model.encoder import SentenceEncoder
from kvchat.model.llm import ChatLayout, load_model

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data" / "locomo"
RESULTS = REPO / "benchmarks" / "results"
TIMING = RESULTS / "records" / "indexmem_timing.json"


def log(message: str) -> None:
    print(f"[indexmem {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def grid(budgets: tuple[int, ...]) -> list[Variant]:
    """indexmem with memory, without, then the baselines: the order they run in."""
    base = dataclasses.replace(CacheConfig(), prefill="block")  # as docs/benchmarks.md's LoCoMo table ran
    out = [Variant(dataclasses.replace(base, method="indexmem", budget=b, latent_memory=m))
           for m in (True, False) for b in budgets]
    out += [Variant(dataclasses.replace(base, method=m, budget=b)) for m in ("snapkv", "epicache") for b in budgets]
    return out


def quality(args, lm) -> None:
    config = EvalConfig(max_context=args.max_context, questions=args.questions)
    sets = qa_sets(args.data, 0, lm, config)
    home = default_home()
    variants = [v for v in grid(args.budget_list) if v.cache.method in args.methods.split(",")]
    for qa_set in sets:  # one set at a time, so the first conversation is complete before the second starts
        log(f"{qa_set.describe(config.questions)}; {len(variants)} variants")
        evaluate([qa_set], variants, lm=lm, encoder=SentenceEncoder(), config=config,
                 base=IngestConfig(cache=variants[0].cache), results=ResultsFile(args.out),
                 profile_dirs=[home / "profiles"])


def timing(args, lm, rounds: int = 2, budget: int = 256, block: int = 512) -> None:
    """Block prefill of the first history's kept sessions: full KV vs indexmem vs snapkv, interleaved."""
    config = EvalConfig(max_context=args.max_context, questions=args.questions)
    qa_set = qa_sets(args.data[:1], 0, lm, config)[0]
    layout = ChatLayout.from_tokenizer(lm.tokenizer, SYSTEM_PROMPT)
    prefix, context = lm.encode(layout.before_conversation), lm.encode("\n".join(format_turns(qa_set.turns)))
    cache = CacheConfig(budget=budget, block_size=block)
    trained = find_indexmem(lm, [default_home() / "profiles"])
    budgets = uniform_budgets(lm.num_layers, budget)

    def scorer(method: str):
        return REGISTRY[method].scorer(ScorerInputs(lm.encode, layout, cache, model=lm.model, trained=trained))

    runs = {"full": lambda: block_prefill(lm.model, prefix, context, block_size=block, budgets=None, scorer=None),
            "indexmem": lambda: block_prefill(lm.model, prefix, context, block_size=block, budgets=budgets,
                                              scorer=scorer("indexmem")),
            "indexmem+memory": lambda: block_prefill(
                lm.model, prefix, context, block_size=block, budgets=budgets, scorer=scorer("indexmem"),
                on_evict=LatentMemory(trained.memory, trained.config).writer(lm.model.model.rotary_emb)),
            "snapkv": lambda: block_prefill(lm.model, prefix, context, block_size=block, budgets=budgets,
                                            scorer=scorer("snapkv"))}
    seconds: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(rounds):
        for name, run in runs.items():
            clock = time.perf_counter()
            run()
            seconds[name].append(round(time.perf_counter() - clock, 2))
            log(f"round {r + 1}: {name} {seconds[name][-1]} s")
    result = {
        "history": qa_set.name, "history_tokens": int(context.shape[-1]), "budget": budget, "block": block,
        "threads": torch.get_num_threads(), "seconds": seconds,
        "min_ratio_to_full": {k: round(min(v) / min(seconds["full"]), 2) for k, v in seconds.items()},
        "median_ratio_to_full": {k: round(statistics.median(v) / statistics.median(seconds["full"]), 2)
                                 for k, v in seconds.items()},
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, run {args.load}", "load": args.load.record(),
        "date": time.strftime("%Y-%m-%d"),
    }
    TIMING.write_text(json.dumps(result, indent=1) + "\n")
    log(json.dumps(result))


def pivot(rows: list[dict], budgets: tuple[int, ...]) -> str:
    """KL, agreement, F1 and evidence kept per variant family (rows) and budget (columns)."""
    by_key = {r["variant"]: r for r in rows}
    families = [("indexmem, memory on", "indexmem", False), ("indexmem, memory off", "indexmem", True),
                ("snapkv", "snapkv", False), ("epicache", "epicache", False)]
    metrics = (("kl", "KL", "{:.3f}"), ("agreement", "agree", "{:.3f}"), ("f1", "F1", "{:.3f}"),
               ("evidence_kept", "evidence", "{:.2f}"))
    head = " | ".join(f"{label} @{b}" for _, label, _ in metrics for b in budgets)
    lines = [f"| method | {head} |", "|---|" + "---|" * len(metrics) * len(budgets)]
    for label, method, memory_off in families:
        cells = []
        for key, _, fmt in metrics:
            for b in budgets:
                row = next((r for v, r in by_key.items() if v.startswith(f"{method}@{b}/")
                            and ("memory=False" in v) == memory_off), {})
                cells.append(eval_report.cell(row, key, fmt))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_report(args) -> None:
    records = ResultsFile(args.out).records
    rows = summarize(records)
    text = eval_report.markdown(rows, title="IndexMem vs full KV (embedded SmolLM2-135M)", notes=[
        f"{', '.join(p.stem for p in args.data)} cut to whole sessions within {args.max_context} tokens, "
        f"{args.questions} questions each (categories 1-4); block 512, block prefill, default layer budgets "
        "(the shipped sensitivity profile), uniform heads",
        *[f"{key} on {name} skipped: {reason}" for (name, key), reason in skipped(records).items()],
    ])
    text += "\nBy method and budget:\n\n" + pivot(rows, args.budget_list)
    if TIMING.is_file():
        t = json.loads(TIMING.read_text())
        text += (f"\nBlock prefill of {t['history']} ({t['history_tokens']} tokens, budget {t['budget']}, block "
                 f"{t['block']}, {t['threads']} thread(s), {t['machine']}): seconds per round "
                 f"{t['seconds']}; minimum relative to full KV {t['min_ratio_to_full']}.\n")
    (RESULTS / "indexmem.md").write_text(text)
    print(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("quality", "timing", "report"))
    parser.add_argument("data", nargs="*", type=Path, default=[SHARED / "conv-26.json", SHARED / "conv-30.json"])
    parser.add_argument("--max-context", type=int, default=4096)
    parser.add_argument("--questions", type=int, default=10)
    parser.add_argument("--budgets", default="128,256,512")
    parser.add_argument("--methods", default="indexmem,snapkv,epicache", help="quality: which of the grid to run")
    parser.add_argument("--out", type=Path, default=RESULTS / "records" / "indexmem.jsonl")
    args = checked(parser, skip=lambda a: a.what == "report")
    args.budget_list = tuple(int(b) for b in args.budgets.split(","))
    if args.what == "report":
        write_report(args)
        return
    log(f"run {args.load}")  # quality's records are kvchat eval's: the load is in this log only
    lm = load_model("default", default_home() / "models")
    quality(args, lm) if args.what == "quality" else timing(args, lm)


if __name__ == "__main__":
    main()
