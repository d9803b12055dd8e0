"""IndexMem's latent memory: the shipped one against ones retrained under ingest's own eviction (additive or
mass readout).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/indexmem_memory.py residual WEIGHTS... [--names a,b]
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/indexmem_memory.py report --runs NAME=RESULTS.jsonl...

`residual`: the share of the eviction residual each weights file's memory removes on the held-out chunks of
`kvchat train-indexer` (the default recipe: chit-chat, synthetic, calibration; never LoCoMo), measured by
training's own `evaluate_memory` twice: evicting as ingest does (`TrainConfig`'s defaults, which are
`CacheConfig`'s: the indexer blended 1:3 with the block's last 64 queries' attention, a 16-entry window) and
as the memory stage did before it reused ingest's scorer (the indexer alone, a 64-entry window). Writes
benchmarks/results/indexmem_memory_residual.json.
`report`: the LoCoMo table (first-token KL and agreement against full KV, memory on and off) of runs made
by `benchmarks/indexmem.py quality --methods indexmem --out RESULTS.jsonl`, one per weights file (each with
`KVCHAT_HOME` holding that file in its profiles/), into benchmarks/results/indexmem_memory.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from kvchat.config import TrainConfig, default_home
from kvchat.evaluate import ResultsFile, summarize
from kvchat.kv.trained import TrainedIndexMem
from kvchat.llm import load_model
from kvchat.training import capture, evaluate_memory, make_chunks

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
# The memory stage's eviction before it reused ingest's scorer: the indexer alone, a 64-entry window.
INDEXER_ALONE = {"memory_attention_mix": 0.0, "memory_window": 64}


def log(message: str) -> None:
    print(f"[indexmem_memory {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def residual(args) -> None:
    lm = load_model("default", default_home() / "models")
    config = TrainConfig()
    _, held_chunks, sources = make_chunks(lm, config)
    held = [capture(lm, chunk) for chunk in held_chunks]
    log(f"{len(held)} held-out chunks from {', '.join(sources)}")
    evictions = {"ingest": config, "indexer alone (window 64)": dataclasses.replace(config, **INDEXER_ALONE)}
    out = {"held_out_chunks": len(held), "readers": config.memory_queries, "budgets": list(config.memory_budgets),
           "evictions": {k: {f: getattr(v, f) for f in ("memory_attention_mix", "memory_window", "memory_block")}
                         for k, v in evictions.items()}, "weights": {}}
    names = args.names.split(",") if args.names else [p.name for p in args.weights]
    for name, path in zip(names, args.weights, strict=True):
        trained = TrainedIndexMem.load(path)
        rows = {}
        for eviction, train_config in evictions.items():
            clock = time.perf_counter()
            metrics = evaluate_memory(trained.memory, trained.indexer, lm, held, train_config, trained.config)
            rows[eviction] = metrics["residual_removed"] | {"per_layer": metrics["per_layer"]}
            log(f"{name}, evicting as {eviction}: {metrics['residual_removed']} ({time.perf_counter() - clock:.0f} s)")
        out["weights"][name] = {"file": str(path), "data_hash": trained.data_hash, "residual_removed": rows}
    out["threads"] = torch.get_num_threads()
    out["date"] = time.strftime("%Y-%m-%d")
    (RESULTS / "indexmem_memory_residual.json").write_text(json.dumps(out, indent=1) + "\n")


def report(args) -> None:
    budgets = (128, 256, 512)
    lines = ["| memory | " + " | ".join(f"KL @{b}" for b in budgets) + " | "
             + " | ".join(f"agree @{b}" for b in budgets) + " |", "|---|" + "---|" * 2 * len(budgets)]
    for run in args.runs:
        name, path = run.split("=", 1)
        rows = summarize(ResultsFile(Path(path)).records)
        for label, off in ((f"{name}, on", False), (f"{name}, off", True)):
            picked = [next((r for r in rows if r["variant"].startswith(f"indexmem@{b}/")
                            and ("memory=False" in r["variant"]) == off), {}) for b in budgets]
            cells = [f"{r['kl']:.4f}" if r else "–" for r in picked] + [f"{r['agreement']:.3f}" if r else "–"
                                                                         for r in picked]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    text = ("# IndexMem's memory: shipped, retrained under ingest's eviction, mass readout (embedded SmolLM2-135M)\n\n"
            "LoCoMo conv-26 and conv-30 cut to whole sessions within 4096 tokens, 10 questions each (categories "
            "1-4), block 512, block prefill, default layer budgets, uniform heads; first-token KL and agreement "
            "against full KV, means over the 20 questions.\n\n" + "\n".join(lines) + "\n")
    training = RESULTS / "indexmem_training_memory_ingest_eviction.json"
    if training.is_file():
        t = json.loads(training.read_text())
        text += (f"\nretrained: `kvchat train-indexer --stage memory --steps {t['steps']['memory']} --threads 1` "
                 f"on a copy of the shipped file (its indexer; seed 0, the default recipe, data hash "
                 f"{t['data_hash']}), evicting as ingest does; {t['timings_ms']['total'] / 1000:.0f} s "
                 f"(`{training.name}`). Not shipped.\n")
    mass = RESULTS / "indexmem_training_memory_mass.json"
    if mass.is_file():
        t = json.loads(mass.read_text())
        removed = ", ".join(f"{v:.3f} @{k}" for k, v in t["metrics"]["memory"]["residual_removed"].items())
        text += (f"\nmass: the same command with `--memory-readout mass` (the memory's entries join attention's "
                 f"softmax as extra mass, kvchat.kv.latent), same data and recipe (data hash {t['data_hash']}); "
                 f"{t['timings_ms']['total'] / 1000:.0f} s (`{mass.name}`); held-out residual removed {removed}.\n")
    residual_file = RESULTS / "indexmem_memory_residual.json"
    if residual_file.is_file():
        data = json.loads(residual_file.read_text())
        budgets = data["budgets"]
        text += (f"\nShare of the eviction residual the memory removes on the {data['held_out_chunks']} held-out "
                 f"training chunks (training's `residual_removed`, last {data['readers']} tokens reading, all "
                 "layers; negative: the readout adds error), by how the simulated block prefill evicts:\n\n"
                 "| memory | eviction | " + " | ".join(f"@{b}" for b in budgets)
                 + " | worst layer (mean over budgets) |\n"
                 "|---|---|" + "---|" * (len(budgets) + 1) + "\n")
        for name, weights in data["weights"].items():
            for eviction, row in weights["residual_removed"].items():
                text += (f"| {name} | {eviction} | " + " | ".join(f"{row[str(b)]:.3f}" for b in budgets)
                         + f" | {min(row['per_layer']):.3f} |\n")
    (RESULTS / "indexmem_memory.md").write_text(text)
    print(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("residual", "report"))
    parser.add_argument("weights", nargs="*", type=Path, help="residual: IndexMem weights files")
    parser.add_argument("--names", default="", help="residual: a name per weights file, comma-separated")
    parser.add_argument("--runs", nargs="*", default=[], help="report: NAME=RESULTS.jsonl of indexmem.py quality")
    args = parser.parse_args()
    residual(args) if args.what == "residual" else report(args)


if __name__ == "__main__":
    main()
