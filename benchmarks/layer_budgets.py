"""Where the budget goes: layer-budget strategies x head-budget modes x budgets, against full KV.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/layer_budgets.py [DATA...] [--max-context N]
        [--questions N] [--budgets 256,512,1024] [--out results.jsonl] [--report report.md]

For the embedded model, epicache caches built with uniform, sensitivity, pyramid and cake layer budgets,
each with uniform and adaptive (AdaKV) head budgets, at each budget; every question is answered from
each and compared with full KV: KL(full || variant) of the first answer token and the agreement of the
answers (EpiCache Fig. 4b reports sensitivity budgets lowering that KL vs uniform). It is `kvchat eval`
with a different grid, so results resume the same way. The defaults reproduce docs/benchmarks.md's table
(about half an hour a conversation on 2 CPUs).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

from _load import checked  # benchmarks/ is on sys.path

from kvchat.config import CacheConfig, EvalConfig, IngestConfig, default_home
from kvchat.eval import report
from kvchat.eval.evaluate import ResultsFile, Variant, evaluate, qa_sets, skipped
from kvchat.eval.summary import summarize
from kvchat.model.encoder import SentenceEncoder
from kvchat.model.llm import load_model

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data" / "locomo"
RESULTS = REPO / "benchmarks" / "results"
STRATEGIES = ("uniform", "sensitivity", "pyramid", "cake")
HEAD_MODES = ("uniform", "adaptive")


def grid(budgets: tuple[int, ...], method: str = "epicache") -> list[Variant]:
    """Every strategy x head mode x budget; the variant key names both (they differ from the defaults
    or are forced into it below)."""
    out = []
    for budget in budgets:
        for strategy in STRATEGIES:
            for heads in HEAD_MODES:
                cache = dataclasses.replace(
                    CacheConfig(prefill="block"), method=method, budget=budget, layer_budgets=strategy,
                    head_budgets=heads,
                )
                out.append(Variant(cache))
    return out


def pivot(rows: list[dict], variants: list[Variant], budgets: tuple[int, ...]) -> str:
    """KL and agreement per layer strategy x head mode (rows) and budget (columns): docs/benchmarks.md's table."""
    by_key = {r["variant"]: r for r in rows}
    kl = " | ".join(f"KL @{b}" for b in budgets)
    agreement = " | ".join(f"agree @{b}" for b in budgets)
    lines = [f"| layer budgets | heads | {kl} | {agreement} |", "|---|---|" + "---|" * 2 * len(budgets)]
    for strategy in STRATEGIES:
        for heads in HEAD_MODES:
            cells = {v.cache.budget: by_key.get(v.key) for v in variants
                     if (v.cache.layer_budgets, v.cache.head_budgets) == (strategy, heads)}
            values = [report.cell(cells.get(b) or {}, key, "{:.3f}") for key in ("kl", "agreement") for b in budgets]
            lines.append(f"| {strategy} | {heads} | " + " | ".join(values) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", nargs="*", type=Path, default=[SHARED / "conv-30.json", SHARED / "conv-26.json"])
    parser.add_argument("--max-context", type=int, default=2048)
    parser.add_argument("--questions", type=int, default=5, help="per conversation")
    parser.add_argument("--budgets", default="256,512,1024")
    parser.add_argument("--out", type=Path, default=RESULTS / "records" / "layer_budgets.jsonl")
    parser.add_argument("--report", type=Path, default=RESULTS / "layer_budgets.md")
    args = checked(parser)

    home = default_home()
    lm = load_model("default", home / "models")
    config = EvalConfig(max_context=args.max_context, questions=args.questions)
    sets = qa_sets(args.data, 0, lm, config)
    budgets = tuple(int(b) for b in args.budgets.split(","))
    variants = grid(budgets)
    records = evaluate(
        sets, variants, lm=lm, encoder=SentenceEncoder(), config=config, base=IngestConfig(),
        results=ResultsFile(args.out), profile_dirs=[home / "profiles"],
    )
    rows = summarize(records)
    notes = [s.describe(config.questions) for s in sets]
    notes.append(f"embedded model; epicache; --max-context {args.max_context}; {os.cpu_count()} CPUs; the last run "
                 f"(records resumed from earlier runs are not timed again) {args.load}")
    notes += [f"{key} skipped: {reason}" for (_, key), reason in skipped(records).items()]
    table = pivot(rows, variants, budgets)
    text = report.markdown(rows, title="Layer and head budgets vs full KV", notes=notes)
    args.report.write_text(f"{text}\nBy strategy and budget:\n\n{table}")
    print(text)


if __name__ == "__main__":
    main()
